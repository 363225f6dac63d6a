"""benchmarks/trace_calls.py without a GPU: the host's busiest events are read from a real trace,
by total time, Python frames left out; bad arguments are one-line usage errors."""
from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import trace_calls  # noqa: E402


def test_host_events_read_a_trace(tmp_path):
    f = jax.jit(lambda v: (v * 3.0).sum())
    x = jnp.arange(4096, dtype=jnp.float32)
    f(x).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        f(x).block_until_ready()
    path = glob.glob(str(tmp_path / "**" / "*.xplane.pb"), recursive=True)[0]
    rows = trace_calls.host_events(path, top=50)
    assert rows, "a traced execution has host events"
    names = [r[0] for r in rows]
    assert any("Execute" in n for n in names), names  # PjRt's execution of the program
    assert not any(n.startswith("$") for n in names)  # Python frames are not XLA's runtime
    totals = [r[2] for r in rows]
    assert totals == sorted(totals, reverse=True)
    for _, count, total, longest in rows:
        assert count >= 1 and 0 <= longest <= total + 1e-9


@pytest.mark.parametrize("args", [["--bytes", "4Q"], ["--bytes", "2"], ["--k", "0"], ["--warmup", "0"]])
def test_bad_arguments_are_usage_errors(args):
    r = subprocess.run([sys.executable, str(BENCHMARKS / "trace_calls.py"), *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert args[0] in r.stderr


def test_runs_on_cpu_and_says_there_are_no_gpu_kernels():
    """On CPU host devices (no GPU kernels to trace) the tool runs its warm-ups and traced runs and
    says what it found instead of a table."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    r = subprocess.run([sys.executable, str(BENCHMARKS / "trace_calls.py"), "--bytes", "4K", "--k", "2",
                        "--warmup", "2"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert "## jax_blink.all_reduce: no device events matching" in r.stdout, r.stdout
    assert "## lax.psum: no device events matching" in r.stdout, r.stdout
