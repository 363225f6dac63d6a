"""Layer 4, the public API: the collectives, ``explain`` and gradient buckets
(re-exported by ``jax_blink``)."""
