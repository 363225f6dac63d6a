"""benchmarks/link_probe.py without a GPU: its table says what each number is, and it refuses bad
sizes and a machine without CuPy or GPUs with what it needs instead of a traceback."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import link_probe  # noqa: E402


def test_table_says_what_each_number_is():
    rows = [dict(engine="ce", direction="pull", peers=3, how="3 stream(s)", time_us=2500.0, gbps=322.1, spread=0.02),
            dict(engine="sm", direction="push", peers=1, how="serial, 132 blocks", time_us=900.0, gbps=298.3, spread=0.0)]
    text = link_probe.table(rows, 4, "NVIDIA H200", 256 << 20)
    assert "4 x NVIDIA H200, 256 MiB per peer" in text and "measured" in text
    assert "per GPU (GB/s, k x bytes / time)" in text and "median time (us)" in text
    assert "| ce | pull | 3 | 3 stream(s) | 2500.0 | 322.1 | 2% |" in text
    assert "| sm | push | 1 | serial, 132 blocks | 900.0 | 298.3 | 0% |" in text


@pytest.mark.parametrize("args,says", [(["--bytes", "100"], "at least 4K"), (["--bytes", "1x"], "--bytes"),
                                       (["--runs", "0"], "--runs"), (["--engines", "dma"], "--engines"),
                                       (["--engines", ","], "--engines")])
def test_bad_arguments_are_refused(args, says):
    r = subprocess.run([sys.executable, str(BENCHMARKS / "link_probe.py"), *args], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed here")
def test_without_cupy_it_says_what_it_needs():
    r = subprocess.run([sys.executable, str(BENCHMARKS / "link_probe.py")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "needs CuPy" in r.stderr and "Traceback" not in r.stderr
