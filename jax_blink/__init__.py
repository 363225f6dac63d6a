"""jax_blink: Blink-style collectives for JAX.

Probe the links between the devices of a mesh axis, pack spanning trees into that graph with
OR-Tools at trace time, and run them as an XLA custom call.
"""
