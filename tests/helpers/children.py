"""What the multi-process GPU scripts (tests/helpers/gpu_ipc_selftest.py, benchmarks/gpu_faults.py)
share: how many GPUs this machine has, and bounding the child processes they start."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time


def gpu_count() -> int:
    """The GPUs ``nvidia-smi -L`` lists (0 where it is missing or does not answer in 60 s)."""
    try:
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for ln in r.stdout.splitlines() if ln.startswith("GPU "))


def note_children(procs) -> None:
    """Bound the children beyond this process: each leads a process group of its own, which
    SIGTERM to this process kills (``timeout`` around it), and CHILD_PIDS_FILE, where set, lists
    them for the calling script to kill after its own deadline (SIGKILL reaches nobody's handler)."""
    path = os.environ.get("CHILD_PIDS_FILE")
    if path:
        with open(path, "a") as f:
            f.write("".join(f"{p.pid}\n" for p in procs))

    def stop(signum, frame):
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for p in procs:
            p.wait()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def run_bounded(argvs: list[list[str]], timeout_s: float, env: dict | None = None) -> list[dict]:
    """Start one child per argv, each leading a process group of its own and writing to a file (a
    full pipe would stall it); wait until all have exited or ``timeout_s`` has passed, then kill
    the groups still running and reap every child. Per child: ``rc``, ``killed`` (at the
    deadline), ``exited`` (wall-clock time it was seen gone; None where killed) and ``output``."""
    logs = [tempfile.TemporaryFile("w+") for _ in argvs]
    procs = [subprocess.Popen(a, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                              env={**os.environ, **(env or {})}) for a, log in zip(argvs, logs)]
    note_children(procs)
    deadline = time.monotonic() + timeout_s
    exited: list[float | None] = [None] * len(procs)
    while None in exited and time.monotonic() < deadline:
        for i, p in enumerate(procs):
            if exited[i] is None and p.poll() is not None:
                exited[i] = time.time()
        time.sleep(0.05)
    out = []
    for i, (p, log) in enumerate(zip(procs, logs)):
        killed = exited[i] is None and p.poll() is None
        if killed:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()
        if exited[i] is None and not killed:  # exited between the last poll and the deadline
            exited[i] = time.time()
        log.seek(0)
        out.append({"rc": p.returncode, "killed": killed, "exited": exited[i], "output": log.read()})
        log.close()
    return out

