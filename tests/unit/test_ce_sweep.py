"""benchmarks/ce_sweep.py without a GPU: its shipped variants parse under distinct names and set
only jax_blink's variables, its table names every number, bad arguments are refused naming the
option, and on CPU host devices it stops with what it needs instead of a traceback."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import ce_sweep as sweep  # noqa: E402
from sweep_cli import parse_config  # noqa: E402


def test_shipped_variants_parse():
    parsed = [parse_config(t) for t in sweep.DEFAULT_CONFIGS]
    assert len({name for name, _ in parsed}) == len(parsed)
    assert all(env.get("JAX_BLINK_ASYNC_ENGINE") in ("ce", "sm") for _, env in parsed)


def test_table_says_what_each_number_is():
    row = dict(bytes_per_rank=1 << 30, n=4, variant="ce-16M", time_us=4101.5, psum_time_us=4627.7, speedup=1.128,
               busbw=392.6, spread=0.004, psum_spread=0.01, rel_diff=1.6e-7)
    text = sweep.table([row, {**row, "bytes_per_rank": 16 << 20}])
    assert "time (us, measured)" in text and "psum (us, measured)" in text and "busbw (GB/s)" in text
    assert "| 1024 MiB x 4 | ce-16M | 4101.5 | 4627.7 | 1.128 | 392.6 | 0% / 1% | 1.6e-07 |" in text
    assert "| 16 MiB x 4 |" in text


def test_refuses_cpu_devices_with_what_it_needs():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    r = subprocess.run([sys.executable, str(BENCHMARKS / "ce_sweep.py"), "--sizes", "1M"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0
    assert "needs 2 or more GPUs" in r.stderr + r.stdout and "Traceback" not in r.stderr


@pytest.mark.parametrize("args,named", [(["--sizes", "512"], "--sizes"), (["--sizes", "1.5M"], "--sizes"),
                                        (["--chain", "0"], "--chain"), (["--runs", "x"], "--runs"),
                                        (["--config", "bad"], "--config")])
def test_bad_arguments_are_refused(args, named):
    r = subprocess.run([sys.executable, str(BENCHMARKS / "ce_sweep.py"), *args], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and named in r.stderr and "Traceback" not in r.stderr


def test_the_shared_loop_times_and_checks_variants_on_cpu_devices():
    """sweep_cli.against_psum, which both sweeps run on GPUs, on CPU host devices: a variant's
    variables hold only around its set-up, its result is compared with psum's, and its row says
    what it measured and what observe() added."""
    import jax
    from jax_blink.tools.timing import COLLECTIVES, chained

    import sweep_cli

    devices = jax.devices()
    if devices[0].platform != "cpu" or len(devices) < 2:
        pytest.skip("needs 2+ CPU host devices")
    mesh = jax.make_mesh((len(devices),), ("x",), devices=devices)
    coll = COLLECTIVES["allreduce"]
    setups = []

    def variants():
        return [("ours", {"JAX_BLINK_CE_GATHER": "push"}, chained(coll.chain(coll.ours), mesh, "x", 2, dispatch="blink"))]

    def observe():  # before the set-up, then after it
        setups.append(os.environ.get("JAX_BLINK_CE_GATHER"))
        return lambda: {"kernels": "cpu"}

    rows = sweep_cli.against_psum(mesh, [4096], 2, 1, variants, name_key="variant", observe=observe)
    assert len(rows) == 1 and rows[0]["variant"] == "ours" and rows[0]["n"] == len(devices)
    assert rows[0]["rel_diff"] < 1e-5 and rows[0]["time_us"] > 0 and rows[0]["psum_time_us"] > 0
    assert rows[0]["env"] == {"JAX_BLINK_CE_GATHER": "push"} and rows[0]["kernels"] == "cpu" and setups == [None]
    assert "JAX_BLINK_CE_GATHER" not in os.environ


def test_the_shared_loop_traces_each_variant_with_profile(tmp_path):
    """--profile: after the timing, one traced run per size and variant, its trace's path and the
    peer copies' summary in the row (no GPU here: the summary says that no copy ran)."""
    import jax
    from jax_blink.tools import trace_copies
    from jax_blink.tools.timing import COLLECTIVES, chained

    import sweep_cli

    devices = jax.devices()
    if devices[0].platform != "cpu" or len(devices) < 2:
        pytest.skip("needs 2+ CPU host devices")
    mesh = jax.make_mesh((len(devices),), ("x",), devices=devices)
    coll = COLLECTIVES["allreduce"]

    def variants():
        return [("ours", {}, chained(coll.chain(coll.ours), mesh, "x", 2, dispatch="blink"))]

    rows = sweep_cli.against_psum(mesh, [4096], 2, 1, variants, profile=str(tmp_path))
    prof = rows[0]["profile"]
    if prof["trace"] is None:
        pytest.skip("this jax's profiler wrote no .trace.json.gz")
    assert str(tmp_path / "4KiB" / "ours") in prof["trace"] and prof["devices"] == {}
    assert "no peer copy" in trace_copies.describe(prof)


def test_a_profile_folder_that_cannot_be_made_is_refused_first(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    r = subprocess.run([sys.executable, str(BENCHMARKS / "ce_sweep.py"), "--profile", str(blocker / "traces")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--profile" in r.stderr and "cannot make" in r.stderr and "Traceback" not in r.stderr
