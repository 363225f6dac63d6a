"""What the multi-process GPU scripts (tests/helpers/gpu_ipc_selftest.py, benchmarks/gpu_faults.py)
share: how many GPUs this machine has, and bounding the child processes they start."""
from __future__ import annotations

import os
import signal
import subprocess
import sys


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
