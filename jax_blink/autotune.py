"""Run-time tuning of the pipelining chunk, as Blink does it: multiplicative increase, additive
decrease (MIAD), keeping the best chunk measured.

The chunk is part of the schedule program, fixed when ``jit`` traces, so tuning cannot happen inside
a call: :func:`tune_chunk` times real programs at a few chunks and stores the best one per size
class in a cache (memory plus a JSON file); ``config.chunk_bytes = "auto"`` then makes every later
trace read that cache (:func:`lookup`) and never time anything itself.

Cache file: ``$JAX_BLINK_TUNING_CACHE``, by default ``~/.cache/jax_blink/chunks.json``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import threading
import warnings
from collections.abc import Callable

import jax.numpy as jnp

from .schedule import ALIGN_BYTES, DEFAULT_CHUNK_BYTES

CACHE_ENV = "JAX_BLINK_TUNING_CACHE"
_FORMAT = 1

# ---------------------------------------------------------------------------------------------
# The search.


@dataclasses.dataclass
class MiadResult:
    """The best chunk found, its throughput, the step of the additive decrease, and every trial
    ``(chunk_bytes, throughput)`` in the order measured."""

    chunk_bytes: int
    throughput: float
    backoff: int
    log: list[tuple[int, float]]


def _down(b: float) -> int:
    # Chunks are whole 16-byte units: the schedule aligns segments (and so chunks) to 16 bytes.
    return int(b) // ALIGN_BYTES * ALIGN_BYTES


def _up(b: float) -> int:
    return -(-int(math.ceil(b)) // ALIGN_BYTES) * ALIGN_BYTES


def _score(t: float) -> float:
    # A failed or nonsense measurement (NaN) never counts as an improvement.
    return t if t == t else -math.inf


def miad(measure: Callable[[int], float], start: int, *, lo: int, hi: int, grow: float = 2,
         backoff: int | None = None, max_trials: int = 12) -> MiadResult:
    """Search the chunk (bytes) that maximizes ``measure(chunk) -> throughput``.

    From ``start`` (clamped to [lo, hi]) multiply by ``grow`` while throughput rises; after the first
    step that does not improve, return to the best and subtract ``backoff`` (default: a quarter of
    that best) while that improves. Stops when neither direction improves, at the bounds, or after
    ``max_trials`` measurements. Every chunk is a multiple of 16 bytes within [lo, hi], and none is
    measured twice. Pure: all it knows of the world is ``measure``.
    """
    lo_, hi_ = max(ALIGN_BYTES, _up(lo)), _down(hi)
    if lo_ > hi_:
        raise ValueError(f"no 16-byte multiple in [lo, hi] = [{lo}, {hi}]")
    if not grow > 1:
        raise ValueError(f"grow must be > 1, got {grow}")
    if max_trials < 1:
        raise ValueError(f"max_trials must be >= 1, got {max_trials}")

    def clamp(c: int) -> int:
        return min(hi_, max(lo_, c))

    seen: dict[int, float] = {}
    log: list[tuple[int, float]] = []

    def trial(c: int) -> float | None:
        if c in seen:
            return seen[c]
        if len(log) >= max_trials:
            return None
        t = float(measure(c))
        seen[c] = t
        log.append((c, t))
        return t

    best = clamp(_down(start))
    best_t = trial(best)
    while True:  # multiplicative increase (at least one 16-byte unit, so that it always moves)
        c = clamp(max(_down(best * grow), best + ALIGN_BYTES))
        t = trial(c) if c != best else None
        if t is None or not _score(t) > _score(best_t):
            break
        best, best_t = c, t
    step = max(ALIGN_BYTES, _down(best / 4 if backoff is None else backoff))
    while True:  # additive decrease from the best
        c = clamp(best - step)
        t = trial(c) if c != best else None
        if t is None or not _score(t) > _score(best_t):
            break
        best, best_t = c, t
    return MiadResult(best, best_t, step, log)


# ---------------------------------------------------------------------------------------------
# The cache: (device kind, ranks, collective, dtype, size class) -> chunk bytes.

Key = tuple[str, int, str, str, int]
_FIELDS = ("device_kind", "nranks", "collective", "dtype", "size_class")

_lock = threading.Lock()
_entries: dict[Key, int] = {}
_loaded_from: str | None = None


def cache_path() -> str:
    """Where the cache file is: ``$JAX_BLINK_TUNING_CACHE`` or ``~/.cache/jax_blink/chunks.json``."""
    return os.environ.get(CACHE_ENV) or os.path.join(
        os.path.expanduser("~"), ".cache", "jax_blink", "chunks.json")


def size_class(nbytes: int) -> int:
    """Sizes within a factor of two share a tuned chunk: the class is ``nbytes.bit_length()``."""
    return int(nbytes).bit_length()


def key(device_kind: str, nranks: int, collective: str, dtype, nbytes: int) -> Key:
    """The cache key of a call. ``nbytes``: the bytes of the operand the schedule covers, per rank
    (for ``allgather`` the gathered buffer, ``n`` times the input)."""
    return (str(device_kind), int(nranks), str(collective), jnp.dtype(dtype).name, size_class(nbytes))


def _read(path: str) -> dict[Key, int]:
    """The entries of the file at ``path``; a missing file is empty, and so is a corrupt one."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        warnings.warn(f"jax_blink: ignoring the unreadable tuning cache {path}: {e}", RuntimeWarning,
                      stacklevel=3)
        return {}
    out: dict[Key, int] = {}
    entries = doc.get("entries") if isinstance(doc, dict) else None
    for e in entries if isinstance(entries, list) else []:
        try:
            k = (str(e["device_kind"]), int(e["nranks"]), str(e["collective"]), str(e["dtype"]),
                 int(e["size_class"]))
            chunk = int(e["chunk_bytes"])
        except (TypeError, KeyError, ValueError):
            continue  # one bad entry does not spoil the others
        if chunk >= ALIGN_BYTES:
            out[k] = chunk
    return out


