"""Run-time options of jax_blink, read from the environment once and changeable in code.

``JAX_BLINK_TIMEOUT_S``   budget of every wait inside a collective (default 10 s)
``JAX_BLINK_CHUNK_BYTES`` pipelining chunk in bytes (default: the schedule's); ``auto``: the chunk
                          that ``jax_blink.autotune.tune_chunk`` measured best for this device
                          kind, rank count, collective, dtype and size class, where it has one
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
import operator
import os

_FALLBACKS = ("warn", "raise", "silent")
_DISPATCH = ("auto", "blink", "lax")
#: ``chunk_bytes`` value that means: the tuned chunk from the cache of :mod:`jax_blink.autotune`.
AUTO = "auto"


def check_chunk_bytes(value) -> None:
    """Raise ValueError unless ``value`` is None, ``"auto"`` or a whole number of bytes >= 16."""
    if value is None or value == AUTO:
        return
    if isinstance(value, str):
        raise ValueError(f"chunk_bytes must be a number of bytes >= 16, {AUTO!r} or None, got {value!r}")
    try:
        if isinstance(value, bool):
            raise TypeError
        v = operator.index(value)
    except TypeError:
        raise ValueError(f"chunk_bytes must be a whole number of bytes >= 16, {AUTO!r} or None, "
                         f"got {value!r}") from None
    if v < 16:
        raise ValueError(f"chunk_bytes must be >= 16 (or {AUTO!r} or None), got {value}")


@dataclasses.dataclass
class Options:
    timeout_s: float = 10.0
    chunk_bytes: int | str | None = None  # bytes, "auto" (tuned, jax_blink.autotune) or None
    fallback: str = "warn"
    command_buffers: bool = False
    dispatch: str = "auto"

    def validate(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        check_chunk_bytes(self.chunk_bytes)
        if self.dispatch not in _DISPATCH:
            raise ValueError(f"dispatch must be one of {_DISPATCH}, got {self.dispatch!r}")
        if self.fallback not in _FALLBACKS:
            raise ValueError(f"fallback must be one of {_FALLBACKS}, got {self.fallback!r}")


def _from_env() -> Options:
    o = Options()
    if "JAX_BLINK_TIMEOUT_S" in os.environ:
        o.timeout_s = float(os.environ["JAX_BLINK_TIMEOUT_S"])
    if "JAX_BLINK_CHUNK_BYTES" in os.environ:
        text = os.environ["JAX_BLINK_CHUNK_BYTES"].strip()
        if text.lower() == AUTO:
            o.chunk_bytes = AUTO
        else:
            try:
                o.chunk_bytes = int(text)
            except ValueError:
                raise ValueError(f"JAX_BLINK_CHUNK_BYTES must be a number of bytes or {AUTO!r}, "
                                 f"got {text!r}") from None
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
