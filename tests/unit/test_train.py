"""Data-parallel training (jax_blink.tools.train) and gradient buckets (jax_blink.api.buckets), on 8 CPU
host devices: psum, explicit jax_blink calls and the switch train tiny models to the same losses
and parameters."""
import json
import os
import re

import jax
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_blink.api import buckets
from jax_blink.options import config, override

pytest.importorskip("flax", reason="the train extra is not installed (pip install -e '.[train]')")
pytest.importorskip("optax", reason="the train extra is not installed (pip install -e '.[train]')")

from jax_blink.tools.train import __main__ as cli  # noqa: E402
from jax_blink.tools.train.check import check_against_psum  # noqa: E402
from jax_blink.tools.train.models import SIZES  # noqa: E402
from jax_blink.tools.train.step import DataParallel, switch_available  # noqa: E402

N = 8
if jax.default_backend() != "cpu":
    # Training on 8 CPU host devices; on a GPU machine `python -m jax_blink.tools.train` is the run.
    pytest.skip("these tests train on 8 CPU host devices; this process's default devices are "
                f"{jax.default_backend()}", allow_module_level=True)
FAST = {"xla_backend_optimization_level": 0}  # the same for every mode: compiles in a third of the time


def _tree(rng):
    """Leaves of mixed sizes and two dtypes, random values."""
    return {"a": rng.standard_normal((300,)).astype(np.float32),
            "b": [rng.standard_normal((17, 9)).astype(np.float32), rng.integers(-9, 9, (5,)).astype(np.int32)],
            "c": rng.standard_normal((4, 4, 40)).astype(np.float32),
            "d": rng.standard_normal(()).astype(np.float32)}


def test_bucket_layout_is_ddps_and_round_trips():
    tree = _tree(np.random.default_rng(0))
    layout = buckets.BucketLayout.of(tree, bucket_bytes=1024, first_bucket_bytes=256)
    leaves = jax.tree.leaves(tree)
    # Every leaf exactly once, in reverse leaf order within each dtype, never split.
    order = [s.leaf for b in layout.buckets for s in b.slots]
    assert sorted(order) == list(range(len(leaves)))
    for dtype in {np.dtype(np.float32), np.dtype(np.int32)}:
        mine = [s.leaf for b in layout.buckets if b.dtype == dtype for s in b.slots]
        assert mine == sorted(mine, reverse=True)
    # A bucket closes once it reaches its cap: without its last leaf it is under the cap.
    for i, b in enumerate(layout.buckets[:-1]):
        cap = 256 if i == 0 else 1024
        if b.nbytes >= cap:
            assert (b.size - b.slots[-1].size) * b.dtype.itemsize < cap
    assert layout.buckets[0].nbytes >= 256 and layout.buckets[0].slots[0].leaf == len(leaves) - 1
    assert len(layout.buckets) >= 3
    back = layout.unpack(layout.pack(tree))
    for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(back)):
        assert x.dtype == y.dtype and np.array_equal(x, np.asarray(y))
    assert "bucket 0" in layout.describe()
    with pytest.raises(ValueError, match="bucket_bytes"):
        buckets.BucketLayout.of(tree, bucket_bytes=0)
    with pytest.raises(ValueError, match="leaf"):
        layout.pack({**tree, "a": tree["a"][:10]})


def test_large_leaf_alone_closes_the_open_bucket_first():
    """DDP adds a leaf past the cap to the open bucket; large_leaf_alone closes that bucket first
    and gives the leaf one of its own. The leaves, their order and the round trip are unchanged."""
    rng = np.random.default_rng(3)
    tree = {"embed": rng.standard_normal((50, 16)).astype(np.float32),  # 3200 bytes, first in leaf order
            "w": [rng.standard_normal((16, 16)).astype(np.float32) for _ in range(4)]}  # 1024 bytes each
    ddp = buckets.BucketLayout.of(tree, bucket_bytes=3000, first_bucket_bytes=3000)
    alone = buckets.BucketLayout.of(tree, bucket_bytes=3000, first_bucket_bytes=3000, large_leaf_alone=True)
    paths = lambda layout: [[s.path for s in b.slots] for b in layout.buckets]  # noqa: E731
    assert paths(ddp) == [["['w'][3]", "['w'][2]", "['w'][1]"], ["['w'][0]", "['embed']"]]
    assert paths(alone) == [["['w'][3]", "['w'][2]", "['w'][1]"], ["['w'][0]"], ["['embed']"]]
    assert [s.leaf for b in alone.buckets for s in b.slots] == [s.leaf for b in ddp.buckets for s in b.slots]
    for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(alone.unpack(alone.pack(tree)))):
        assert np.array_equal(x, np.asarray(y))
    assert "a leaf of at least the cap alone" in alone.describe()
    assert "alone" not in ddp.describe()
    # The first bucket's smaller cap is the one that counts while it is open.
    small = {"m": tree["w"][0].repeat(2, axis=0), "z": tree["w"][1]}  # 2048 and 1024 bytes; z comes first
    assert paths(buckets.BucketLayout.of(small, 1 << 20, 1500)) == [["['z']", "['m']"]]
    assert paths(buckets.BucketLayout.of(small, 1 << 20, 1500, large_leaf_alone=True)) == [["['z']"], ["['m']"]]
    with pytest.raises(TypeError, match="large_leaf_alone must be True or False"):
        buckets.BucketLayout.of(tree, large_leaf_alone="yes")


