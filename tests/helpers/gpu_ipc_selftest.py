"""Two or more processes run every jax_blink collective through CUDA IPC (needs a CUDA GPU).

    python tests/helpers/gpu_ipc_selftest.py [--processes N] [--shared] [--out benchmarks/results/ipc-selftest-<machine>.json]
                                     [--bench-out benchmarks/results/allreduce-ipc-<machine>-<date>.json]

Starts a jax.distributed job of N processes (default 2) on loopback. With N or more GPUs each
process takes its own (``local_device_ids=[pid]``), and XLA's psum/pmax/pmin (NCCL) must agree
with ours (not under IPC_SELFTEST_QUICK=1, unless IPC_SELFTEST_LAX=1: NCCL under a sanitizer only
adds time). With fewer GPUs (or ``--shared``) all share GPU 0
(``local_device_ids=[0]``, ``XLA_PYTHON_CLIENT_PREALLOCATE=false``): jax lists N GPUs and a
``shard_map`` over them runs, each process driving its own device. XLA's psum cannot run there
(NCCL refuses a duplicate GPU), so results are checked against numpy (float64 for the float sums),
and every process compares its result with every other's bit for bit through the job's
key-value store where they must agree (all_reduce, all_gather, broadcast). Every collective (all_reduce, all_gather,
reduce_scatter, broadcast, reduce; sum/max/min where it reduces; tiled and untiled layouts, both
roots for float32), every dtype, pieces of 7, 1031 and 2^20 elements (the last for float32 and
bfloat16), with JAX_BLINK_FALLBACK=raise and JAX_BLINK_DISPATCH=blink (no quiet fall-back); the
optimized program must hold the IPC custom call. Exits 0 when both processes pass. Under
compute-sanitizer (IPC_SELFTEST_QUICK=1: float32 and bfloat16, 7 and 1031 elements, every
collective once; IPC_SELFTEST_QUICK=2: 1031 elements only):
``IPC_SELFTEST_QUICK=1 compute-sanitizer --tool memcheck --target-processes all python tests/helpers/gpu_ipc_selftest.py --processes 4``.

Timing (two GPUs, or IPC_SELFTEST_TIMING=only: no checks, ours alone where NCCL cannot run): a
20-call chain of all_reduce against lax.psum, float32, 1 KiB-256 MiB per rank; IPC_SELFTEST_PROFILE=1
adds each kernel's time at 1 and 16 MiB; --bench-out writes the timings as a bench result of layout
"several processes" for the dispatch table (``python -m jax_blink crossover PATH``). ``--dispatch auto``
times what ``dispatch="auto"`` runs instead of the executor (each row names the path it ran; such a
file records ``dispatch: auto``, which the dispatch table refuses to be derived from).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import children  # tests/helpers (this script's folder, first on its path)


#: Every collective the self-test checks: (name, variant), the variant its keyword arguments.
#: "extra": checked for float32 only (layouts and roots; the dtype paths are the same).
CASES = (("all_reduce", {"op": "sum"}), ("all_reduce", {"op": "max"}), ("all_reduce", {"op": "min"}),
         ("all_gather", {"tiled": False}), ("reduce_scatter", {"tiled": True}),
         ("broadcast", {"root": 1}), ("reduce", {"root": 1, "op": "sum"}),
         ("reduce", {"root": 1, "op": "max"}), ("reduce", {"root": 1, "op": "min"}))
EXTRA_CASES = (("all_gather", {"tiled": True}), ("reduce_scatter", {"tiled": False}),
               ("broadcast", {"root": 0}), ("reduce", {"root": 0, "op": "sum"}))
#: The cases under compute-sanitizer (IPC_SELFTEST_QUICK=1): every collective once, every op.
QUICK_CASES = CASES[:7]


def _operand_shape(what: str, kw: dict, size: int, nproc: int = 2) -> tuple[int, ...]:
    """A rank's operand for ``size`` elements per piece: reduce_scatter's holds one piece per rank."""
    if what == "reduce_scatter":
        return (nproc * size,) if kw["tiled"] else (nproc, size)
    return (size,)


def _ours(what: str, kw: dict):
    import jax_blink

    fn = getattr(jax_blink, what)
    return lambda v: fn(v, "x", **kw)


def _numpy_reference(what: str, kw: dict, data, pid: int):
    """What rank ``pid`` must get, from every rank's operand ``data[rank]``: float64 for float
    sums (compared with a tolerance), the exact values elsewhere."""
    import numpy as np

    integer = np.issubdtype(data.dtype, np.integer)
    op = kw.get("op", "sum")
    if op == "sum":
        total = data.sum(0) if integer else data.astype(np.float64).sum(0)
    else:
        total = data.max(0) if op == "max" else data.min(0)
    if what == "all_reduce":
        return total
    if what == "all_gather":
        return data.reshape((-1,) + data.shape[2:]) if kw["tiled"] else data
    if what == "reduce_scatter":
        return total.reshape(data.shape[0], -1)[pid] if kw["tiled"] else total[pid]
    if what == "broadcast":
        return data[kw["root"]]
    return total if pid == kw["root"] else data[pid]  # reduce


def _same_on_every_rank(what: str, kw: dict) -> bool:
    """Whether every rank must hold the same result (compared bit for bit through the store)."""
    return what in ("all_reduce", "all_gather", "broadcast")


def _close(got, want, dname: str, exact: bool) -> bool:
    import numpy as np

    if exact:
        return np.array_equal(got, want.astype(got.dtype))
    tol = {"bfloat16": 2e-2, "float16": 2e-3}.get(dname, 1e-6)
    return np.allclose(got.astype(np.float64), want, rtol=tol, atol=tol)


def child(pid: int, port: int, distinct: bool, nproc: int = 2) -> dict:
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    os.environ["JAX_BLINK_FALLBACK"] = "raise"
    os.environ["JAX_BLINK_DISPATCH"] = "blink"
    import jax

    jax.config.update("jax_enable_x64", True)  # float64 and int64 as themselves
    import ml_dtypes
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
                               local_device_ids=[pid if distinct else 0])
    from jax_blink.lowering import backends as _backends
    from jax_blink.lowering import processes as distributed
    from jax_blink.options import settings as options

    client = distributed._client()
    assert jax.device_count() == nproc, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("x",))
    rng = np.random.default_rng(7)
    failures, checks, seen_ipc = [], 0, set()
    quick = os.environ.get("IPC_SELFTEST_QUICK") in ("1", "2")  # under compute-sanitizer: fewer cases
    timing = os.environ.get("IPC_SELFTEST_TIMING", "auto")  # auto (two GPUs), only (no checks), off
    # NCCL beside ours where each process has its own GPU; not under the sanitizer's quick set
    with_lax = distinct and os.environ.get("IPC_SELFTEST_LAX", "0" if quick else "1") == "1"
    dtypes = (("float32", np.float32), ("bfloat16", ml_dtypes.bfloat16), ("float16", np.float16),
              ("float64", np.float64), ("int32", np.int32), ("int64", np.int64))
    # IPC_SELFTEST_QUICK=2 (the smallest set, for runs of 4 processes under every sanitizer): 1031
    # elements alone, a ragged size that no 16-byte copy covers whole
    sizes = ((1031,) if os.environ.get("IPC_SELFTEST_QUICK") == "2" else (7, 1031)) if quick else (7, 1031, 1 << 20)
    for dname, dt in () if timing == "only" else dtypes[:2] if quick else dtypes:
        for size in sizes:
            if size == 1 << 20 and dname not in ("float32", "bfloat16"):
                continue
            cases = QUICK_CASES if quick else CASES + (EXTRA_CASES if dname == "float32" else ())
            for what, kw in cases:
                shape = _operand_shape(what, kw, size, nproc)
                if dt in (np.int32, np.int64):
                    data = rng.integers(-1000, 1000, size=(nproc,) + shape).astype(dt)
                else:
                    data = rng.standard_normal((nproc,) + shape).astype(dt)
                name = f"{dname}/{size}/{what}/" + ",".join(f"{k}={v}" for k, v in kw.items())
                spec = P("x")
                x = jax.make_array_from_callback((nproc * shape[0],) + shape[1:], NamedSharding(mesh, spec),
                                                 lambda idx: data.reshape((-1,) + shape[1:])[idx])
                f = jax.jit(jax.shard_map(_ours(what, kw), mesh=mesh, in_specs=spec, out_specs=spec))
                if what not in seen_ipc:  # the optimized program must hold the IPC custom call
                    seen_ipc.add(what)
                    if _backends.TARGET_IPC not in f.lower(x).compile().as_text():
                        failures.append(f"{what}: no {_backends.TARGET_IPC} in the optimized program")
                got = np.asarray(f(x).addressable_shards[0].data)
                if with_lax:  # one GPU each: XLA's own collective (NCCL) runs too, and must agree
                    with options.override(dispatch="lax"):  # the same call, as lax's expression
                        g = jax.jit(jax.shard_map(_ours(what, kw), mesh=mesh, in_specs=spec,
                                                  out_specs=spec)).lower(x).compile()
                    want = np.asarray(g(x).addressable_shards[0].data)
                    # NCCL's ring rounds every partial sum to the dtype (nproc - 1 roundings of partial
                    # sums up to about 4 in size); ours sums in float32 and rounds once
                    tol = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}.get(dname, 2.5e-7) * 4 * (nproc - 1)
                    if got.shape != want.shape or not np.allclose(got.astype(np.float64), want.astype(np.float64),
                                                                  rtol=tol, atol=tol):
                        failures.append(f"{name}: differs from lax")
                want = _numpy_reference(what, kw, data, pid)
                exact = dt in (np.int32, np.int64) or kw.get("op", "sum") != "sum" or what in (
                    "all_gather", "broadcast") or (what == "reduce" and pid != kw["root"])
                ok = got.shape == want.shape and _close(got, want, dname, exact)
                same = True
                if _same_on_every_rank(what, kw):  # the other process's bits, through the store
                    client.key_value_set_bytes(f"selftest/{name}/{pid}", got.tobytes())
                    same = all(client.blocking_key_value_get_bytes(f"selftest/{name}/{q}", 60_000) == got.tobytes()
                               for q in range(nproc) if q != pid)
                checks += 1
                if not (ok and same):
                    failures.append(f"{name}: {'wrong values' if not ok else ''} {'ranks differ' if not same else ''}")
    timed = timing == "only" or (timing == "auto" and distinct and not quick)
    timings = _time_against_lax(mesh, lax_too=distinct, dispatch=os.environ.get("IPC_SELFTEST_DISPATCH", "blink")
                                ) if timed else []
    return {"ok": not failures, "process": pid, "processes": nproc, "checks": checks, "failures": failures,
            "timings": timings, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "gpus": "one per process" if distinct else "every process on GPU 0"}


def _time_against_lax(mesh, lax_too: bool, dispatch: str = "blink") -> list[dict]:
    """Per-call time of a 20-call chain of our all-reduce (traced under ``dispatch``: ``blink``, the
    executor, or ``auto``, what users get; each row's ``path`` says which ran) and (``lax_too``: one
    GPU per process, where NCCL runs) of lax.psum, float32, taking turns (jax_blink.tools.bench's
    method). Both processes run the
    same number of rounds (no time-based stopping), so neither waits on a call the other never
    makes. IPC_SELFTEST_PROFILE=1 also traces one chain of ours at 1 and 16 MiB (CUPTI, through
    jax's profiler) and reports each kernel's median time and the gaps between kernels."""
    import statistics

    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_blink
    from jax_blink.tools import timing

    k, rows = 20, []
    profile = os.environ.get("IPC_SELFTEST_PROFILE") == "1"
    for nbytes in (1 << 10, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28):
        n = nbytes // 4
        ours = timing.chained(lambda v, a: jax_blink.all_reduce(v, a) * 0.5, mesh, "x", k, dispatch=dispatch)
        lax_ = timing.chained(lambda v, a: jax.lax.psum(v, a) * 0.5, mesh, "x", k)
        data = np.random.default_rng(1).standard_normal(mesh.devices.size * n).astype(np.float32)
        # (not device_put: in a job of processes it checks the value through XLA's collectives,
        # which cannot run where both processes share a GPU)
        x = jax.make_array_from_callback(data.shape, NamedSharding(mesh, P("x")), lambda idx: data[idx])
        runs = 30 if nbytes <= 1 << 20 else 8
        fns = [ours, lax_] if lax_too else [ours]
        times = timing.interleaved_times(fns, x, runs)
        us = lambda t: round(statistics.median(t) / k * 1e6, 2)
        path = "executor" if timing.runs_executor(ours, x) else "lax"
        row = {"bytes_per_rank": nbytes, "ours_us": us(times[0]), "dispatch": dispatch, "path": path}
        if lax_too:
            row["lax_us"] = us(times[1])
            row["speedup"] = round(statistics.median(times[1]) / statistics.median(times[0]), 3)
            # the chain doubles the values each call; elements that cancel carry the sums' rounding
            # relative to the largest value, not to themselves
            a, b = np.asarray(ours(x).addressable_shards[0].data), np.asarray(lax_(x).addressable_shards[0].data)
            row["same"] = bool(np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(b)))
        if profile and nbytes in (1 << 20, 1 << 24):
            row["profile"] = _kernel_profile(ours, x)
        rows.append(row)
    return rows


def _kernel_profile(fn, x) -> dict:
    """Median duration per kernel name of one traced run of ``fn(x)`` on this process's GPU, and
    the median idle gap between consecutive kernels (benchmarks/call_profile.py's trace)."""
    import statistics

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
    import call_profile

    ev = sorted((e for e in call_profile.events(call_profile.trace(fn, x)) if e[0] == "device"
                 and not call_profile._MEMCPY.search(e[2])), key=lambda e: e[3])
    by_name: dict[str, list[float]] = {}
    for e in ev:
        by_name.setdefault(call_profile._norm(e[2])[:60], []).append(e[4] / 1e3)
    gaps = [(b[3] - (a[3] + a[4])) / 1e3 for a, b in zip(ev, ev[1:])]
    return {"kernels_us": {k: [len(v), round(statistics.median(v), 2)] for k, v in by_name.items()},
            "gap_us_median": round(statistics.median(gaps), 2) if gaps else None,
            "span_us": round((ev[-1][3] + ev[-1][4] - ev[0][3]) / 1e3, 1) if ev else None}


def main() -> int:
    if len(sys.argv) >= 3 and sys.argv[1] == "--child":
        r = child(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "distinct", int(sys.argv[5]))
        print("RESULT " + json.dumps(r), flush=True)
        return 0 if r["ok"] else 1
    import argparse

    ap = argparse.ArgumentParser(prog="python tests/helpers/gpu_ipc_selftest.py",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=2, metavar="N",
                    help="processes in the job, 2 or more (default 2); one GPU each where there are N")
    ap.add_argument("--shared", action="store_true",
                    help="every process on GPU 0 even where there are enough GPUs")
    ap.add_argument("--out", metavar="JSON", help="write the summary here")
    ap.add_argument("--dispatch", choices=("blink", "auto"), default="blink",
                    help="what the timing runs as ours: blink (default), the executor, which dispatch entries "
                         "come from; auto, what dispatch=\"auto\" runs (each row names the path)")
    ap.add_argument("--bench-out", metavar="JSON",
                    help="write the timings (two GPUs) as a bench result for python -m jax_blink crossover")
    args = ap.parse_args()
    nproc = args.processes
    if nproc < 2:
        ap.error(f"--processes must be 2 or more, got {nproc}")
    for path in (args.out, args.bench_out):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.path.isdir(folder):
            ap.error(f"no folder {folder!r} to write {path!r} in")
    if children.gpu_count() == 0:
        ap.error("needs a CUDA GPU (nvidia-smi lists none); tests/gpu/test_cuda_ipc.py skips without one")
    out = args.out
    os.environ["IPC_SELFTEST_DISPATCH"] = args.dispatch  # the children's timing reads it
    # With N GPUs each process takes its own (one process per GPU, as launchers run jobs);
    # with fewer, all share GPU 0. --shared forces the shared layout.
    distinct = children.gpu_count() >= nproc and not args.shared
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.time()
    # Output to files, not pipes: a child blocked on a full pipe would stall its peers.
    logs = [tempfile.TemporaryFile("w+") for _ in range(nproc)]
    procs = [subprocess.Popen([sys.executable, __file__, "--child", str(i), str(port),
                              "distinct" if distinct else "shared", str(nproc)], stdout=log,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for i, log in enumerate(logs)]
    children.note_children(procs)
    deadline = time.monotonic() + 600
    timed_out = False
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    for p in procs:  # every child's process group killed where it is still there, then reaped
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    results = []
    for log in logs:
        log.seek(0)
        text = log.read()
        log.close()
        lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        results.append(json.loads(lines[-1][7:]) if lines else {"ok": False, "output": text[-4000:]})
    if timed_out:
        print("self-test did not finish in 600 s")
    summary = {"command": f"python tests/helpers/gpu_ipc_selftest.py --processes {nproc}",
               "seconds": round(time.time() - t0, 1), "ok": not timed_out and all(r.get("ok") for r in results),
               "processes": results}
    print(json.dumps(summary, indent=1))
    if out:
        with open(out, "w") as f:
            json.dump(summary, f, indent=1)
    if args.bench_out and distinct:
        _write_bench_json(args.bench_out, results)
    return 0 if summary["ok"] else 1


def _write_bench_json(path: str, results: list[dict]) -> None:
    """The timings as a bench result of layout "several processes", which jax_blink.lowering.dispatch_table.derive
    reads (``python -m jax_blink crossover PATH``): one row per process and size."""
    n = results[0].get("processes", 2)
    rows = [{"size": t["bytes_per_rank"], "count": t["bytes_per_rank"] // 4, "dtype": "float32", "n": n,
             "process": r["process"], "time_us": t["ours_us"], "lax_time_us": t["lax_us"],
             "speedup": t["speedup"], "wrong": 0 if t["same"] else 1, "path": t.get("path", "executor")}
            for r in results for t in r.get("timings", []) if "lax_us" in t]
    meta = {"device_kind": results[0].get("device"), "n": n, "jax": results[0].get("jax"), "k": 20,
            "collective": "allreduce", "layout": "several processes", "date": time.strftime("%Y-%m-%d"),
            "dispatch": (results[0].get("timings") or [{}])[0].get("dispatch", "blink"),
            "method": "tests/helpers/gpu_ipc_selftest.py, one process per GPU (jax.distributed on loopback): a 20-call "
                      "chain of jax_blink.all_reduce (CUDA IPC) and of lax.psum (NCCL), taking turns, median "
                      "per-call time; each process timed its own device, one row per process and size"}
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
