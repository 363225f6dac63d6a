"""Faults injected into the multi-device paths: each must end in a clear error within the time
budget, and a new call after ``jax_blink.reset()`` must work again.

    python benchmarks/gpu_faults.py [--platform gpu|cpu] [--cases skip,skip-ce,never,unmapped,setup,kill,shape]
        [--processes 4] [--timeout-s 2] [--setup-timeout-s 4] [--out faults.json]

Cases (the last of ``--processes`` is the faulty rank or process, the others survivors):

  skip      one process, every local device (up to 4): the last rank skips an all_reduce under
            ``lax.cond`` whose call site every rank has already run once (so the skip meets a
            set-up collective, not its set-up).
  skip-ce   the same with the all-reduce on copy engines (``JAX_BLINK_TWOSHOT_ENGINE=ce``, an operand of 1 MiB per rank and the
            two-shot sizes from 1 KiB; 3+ GPUs): the ranks that call wait for the skipping one
            on the host, not in a kernel.
  never     a job of N processes (CUDA IPC on GPUs, shared memory on CPU): after two good calls
            the last process never makes call 3 (it stays alive); the others make calls 3 and 4.
  unmapped  the last process frees its regions early (``ipc_release()``: its IPC memory, which
            its peers still map; on CPU ``shm_cleanup()``) after two good calls, then tries call 3.
  setup     the last process never reaches a new call site: the others' set-up of it waits for
            its handle (``JAX_BLINK_SETUP_TIMEOUT_S``).
  kill      the last process is killed (SIGKILL) while its call 3 runs (the others start theirs
            1 s later); the others make calls 3 and 4.
  shape     the last process's operand has twice the others' elements (a different global
            shape, as a rank with another batch would have).

Per case and surviving process it records what each call did (ok, wrong values, an error, or
still blocked at the deadline), the time from the faulty call to the first error that surfaced
(the call itself, ``jax_blink.check()`` or the next call), whether that error names the faulty
rank, and recovery: ``jax_blink.reset()``, then a newly traced call over the devices still alive
(every process but a killed one) checked against numpy on fresh random data; and, for the IPC
cases, whether the failed call site itself works after ``reset()`` (IPC failures are sticky by
design). Every child runs under a deadline and is killed (its process group) and reaped after
it. Cases share jobs: ``never, unmapped, setup, kill`` run in one job of N processes (in that
order; the killed process is the last thing), ``shape`` in a job of its own (its overrun may
break the faulty process's GPU context); ``--separate`` gives every case its own job.

Prints a table and ``--out`` writes JSON. Exits 0 when every case ended in an error within the
budget (plus a margin) and recovered, 1 otherwise (a finding to name, not a crash of this
script). On CPU host devices (``--platform cpu``) the same cases run through the CPU executor:
one process of 4 host devices, and jobs of N processes of one host device each.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "helpers"))
import children  # noqa: E402  (tests/helpers/children.py: GPU count, bounded children)

CASES = ("skip", "skip-ce", "never", "unmapped", "setup", "kill", "shape")
ONE_PROCESS_CASES = ("skip", "skip-ce")
IPC_CASES = tuple(c for c in CASES if c not in ONE_PROCESS_CASES)
#: Cases that share one job, in this order (the killed process last); the others get a job each.
SHARED_JOB = ("never", "unmapped", "setup", "kill")
#: Slack on top of the budget: the error's way back through XLA, a loaded machine.
MARGIN_S = 10.0
SIZE = 1031  # elements per rank: not a multiple of 16 bytes' worth, so the ragged tail is in play
SIZE_CE = (1 << 18) + 3  # skip-ce: large enough for a two-shot site (the copy engines' sizes), ragged


# ---------------------------------------------------------------------------------------------
# Helpers of the children.

def _outcome(fn, deadline_s: float) -> dict:
    """Run ``fn()`` in a thread; ``{"state": "returned" | "error" | "blocked", ...}`` and seconds.
    A blocked call is left behind (its thread is a daemon): the caller reports and exits."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except Exception as e:  # noqa: BLE001  XLA's error types differ between jax versions
            box["error"] = f"{type(e).__name__}: {e}"

    t0 = time.monotonic()
    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(deadline_s)
    took = round(time.monotonic() - t0, 3)
    if t.is_alive():
        return {"state": "blocked", "seconds": took}
    if "error" in box:
        return {"state": "error", "seconds": took, "error": box["error"][:1500]}
    return {"state": "returned", "seconds": took, "value": box.get("value")}