def test_last_bucket_pieces_cuts_only_the_last_bucket():
    """last_bucket_pieces=K: the buckets before the last as DDP's, the last cut into K buckets of
    consecutive leaves as even in count as can be, each laid out from offset 0; at most one per
    leaf; the round trip unchanged; bad values refused naming the argument."""
    rng = np.random.default_rng(4)
    tree = {f"w{i:02d}": rng.standard_normal((i + 2, 3)).astype(np.float32) for i in range(11)}
    ddp = buckets.BucketLayout.of(tree, bucket_bytes=1 << 20, first_bucket_bytes=100)
    assert [len(b.slots) for b in ddp.buckets] == [1, 10]  # w10 (144 bytes) closes the first bucket
    paths = lambda layout: [[s.path for s in b.slots] for b in layout.buckets]  # noqa: E731
    for k, sizes in ((1, [10]), (2, [5, 5]), (4, [2, 3, 2, 3]), (9, [1] * 8 + [2]), (40, [1] * 10)):
        cut = buckets.BucketLayout.of(tree, bucket_bytes=1 << 20, first_bucket_bytes=100, last_bucket_pieces=k)
        assert paths(cut)[:1] == paths(ddp)[:1]
        assert [len(b.slots) for b in cut.buckets[1:]] == sizes
        assert sum(paths(cut)[1:], []) == paths(ddp)[1]  # the same leaves in the same order
        assert cut.last_bucket_pieces == len(sizes)
        for b in cut.buckets:
            assert [s.offset for s in b.slots] == list(np.cumsum([0] + [s.size for s in b.slots])[:-1])
        for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(cut.unpack(cut.pack(tree)))):
            assert np.array_equal(x, np.asarray(y))
        assert ("the last bucket cut into" in cut.describe()) == (k > 1)
    for bad, err in ((0, ValueError), (-2, ValueError), (2.0, TypeError), (True, TypeError), ("3", TypeError)):
        with pytest.raises(err, match="last_bucket_pieces"):
            buckets.BucketLayout.of(tree, last_bucket_pieces=bad)


def test_bucketed_all_reduce_equals_psum_per_leaf():
    rng = np.random.default_rng(1)
    per_rank = [_tree(rng) for _ in range(N)]
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *per_rank)
    mesh = jax.make_mesh((N,), ("data",))
    x = jax.device_put(stacked, NamedSharding(mesh, P("data")))
    layout = buckets.BucketLayout.of(per_rank[0], bucket_bytes=1024, first_bucket_bytes=256)

    def body(t):
        t = jax.tree.map(lambda v: v[0], t)
        return (jax.tree.map(lambda v: v[None], buckets.bucketed_all_reduce(t, "data", layout=layout)),
                jax.tree.map(lambda v: v[None], jax.tree.map(lambda v: lax.psum(v, "data"), t)))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    with override(dispatch="blink"):
        ours, ref = f(x)
        text = f.lower(x).as_text()
    assert text.count("jax_blink_collective") == len(layout.buckets)
    # The calls in bucket order (tests/unit/test_ordering.py checks the chain in the compiled program).
    assert text.count("@jax_blink_after(") >= len(layout.buckets) - 1
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        assert (a == a[:1]).all()  # every rank the same bits


