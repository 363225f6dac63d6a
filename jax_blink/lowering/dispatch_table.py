"""When jax_blink's executor is the faster choice, from measurements (not guesses).

Each collective (``all_reduce``, ``broadcast``, ``reduce``, ``all_gather``, ``reduce_scatter``)
hands a call to its ``lax`` counterpart (``lax.psum``, ``lax.all_gather``, ``lax.psum_scatter``, or
the psum expression it equals) where that was measured faster for that collective on the same
kind of machine: the same device model and count, the same links, the same layout of the ranks
(:class:`jax_blink.lowering.machine.MachineKey`). Each entry is derived by
:func:`jax_blink.tools.derive.derive` from bench results kept in the repository
(``python -m jax_blink.tools.bench -c all -o benchmarks/results``, its JSON files) and shipped in
``dispatch_entries.json`` beside this module; a test derives every entry again from the files it
cites, so the table cannot drift from its evidence. To add or refresh the entries of a machine
after a bench run, one command rewrites that file::

    python -m jax_blink crossover --update benchmarks/results/<collective>-<kind>-<date>.json [...]

On a machine the table has no entry for, :func:`meanwhile` decides: the executor only at sizes
where it won on every machine of that platform measured so far, ``lax`` elsewhere (and ``lax``
everywhere for a collective never measured on that platform). ``jax-blink tune`` measures a
machine and stores its own entry in the user's cache (:mod:`jax_blink.lowering.dispatch_cache`),
which ``dispatch="auto"`` prefers from then on.

Sizes are the bytes of one rank's operand (``x.size * itemsize``), for every collective; the
bench's ``size`` column is the larger of input and output (nccl-tests), which for all-gather is
the output, n times the operand: :func:`jax_blink.tools.derive.derive` converts.
"""
from __future__ import annotations

import dataclasses
import json
import os

#: The collectives of the table, by their bench names (``python -m jax_blink.tools.bench -c``).
COLLECTIVES = ("allreduce", "broadcast", "reduce", "allgather", "reducescatter")

#: Where a collective's ranks live. ``"one process"``: every rank in the caller's process (the
#: executors meet in one address space); ``"several processes"``: ranks in different processes of
#: a job (shared memory on CPU, CUDA IPC on GPUs), a different executor with its own costs.
LAYOUTS = ("one process", "several processes")

#: The shipped entries: written by ``python -m jax_blink crossover --update``, read at import.
SHIPPED_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dispatch_entries.json")
#: The command that (re)writes :data:`SHIPPED_FILE` from bench files.
UPDATE_COMMAND = "python -m jax_blink crossover --update"
_FORMAT = 1

Range = tuple[int, int | None]


