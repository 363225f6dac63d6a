"""How much of jax_blink's kernel time ran beside other kernels: the overlap figure of a profile.

Reads a trace of ``jax.profiler`` (the ``*.trace.json.gz`` file it writes, Chrome's trace format:
complete events ``"ph": "X"`` with ``ts`` and ``dur`` in microseconds, per process ``pid``, the
processes named by ``"ph": "M"`` metadata events such as ``/device:GPU:0``)::

    from jax_blink.tools import trace_overlap
    summary = trace_overlap.summarize(trace_overlap.load("run/plugins/profile/.../host.trace.json.gz"))
    print(trace_overlap.describe(summary))

For each GPU (a process whose name holds ``/device:GPU``; every process where no name says so),
our kernels' busy time (the union of their intervals), the other kernels' busy time, and the part
of ours that lies inside the other kernels' union: ``overlap = that / ours``. Memory copies and sets
do not count as compute. 1.0: every microsecond of our kernels ran beside a compute kernel;
0.0: none did (a synchronous call between two kernels on one stream).
"""
from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterable
from pathlib import Path

#: The CUDA executor's kernels (kernels/cuda/device_kernels.cuh), as the profiler names them, and
#: the copy-engine form's work (kernels/cuda/async_ce.cc): its reduction kernel and its peer copies,
#: which no XLA collective of these programs issues.
OUR_KERNELS = re.compile(r"\b(?:collective|ll|oneshot|one_shot|twoshot|two_shot|one_rank|reduce_terms)_kernel\b"
                         r"|^MemcpyP2P")
#: XLA's collectives on GPUs: NCCL's kernels.
XLA_COLLECTIVES = re.compile(r"nccl", re.IGNORECASE)
#: Events on a GPU that are not compute: copies, sets and NCCL's kernels (XLA's collectives).
NOT_COMPUTE = re.compile(r"^(?:Memcpy|Memset|memcpy|memset)|" + XLA_COLLECTIVES.pattern, re.IGNORECASE)


def load(path) -> dict:
    """The trace at ``path`` (``.json`` or ``.json.gz``) as a dict with ``traceEvents``."""
    p = Path(path)
    raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
    trace = json.loads(raw)
    if isinstance(trace, list):  # the bare-array form of the format
        trace = {"traceEvents": trace}
    if "traceEvents" not in trace:
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents)")
    return trace


def process_names(trace: dict) -> dict:
    """Every process id of the trace and its name (``/device:GPU:0``, ``/host:CPU``, ...)."""
    return {e.get("pid"): e.get("args", {}).get("name", "") for e in trace["traceEvents"]
            if e.get("ph") == "M" and e.get("name") == "process_name"}


