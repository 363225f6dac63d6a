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


def _ipc_results(dispatch: str) -> list[dict]:
    rows = [{"bytes_per_rank": b, "ours_us": 30.0, "lax_us": 40.0 if b < 1 << 20 else 20.0, "speedup": 0.0,
             "same": True, "dispatch": dispatch, "path": "executor"} for b in (1 << 10, 1 << 16, 1 << 20, 1 << 24)]
    for r in rows:
        r["speedup"] = round(r["lax_us"] / r["ours_us"], 3)
    return [{"process": p, "processes": 4, "device": "NVIDIA H200", "jax": "0.11.2", "timings": rows}
            for p in range(4)]


@pytest.mark.parametrize("dispatch", ["blink", "auto"])
def test_ipc_selftest_bench_file_records_its_dispatch_and_only_executor_runs_derive(tmp_path, dispatch):
    # A timing of what dispatch="auto" ran must never become a dispatch entry (it would judge the
    # table by itself); the executor's timing must.
    sys.path.insert(0, str(ROOT / "tests" / "helpers"))
    try:
        import gpu_ipc_selftest
    finally:
        sys.path.pop(0)
    from jax_blink.tools import derive

    path = tmp_path / "allreduce-ipc4.json"
    gpu_ipc_selftest._write_bench_json(str(path), _ipc_results(dispatch))
    import json

    doc = json.loads(path.read_text())
    assert doc["meta"]["dispatch"] == dispatch and doc["meta"]["layout"] == "several processes"
    assert len(doc["rows"]) == 16 and {r["path"] for r in doc["rows"]} == {"executor"}
    if dispatch == "auto":
        with pytest.raises(ValueError, match="dispatch='auto'"):
            derive.derive([path.name], root=str(tmp_path))
    else:
        c = derive.derive([path.name], root=str(tmp_path))
        # lax won from 1 MiB; the executor at 64 KiB: lax from the point between the two
        assert (c.ranks, c.layout, c.lax_ranges) == (4, "several processes", ((1 << 18, None),))
