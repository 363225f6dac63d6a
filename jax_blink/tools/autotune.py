"""Run-time tuning of the pipelining chunk, as Blink does it: multiplicative increase, additive
decrease (MIAD), keeping the best chunk measured. A tool: nothing on the call path imports it.

The chunk is part of the schedule program, fixed when ``jit`` traces, so tuning cannot happen inside
a call: :func:`tune_chunk` times real programs at a few chunks (with the bench's timing helpers) and
stores the best one per size class in :mod:`jax_blink.lowering.chunk_cache`; ``config.chunk_bytes = "auto"``
then makes every later trace read that cache and never time anything itself.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from jax_blink.lowering.chunk_cache import store
# The cache's API, as the tools (bench --tune-chunks) have always reached it through this module.
from jax_blink.lowering.chunk_cache import CACHE_ENV, cache_path, key, lookup, reload, size_class  # noqa: F401
from jax_blink.planning.schedule import ALIGN_BYTES, DEFAULT_CHUNK_BYTES
from jax_blink.tools import timing

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
# Measuring the real thing.

def tune_chunk(collective: str, x, mesh, axis: str, *, k: int = 20, runs: int = 5, lo: int = 4096,
               hi: int = 16 << 20, start: int | None = None) -> MiadResult:
    """Find the best chunk for ``collective`` over ``x`` (sharded along ``axis`` of ``mesh``, as in
    ``python -m jax_blink.tools.bench``) by timing chains of ``k`` calls through the executor; store it in
    the cache for ``config.chunk_bytes = "auto"`` and return the search.

    Throughput is the bench's ``size`` (bytes per rank a call moves) over the time per call. The
    upper bound is lowered to the operand's size: a larger chunk gives the same program.
    """
    if collective not in timing.COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; supported: {sorted(timing.COLLECTIVES)}")
    coll = timing.COLLECTIVES[collective]
    n = mesh.shape[axis]
    per_rank = x.nbytes // n
    moved = per_rank * coll.size_factor(n)
    program_bytes = per_rank * (n if collective == "allgather" else 1)  # what _collective_call sees
    hi = max(lo, min(hi, _up(program_bytes)))
    step = coll.chain(coll.ours)

    def measure(chunk: int) -> float:
        fn = timing.chained(step, mesh, axis, k, chunk_bytes=chunk, dispatch="blink")
        return moved / (timing.median_time(fn, x, runs) / k)

    res = miad(measure, DEFAULT_CHUNK_BYTES if start is None else start, lo=lo, hi=hi)
    store(mesh.devices.flat[0].device_kind, n, collective, x.dtype, program_bytes, res.chunk_bytes)
    return res
