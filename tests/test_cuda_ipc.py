"""CUDA IPC across processes: tests/gpu_ipc_selftest.py (two processes sharing GPU 0) as a test."""
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.gpu
def test_two_processes_sharing_a_gpu_all_reduce_through_cuda_ipc():
    script = Path(__file__).with_name("gpu_ipc_selftest.py")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