def gpu_spans(trace: dict, names: dict | None = None):
    """``(pid, event name, (start, end), event)`` of every complete event (``"X"``, with a duration)
    of the GPU processes; of every process where the trace names no GPU."""
    names = process_names(trace) if names is None else names
    gpus = {pid for pid, n in names.items() if "/device:GPU" in n}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and "dur" in e and (not gpus or e.get("pid") in gpus):
            yield e.get("pid"), str(e.get("name", "")), (float(e["ts"]), float(e["ts"]) + float(e["dur"])), e


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` intervals as sorted, disjoint intervals."""
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def length(intervals) -> float:
    """The summed length of ``(start, end)`` intervals (disjoint ones: their union's length)."""
    return sum(b - a for a, b in intervals)


def _intersection(xs, ys) -> float:
    """Length of (union xs) & (union ys), both sorted and disjoint."""
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, hi - lo)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize(trace: dict, ours=OUR_KERNELS) -> dict:
    """Per GPU and in all: our kernels' busy time, the other kernels' busy time and the overlap.

    Args:
        trace: A loaded trace (:func:`load`).
        ours: The pattern of our kernels' names.

    Returns:
        ``{"devices": {name: {"ours_us", "compute_us", "beside_us", "overlap", "our_kernels"}},
        "ours_us", "beside_us", "overlap", "span_us", "compute_us_per_gpu"}``; ``overlap`` is None
        where no kernel of ours ran; ``span_us`` is the GPUs' time for what the trace holds: from
        the first event of any GPU to the last one's end (0 where no process is named as a GPU: a
        CPU run's trace); ``compute_us_per_gpu``: the other kernels' busy time (their union), the
        mean over every GPU with a kernel, whether ours ran there or not (0.0 where none).
    """
    names = process_names(trace)
    named_gpus = any("/device:GPU" in n for n in names.values())
    per: dict = {}
    first, last = float("inf"), float("-inf")
    for pid, name, span, _ in gpu_spans(trace, names):
        if named_gpus:
            first, last = min(first, span[0]), max(last, span[1])
        d = per.setdefault(pid, {"ours": [], "compute": []})
        if ours.search(name):
            d["ours"].append(span)
        elif not NOT_COMPUTE.search(name):
            d["compute"].append(span)
    out: dict = {"devices": {}}
    total_ours = total_beside = 0.0
    for pid, d in sorted(per.items(), key=lambda kv: str(kv[0])):
        if not d["ours"]:
            continue
        o, c = union(d["ours"]), union(d["compute"])
        ours_us, beside = length(o), _intersection(o, c)
        out["devices"][names.get(pid, str(pid))] = {
            "ours_us": ours_us, "compute_us": length(c), "beside_us": beside,
            "overlap": beside / ours_us if ours_us else None, "our_kernels": len(d["ours"])}
        total_ours += ours_us
        total_beside += beside
    out["ours_us"], out["beside_us"] = total_ours, total_beside
    out["overlap"] = total_beside / total_ours if total_ours else None
    out["span_us"] = last - first if last > first else 0.0
    busy = [length(union(d["compute"])) for d in per.values() if d["compute"] or d["ours"]]
    out["compute_us_per_gpu"] = sum(busy) / len(busy) if busy else 0.0
    return out


def describe(summary: dict) -> str:
    """One line: the overlap figure, our kernel time and the devices it was measured on, and the
    GPUs' span of the trace."""
    span = summary.get("span_us", 0.0)
    tail = f"; GPU span {span / 1e3:.3f} ms (first kernel of any GPU to the last one's end)" if span else ""
    if summary["overlap"] is None:
        return "no jax_blink kernel in the trace (no GPU kernels, or the step ran none)" + tail
    n = len(summary["devices"])
    return (f"overlap {summary['overlap']:.1%}: {summary['beside_us'] / 1e3:.3f} ms of "
            f"{summary['ours_us'] / 1e3:.3f} ms of jax_blink kernel time ran beside other kernels "
            f"(sum over {n} GPU(s)){tail}")


def kernel_kind(name: str) -> str:
    """A kernel's name without the numbers XLA appends to tell its fusions apart
    (``loop_add_fusion_12`` and ``loop_add_fusion.3`` are both ``loop_add_fusion``), so that the
    kernels of two programs compare by kind."""
    return re.sub(r"(?:[._]\d+)+$", "", name)


def kernel_table(trace: dict, device: str | None = None) -> dict[str, tuple[int, float]]:
    """GPU kernel time by kind on one GPU: ``{kind: (count, total_us)}`` (:func:`kernel_kind`).

    Args:
        trace: A loaded trace (:func:`load`).
        device: The GPU's process name (``/device:GPU:0``); default, the first GPU by name (every
            process where the trace names no GPU).
    """
    names = process_names(trace)
    gpus = sorted(n for n in names.values() if "/device:GPU" in n)
    want = device if device is not None else (gpus[0] if gpus else None)
    table: dict[str, list] = {}
    for pid, name, (a, b), _ in gpu_spans(trace, names):
        if want is not None and names.get(pid) != want:
            continue
        row = table.setdefault(kernel_kind(name), [0, 0.0])
        row[0] += 1
        row[1] += b - a
    return {k: (n, us) for k, (n, us) in table.items()}


def compare_tables(table: dict[str, tuple[int, float]], base: dict[str, tuple[int, float]], top: int = 25) -> str:
    """The kernel kinds whose time differs most between two tables (:func:`kernel_table`), one line
    each: time and count in ``table``, the change against ``base``; the totals first."""
    total = sum(us for _, us in table.values())
    total_base = sum(us for _, us in base.values())
    lines = [f"time by kind, measured: {total / 1e3:.3f} ms in all ({total_base / 1e3:.3f} ms in the base, "
             f"{(total - total_base) / 1e3:+.3f} ms); the {top} kinds that changed most:"]
    kinds = set(table) | set(base)
    delta = {k: table.get(k, (0, 0.0))[1] - base.get(k, (0, 0.0))[1] for k in kinds}
    for k in sorted(kinds, key=lambda k: -abs(delta[k]))[:top]:
        n, us = table.get(k, (0, 0.0))
        n0, _ = base.get(k, (0, 0.0))
        lines.append(f"  {delta[k] / 1e3:+9.3f} ms  {us / 1e3:9.3f} ms in {n:5d} kernel(s) ({n - n0:+d})  {k[:100]}")
    return "\n".join(lines)


def timeline_png(trace: dict, path, ours=OUR_KERNELS, title: str = "") -> None:
    """A picture of the trace's GPU kernels (one row per GPU: compute in grey, ours in red above it)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = process_names(trace)
    spans = list(gpu_spans(trace, names))
    gpus = sorted((pid for pid, n in names.items() if "/device:GPU" in n), key=lambda p: names[p]) or \
        sorted({pid for pid, *_ in spans}, key=str)  # an idle GPU keeps its row
    t0 = min((a for _, _, (a, _), _ in spans), default=0.0)
    fig, ax = plt.subplots(figsize=(12, 0.8 + 0.7 * len(gpus)))
    row_of = {pid: row for row, pid in enumerate(gpus)}
    for pid, name, (a, b), _ in spans:
        mine, xlas = bool(ours.search(name)), bool(XLA_COLLECTIVES.search(name))
        if not mine and not xlas and NOT_COMPUTE.search(name):
            continue
        ax.broken_barh([((a - t0) / 1e3, (b - a) / 1e3)], (row_of[pid] + (0.45 if mine or xlas else 0.0), 0.4),
                       color="tab:red" if mine else "tab:blue" if xlas else "0.6")
    ax.set_yticks([r + 0.4 for r in range(len(gpus))], [names.get(p, str(p)) for p in gpus])
    ax.set_xlabel("ms since the first kernel (measured, jax.profiler)")
    ax.set_title(title or "GPU kernels: compute (grey), jax_blink (red), NCCL (blue)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
