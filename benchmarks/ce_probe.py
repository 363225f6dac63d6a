"""How fast the copy engines move bytes between GPUs when several peers are copied at once (GPUs, CuPy).

    python benchmarks/ce_probe.py [--bytes 256M] [--runs 10] [--out FILE.md]

The copy-engine all-reduce (kernels/cuda/async_ce.cc) copies from every peer at once, one stream
per peer. On 4 x H200 it reached 235 GB/s bus bandwidth at 1 GiB against 333 on 3 of those GPUs
(benchmarks/NOTES.md, change 19). This probe measures the copies alone, no reduction, no XLA:
every GPU at the same time copies ``--bytes`` from (pull) or to (push) each of k peers
(``cudaMemcpyPeerAsync``), for k = 1 .. n - 1, the k copies either on k streams (at once) or on
one stream (one after another). Each pattern runs ``--runs`` times after a warm-up; a run's time is
the host's wall time from the first copy enqueued to the last GPU synchronised. The table gives,
per pattern, the median time and the MEASURED bytes per second that each GPU received (pull) or
sent (push): k x bytes / time. Peer rank of copy i on GPU g: (g + i) mod n, as the all-reduce
orders them.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def _fmt(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def table(rows: list[dict], n: int, kind: str, nbytes: int) -> str:
    """Markdown: one row per pattern, what each number is in the header."""
    lines = [f"# benchmarks/ce_probe.py, {n} x {kind}, {_fmt(nbytes)} per copy, {time.strftime('%Y-%m-%d')}, measured",
             "",
             "| direction | peers per GPU (k) | streams per GPU | median time (us) | per GPU (GB/s, k x bytes / time) | spread |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['direction']} | {r['peers']} | {r['streams']} | {r['time_us']:.1f} | {r['gbps']:.1f} "
                     f"| {100 * r['spread']:.0f}% |")
    return "\n".join(lines)


def run(nbytes: int, runs: int) -> tuple[list[dict], int, str]:
    import cupy as cp

    n = cp.cuda.runtime.getDeviceCount()
    if n < 2:
        raise SystemExit(f"ce_probe.py: needs 2 or more GPUs (here: {n})")
    kind = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    bufs, streams = [], []
    for g in range(n):
        with cp.cuda.Device(g):
            for p in range(n):
                if p != g:
                    try:
                        cp.cuda.runtime.deviceEnablePeerAccess(p)
                    except cp.cuda.runtime.CUDARuntimeError as e:  # enabled already: fine
                        if "AlreadyEnabled" not in str(e):
                            raise
            # One source and n - 1 destination slots per GPU, filled so that no page is untouched.
            bufs.append((cp.full(nbytes // 4, g + 1, cp.float32), cp.zeros((n - 1, nbytes // 4), cp.float32)))
            streams.append([cp.cuda.Stream(non_blocking=True) for _ in range(n - 1)])

    def once(direction: str, k: int, parallel: bool) -> float:
        t0 = time.perf_counter()
        for g in range(n):
            with cp.cuda.Device(g):
                for i in range(1, k + 1):
                    p = (g + i) % n
                    s = streams[g][i - 1 if parallel else 0]
                    if direction == "pull":  # g's slot i - 1 <- p's source
                        dst, ddev, src, sdev = bufs[g][1][i - 1].data.ptr, g, bufs[p][0].data.ptr, p
                    else:  # p's slot i - 1 <- g's source
                        dst, ddev, src, sdev = bufs[p][1][i - 1].data.ptr, p, bufs[g][0].data.ptr, g
                    cp.cuda.runtime.memcpyPeerAsync(dst, ddev, src, sdev, nbytes, s.ptr)
        for g in range(n):
            with cp.cuda.Device(g):
                cp.cuda.runtime.deviceSynchronize()
        return time.perf_counter() - t0

    rows = []
    for direction in ("pull", "push"):
        for k in range(1, n):
            for parallel in ((False, True) if k > 1 else (True,)):
                once(direction, k, parallel)  # warm-up
                times = [once(direction, k, parallel) for _ in range(runs)]
                t = statistics.median(times)
                q = statistics.quantiles(times, n=4) if len(times) > 1 else [t, t, t]
                rows.append(dict(direction=direction, peers=k, streams=k if parallel else 1, time_us=t * 1e6,
                                 gbps=k * nbytes / t / 1e9, spread=(q[2] - q[0]) / t, runs=runs))
                print(f"{direction} k={k} streams={rows[-1]['streams']}: {t * 1e6:.1f} us, "
                      f"{rows[-1]['gbps']:.1f} GB/s per GPU (measured)", flush=True)
    # The copies must have landed: every slot holds its source GPU's value (pull) or the sender's (push).
    for g in range(n):
        with cp.cuda.Device(g):
            got = {int(v) for v in cp.unique(bufs[g][1][:, :1024]).get()}
            if not got <= set(range(1, n + 1)) - {g + 1}:
                raise SystemExit(f"ce_probe.py: GPU {g}'s slots hold {sorted(got)}: the copies went wrong")
    return rows, n, kind


def main(argv=None) -> int:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from jax_blink.tools import arguments as cli

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bytes", default=256 << 20, type=cli.byte_count, help="bytes per copy (default 256M)")
    ap.add_argument("--runs", type=cli.whole_number(1, 1000), default=10, help="timed runs per pattern")
    ap.add_argument("--out", help="write the table to this Markdown file")
    args = ap.parse_args(argv)
    if args.bytes < 4096 or args.bytes % 16:
        ap.error(f"--bytes: got {args.bytes}; takes at least 4K, a multiple of 16")
    try:
        import cupy  # noqa: F401
    except ImportError:
        ap.error("needs CuPy (pip install cupy-cuda13x) and 2 or more GPUs")
    rows, n, kind = run(args.bytes, args.runs)
    text = table(rows, n, kind, args.bytes)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
