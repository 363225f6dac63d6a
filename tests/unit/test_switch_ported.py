"""Programs nobody here wrote, unchanged, with and without jax_blink's switch.

1. JAX's own test cases for these collectives (tests/jax_ported/pmap_test.py and
   shard_map_test.py: jax v0.10.2's files, unchanged). tests/jax_ported/conftest.py runs each
   selected case once as jax runs it and once under ``jax_blink.installed()`` with
   ``dispatch="blink"``, and fails a case whose two runs end differently. Here: every case must
   pass both ways, and where jax_blink is meant to run, its executor must have run.
   ``JAX_BLINK_PORTED_FULL=1`` runs the wide selection (several hundred cases, many minutes)
   instead of the CI one.
2. Public examples (tests/jax_ported/*.py: jax's pmap MNIST example with synthetic data, the
   neural-network section of jax's shard_map tutorial): ``python SCRIPT`` against
   ``python -m jax_blink run --report SCRIPT``; the same printed numbers, and collectives on jax_blink.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[2]
PORTED = ROOT / "tests" / "jax_ported"

#: The jax version whose tests/pmap_test.py and tests/shard_map_test.py are in tests/jax_ported.
VENDORED_JAX = "0.10.2"
_PMAP = "tests/jax_ported/pmap_test.py::PythonPmapTest::"
_SMAP = "tests/jax_ported/shard_map_test.py::ShardMapTest::"
#: The CI selection: psum / pmean / pmax / pmin / all_gather / psum_scatter in pmap and shard_map,
#: their gradients, vmap, pytrees of dtypes, axis_index_groups, and calls that must stay XLA's.
CI_CASES = [_PMAP + t for t in (
    "testGather", "testGatherTiled", "testGatherNegativeAxis", "testReduceScatter",
    "testReduceScatterTiled", "testReduceScatterReplicaGroupsTiled",
    "testCollectivesWithTreesOfDifferentDtypes", "testComplexPsum", "testGradOfPsum",
    "testPsumReplicaGroups", "testGatherReplicaGroups", "testPsumOnBooleanDtype",
    "testPsumUnevenReplicaGroups")] + [_SMAP + t for t in (
    "test_all_gather", "test_all_gather_invariant_basic", "test_all_gather_with_axis_index_groups",
    "test_matmul_reduce_scatter", "test_reduce_scatter_with_axis_index_groups",
    "test_vmap_basic_axis_name", "test_psum_transpose_non_zero_cts",
    "test_fanin_psum_transposes_to_fanout", "test_repeated_psum_allowed", "test_pmin", "test_pmax",
    "test_check_rep_false_grads", "test_vmap_shmap_psum")]
#: Cases whose collectives all stay XLA's, and why (the switch's reason must say so).
XLA_ONLY = {"testComplexPsum": "dtype complex64",
            "testPsumUnevenReplicaGroups": "axis_index_groups of unequal sizes",
            "test_vmap_shmap_psum": "partially manual shard_map"}
_FULL_K = "gather or scatter or psum or pmean or pmax or pmin or collective or grad or vmap or Gather " \
          "or Scatter or Psum or Pmean or Pmax or Pmin or Collective or Grad or Vmap or AllReduce"


def _env(**extra):
    env = dict(os.environ)
    env.update(extra)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"  # these run on 8 CPU host devices, also on a GPU machine
    env.setdefault("PJRT_NPROC", "16")
    return env


def test_jax_own_collective_tests_pass_as_without_the_switch(tmp_path):
    report = tmp_path / "report.json"
    full = os.environ.get("JAX_BLINK_PORTED_FULL") == "1"
    selection = ["tests/jax_ported/pmap_test.py", "tests/jax_ported/shard_map_test.py", "-k", _FULL_K] \
        if full else CI_CASES
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection],
                       cwd=ROOT, capture_output=True, text=True, timeout=7200 if full else 600,
                       env=_env(JAX_BLINK_PORTED="1", JAX_BLINK_PORTED_REPORT=str(report)))
    cases = json.loads(report.read_text()) if report.exists() else {}
    if jax.__version__ == VENDORED_JAX:
        assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    else:  # jax's tests of another version may fail with and without the switch alike
        assert cases, r.stdout[-6000:] + r.stderr[-3000:]
    if not full:
        assert sorted(k.split("::")[-1] for k in cases) == sorted(c.split("::")[-1] for c in CI_CASES)
    for name, rec in cases.items():
        assert rec["plain"] == rec["switched"], (name, rec)
        short = name.split("::")[-1]
        on_blink = [d for d in rec["decisions"] if d["runs_on"] == "jax_blink"]
        if short in XLA_ONLY:
            assert not on_blink and rec["executor_comms"] == 0, (name, rec)
            assert all(XLA_ONLY[short] in d["reason"] for d in rec["decisions"]), (name, rec)
        elif rec["decisions"] and rec["plain"] == "passed":
            # jax_blink was meant to run here: its custom call was lowered and its executor ran.
            assert on_blink and rec["executor_comms"] > 0, (name, rec)


_TIMING = re.compile(r" in [0-9.]+ sec")
_NUMBER = re.compile(r"-?\d+\.\d+(?:e[-+]?\d+)?")


def _numbers_and_words(text: str):
    lines = [_TIMING.sub(" in _ sec", line) for line in text.splitlines()]
    words = [_NUMBER.sub("#", line) for line in lines]
    numbers = [float(m) for line in lines for m in _NUMBER.findall(line)]
    return words, numbers


@pytest.mark.parametrize("script", ["spmd_mnist_classifier_fromscratch.py", "shard_map_neural_networks.py"])
def test_public_example_runs_unchanged_under_the_switch(script):
    env = _env(JAX_BLINK_DISPATCH="blink")  # every collective it can run, whatever the size
    runs = [subprocess.Popen(cmd + [str(PORTED / script)], cwd=PORTED, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for cmd in ([sys.executable], [sys.executable, "-m", "jax_blink", "run", "--report"])]
    (plain_out, plain_err), (out, err) = (p.communicate(timeout=600) for p in runs)
    assert runs[0].returncode == 0, plain_err[-3000:]
    assert runs[1].returncode == 0, err[-3000:]
    plain_words, plain_numbers = _numbers_and_words(plain_out)
    words, numbers = _numbers_and_words(out)
    assert words == plain_words
    assert numbers == pytest.approx(plain_numbers, rel=1e-4, abs=1e-5)
    summary = re.search(r"jax_blink switch: (\d+) collective\(s\) lowered, (\d+) on jax_blink", err)
    assert summary and int(summary.group(2)) > 0, err[-3000:]
