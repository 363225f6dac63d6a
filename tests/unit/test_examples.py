"""Every example runs jax_blink as written, in a fresh process with no flag preset (a new user's
shell): on a machine without GPUs it asks XLA for 8 CPU host devices itself and its collectives run
on jax_blink's executor (its compiled step holds jax_blink's custom call). Also `python -m jax_blink
run SCRIPT.py`, whose tool asks for the devices and says so."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from repository import repository_files  # noqa: E402  (tests/helpers: not a package)

ROOT = Path(__file__).resolve().parents[2]


# What git tracks there, not whatever else lies in the folder.
EXAMPLES = repository_files(ROOT, "examples/*.py")
TIMEOUT_S = 600  # two training steps of a tiny model, compiles included, on a 2-core machine: ~30 s


def _fresh_env() -> dict[str, str]:
    """A user's environment: this checkout importable, and none of the test process's flags."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "PJRT_NPROC") and not k.startswith("JAX_BLINK_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(argv, tmp_path, timeout=TIMEOUT_S):
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=tmp_path,
                          env=_fresh_env(), timeout=timeout)


def test_examples_are_tracked():
    assert {p.name for p in EXAMPLES} >= {"train_gpt2.py", "train_resnet.py"}


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs_jax_blink_as_written(path, tmp_path):
    pytest.importorskip("flax")
    r = _run([str(path), "--size", "tiny", "--steps", "2", "--collective", "blink"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"step 1 loss \d", r.stdout), r.stdout
    held = re.search(r"(\d+) x (\S+): the step holds (\d+) jax_blink collective call\(s\)", r.stdout)
    assert held, r.stdout
    if jax.default_backend() == "cpu":
        assert "asked XLA for 8 CPU host devices" in r.stdout
        assert held.group(1) == "8" and held.group(2) == "cpu"
    assert int(held.group(3)) >= 1, "the step holds no jax_blink collective: lax ran the sums"


_SCRIPT = """
    import jax, jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding, PartitionSpec as P

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",))
    f = jax.jit(jax.shard_map(lambda v: lax.psum(v, "data"), mesh=mesh, in_specs=P("data"), out_specs=P()))
    x = jax.device_put(jnp.arange(4.0 * n), NamedSharding(mesh, P("data")))
    print("sum", float(f(x)[0]), "on", n, "devices")
"""


def test_run_puts_an_unedited_script_on_jax_blink(tmp_path):
    """`run --report -- SCRIPT.py`: the tool asks for host devices (and says so), the script's psum
    is lowered by the switch onto jax_blink, and --report says so when the script ends."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    r = _run(["-m", "jax_blink", "run", "--report", "--", str(script)], tmp_path)
    assert r.returncode == 0, r.stderr
    report = re.search(r"jax_blink switch: (\d+) collective\(s\) lowered, (\d+) on jax_blink", r.stderr)
    assert report, r.stderr
    if jax.default_backend() == "cpu":
        assert "on 8 devices" in r.stdout and "set XLA_FLAGS" in r.stderr
        assert int(report.group(2)) >= 1, r.stderr  # JAX_BLINK_DISPATCH unset: the table decides
    # the sum over 8 ranks of [4k, 4k+1, 4k+2, 4k+3]'s first element: 0 + 4 + ... + 28
    n = 8 if jax.default_backend() == "cpu" else jax.device_count()
    assert f"sum {float(sum(4 * k for k in range(n)))} on {n} devices" in r.stdout


def test_run_shows_the_scripts_frames_only(tmp_path):
    """An exception in the script shows the script's frames, as `python SCRIPT.py` does."""
    script = tmp_path / "broken.py"
    script.write_text("def f():\n    raise ValueError('bad value in the script')\n\nf()\n")
    plain = _run([str(script)], tmp_path, timeout=120)
    ours = _run(["-m", "jax_blink", "run", str(script)], tmp_path, timeout=120)
    assert ours.returncode == plain.returncode == 1
    frames = [line for line in ours.stderr.splitlines() if line.startswith("  File ")]
    assert frames == [line for line in plain.stderr.splitlines() if line.startswith("  File ")], ours.stderr
    assert ours.stderr.rstrip().endswith("ValueError: bad value in the script")
