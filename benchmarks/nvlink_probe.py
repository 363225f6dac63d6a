"""What NVLink through a switch carries when every GPU moves data at once, by traffic pattern.

Each GPU runs one copy kernel at the same time (one thread per GPU launches, then all are timed
between two host barriers):
  push-all   every GPU writes B bytes into each of its n-1 peers (an all-to-all of writes: the
             pattern of a two-shot all-reduce by remote writes)
  pull-all   every GPU reads B bytes from each of its n-1 peers (the pattern of the star trees'
             reduce: the root reads its children's operands)
  push-ring  every GPU writes (n-1) B bytes into its next GPU only (NCCL's ring pattern)
Reported per GPU: bytes leaving it (push) or reaching it (pull) per second, MEASURED, GB/s, and
what an all-reduce of that pattern would reach in bus bandwidth (2(n-1)/n x N per direction, the
same bytes on every link: the per-direction rate itself).

    python benchmarks/nvlink_probe.py --bytes 256M --blocks 132 [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time

KERNEL = r"""
extern "C" __global__ void copy_many(const uint4* const* srcs, uint4* const* dsts, int pairs, long long n16) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (int k = 0; k < pairs; ++k) {
    const int j = (k + blockIdx.x) % pairs;  // blocks start on different peers: every link busy at once
    const uint4* s = srcs[j];
    uint4* d = dsts[j];
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += 4 * stride) {
      uint4 v0 = __ldcg(s + i), v1, v2, v3;
      const bool b1 = i + stride < n16, b2 = i + 2 * stride < n16, b3 = i + 3 * stride < n16;
      if (b1) v1 = __ldcg(s + i + stride);
      if (b2) v2 = __ldcg(s + i + 2 * stride);
      if (b3) v3 = __ldcg(s + i + 3 * stride);
      d[i] = v0;
      if (b1) d[i + stride] = v1;
      if (b2) d[i + 2 * stride] = v2;
      if (b3) d[i + 3 * stride] = v3;
    }
  }
}
"""


def parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper()
    return int(t[:-1]) * units[t[-1]] if t[-1:] in units else int(t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bytes", type=parse_bytes, default=parse_bytes("256M"), help="B: bytes per peer (default 256M)")
    ap.add_argument("--blocks", type=int, default=132)
    ap.add_argument("--threads", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    import cupy as cp

    n = cp.cuda.runtime.getDeviceCount()
    if n < 2:
        print("needs 2 or more GPUs", file=sys.stderr)
        return 2
    for i in range(n):
        with cp.cuda.Device(i):
            for j in range(n):
                if i != j:
                    try:
                        cp.cuda.runtime.deviceEnablePeerAccess(j)
                    except cp.cuda.runtime.CUDARuntimeError:
                        pass
    n16 = a.bytes // 16
    bufs, kern = [], []
    for i in range(n):  # per GPU: a source and a landing region per peer
        with cp.cuda.Device(i):
            bufs.append({"src": [cp.random.random(n16 * 2, dtype=cp.float64) for _ in range(n)],
                         "dst": [cp.empty(n16 * 2, dtype=cp.float64) for _ in range(n)]})
            kern.append(cp.RawKernel(KERNEL, "copy_many"))

    def plan(pattern, i):
        peers = [j for j in range(n) if j != i]
        if pattern == "push-all":
            return [(bufs[i]["src"][j], bufs[j]["dst"][i]) for j in peers]
        if pattern == "pull-all":
            return [(bufs[j]["src"][i], bufs[i]["dst"][j]) for j in peers]
        nxt = (i + 1) % n  # push-ring: (n-1) B to the next GPU, in n-1 pieces
        return [(bufs[i]["src"][j], bufs[nxt]["dst"][j]) for j in peers]

    rows = []
    for pattern in ("push-all", "pull-all", "push-ring"):
        args = []
        for i in range(n):
            with cp.cuda.Device(i):
                pl = plan(pattern, i)
                srcs = cp.asarray([s.data.ptr for s, _ in pl], dtype=cp.uint64)
                dsts = cp.asarray([d.data.ptr for _, d in pl], dtype=cp.uint64)
                args.append((srcs, dsts, len(pl)))
        times = []
        for _ in range(a.reps + 1):
            for i in range(n):
                cp.cuda.Device(i).synchronize()
            barrier = threading.Barrier(n)

            def launch(i):
                with cp.cuda.Device(i):
                    srcs, dsts, pairs = args[i]
                    barrier.wait()
                    kern[i]((a.blocks,), (a.threads,), (srcs, dsts, cp.int32(pairs), cp.int64(n16)))
                    cp.cuda.Device(i).synchronize()

            t0 = time.perf_counter()
            ths = [threading.Thread(target=launch, args=(i,)) for i in range(n)]
            for t in ths:
                t.start()
            for t in ths:
                t.join()
            times.append(time.perf_counter() - t0)
        t = sorted(times[1:])[len(times[1:]) // 2]
        per_gpu = (n - 1) * a.bytes / t / 1e9
        rows.append({"pattern": pattern, "gpus": n, "bytes_per_peer": a.bytes, "seconds": t, "gbps_per_gpu": per_gpu})
        print(f"{pattern:>10}: {n} GPUs, {(n - 1) * a.bytes / 2**20:.0f} MiB per GPU, {t * 1e3:.2f} ms: "
              f"{per_gpu:.1f} GB/s per GPU per direction (MEASURED, host-timed, {a.blocks} blocks x {a.threads})")
    name = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": name, "date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
