"""A kernel reads a peer GPU's memory allocated at an awkward moment: does memcheck call it out of bounds? (GPUs, CuPy)

    python benchmarks/peer_alloc_probe.py [--case moved,late] [--reader 0] [--owner 2] [--bytes 130M]
    compute-sanitizer --tool memcheck python benchmarks/peer_alloc_probe.py

The 3-GPU memcheck finding of issue 31 (benchmarks/NOTES.md): under XLA's platform allocator a
rank's reads of a peer's operand, at offsets it must read, inside the peer's live allocation, were
called out of bounds by memcheck, which then stopped the kernel; without the tool the program was
right. This probe repeats the two moments such a buffer can be born in, with nothing of jax_blink
or XLA (peer access on both ways between ``--reader`` and ``--owner`` first, as the executor does):

- ``moved``: the reader allocates ``--bytes`` and frees them; the owner allocates until it gets
  that address back (``--tries``), then a control buffer; a kernel on the reader sums both through
  the peer mapping (``ld.global.cg``, as the executor reads peers). Under XLA's platform allocator
  an address moves between GPUs like this from call to call.
- ``late``: the reader's kernel is launched first and waits (a flag in mapped pinned memory,
  at most ``--wait-s``) for the address of a buffer that the owner allocates only then, as the
  executor's kernel of call k waits for a peer's pointers to a buffer that XLA allocated for call k
  after this rank's kernel was launched; a control buffer of the owner's is allocated before the
  launch and summed by the same kernel.

Each read's sum is checked against the expected one. Run it under memcheck beside a plain run:
reports on one case's buffer alone, with right sums without the tool, place the issue-31 finding
on that moment of birth, not on jax_blink's reads.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jax_blink.tools import arguments as cli  # noqa: E402  (the repository first on the path)

CASES = ("moved", "late")

KERNELS = r"""
__device__ unsigned long long sum_range(const unsigned int* p, unsigned long long n) {
  unsigned long long acc = 0;
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x)
    acc += __ldcg(p + i);
  return acc;
}

extern "C" __global__ void sum_words(const unsigned int* p, unsigned long long n, unsigned long long* out) {
  atomicAdd(out, sum_range(p, n));
}

// box[0]: the flag (1 once box[1] holds the buffer's address), box[2]: set to 1 by a block that
// gave up waiting. out[0]: the late buffer's sum, out[1]: the control's.
extern "C" __global__ void sum_when_given(volatile unsigned long long* box, const unsigned int* control,
                                          unsigned long long n, unsigned long long wait_ns,
                                          unsigned long long* out) {
  __shared__ int ready;
  if (threadIdx.x == 0) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    ready = 0;
    while (!ready) {
      if (box[0] == 1ull) { ready = 1; break; }
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
      if (t - t0 > wait_ns) { box[2] = 1ull; ready = -1; }
      if (ready) break;
    }
    __threadfence_system();
  }
  __syncthreads();
  atomicAdd(out + 1, sum_range(control, n));
  if (ready == 1) {
    const unsigned int* p = (const unsigned int*)box[1];
    atomicAdd(out, sum_range(p, n));
  }
}
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/peer_alloc_probe.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", default=",".join(CASES), help=f"comma-separated from {', '.join(CASES)} (default all)")
    ap.add_argument("--reader", type=cli.whole_number(0, 63), default=0, help="GPU whose kernel reads (default 0)")
    ap.add_argument("--owner", type=cli.whole_number(0, 63), default=2, help="GPU that owns the buffers (default 2)")
    ap.add_argument("--bytes", type=cli.byte_count, default=130 << 20, help="buffer size (default 130M)")
    ap.add_argument("--tries", type=cli.whole_number(1, 64), default=8,
                    help="moved: owner allocations to try for the freed address (default 8)")
    ap.add_argument("--wait-s", type=cli.whole_number(1, 600), default=20,
                    help="late: most seconds the reader's kernel waits for the buffer's address (default 20)")
    args = ap.parse_args(argv)
    if args.reader == args.owner:
        ap.error(f"--reader and --owner must differ (both {args.reader})")
    cases = [c.strip().lower() for c in args.case.split(",") if c.strip()]
    if not cases or set(cases) - set(CASES):
        ap.error(f"--case: got {args.case!r}; takes {' and '.join(CASES)}, comma-separated")
    if args.bytes < 4096 or args.bytes % 16:
        ap.error(f"--bytes: got {args.bytes}; takes at least 4K, a multiple of 16")
    try:
        import cupy as cp
    except ImportError:
        ap.error("needs CuPy (pip install cupy-cuda12x or cupy-cuda13x) and 2 GPUs")
    rt = cp.cuda.runtime
    if rt.getDeviceCount() <= max(args.reader, args.owner):
        ap.error(f"needs GPUs {args.reader} and {args.owner}; this machine has {rt.getDeviceCount()}")
    r, o = args.reader, args.owner
    for a, b in ((r, o), (o, r)):
        with cp.cuda.Device(a):
            if not rt.deviceCanAccessPeer(a, b):
                ap.error(f"GPU {a} cannot reach GPU {b} through peer access")
            try:
                rt.deviceEnablePeerAccess(b)
            except rt.CUDARuntimeError as e:  # already on: harmless
                if "PeerAccessAlreadyEnabled" not in str(e):
                    raise
    words = args.bytes // 4
    expected = words * 0x01010101  # every byte 0x01
    print(f"# peer_alloc_probe: GPU {r} reads GPU {o}'s buffers of {args.bytes} bytes (measured, each sum checked)")
    ok = True
    for case in cases:
        rows = (_moved if case == "moved" else _late)(cp, r, o, args)
        for name, ptr, got in rows:
            if ptr is None:
                print(f"{case}: {name}: not run ({got})")
                continue
            if isinstance(got, str):  # the kernel failed (under memcheck: it stops the kernel it reports)
                ok = False
                print(f"{case}: {name} at {ptr:#x}: {got}")
                continue
            right = got == expected
            ok &= right
            print(f"{case}: {name} at {ptr:#x}: sum {got} against {expected}: {'right' if right else 'WRONG'}")
    return 0 if ok else 1


