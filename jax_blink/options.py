"""Run-time options of jax_blink, read from the environment once and changeable in code.

``JAX_BLINK_TIMEOUT_S``   budget of every wait inside a collective (default 10 s)
``JAX_BLINK_CHUNK_BYTES`` pipelining chunk (default: the schedule's)
``JAX_BLINK_COMMAND_BUFFERS`` ``1``: lower to the handler that XLA may capture in CUDA graphs
                          (the first call of each call site must run uncaptured)
``JAX_BLINK_DISPATCH``    ``auto`` (default): ``all_reduce`` uses ``lax.psum`` where that was measured
                          faster (jax_blink/tuning.py); ``blink``: always the executor; ``lax``: never
``JAX_BLINK_FALLBACK``    ``warn`` (default): use ``lax`` collectives with one warning where no
                          executor can run (no peer access, no CUDA build); ``raise``: refuse;
                          ``silent``: fall back without a word.
"""
from __future__ import annotations

import dataclasses
import os

_FALLBACKS = ("warn", "raise", "silent")
_DISPATCH = ("auto", "blink", "lax")


@dataclasses.dataclass
class Options:
    timeout_s: float = 10.0
    chunk_bytes: int | None = None
    fallback: str = "warn"
    command_buffers: bool = False
    dispatch: str = "auto"

    def validate(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.chunk_bytes is not None and self.chunk_bytes < 16:
            raise ValueError(f"chunk_bytes must be >= 16 (or None), got {self.chunk_bytes}")
        if self.dispatch not in _DISPATCH:
            raise ValueError(f"dispatch must be one of {_DISPATCH}, got {self.dispatch!r}")
        if self.fallback not in _FALLBACKS:
            raise ValueError(f"fallback must be one of {_FALLBACKS}, got {self.fallback!r}")


def _from_env() -> Options:
    o = Options()
    if "JAX_BLINK_TIMEOUT_S" in os.environ:
        o.timeout_s = float(os.environ["JAX_BLINK_TIMEOUT_S"])
    if "JAX_BLINK_CHUNK_BYTES" in os.environ:
        o.chunk_bytes = int(os.environ["JAX_BLINK_CHUNK_BYTES"])
    if "JAX_BLINK_DISPATCH" in os.environ:
        o.dispatch = os.environ["JAX_BLINK_DISPATCH"]
    if "JAX_BLINK_COMMAND_BUFFERS" in os.environ:
        o.command_buffers = os.environ["JAX_BLINK_COMMAND_BUFFERS"].lower() in ("1", "true", "yes")
    if "JAX_BLINK_FALLBACK" in os.environ:
        o.fallback = os.environ["JAX_BLINK_FALLBACK"]
    o.validate()
    return o


#: The options in force. Values are read at trace time: change them before ``jit`` traces.
config = _from_env()
