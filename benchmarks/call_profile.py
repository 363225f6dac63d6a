"""Where the time of one chained call goes on one GPU: host code, launch, kernel, gap.

Traces one run of each row of benchmarks/xla_call_overhead.py (K chained calls in one jitted
program) with JAX's profiler (CUPTI: device kernels with GPU timestamps, driver/runtime API calls
and XLA's host annotations on the host clock) and prints per row:
  device: kernels of the chain, their median duration, the median idle gap between two of them
          and the median period (start to start);
  host:   every host event name that occurs about once per call (count >= K/2), with its count
          and median duration, so that the handler's own code, XLA's thunk around it and the
          launch API call can be told apart.
``--dump DIR`` writes every event of each trace as CSV (kind, line, name, start_us, dur_us;
times relative to the first kernel of the chain) for a closer look.

    python benchmarks/call_profile.py [--k 20] [--dump DIR]
"""
from __future__ import annotations

import argparse
import collections
import csv
import glob
import os
import re
import statistics
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax.profiler import ProfileData

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import xla_call_overhead as probe  # noqa: E402  (the chains being profiled)

from jax_blink.lowering import backends as _backends  # noqa: E402

_MEMCPY = re.compile(r"memcpy|memset", re.I)


def _norm(name: str) -> str:
    """One name per kind of event: XLA's per-op suffixes (.12, :#...#) folded away."""
    name = name.split("#")[0].split(":")[0] if name.startswith(("custom-call", "fusion", "loop_")) else name
    return re.sub(r"[._]\d+\b", "", name)[:90]


def trace(fn, x) -> ProfileData:
    fn(x).block_until_ready()
    fn(x).block_until_ready()
    d = tempfile.mkdtemp()
    with jax.profiler.trace(d):
        fn(x).block_until_ready()
    return ProfileData.from_file(glob.glob(d + "/**/*.xplane.pb", recursive=True)[0])


def events(pd: ProfileData):
    """(kind, plane/line, name, start_ns, dur_ns) of every event; kind 'device' or 'host'."""
    for plane in pd.planes:
        kind = "device" if "/device:GPU" in plane.name else "host"
        for line in plane.lines:
            if kind == "host" and line.name == "python":
                continue  # Python frames: the run's start and end, not per call
            for e in line.events:
                yield kind, f"{plane.name}|{line.name}", e.name, float(e.start_ns), float(e.duration_ns)


def report(label: str, fn, x, k: int, dump: str | None) -> None:
    evs = list(events(trace(fn, x)))
    kernels: dict[str, list[tuple[float, float, str]]] = collections.defaultdict(list)
    for kind, where, name, t, d in evs:
        if kind == "device" and not _MEMCPY.search(name) and d > 0:
            kernels[where].append((t, d, name))
    line, ks = max(kernels.items(), key=lambda kv: len(kv[1]), default=("", []))
    ks.sort()
    print(f"\n## {label}: {len(ks)} kernels on {line or 'no device line'}")
    if len(ks) >= 2:
        durs = [d for _, d, _ in ks]
        gaps = [ks[i][0] - (ks[i - 1][0] + ks[i - 1][1]) for i in range(1, len(ks))]
        period = [ks[i][0] - ks[i - 1][0] for i in range(1, len(ks))]
        names = collections.Counter(_norm(n) for _, _, n in ks)
        print(f"  device: kernel {statistics.median(durs) / 1e3:.2f} us (min {min(durs) / 1e3:.2f}), "
              f"gap {statistics.median(gaps) / 1e3:.2f} us (min {min(gaps) / 1e3:.2f}), "
              f"period {statistics.median(period) / 1e3:.2f} us; span {(ks[-1][0] + ks[-1][1] - ks[0][0]) / 1e3:.1f} us; "
              f"names {dict(names.most_common(3))}")
    t0 = ks[0][0] if ks else 0.0
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for kind, where, name, t, d in evs:
        if kind == "host":
            by_name[_norm(name)].append(d)
    per_call = sorted(((n, v) for n, v in by_name.items() if len(v) >= k // 2), key=lambda nv: -statistics.median(nv[1]))
    for n, v in per_call[:25]:
        print(f"  host: {n:<60} x{len(v):<4} median {statistics.median(v) / 1e3:8.2f} us")
    if dump:
        os.makedirs(dump, exist_ok=True)
        path = os.path.join(dump, re.sub(r"\W+", "_", label).strip("_") + ".csv")
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["kind", "line", "name", "start_us", "dur_us"])
            for kind, where, name, t, d in sorted(evs, key=lambda e: e[3]):
                w.writerow([kind, where, name[:200], f"{(t - t0) / 1e3:.3f}", f"{d / 1e3:.3f}"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--elems", type=int, default=256)
    ap.add_argument("--dump", help="write every event of each trace as CSV under this folder")
    a = ap.parse_args()
    if not _backends.register("gpu" if jax.default_backend() == "gpu" else "cpu"):
        raise SystemExit("no jax_blink executor")
    x = jnp.asarray(np.random.default_rng(0).standard_normal(a.elems), jnp.float32)
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, "
          f"{a.k} chained calls")
    for name, make in probe.rows(a.elems, x):
        report(name, make(a.k), x, a.k, a.dump)


if __name__ == "__main__":
    main()
