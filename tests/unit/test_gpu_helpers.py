"""The GPU test files and helper scripts, checked where no GPU is: what can break them before a
GPU call finds out (an import that a refactor left behind, two files sharing comm ids)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_test_files_take_disjoint_comm_id_ranges():
    # One pytest process runs every tests/gpu file: a comm id set up by one file with its program
    # and met again by another with a different program fails ("the schedule program differs").
    starts = {}
    for path in sorted((ROOT / "tests" / "gpu").glob("test_*.py")):
        for m in re.finditer(r"itertools\.count\(([^)]*)\)", path.read_text()):
            starts[path.name] = eval(m.group(1), {})  # noqa: S307  a literal such as 2 * 10**9
    assert len(starts) >= 3, starts
    values = sorted(starts.values())
    assert all(b - a >= 10**8 for a, b in zip(values, values[1:])), f"overlapping comm id ranges: {starts}"
    assert min(values) >= 10**8, "the library's own ids count up from 1"


@pytest.mark.parametrize("script,args", [("gpu_ipc_faults.py", ["skip"]), ("gpu_ipc_selftest.py", [])])
def test_gpu_helper_scripts_import_and_refuse_without_a_gpu(tmp_path, script, args):
    # PATH without nvidia-smi: each script gets past its imports and stops with its own message.
    env = {**os.environ, "PATH": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / script), *args], env=env,
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "needs a CUDA GPU" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
