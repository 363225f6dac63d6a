"""The CPU executor's shared-memory path (kernels/cpu/shm.cc) alone, without jax.distributed:
``--procs`` processes of ``--local`` host devices each run K chained all-reduces of one
n = procs * local rank program through "jax_blink_collective_mp" (each process calls the handler
on its own devices as ranks pid * local + i; the job key is drawn here). Prints, per size, process
0's median time per call over ``--runs`` runs (after a warm-up run that sets the segments up),
and checks every result.

    python benchmarks/cpu_shm_bench.py [--procs 2] [--local 2] [-b 1K] [-e 4M] [-k 20] [--runs 9]
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time


def child(pid: int, a: argparse.Namespace, key: str, sizes: list[int]) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={a.local}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("PJRT_NPROC", "16")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jax_blink import Topology
    from jax_blink.lowering import backends as _backends, custom_call

    _backends.module("cpu").shm_set_job(key, pid)
    assert _backends.register("cpu")
    n = a.procs * a.local
    topology = Topology.host(n)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    rank_process = np.repeat(np.arange(a.procs, dtype=np.int32), a.local)
    rank_device = np.arange(n, dtype=np.int32)
    rows = []
    for s, nbytes in enumerate(sizes):
        elems = nbytes // 4
        program = custom_call.build_program(topology, "allreduce", None, elems, 4, None, "exact")

        def body(v, s=s, program=program):
            rank = (lax.axis_index("x") + pid * a.local).astype(jnp.int32)
            v = v[0]
            for i in range(a.k):  # every call site its own comm_id, the same in every process
                call = jax.ffi.ffi_call(_backends.TARGET_MP, jax.ShapeDtypeStruct(v.shape, v.dtype))
                v = call(v, rank, jnp.int32(0), program=program, op=np.int32(0),
                         comm_id=np.int64(7_000_000 + s * 1000 + i), timeout_ms=np.int64(60_000),
                         host_share=np.float32(0), rank_process=rank_process, rank_device=rank_device,
                         setup_timeout_ms=np.int64(60_000))
            return v[None]

        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
        ranks = np.arange(a.local) + pid * a.local
        x = jax.device_put(np.repeat((ranks + 1).astype(np.float32)[:, None], elems, axis=1),
                           NamedSharding(mesh, P("x")))
        got = np.asarray(fn(x))  # warm-up: compiles and sets the segments up
        want = np.float32(n * (n + 1) / 2 * float(n) ** (a.k - 1))
        if not np.allclose(got, want, rtol=1e-5):
            raise SystemExit(f"process {pid}, {nbytes} bytes: wrong result {got.ravel()[:4]} against {want}")
        times = []
        for _ in range(a.runs):
            t0 = time.perf_counter()
            fn(x).block_until_ready()
            times.append((time.perf_counter() - t0) / a.k * 1e6)
        rows.append({"bytes": nbytes, "us_per_call": statistics.median(times), "min_us": min(times)})
    if pid == 0:
        print("RESULT " + json.dumps(rows), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--local", type=int, default=2, help="host devices per process")
    ap.add_argument("-b", "--begin", default="1K")
    ap.add_argument("-e", "--end", default="4M")
    ap.add_argument("-f", "--factor", type=int, default=4)
    ap.add_argument("-k", type=int, default=20, help="chained calls per program")
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    from jax_blink.options import parse_byte_count

    sizes, size = [], parse_byte_count(a.begin)
    while size <= parse_byte_count(a.end):
        sizes.append(size)
        size *= a.factor
    if a.child:
        child(int(a.child[0]), a, a.child[1], sizes)
        return
    key = secrets.token_hex(8)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--child", str(p), key],
                              stdout=subprocess.PIPE, text=True, env=env) for p in range(a.procs)]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a process failed: exit codes {[p.returncode for p in procs]}")
    rows = json.loads(next(line for line in outs[0].splitlines() if line.startswith("RESULT "))[7:])
    print(f"# {a.procs} processes x {a.local} host devices, float32 all-reduce, {a.k} chained calls, "
          f"median of {a.runs} runs (process 0)")
    print(f"# {'bytes':>9}  {'us/call':>9}  {'min us':>9}")
    for r in rows:
        print(f"  {r['bytes']:>9}  {r['us_per_call']:9.1f}  {r['min_us']:9.1f}")


if __name__ == "__main__":
    main()