@dataclasses.dataclass(frozen=True)
class Crossover:
    """On ``ranks`` devices of ``device_kind``, ``collective``'s ``lax`` counterpart was measured
    faster for operand sizes per rank in the half-open byte ranges ``lax_ranges`` (``[lo, hi)``,
    ``hi`` None: no upper end); the executor everywhere else. ``sources`` are the bench JSON files
    it is derived from."""

    device_kind: str
    ranks: int
    lax_ranges: tuple[Range, ...]
    sources: tuple[str, ...]
    collective: str = "allreduce"
    layout: str = "one process"
    #: The element type the entry is for (derived from that dtype's rows alone); None: every dtype,
    #: derived from all rows (a size goes to lax only where lax won in each dtype measured).
    dtype: str | None = None
    #: The links of the machine measured (:func:`jax_blink.lowering.machine.links_here`: "NV18
    #: switch", "NV4 pairs", "pcie", "host memory"); None: runs that did not record them, which
    #: match any links of that device model and count.
    links: str | None = None
    #: The jax and NCCL versions measured with: set on tuned entries (``jax-blink tune``), which
    #: match only the same versions; None on shipped entries.
    jax: str | None = None
    nccl: str | None = None

    def prefers_lax(self, nbytes: int) -> bool:
        return any(lo <= nbytes and (hi is None or nbytes < hi) for lo, hi in self.lax_ranges)

    @property
    def group(self) -> tuple:
        """What one measurement covers: machine, links, collective and layout (every dtype)."""
        return (self.device_kind, self.ranks, self.links, self.collective, self.layout)

    def as_code(self) -> str:
        """The entry as Python (what ``python -m jax_blink crossover`` prints)."""
        lines = [f"Crossover({self.device_kind!r}, {self.ranks}, {self.lax_ranges!r}, ("]
        lines += [f"    {src!r}," for src in self.sources]
        tail = "" if self.collective == "allreduce" else f", collective={self.collective!r}"
        tail += "" if self.layout == "one process" else f", layout={self.layout!r}"
        for name in ("dtype", "links", "jax", "nccl"):
            value = getattr(self, name)
            tail += "" if value is None else f", {name}={value!r}"
        lines.append(")" + tail + ")")
        return "\n".join(lines)

    def to_json(self) -> dict:
        """The entry as one record of :data:`SHIPPED_FILE` or of the tuning cache."""
        record = dataclasses.asdict(self)
        record["lax_ranges"] = [list(r) for r in self.lax_ranges]
        record["sources"] = list(self.sources)
        return record

    @classmethod
    def from_json(cls, record: dict) -> Crossover:
        """An entry from :meth:`to_json`'s record; ValueError for a record that is not one."""
        try:
            fields = {f.name for f in dataclasses.fields(cls)}
            unknown = set(record) - fields
            if unknown:
                raise ValueError(f"unknown fields {sorted(unknown)}")
            c = cls(**{**record, "ranks": int(record["ranks"]),
                       "lax_ranges": tuple((int(lo), None if hi is None else int(hi))
                                           for lo, hi in record["lax_ranges"]),
                       "sources": tuple(str(s) for s in record["sources"])})
        except (TypeError, KeyError, ValueError) as e:
            raise ValueError(f"not a dispatch entry ({type(e).__name__}: {e}): {record!r}") from None
        _check_collective(c.collective)
        _check_layout(c.layout)
        return c


def read_entries(path: str) -> tuple[Crossover, ...]:
    """The entries of a file written by :func:`write_entries` (ValueError naming the file and the
    command that rewrites it where it cannot be read)."""
    try:
        with open(path) as f:
            doc = json.load(f)
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
            raise ValueError(f"not a format-{_FORMAT} file of dispatch entries")
        return tuple(Crossover.from_json(r) for r in doc["entries"])
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the dispatch entries ({type(e).__name__}: {e}); "
                         f"{UPDATE_COMMAND} FILES... writes it") from None


def write_entries(path: str, entries, about: str) -> None:
    """Write ``entries`` to ``path`` (sorted, one record each; atomically: readers see the old file
    or the new one)."""
    order = sorted(entries, key=lambda c: (c.device_kind, c.ranks, c.links or "", c.collective, c.layout,
                                           c.dtype or "", c.jax or "", c.nccl or ""))
    # One record per line: a diff of the file shows which entries changed.
    records = ",\n".join("  " + json.dumps(c.to_json()) for c in order)
    text = (f'{{"format": {_FORMAT},\n "about": {json.dumps(about)},\n "entries": [\n{records}\n ]}}\n')
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _check_collective(collective: str) -> None:
    if collective not in COLLECTIVES:
        raise ValueError(f"collective {collective!r} is not one of the table's: {', '.join(COLLECTIVES)}")


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")


#: The shipped entries (every one derived from bench runs in benchmarks/results/, its sources;
#: what each run showed is in benchmarks/NOTES.md, "The dispatch table").
CROSSOVERS: tuple[Crossover, ...] = read_entries(SHIPPED_FILE)


def entry(device_kind: str | None, ranks: int, collective: str = "allreduce",
          layout: str = "one process", dtype: str | None = None, links: str | None = None,
          table: tuple[Crossover, ...] | None = None) -> Crossover | None:
    """The entry of ``table`` (default :data:`CROSSOVERS`) for ``collective`` on ``ranks`` devices
    of ``device_kind`` linked as ``links`` (None: not known, any entry of that model and count)
    whose ranks live as ``layout`` says: the one for ``dtype`` where there is one, else the one
    for every dtype; an entry for these very links before one that did not record links (None:
    not measured)."""
    _check_collective(collective)
    _check_layout(layout)
    found = [c for c in (CROSSOVERS if table is None else table)
             if c.device_kind == device_kind and c.ranks == ranks and c.collective == collective
             and c.layout == layout and c.dtype in (dtype, None)
             and (c.links is None or links is None or c.links == links)]
    if not found:
        return None
    # The most specific: this dtype's own entry, then one measured on these links.
    return max(found, key=lambda c: (dtype is not None and c.dtype == dtype,
                                     links is not None and c.links == links))


