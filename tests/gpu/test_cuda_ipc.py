"""CUDA IPC across processes, as tests: tests/helpers/gpu_ipc_selftest.py (every collective, two processes
on one GPU or one GPU each) and tests/helpers/gpu_ipc_faults.py (a process that skips a call or dies)."""
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parents[1] / "helpers"


def _run(script: str, *args: str, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HERE / script), *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.gpu
def test_every_collective_across_two_processes_through_cuda_ipc():
    r = _run("gpu_ipc_selftest.py", timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.parametrize("fault, collective", [("skip", "all_reduce"), ("skip", "broadcast"),
                                               ("kill", "all_reduce")])
def test_a_process_that_skips_a_call_or_dies_is_named_within_the_budget(fault, collective):
    # The script bounds its children (300 s, killed and reaped) and checks the error, its
    # timing and the survivor's exit; this bound is the script's own, with room to start.
    r = _run("gpu_ipc_faults.py", fault, collective, timeout=420)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert '"ok": true' in r.stdout
