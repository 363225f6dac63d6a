"""Deriving a dispatch table entry (:class:`jax_blink.lowering.dispatch_table.Crossover`) from
bench runs: ``python -m jax_blink crossover RUN.json ...``."""
from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

from jax_blink.lowering.dispatch_table import COLLECTIVES, LAYOUTS, Crossover


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
        raise ValueError(f"{src}: not a readable bench result (python -m jax_blink.tools.bench -o DIR writes "
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
