"""When jax_blink's executor is the faster choice, from measurements (not guesses).

Each collective (``all_reduce``, ``broadcast``, ``reduce``, ``all_gather``, ``reduce_scatter``)
hands a call to its ``lax`` counterpart (``lax.psum``, ``lax.all_gather``, ``lax.psum_scatter``, or
the psum expression it equals) where that was measured faster for that collective on the same
kind of machine. Each entry of :data:`CROSSOVERS` is derived by :func:`derive` from bench results
kept in the repository (``python -m jax_blink.bench -c all -o benchmarks/results``, its JSON
files), and a test derives every entry again from the files it cites: the table cannot drift from
its evidence. A collective or machine that is not listed always uses the executor.

Sizes are the bytes of one rank's operand (``x.size * itemsize``), for every collective; the
bench's ``size`` column is the larger of input and output (nccl-tests), which for all-gather is
the output, n times the operand: :func:`derive` converts.

To make or refresh an entry after a bench run::

    python -m jax_blink crossover benchmarks/results/<collective>-<kind>-<date>.json [more runs ...]
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence


#: The collectives of the table, by their bench names (``python -m jax_blink.bench -c``).
COLLECTIVES = ("allreduce", "broadcast", "reduce", "allgather", "reducescatter")

#: Where a collective's ranks live. ``"one process"``: every rank in the caller's process (the
#: executors meet in one address space); ``"several processes"``: ranks in different processes of
#: a job (shared memory on CPU, CUDA IPC on GPUs), a different executor with its own costs.
LAYOUTS = ("one process", "several processes")


@dataclasses.dataclass(frozen=True)
class Crossover:
    """On ``ranks`` devices of ``device_kind``, ``collective``'s ``lax`` counterpart was measured
    faster for operand sizes per rank in the half-open byte ranges ``lax_ranges`` (``[lo, hi)``,
    ``hi`` None: no upper end); the executor everywhere else. ``sources`` are the bench JSON files
    it is derived from."""

    device_kind: str
    ranks: int
    lax_ranges: tuple[tuple[int, int | None], ...]
    sources: tuple[str, ...]
    collective: str = "allreduce"
    layout: str = "one process"
    #: The element type the entry is for (derived from that dtype's rows alone); None: every dtype,
    #: derived from all rows (a size goes to lax only where lax won in each dtype measured).
    dtype: str | None = None

    def prefers_lax(self, nbytes: int) -> bool:
        return any(lo <= nbytes and (hi is None or nbytes < hi) for lo, hi in self.lax_ranges)

    def as_code(self) -> str:
        """The entry as it is written in :data:`CROSSOVERS` (what ``python -m jax_blink crossover``
        prints to paste there)."""
        lines = [f"Crossover({self.device_kind!r}, {self.ranks}, {self.lax_ranges!r}, ("]
        lines += [f"    {src!r}," for src in self.sources]
        tail = "" if self.collective == "allreduce" else f", collective={self.collective!r}"
        tail += "" if self.layout == "one process" else f", layout={self.layout!r}"
        tail += "" if self.dtype is None else f", dtype={self.dtype!r}"
        lines.append(")" + tail + ")")
        return "\n".join(lines)


#: lax "won" a row only where ours took at least 5% longer (speedup below this): closer than that
#: is within the run-to-run spread of these runs (10-50% on the loaded CPU machines, 1-10% on GPUs),
#: and a tie is left to the executor.
LAX_WINS_BELOW = 0.95


def _lax_won(row: dict) -> bool:
    """psum was faster at this row, by a margin (:data:`LAX_WINS_BELOW`), by the 20-call time and,
    where measured, by the marginal cost."""
    slope = row.get("slope_speedup")
    slope = float("nan") if slope is None else float(slope)
    return float(row["speedup"]) < LAX_WINS_BELOW and (math.isnan(slope) or slope < LAX_WINS_BELOW)


def _read_run(src: str, root: str, dtype: str | None = None) -> tuple[tuple[str, int, str, str], dict[int, bool]]:
    """(device kind, ranks, collective, layout) of a bench run and, per operand size it measured
    (in ``dtype`` only, where given), whether lax won there."""
    try:
        with open(os.path.join(root, src)) as f:
            doc = json.load(f)
        meta, rows = doc["meta"], doc["rows"]
        collective = meta.get("collective") or os.path.basename(src).split("-")[0]
        n = int(meta["n"])
        layout = meta.get("layout", "one process")
        kind = (meta["device_kind"], n, collective, layout)
        per_operand = n if collective == "allgather" else 1  # the bench's size: all-gather's output
        points = [(int(r["size"]) // per_operand, str(r.get("dtype", "")), int(r.get("wrong", 0)), _lax_won(r))
                  for r in rows]
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{src}: not a readable bench result (python -m jax_blink.bench -o DIR writes "
                         f"one): {type(e).__name__}: {e}") from None
    if collective not in COLLECTIVES:
        raise ValueError(f"{src}: a bench run of {collective!r}, not of a collective the table holds "
                         f"({', '.join(COLLECTIVES)})")
    if layout not in LAYOUTS:
        raise ValueError(f"{src}: layout {layout!r} is not one of {LAYOUTS}")
    won: dict[int, bool] = {}
    for size, row_dtype, wrong, lax_won in points:
        if dtype is not None and row_dtype != dtype:
            continue
        if wrong:
            raise ValueError(f"{src}: {size} bytes {row_dtype} had {wrong} wrong elements; a run with wrong "
                             "results decides nothing")
        won[size] = won.get(size, True) and lax_won
    return kind, won


def derive(sources: Sequence[str], root: str = ".", dtype: str | None = None) -> Crossover:
    """The crossover entry that the bench runs ``sources`` of one collective (JSON files written by
    ``python -m jax_blink.bench -o DIR``; paths relative to ``root``) support.

    A size goes to ``lax`` only if lax won there in every run that measured it and in every
    dtype, by the 20-call time and (where the run has it) the marginal cost of a call: below a few
    hundred KiB both measures move by tens of percent between runs, and a dispatch rule must not
    follow that noise. Between two measured sizes the boundary is their geometric mean; below the
    smallest and above the largest size measured the nearest measured size decides.

    With ``dtype``, only that element type's rows count, and the entry is for that dtype alone.

    Raises ValueError when the runs disagree on the machine (device kind, rank count) or the
    collective, when one is of a collective the table does not hold, cannot be read, or had wrong
    results, or when no run measured ``dtype``.
    """
    if not sources:
        raise ValueError("derive() needs at least one bench JSON file")
    kinds, lax_won = set(), {}
    for src in sources:
        kind, won = _read_run(src, root, dtype)
        kinds.add(kind)
        for size, w in won.items():
            lax_won[size] = lax_won.get(size, True) and w
    if len({k[2] for k in kinds}) > 1:
        raise ValueError(f"the runs are of different collectives: {sorted({k[2] for k in kinds})}; "
                         "derive one entry per collective")
    if len({k[3] for k in kinds}) > 1:
        raise ValueError(f"the runs are of different layouts: {sorted({k[3] for k in kinds})}; "
                         "derive one entry per layout")
    if len(kinds) != 1:
        raise ValueError(f"the runs are of different machines: {sorted(k[:2] for k in kinds)}; "
                         "derive one entry per machine")
    if not lax_won:
        raise ValueError("the runs measured no size" + (f" in {dtype}" if dtype is not None else ""))
    measured, won_everywhere = set(lax_won), {s for s, w in lax_won.items() if w}
    order = sorted(measured)
    lax = [s in won_everywhere for s in order]
    ranges, i = [], 0
    while i < len(order):
        if not lax[i]:
            i += 1
            continue
        j = i
        while j + 1 < len(order) and lax[j + 1]:
            j += 1
        lo = 0 if i == 0 else round(math.sqrt(order[i - 1] * order[i]))
        hi = None if j == len(order) - 1 else round(math.sqrt(order[j] * order[j + 1]))
        ranges.append((lo, hi))
        i = j + 1
    (kind, n, collective, layout), = kinds
    return Crossover(kind, n, tuple(ranges), tuple(sources), collective, layout, dtype)


# Executor 0.4.x on 2 x H200: three all-reduce runs, 1 KiB-1 GiB, 20 chained calls and the marginal
# cost between 20 and 100 (float32 and bfloat16 in the v0.3 runs, float32 in v0.4). psum won by both
# measures at one point of one run (float32 64 KiB in v0.4: 0.92x, 0.68x) and lost there in the
# others (1.47x/1.41x and 0.98x/1.21x), so no size goes to psum. (Executor 0.2.0 lost below 16 MiB.)
CROSSOVERS: tuple[Crossover, ...] = (
    Crossover("NVIDIA H200", 2, (), (
        "benchmarks/results/allreduce-nvidia-h200-x2-2026-11-22-v0.3.json",
        "benchmarks/results/allreduce-nvidia-h200-x2-2026-11-22-v0.3-slope.json",
        "benchmarks/results/allreduce-nvidia-h200-x2-2026-11-22-v0.4.json")),
    # One process per GPU on 2 x H200 (the CUDA IPC executor, 2026-11-24, tests/gpu_ipc_selftest.py,
    # float32, 20-call chains against NCCL's psum): ours won at 1 KiB only (1.04x); from 64 KiB
    # psum was faster (0.83-0.93x at 64 KiB, 0.40-0.52x from 1 MiB), so psum takes those sizes.
    Crossover('NVIDIA H200', 2, ((8192, None),), (
        'benchmarks/results/allreduce-ipc-nvidia-h200-x2-2026-11-24.json',
    ), layout='several processes'),
    # CPU host devices (the CPU executor: threads meeting in one process) on a 2-core machine shared
    # with other jobs (load average 4-8 while measuring), 2026-11-24, executor of commit 328c546:
    # every collective against its lax counterpart, float32 and bfloat16, 1 KiB-16 MiB (8 ranks:
    # 4 MiB) by factors of 4, 20 chained calls, ours and lax taking turns run by run. By more than
    # 5% (LAX_WINS_BELOW) lax won in both dtypes only at 4-rank all-gathers of 128-512 KiB and
    # 8-rank all-reduces of 32-128 KiB (the entries for every dtype); in float32 alone in more
    # places (all-gather from 64 KiB on 4 and 8 ranks, 0.51-0.76x; reduce-scatter at 256 KiB-4 MiB;
    # 8-rank all-reduce at 1 MiB, 0.54x: the float32 entries below), in bfloat16 ours nearly
    # everywhere (XLA's bfloat16 arithmetic is slow on CPU). The runs of the executor before
    # (commit 981c98e, benchmarks/results/*-before-2026-11-23.*: 1 KiB-4 MiB by factors of 16)
    # had lax faster at every size for all-reduce, all-gather and reduce-scatter on 4 and 8 ranks
    # (0.12-0.76x); benchmarks/results/cpu-executor-before-after-2core-2026-11-23.md compares.
    # Other CPUs may differ: measure them (python -m jax_blink.bench -c all -o DIR,
    # then python -m jax_blink crossover DIR/<collective>-....json).
    Crossover("cpu", 2, (), (
        "benchmarks/results/allreduce-cpu-2core-2dev-2026-11-24.json",
    )),
    Crossover("cpu", 2, (), (
        "benchmarks/results/broadcast-cpu-2core-2dev-2026-11-24.json",
    ), collective="broadcast"),
    Crossover("cpu", 2, (), (
        "benchmarks/results/reduce-cpu-2core-2dev-2026-11-24.json",
    ), collective="reduce"),
    Crossover("cpu", 2, (), (
        "benchmarks/results/allgather-cpu-2core-2dev-2026-11-24.json",
    ), collective="allgather"),
    Crossover("cpu", 2, (), (
        "benchmarks/results/reducescatter-cpu-2core-2dev-2026-11-24.json",
    ), collective="reducescatter"),
    Crossover("cpu", 4, (), (
        "benchmarks/results/allreduce-cpu-2core-4dev-2026-11-24.json",
    )),
    Crossover("cpu", 4, (), (
        "benchmarks/results/broadcast-cpu-2core-4dev-2026-11-24.json",
    ), collective="broadcast"),
    Crossover("cpu", 4, (), (
        "benchmarks/results/reduce-cpu-2core-4dev-2026-11-24.json",
    ), collective="reduce"),
    Crossover("cpu", 4, ((131072, 524288),), (
        "benchmarks/results/allgather-cpu-2core-4dev-2026-11-24.json",
    ), collective="allgather"),
    Crossover("cpu", 4, (), (
        "benchmarks/results/reducescatter-cpu-2core-4dev-2026-11-24.json",
    ), collective="reducescatter"),
    Crossover("cpu", 8, ((32768, 131072),), (
        "benchmarks/results/allreduce-cpu-2core-8dev-2026-11-24.json",
    )),
    Crossover("cpu", 8, (), (
        "benchmarks/results/broadcast-cpu-2core-8dev-2026-11-24.json",
    ), collective="broadcast"),
    Crossover("cpu", 8, (), (
        "benchmarks/results/reduce-cpu-2core-8dev-2026-11-24.json",
    ), collective="reduce"),
    Crossover("cpu", 8, (), (
        "benchmarks/results/allgather-cpu-2core-8dev-2026-11-24.json",
    ), collective="allgather"),
    Crossover("cpu", 8, (), (
        "benchmarks/results/reducescatter-cpu-2core-8dev-2026-11-24.json",
    ), collective="reducescatter"),
    # Per dtype, from the same runs (each dtype's rows alone; only where that differs from the
    # entry for every dtype above): float32 goes to lax in more places, bfloat16 in a few others.
    Crossover('cpu', 2, ((524288, 2097152),), (
        'benchmarks/results/reduce-cpu-2core-2dev-2026-11-24.json',
    ), collective='reduce', dtype='bfloat16'),
    Crossover('cpu', 2, ((2097152, None),), (
        'benchmarks/results/allgather-cpu-2core-2dev-2026-11-24.json',
    ), collective='allgather', dtype='float32'),
    Crossover('cpu', 2, ((32768, 131072),), (
        'benchmarks/results/allgather-cpu-2core-2dev-2026-11-24.json',
    ), collective='allgather', dtype='bfloat16'),
    Crossover('cpu', 2, ((131072, 524288), (2097152, 8388608)), (
        'benchmarks/results/reducescatter-cpu-2core-2dev-2026-11-24.json',
    ), collective='reducescatter', dtype='float32'),
    Crossover('cpu', 4, ((2097152, 8388608),), (
        'benchmarks/results/allreduce-cpu-2core-4dev-2026-11-24.json',
    ), dtype='float32'),
    Crossover('cpu', 4, ((131072, 524288),), (
        'benchmarks/results/reduce-cpu-2core-4dev-2026-11-24.json',
    ), collective='reduce', dtype='bfloat16'),
    Crossover('cpu', 4, ((32768, None),), (
        'benchmarks/results/allgather-cpu-2core-4dev-2026-11-24.json',
    ), collective='allgather', dtype='float32'),
    Crossover('cpu', 4, ((131072, 524288), (2097152, 8388608)), (
        'benchmarks/results/reducescatter-cpu-2core-4dev-2026-11-24.json',
    ), collective='reducescatter', dtype='float32'),
    Crossover('cpu', 8, ((32768, 131072), (524288, None)), (
        'benchmarks/results/allreduce-cpu-2core-8dev-2026-11-24.json',
    ), dtype='float32'),
    Crossover('cpu', 8, ((2097152, None),), (
        'benchmarks/results/reduce-cpu-2core-8dev-2026-11-24.json',
    ), collective='reduce', dtype='float32'),
    Crossover('cpu', 8, ((32768, None),), (
        'benchmarks/results/allgather-cpu-2core-8dev-2026-11-24.json',
    ), collective='allgather', dtype='float32'),
    Crossover('cpu', 8, ((131072, 2097152),), (
        'benchmarks/results/reducescatter-cpu-2core-8dev-2026-11-24.json',
    ), collective='reducescatter', dtype='float32'),
)


def _check_collective(collective: str) -> None:
    if collective not in COLLECTIVES:
        raise ValueError(f"collective {collective!r} is not one of the table's: {', '.join(COLLECTIVES)}")


def entry(device_kind: str | None, ranks: int, collective: str = "allreduce",
          layout: str = "one process", dtype: str | None = None) -> Crossover | None:
    """The table's entry for ``collective`` on ``ranks`` devices of ``device_kind`` whose ranks
    live as ``layout`` says: the one for ``dtype`` where there is one, else the one for every
    dtype (None: not measured)."""
    _check_collective(collective)
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
    found = [c for c in CROSSOVERS if c.device_kind == device_kind and c.ranks == ranks
             and c.collective == collective and c.layout == layout and c.dtype in (dtype, None)]
    return next((c for c in found if dtype is not None and c.dtype == dtype), found[0] if found else None)


def prefer_lax(device_kind: str | None, ranks: int, nbytes: int, collective: str = "allreduce",
               layout: str = "one process", dtype: str | None = None) -> bool:
    """True when ``collective``'s ``lax`` counterpart was measured faster than the executor for a
    call with ``nbytes`` of operand per rank on ``ranks`` devices of ``device_kind`` whose ranks
    live as ``layout`` says, in ``dtype`` where the table has an entry for it."""
    c = entry(device_kind, ranks, collective, layout, dtype)
    return c is not None and c.prefers_lax(nbytes)

