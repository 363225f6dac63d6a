"""How the peer copies of a profile ran: per GPU, how many, how long, how many at once.

Reads a ``jax.profiler`` trace (:func:`jax_blink.tools.trace_overlap.load`) of a program whose
all-reduce moves its bytes with copy engines (``JAX_BLINK_ASYNC_ENGINE=ce``,
``kernels/cuda/async_ce.cc``)::

    from jax_blink.tools import trace_copies, trace_overlap
    print(trace_copies.describe(trace_copies.summarize(trace_overlap.load(path))))

For each GPU (a process whose name holds ``/device:GPU``; every process where none does, as
:func:`jax_blink.tools.trace_overlap.gpu_spans` reads them): the peer copies (events named
``MemcpyP2P...``) as a count, their bytes (the profiler's ``memcpy_details`` ``size:``), their
busy time (the union of their intervals), the sum of their durations, and so the mean number
running at once while any runs (sum / busy) and the rate while any runs (bytes / busy); the busy time of
the copy-engine reductions (``reduce_terms_kernel``); and the span from the GPU's first event to
its last. A copy engine all-reduce whose copies run at its links' rate keeps its copies busy most of
the span; gaps say where it waits instead (benchmarks/NOTES.md, change 21).
"""
from __future__ import annotations

import re

from jax_blink.tools.trace_overlap import gpu_spans, length, process_names, union

#: Copies between GPUs, as the profiler names them.
PEER_COPIES = re.compile(r"^MemcpyP2P|^MemcpyPtoP|^Memcpy PtoP")
#: The size of a copy in the profiler's ``memcpy_details`` argument.
_SIZE = re.compile(r"\bsize:(\d+)")
#: The copy-engine form's reduction kernel.
REDUCTIONS = re.compile(r"\breduce_terms_kernel\b")


def summarize(trace: dict) -> dict:
    """Per GPU: ``{"copies", "bytes", "copy_busy_us", "copy_sum_us", "at_once", "gbps_busy", "reduce_busy_us",
    "span_us"}``.

    Args:
        trace: A loaded trace (``trace_overlap.load``).

    Returns:
        ``{"devices": {name: {...}}}``; only GPUs with at least one peer copy; ``at_once`` is the
        mean number of copies running while any runs, ``gbps_busy`` the bytes per second (1e9) while any
        runs (0 where the trace gives no sizes).
    """
    names = process_names(trace)
    per: dict = {}
    for pid, name, span, e in gpu_spans(trace, names):
        d = per.setdefault(pid, {"copies": [], "reductions": [], "all": [], "bytes": 0})
        d["all"].append(span)
        if PEER_COPIES.search(name):
            d["copies"].append(span)
            size = _SIZE.search(str(e.get("args", {}).get("memcpy_details", "")))
            d["bytes"] += int(size.group(1)) if size else 0
        elif REDUCTIONS.search(name):
            d["reductions"].append(span)
    out: dict = {"devices": {}}
    for pid, d in sorted(per.items(), key=lambda kv: str(kv[0])):
        if not d["copies"]:
            continue
        busy = length(union(d["copies"]))
        total = sum(b - a for a, b in d["copies"])
        out["devices"][names.get(pid, str(pid))] = {
            "copies": len(d["copies"]), "bytes": d["bytes"], "copy_busy_us": busy, "copy_sum_us": total,
            "at_once": total / busy if busy else 0.0, "gbps_busy": d["bytes"] / busy / 1e3 if busy else 0.0,
            "reduce_busy_us": length(union(d["reductions"])),
            "span_us": max(b for _, b in d["all"]) - min(a for a, _ in d["all"])}
    return out


def describe(summary: dict) -> str:
    """One line per GPU (MEASURED, from the trace), or a line saying that no peer copy ran."""
    if not summary["devices"]:
        return "no peer copy in the trace (no GPUs, or the program ran no copy-engine collective)"
    return "\n".join(
        f"{name}: {d['copies']} peer copies of {d['bytes'] / 2**20:.1f} MiB, busy {d['copy_busy_us'] / 1e3:.3f} ms of "
        f"a {d['span_us'] / 1e3:.3f} ms span ({d['copy_busy_us'] / d['span_us']:.0%}), {d['at_once']:.2f} at once on "
        f"average, {d['gbps_busy']:.1f} GB/s while any runs; "
        f"reductions busy {d['reduce_busy_us'] / 1e3:.3f} ms (measured, profiler trace)"
        for name, d in summary["devices"].items())
