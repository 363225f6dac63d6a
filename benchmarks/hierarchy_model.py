"""The cost model of all-reduce over k hosts (jax_blink.tools.simulate.model_times_us).

Blink's three phases (trees inside the host, a ring among hosts of each GPU's piece over its own
NIC) against NCCL's flat rings over all GPUs and NCCL-style hierarchical rings, for 2 to 16 hosts,
25 / 50 / 100 GB/s per GPU between hosts, 1 MiB to 1 GiB per GPU; inside each host a full DGX-1V
(8 GPUs) and, as the paper's partial allocations, 6 of its GPUs (0, 1, 3, 4, 5, 7: a job that got
those). Pure model, no devices:

    python benchmarks/hierarchy_model.py [--out benchmarks/results/hierarchy-model-dgx1v]

writes OUT.csv (every point), OUT.md (the table at 256 MiB) and OUT.png (algbw against size).
"""
from __future__ import annotations

import argparse
import csv
from pathlib import Path

from jax_blink.tools.simulate import model_times_us
from jax_blink.planning.topology import Topology

HOSTS = (2, 4, 8, 16)
NET_GBPS = (25.0, 50.0, 100.0)
SIZES = [1 << p for p in range(20, 31, 2)]  # 1 MiB .. 1 GiB
ALGOS = ("blink_3phase", "nccl_hier_rings", "flat_ring")
INSIDE = {"dgx1v": Topology.preset("dgx1v"), "dgx1v[0,1,3,4,5,7]": Topology.preset("dgx1v").subset([0, 1, 3, 4, 5, 7])}


def rows():
    for name, inside in INSIDE.items():
      for hosts in HOSTS:
        for net in NET_GBPS:
            for size in SIZES:
                t = model_times_us(hosts, net, size, inside)
                yield {"inside": name, "hosts": hosts, "gpus": inside.n * hosts, "net_gbps_per_gpu": net, "bytes": size,
                       **{f"{a}_us": round(t[a], 2) for a in ALGOS},
                       **{f"{a}_algbw_gbps": round(size / t[a] / 1e3, 2) for a in ALGOS},
                       "speedup_vs_hier_rings": round(t["nccl_hier_rings"] / t["blink_3phase"], 3),
                       "speedup_vs_flat_ring": round(t["flat_ring"] / t["blink_3phase"], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/hierarchy-model-dgx1v")
    out = Path(ap.parse_args().out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = list(rows())
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(data[0]))
        w.writeheader()
        w.writerows(data)
    table = ["| inside a host | hosts | GB/s per GPU between hosts | Blink 3-phase (ms) | hierarchical rings (ms) | flat ring (ms) "
             "| vs hier. rings | vs flat ring |", "|---|---|---|---|---|---|---|---|"]
    for r in data:
        if r["bytes"] == 1 << 28:
            table.append(f"| {r['inside']} | {r['hosts']} | {r['net_gbps_per_gpu']:g} | {r['blink_3phase_us'] / 1e3:.2f} | "
                         f"{r['nccl_hier_rings_us'] / 1e3:.2f} | {r['flat_ring_us'] / 1e3:.2f} | "
                         f"{r['speedup_vs_hier_rings']:.2f}x | {r['speedup_vs_flat_ring']:.2f}x |")
    text = ("All-reduce of 256 MiB per GPU over k hosts (model: jax_blink.tools.simulate.model_times_us)\n\n"
            + "\n".join(table) + "\n")
    out.with_suffix(".md").write_text(text)
    print(text)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(len(INSIDE), len(NET_GBPS), figsize=(5 * len(NET_GBPS), 4 * len(INSIDE)), sharey=True)
    styles = {"blink_3phase": "-", "nccl_hier_rings": "--", "flat_ring": ":"}
    for axes, name in zip(grid, INSIDE):
      for ax, net in zip(axes, NET_GBPS):
        for hosts in (2, 16):
            for a in ALGOS:
                pts = [r for r in data if r["inside"] == name and r["hosts"] == hosts and r["net_gbps_per_gpu"] == net]
                ax.plot([r["bytes"] for r in pts], [r[f"{a}_algbw_gbps"] for r in pts], styles[a],
                        marker="o" if hosts == 2 else "s", ms=3, label=f"{a}, {hosts} hosts")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{name}, {net:g} GB/s per GPU between hosts", fontsize=9)
        ax.set_xlabel("bytes per GPU")
        ax.grid(True, alpha=0.3)
      axes[0].set_ylabel("algbw (GB/s, model)")
    grid[0][-1].legend(fontsize=7)
    fig.suptitle("All-reduce over k hosts: three phases vs rings (alpha-beta model)")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