def test_stream_annotation_wraps_the_call_and_keeps_the_result():
    """--stream (experimental): the call is lowered inside a call annotated for an XLA:GPU stream;
    XLA:CPU ignores the annotation, so here the result must simply be the sum."""
    from jax_blink.tools.train.step import reducer
    from jax_blink.lowering import jax_internals as _jax_internals
    if _jax_internals.compute_on_call() is None:  # a jax without it: a clear error, not an ImportError
        with pytest.raises(NotImplementedError, match="compute_on2.*run without a stream annotation"):
            reducer("blink", "data", stream=1)
        return
    mesh = jax.make_mesh((N,), ("data",))
    f = jax.jit(jax.shard_map(reducer("blink", "data", stream=1), mesh=mesh, in_specs=P("data"), out_specs=P()))
    x = np.random.default_rng(2).standard_normal((N, 64)).astype(np.float32)
    xs = jax.device_put(x.reshape(-1), NamedSharding(mesh, P("data")))
    with override(dispatch="blink"):
        text = f.lower(xs).as_text()
        out = f(xs)
    assert '_xla_stream_annotation = "1"' in text and "jax_blink_collective" in text
    np.testing.assert_allclose(np.asarray(out), x.sum(0), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="blink"):
        reducer("psum", "data", stream=1)


@pytest.mark.parametrize("model", ["gpt2", "resnet"])
def test_psum_blink_and_switch_train_alike(model):
    assert switch_available(), "jax_blink.installed() (the switch) is missing"
    mesh = jax.make_mesh((N,), ("data",))
    # Caps small enough for several buckets (the ResNet's BatchNorm statistics travel in them).
    dp = DataParallel(model, SIZES[model]["tiny"], mesh, bucket_bytes=32 << 10,
                      first_bucket_bytes=4 << 10, compiler_options=FAST)
    assert len(dp.layout.buckets) >= 3
    steps = 3
    # `none` (the step without its all-reduce) on one model, the tree's psum under the switch on the
    # other: each mode is a compile (CI time).
    modes = ("psum", "blink", "switch") + (("none",) if model == "gpt2" else ("switch-tree",))
    states, losses = {}, {}
    for mode in modes:
        states[mode], losses[mode] = dp.run(mode, steps)
    # What each program runs: XLA's all-reduce (it may combine the buckets), or one jax_blink call
    # per bucket, or the switch's merged calls (the buckets' psums are adjacent: one call per dtype
    # up to jax_blink.config.merge_bytes, as XLA's combiner joins them), or nothing.
    count = {m: dp.collectives_in(m) for m in modes}
    assert count["psum"]["all-reduce"] >= 1 and count["psum"]["jax_blink"] == 0
    assert count["blink"] == {"all-reduce": 0, "jax_blink": len(dp.layout.buckets)}, count["blink"]
    # Under the switch every bucket's psum starts on its own inside the backward pass (the switch's
    # buckets take the step's cap): one jax_blink call per bucket, as the explicit calls.
    assert count["switch"] == {"all-reduce": 0, "jax_blink": len(dp.layout.buckets)}, count["switch"]

    if "switch-tree" in modes:  # a psum per leaf, merged by the switch into calls of at most the cap
        assert count["switch-tree"]["all-reduce"] == 0 and count["switch-tree"]["jax_blink"] >= 2, count
    for mode in ("blink", "switch") + (("switch-tree",) if "switch-tree" in modes else ()):
        np.testing.assert_allclose(losses[mode], losses["psum"], rtol=2e-5, err_msg=mode)
        for path, a, b in zip(jax.tree_util.tree_flatten_with_path(states[mode])[0],
                              jax.tree.leaves(states[mode]), jax.tree.leaves(states["psum"])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=2e-6,
                                       err_msg=f"{mode} {jax.tree_util.keystr(path[0])}")
        # Replicated: every device holds the same parameters.
        for leaf in jax.tree.leaves(states[mode]["params"]):
            shards = [np.asarray(s.data) for s in leaf.addressable_shards]
            assert all(np.array_equal(shards[0], s) for s in shards[1:])
    assert losses["psum"][0] != losses["psum"][2]  # training moves
    if "none" in modes:  # and the collective matters: without it the later losses differ
        assert count["none"] == {"all-reduce": 0, "jax_blink": 0}
        assert losses["none"][0] == pytest.approx(losses["psum"][0], rel=1e-6)
        assert abs(losses["none"][2] - losses["psum"][2]) > 1e-4


