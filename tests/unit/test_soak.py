"""benchmarks/gpu_soak.py on 4 CPU host devices: a run of a few seconds, its JSON, and that a wrong
result counts as an error (the soak's check can fail)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import collective_checks  # noqa: E402
import gpu_soak  # noqa: E402

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu" or len(jax.devices()) < 4,
                                reason="runs on 4 CPU host devices")


def test_a_short_soak_on_four_host_devices_writes_its_report(tmp_path):
    out = tmp_path / "soak.json"
    rc = gpu_soak.main(["--duration", "2.5", "--devices", "4", "--max-bytes", "64K", "--orders", "3",
                        "--seed", "5", "--out", str(out)])
    r = json.loads(out.read_text())
    assert rc == 0 and r["ok"] and r["errors"] == 0, r["error_details"]
    assert r["platform"] == "cpu" and r["devices"] == 4
    assert r["iterations"] >= 1 and r["calls"] >= r["iterations"]
    assert sum(r["calls_by_collective"].values()) == r["calls"]
    assert set(r["calls_by_collective"]) <= set(collective_checks.COLLECTIVES)
    assert r["largest_bytes"] == 64 << 10  # the first program runs the largest size
    assert len(r["orders"]) == 3 and all(1 <= len(o) <= 4 for o in r["orders"])
    mem = r["memory"]
    for name in ("start", "before", "after"):
        assert len(mem[name]["devices"]) == 4
        assert "communicators" in mem[name]["executor"]
        assert mem[name]["process"].get("VmRSS_kib", 1) > 0
    assert "process_VmRSS_kib" in mem["growth_steady"] or not mem["after"]["process"]
    assert r["seconds"] < 60  # the duration bounds new iterations; one compile may overrun it


def test_a_wrong_result_is_counted_as_an_error(monkeypatch):
    real = collective_checks.Case.ours

    def off_by_one(self, v):  # every collective's result shifted: the check against lax must see it
        return real(self, v) + jnp.ones((), v.dtype)

    monkeypatch.setattr(collective_checks.Case, "ours", off_by_one)
    r = gpu_soak.run(0.5, jax.devices()[:4], max_bytes=4 << 10, orders=1, seed=2)
    assert not r["ok"] and r["errors"] == r["iterations"] >= 1
    assert r["error_details"][0]["wrong"], r["error_details"][0]


def test_bad_arguments_are_refused(capsys):
    for argv, words in ((["--duration", "0"], "--duration must be > 0"),
                        (["--duration", "1", "--devices", "1"], "--devices must lie in 2.."),
                        (["--duration", "1", "--min-bytes", "1Q"], "not a byte count")):
        with pytest.raises(SystemExit) as e:
            gpu_soak.main(argv)
        assert e.value.code == 2
        assert words in capsys.readouterr().err


def test_gpu_samples_carry_nvml_memory_per_device(monkeypatch):
    """On GPUs each device's sample adds NVML's bytes used on the GPU and by this process (found by
    PCI bus id), which see allocations outside XLA's pool; without NVML the sample is XLA's alone."""
    import os
    import types

    class NVMLError(Exception):
        pass

    used = {0: 1 << 30, 1: 3 << 30}
    fake = types.SimpleNamespace(
        NVMLError=NVMLError, nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 2, nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetPciInfo=lambda h: types.SimpleNamespace(busId=f"00000000:0{h + 1}:00.0".encode()),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=used[h]),
        nvmlDeviceGetComputeRunningProcesses=lambda h: [
            types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=(h + 1) << 20),
            types.SimpleNamespace(pid=os.getpid() + 1, usedGpuMemory=7 << 20)])
    devices = [types.SimpleNamespace(id=i, platform="gpu", pci_bus_id=f"0000:0{2 - i}:00.0", local_hardware_id=i,
                                     memory_stats=lambda: {"bytes_in_use": 5}) for i in range(2)]
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    s = gpu_soak.sample(devices)
    # device 0 sits at bus 02 (NVML index 1), device 1 at bus 01 (index 0)
    assert s["devices"] == [{"bytes_in_use": 5, "nvml_used_bytes": 3 << 30, "nvml_process_bytes": 2 << 20},
                            {"bytes_in_use": 5, "nvml_used_bytes": 1 << 30, "nvml_process_bytes": 1 << 20}]
    later = gpu_soak.sample(devices)
    later["devices"][0]["nvml_used_bytes"] += 4096
    assert gpu_soak.growth(s, later)["device_nvml_used_bytes"] == 4096
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no NVML: XLA's numbers only
    assert gpu_soak.sample(devices)["devices"] == [{"bytes_in_use": 5}, {"bytes_in_use": 5}]


def test_the_steady_phase_is_traced_through_nvml(monkeypatch, capsys):
    """On GPUs NVML is read at even times through the steady phase, so that a one-time step and a
    climb can be told apart; the report prints each sample against the first."""
    grown = iter(range(0, 1 << 40, 2 << 20))
    monkeypatch.setattr(gpu_soak, "_nvml_memory",
                        lambda devices: (lambda g: [{"nvml_used_bytes": (1 << 30) + g} for _ in devices])(next(grown)))
    r = gpu_soak._soak(5.0, jax.devices()[:4], "gpu", 1 << 10, 4 << 10, 1, 3)  # 3 s steady after a compile
    t = r["memory"]["steady_trace"]
    assert 2 <= len(t) <= gpu_soak.STEADY_SAMPLES + 1, t
    assert all(len(x["nvml_used_bytes"]) == 4 for x in t)
    assert [x["s"] for x in t] == sorted(x["s"] for x in t) and t[0]["steady_calls"] == 0
    assert t[-1]["nvml_used_bytes"][0] > t[0]["nvml_used_bytes"][0]
    monkeypatch.setattr(gpu_soak, "run", lambda *a, **k: r)
    assert gpu_soak.main(["--duration", "1"]) == 0
    out = capsys.readouterr().out
    assert "through the steady phase, MiB above its first sample" in out and "+0/+0/+0/+0" in out, out
