"""``python -m jax_blink env``: the report works on this machine (CPU host devices here, GPUs
where there are some) and says what each section is."""
import jax

from jax_blink.tools import env_report


def test_the_report_names_versions_executors_devices_and_decisions():
    text = env_report.report()
    for title in ("== Versions", "== Executors in this build", "== GPUs", "== Links between",
                  "== Peer access", "== What jax_blink would run here", "== Environment"):
        assert title in text, title
    assert f"jax            {jax.__version__}" in text
    assert "CPU executor   built" in text
    n = len(jax.devices())
    if jax.devices()[0].platform == "cpu" and n > 1:
        assert f"{n} x cpu, float32" in text
        # every decision names where the call runs and why
        rows = [line for line in text.splitlines() if "bytes per rank:" in line]
        assert len(rows) == 9 and all("(dispatch=" in r for r in rows)


def test_a_failing_probe_is_reported_not_raised(monkeypatch):
    def broken(devices):
        raise RuntimeError("NVML exploded")

    monkeypatch.setattr(env_report, "_links", broken)
    assert "unknown (RuntimeError: NVML exploded)" in env_report.report()


def test_the_command_line_prints_it():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-m", "jax_blink", "env"], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert "== What jax_blink would run here" in out.stdout
    if "== GPUs\n  none visible" in out.stdout:  # no GPU: the tool asked for 8 CPU host devices
        assert "8 x cpu, float32" in out.stdout


def test_a_machine_without_an_entry_is_told_what_runs_meanwhile(monkeypatch, tmp_path):
    """No entry for this machine: the report says so, what auto runs meanwhile, and the command
    that measures one; with an entry, which one auto follows."""
    from jax_blink.lowering import dispatch_cache, dispatch_table

    monkeypatch.setenv(dispatch_cache.CACHE_ENV, str(tmp_path))
    n = len(jax.devices())
    if n < 2:
        return
    text = env_report.report()
    assert "this machine's dispatch key:" in text
    monkeypatch.setattr(dispatch_table, "CROSSOVERS", ())
    text = env_report.report()
    assert "NO entry for this machine: the meanwhile rule" in text
    assert "has no measured entry for this machine" in text and "jax-blink tune" in text
    assert "Meanwhile it runs jax_blink's executor only at sizes" in text


def test_relevant_environment_keeps_what_changes_a_run():
    env = {"JAX_BLINK_ASYNC_ENGINE": "ce", "CUDA_VISIBLE_DEVICES": "0,1", "NCCL_NVLS_ENABLE": "0", "HOME": "/root",
           "XLA_FLAGS": "--xla_dump_to=/tmp", "PATH": "/bin"}
    assert env_report.relevant_environment(env) == {"CUDA_VISIBLE_DEVICES": "0,1", "JAX_BLINK_ASYNC_ENGINE": "ce",
                                         "NCCL_NVLS_ENABLE": "0", "XLA_FLAGS": "--xla_dump_to=/tmp"}


def test_a_value_the_executor_would_refuse_is_said_in_the_report(monkeypatch):
    import pytest

    from jax_blink.lowering import backends

    mod = backends.module("gpu")
    if mod is None or not hasattr(mod, "check_environment"):
        pytest.skip("no CUDA executor in this build: nothing checks its variables")
    monkeypatch.setenv("JAX_BLINK_CE_GATHER", "scatter")
    text = env_report.report()
    assert "NOT UNDERSTOOD: JAX_BLINK_CE_GATHER='scatter' is not understood" in text
    monkeypatch.setenv("JAX_BLINK_CE_GATHER", "push")
    assert "NOT UNDERSTOOD" not in env_report.report()
