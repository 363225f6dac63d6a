"""Timing and checking collectives side by side: chains of calls, interleaved runs, medians and
spreads, and the table of jax_blink's collectives with their ``lax`` references. Shared by the
bench, the chunk search and the demo."""
from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_blink.api import collectives
from jax_blink.options import override

#: How far a result may stray from ``lax``'s for each dtype (rounding of a different order of sums).
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3, "float64": 1e-12}


def chained(fn, mesh, axis: str, k: int, **overrides):
    """``k`` calls of ``fn(v, axis)`` in a row, each on the last one's result, as one jitted
    shard_map over ``axis`` of ``mesh``, with the options ``overrides`` set while it traces."""
    def body(v):
        with override(**overrides):
            for _ in range(k):
                v = fn(v, axis)
        return v
    spec = P(axis)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))


class Ready:
    """A pytree of results as one result for :func:`interleaved_times`, which waits on
    ``result.block_until_ready()``: waits on every array of the tree."""

    def __init__(self, tree):
        self.tree = tree

    def block_until_ready(self):
        return jax.block_until_ready(self.tree)


def interleaved_times(fns: list, x, runs: int, min_seconds: float = 0.0,
                      max_runs: int = 200) -> list[list[float]]:
    """Wall times of each of ``fns`` on ``x``, the functions taking turns (one run each per round,
    the order reversed every other round) so that a drift of the machine falls on all of them
    alike. After compiling and one warm-up run each: at least ``runs`` rounds, and more (up to
    ``max_runs``) until every function has run for ``min_seconds`` in all: small sizes, whose
    programs take microseconds and whose times scatter most, get many more samples for free."""
    for fn in fns:
        fn(x).block_until_ready()  # compile + warm up
        fn(x).block_until_ready()
    times: list[list[float]] = [[] for _ in fns]
    rounds = 0
    while rounds < runs or (rounds < max_runs and min(sum(t) for t in times) < min_seconds):
        order = range(len(fns)) if rounds % 2 == 0 else reversed(range(len(fns)))
        for i in order:
            t0 = time.perf_counter()
            fns[i](x).block_until_ready()
            times[i].append(time.perf_counter() - t0)
        rounds += 1
    return times


def runs_executor(fn: Callable, x) -> bool:
    """Whether the compiled program of ``fn(x)`` holds jax_blink's custom call (the executor runs
    it, in one process or through CUDA IPC), rather than XLA's own collective."""
    from jax_blink.lowering.backends import TARGET  # every executor target's name starts with it

    return TARGET in fn.lower(x).as_text()


def run_times(fn, x, runs: int) -> list[float]:
    """Wall times of ``runs`` runs of ``fn(x)``, after compiling and one warm-up run."""
    return interleaved_times([fn], x, runs)[0]


def median_time(fn, x, runs: int) -> float:
    """Median wall time of ``fn(x)`` over ``runs`` runs, after compiling and one warm-up run."""
    return statistics.median(run_times(fn, x, runs))


def spread(times: list[float]) -> float:
    """How much the runs disagree: (75th - 25th percentile) / median (0 for fewer than 4 runs)."""
    if len(times) < 4:
        return 0.0
    q = statistics.quantiles(times, n=4)
    return (q[2] - q[0]) / statistics.median(times)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the bench: ours and its lax reference (one call each), how a call's
    output feeds the next call of a chain, nccl-tests' bus-bandwidth factor, and the bytes a call
    moves per rank for the bandwidth (nccl-tests: the larger of input and output)."""

    ours: Callable
    ref: Callable
    chain: Callable  # (one call's function) -> a step with the input's shape
    bus_factor: Callable[[int], float]
    size_factor: Callable[[int], int]
    replicated: bool  # every rank must end with the same bits
    divisible: bool = False  # the per-rank count must be a multiple of the rank count


def _same(f):
    return f


COLLECTIVES = {
    "allreduce": Collective(
        lambda v, a: collectives.all_reduce(v, a), lambda v, a: lax.psum(v, a), _same,
        lambda n: 2 * (n - 1) / n, lambda n: 1, True),
    "broadcast": Collective(
        lambda v, a: collectives.broadcast(v, a, root=0),
        lambda v, a: lax.psum(jnp.where(lax.axis_index(a) == 0, v, jnp.zeros_like(v)), a), _same,
        lambda n: 1.0, lambda n: 1, True),
    "reduce": Collective(
        lambda v, a: collectives.reduce(v, a, root=0),
        lambda v, a: jnp.where(lax.axis_index(a) == 0, lax.psum(v, a), v), _same,
        lambda n: 1.0, lambda n: 1, False),
    "allgather": Collective(
        lambda v, a: collectives.all_gather(v, a, tiled=True),
        lambda v, a: lax.all_gather(v, a, tiled=True),
        lambda f: (lambda v, a: f(v, a)[: v.shape[0]]),
        lambda n: (n - 1) / n, lambda n: n, True),
    "reducescatter": Collective(
        lambda v, a: collectives.reduce_scatter(v, a, tiled=True),
        lambda v, a: lax.psum_scatter(v, a, tiled=True),
        lambda f: (lambda v, a: jnp.tile(f(v, a), lax.axis_size(a))),
        lambda n: (n - 1) / n, lambda n: 1, False, divisible=True),
}


def check_against_lax(coll: Collective, mesh, axis, x) -> int:
    """Elements of one call of ours that differ from the lax reference by more than rounding (or
    that differ between ranks where every rank must hold the same result)."""
    spec = P(axis)
    with override(dispatch="blink"):
        ours = jax.jit(jax.shard_map(lambda v: coll.ours(v, axis), mesh=mesh,
                                     in_specs=spec, out_specs=spec))(x)
    ref = jax.jit(jax.shard_map(lambda v: coll.ref(v, axis), mesh=mesh,
                                in_specs=spec, out_specs=spec))(x)
    n = mesh.shape[axis]
    ours = np.asarray(ours.astype(jnp.float32)).reshape(n, -1)
    ref = np.asarray(ref.astype(jnp.float32)).reshape(n, -1)
    tol = TOLERANCE.get(jnp.dtype(x.dtype).name, 0)
    wrong = ~np.isclose(ours, ref, rtol=tol, atol=tol * n * 4)
    if coll.replicated:
        wrong |= ours != ours[:1]
    return int(wrong.sum())


