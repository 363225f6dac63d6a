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
