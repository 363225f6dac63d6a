"""The notebooks run from top to bottom as a user runs them: a fresh kernel with no XLA_FLAGS preset
(they are executed here so that they do not rot). Those that run collectives must run them on
jax_blink's executor over 8 CPU host devices (on a machine without GPUs), asking XLA for them
themselves."""

import os
import sys
from pathlib import Path

import jax
import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from repository import repository_files  # noqa: E402  (tests/helpers: not a package)

ROOT = Path(__file__).resolve().parents[2]


# What git tracks there, not whatever else lies in the folder.
NOTEBOOKS = repository_files(ROOT, "notebooks/*.ipynb")
#: The notebooks that run collectives (01_trees plans and draws in the model only).
RUN_COLLECTIVES = {"02_collectives.ipynb", "03_training.ipynb"}
# Run after the notebook's own cells: the devices it got, and the CPU executor's communicators
# (each made by a collective that ran on the executor).
_PROBE = """import jax
from jax_blink.lowering import backends as _backends
_mod = _backends.module("cpu")
print("PROBE", jax.device_count(), jax.devices()[0].platform, _mod.num_comms() if _mod is not None else -1)"""


def _stream_text(nb) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                   if o.get("output_type") == "stream")


def test_notebooks_are_tracked():
    assert {p.name for p in NOTEBOOKS} >= RUN_COLLECTIVES | {"01_trees.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    nb = nbformat.read(path, as_version=4)
    # Committed notebooks carry no outputs (they are executed here instead).
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), f"clear the outputs of {path.name}"
    nb.cells.append(nbformat.v4.new_code_cell(_PROBE))
    # The kernel is a fresh process as a user starts it: jax_blink from this checkout, no display,
    # and none of the flags this test process runs under (tests/conftest.py sets XLA_FLAGS).
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv("PJRT_NPROC", raising=False)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    probe = [line.split() for line in _stream_text(nb).splitlines() if line.startswith("PROBE ")]
    assert len(probe) == 1, _stream_text(nb)[-2000:]
    _, count, platform, comms = probe[0]
    if path.name in RUN_COLLECTIVES and jax.default_backend() == "cpu":
        assert (int(count), platform) == (8, "cpu"), "the notebook did not ask XLA for 8 CPU host devices"
        assert int(comms) > 0, "no collective ran on jax_blink's CPU executor"
