"""Deriving dispatch table entries (:class:`jax_blink.lowering.dispatch_table.Crossover`) from
bench runs: ``python -m jax_blink crossover RUN.json ...`` prints one entry;
``python -m jax_blink crossover --update RUN.json ...`` derives every machine's and collective's
entries from the runs and writes them into the shipped table's file (``jax-blink tune`` does the
same into the user's cache)."""
from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

from jax_blink.lowering import dispatch_table
from jax_blink.lowering.dispatch_table import COLLECTIVES, LAYOUTS, Crossover
from jax_blink.lowering.machine import HOST_LINKS


#: lax "won" a row of CPU host devices only where ours took at least 5% longer (speedup below
#: this): closer than that is within the run-to-run spread of those runs (10-50% on the loaded
#: 2-core machines), and a tie is left to the executor.
LAX_WINS_BELOW = 0.95
#: On GPUs the medians move by 0-4% between runs at the sizes where the two paths are close (1 MiB
#: and up), and `auto` must never take a path measured slower there (issue 27): lax wins a GPU row
#: where ours took 1% longer or more.
LAX_WINS_BELOW_GPU = 0.99


def lax_wins_below(device_kind: str) -> float:
    """The speedup under which lax won a row of a run on ``device_kind`` (``"cpu"``: host devices)."""
    return LAX_WINS_BELOW if device_kind == "cpu" else LAX_WINS_BELOW_GPU


def _lax_won(row: dict, below: float = LAX_WINS_BELOW) -> bool:
    """psum was faster at this row, by a margin (speedup < ``below``), by the 20-call time and,
    where measured, by the marginal cost."""
    slope = row.get("slope_speedup")
    slope = float("nan") if slope is None else float(slope)
    return float(row["speedup"]) < below and (math.isnan(slope) or slope < below)


def _read_run(src: str, root: str, dtype: str | None = None
              ) -> tuple[tuple[str, int, str, str, str | None], dict[int, bool]]:
    """(device kind, ranks, collective, layout, links) of a bench run and, per operand size it
    measured (in ``dtype`` only, where given), whether lax won there. Runs that did not record
    their links are of CPU host devices (host memory) or say nothing (None)."""
    try:
        with open(os.path.join(root, src)) as f:
            doc = json.load(f)
        meta, rows = doc["meta"], doc["rows"]
        collective = meta.get("collective") or os.path.basename(src).split("-")[0]
        n = int(meta["n"])
        layout = meta.get("layout", "one process")
        links = meta.get("links") or (HOST_LINKS if meta["device_kind"] == "cpu" else None)
        kind = (meta["device_kind"], n, collective, layout, links)
        timed = meta.get("dispatch", "blink")
        per_operand = n if collective == "allgather" else 1  # the bench's size: all-gather's output
        below = lax_wins_below(meta["device_kind"])
        points = [(int(r["size"]) // per_operand, str(r.get("dtype", "")), int(r.get("wrong", 0)), _lax_won(r, below))
                  for r in rows]
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{src}: not a readable bench result (python -m jax_blink.tools.bench -o DIR writes "
                         f"one): {type(e).__name__}: {e}") from None
    if collective not in COLLECTIVES:
        raise ValueError(f"{src}: a bench run of {collective!r}, not of a collective the table holds "
                         f"({', '.join(COLLECTIVES)})")
    if layout not in LAYOUTS:
        raise ValueError(f"{src}: layout {layout!r} is not one of {LAYOUTS}")
    if meta.get("complete") is False:  # files of runs before this field was written are whole runs
        raise ValueError(f"{src}: the run stopped after {len(rows)} of its {meta.get('rows_planned', '?')} rows "
                         "(\"complete\": false); its rows can be read, but an entry extends the last size "
                         "measured to every larger one, so it needs a whole run: run the bench again")
    if timed != "blink":
        raise ValueError(f"{src}: a bench run of dispatch={timed!r}, which times what the table already "
                         "decides; entries come from runs of the executor itself (the bench's default)")
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
    ``python -m jax_blink.tools.bench -o DIR``; paths relative to ``root``) support.

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
        raise ValueError(f"the runs are of different machines: {sorted((k[0], k[1], k[4] or '') for k in kinds)}; "
                         "derive one entry per machine (device kind, count and links)")
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
    (kind, n, collective, layout, links), = kinds
    return Crossover(kind, n, tuple(ranges), tuple(sources), collective, layout, dtype, links)


def _dtypes(src: str, root: str) -> list[str]:
    with open(os.path.join(root, src)) as f:
        return list(dict.fromkeys(str(r.get("dtype", "")) for r in json.load(f)["rows"]))


def derive_all(sources: Sequence[str], root: str = ".") -> list[Crossover]:
    """Every entry that the bench runs ``sources`` support, of any machines and collectives: the
    runs are grouped by machine (device kind, count, links), collective and layout; each group
    gives its entry for every dtype (:func:`derive`) and, for each dtype whose own rows put a
    different set of sizes on ``lax``, that dtype's entry too.

    Raises ValueError as :func:`derive` does, for any one file."""
    if not sources:
        raise ValueError("derive_all() needs at least one bench JSON file")
    groups: dict[tuple, list[str]] = {}
    for src in dict.fromkeys(sources):
        kind, _ = _read_run(src, root)
        groups.setdefault(kind, []).append(src)
    out = []
    for files in groups.values():
        every = derive(files, root)
        out.append(every)
        dtypes = dict.fromkeys(d for src in files for d in _dtypes(src, root))
        for d in dtypes:
            own = derive(files, root, dtype=d)
            if own.lax_ranges != every.lax_ranges:
                out.append(own)
    return out


def update(sources: Sequence[str], path: str = dispatch_table.SHIPPED_FILE, root: str = ".",
           about: str | None = None) -> tuple[list[Crossover], list[Crossover]]:
    """Derive every entry of ``sources`` (:func:`derive_all`) and write them into the entries file
    ``path`` (default: the shipped table), in place of the entries of the same machines,
    collectives and layouts; ``(new entries, entries they replaced)``. A file that does not exist
    yet is made."""
    new = derive_all(sources, root)
    groups = {c.group for c in new}
    old = list(dispatch_table.read_entries(path)) if os.path.exists(path) else []
    replaced = [c for c in old if c.group in groups]
    kept = [c for c in old if c.group not in groups]
    text = about or ("Dispatch entries of jax_blink.lowering.dispatch_table, each derived from the bench files "
                     f"it cites (sources). Written by: {dispatch_table.UPDATE_COMMAND} FILES...; do not edit "
                     "by hand (tests/unit/test_dispatch.py derives every entry again).")
    dispatch_table.write_entries(path, kept + new, text)
    return new, replaced