def _write(path: str, entries: dict[Key, int]) -> None:
    # Atomic: readers (other processes tracing with "auto") see the old file or the new one.
    doc = {"format": _FORMAT, "entries": [dict(zip(_FIELDS, k), chunk_bytes=v)
                                          for k, v in sorted(entries.items())]}
    folder = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".chunks-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        warnings.warn(f"jax_blink: could not write the tuning cache {path} ({e}); the tuned chunk "
                      "is kept in memory only", RuntimeWarning, stacklevel=3)


def _loaded() -> dict[Key, int]:
    # Lazily, and again when the path changes (the environment variable was set after a lookup).
    global _entries, _loaded_from
    path = cache_path()
    if _loaded_from != path:
        _entries, _loaded_from = _read(path), path
    return _entries


def lookup(device_kind: str | None, nranks: int, collective: str, dtype, nbytes: int) -> int | None:
    """The tuned chunk (bytes) of this call's class, or None where nothing was tuned for it."""
    if device_kind is None:
        return None
    with _lock:
        return _loaded().get(key(device_kind, nranks, collective, dtype, nbytes))


def store(device_kind: str, nranks: int, collective: str, dtype, nbytes: int, chunk_bytes: int) -> None:
    """Remember ``chunk_bytes`` for this call's class, in memory and in the cache file (merged with
    what other processes wrote there since it was loaded)."""
    if int(chunk_bytes) < ALIGN_BYTES:
        raise ValueError(f"chunk_bytes must be >= {ALIGN_BYTES}, got {chunk_bytes}")
    global _entries
    k = key(device_kind, nranks, collective, dtype, nbytes)
    with _lock:
        path = cache_path()
        # The file's entries win over older ones in memory; ours are kept where the file lacks them.
        merged = {**_loaded(), **_read(path), k: int(chunk_bytes)}
        _entries = merged
        _write(path, merged)


def reload() -> None:
    """Forget the entries in memory: the next lookup reads the file again."""
    global _loaded_from
    with _lock:
        _loaded_from = None


# ---------------------------------------------------------------------------------------------
# Measuring the real thing.

def tune_chunk(collective: str, x, mesh, axis: str, *, k: int = 20, runs: int = 5, lo: int = 4096,
               hi: int = 16 << 20, start: int | None = None) -> MiadResult:
    """Find the best chunk for ``collective`` over ``x`` (sharded along ``axis`` of ``mesh``, as in
    ``python -m jax_blink.bench``) by timing chains of ``k`` calls through the executor; store it in
    the cache for ``config.chunk_bytes = "auto"`` and return the search.

    Throughput is the bench's ``size`` (bytes per rank a call moves) over the time per call. The
    upper bound is lowered to the operand's size: a larger chunk gives the same program.
    """
    # bench imports this module (for --tune-chunks): import it when it is needed, not at the top.
    from . import bench

    if collective not in bench.COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; supported: {sorted(bench.COLLECTIVES)}")
    coll = bench.COLLECTIVES[collective]
    n = mesh.shape[axis]
    per_rank = x.nbytes // n
    moved = per_rank * coll.size_factor(n)
    program_bytes = per_rank * (n if collective == "allgather" else 1)  # what _collective_call sees
    hi = max(lo, min(hi, _up(program_bytes)))
    step = coll.chain(coll.ours)

    def measure(chunk: int) -> float:
        fn = bench._chained(step, mesh, axis, k, chunk_bytes=chunk, dispatch="blink")
        return moved / (bench.median_time(fn, x, runs) / k)

    res = miad(measure, DEFAULT_CHUNK_BYTES if start is None else start, lo=lo, hi=hi)
    store(mesh.devices.flat[0].device_kind, n, collective, x.dtype, program_bytes, res.chunk_bytes)
    return res
