"""benchmarks/ce_probe.py without a GPU: its table says what each number is, and it refuses bad
sizes and a machine without CuPy or GPUs with what it needs instead of a traceback."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import ce_probe  # noqa: E402


def test_table_says_what_each_number_is():
    rows = [dict(direction="pull", peers=3, streams=3, time_us=2500.0, gbps=322.1, spread=0.02),
            dict(direction="push", peers=1, streams=1, time_us=900.0, gbps=298.3, spread=0.0)]
    text = ce_probe.table(rows, 4, "NVIDIA H200", 256 << 20)
    assert "4 x NVIDIA H200, 256 MiB per copy" in text and "measured" in text
    assert "per GPU (GB/s, k x bytes / time)" in text and "median time (us)" in text
    assert "| pull | 3 | 3 | 2500.0 | 322.1 | 2% |" in text


@pytest.mark.parametrize("args,says", [(["--bytes", "100"], "at least 4K"), (["--bytes", "1x"], "--bytes"),
                                       (["--runs", "0"], "--runs")])
def test_bad_arguments_are_refused(args, says):
    r = subprocess.run([sys.executable, str(BENCHMARKS / "ce_probe.py"), *args], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed here")
def test_without_cupy_it_says_what_it_needs():
    r = subprocess.run([sys.executable, str(BENCHMARKS / "ce_probe.py")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "needs CuPy" in r.stderr and "Traceback" not in r.stderr
