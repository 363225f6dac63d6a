"""How fast each GPU moves bytes to and from its peers when several peers are served at once (GPUs, CuPy).

    python benchmarks/link_probe.py [--bytes 256M] [--runs 10] [--engines ce,sm,tma,host,mix] [--out FILE.md]

The ceiling that an all-reduce on these links is held against, measured without reductions, flags
or XLA: every GPU at the same time moves ``--bytes`` to (push) or from (pull) each of k peers, for
k = 1 .. n - 1. Peer of copy i on GPU g: (g + i) mod n, as the all-reduces order them.

- ``ce``, copy engines (``cudaMemcpyPeerAsync``), pull and push: the k copies on k streams (at
  once) or on one stream (one after another); and pushes on k streams cut into copies of 16 MiB
  (as the copy-engine all-reduce cuts its chunks). A run's time is the host's wall time from the
  first copy enqueued to the last GPU synchronised.
- ``sm``, a kernel's 16-byte stores into the peers (push), as the executor's kernels write, or its
  16-byte loads from the peers into this GPU (pull), on every SM (the grid of the two-shot kernel)
  or half of them; ``serial`` serves each peer the whole buffer in turn, ``spread`` alternates
  between the peers every 32 KiB per block (JAX_BLINK_TWOSHOT_PUSH). A run's time is the longest of
  the GPUs' kernels, timed by CUDA events around each.
- ``host``, copy engines between each GPU and pinned host memory (``cudaMemcpyAsync``), what
  Blink's host transfer would add beside NVLink: device to host, host to device, and both at once
  (two streams), with 1 .. n GPUs copying at the same time (their host links and the host's memory
  are shared); then both directions at once beside the copy engines' pushes to all n - 1 peers,
  each timed by its own streams' events, to see whether either slows the other. Per GPU one
  pinned buffer each way (``cudaHostAllocPortable``), allocated by one thread (the host's NUMA
  placement is not chosen).
- ``tma``, Hopper's bulk copies (``cp.async.bulk``, one thread per block): tiles of 8 KiB loaded
  into shared memory (4 stages) and written from there into the peers (push), on every SM;
  ``serial`` as above, ``spread`` writes each tile to every peer. Timed like ``sm``. Whether bulk
  writes carry more across NVLink than 16-byte stores (which top out at 322-338 GB/s per GPU on
  4 x H200) is what it asks.
- ``mix``, both at once: every GPU pushes to its k peers, the first share of each peer's bytes on
  copy engines (a stream per peer) and the rest by the ``sm`` kernel's stores (every SM, its own
  stream), for shares 0, 25, 50, 75 and 100% on the copy engines; timed by the host from the
  first launch to the last GPU synchronised (so 0% and 100% are the two engines alone, timed the
  same way). Whether NVLink carries more per GPU with both engines writing than with either alone
  (copy engines 372-377, stores 322-338 GB/s on 4 x H200) is what it asks: the bound of a two-shot
  all-reduce that splits its pushes between them.

Each pattern runs ``--runs`` times after a warm-up, from zeroed destinations, and then every byte
is checked: the destinations it fills hold their sender's value, the others still 0. The table gives per
pattern the median time and the MEASURED bytes per second that each GPU sent (push) or received
(pull): k x bytes / time.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

#: The SM probe's kernels: dsts[d][i] = srcs[d][i], 512 threads, 4 vectors of 16 bytes in flight
#: per thread, as the executor's copy loops (kernels/cuda/device_kernels.cuh, copy_range). Push:
#: this GPU's buffer into the peers, plain loads; pull: the peers' buffers into this GPU, loads with
#: ld.global.cg, as the executor reads peers.
SM_KERNEL = r"""
template <bool kFromPeers>
__device__ void move(uint4* const* dsts, const uint4* const* srcs, int k, long long nvec, int spread) {
  const long long per = (nvec + gridDim.x - 1) / gridDim.x, lo = per * blockIdx.x;
  const long long hi = lo + per < nvec ? lo + per : nvec;
  const int rounds = spread ? 1 : k;
  for (int pass = 0; pass < rounds; ++pass)
    for (long long base = lo + threadIdx.x; base < hi; base += 512 * 4)
      for (int d = spread ? 0 : pass; d < (spread ? k : pass + 1); ++d) {
        uint4 raw[4];
#pragma unroll
        for (int r = 0; r < 4; ++r)
          if (base + r * 512 < hi) raw[r] = kFromPeers ? __ldcg(srcs[d] + base + r * 512) : srcs[d][base + r * 512];
#pragma unroll
        for (int r = 0; r < 4; ++r) if (base + r * 512 < hi) dsts[d][base + r * 512] = raw[r];
      }
}

