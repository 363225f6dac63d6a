"""A process of a two-process CUDA IPC job skips a collective or dies (needs a CUDA GPU).

    python tests/helpers/gpu_ipc_faults.py skip|kill [all_reduce|broadcast] [--shared]

Two processes (one GPU each where two or more are present, else both on GPU 0, as
tests/helpers/gpu_ipc_selftest.py lays them out) run the same jax_blink collective, with
JAX_BLINK_TIMEOUT_S=3. Both make calls 1 and 2 (checked against numpy); then process 1 stops:
``skip``: it never makes call 3 and waits (for the store) until process 0 is done, then leaves
normally; ``kill``: it sends itself SIGKILL (and the error must also say that its process exited). Process 0 makes call 3, whose wait gives up at the
budget, then ``jax_blink.check()`` and call 4 must both raise an error naming "rank 1 (process 1)",
within the budget plus a margin, and process 0 must exit afterwards (no kernel left spinning: it
frees its IPC regions first, which waits for the GPU). broadcast is rooted at process 0, which
receives no data: only the flag protocol tells it that process 1 is missing. Exits 0 when all
holds; prints a JSON summary. ``kill`` runs with jax's ``jax_enable_recoverability`` on, where
jax has it: otherwise jax's coordination service may end the survivor itself when it sees the
other process die.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time

TIMEOUT_S = 3.0
#: Slack on top of the budget: the error's way back through XLA, time slicing of a shared GPU.
MARGIN_S = 12.0
#: How long the survivor may take to exit after its result (jax's own shutdown included).
EXIT_S = 60.0
VICTIM, SURVIVOR = 1, 0


def child(pid: int, port: int, distinct: bool, fault: str, what: str) -> dict:
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    os.environ["JAX_BLINK_FALLBACK"] = "raise"
    os.environ["JAX_BLINK_DISPATCH"] = "blink"
    os.environ["JAX_BLINK_TIMEOUT_S"] = str(TIMEOUT_S)
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    if fault == "kill":
        # Without it jax's coordination service may end the survivor itself once it sees a task
        # die (by design: the job fails); this test is about what jax_blink does then.
        try:
            jax.config.update("jax_enable_recoverability", True)
        except (AttributeError, KeyError, ValueError):  # a jax without the option
            pass
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                               local_device_ids=[pid if distinct else 0])
    import jax_blink
    from jax_blink.lowering import backends as _backends
    from jax_blink.lowering import processes as distributed

    client = distributed._client()
    mesh = Mesh(np.array(jax.devices()), ("x",))
    size = 1031
    data = np.random.default_rng(3).standard_normal((2, size)).astype(np.float32)
    x = jax.make_array_from_callback((2 * size,), NamedSharding(mesh, P("x")), lambda idx: data.reshape(-1)[idx])
    kw = {"root": SURVIVOR} if what == "broadcast" else {}
    fn = getattr(jax_blink, what)
    f = jax.jit(jax.shard_map(lambda v: fn(v, "x", **kw), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    want = data[SURVIVOR] if what == "broadcast" else data.astype(np.float64).sum(0)

    def call():
        return np.asarray(f(x).addressable_shards[0].data)

    report = {"process": pid, "collective": what, "fault": fault}
    first_two = [np.allclose(call(), want, rtol=1e-5, atol=1e-5) for _ in range(2)]
    if not all(first_two):
        return {**report, "ok": False, "failures": ["calls 1 and 2 gave wrong values"]}
    if pid == VICTIM:
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        # skip: no call 3; leave once the survivor has its error (both then exit normally)
        client.blocking_key_value_get("faults/done", int((TIMEOUT_S + MARGIN_S + 120) * 1000))
        return {**report, "ok": True, "role": "skipped call 3"}

    t0 = time.monotonic()
    call()  # call 3: its wait gives up at the budget; its result is undefined
    t_call3 = time.monotonic() - t0
    errors = {}
    try:
        jax_blink.check()
        errors["check"] = "(no error)"
    except RuntimeError as e:
        errors["check"] = str(e)
    try:
        call()
        errors["call 4"] = "(no error)"
    except Exception as e:  # noqa: BLE001  XLA's runtime error type differs between jax versions
        errors["call 4"] = str(e)
    t_error = time.monotonic() - t0
    # A kernel still spinning would make this hang (cudaFree waits for the device).
    _backends.module("gpu").ipc_release()
    failures = [f"{k} did not name rank 1 (process 1): {v[:400]}" for k, v in errors.items()
                if "rank 1 (process 1)" not in v]
    if fault == "kill":  # the message tells a dead process from a late one (its pid is gone)
        failures += [f"{k} did not say that the process exited: {v[:400]}" for k, v in errors.items()
                     if "has exited" not in v]
    if t_error > TIMEOUT_S + MARGIN_S:
        failures.append(f"the error took {t_error:.1f} s, more than the budget {TIMEOUT_S:g} s + {MARGIN_S:g} s")
    if fault == "skip":
        client.key_value_set("faults/done", "1")
    return {**report, "ok": not failures, "failures": failures, "errors": errors,
            "call3_s": round(t_call3, 2), "error_s": round(t_error, 2), "t_result": time.time()}


def _run_children(argv_of, timeout_s: float) -> list[dict]:
    """Every child bounded (children.run_bounded): its return code, output, RESULT dict and the
    time it exited."""
    import children  # tests/helpers, on the path since main()

    out = []
    for r in children.run_bounded(argv_of, timeout_s):
        lines = [ln for ln in r["output"].splitlines() if ln.startswith("RESULT ")]
        out.append({"rc": r["rc"], "exited": r["exited"], "output": r["output"][-3000:],
                    "result": json.loads(lines[-1][7:]) if lines else None})
    return out


def main() -> int:
    if len(sys.argv) >= 3 and sys.argv[1] == "--child":
        pid, port, layout, fault, what = sys.argv[2:7]
        r = child(int(pid), int(port), layout == "distinct", fault, what)
        print("RESULT " + json.dumps(r), flush=True)
        if fault == "kill":
            # The peer is dead: jax.distributed's shutdown barrier at exit would wait for it
            # (jax's own shutdown_timeout, minutes). Our part is done: the regions are freed.
            os._exit(0 if r["ok"] else 1)
        return 0 if r["ok"] else 1
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    fault = args[0] if args else ""
    what = args[1] if len(args) > 1 else "all_reduce"
    if fault not in ("skip", "kill") or what not in ("all_reduce", "broadcast"):
        print(__doc__)
        return 2
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import children  # tests/helpers

    if children.gpu_count() == 0:
        print("python tests/helpers/gpu_ipc_faults.py: error: needs a CUDA GPU (nvidia-smi lists none); "
              "tests/gpu/test_cuda_ipc.py skips without one", file=sys.stderr)
        return 2
    distinct = children.gpu_count() >= 2 and "--shared" not in sys.argv
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.time()
    runs = _run_children([[sys.executable, os.path.abspath(__file__), "--child", str(i), str(port),
                           "distinct" if distinct else "shared", fault, what] for i in range(2)], 300)
    survivor, victim = runs[SURVIVOR], runs[VICTIM]
    failures = []
    r = survivor["result"]
    if r is None:
        failures.append("process 0 gave no result: " + survivor["output"][-1500:])
    else:
        failures += r.get("failures", [])
        if survivor["exited"] is None or survivor["exited"] - r.get("t_result", 0) > EXIT_S:
            failures.append(f"process 0 did not exit within {EXIT_S:g} s of its result")
    if survivor["rc"] != 0:
        failures.append(f"process 0 exited with {survivor['rc']}")
    want_victim_rc = -signal.SIGKILL if fault == "kill" else 0
    if victim["rc"] != want_victim_rc:
        failures.append(f"process 1 exited with {victim['rc']}, not {want_victim_rc}: " + victim["output"][-1500:])
    summary = {"command": f"python tests/helpers/gpu_ipc_faults.py {fault} {what}", "ok": not failures,
               "gpus": "one per process" if distinct else "both processes on GPU 0",
               "seconds": round(time.time() - t0, 1), "failures": failures,
               "survivor": r, "victim": victim["result"]}
    print(json.dumps(summary, indent=1))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