def prefer_lax(device_kind: str | None, ranks: int, nbytes: int, collective: str = "allreduce",
               layout: str = "one process", dtype: str | None = None, links: str | None = None) -> bool:
    """True when ``collective``'s ``lax`` counterpart was measured faster than the executor for a
    call with ``nbytes`` of operand per rank on ``ranks`` devices of ``device_kind`` whose ranks
    live as ``layout`` says, in ``dtype`` where the table has an entry for it (False where the
    table has no entry: :func:`meanwhile` says what runs there)."""
    c = entry(device_kind, ranks, collective, layout, dtype, links)
    return c is not None and c.prefers_lax(nbytes)


def merge_ranges(ranges) -> tuple[Range, ...]:
    """The union of half-open byte ranges, as sorted disjoint ranges."""
    out: list[list] = []
    for lo, hi in sorted(ranges, key=lambda r: r[0]):
        if out and (out[-1][1] is None or lo <= out[-1][1]):
            if out[-1][1] is not None:
                out[-1][1] = None if hi is None else max(out[-1][1], hi)
            continue
        out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def platform_of(device_kind: str | None) -> str:
    """``"cpu"`` for CPU host devices, else ``"gpu"`` (the table's two platforms)."""
    return "cpu" if device_kind == "cpu" else "gpu"


def meanwhile(platform: str, collective: str = "allreduce", layout: str = "one process",
              dtype: str | None = None) -> Crossover:
    """What ``dispatch="auto"`` runs on a machine of ``platform`` (``"cpu"`` or ``"gpu"``) that the
    table has no entry for: ``lax`` at every size where it won on any machine of that platform
    measured so far (each machine's entry for ``dtype`` as :func:`entry` picks it), the executor
    only where it won or tied on all of them. Where no machine of that platform measured
    ``collective`` in ``layout``, the machines that measured it in the other layout decide; where
    none measured it at all, ``lax`` at every size. The result names every file it rests on."""
    _check_collective(collective)
    _check_layout(layout)
    groups = {(c.device_kind, c.ranks, c.links, c.layout) for c in CROSSOVERS
              if platform_of(c.device_kind) == platform and c.collective == collective}
    if any(g[3] == layout for g in groups):
        groups = {g for g in groups if g[3] == layout}
    # else: the layout was never measured on this platform; the other layout's machines decide
    picked = [entry(kind, n, collective, lay, dtype, links) for kind, n, links, lay in sorted(groups, key=str)]
    picked = [c for c in picked if c is not None]
    if not picked:
        return Crossover(f"no {platform} machine measured", 0, ((0, None),), (), collective, layout, dtype)
    ranges = merge_ranges(r for c in picked for r in c.lax_ranges)
    sources = tuple(dict.fromkeys(s for c in picked for s in c.sources))
    machines = ", ".join(f"{c.ranks} x {c.device_kind}" + (f" ({c.links})" if c.links else "") for c in picked)
    return Crossover(f"every {platform} machine measured: {machines}", 0, ranges, sources, collective,
                     layout, dtype)


def describe_ranges(ranges: tuple[Range, ...]) -> str:
    """Byte ranges in words: ``from 8M``, ``32K to 128K``, ``11.3M to 45.3M``, ``every size``, ``no size``."""
    def b(x: int) -> str:
        for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
            if x >= 1 << shift:  # whole units where exact; a boundary between two measured sizes is not
                return f"{x >> shift}{unit}" if x % (1 << shift) == 0 else f"{x / (1 << shift):.1f}{unit}"
        return str(x)
    if not ranges:
        return "no size"
    if ranges == ((0, None),):
        return "every size"
    return ", ".join(("below " + b(hi) if lo == 0 else f"from {b(lo)}") if lo == 0 or hi is None
                     else f"{b(lo)} to {b(hi)}" for lo, hi in ranges)


def at_ranges(ranges: tuple[Range, ...]) -> str:
    """:func:`describe_ranges` after a name, as the messages write it: ``lax.psum from 8M``,
    ``lax.psum at 512K to 2M, from 8M``, ``lax.psum at every size``."""
    text = describe_ranges(ranges)
    return text if text.startswith(("from ", "below ")) else "at " + text
