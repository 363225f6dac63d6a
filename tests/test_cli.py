"""The command line: ``python -m jax_blink plan ...``."""

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jax_blink.__main__ import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _needs_planner():
    import jax_blink.treegen as treegen

    if not hasattr(treegen, "plan"):
        pytest.skip("jax_blink.treegen.plan not available yet")


def test_plan_allreduce_dgx1v_subset(capsys):
    rc = main(["plan", "--topology", "dgx1v", "--devices", "0,1,4", "--collective", "allreduce"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "tree 0: root" in out
    assert "GB/s" in out and "cut bound" in out
    assert "rings" in out and "pcie" in out  # {0,1,4} has no NVLink ring
    assert re.search(r"trees [\d.]+ vs rings [\d.]+ .*: [\d.]+x", out)


def test_plan_broadcast_root_and_plot(tmp_path, capsys):
    png = tmp_path / "trees.png"
    rc = main(["plan", "--topology", "dgx1v", "--collective", "broadcast", "--root", "0",
               "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "150" in out  # all 8 GPUs from 0: 6 links x 25 GB/s
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_discover_default(capsys):
    # No --topology: the jax devices here (8 CPU host devices under tests/conftest.py; the GPUs
    # on a GPU machine, which NVML describes).
    import jax

    rc = main(["plan", "--collective", "allreduce"])
    out = capsys.readouterr().out
    assert rc == 0
    expected = "host" if jax.default_backend() == "cpu" else f"{jax.device_count()} devices"
    assert expected in out


@pytest.mark.parametrize("argv, words", [
    (["plan", "--topology", "dgx9"], "unknown preset"),
    (["plan", "--topology", "dgx1v", "--devices", "0,x"], "--devices"),
    (["plan", "--topology", "dgx1v", "--devices", "0,9"], "--devices"),
    (["plan", "--topology", "dgx1v", "--devices", "0,0,1"], "twice"),
    (["plan", "--topology", "dgx1v", "--collective", "gather"], "invalid choice"),
    (["plan", "--topology", "dgx1v", "--devices", "0,1,4", "--root", "5"], "--root"),
    (["plan", "--topology", "dgx1v", "--devices", "0,5"], ""),  # 0 and 5 share no NVLink
    ([], "required"),
])
def test_bad_input_one_line_exit_2(argv, words, capsys):
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0], err
    assert words in lines[0]
    assert "Traceback" not in err


def test_help_exits_0(capsys):
    assert main(["plan", "--help"]) == 0
    assert "--collective" in capsys.readouterr().out


def test_subprocess_module(tmp_path):
    png = tmp_path / "t.png"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               MPLBACKEND="", DISPLAY="")
    env.pop("MPLBACKEND")
    r = subprocess.run([sys.executable, "-m", "jax_blink", "plan", "--topology", "dgx1v",
                        "--devices", "0,1,2,3,4", "--collective", "allreduce", "--plot", str(png)],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "tree 0" in r.stdout and png.exists()
    r = subprocess.run([sys.executable, "-m", "jax_blink", "plan", "--topology", "nope"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_single_device_and_mwu(capsys):
    assert main(["plan", "--topology", "dgx1v", "--devices", "0"]) == 0
    assert "nothing to move" in capsys.readouterr().out
    assert main(["plan", "--topology", "dgx1v", "--devices", "0,1,4", "--collective", "reduce",
                 "--root", "4", "--method", "mwu", "--size", "64MiB"]) == 0
    out = capsys.readouterr().out
    assert "reduce plan (mwu), root 4" in out and "model at 67.1089 MB" in out


def test_demo_runs_all_reduce_against_psum(tmp_path, capsys):
    png = tmp_path / "demo.png"
    assert main(["demo", "--size", "1000", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    if len(jax.devices()) == 1:  # one GPU (CPU runs get host devices from the conftest)
        assert "one device: nothing to reduce across" in out
        return
    assert "results agree with lax.psum" in out
    assert "jax_blink executor" in out and "lax.psum" in out
    assert png.stat().st_size > 0


def test_crossover_prints_the_entry_that_tuning_holds(capsys, monkeypatch):
    """`crossover` on the runs an entry cites prints that entry, in the form tuning.py holds."""
    from jax_blink import tuning

    monkeypatch.chdir(ROOT)
    entry = tuning.CROSSOVERS[0]
    assert main(["crossover", *entry.sources]) == 0
    out = capsys.readouterr().out
    code = "\n".join(line for line in out.splitlines() if not line.startswith("#"))
    assert eval(code, {"Crossover": tuning.Crossover}) == entry  # noqa: S307 (our own output)
    assert main(["crossover", "benchmarks/results/plan_time-cpu-2026-11-22.txt"]) == 2
    assert "not a readable bench result" in capsys.readouterr().err
