"""Jobs of several processes on loopback (jax.distributed + gloo), CPU executor through shared memory.

Each test starts a job of N processes of tests/helpers/multiprocess_child.py (1 to 4 host devices each),
with JAX_BLINK_FALLBACK=raise and JAX_BLINK_DISPATCH=blink, bounds it in time (the process group
is killed on timeout) and checks what every process reports, and that /dev/shm holds no segment
of the job afterwards.
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
from pathlib import Path

import pytest

pytest.importorskip("jax")
_blink_cpu = pytest.importorskip("jax_blink._blink_cpu")
if not hasattr(_blink_cpu, "shm_set_job"):
    pytest.skip("this build of the CPU executor has no shared-memory path", allow_module_level=True)

CHILD = Path(__file__).parents[1] / "helpers" / "multiprocess_child.py"
SHM = Path("/dev/shm")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _segments() -> set[str]:
    return {p.name for p in SHM.iterdir() if p.name.startswith("jxb_")} if SHM.is_dir() else set()


def run_job(scenario: str, nproc: int, local: int, *, timeout: float = 120.0,
            env: dict | None = None) -> list[dict]:
    """Run one job; return each process's RESULT (or its exit status and output tail)."""
    port = _free_port()
    child_env = {**os.environ, "JAX_BLINK_TIMEOUT_S": "3", "JAX_BLINK_SETUP_TIMEOUT_S": "30", **(env or {})}
    child_env.pop("XLA_FLAGS", None)  # the child sets its own device count
    # Output to files, not pipes: a child blocked on a full pipe would stall its peers.
    logs = [tempfile.TemporaryFile("w+") for _ in range(nproc)]
    procs = [subprocess.Popen([sys.executable, str(CHILD), scenario, str(i), str(nproc), str(port), str(local)],
                              stdout=log, stderr=subprocess.STDOUT, text=True,
                              env=child_env, start_new_session=True)
             for i, log in enumerate(logs)]
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        tails = []
        for log in logs:
            log.seek(0)
            tails.append(log.read()[-1500:])
        pytest.fail(f"job {scenario} x{nproc} did not finish within {timeout:g} s; output tails: {tails}")
    finally:
        for q in procs:  # kill what is left of every process group of the job, then reap
            try:
                os.killpg(q.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            q.wait()
    results = []
    for i, (p, log) in enumerate(zip(procs, logs)):
        log.seek(0)
        out = log.read()
        log.close()
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        r = json.loads(lines[-1][len("RESULT "):]) if lines else {"ok": False, "process": i}
        if not lines or not r.get("ok"):
            r["output"] = out[-3000:]
        r["returncode"] = p.returncode
        results.append(r)
    return results


@pytest.fixture
def no_leftover_segments():
    before = _segments()
    yield
    left = _segments() - before
    assert not left, f"shared-memory segments left in /dev/shm: {sorted(left)}"


@pytest.mark.parametrize("nproc,local,per_host", [(2, 2, 1), (4, 1, 2)])
def test_collectives_across_processes_and_hosts(nproc, local, per_host, no_leftover_segments):
    """Flat over one axis spanning the processes (shared memory), then with every ``per_host``
    processes a "host": all_reduce, reduce_scatter and all_gather in phases over that axis, over
    ("host", "local") and over one axis whose ranks alternate between the hosts (per_host=1: the
    inside of a host is one process, the in-process executor; 2: shared memory)."""
    results = run_job("collectives", nproc, local, env={"MP_PER_HOST": str(per_host)})
    for r in results:
        assert r.get("ok"), f"process {r.get('process')}: {r}"
        assert r["returncode"] == 0, r
        assert r["checks"] >= 100, r


@pytest.mark.parametrize("scenario,nproc,local", [("skip", 2, 4), ("die", 3, 1)])
def test_a_faulty_process_is_named(scenario, nproc, local, no_leftover_segments):
    t0 = time.monotonic()
    results = run_job(scenario, nproc, local, timeout=90, env={"JAX_BLINK_SETUP_TIMEOUT_S": "4"})
    victim = nproc - 1
    for r in results[:victim]:
        assert r.get("ok"), f"process {r.get('process')} did not end with an error naming process {victim}: {r}"
        assert r["seconds"] < 4 + 5, r  # the time budget (3 s, set-up 4 s) plus slack on a loaded machine
    assert time.monotonic() - t0 < 90
