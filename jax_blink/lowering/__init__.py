"""Layer 2, lowering: whether a call runs on jax_blink's executor or XLA's collective, the custom
call that carries a plan's program, the executors' registration, and ranks in several processes
or on several hosts."""