extern "C" __global__ void __launch_bounds__(512) push_peers(uint4* const* dsts, const uint4* const* srcs, int k,
                                                           long long nvec, int spread) {
  move<false>(dsts, srcs, k, nvec, spread);
}

extern "C" __global__ void __launch_bounds__(512) pull_peers(uint4* const* dsts, const uint4* const* srcs, int k,
                                                           long long nvec, int spread) {
  move<true>(dsts, srcs, k, nvec, spread);
}
"""


#: The bulk-copy probe's kernel (sm_90): thread 0 of each block loads tiles with
#: cp.async.bulk into shared memory (completion on an mbarrier) and writes each from there into a
#: peer (or every peer) with cp.async.bulk; a stage is reloaded once its writes have read it.
TMA_KERNEL = r"""
#define TILE 8192
#define STAGES 4
extern "C" __global__ void __launch_bounds__(32) tma_push(const char* src, char* const* dsts, int k,
                                                        long long nbytes, int spread) {
  __shared__ alignas(128) char buf[STAGES][TILE];
  __shared__ alignas(8) unsigned long long bar[STAGES];
  if (threadIdx.x != 0) return;
  const long long tiles_all = (nbytes + TILE - 1) / TILE;
  const long long per = (tiles_all + gridDim.x - 1) / gridDim.x, t0 = per * blockIdx.x;
  const long long t1 = t0 + per < tiles_all ? t0 + per : tiles_all;
  if (t0 >= t1) return;
  for (int s = 0; s < STAGES; ++s) {
    unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(&bar[s]));
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(a) : "memory");
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  // Work items: (pass, tile); serial: pass d sends every tile to peer d; spread: one pass, each
  // tile to every peer.
  const int passes = spread ? 1 : k;
  const long long n = (t1 - t0) * passes;
  auto size_of = [&](long long t) { long long r = nbytes - t * TILE; return static_cast<unsigned>(r < TILE ? r : TILE); };
  auto tile_of = [&](long long w) { return t0 + w % (t1 - t0); };
  auto load = [&](long long w) {
    const int s = static_cast<int>(w % STAGES);
    const long long t = tile_of(w);
    unsigned b = static_cast<unsigned>(__cvta_generic_to_shared(&bar[s]));
    unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(buf[s]));
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(size_of(t)) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(d), "l"(src + t * TILE), "r"(size_of(t)), "r"(b) : "memory");
  };
  for (long long w = 0; w < n && w < STAGES; ++w) load(w);
  for (long long w = 0; w < n; ++w) {
    const int s = static_cast<int>(w % STAGES);
    const unsigned parity = static_cast<unsigned>((w / STAGES) & 1);
    unsigned b = static_cast<unsigned>(__cvta_generic_to_shared(&bar[s]));
    unsigned done = 0;
    while (!done)
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(done) : "r"(b), "r"(parity) : "memory");
    const long long t = tile_of(w);
    unsigned from = static_cast<unsigned>(__cvta_generic_to_shared(buf[s]));
    const int first = spread ? 0 : static_cast<int>(w / (t1 - t0)), last = spread ? k : first + 1;
    for (int d = first; d < last; ++d)
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                   ::"l"(dsts[d] + t * TILE), "r"(from), "r"(size_of(t)) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (w + STAGES < n) {
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");  // stage s read by its stores
      load(w + STAGES);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
"""


def _fmt(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def table(rows: list[dict], n: int, kind: str, nbytes: int) -> str:
    """Markdown: one row per pattern, what each number is in the header."""
    lines = [f"# benchmarks/link_probe.py, {n} x {kind}, {_fmt(nbytes)} per peer, {time.strftime('%Y-%m-%d')}, measured",
             "",
             "| engine | direction | peers per GPU (k) | how | median time (us) | per GPU (GB/s, k x bytes / time) | spread |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['engine']} | {r['direction']} | {r['peers']} | {r['how']} | {r['time_us']:.1f} "
                     f"| {r['gbps']:.1f} | {100 * r['spread']:.0f}% |")
    return "\n".join(lines)


def _ce_bytes(nbytes: int, share: float) -> int:
    """The copy engines' part of ``nbytes`` in the ``mix`` patterns: whole 16-byte vectors."""
    return int(round(nbytes * share / 16)) * 16


def _row(engine: str, direction: str, k: int, how: str, times: list[float], nbytes: int) -> dict:
    t = statistics.median(times)
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [t, t, t]
    row = dict(engine=engine, direction=direction, peers=k, how=how, time_us=t * 1e6, gbps=k * nbytes / t / 1e9,
               spread=(q[2] - q[0]) / t, runs=len(times))
    print(f"{engine} {direction} k={k} {how}: {row['time_us']:.1f} us, {row['gbps']:.1f} GB/s per GPU (measured)",
          flush=True)
    return row


def run(nbytes: int, runs: int, engines: list[str]) -> tuple[list[dict], int, str]:
    import cupy as cp

    n = cp.cuda.runtime.getDeviceCount()
    if n < 2:
        raise SystemExit(f"link_probe.py: needs 2 or more GPUs (here: {n})")
    props = cp.cuda.runtime.getDeviceProperties(0)
    kind, sms = props["name"].decode(), props["multiProcessorCount"]
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

    def slot(dst_gpu: int, src_gpu: int):  # dst_gpu's slot for what src_gpu sends it
        return bufs[dst_gpu][1][(src_gpu - dst_gpu - 1) % n]

    def sync_all():
        for g in range(n):
            with cp.cuda.Device(g):
                cp.cuda.runtime.deviceSynchronize()

    def once_ce(direction: str, k: int, parallel: bool, piece: int = 0) -> float:
        piece = piece or nbytes
        t0 = time.perf_counter()
        for g in range(n):
            with cp.cuda.Device(g):
                for i in range(1, k + 1):
                    p = (g + i) % n
                    s = streams[g][i - 1 if parallel else 0]
                    d, dd, src, sd = (slot(g, p), g, bufs[p][0], p) if direction == "pull" else (slot(p, g), p, bufs[g][0], g)
                    for off in range(0, nbytes, piece):
                        cp.cuda.runtime.memcpyPeerAsync(d.data.ptr + off, dd, src.data.ptr + off, sd,
                                                        min(piece, nbytes - off), s.ptr)
        sync_all()
        return time.perf_counter() - t0

    def timed(launch) -> float:  # launch(g, stream) on every GPU at once; the longest kernel, by events
        events = []
        for g in range(n):
            with cp.cuda.Device(g):
                s, e0, e1 = streams[g][0], cp.cuda.Event(), cp.cuda.Event()
                e0.record(s)
                launch(g, s)
                e1.record(s)
                events.append((e0, e1))
        sync_all()
        return max(cp.cuda.get_elapsed_time(e0, e1) for e0, e1 in events) / 1e3

    def pointers(arrays):
        return cp.array([a.data.ptr for a in arrays], dtype=cp.uint64)

    hosts = []  # per GPU: (pinned source of its host-to-device copy, pinned destination of its
    # device-to-host copy, device destination of the host-to-device copy), numpy views on the host
    if "host" in engines:
        import ctypes

        import numpy as np

        def pinned(fill: float):
            ptr = cp.cuda.runtime.hostAlloc(nbytes, 1)  # cudaHostAllocPortable: pinned for every GPU
            view = np.ctypeslib.as_array((ctypes.c_float * (nbytes // 4)).from_address(ptr))
            view[:] = fill
            return ptr, view

        for g in range(n):
            with cp.cuda.Device(g):
                hosts.append((pinned(100 + g), pinned(0), cp.zeros(nbytes // 4, cp.float32)))

    kernels, tables, tma = [], [], []
    for g in range(n):
        peers = [(g + i) % n for i in range(1, n)]
        with cp.cuda.Device(g):
            if "sm" in engines or "mix" in engines:
                module = cp.RawModule(code=SM_KERNEL, options=("-std=c++17",))
                kernels.append({"push": module.get_function("push_peers"), "pull": module.get_function("pull_peers")})
                # (destinations, sources) per direction
                tables.append({"push": (pointers([slot(p, g) for p in peers]), pointers([bufs[g][0]] * (n - 1))),
                               "pull": (pointers([slot(g, p) for p in peers]), pointers([bufs[p][0] for p in peers]))})
            if "tma" in engines:
                tma.append((cp.RawModule(code=TMA_KERNEL, options=("-std=c++17",)).get_function("tma_push"),
                            pointers([slot(p, g) for p in peers])))

    def once_tma(k: int, spread: bool) -> float:
        return timed(lambda g, s: tma[g][0]((sms,), (32,), (bufs[g][0], tma[g][1], cp.int32(k), cp.int64(nbytes),
                                                            cp.int32(spread)), stream=s))

    def once_sm(direction: str, k: int, grid: int, spread: bool) -> float:
        return timed(lambda g, s: kernels[g][direction]((grid,), (512,), (*tables[g][direction], cp.int32(k),
                                                                          cp.int64(nbytes // 16), cp.int32(spread)),
                                                        stream=s))

    shares = (0.0, 0.25, 0.5, 0.75, 1.0)
    # Per GPU and share: the kernel's (destinations, sources) past the copy engines' part.
    mix_tables, mix_streams = [], []
    if "mix" in engines:
        for g in range(n):
            peers = [(g + i) % n for i in range(1, n)]
            with cp.cuda.Device(g):
                mix_streams.append(cp.cuda.Stream(non_blocking=True))
                mix_tables.append({})
                for share in shares:
                    off = _ce_bytes(nbytes, share) // 4
                    mix_tables[g][share] = (pointers([slot(p, g)[off:] for p in peers]),
                                            pointers([bufs[g][0][off:]] * (n - 1)))

    def once_mix(k: int, share: float) -> float:
        """k peers per GPU: the first ``share`` of each peer's bytes on copy engines, the rest by the
        kernel's stores, all at once on every GPU; the host's time to the last synchronisation."""
        ce = _ce_bytes(nbytes, share)
        t0 = time.perf_counter()
        for g in range(n):
            with cp.cuda.Device(g):
                if ce < nbytes:
                    kernels[g]["push"]((sms,), (512,), (*mix_tables[g][share], cp.int32(k),
                                                        cp.int64((nbytes - ce) // 16), cp.int32(0)),
                                       stream=mix_streams[g])
                for i in range(1, k + 1):
                    if ce:
                        p = (g + i) % n
                        cp.cuda.runtime.memcpyPeerAsync(slot(p, g).data.ptr, p, bufs[g][0].data.ptr, g, ce,
                                                        streams[g][i - 1].ptr)
        sync_all()
        return time.perf_counter() - t0

    def once_host(gpus: int, d2h: bool, h2d: bool, peers: int = 0) -> dict[str, float]:
        """GPUs 0 .. gpus - 1 copy to and/or from pinned host memory (and push to ``peers`` peers on
        streams of their own); per kind of copy, the longest time any GPU took for it, by events: from
        the first of its streams' starts to the last one's end (its pushes, on several streams, may run
        one after another: each stream's own span would miss that)."""
        spans: dict[str, dict[int, list[tuple]]] = {"d2h": {}, "h2d": {}, "peers": {}}
        for g in range(gpus):
            with cp.cuda.Device(g):
                (hsrc, _), (hdst, _), dev = hosts[g]
                work = []
                if d2h:
                    work.append(("d2h", lambda s: cp.cuda.runtime.memcpyAsync(hdst, bufs[g][0].data.ptr, nbytes, 2, s.ptr)))
                if h2d:
                    work.append(("h2d", lambda s: cp.cuda.runtime.memcpyAsync(dev.data.ptr, hsrc, nbytes, 1, s.ptr)))
                for i in range(1, peers + 1):
                    p = (g + i) % n
                    work.append(("peers", lambda s, p=p: cp.cuda.runtime.memcpyPeerAsync(
                        slot(p, g).data.ptr, p, bufs[g][0].data.ptr, g, nbytes, s.ptr)))
                for (what, go), s in zip(work, streams[g] + host_streams[g]):
                    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                    e0.record(s)
                    go(s)
                    e1.record(s)
                    spans[what].setdefault(g, []).append((e0, e1))
        sync_all()

        def span_s(pairs):  # one GPU's events: the first start to the last end, in seconds
            ref = pairs[0][0]
            return (max(cp.cuda.get_elapsed_time(ref, b) for _, b in pairs)
                    - min(cp.cuda.get_elapsed_time(ref, a) for a, _ in pairs)) / 1e3

        return {what: max(span_s(pairs) for pairs in per_gpu.values()) for what, per_gpu in spans.items() if per_gpu}

    host_streams = [[] for _ in range(n)]
    if "host" in engines:
        for g in range(n):
            with cp.cuda.Device(g):
                host_streams[g] = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]

    def check_host(label: str, gpus: int, d2h: bool, h2d: bool):
        """After a host pattern from zeroed destinations: GPU g's pinned destination holds g + 1 where
        it copied to the host, its device destination 100 + g where it copied from it; else 0."""
        for g in range(n):
            _, (_, hview), dev = hosts[g]
            want = (g + 1) if d2h and g < gpus else 0
            if not (hview == want).all():
                raise SystemExit(f"link_probe.py: {label}: GPU {g}'s pinned copy holds "
                                 f"{sorted(set(hview[:8].tolist()))}, not only {want}")
            with cp.cuda.Device(g):
                want = (100 + g) if h2d and g < gpus else 0
                if not bool((dev == want).all()):
                    raise SystemExit(f"link_probe.py: {label}: GPU {g}'s copy from the host does not hold only {want}")

    def check(label: str, direction: str, k: int):
        """After a pattern that started from zeroed slots: the slots it fills hold their sender's
        value, every other slot still 0. Pull: GPU g read peers g + 1 .. g + k (its slots 0 .. k - 1);
        push: peers g - 1 .. g - k wrote into GPU g (its slots n - 2 down to n - k - 1)."""
        for g in range(n):
            filled = range(k) if direction == "pull" else range(n - k - 1, n - 1)
            with cp.cuda.Device(g):
                for i in range(1, n):  # slot i - 1: what GPU g + i sends
                    sender, want = (g + i) % n, (i - 1 in filled) * ((g + i) % n + 1)
                    if not bool((bufs[g][1][i - 1] == want).all()):
                        got = sorted(float(v) for v in cp.unique(bufs[g][1][i - 1]).get())[:4]
                        raise SystemExit(f"link_probe.py: {label}: GPU {g}'s slot for GPU {sender} holds {got}, "
                                         f"not only {want}: the bytes did not land where they should")

    rows = []

    def measure(engine: str, direction: str, k: int, how: str, once) -> None:
        """Zeroed slots, a warm-up, ``runs`` timed runs, then the check of what landed; one row."""
        for g in range(n):
            with cp.cuda.Device(g):
                bufs[g][1].fill(0)
        sync_all()
        once()  # warm-up
        times = [once() for _ in range(runs)]
        check(f"{engine} {direction} k={k} {how}", direction, k)
        rows.append(_row(engine, direction, k, how, times, nbytes))

    if "ce" in engines:
        for direction in ("pull", "push"):
            for k in range(1, n):
                for parallel in ((False, True) if k > 1 else (True,)):
                    measure("ce", direction, k, f"{k if parallel else 1} stream(s)",
                            lambda: once_ce(direction, k, parallel))
        piece = 16 << 20
        if nbytes > piece:
            for k in range(1, n):
                measure("ce", "push", k, f"{k} stream(s), copies of 16 MiB", lambda: once_ce("push", k, True, piece))
    if "sm" in engines:
        for direction in ("push", "pull"):
            for grid in (sms, sms // 2):
                for k in range(1, n):
                    for spread in ((False, True) if k > 1 else (False,)):
                        measure("sm", direction, k, f"{'spread' if spread else 'serial'}, {grid} blocks",
                                lambda: once_sm(direction, k, grid, spread))
    if "host" in engines:
        def measure_host(gpus: int, d2h: bool, h2d: bool, peers: int = 0) -> None:
            for g in range(n):
                with cp.cuda.Device(g):
                    hosts[g][2].fill(0)
                    bufs[g][1].fill(0)
                hosts[g][1][1][:] = 0
            sync_all()
            once_host(gpus, d2h, h2d, peers)  # warm-up
            runs_ = [once_host(gpus, d2h, h2d, peers) for _ in range(runs)]
            way = "both ways" if d2h and h2d else ("device to host" if d2h else ("host to device" if h2d else "none"))
            label = f"host {way}, {gpus} GPU(s) at once" + (f", beside pushes to {peers} peers" if peers else "")
            check_host(label, gpus, d2h, h2d)
            if peers:
                check(label, "push", peers)
            for what in ("d2h", "h2d", "peers"):
                if what in runs_[0]:
                    times = [r[what] for r in runs_]
                    k = peers if what == "peers" else 1
                    if what == "peers":
                        how = f"{gpus} GPU(s) at once, " + ("beside host copies both ways" if d2h and h2d
                                                            else "no host copies, timed like the row beside them")
                    else:
                        how = (f"{gpus} GPU(s) at once" + (", both ways" if d2h and h2d else "")
                               + (f", beside pushes to {peers} peers" if peers else ""))
                    rows.append(_row("host" if what != "peers" else "ce", what if what != "peers" else "push",
                                     k, how, times, nbytes))

        for gpus in range(1, n + 1):
            measure_host(gpus, True, False)
            measure_host(gpus, False, True)
            measure_host(gpus, True, True)
        measure_host(n, False, False, peers=n - 1)  # the pushes alone, timed the same way
        measure_host(n, True, True, peers=n - 1)
    if "tma" in engines:
        for k in range(1, n):
            for spread in ((False, True) if k > 1 else (False,)):
                measure("tma", "push", k, f"{'spread' if spread else 'serial'}, {sms} blocks, tiles of 8 KiB",
                        lambda: once_tma(k, spread))
    if "mix" in engines:
        for k in sorted({1, n - 1}):
            for share in shares:
                measure("ce+sm", "push", k, f"{share:.0%} on copy engines ({k} stream(s)), the rest a kernel's "
                        f"stores ({sms} blocks), host-timed", lambda: once_mix(k, share))
    for (hsrc, _), (hdst, _), _ in hosts:
        cp.cuda.runtime.freeHost(hsrc)
        cp.cuda.runtime.freeHost(hdst)
    return rows, n, kind


def main(argv=None) -> int:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from jax_blink.tools import arguments as cli

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bytes", default=256 << 20, type=cli.byte_count, help="bytes per peer (default 256M)")
    ap.add_argument("--runs", type=cli.whole_number(1, 1000), default=10, help="timed runs per pattern")
    ap.add_argument("--engines", default="ce,sm,tma",
                    help="comma-separated: ce (copy engines), sm (a kernel's loads and stores), tma (bulk copies), "
                         "host (copy engines to and from pinned host memory), mix (copy engines and a kernel's "
                         "stores at once)")
    ap.add_argument("--out", help="write the table to this Markdown file")
    args = ap.parse_args(argv)
    if args.bytes < 4096 or args.bytes % 16:
        ap.error(f"--bytes: got {args.bytes}; takes at least 4K, a multiple of 16")
    engines = [e.strip().lower() for e in args.engines.split(",") if e.strip()]
    if not engines or set(engines) - {"ce", "sm", "tma", "host", "mix"}:
        ap.error(f"--engines: got {args.engines!r}; takes ce, sm, tma, host and mix, comma-separated")
    try:
        import cupy  # noqa: F401
    except ImportError:
        ap.error("needs CuPy (pip install cupy-cuda13x) and 2 or more GPUs")
    rows, n, kind = run(args.bytes, args.runs, engines)
    text = table(rows, n, kind, args.bytes)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
