"""Does a peer read go wrong at a virtual address that moved from the reading GPU to its peer? (GPUs, CuPy)

    python benchmarks/va_reuse_probe.py [--reader 0] [--owner 2] [--bytes 130M] [--tries 8]
    compute-sanitizer --tool memcheck python benchmarks/va_reuse_probe.py

The 3-GPU memcheck finding of issue 31 (benchmarks/NOTES.md): under XLA's platform allocator,
GPU 0's kernel read GPU 2's operand of call 4 at a virtual address that had held GPU 0's own
operand of call 3, freed in between; memcheck called the reads out of bounds "inside the nearest
allocation" (GPU 2's) and the kernel then hit a hardware exception. Without the sanitizer the
same program was right. This probe repeats the sequence with nothing of jax_blink or XLA:

1. peer access on, both ways, between ``--reader`` and ``--owner``;
2. the reader allocates ``--bytes`` (``cudaMalloc``), writes it, frees it;
3. the owner allocates as much, until it gets the freed address back (``--tries``; each miss is
   kept, so that the allocator must move on), then a control buffer, and fills both with a known
   pattern;
4. a kernel on the reader sums the owner's buffer through the peer mapping (``ld.global.cg``, as
   the executor reads peers), and the same for a control buffer of the owner's whose address was
   never the reader's.

It prints whether the address moved, and each read's sum against the expected one. Run it under
memcheck beside a plain run: a finding on the moved address alone, with right sums without the
tool, places the issue-31 finding on the address's move between devices, not on jax_blink's reads.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jax_blink.tools import cli  # noqa: E402  (the repository first on the path)

SUM_KERNEL = r"""
extern "C" __global__ void sum_words(const unsigned int* p, unsigned long long n, unsigned long long* out) {
  unsigned long long acc = 0;
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x)
    acc += __ldcg(p + i);
  atomicAdd(out, acc);
}
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/va_reuse_probe.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reader", type=cli.whole_number(0, 63), default=0, help="GPU whose kernel reads (default 0)")
    ap.add_argument("--owner", type=cli.whole_number(0, 63), default=2, help="GPU that owns the buffers (default 2)")
    ap.add_argument("--bytes", type=cli.byte_count, default=130 << 20, help="buffer size (default 130M)")
    ap.add_argument("--tries", type=cli.whole_number(1, 64), default=8,
                    help="owner allocations to try for the freed address (default 8)")
    args = ap.parse_args(argv)
    if args.reader == args.owner:
        ap.error(f"--reader and --owner must differ (both {args.reader})")
    try:
        import cupy as cp
    except ImportError:
        ap.error("needs CuPy (pip install cupy-cuda12x or cupy-cuda13x) and 2 GPUs")
    rt = cp.cuda.runtime
    if rt.getDeviceCount() <= max(args.reader, args.owner):
        ap.error(f"needs GPUs {args.reader} and {args.owner}; this machine has {rt.getDeviceCount()}")
    words = args.bytes // 4
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
    with cp.cuda.Device(r):
        freed = rt.malloc(args.bytes)
        rt.memset(freed, 1, args.bytes)
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
                rt.memset(ptr, 0x01, args.bytes)  # every word 0x01010101
        rt.deviceSynchronize()
    expected = words * 0x01010101
    with cp.cuda.Device(r):
        kernel = cp.RawKernel(SUM_KERNEL, "sum_words")
        rows = []
        for name, ptr in (("control (address never the reader's)", control), ("moved (the reader's freed address)", moved)):
            if ptr is None:
                rows.append((name, None, None))
                continue
            out = cp.zeros(1, dtype=cp.uint64)
            kernel((264,), (256,), (cp.uint64(ptr), cp.uint64(words), out))
            got = int(out.get()[0])
            rows.append((name, ptr, got))
    print(f"# va_reuse_probe: GPU {r} reads GPU {o}'s buffers of {args.bytes} bytes; the reader's freed buffer was "
          f"at {freed:#x}; the owner {'got that address back' if moved else f'did not get it back in {args.tries} tries'}")
    ok = True
    for name, ptr, got in rows:
        if ptr is None:
            print(f"{name}: not run (no buffer at the freed address)")
            continue
        right = got == expected
        ok &= right
        print(f"{name} at {ptr:#x}: sum {got} against {expected}: {'right' if right else 'WRONG'} (measured)")
    with cp.cuda.Device(o):
        for ptr in kept + [control] + ([moved] if moved else []):
            rt.free(ptr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
