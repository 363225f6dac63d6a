"""Tensor-parallel decoding with jax_blink: ``python -m jax_blink.tools.decode`` (a tool above the
library; nothing in the library imports it).

:mod:`.model` (a Llama-shaped decoder, ``shard_map`` over a ``"tp"`` axis, a KV cache, random
bfloat16 weights), :mod:`.bench` (decode steps of each all-reduce variant timed in turns, checked
against ``lax.psum``, written as CSV, JSON and PNG), :mod:`.__main__` (the command).
"""