def test_cli_trains_and_writes_results(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("JAX_BLINK_ASYNC_ENGINE", "ce")  # recorded: what an overlapped mode would run on
    # A vocabulary of 4096 (a table of 256 KiB; 32 tokens of 64 bytes per device): the tied
    # embedding's gradient is row-sparse enough for the switch to gather it.
    rc = cli.main(["--model", "gpt2", "--collective", "switch", "--steps", "3", "--layers", "1",
                   "--width", "16", "--vocab", "4096", "--timing-runs", "2", "--chain", "2", "--bucket-mb", "0.01",
                   "--first-bucket-mb", "0.002", "--quick-compile", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    steps = [line.split() for line in out.splitlines() if re.match(r"step \d+ loss ", line)]
    assert [s[1] for s in steps] == ["0", "1", "2"] and all(s[2] == "loss" for s in steps)
    for label in ("psum (XLA all-reduce)", "psum under the switch", "no all-reduce", "collectives"):
        assert label in out
    (record,) = [json.loads(p.read_text()) for p in tmp_path.glob("train-gpt2-tiny-switch-cpu-x8-*.json")]
    assert record["losses"] == pytest.approx([float(s[3]) for s in steps], rel=1e-5)
    assert set(record["timing"]["modes"]) == {"psum", "switch", "switch-auto", "switch-sparse", "switch-late", "switch-sync",
                                               "none", "none-barrier"}
    assert record["timing"]["chain"] == 2 and "runs of 2 steps in a row" in out
    # Overlapped, each bucket's psum is a start of its own; without the overlap the buckets' adjacent
    # psums merge into calls of at most the step's bucket cap (here each bucket is most of the cap).
    timing = record["timing"]["modes"]
    assert timing["switch"]["jax_blink_calls"] == len(record["buckets"]) > 1, timing
    assert timing["switch-late"]["jax_blink_calls"] == len(record["buckets"]), timing
    # Under the default dispatch the CPU host devices' entry keeps these small buckets on the executor.
    assert timing["switch-auto"]["jax_blink_calls"] == len(record["buckets"]), timing
    # With the embedding's gradient gathered: the table's dense part leaves its bucket (a start of
    # its own) and the tokens and rows are gathered (two calls).
    assert timing["switch-sparse"]["jax_blink_calls"] == timing["switch"]["jax_blink_calls"] + 3, timing
    assert 1 <= timing["switch-sync"]["jax_blink_calls"] <= len(record["buckets"]), timing
    assert "psum under the switch (overlapped)" in out and "switch_overlap=False" in out
    assert "switch_sparse_gradients=True" in out and "psum under the switch, dispatch=auto" in out
    assert list(tmp_path.glob("train-gpt2-tiny-switch-cpu-x8-*.txt"))
    assert record["environment"].get("JAX_BLINK_ASYNC_ENGINE") == "ce"
    assert "environment: " in out and "JAX_BLINK_ASYNC_ENGINE=ce" in out
    # Every timed mode that sums the gradients was checked against psum's result before the timing.
    assert set(record["check"]) == {"switch", "switch-auto", "switch-sparse", "switch-late", "switch-sync"}
    assert all(c["passed"] and c["finite"] and c["update_rel_diff"] < 1e-3 and c["loss_rel_diff"] < 1e-5
               for c in record["check"].values()), record["check"]
    assert "results against psum's, 3 step(s)" in out and "  switch-late: ok, parameter change within " in out


class _FakeRun:
    """A DataParallel stand-in whose modes return given losses and parameters (no compile)."""

    def __init__(self, p0, results):
        self.state0 = {"params": {"w": jax.numpy.asarray(p0, jax.numpy.float32)}}
        self.results = results

    def run(self, mode, steps):
        losses, params = self.results[mode]
        return {"params": {"w": jax.numpy.asarray(params, jax.numpy.float32)}}, list(losses)[:steps]


def test_the_result_check_flags_a_wrong_or_non_finite_mode():
    """From p0 = 0, psum moves the parameters to (3, 4), a change of norm 5: a mode within half of
    that passes (rounding, a few of AdamW's signs turned), one that loses a bucket or gives NaN fails."""
    dp = _FakeRun([0.0, 0.0], {"psum": ([10.0, 9.0], [3.0, 4.0]),
                               "switch": ([10.0, 9.0000001], [3.0, 4.0000005]),
                               "switch-late": ([10.0, 9.001], [3.0, 5.0]),       # one sign turned: 0.2
                               "overlap": ([10.0, 9.1], [3.0, 0.0]),             # a bucket lost: 0.8
                               "blink": ([10.0, 9.0], [3.0, float("nan")]), "none": ([10.0, 5.0], [0.0, 0.0])})
    check = check_against_psum(dp, ["psum", "switch", "switch-late", "overlap", "blink", "none", "none-barrier"], 2)
    assert set(check) == {"switch", "switch-late", "overlap", "blink"}  # psum is the reference; the baselines sum nothing
    assert check["switch"]["passed"] and check["switch"]["update_rel_diff"] == pytest.approx(1e-7, abs=2e-7)
    assert check["switch-late"]["passed"] and check["switch-late"]["update_rel_diff"] == pytest.approx(0.2)
    assert not check["overlap"]["passed"] and check["overlap"]["finite"]
    assert check["overlap"]["update_rel_diff"] == pytest.approx(0.8)
    assert check["overlap"]["loss_rel_diff"] == pytest.approx(0.1 / 9.0)
    assert not check["blink"]["passed"] and not check["blink"]["finite"]


def test_cli_fails_when_a_mode_does_not_give_psums_result(tmp_path, capsys, monkeypatch):
    """A mode whose training differs from psum's is named, its times are marked, and the exit
    status is 1 (here the switch's parameters are moved by 1)."""
    real = DataParallel.run

    def run(self, mode, steps, on_step=None):
        state, losses = real(self, mode, steps, on_step)
        if mode == "switch":  # every parameter 1 off: far past psum's change of about 1e-3 per step
            state = {**state, "params": jax.tree.map(lambda x: x + 1.0, state["params"])}
        return state, losses

    monkeypatch.setattr(DataParallel, "run", run)
    rc = cli.main(["--model", "gpt2", "--collective", "switch", "--steps", "2", "--layers", "1", "--width", "16",
                   "--timing-runs", "1", "--chain", "1", "--modes", "switch", "--quick-compile", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert re.search(r"  switch: MISMATCH, parameter change within \d\.\de\+0[1-9]", out), out
    assert "error: switch did not train as psum does" in out
    (record,) = [json.loads(p.read_text()) for p in tmp_path.glob("train-gpt2-tiny-switch-cpu-x8-*.json")]
    assert record["check"]["switch"]["passed"] is False


@pytest.mark.parametrize("argv, flag", [
    (["--model", "vgg"], "--model"),
    (["--model", "gpt2", "--collective", "nccl"], "--collective"),
    (["--model", "gpt2", "--steps", "0"], "--steps"),
    (["--model", "gpt2", "--size", "huge"], "--size"),
    (["--model", "gpt2", "--bucket-mb", "-1"], "--bucket-mb"),
    (["--model", "gpt2", "--bucket-mb", "nan"], "--bucket-mb"),
    (["--model", "resnet", "--heads", "4"], "--heads"),
    (["--model", "gpt2", "--image-size", "32"], "--image-size"),
    (["--model", "gpt2", "--width", "30", "--heads", "4"], "--width"),
    (["--model", "gpt2", "--timing-runs", "-1"], "--timing-runs"),
    (["--model", "gpt2", "--chain", "0"], "--chain"),
    (["--model", "gpt2", "--first-bucket-mb", "30"], "--first-bucket-mb"),
    (["--steps", "3"], "--model"),
    (["--model", "gpt2", "--stream", "1"], "--stream"),  # CPU host devices: no streams
    (["--model", "gpt2", "--hold", "some"], "--hold"),
    (["--model", "gpt2", "--collective", "switch", "--hold", "all"], "--hold"),
    (["--model", "gpt2", "--modes", "switch,nccl"], "--modes"),
    (["--model", "gpt2", "--modes", ","], "--modes"),
    (["--model", "gpt2", "--collective", "blink", "--modes", "switch-ce"], "--modes"),
    (["--model", "resnet", "--collective", "switch", "--modes", "switch-sparse"], "--modes"),
    (["--model", "gpt2", "--collective", "switch", "--modes", "switch-tree-8blocks,overlap-kpack"], "--modes"),
    (["--model", "gpt2", "--profile", __file__], "--profile"),  # a file, not a folder
    (["--model", "gpt2", "--profile", __file__ + "/traces"], "--profile"),
])
def test_cli_bad_flags_are_usage_errors(argv, flag, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err, err


def test_time_steps_chains_each_run_from_the_same_state():
    """Each timed run is `chain` steps in a row, each fed the previous one's state, every run from
    the state given; the times are per step."""
    seen = {"a": [], "b": []}

    class Steps:
        batches = ["batch"]

        def callable(self, mode):
            def step(state, batch):
                assert batch == "batch"
                seen[mode].append(state)
                return state + 1, np.float32(0.5)
            return step

    times = cli.time_steps(Steps(), ["a", "b"], 10, runs=3, chain=4)
    assert {m: len(t) for m, t in times.items()} == {"a": 3, "b": 3}
    assert all(t > 0 for ts in times.values() for t in ts)
    for m in ("a", "b"):  # compile, warm-up and 3 runs, 4 steps each from state 10
        assert seen[m] == [10, 11, 12, 13] * 5, seen[m]


def test_timed_modes_default_and_asked():
    """Each collective's modes in the order they take turns; --modes keeps those named with psum
    and none (the ratios and the exposed time need them), and only it adds the site variants."""
    assert cli.timed_modes("blink", "blink", "gpt2") == ["psum", "blink", "overlap", "none", "none-barrier"]
    assert cli.timed_modes("overlap", "blink", "gpt2", "both") == ["psum", "blink", "overlap", "overlap-all", "none",
                                                                   "none-barrier"]
    assert cli.timed_modes("overlap", "blink", "gpt2", "none") == ["psum", "blink", "overlap-none", "none",
                                                                   "none-barrier"]
    assert cli.timed_modes("overlap", "blink", "resnet", asked=["overlap-none", "overlap"]) == [
        "psum", "overlap", "overlap-none", "none", "none-barrier"]
    assert cli.timed_modes("overlap", "blink", "gpt2", "weights") == ["psum", "blink", "overlap-weights", "none",
                                                                     "none-barrier"]
    assert cli.timed_modes("overlap", "blink", "resnet", asked=["overlap-weights", "overlap"]) == [
        "psum", "overlap", "overlap-weights", "none", "none-barrier"]
    assert cli.timed_modes("overlap", "blink", "resnet", asked=["overlap-none-last16", "overlap", "overlap-none"]) == [
        "psum", "overlap", "overlap-none", "overlap-none-last16", "none", "none-barrier"]
    assert cli.timed_modes("switch", "blink", "resnet", asked=["switch-none-last16", "switch", "switch-none",
                                                                "switch-tree-weights", "switch-weights"]) == [
        "psum", "switch", "switch-weights", "switch-none", "switch-none-last16", "switch-tree-weights", "none",
        "none-barrier"]
    assert cli.timed_modes("switch", "blink", "resnet") == ["psum", "switch", "switch-auto", "switch-late",
                                                             "switch-sync", "none", "none-barrier"]
    assert cli.timed_modes("switch", "auto", "gpt2") == ["psum", "switch", "switch-sparse", "switch-late",
                                                          "switch-sync", "none", "none-barrier"]
    assert cli.timed_modes("switch", "blink", "resnet", asked=["switch-8blocks", "switch", "switch-ce"]) == [
        "psum", "switch", "switch-ce", "switch-8blocks", "none", "none-barrier"]
    assert cli.timed_modes("switch", "blink", "gpt2", asked=["switch-tree", "psum-tree"]) == [
        "psum", "psum-tree", "switch-tree", "none", "none-barrier"]
    assert cli.timed_modes("blink", "blink", "gpt2", asked=["psum-tree"]) == ["psum", "psum-tree", "none",
                                                                             "none-barrier"]
    # A site variant of the tree's psum is both a site variant and a tree mode: timed once.
    assert cli.timed_modes("switch", "blink", "gpt2", asked=["switch-tree", "switch-tree-8blocks", "switch-tree-sync"]) == [
        "psum", "switch-tree-8blocks", "switch-tree", "switch-tree-sync", "none", "none-barrier"]
    with pytest.raises(cli.UsageError, match="does not time switch-tree"):
        cli.timed_modes("blink", "blink", "gpt2", asked=["switch-tree"])
    with pytest.raises(cli.UsageError, match="does not time switch-auto"):
        cli.timed_modes("switch", "auto", "gpt2", asked=["switch-auto"])


def test_site_environment_holds_for_the_first_call_only(monkeypatch):
    """A mode of SITE_ENVIRONMENT runs its first call (to its end) under its variables, later calls
    and other modes under the process's own; the environment is put back."""
    from jax_blink.tools.train.step import DataParallel
    monkeypatch.setenv("JAX_BLINK_ASYNC_BLOCKS", "24")
    monkeypatch.delenv("JAX_BLINK_ASYNC_ENGINE", raising=False)
    seen = []

    class Stub:
        _sites_set_up: set = set()

        def compiled(self, mode):
            return lambda x: seen.append((mode, os.environ.get("JAX_BLINK_ASYNC_ENGINE"),
                                          os.environ.get("JAX_BLINK_ASYNC_BLOCKS"))) or np.float32(x)

    stub = Stub()
    stub._sites_set_up = set()
    for mode in ("switch-ce", "switch-8blocks", "switch"):
        fn = DataParallel.callable(stub, mode)
        fn(1.0), fn(2.0)
        DataParallel.callable(stub, mode)(3.0)
    assert seen == [("switch-ce", "ce", "24")] + [("switch-ce", None, "24")] * 2 + \
        [("switch-8blocks", None, "8")] + [("switch-8blocks", None, "24")] * 2 + [("switch", None, "24")] * 3
    assert os.environ.get("JAX_BLINK_ASYNC_ENGINE") is None and os.environ["JAX_BLINK_ASYNC_BLOCKS"] == "24"


def test_cli_times_the_switchs_site_variants(tmp_path, capsys):
    """--modes switch,switch-ce,switch-8blocks,psum-tree: psum, those and the baselines, each site
    variant lowered as the switch (a start per bucket) and labelled with its variables."""
    rc = cli.main(["--model", "resnet", "--collective", "switch", "--steps", "1", "--timing-runs", "1",
                   "--chain", "1", "--bucket-mb", "0.05", "--first-bucket-mb", "0.01", "--quick-compile",
                   "--modes", "switch-8blocks,switch,psum-tree,switch-ce", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    (record,) = [json.loads(p.read_text()) for p in tmp_path.glob("train-resnet-tiny-switch-cpu-x8-*.json")]
    timing = record["timing"]["modes"]
    assert list(timing) == ["psum", "switch", "switch-ce", "switch-8blocks", "psum-tree", "none", "none-barrier"]
    assert timing["psum-tree"]["xla_all_reduces"] >= 1 and timing["psum-tree"]["jax_blink_calls"] == 0
    assert "psum of the gradient tree (no buckets)" in out
    assert "XLA:CPU removes optimization barriers" in out  # the baseline's line says what it is here
    assert timing["switch-ce"]["jax_blink_calls"] == timing["switch"]["jax_blink_calls"] == len(record["buckets"]) > 1
    assert "JAX_BLINK_ASYNC_ENGINE=ce (its sites)" in out and "JAX_BLINK_ASYNC_BLOCKS=8 (its sites)" in out


def test_cli_times_the_last_bucket_cut_beside_the_whole(tmp_path, capsys):
    """--modes switch,switch-last16,switch-tree,switch-tree-last16: the cut modes train as psum
    does and hold more calls than their base mode (the switch would merge the layout's pieces
    back into one call but for switch_last_bucket_pieces); the layout of switch-last16 printed."""
    rc = cli.main(["--model", "resnet", "--collective", "switch", "--steps", "1", "--timing-runs", "1",
                   "--chain", "1", "--quick-compile", "--modes", "switch,switch-last16,switch-tree,switch-tree-last16",
                   "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    (record,) = [json.loads(p.read_text()) for p in tmp_path.glob("train-resnet-tiny-switch-cpu-x8-*.json")]
    calls = {m: t["jax_blink_calls"] for m, t in record["timing"]["modes"].items()}
    # The tiny ResNet's gradients fit one bucket: whole, one call; cut, 16 (it has 62 leaves).
    assert calls["switch"] == calls["switch-tree"] == 1 and calls["switch-last16"] == calls["switch-tree-last16"] == 16, calls
    assert "gradient buckets of switch-last16: 16 bucket(s)" in out and "the last bucket cut into 16" in out
    assert "gradient buckets of switch-tree-last16" not in out  # the tree's psum has no buckets of the tool's
    assert "psum under the switch (overlapped), the last bucket in 16 calls" in out
    for mode in ("switch-last16", "switch-tree-last16"):
        assert f"  {mode}: ok" in out
    assert cli.timed_modes("overlap", "blink", "resnet", asked=["overlap-last16"]) == [
        "psum", "overlap-last16", "none", "none-barrier"]
    with pytest.raises(cli.UsageError, match="does not time overlap-last16"):
        cli.timed_modes("switch", "blink", "resnet", asked=["overlap-last16"])


def test_cli_profile_reports_gpu_spans_and_a_host_bound_step(tmp_path, capsys, monkeypatch):
    """--profile traces every timed mode, the step without all-reduce too; from their GPU spans the
    tool prints each mode's span less that step's, and a note when the GPUs' span is well under the
    timed step (host-bound). CPU traces name no GPU, so the spans here are a stand-in's."""
    traced = []

    def fake_profile(dp, modes, state, folder, say):
        traced.extend(modes)
        return {m: {"span_us": 1.0 + 250.0 * (m != "none"), "overlap": None,
                    "compute_us_per_gpu": 1000.0 + 500.0 * (m == "psum")} for m in modes}

    monkeypatch.setattr(cli, "profile_modes", fake_profile)
    rc = cli.main(["--model", "gpt2", "--collective", "switch", "--steps", "1", "--layers", "1", "--width", "16",
                   "--timing-runs", "1", "--chain", "2", "--bucket-mb", "0.01", "--first-bucket-mb", "0.002",
                   "--quick-compile", "--profile", str(tmp_path / "prof"), "--no-write"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert traced == ["psum", "switch", "switch-auto", "switch-sparse", "switch-late", "switch-sync", "none",
                      "none-barrier"]
    assert ("psum 0.250 ms, switch 0.250 ms, switch-auto 0.250 ms, switch-sparse 0.250 ms, switch-late 0.250 ms, "
            "switch-sync 0.250 ms, none-barrier 0.250 ms") in out, out
    assert "compute kernels busy per GPU (measured, one profiled step" in out and "psum 1.500 ms, switch 1.000 ms" in out
    # A 1 us GPU span against a CPU step of milliseconds: host-bound, and the note says so.
    assert "note: host-bound: the step without all-reduce spans 0.001 ms on the GPUs" in out, out


def test_cli_times_both_holds_of_the_overlapped_step(tmp_path, capsys):
    """--hold both times the overlapped step with each hold beside psum, the synchronous calls and
    the step without all-reduce, each with a jax_blink call per bucket."""
    rc = cli.main(["--model", "gpt2", "--collective", "overlap", "--hold", "both", "--steps", "2", "--layers", "1",
                   "--width", "16", "--timing-runs", "1", "--bucket-mb", "0.01", "--first-bucket-mb", "0.002",
                   "--quick-compile", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "jax_blink overlapped (hold recent)" in out and "jax_blink overlapped (hold all)" in out, out
    (record,) = [json.loads(p.read_text()) for p in tmp_path.glob("train-gpt2-tiny-overlap-cpu-x8-*.json")]
    assert record["hold"] == "both"
    assert list(record["timing"]["modes"]) == ["psum", "blink", "overlap", "overlap-all", "none", "none-barrier"]
    for m in ("overlap", "overlap-all"):
        assert record["timing"]["modes"][m]["jax_blink_calls"] == len(record["buckets"]) > 1


def test_gpt2_example_trains(capsys):
    """examples/train_gpt2.py, the step written out by hand, runs and its loss falls."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "examples" / "train_gpt2.py"
    spec = importlib.util.spec_from_file_location("train_gpt2_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with override(dispatch=config.dispatch):  # the example sets config.dispatch: restored after
        example.main(["--steps", "3", "--bucket-mb", "0.05"])
    losses = [float(m.group(1)) for m in re.finditer(r"^step \d+ loss (\S+)$", capsys.readouterr().out, re.M)]
    assert len(losses) == 3 and all(np.isfinite(losses)) and losses[2] < losses[0]



def test_cli_on_one_device_has_no_collective_share_and_says_where_it_wrote(tmp_path, monkeypatch, capsys):
    """One device: no "collective share" (the all-reduce moves nothing); no --out: the results go
    to ./jax_blink_results of the folder the user stands in, and the run says so."""
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["--model", "gpt2", "--devices", "1", "--steps", "1", "--layers", "1", "--width", "16",
                   "--timing-runs", "1", "--quick-compile"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.count("no collective in this program") == 3, out  # psum's, jax_blink's and the overlapped step
    assert not re.search(r"collectives +[\d.]+%", out), out
    folder = tmp_path / cli.DEFAULT_OUT
    assert f"made the folder {folder}" in out and f"wrote {folder}" in out
    (record,) = [json.loads(p.read_text()) for p in folder.glob("train-gpt2-tiny-blink-cpu-x1-*.json")]
    assert record["timing"]["modes"]["blink"]["collective_share"] is None
    assert not (tmp_path / "benchmarks").exists()


def test_switch_auto_is_traced_under_the_default_dispatch():
    """``switch-auto`` is the switch as a user gets it (``dispatch="auto"``) whatever the tool's
    ``--dispatch``; the other switch modes take the tool's."""
    import jax_blink
    from jax_blink.tools.train.step import lowering_context
    seen, before = {}, jax_blink.config.dispatch
    for mode in ("switch", "switch-auto", "switch-sparse"):
        with lowering_context(mode, "blink"):
            seen[mode] = (jax_blink.config.dispatch, jax_blink.config.switch_sparse_gradients)
    assert seen == {"switch": ("blink", False), "switch-auto": ("auto", False), "switch-sparse": ("blink", True)}
    assert jax_blink.config.dispatch == before  # restored
