"""Where the time of chained collectives goes: kernel start, duration and gaps per GPU, from JAX's
profiler (CUPTI), for our all-reduce and for ``lax.psum`` on the same data.

    python benchmarks/trace_calls.py [--bytes 4M] [--k 20] [--warmup 2]

Prints, per GPU and call, the kernel's start (relative to the first kernel of the program on any
GPU), its duration and the idle gap before it on its stream; then the medians. A gap is host launch
pacing; a long duration with a late peer start is one GPU waiting for the other.
"""
from __future__ import annotations

import argparse
import glob
import statistics
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.profiler import ProfileData
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_blink
from jax_blink.tools.arguments import byte_count, whole_number
from jax_blink.tools.timing import chained as _chained


def _kernels(path: str, patterns: tuple[str, ...]) -> dict[str, list[tuple[float, float]]]:
    """(start_ns, duration_ns) of device events whose name contains one of ``patterns``, per device plane."""
    out: dict[str, list[tuple[float, float]]] = {}
    for plane in ProfileData.from_file(path).planes:
        if "/device:GPU" not in plane.name:
            continue
        for line in plane.lines:
            for e in line.events:
                if any(p in e.name for p in patterns):
                    out.setdefault(plane.name, []).append((e.start_ns, e.duration_ns))
    return {k: sorted(v) for k, v in out.items()}


def _names(path: str) -> list[str]:
    names = set()
    for plane in ProfileData.from_file(path).planes:
        if "/device:GPU" in plane.name:
            for line in plane.lines:
                for e in line.events:
                    names.add(e.name[:80])
    return sorted(names)


def host_events(path: str, top: int = 12) -> list[tuple[str, int, float, float]]:
    """The host's busiest event names in a trace: (name, count, total us, longest us), by total time.

    Every host thread's events count but Python frames, nested ones too (a parent's time includes its children's), so
    the list shows where the host spent the traced run: XLA's command-buffer updates, our
    handler's calls, the launches of each GPU's program.
    """
    total: dict[str, list[float]] = {}
    for plane in ProfileData.from_file(path).planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        for line in plane.lines:
            for e in line.events:
                if e.name.startswith("$"):  # Python frames (the profiler's Python tracer)
                    continue
                t = total.setdefault(e.name[:70], [0, 0.0, 0.0])
                t[0] += 1
                t[1] += e.duration_ns / 1e3
                t[2] = max(t[2], e.duration_ns / 1e3)
    rows = [(name, int(c), tot, mx) for name, (c, tot, mx) in total.items()]
    return sorted(rows, key=lambda r: -r[2])[:top]


def report(label: str, fn, x, pattern: tuple[str, ...], k: int, warmup: int = 2) -> None:
    for _ in range(warmup):  # the first compiles and runs op by op; XLA records its graphs on the second
        fn(x).block_until_ready()
    d = tempfile.mkdtemp()
    with jax.profiler.trace(d):
        fn(x).block_until_ready()
    path = glob.glob(d + "/**/*.xplane.pb", recursive=True)[0]
    ks = _kernels(path, pattern)
    if not ks:
        print(f"## {label}: no device events matching {pattern!r}; device event names: {_names(path)[:30]}")
        return
    t0 = min(v[0][0] for v in ks.values())
    print(f"## {label}: {k} chained calls; per GPU: start (us from first), duration (us), gap before (us)")
    for plane, evs in ks.items():
        gaps = [evs[i][0] - (evs[i - 1][0] + evs[i - 1][1]) for i in range(1, len(evs))]
        print(f"  {plane}: {len(evs)} kernels, median duration {statistics.median(e[1] for e in evs) / 1e3:.1f} us, "
              f"median gap {statistics.median(gaps) / 1e3 if gaps else 0:.1f} us, "
              f"span {(evs[-1][0] + evs[-1][1] - evs[0][0]) / 1e3:.1f} us")
        for i, (s, dur) in enumerate(evs[:6]):
            print(f"    #{i}: start {(s - t0) / 1e3:8.1f}  dur {dur / 1e3:7.1f}  gap {gaps[i - 1] / 1e3 if i else 0:7.1f}")
    print("  host, busiest events of the traced run (every thread, Python frames left out; nested events counted in their parents too):")
    print(f"    {'count':>6} {'total us':>10} {'longest us':>10}  name")
    for name, c, tot, mx in host_events(path):
        print(f"    {c:6d} {tot:10.1f} {mx:10.1f}  {name}")


def main() -> None:
    ap = argparse.ArgumentParser(description="Where the time of chained all-reduces goes, per GPU (CUPTI).")
    ap.add_argument("--bytes", type=byte_count, default="4M", help="bytes per rank, float32 (default 4M; at least 4)")
    ap.add_argument("--k", type=whole_number(1), default=20, help="chained calls per program (default 20)")
    ap.add_argument("--warmup", type=whole_number(1), default=2,
                    help="untraced runs before the traced one (default 2: XLA runs a command buffer's first "
                         "execution op by op and records the graph on the second, which a trace after one "
                         "warm-up measures; the bench's timed runs come after two)")
    a = ap.parse_args()
    if a.bytes < 4:
        ap.error(f"--bytes: got {a.bytes}; takes at least 4 (one float32 per rank)")
    devices = jax.devices()
    n = len(devices)
    mesh = jax.make_mesh((n,), ("x",), devices=devices)
    count = a.bytes // 4
    x = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal(n * count), jnp.float32),
                       NamedSharding(mesh, P("x")))
    ours = _chained(lambda v, ax: jax_blink.all_reduce(v, ax), mesh, "x", a.k, dispatch="blink")
    psum = _chained(lambda v, ax: lax.psum(v, ax), mesh, "x", a.k)
    # Our kernels: the tree kernel and the one-shot ones (executor 0.3.0).
    report("jax_blink.all_reduce", ours, x, ("collective_kernel", "ll_kernel", "oneshot_kernel"), a.k, a.warmup)
    # psum: NCCL's kernels, or XLA's own all-reduce kernels (named after the HLO op, "psum...").
    report("lax.psum", psum, x, ("nccl", "psum", "all-reduce", "all_reduce"), a.k, a.warmup)


if __name__ == "__main__":
    main()
