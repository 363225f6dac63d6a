"""Two processes sharing one GPU run jax_blink.all_reduce through CUDA IPC (needs a CUDA GPU).

    python tests/gpu_ipc_selftest.py [--out benchmarks/results/ipc-selftest-<machine>.json]

Starts a jax.distributed job of two processes on loopback, both on GPU 0
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


def child(pid: int, port: int) -> dict:
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    os.environ["JAX_BLINK_FALLBACK"] = "raise"
    os.environ["JAX_BLINK_DISPATCH"] = "blink"
    import jax

    jax.config.update("jax_enable_x64", True)  # float64 and int64 as themselves
    import ml_dtypes
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid, local_device_ids=[0])
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
    return {"ok": not failures, "process": pid, "checks": checks, "failures": failures,
            "device": jax.devices()[0].device_kind, "jax": jax.__version__}


def main() -> int:
    if len(sys.argv) >= 3 and sys.argv[1] == "--child":
        r = child(int(sys.argv[2]), int(sys.argv[3]))
        print("RESULT " + json.dumps(r), flush=True)
        return 0 if r["ok"] else 1
    out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, __file__, "--child", str(i), str(port)], stdout=subprocess.PIPE,
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
