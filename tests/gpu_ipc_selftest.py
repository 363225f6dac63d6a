"""Two processes sharing one GPU run jax_blink.all_reduce through CUDA IPC (needs a CUDA GPU).

    python tests/gpu_ipc_selftest.py [--shared] [--out benchmarks/results/ipc-selftest-<machine>.json]

Starts a jax.distributed job of two processes on loopback. With two or more GPUs each process
takes its own (``local_device_ids=[pid]``), and XLA's psum/pmax/pmin (NCCL) must agree with ours.
With one GPU (or ``--shared``) both share GPU 0
(``local_device_ids=[0]``, ``XLA_PYTHON_CLIENT_PREALLOCATE=false``): jax lists 2 GPUs and a
``shard_map`` over them runs, each process driving its own device. XLA's psum cannot run there
(NCCL refuses a duplicate GPU), so results are checked against numpy (float64 for the float sums),
and the two processes compare their results bit for bit through the job's key-value store. Every
dtype, sum/max/min, sizes from 7 elements to 4 MiB, with JAX_BLINK_FALLBACK=raise and
JAX_BLINK_DISPATCH=blink (no quiet fall-back); the optimized program must hold the IPC custom call.
Exits 0 when both processes pass. Under compute-sanitizer (IPC_SELFTEST_QUICK=1: float32 and
bfloat16, 7 and 1031 elements):
``IPC_SELFTEST_QUICK=1 compute-sanitizer --tool memcheck --target-processes all python tests/gpu_ipc_selftest.py``.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time


def child(pid: int, port: int, distinct: bool) -> dict:
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    os.environ["JAX_BLINK_FALLBACK"] = "raise"
    os.environ["JAX_BLINK_DISPATCH"] = "blink"
    import jax

    jax.config.update("jax_enable_x64", True)  # float64 and int64 as themselves
    import ml_dtypes
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                               local_device_ids=[pid if distinct else 0])
    import jax_blink
    from jax_blink import _backends, distributed

    client = distributed._client()
    assert jax.device_count() == 2, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("x",))
    rng = np.random.default_rng(7)
    failures, checks = [], 0
    quick = os.environ.get("IPC_SELFTEST_QUICK") == "1"  # under compute-sanitizer: fewer cases
    dtypes = (("float32", np.float32), ("bfloat16", ml_dtypes.bfloat16), ("float16", np.float16),
              ("float64", np.float64), ("int32", np.int32), ("int64", np.int64))
    for dname, dt in dtypes[:2] if quick else dtypes:
        for size in (7, 1031) if quick else (7, 1031, 1 << 20):
            if size == 1 << 20 and dname not in ("float32", "bfloat16"):
                continue
            for op in ("sum", "max", "min"):
                if dt in (np.int32, np.int64):
                    data = rng.integers(-1000, 1000, size=(2, size)).astype(dt)
                else:
                    data = rng.standard_normal((2, size)).astype(dt)
                f = jax.jit(jax.shard_map(lambda v, op=op: jax_blink.all_reduce(v, "x", op=op), mesh=mesh,
                                          in_specs=P("x"), out_specs=P("x")))
                x = jax.make_array_from_callback((2 * size,), NamedSharding(mesh, P("x")),
                                                 lambda idx: data.reshape(-1)[idx])
                name = f"{dname}/{size}/{op}"
                if checks == 0:
                    hlo = f.lower(x).compile().as_text()
                    if _backends.TARGET_IPC not in hlo:
                        failures.append("no jax_blink_collective_ipc in the optimized program")
                got = np.asarray(f(x).addressable_shards[0].data)
                if distinct:  # two GPUs: XLA's own collective (NCCL) runs too, and must agree
                    lax_op = {"sum": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin}[op]
                    g = jax.jit(jax.shard_map(lambda v, lax_op=lax_op: lax_op(v, "x"), mesh=mesh,
                                              in_specs=P("x"), out_specs=P("x")))
                    want = np.asarray(g(x).addressable_shards[0].data)
                    tol = {"bfloat16": 1e-2, "float16": 1e-3}.get(dname, 1e-6)
                    if not np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol):
                        failures.append(f"{dname}/{size}/{op}: differs from lax")
                ref = {"sum": data.astype(np.float64).sum(0), "max": data.max(0), "min": data.min(0)}[op]
                if dt in (np.int32, np.int64):
                    ref = {"sum": data.sum(0), "max": data.max(0), "min": data.min(0)}[op]
                    ok = np.array_equal(got, ref)
                elif op == "sum":
                    tol = {"bfloat16": 2e-2, "float16": 2e-3}.get(dname, 1e-6)
                    ok = np.allclose(got.astype(np.float64), ref, rtol=tol, atol=tol)
                else:
                    ok = np.array_equal(got, ref.astype(dt))
                # the other process's bits, through the store
                client.key_value_set_bytes(f"selftest/{name}/{pid}", got.tobytes())
                other = client.blocking_key_value_get_bytes(f"selftest/{name}/{1 - pid}", 60_000)
                same = other == got.tobytes()
                checks += 1
                if not (ok and same):
                    failures.append(f"{name}: {'wrong values' if not ok else ''} {'ranks differ' if not same else ''}")
    timings = _time_against_lax(mesh) if distinct and not quick else []
    return {"ok": not failures, "process": pid, "checks": checks, "failures": failures, "timings": timings,
            "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "gpus": "one per process" if distinct else "both processes on GPU 0"}


def _time_against_lax(mesh) -> list[dict]:
    """Per-call time of a 20-call chain of our all-reduce and of lax.psum, float32, taking turns
    (jax_blink.bench's method). Both processes run the same number of rounds (no time-based
    stopping), so neither waits on a call the other never makes."""
    import statistics

    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_blink
    from jax_blink import bench

    k, rows = 20, []
    for nbytes in (1 << 10, 1 << 16, 1 << 20, 1 << 24, 1 << 28):
        n = nbytes // 4
        ours = bench._chained(lambda v, a: jax_blink.all_reduce(v, a) * 0.5, mesh, "x", k)
        lax_ = bench._chained(lambda v, a: jax.lax.psum(v, a) * 0.5, mesh, "x", k)
        x = jax.device_put(np.random.default_rng(1).standard_normal(2 * n).astype(np.float32),
                           NamedSharding(mesh, P("x")))
        runs = 30 if nbytes <= 1 << 20 else 8
        t_ours, t_lax = bench.interleaved_times([ours, lax_], x, runs)
        same = np.allclose(np.asarray(ours(x).addressable_shards[0].data),
                           np.asarray(lax_(x).addressable_shards[0].data), rtol=1e-5, atol=1e-5)
        us = lambda t: round(statistics.median(t) / k * 1e6, 2)
        rows.append({"bytes_per_rank": nbytes, "ours_us": us(t_ours), "lax_us": us(t_lax),
                     "speedup": round(statistics.median(t_lax) / statistics.median(t_ours), 3), "same": bool(same)})
    return rows


def _gpu_count() -> int:
    try:
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for ln in r.stdout.splitlines() if ln.startswith("GPU "))


def main() -> int:
    if len(sys.argv) >= 3 and sys.argv[1] == "--child":
        r = child(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "distinct")
        print("RESULT " + json.dumps(r), flush=True)
        return 0 if r["ok"] else 1
    out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
    # With two GPUs each process takes its own (one process per GPU, as launchers run jobs);
    # with one, both share GPU 0. --shared forces the shared layout.
    distinct = _gpu_count() >= 2 and "--shared" not in sys.argv
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, __file__, "--child", str(i), str(port),
                              "distinct" if distinct else "shared"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True) for i in range(2)]
    results = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            print("self-test did not finish in 600 s")
            return 1
        lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        results.append(json.loads(lines[-1][7:]) if lines else {"ok": False, "output": text[-4000:]})
    summary = {"command": "python tests/gpu_ipc_selftest.py", "seconds": round(time.time() - t0, 1),
               "ok": all(r.get("ok") for r in results), "processes": results}
    print(json.dumps(summary, indent=1))
    if out:
        with open(out, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
