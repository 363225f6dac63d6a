"""NCCL measured directly, nccl-tests style: the anchor beside jax_blink's and XLA's numbers.

One process per GPU (``torch.distributed``, NCCL back end), out-of-place collectives on fresh
random data, CUDA events around ``--iters`` back-to-back calls after ``--warmup`` calls, the
slowest rank's time per call reported (as nccl-tests does). Sizes are bytes per rank of the
operand (all-gather: each rank's piece), as jax_blink's bench counts them; the ``size`` column is
nccl-tests' (the larger of a rank's input and output), from which algbw and busbw are computed. Every size is checked once
against a float64 sum of the ranks' data (all-reduce), so a wrong NCCL set-up cannot pass as fast.

    NCCL_NVLS_ENABLE=0 python benchmarks/nccl_bench.py -n 4 -b 1K -e 1G -f 4 -d float32,bfloat16 \
        -c allreduce,allgather,reducescatter -o benchmarks/results

Writes ``nccl-<collective>-<kind>-<date>.csv`` / ``.json`` and prints a table (MEASURED: time in
microseconds per call, algbw and busbw in GB/s, nccl-tests' definitions).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

SIZES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
BUS_FACTOR = {"allreduce": lambda n: 2 * (n - 1) / n, "allgather": lambda n: (n - 1) / n,
              "reducescatter": lambda n: (n - 1) / n}


def parse_bytes(text: str) -> int:
    text = text.strip().upper()
    mult = SIZES.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in SIZES else text
    if not digits.isdigit() or int(digits) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count such as 4096, 512K, 16M or 1G")
    return int(digits) * mult


def _worker(rank: int, n: int, args: argparse.Namespace, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                            device_id=torch.device("cuda", rank))
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    for coll in args.collectives:
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            esize = torch.tensor([], dtype=dtype).element_size()
            size = args.begin
            while size <= args.end:
                elems = max(1, size // esize)
                if coll == "reducescatter":
                    elems = max(n, elems // n * n)
                x = torch.randn(elems, generator=gen, device="cuda", dtype=torch.float32).to(dtype)
                if coll == "allreduce":
                    out = torch.empty_like(x)
                    call = lambda: (out.copy_(x), dist.all_reduce(out))  # noqa: E731 (out of place)
                    wrong = _check_allreduce(x, out, call, n)
                elif coll == "allgather":
                    out = torch.empty(elems * n, device="cuda", dtype=dtype)
                    call = lambda: dist.all_gather_into_tensor(out, x)  # noqa: E731
                    wrong = -1
                else:
                    out = torch.empty(elems // n, device="cuda", dtype=dtype)
                    call = lambda: dist.reduce_scatter_tensor(out, x)  # noqa: E731
                    wrong = -1
                for _ in range(args.warmup):
                    call()
                torch.cuda.synchronize()
                dist.barrier()
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.iters):
                    call()
                stop.record()
                torch.cuda.synchronize()
                t_us = torch.tensor([start.elapsed_time(stop) * 1e3 / args.iters], device="cuda")
                dist.all_reduce(t_us, op=dist.ReduceOp.MAX)
                nbytes = elems * esize  # each rank's operand
                # nccl-tests' size: the larger of a rank's input and output (all-gather: its output)
                size = nbytes * n if coll == "allgather" else nbytes
                rows.append({"collective": coll, "dtype": dtype_name, "bytes_per_rank": nbytes, "size": size,
                             "nccl_us": float(t_us.item()), "wrong": wrong})
                size *= args.factor
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def _check_allreduce(x, out, call, n: int) -> int:
    """Elements of NCCL's sum that differ from a float64 sum of every rank's data beyond rounding."""
    import torch
    import torch.distributed as dist

    call()
    torch.cuda.synchronize()
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x)
    exact = torch.stack([p.double() for p in parts]).sum(0)
    tol = (8e-2 if x.dtype == torch.bfloat16 else 1e-5) * (1 + exact.abs())
    return int(((out.double() - exact).abs() > tol).sum().item())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", "--gpus", type=int, default=0, help="GPUs, one process each (default: all visible)")
    ap.add_argument("-b", "--begin", type=parse_bytes, default=parse_bytes("1K"))
    ap.add_argument("-e", "--end", type=parse_bytes, default=parse_bytes("1G"))
    ap.add_argument("-f", "--factor", type=int, default=4)
    ap.add_argument("-d", "--dtype", default="float32", help="comma-separated: float32, bfloat16")
    ap.add_argument("-c", "--collective", default="allreduce", help="comma-separated: allreduce, allgather, reducescatter")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per size (default 20, as the bench's chain)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("-o", "--out", default="", help="folder for the CSV/JSON (default: print only)")
    ap.add_argument("--kind", default="", help="device kind for the file names (default from the GPU's name)")
    args = ap.parse_args(argv)
    args.dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    args.collectives = [c.strip() for c in args.collective.split(",") if c.strip()]
    for d in args.dtypes:
        if d not in ("float32", "bfloat16"):
            ap.error(f"dtype {d!r}: this anchor times float32 and bfloat16")
    for c in args.collectives:
        if c not in BUS_FACTOR:
            ap.error(f"collective {c!r}: one of {', '.join(BUS_FACTOR)}")
    if args.factor < 2 or args.end < args.begin:
        ap.error("need --factor >= 2 and --end >= --begin")
    import socket

    try:
        import torch
        import torch.multiprocessing as mp
    except ImportError:
        ap.error("needs PyTorch with CUDA (torch.distributed's NCCL back end): pip install torch")
    if not torch.cuda.is_available():
        ap.error("needs CUDA GPUs (torch sees none)")

    n = args.gpus or torch.cuda.device_count()
    if n < 2 or n > torch.cuda.device_count():
        ap.error(f"--gpus {n}: this machine shows {torch.cuda.device_count()} GPUs; NCCL needs 2 or more")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, n, args, port, queue)) for r in range(n)]
    for p in procs:
        p.start()
    try:
        rows = queue.get(timeout=540)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    name = torch.cuda.get_device_name(0)
    kind = args.kind or f"{name.lower().replace(' ', '-')}-x{n}"
    for r in rows:
        t = r["nccl_us"] * 1e-6
        r["algbw"] = r["size"] / t / 1e9
        r["busbw"] = r["algbw"] * BUS_FACTOR[r["collective"]](n)
    print(f"NCCL {torch.cuda.nccl.version()} via torch.distributed, {n} x {name}, one process per GPU, "
          f"{args.iters} back-to-back calls (MEASURED)")
    print(f"{'collective':>13} {'dtype':>9} {'bytes/rank':>11} {'size':>11} {'time_us':>10} {'algbw':>8} {'busbw':>8} "
          f"{'#wrong':>6}")
    for r in rows:
        print(f"{r['collective']:>13} {r['dtype']:>9} {r['bytes_per_rank']:>11} {r['size']:>11} {r['nccl_us']:>10.1f} "
              f"{r['algbw']:>8.1f} {r['busbw']:>8.1f} {r['wrong']:>6}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        date = datetime.date.today().isoformat()
        base = os.path.join(args.out, f"nccl-{kind}-{date}")
        meta = {"device": name, "gpus": n, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                "torch": torch.__version__, "date": date, "iters": args.iters, "method": "torch.distributed, "
                "one process per GPU, CUDA events around back-to-back calls, slowest rank"}
        with open(base + ".json", "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        with open(base + ".csv", "w") as f:
            f.write("collective,dtype,bytes_per_rank,size,nccl_us,algbw,busbw,wrong\n")
            for r in rows:
                f.write(f"{r['collective']},{r['dtype']},{r['bytes_per_rank']},{r['size']},{r['nccl_us']:.3f},"
                        f"{r['algbw']:.3f},{r['busbw']:.3f},{r['wrong']}\n")
        print("wrote", base + ".json")
    return 1 if any(r["wrong"] > 0 for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
