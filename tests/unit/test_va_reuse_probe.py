"""benchmarks/va_reuse_probe.py without a GPU: bad arguments and a machine without CuPy end in a
usage error that names the problem, not a traceback."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "va_reuse_probe.py"


@pytest.mark.parametrize("args,says", [(["--reader", "1", "--owner", "1"], "must differ (both 1)"),
                                       (["--bytes", "1.5Q"], "--bytes"), (["--tries", "0"], "--tries"),
                                       ([], "needs CuPy")])
def test_refuses_with_what_it_needs(args, says):
    r = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert says in r.stderr and "Traceback" not in r.stderr, r.stderr
