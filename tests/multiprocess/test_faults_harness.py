"""benchmarks/gpu_faults.py on CPU: the harness that injects faults into jobs of several processes
(on GPUs through CUDA IPC) judges each case as it should, where the CPU executor runs the same
cases through shared memory. A kill of one of 3 processes, whose recovery traces a mesh of the 2
survivors, a process that never reaches a new call site (alone in its job: the first collective's
host-name exchange then waits for it) and a rank with another shape are the cases its GPU runs got
wrong, or could not recover from (benchmarks/results/faults-*-nvidia-h200-x4-2026-11-27-run*.*)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")
_blink_cpu = pytest.importorskip("jax_blink._blink_cpu")
if not hasattr(_blink_cpu, "shm_set_job"):
    pytest.skip("this build of the CPU executor has no shared-memory path", allow_module_level=True)

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu_faults.py"


def test_kill_and_shape_end_in_named_errors_and_recover(tmp_path):
    out = tmp_path / "faults.json"
    pids = tmp_path / "children.pids"
    env = {**os.environ, "CHILD_PIDS_FILE": str(pids), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # the script gives each child its own device count
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--platform", "cpu", "--processes", "3",
                             "--cases", "setup,kill,shape", "--separate", "--job-timeout-s", "60",
                             "--total-timeout-s", "150", "--out", str(out)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        if pids.exists():  # the script's children, should it have left any
            for pid in pids.read_text().split():
                try:
                    os.killpg(int(pid), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
    r = json.loads(out.read_text())
    rows = {c["case"]: c for c in r["cases"]}
    assert set(rows) == {"setup", "kill", "shape"}, text[-2000:]
    for case, row in rows.items():
        assert row["error_every_survivor"] and row["time_to_error_s"] is not None, (case, text[-2000:])
        assert row["recovered"], (case, row.get("what"), text[-2000:])
        assert row["ok"], (case, row.get("what"))
    assert rows["shape"]["error_names_faulty_rank"] and rows["setup"]["error_names_faulty_rank"]
    # Every process learns of the other shape at once, from the segment's record, not by waiting
    # out the 4 s set-up budget for a rank that will never attach.
    assert rows["shape"]["time_to_error_s"] < 2.0, rows["shape"]["what"]
    assert "calls it with" in rows["shape"]["error_example"], rows["shape"]["error_example"]
    survivors = [x for x in rows["kill"]["reports"] if x.get("role") == "survivor"]
    assert len(survivors) == 2 and all(x["recovery"]["state"] == "ok" for x in survivors)
    assert proc.returncode == 0, text[-2000:]


def test_copy_engine_case_is_refused_on_cpu_with_what_to_do():
    r = subprocess.run([sys.executable, str(SCRIPT), "--platform", "cpu", "--cases", "skip-ce"],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 2 and "skip-ce needs GPUs" in r.stderr and "Traceback" not in r.stderr
