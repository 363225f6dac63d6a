"""benchmarks/twoshot_sweep.py without a GPU: its settings parse (and bad ones are refused with
what to write), each setting's variables hold only inside its block, its table names every
number, and on CPU host devices it stops with what it needs instead of a traceback."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import twoshot_sweep as sweep  # noqa: E402
from collective_checks import environment  # noqa: E402
from sweep_cli import parse_config  # noqa: E402


def test_settings_parse():
    assert parse_config("default:") == ("default", {})
    assert parse_config("p:JAX_BLINK_TWOSHOT_MODE=pull,JAX_BLINK_TWOSHOT_PIECE_BYTES=64K") == (
        "p", {"JAX_BLINK_TWOSHOT_MODE": "pull", "JAX_BLINK_TWOSHOT_PIECE_BYTES": "64K"})
    for bad in ("nocolon", ":JAX_BLINK_X=1", "n:NOT_OURS=1", "n:JAX_BLINK_X"):
        with pytest.raises(ValueError, match="JAX_BLINK|NAME:VAR=VALUE"):
            parse_config(bad)
    for text in sweep.DEFAULT_CONFIGS:  # the shipped settings parse, under distinct names
        parse_config(text)
    assert len({parse_config(t)[0] for t in sweep.DEFAULT_CONFIGS}) == len(sweep.DEFAULT_CONFIGS)


def test_variables_hold_only_inside_the_block(monkeypatch):
    monkeypatch.setenv("JAX_BLINK_TWOSHOT_MODE", "auto")
    monkeypatch.delenv("JAX_BLINK_TWOSHOT_PIECE_BYTES", raising=False)
    with environment({"JAX_BLINK_TWOSHOT_MODE": "pull", "JAX_BLINK_TWOSHOT_PIECE_BYTES": "1M"}):
        assert os.environ["JAX_BLINK_TWOSHOT_MODE"] == "pull"
        assert os.environ["JAX_BLINK_TWOSHOT_PIECE_BYTES"] == "1M"
    assert os.environ["JAX_BLINK_TWOSHOT_MODE"] == "auto"
    assert "JAX_BLINK_TWOSHOT_PIECE_BYTES" not in os.environ


def test_table_says_what_each_number_is():
    row = dict(bytes_per_rank=1 << 30, n=4, config="pieces1M", kernels="twoshot 4", time_us=4875.1,
               psum_time_us=4627.7, speedup=0.949, busbw=330.4, spread=0.004, psum_spread=0.01, rel_diff=1.6e-7)
    text = sweep.table([row, {**row, "bytes_per_rank": 64 << 10}])
    assert "ours (us, measured)" in text and "psum (us, measured)" in text and "busbw (GB/s)" in text
    assert "| 1024 MiB x 4 | pieces1M | twoshot 4 | 4875.1 | 4627.7 | 0.949 | 330.4 | 0% / 1% | 1.6e-07 |" in text
    assert "| 64 KiB x 4 |" in text


def test_refuses_cpu_devices_with_what_it_needs():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    r = subprocess.run([sys.executable, str(BENCHMARKS / "twoshot_sweep.py"), "--sizes", "1M"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0
    assert "needs 3 or more GPUs" in r.stderr + r.stdout and "Traceback" not in r.stderr


@pytest.mark.parametrize("args,named", [(["--sizes", "64K"], "--sizes"), (["--sizes", "1.5M"], "--sizes"),
                                        (["--chain", "0"], "--chain"), (["--runs", "x"], "--runs"),
                                        (["--config", "bad"], "--config")])
def test_bad_values_are_usage_errors_naming_the_option(args, named, capsys):
    with pytest.raises(SystemExit) as e:
        sweep.main(args)
    assert e.value.code == 2 and named in capsys.readouterr().err