def _filled(rt, nbytes: int) -> int:
    ptr = rt.malloc(nbytes)
    rt.memset(ptr, 0x01, nbytes)
    return ptr


def _moved(cp, r: int, o: int, args) -> list:
    rt = cp.cuda.runtime
    with cp.cuda.Device(r):
        freed = _filled(rt, args.bytes)
        rt.deviceSynchronize()
        rt.free(freed)
    kept, moved = [], None
    with cp.cuda.Device(o):
        for _ in range(args.tries):  # first: the freed address is the allocator's likeliest answer
            ptr = rt.malloc(args.bytes)
            if ptr == freed:
                moved = ptr
                break
            kept.append(ptr)
        control = rt.malloc(args.bytes)
        if control == freed:  # the allocator's answer came late: that buffer is the moved one
            moved, control = control, rt.malloc(args.bytes)
        for ptr in (control, moved):
            if ptr is not None:
                rt.memset(ptr, 0x01, args.bytes)
        rt.deviceSynchronize()
    rows = []
    with cp.cuda.Device(r):
        kernel = cp.RawKernel(KERNELS, "sum_words")
        for name, ptr in (("control (an address never the reader's)", control),
                          ("moved (the address the reader freed)", moved)):
            if ptr is None:
                rows.append((name, None, f"the owner did not get the freed address back in {args.tries} tries"))
                continue
            out = cp.zeros(1, dtype=cp.uint64)
            kernel((264,), (256,), (cp.uint64(ptr), cp.uint64(args.bytes // 4), out))
            rows.append((name, ptr, int(out.get()[0])))
    with cp.cuda.Device(o):
        for ptr in kept + [control] + ([moved] if moved else []):
            rt.free(ptr)
    return rows


def _late(cp, r: int, o: int, args) -> list:
    import ctypes

    import numpy as np

    rt = cp.cuda.runtime
    # cudaHostAllocPortable | cudaHostAllocMapped: the reader's kernel polls it, the host writes it;
    # under unified addressing its host address is also its device address in every context.
    box_host = rt.hostAlloc(32, 3)
    box = np.ctypeslib.as_array((ctypes.c_uint64 * 4).from_address(box_host))
    box[:] = 0
    with cp.cuda.Device(o):
        control = _filled(rt, args.bytes)  # born before the reader's launch
        rt.deviceSynchronize()
    # Printed now: a tool's report names addresses, and the sums may never come (a stopped kernel).
    print(f"late: control buffer at {control:#x}, {args.bytes} bytes on GPU {o}", flush=True)
    with cp.cuda.Device(r):
        kernel = cp.RawKernel(KERNELS, "sum_when_given")
        out = cp.zeros(2, dtype=cp.uint64)
        kernel((264,), (256,), (cp.uint64(box_host), cp.uint64(control), cp.uint64(args.bytes // 4),
                                cp.uint64(args.wait_s * 1_000_000_000), out))
    time.sleep(0.5)  # the reader's kernel is running, waiting
    with cp.cuda.Device(o):
        late = _filled(rt, args.bytes)  # born after the reader's launch
        rt.deviceSynchronize()
    print(f"late: late buffer at {late:#x}, {args.bytes} bytes on GPU {o}", flush=True)
    box[1] = late
    box[0] = 1
    with cp.cuda.Device(r):
        try:
            sums = [int(v) for v in out.get()]
        except rt.CUDARuntimeError as e:  # the context is lost (a stopped kernel): nothing more to free
            failed = f"the reader's kernel failed ({e})"
            return [("control (allocated before the reader's launch)", control, failed),
                    ("late (allocated while the reader's kernel waited)", late, failed)]
    gave_up = int(box[2]) == 1
    rows = [("control (allocated before the reader's launch)", control, sums[1]),
            ("late (allocated while the reader's kernel waited)", None if gave_up else late,
             f"the kernel gave up waiting after {args.wait_s} s" if gave_up else sums[0])]
    with cp.cuda.Device(o):
        rt.free(control)
        rt.free(late)
    rt.freeHost(box_host)
    return rows


if __name__ == "__main__":
    sys.exit(main())