def _check_error() -> str | None:
    import jax_blink

    try:
        jax_blink.check()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"[:1500]
    return None


def _values(result, want, what: str) -> dict:
    """``returned`` -> ``ok`` or ``wrong`` against numpy's ``want`` (float64 sums)."""
    import numpy as np

    got = np.asarray(result, dtype=np.float64)
    if got.shape != want.shape:
        return {"state": "wrong", "detail": f"{what}: shape {got.shape}, expected {want.shape}"}
    if np.allclose(got, want, rtol=1e-5, atol=1e-5):
        return {"state": "ok"}
    bad = int(np.sum(~np.isclose(got, want, rtol=1e-5, atol=1e-5)))
    return {"state": "wrong", "detail": f"{what}: {bad} of {got.size} elements differ from numpy"}


def _call(fn, x, want, deadline_s: float, what: str) -> dict:
    """One call of ``fn(x)`` (this process's first shard read back) under a deadline, judged."""
    import numpy as np

    r = _outcome(lambda: np.asarray(fn(x).addressable_shards[0].data), deadline_s)
    if r["state"] == "returned":
        r.update(_values(r.pop("value"), want, what))
    return r


# ---------------------------------------------------------------------------------------------
# Case "skip": one process, several devices.

def child_one_process(timeout_s: float, case: str = "skip") -> dict:
    size = SIZE_CE if case == "skip-ce" else SIZE
    if case == "skip-ce":  # read when the sites are set up, so before any call
        os.environ.update(JAX_BLINK_TWOSHOT_ENGINE="ce", JAX_BLINK_TWOSHOT_MIN_BYTES="1K")
    import jax
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jax_blink

    jax_blink.config.timeout_s = timeout_s
    jax_blink.config.dispatch = "blink"
    jax_blink.config.fallback = "raise"
    devices = jax.devices()[:4]
    n = len(devices)
    mesh = Mesh(np.array(devices), ("x",))
    rng = np.random.default_rng(1)

    def put(host):
        return jax.device_put(host, NamedSharding(mesh, P("x")))

    def smap(body):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))

    full = smap(lambda v: jax_blink.all_reduce(v, "x"))
    # A rank whose flag is set skips the all-reduce. Run once with no flag set, so that the site is
    # set up on every rank, then with the last rank's set: the skip meets a running collective
    # (the executor's waits, or the copy engines' host meetings), not its set-up.
    skipping = jax.jit(jax.shard_map(
        lambda v, f: lax.cond(f[0] > 0, lambda a: a, lambda a: jax_blink.all_reduce(a, "x"), v),
        mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x"), check_vma=False))
    psum = smap(lambda v: lax.psum(v, "x"))
    report = {"case": case, "where": f"one process, {n} {devices[0].platform} devices"
              + (", all-reduce on copy engines" if case == "skip-ce" else ""),
              "fault": f"rank {n - 1} skips an all_reduce (lax.cond)", "process": 0}
    host = rng.random((n, size), dtype=np.float32)
    first = _call(full, put(host.reshape(-1)), host.astype(np.float64).sum(0), 60, "call 1")
    report["call 1"] = first
    if first["state"] != "ok":
        return {**report, "ok": False, "what": "the first, good call failed"}
    none_skip, last_skips = put(np.zeros(n, np.int32)), put((np.arange(n) == n - 1).astype(np.int32))
    host = rng.random((n, size), dtype=np.float32)
    second = _call(lambda v: skipping(v, none_skip), put(host.reshape(-1)), host.astype(np.float64).sum(0), 60,
                   "call 2 (no rank skips)")
    report["call 2 (no rank skips)"] = second
    if second["state"] != "ok":
        return {**report, "ok": False, "what": "the second, good call (the skipping program, nobody skipping) failed"}
    host = rng.random((n, size), dtype=np.float32)
    x = put(host.reshape(-1))
    t0 = time.monotonic()
    # The faulty call: ranks 0..n-2 wait for rank n-1. Its result is undefined; what matters is
    # whether and when an error surfaces.
    bad = _outcome(lambda: jax.block_until_ready(skipping(x, last_skips)), timeout_s + MARGIN_S)
    report["faulty call"] = {k: v for k, v in bad.items() if k != "value"}
    t_error = bad["seconds"] if bad["state"] == "error" else None
    if bad["state"] == "blocked":
        return {**report, "ok": False, "what": "HANG: the faulty call still blocked at the deadline"}
    # GPU kernels cannot raise: the error is recorded on the device; poll check() for it.
    error = bad.get("error")
    while error is None and time.monotonic() - t0 < timeout_s + MARGIN_S:
        error = _check_error()
        if error is None:
            time.sleep(0.05)
    if error is not None and t_error is None:
        t_error = round(time.monotonic() - t0, 3)
    after = _call(full, x, host.astype(np.float64).sum(0), timeout_s + MARGIN_S, "next call before reset")
    report["next call before reset"] = after
    if error is None and after["state"] == "error":
        error, t_error = after["error"], round(time.monotonic() - t0, 3)
    report.update(_judge_error(error, t_error, timeout_s, rank=n - 1, process=None))
    reset = _outcome(jax_blink.reset, 60)
    report["reset"] = reset["state"] if reset["state"] != "error" else reset["error"]
    host = rng.random((n, size), dtype=np.float32)
    x = put(host.reshape(-1))
    rec = _call(full, x, host.astype(np.float64).sum(0), timeout_s + MARGIN_S, "after reset")
    if rec["state"] == "ok":  # and against psum on the same data
        same = np.allclose(np.asarray(full(x)), np.asarray(psum(x)), rtol=1e-5, atol=1e-5)
        rec = rec if same else {"state": "wrong", "detail": "differs from lax.psum"}
    report["recovery"] = rec
    report["recovered"] = rec["state"] == "ok"
    report["ok"] = report["error_in_budget"] and report["recovered"]
    return report


def _judge_error(error: str | None, t_error: float | None, timeout_s: float, rank: int,
                 process: int | None) -> dict:
    # "rank 3 (process 3)" (CUDA), "process 3" (set-up), "never joined this call: 3" (CPU executor)
    named = error is not None and bool(
        re.search(rf"\brank {rank}\b|never joined this call: [0-9, ]*\b{rank}\b", error)
        or (process is not None and re.search(rf"\bprocess {process}\b", error)))
    return {"error": error, "time_to_error_s": t_error, "error_names_faulty_rank": named,
            "error_in_budget": error is not None and t_error is not None and t_error <= timeout_s + MARGIN_S}


# ---------------------------------------------------------------------------------------------
# Cases of a job of several processes.

class Job:
    """This process's view of the job: the store, barriers with a deadline, the mesh."""

    def __init__(self, pid: int, nproc: int, timeout_s: float, setup_s: float):
        import jax

        from jax_blink.lowering import processes

        self.pid, self.nproc, self.victim = pid, nproc, nproc - 1
        self.timeout_s, self.setup_s = timeout_s, setup_s
        self.client = processes._client()
        self.platform = jax.devices()[0].platform
        self.phase = ""

    def barrier(self, name: str, members, wait_s: float = 120.0) -> None:
        key = f"faults/{self.phase}/{name}"
        self.client.key_value_set(f"{key}/{self.pid}", "1")
        for q in members:
            if q != self.pid:
                self.client.blocking_key_value_get(f"{key}/{q}", int(wait_s * 1000))

    def mesh(self, alive):
        import jax
        import numpy as np
        from jax.sharding import Mesh

        return Mesh(np.array([d for d in jax.devices() if d.process_index in alive]), ("x",))

    def site(self, mesh, what: str = "all_reduce"):
        """A newly traced call site over ``mesh`` (a new comm_id, set up when first lowered)."""
        import jax
        from jax.sharding import PartitionSpec as P

        import jax_blink

        fn = getattr(jax_blink, what)
        jitted = jax.jit(jax.shard_map(lambda v: fn(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                       check_vma=False))

        def call(x):
            # The mesh in context while the site is traced: a mesh of only some of the job's
            # devices (the survivors') is known to the lowering no other way (jax 0.11.2 on GPUs).
            with jax.set_mesh(mesh):
                return jitted(x)
        return call

    def data(self, mesh, seed: int, size: int = SIZE):
        """Fresh random rows, the same in every process (each builds its own shards), as a global array."""
        import jax
        import numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P

        n = mesh.devices.size
        host = np.random.default_rng(seed).random((n, size), dtype=np.float32)
        x = jax.make_array_from_callback((n * size,), NamedSharding(mesh, P("x")),
                                         lambda idx: host.reshape(-1)[idx])
        return host, x

    def release_my_memory(self) -> str:
        """Free this process's collective memory now (the fault of case "unmapped")."""
        from jax_blink.lowering import backends

        if self.platform == "gpu":
            backends.module("gpu").ipc_release()
            return "ipc_release(): every IPC region of this process freed, its handles of peers closed"
        return f"shm_cleanup(): unlinked {list(backends.module('cpu').shm_cleanup())}"


def run_case(job: Job, case: str, seed: int) -> dict:
    """One case in this process; returns its report (victim or survivor view)."""
    import numpy as np

    job.phase = case
    everyone = list(range(job.nproc))
    survivors = everyone[:-1]
    me_victim = job.pid == job.victim
    t_budget = job.timeout_s + MARGIN_S
    report = {"case": case, "process": job.pid, "role": "faulty" if me_victim else "survivor"}
    job.barrier("start", everyone)
    mesh = job.mesh(everyone)
    if case == "setup":
        report["fault"] = f"process {job.victim} never reaches the set-up of a new call site"
        if me_victim:  # traces nothing: after reset() (a new epoch of comm ids) the sites pair again
            job.barrier("survivors-done", everyone, wait_s=job.setup_s + t_budget + 120)
            return _recover(job, report, everyone, seed)
        host, x = job.data(mesh, seed)
        t0 = time.monotonic()
        f = job.site(mesh)
        r = _call(f, x, host.astype(np.float64).sum(0), job.setup_s + t_budget, "new site")
        report["faulty call"] = r
        err = r.get("error")
        report.update(_judge_error(err, r["seconds"] if err else None, job.setup_s, rank=job.victim,
                                   process=job.victim))
        if r["state"] == "blocked":
            report["what"] = "HANG: the set-up still blocked at the deadline"
            return report
        job.barrier("survivors-done", everyone)
        return _recover(job, report, everyone, seed)

    size_here = 2 * SIZE if (case == "shape" and me_victim) else SIZE
    host, x = job.data(mesh, seed, size_here)
    f = job.site(mesh)
    want = host.astype(np.float64).sum(0)
    if case == "shape":
        report["fault"] = f"process {job.victim}'s operand has {2 * SIZE} elements, the others' {SIZE}"
        r = _call(f, x, want if not me_victim else want, t_budget, "call 1")
        report["faulty call"] = r
        if r["state"] == "blocked":
            report["what"] = "HANG: the call with mismatched shapes still blocked at the deadline"
            return report
        t0 = time.monotonic() - r["seconds"]
        err = r.get("error")
        while err is None and time.monotonic() - t0 < t_budget:
            err = _check_error()
            if err is None:
                time.sleep(0.05)
        report.update(_judge_error(err, round(time.monotonic() - t0, 3) if err else None, job.timeout_s,
                                   rank=job.victim, process=job.victim))
        if me_victim:
            report["error_names_faulty_rank"] = err is not None  # its own error names itself or a peer
        job.barrier("survivors-done", everyone, wait_s=t_budget + 120)
        return _recover(job, report, everyone, seed)

    # never, unmapped, kill: two good calls on one site first
    for k in (1, 2):
        host, x = job.data(mesh, seed + k)
        r = _call(f, x, host.astype(np.float64).sum(0), t_budget, f"call {k}")
        report[f"call {k}"] = r
        if r["state"] != "ok":
            report["what"] = f"call {k}, before the fault, did not work"
            return report
    job.barrier("two-calls", everyone)
    host3, x3 = job.data(mesh, seed + 3)
    host4, x4 = job.data(mesh, seed + 4)
    if me_victim:
        if case == "never":
            report["fault"] = "never makes call 3 (alive)"
        elif case == "unmapped":
            report["fault"] = job.release_my_memory() + "; then tries call 3"
            report["faulty call"] = _call(f, x3, host3.astype(np.float64).sum(0), t_budget, "call 3")
        elif case == "kill":
            report["fault"] = "SIGKILL 0.3 s into its call 3"
            print("PHASE " + json.dumps(report), flush=True)
            threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
            f(x3).block_until_ready()
            time.sleep(60)  # not reached: the timer kills this process
        job.barrier("survivors-done", everyone, wait_s=3 * t_budget + 120)
        return _recover(job, report, everyone, seed)

    report["fault"] = {"never": f"process {job.victim} never makes call 3 (alive)",
                       "unmapped": f"process {job.victim} frees its collective memory after call 2",
                       "kill": f"process {job.victim} SIGKILLed 0.3 s into its call 3"}[case]
    if case == "kill":
        time.sleep(1.0)  # the victim's call 3 is running (waiting for ours) when it dies
    t0 = time.monotonic()
    r3 = _call(f, x3, host3.astype(np.float64).sum(0), t_budget, "call 3")
    report["call 3"] = r3
    if r3["state"] == "blocked":
        report["what"] = "HANG: call 3 still blocked at the deadline"
        return report
    err = r3.get("error")
    # A failed call 3 (wrong or an error) reports through the call or check(); a right one means
    # the faulty process had posted its part before the fault, and call 4 is the one that fails.
    while err is None and r3["state"] != "ok" and time.monotonic() - t0 < t_budget:
        err = _check_error()
        if err is None:
            time.sleep(0.05)
    t_err = round(time.monotonic() - t0, 3) if err else None
    failing_call = 3
    if err is None and r3["state"] == "ok":
        t0, failing_call = time.monotonic(), 4  # the time to error counts from the call that fails
    r4 = _call(f, x4, host4.astype(np.float64).sum(0), t_budget, "call 4")
    report["call 4"] = r4
    if err is None and r4.get("error"):
        err, t_err = r4["error"], round(time.monotonic() - t0, 3)
    # A victim that had already posted its part of call 3 before it died lets call 3 finish (seen
    # on 4 x H200): the failure is call 4's, which returns when its wait gives up and reports
    # through check(), as any failure of an asynchronous call does.
    while err is None and r4["state"] != "blocked" and time.monotonic() - t0 < 2 * t_budget:
        err = _check_error()
        if err is None:
            time.sleep(0.05)
        else:
            t_err = round(time.monotonic() - t0, 3)
    report["failing call"] = failing_call
    report.update(_judge_error(err, t_err, job.timeout_s, rank=job.victim, process=job.victim))
    if case == "kill":
        report["says_process_exited"] = bool(err and "exited" in err)
    if r4["state"] == "blocked":
        report["what"] = "HANG: call 4 still blocked at the deadline"
        return report
    alive = survivors if case == "kill" else everyone
    if case != "kill":
        job.barrier("survivors-done", everyone)
    return _recover(job, report, alive, seed, failed_site=(f, x4, host4))


def _recover(job: Job, report: dict, alive: list[int], seed: int, failed_site=None) -> dict:
    """reset(), then (survivors) the failed site again, then a new site over the processes alive."""
    import numpy as np

    import jax_blink
    from jax_blink.lowering import custom_call

    t_budget = job.timeout_s + MARGIN_S
    reset = _outcome(jax_blink.reset, 60)
    report["reset"] = reset["state"] if reset["state"] != "error" else reset["error"]
    if failed_site is not None and job.pid != job.victim:
        f, x4, host4 = failed_site
        # The survivors alone: where reset() cleared the failure, this waits for the faulty rank
        # again and must fail the same way; where the failure is sticky, it fails at once.
        same = _call(f, x4, host4.astype(np.float64).sum(0), t_budget, "failed site after reset")
        report["failed site after reset"] = {k: v for k, v in same.items() if k != "value"}
    # The next call site's comm id in this process: the processes' sites match only while every
    # process has lowered as many (a difference here explains a set-up that waits for a peer).
    report["next_comm_id"] = custom_call.upcoming_comm_id()
    if job.pid in alive:
        job.barrier("recover", alive, wait_s=3 * t_budget + 120)
        report["t_after_recover_barrier"] = time.time()  # against ipc_setups' "started": who came late
        mesh = job.mesh(alive)
        host, x = job.data(mesh, seed + 100)
        rec = _call(job.site(mesh), x, host.astype(np.float64).sum(0), t_budget, "new site after reset")
        report["recovery"] = rec
        report["recovered"] = rec["state"] == "ok"
    if job.platform == "gpu":  # which call sites this process set up, and how each ended
        from jax_blink.lowering import processes

        report["ipc_setups"] = processes.ipc_setup_log()[-6:]
    if job.pid != job.victim:
        report["ok"] = bool(report.get("error_in_budget") and report.get("recovered"))
    else:
        report["ok"] = bool(report.get("recovered", True))
    return report


def child_job(pid: int, nproc: int, port: int, platform: str, layout: str, cases: list[str],
              timeout_s: float, setup_s: float) -> None:
    os.environ["JAX_BLINK_FALLBACK"] = "raise"
    os.environ["JAX_BLINK_DISPATCH"] = "blink"
    os.environ["JAX_BLINK_TIMEOUT_S"] = str(timeout_s)
    os.environ["JAX_BLINK_SETUP_TIMEOUT_S"] = str(setup_s)
    if platform == "cpu":
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ.setdefault("PJRT_NPROC", "16")
    else:
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    import jax

    if platform == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:  # a dead process must not make jax's coordination service end the survivors
        jax.config.update("jax_enable_recoverability", True)
    except (AttributeError, KeyError, ValueError):
        pass
    kw = {} if platform == "cpu" else {"local_device_ids": [pid if layout == "distinct" else 0]}
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
                               initialization_timeout=120, **kw)
    import jax_blink  # noqa: F401  (the options read the environment above)

    job = Job(pid, nproc, timeout_s, setup_s)
    for i, case in enumerate(cases):
        report = run_case(job, case, seed=1000 * (i + 1))
        print("PHASE " + json.dumps(report), flush=True)
        if "HANG" in report.get("what", ""):
            break
    if platform == "cpu":
        from jax_blink.lowering import processes

        processes.cleanup()
    elif "kill" not in cases:
        from jax_blink.lowering import backends

        backends.module("gpu").ipc_release()
    sys.stdout.flush()
    # A job with a dead or faulty process cannot shut down in order (jax's shutdown barrier
    # would wait for it): what jax_blink owns is freed above; leave.
    os._exit(0)


# ---------------------------------------------------------------------------------------------
# The parent: children bounded in time, killed and reaped; the table.

def _run_children(argvs: list[list[str]], timeout_s: float, env: dict | None = None) -> list[dict]:
    out = []
    for r in children.run_bounded(argvs, timeout_s, env):
        phases = [json.loads(ln[6:]) for ln in r["output"].splitlines() if ln.startswith("PHASE ")]
        out.append({"rc": r["rc"], "killed_at_deadline": r["killed"], "phases": phases, "tail": r["output"][-2500:]})
    return out


def _summarise(case: str, reports: list[dict], job: dict | None) -> dict:
    """One row per case: the survivors' views merged (slowest error, every flag must hold)."""
    mine = [r for r in reports if r.get("case") == case]
    surv = [r for r in mine if r.get("role") != "faulty"]
    victim = next((r for r in mine if r.get("role") == "faulty"), None)
    row = {"case": case, "fault": (surv or mine or [{}])[0].get("fault", ""), "reports": mine}
    if not surv:
        row.update(ok=False, what="no report from a surviving process" +
                   (f" (job killed at its deadline: {job['killed']})" if job and job.get("killed") else ""))
        return row
    times = [r.get("time_to_error_s") for r in surv]
    row["time_to_error_s"] = max(times) if None not in times else None
    row["error_every_survivor"] = all(r.get("error") for r in surv)
    row["error_names_faulty_rank"] = all(r.get("error_names_faulty_rank") for r in surv)
    row["recovered"] = all(r.get("recovered") for r in surv) and (victim is None or victim.get("recovered", True))
    hang = [r["what"] for r in mine if "HANG" in r.get("what", "")]
    states = sorted({r.get("call 3", r.get("faulty call", {})).get("state", "?") for r in surv})
    failing = sorted({r.get("failing call") for r in surv if r.get("failing call")})
    at = f" of call {'/'.join(map(str, failing))}" if failing else ""
    row["what"] = "; ".join(hang) if hang else (
        f"faulty call: {'/'.join(states)}; first error after {row['time_to_error_s']} s{at}"
        if row["error_every_survivor"] else f"faulty call: {'/'.join(states)}; NO ERROR on some survivor")
    row["error_example"] = (surv[0].get("error") or "")[:300]
    if victim is not None and victim.get("faulty call"):
        row["faulty_process"] = {k: v for k, v in victim["faulty call"].items() if k != "value"}
    if case == "kill":
        row["says_process_exited"] = all(r.get("says_process_exited") for r in surv)
    ids = {r["process"]: r["next_comm_id"] for r in mine if r.get("next_comm_id") is not None}
    if len(set(ids.values())) > 1:  # the recovery's new site then pairs different comm ids
        row["what"] += f"; next comm ids differ between processes: {ids}"
    old = [r.get("failed site after reset", {}).get("state") for r in surv if "failed site after reset" in r]
    if old:
        row["failed_site_after_reset"] = "/".join(sorted(set(old)))
    row["ok"] = bool(row["error_every_survivor"] and row["time_to_error_s"] is not None
                     and row["recovered"] and all(r.get("ok") for r in surv))
    return row


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] in ("--child-one", "--child-job"):
        if sys.argv[1] == "--child-one":
            platform, timeout_s, case = sys.argv[2], float(sys.argv[3]), sys.argv[4]
            if platform == "cpu":
                os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
                os.environ["JAX_PLATFORMS"] = "cpu"
                os.environ.setdefault("PJRT_NPROC", "16")
            print("PHASE " + json.dumps(child_one_process(timeout_s, case)), flush=True)
            os._exit(0)  # a GPU kernel may still spin after a hang: do not wait for it at exit
        pid, nproc, port = map(int, sys.argv[2:5])
        child_job(pid, nproc, port, sys.argv[5], sys.argv[6], sys.argv[7].split(","), float(sys.argv[8]),
                  float(sys.argv[9]))
        return 0
    ap = argparse.ArgumentParser(prog="python benchmarks/gpu_faults.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--platform", choices=("gpu", "cpu"), default="gpu",
                    help="gpu (CUDA executor, CUDA IPC) or cpu (CPU executor, shared memory); default gpu")
    ap.add_argument("--cases", default=None,
                    help=f"some of {','.join(CASES)} (default all; with --platform cpu all but skip-ce)")
    ap.add_argument("--processes", type=int, default=4, help="processes of the multi-process cases (default 4)")
    ap.add_argument("--timeout-s", type=float, default=2.0, help="jax_blink's time budget per wait (default 2)")
    ap.add_argument("--setup-timeout-s", type=float, default=4.0,
                    help="JAX_BLINK_SETUP_TIMEOUT_S: a call site's set-up across processes (default 4)")
    ap.add_argument("--job-timeout-s", type=float, default=150.0,
                    help="each child job is killed (and reaped) after this many seconds (default 150)")
    ap.add_argument("--total-timeout-s", type=float, default=None,
                    help="all jobs together end by then: each gets at most what is left (default: no total)")
    ap.add_argument("--separate", action="store_true", help="every multi-process case in a job of its own")
    ap.add_argument("--out", metavar="JSON")
    args = ap.parse_args(argv)
    if args.cases is None:
        args.cases = ",".join(c for c in CASES if args.platform == "gpu" or c != "skip-ce")
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; cases: {', '.join(CASES)}")
    if args.processes < 2:
        ap.error("--processes must be 2 or more")
    if "skip-ce" in cases and args.platform != "gpu":
        ap.error("case skip-ce needs GPUs (copy engines); leave it out with --platform cpu")
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        ap.error(f"no folder to write {args.out!r} in")
    gpus = children.gpu_count() if args.platform == "gpu" else 0
    if args.platform == "gpu" and gpus == 0:
        ap.error("--platform gpu needs a CUDA GPU (nvidia-smi lists none); --platform cpu runs the CPU executor")
    layout = "distinct" if gpus >= args.processes else "shared"
    me = os.path.abspath(__file__)
    t_start = time.time()
    t_end = time.monotonic() + (args.total_timeout_s or float("inf"))

    def job_budget() -> float:  # what a job may take: its own limit, within the total
        return max(1.0, min(args.job_timeout_s, t_end - time.monotonic()))
    rows, jobs = [], []
    for case in [c for c in ONE_PROCESS_CASES if c in cases]:
        runs = _run_children([[sys.executable, me, "--child-one", args.platform, str(args.timeout_s), case]],
                             job_budget())
        rep = runs[0]["phases"]
        jobs.append({"cases": [case], "killed": runs[0]["killed_at_deadline"], "rc": [runs[0]["rc"]]})
        row = _summarise(case, rep, jobs[-1])
        if not rep:
            row["tail"] = runs[0]["tail"]
        rows.append(row)
    multi = [c for c in cases if c in IPC_CASES]
    groups = ([[c] for c in multi] if args.separate else
              [[c for c in SHARED_JOB if c in multi]] + [[c] for c in multi if c not in SHARED_JOB])
    for group in [g for g in groups if g]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        argvs = [[sys.executable, me, "--child-job", str(i), str(args.processes), str(port), args.platform, layout,
                  ",".join(group), str(args.timeout_s), str(args.setup_timeout_s)] for i in range(args.processes)]
        if time.monotonic() >= t_end:
            for c in group:
                rows.append({"case": c, "ok": False, "what": "not run: --total-timeout-s spent", "reports": []})
            continue
        runs = _run_children(argvs, job_budget())
        jobs.append({"cases": group, "killed": [i for i, r in enumerate(runs) if r["killed_at_deadline"]],
                     "rc": [r["rc"] for r in runs]})
        reports = [p for r in runs for p in r["phases"]]
        for c in group:
            row = _summarise(c, reports, jobs[-1])
            if not row["reports"]:
                row["tails"] = [r["tail"] for r in runs]
            rows.append(row)
    import platform as _pf

    summary = {"ok": all(r["ok"] for r in rows), "platform": args.platform, "processes": args.processes,
               "layout": {"distinct": "one GPU per process", "shared": "processes share GPU 0"}[layout]
               if args.platform == "gpu" else "one host device per process",
               "timeout_s": args.timeout_s, "setup_timeout_s": args.setup_timeout_s, "margin_s": MARGIN_S,
               "host": _pf.node(), "date": time.strftime("%Y-%m-%d"), "seconds": round(time.time() - t_start, 1),
               "jobs": jobs, "cases": rows}
    print(f"# faults on {args.platform} (budget {args.timeout_s:g} s per wait, set-up {args.setup_timeout_s:g} s, "
          f"ok = an error on every survivor within budget + {MARGIN_S:g} s and a new call after reset() right)")
    print(f"{'case':9} {'ok':3} {'error after (s)':>15} {'names rank':>10} {'recovered':>9}  what happened")
    for r in rows:
        t = r.get("time_to_error_s")
        print(f"{r['case']:9} {'yes' if r['ok'] else 'NO':3} {t if t is not None else '-':>15} "
              f"{str(r.get('error_names_faulty_rank', '-')):>10} {str(r.get('recovered', '-')):>9}  {r.get('what', '')}")
        if r.get("failed_site_after_reset"):
            print(f"{'':9} the failed call site after reset(): {r['failed_site_after_reset']}")
        if r.get("error_example"):
            print(f"{'':9} error: {r['error_example'][:220]}")
    print(f"faults: {sum(r['ok'] for r in rows)} of {len(rows)} cases ok, {summary['seconds']} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
