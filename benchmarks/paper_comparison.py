"""The Blink paper's comparison (MLSys 2020, Figs. 11-12), reproduced through the model.

Walks every allocation of 3 to 8 GPUs of a DGX-1V (and a DGX-1P), plans broadcast, reduce and
all-reduce with jax_blink's tree packing, builds NCCL's rings (jax_blink.tools.simulate.rings) and
compares them:

* at the rate level: algorithm bandwidth (GB/s of data per device) of the trees against the rings
  (rings: B for broadcast/reduce, B * n / (2(n - 1)) for all-reduce), and
* through the alpha-beta pipeline model at one size (``--size``, 500 MB per device by default, best
  chunk each). For all-reduce the planner weighs every form the executors run
  (jax_blink.planning.forms: Blink's reduce + broadcast trees, rings, reduce-scatter + all-gather
  over the trees, fewer/shallower trees, the CUDA one-hop kernels) and the row's ``form`` and
  ``speedup`` are those of the form it chooses; ``trees_speedup`` keeps Blink's reduce + broadcast
  alone. Ring times, the baseline's and the ring form's, come from one formula
  (jax_blink.planning.model.ring_allreduce_us).

Allocations whose NVLinks do not connect all their GPUs (e.g. {0, 5, 6}... any allocation with a GPU
that has no NVLink to the others) are SKIPPED: the trees are planned over NVLink only (the presets
without PCIe, as in the paper's comparison) and such allocations have no NVLink plan. Connected
allocations whose NVLinks hold no Hamiltonian ring are kept: NCCL runs them over one PCIe ring at
10 GB/s (jax_blink.tools.simulate.MODEL), which is where the paper's largest speedups come from.

Roots: broadcast and reduce from the lowest device id of the allocation; all-reduce lets the
planner choose its roots.

Writes paper-<preset>-<size>-cpu-model-<date>.csv per preset and paper-<size>-cpu-model-<date>.md
(the summary) into ``--out`` (default benchmarks/results/), and prints the summary.

    PYTHONPATH=. python benchmarks/paper_comparison.py [--presets dgx1v dgx1p] [--size 500e6|64K|4M]
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import sys
import time
from pathlib import Path

import networkx as nx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jax_blink.planning import forms  # noqa: E402
from jax_blink.tools.simulate import MODEL, compare  # noqa: E402
from jax_blink.planning.topology import Topology  # noqa: E402
from jax_blink.planning.packing import plan as make_plan  # noqa: E402

DATE = "2026-11-25"
RESULTS = Path(__file__).resolve().parent / "results"
COLLECTIVES = ("broadcast", "reduce", "allreduce")
#: The paper's headline against NCCL on DGX-1V (abstract and Section 6).
PAPER = {"broadcast": "up to 8x, ~2x on average", "reduce": "(not reported separately)",
         "allreduce": "up to 6x, ~2x on average"}

FIELDS = ["preset", "allocation", "n", "collective", "root", "num_trees", "tree_rate_gbps",
          "bound_gbps", "num_rings", "ring_kind", "ring_rate_gbps", "tree_algbw_gbps",
          "ring_algbw_gbps", "rate_speedup", "size_bytes", "tree_time_us", "ring_time_us",
          "speedup", "form", "form_time_us", "runner_up", "trees_speedup", "iso_class", "plan_s"]


def _iso_classes(preset: str, allocs: list[tuple[int, ...]], collective: str, topo: Topology) -> dict:
    """Allocation -> id of its class up to isomorphism (link counts; the root marked for
    broadcast/reduce), so that the summary can also weigh each distinct shape once."""
    reps: dict[str, list[tuple[nx.MultiGraph, int]]] = {}
    out = {}
    next_id = 0
    for a in allocs:
        g = nx.Graph()
        sub = topo.subset(a)
        for u in a:
            g.add_node(u, root=(collective != "allreduce" and u == min(a)))
        for u, v in sub.simple_graph().edges:
            if u < v:
                g.add_edge(u, v, cap=round(sub.capacity(u, v), 6))
        h = nx.weisfeiler_lehman_graph_hash(g, edge_attr="cap", node_attr="root")
        for rep, cid in reps.get(h, []):
            if nx.is_isomorphic(g, rep, node_match=lambda x, y: x["root"] == y["root"],
                                edge_match=lambda x, y: x["cap"] == y["cap"]):
                out[a] = cid
                break
        else:
            reps.setdefault(h, []).append((g, next_id))
            out[a] = next_id
            next_id += 1
    return out


def run_preset(preset: str, size: float, method: str) -> tuple[list[dict], dict]:
    topo = Topology.preset(preset)
    allocs, skipped = [], []
    for k in range(3, 9):
        for a in itertools.combinations(range(8), k):
            (allocs if topo.subset(a).is_connected() else skipped).append(a)
    rows = []
    t_plan = {}
    for collective in COLLECTIVES:
        iso = _iso_classes(preset, allocs, collective, topo)
        t0 = time.perf_counter()
        for a in allocs:
            sub = topo.subset(a)
            root = None if collective == "allreduce" else min(a)
            t1 = time.perf_counter()
            p = make_plan(sub, collective, root, method=method)
            choice = forms.choose(sub, size, method=method) if collective == "allreduce" else None
            dt = time.perf_counter() - t1  # cold: every allocation is a topology of its own
            c = compare(sub, collective, size, plan=p)
            if choice is None:
                form, form_t, runner = "trees", c["tree_time_us"], ""
            else:
                form, form_t = choice.form.name, choice.form.time_us
                runner = choice.runner_up().name if choice.runner_up() else ""
            rows.append({
                "preset": preset, "allocation": ",".join(map(str, a)), "n": len(a),
                "collective": collective, "root": c["root"], "num_trees": c["num_trees"],
                "tree_rate_gbps": round(c["tree_rate"], 4), "bound_gbps": round(c["bound"], 4),
                "num_rings": c["num_rings"], "ring_kind": c["ring_kind"],
                "ring_rate_gbps": round(c["ring_rate"], 4),
                "tree_algbw_gbps": round(c["tree_algbw"], 4), "ring_algbw_gbps": round(c["ring_algbw"], 4),
                "rate_speedup": round(c["rate_speedup"], 4), "size_bytes": int(size),
                "tree_time_us": round(c["tree_time_us"], 2), "ring_time_us": round(c["ring_time_us"], 2),
                "speedup": round(c["ring_time_us"] / form_t, 4) if form_t > 0 else math.nan,
                "form": form, "form_time_us": round(form_t, 2), "runner_up": runner,
                "trees_speedup": round(c["speedup"], 4), "iso_class": iso[a], "plan_s": round(dt, 4),
            })
        t_plan[collective] = time.perf_counter() - t0
    info = {"allocations": len(allocs), "skipped": skipped, "seconds": t_plan}
    return rows, info


def geomean(xs) -> float:
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def summarise(preset: str, rows: list[dict], info: dict, size: float) -> list[str]:
    lines = [f"### {preset.upper()}: {info['allocations']} allocations of 3-8 GPUs connected over NVLink "
             f"({len(info['skipped'])} skipped: NVLinks do not connect them)", "",
             f"| collective | max speedup (allocation) | geomean, all allocations | geomean, distinct shapes "
             f"| min | allocations with speedup < 1 | NCCL on PCIe | rate >= 0.99 bound | paper (DGX-1V, measured) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for collective in COLLECTIVES:
        rs = [r for r in rows if r["collective"] == collective]
        if not rs:
            continue
        sp = [r["speedup"] for r in rs]
        best = max(rs, key=lambda r: r["speedup"])
        by_class = {}
        for r in rs:
            by_class.setdefault(r["iso_class"], r["speedup"])
        below = sum(1 for x in sp if x < 1 - 1e-9)
        pcie = sum(1 for r in rs if r["ring_kind"] == "pcie")
        ok = sum(1 for r in rs if r["tree_rate_gbps"] >= 0.99 * r["bound_gbps"] - 1e-9)
        lines.append(
            f"| {collective} | {best['speedup']:.2f}x ({{{best['allocation']}}}: "
            f"{best['tree_algbw_gbps']:g} vs {best['ring_algbw_gbps']:g} GB/s) | {geomean(sp):.2f}x "
            f"| {geomean(by_class.values()):.2f}x ({len(by_class)} shapes) | {min(sp):.2f}x | {below} "
            f"| {pcie} | {ok}/{len(rs)} | {PAPER[collective] if preset == 'dgx1v' else '-'} |")
    ar = [r for r in rows if r["collective"] == "allreduce"]
    if ar:
        sp, tsp = [r["speedup"] for r in ar], [r["trees_speedup"] for r in ar]
        counts: dict[str, int] = {}
        for r in ar:
            counts[r["form"]] = counts.get(r["form"], 0) + 1
        lines += ["", f"All-reduce, chosen form against rings: {sum(x < 1 - 1e-9 for x in sp)} of {len(ar)} "
                  f"allocations below rings, min {min(sp):.2f}x, geomean {geomean(sp):.2f}x (Blink's reduce + "
                  f"broadcast trees alone: {sum(x < 1 - 1e-9 for x in tsp)} below, min {min(tsp):.2f}x, "
                  f"geomean {geomean(tsp):.2f}x). Forms chosen: "
                  + ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])) + "."]
    rate_lines = []
    for collective in COLLECTIVES:
        rs = [r for r in rows if r["collective"] == collective]
        if rs:
            rate_lines.append(f"{collective}: max {max(r['rate_speedup'] for r in rs):.2f}x, "
                              f"geomean {geomean([r['rate_speedup'] for r in rs]):.2f}x")
    lines += ["", f"Speedup = ring time / our time at {_size_text(size)} per device through the "
              f"alpha-beta model (best chunk each; all-reduce: the chosen form). At the rate level (algbw "
              f"of the packed trees, no latency): " + "; ".join(rate_lines) + ".",
              "Planning time (cold, every allocation): " + ", ".join(
                  f"{c} {s:.1f} s" for c, s in info["seconds"].items())
              + f"; at most {max(r['plan_s'] for r in rows):.2f} s for one allocation (all-reduce: plan and forms)."]
    return lines


def _size_text(size: float) -> str:
    for unit, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= mult and size % mult == 0:
            return f"{size / mult:g} {unit}"
    return f"{size / 1e6:g} MB" if size >= 1e6 else f"{size:g} bytes"


def _size_arg(text: str) -> float:
    """``500e6``, ``65536``, ``64K``, ``4M``, ``1G`` (binary units) -> bytes (> 0)."""
    t = text.strip()
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(t[-1:].lower(), 1)
    try:
        v = float(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"--size takes bytes per device (500e6, 65536, 64K, 4M), got {text!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"--size must be > 0 bytes, got {text!r}")
    return v


def _size_tag(size: float) -> str:
    for unit, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size >= mult and size % mult == 0:
            return f"{int(size // mult)}{unit}"
    return f"{size / 1e6:g}MB" if size >= 1e6 else f"{int(size)}B"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["dgx1v", "dgx1p"])
    ap.add_argument("--size", type=_size_arg, default=500e6,
                    help="bytes per device for the model (500e6, 65536, 64K, 4M)")
    ap.add_argument("--method", default="exact", choices=["exact", "mwu"])
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    summary = [f"# Blink's trees against NCCL's rings, through the model, {_size_text(args.size)} per device "
               f"({DATE}, CPU only)", "",
               "Produced by `PYTHONPATH=. python benchmarks/paper_comparison.py` (no GPU: planner + "
               "`jax_blink.tools.simulate`). Trees are planned over NVLink only; NCCL's baseline is as many "
               "link-disjoint NVLink rings as the allocation holds, else one PCIe ring at "
               f"{MODEL['pcie_ring_gbps']:g} GB/s. Broadcast/reduce from the lowest GPU of the allocation. "
               f"Per-hop latency (us): {MODEL['alpha_us']}.", ""]
    all_rows = []
    for preset in args.presets:
        rows, info = run_preset(preset, args.size, args.method)
        all_rows += rows
        path = out / f"paper-{preset}-{_size_tag(args.size)}-cpu-model-{DATE}.csv"
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            w.writerows(rows)
        summary += summarise(preset, rows, info, args.size)
        summary += ["", f"Table: `{path.name}`.", ""]
    slow = [r for r in all_rows if r["collective"] == "allreduce" and r["speedup"] < 1 - 1e-9]
    summary += [
        "The paper measured real transfers on DGX-1V against NCCL and reports broadcast up to 8x and "
        "all-reduce up to 6x faster, both about 2x on average. The largest gaps, here as there, come from "
        "allocations whose NVLinks hold no Hamiltonian ring, where NCCL falls back to PCIe (the model takes "
        "10 GB/s for it; a slower real PCIe/QPI path would widen the broadcast gap towards the paper's 8x).",
        "",
        "All-reduce: Blink's reduce + broadcast trees moves as many bytes over the links as NCCL's rings "
        "(2(n-1) S in all), but its pipeline is 2D hops deep per chunk and many light trees pay that fill at "
        "their own fractional rates; at small and middle sizes that loses to the rings' 2(n-1) steps. The "
        "planner therefore prices every form the executors run and keeps the fastest: where the NVLinks "
        "hold rings, the ring form is one of them, priced by the same formula as the NCCL baseline, so no "
        f"row is slower than rings. Rows below rings: {len(slow)} of "
        f"{sum(r['collective'] == 'allreduce' for r in all_rows)} all-reduce rows.",
        "", f"Total run time {time.perf_counter() - t0:.1f} s.",
    ]
    text = "\n".join(summary) + "\n"
    (out / f"paper-{_size_tag(args.size)}-cpu-model-{DATE}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
