"""When jax_blink's executor is the faster choice, from measurements (not guesses).

Each collective (``all_reduce``, ``broadcast``, ``reduce``, ``all_gather``, ``reduce_scatter``)
hands a call to its ``lax`` counterpart (``lax.psum``, ``lax.all_gather``, ``lax.psum_scatter``, or
the psum expression it equals) where that was measured faster for that collective on the same
kind of machine. Each entry of :data:`CROSSOVERS` is derived by :func:`derive` from bench results
kept in the repository (``python -m jax_blink.tools.bench -c all -o benchmarks/results``, its JSON
files), and a test derives every entry again from the files it cites: the table cannot drift from
its evidence. A collective or machine that is not listed always uses the executor.

Sizes are the bytes of one rank's operand (``x.size * itemsize``), for every collective; the
bench's ``size`` column is the larger of input and output (nccl-tests), which for all-gather is
the output, n times the operand: :func:`derive` converts.

To make or refresh an entry after a bench run (:mod:`jax_blink.tools.derive` reads the runs)::

    python -m jax_blink crossover benchmarks/results/<collective>-<kind>-<date>.json [more runs ...]
"""
from __future__ import annotations

import dataclasses


#: The collectives of the table, by their bench names (``python -m jax_blink.tools.bench -c``).
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


# Every entry comes from bench runs in benchmarks/results/ (its sources), derived by
# jax_blink.tools.derive; what each run showed is in benchmarks/NOTES.md ("The dispatch table").
CROSSOVERS: tuple[Crossover, ...] = (
    Crossover("NVIDIA H200", 2, (), (
        "benchmarks/results/allreduce-nvidia-h200-x2-2026-11-22-v0.3.json",
        "benchmarks/results/allreduce-nvidia-h200-x2-2026-11-22-v0.3-slope.json",
        "benchmarks/results/allreduce-nvidia-h200-x2-2026-11-22-v0.4.json")),
    Crossover('NVIDIA H200', 2, ((8192, None),), (
        'benchmarks/results/allreduce-ipc-nvidia-h200-x2-2026-11-24.json',
    ), layout='several processes'),
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

