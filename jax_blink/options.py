"""Run-time options of jax_blink, read from the environment once and changeable in code.

``JAX_BLINK_TIMEOUT_S``   budget of every wait inside a collective (default 10 s)
``JAX_BLINK_CHUNK_BYTES`` pipelining chunk in bytes (65536, 512K, 16M; default: the schedule's); ``auto``: the chunk
                          that ``jax_blink.autotune.tune_chunk`` measured best for this device
                          kind, rank count, collective, dtype and size class, where it has one
``JAX_BLINK_COMMAND_BUFFERS`` ``1``: lower to the handler that XLA may capture in CUDA graphs
                          (the first call of each call site must run uncaptured)
``JAX_BLINK_DISPATCH``    ``auto`` (default): ``all_reduce`` uses ``lax.psum`` where that was measured
                          faster (jax_blink/tuning.py); ``blink``: always the executor; ``lax``: never
``JAX_BLINK_FALLBACK``    ``warn`` (default): use ``lax`` collectives with one warning where no
                          executor can run (no peer access, no CUDA build, several processes);
                          ``raise``: refuse;
                          ``silent``: fall back without a word.
"""
from __future__ import annotations

import contextlib
import dataclasses
import operator
import os

_FALLBACKS = ("warn", "raise", "silent")
MAX_TIMEOUT_S = 1e6  # the budget travels in milliseconds as an int64 attribute; 11 days is plenty
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
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:  # also refuses nan and inf
            raise ValueError(f"timeout_s must be > 0 and at most {MAX_TIMEOUT_S:g} seconds, got {self.timeout_s}")
        check_chunk_bytes(self.chunk_bytes)
        if self.dispatch not in _DISPATCH:
            raise ValueError(f"dispatch must be one of {_DISPATCH}, got {self.dispatch!r}")
        if self.fallback not in _FALLBACKS:
            raise ValueError(f"fallback must be one of {_FALLBACKS}, got {self.fallback!r}")


_UNITS = {"": 0, "k": 10, "m": 20, "g": 30}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def parse_byte_count(text: str) -> int:
    """``"65536"``, ``"512K"``, ``"16M"``, ``"1G"`` (binary units, any case) -> bytes, as the CUDA
    executor reads its byte-count variables; ValueError for anything else."""
    digits, unit = (text[:-1], text[-1:].lower()) if text[-1:].isalpha() else (text, "")
    if not digits.isdigit() or not digits.isascii() or unit not in _UNITS \
            or int(digits) << _UNITS[unit] >= 1 << 63:
        raise ValueError(f"not a byte count: {text!r} (examples: 65536, 512K, 16M, 1G)")
    return int(digits) << _UNITS[unit]


def _from_env() -> Options:
    o = Options()
    # An empty variable counts as unset, as the CUDA executor reads its own.
    env = {k: v for k, v in os.environ.items() if k.startswith("JAX_BLINK_") and v}
    if "JAX_BLINK_TIMEOUT_S" in env:
        try:
            o.timeout_s = float(env["JAX_BLINK_TIMEOUT_S"])
        except ValueError:
            raise ValueError(f"JAX_BLINK_TIMEOUT_S must be a number of seconds > 0, "
                             f"got {env['JAX_BLINK_TIMEOUT_S']!r}") from None
    if "JAX_BLINK_CHUNK_BYTES" in env:
        text = env["JAX_BLINK_CHUNK_BYTES"].strip()
        if text.lower() == AUTO:
            o.chunk_bytes = AUTO
        else:
            try:
                o.chunk_bytes = parse_byte_count(text)
            except ValueError:
                raise ValueError(f"JAX_BLINK_CHUNK_BYTES must be a number of bytes (65536, 512K, 16M) "
                                 f"or {AUTO!r}, got {text!r}") from None
    if "JAX_BLINK_DISPATCH" in env:
        o.dispatch = env["JAX_BLINK_DISPATCH"].strip().lower()
    if "JAX_BLINK_COMMAND_BUFFERS" in env:
        flag = env["JAX_BLINK_COMMAND_BUFFERS"].strip().lower()
        if flag not in _TRUE + _FALSE:  # "" never gets here: empty is unset
            raise ValueError(f"JAX_BLINK_COMMAND_BUFFERS must be 1/true/yes/on or 0/false/no/off, "
                             f"got {env['JAX_BLINK_COMMAND_BUFFERS']!r}")
        o.command_buffers = flag in _TRUE
    if "JAX_BLINK_FALLBACK" in env:
        o.fallback = env["JAX_BLINK_FALLBACK"].strip().lower()
    try:
        o.validate()
    except ValueError as e:  # name the variable: the value came from the environment
        raise ValueError(f"from the JAX_BLINK_* environment: {e}") from None
    return o


#: The options in force. Values are read at trace time: change them before ``jit`` traces.
config = _from_env()


@contextlib.contextmanager
def override(**fields):
    """Set ``config`` fields for the duration of a ``with`` block (options are read when ``jit``
    traces: trace inside the block), restoring them after."""
    saved = {k: getattr(config, k) for k in fields}
    try:
        for k, v in fields.items():
            setattr(config, k, v)
        yield config
    finally:
        for k, v in saved.items():
            setattr(config, k, v)
