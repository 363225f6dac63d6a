"""benchmarks/boundary_probe.py on CPU: every boundary shape hands the update the same values as
no boundary (the step trains to the same parameters), the kernel count reads the entry
computation only, and bad arguments are refused naming the option."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import boundary_probe as probe  # noqa: E402


@pytest.fixture(scope="module")
def dp():
    from jax_blink.tools.train.models import SIZES
    from jax_blink.tools.train.step import DataParallel
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    # Small buckets, so that a bucket holds several leaves and there are several buckets.
    return DataParallel("gpt2", SIZES["gpt2"]["tiny"], mesh, bucket_bytes=16 << 10, first_bucket_bytes=4 << 10)


def test_every_boundary_trains_as_none(dp):
    assert len(dp.layout.buckets) > 2 and max(len(b.slots) for b in dp.layout.buckets) > 1
    steps = probe.make_steps(dp, probe.MODES)
    out = {m: jax.device_get(steps[m](dp.state0, dp.batches[0])) for m in probe.MODES}
    ref_leaves = jax.tree.leaves(out["none"][0]["params"])
    start = jax.tree.leaves(jax.device_get(dp.state0["params"]))
    assert any(not np.array_equal(a, b) for a, b in zip(ref_leaves, start))  # the step moved something
    for m in probe.MODES[1:]:
        for a, b in zip(jax.tree.leaves(out[m][0]["params"]), ref_leaves):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=m)
        np.testing.assert_array_equal(out[m][1], out["none"][1])


def test_kernels_counts_the_entry_computation_only():
    hlo = """HloModule m

%fused_computation (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %add.9 = f32[4]{0} add(%p, %p)
}

ENTRY %main (a: f32[4]) -> (f32[4], f32[4]) {
  %a = f32[4]{0} parameter(0)
  %loop_add_fusion.12 = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_computation
  %loop_add_fusion = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_computation
  %opt-barrier.1 = (f32[4]{0}) opt-barrier(%loop_add_fusion)
  %gte = f32[4]{0} get-tuple-element(%opt-barrier.1), index=0
  %custom-call.3 = f32[4]{0} custom-call(%gte), custom_call_target="x"
  ROOT %t = (f32[4]{0}, f32[4]{0}) tuple(%custom-call.3, %loop_add_fusion.12)
}
"""
    assert probe.kernels(hlo) == {"loop_add_fusion": 2, "custom-call": 1}


def test_start_placement_reads_the_schedule():
    """Each start: the kernels before it in the entry computation, and the products after it."""
    hlo = f"""HloModule m, is_scheduled=true

ENTRY %main (a: f32[4,4]) -> f32[4,4] {{
  %a = f32[4,4]{{1,0}} parameter(0)
  %loop_add_fusion = f32[4,4]{{1,0}} fusion(%a), kind=kLoop, calls=%c
  %s.1 = f32[4,4]{{1,0}} custom-call(%loop_add_fusion), custom_call_target="{probe._START_TARGET}"
  %custom-call.2 = (f32[4,4]{{1,0}}, s8[0]{{0}}) custom-call(%a, %a), custom_call_target="__cublas$gemm"
  %gte = f32[4,4]{{1,0}} get-tuple-element(%custom-call.2), index=0
  %gemm_fusion.3 = f32[4,4]{{1,0}} fusion(%gte, %a), kind=kCustom, calls=%g
  %s.2 = f32[4,4]{{1,0}} custom-call(%gemm_fusion.3), custom_call_target="{probe._START_TARGET}"
  %d = f32[4,4]{{1,0}} custom-call(%s.1, %s.2), custom_call_target="{probe._TARGET}"
  ROOT %loop_add_fusion.4 = f32[4,4]{{1,0}} fusion(%d), kind=kLoop, calls=%c
}}
"""
    assert probe.start_placement(hlo) == [(1, 2), (3, 0)]


def test_overlap_shapes_place_their_starts_in_order(dp):
    """On CPU too the overlap shapes' starts are found in the compiled program, one per bucket (the
    -last16 shapes' last bucket in more), in schedule order (kernels before each grow, products
    after each shrink)."""
    steps = probe.make_steps(dp, list(probe.OVERLAP_SHAPES))
    for m, c in steps.items():
        placed = probe.start_placement(c.as_text())
        assert len(placed) == len(dp.layout_of(probe.OVERLAP_SHAPES[m]).buckets), m
        assert [b for b, _ in placed] == sorted(b for b, _ in placed), m
        assert [a for _, a in placed] == sorted((a for _, a in placed), reverse=True), m


@pytest.mark.parametrize("argv, needle", [
    (["--modes", "flat,nope"], "--modes: unknown ['nope']"),
    (["--devices", "99"], "--devices 99: give 1 to"),
    (["--size", "huge"], "argument --size: invalid choice: 'huge'"),
    (["--batch", "0"], "--batch must be >= 1"),
    (["--runs", "-1"], "--runs must be at least 0"),
    (["--runs", "0", "--profile", "x"], "--profile traces the timed steps"),
    (["--out", str(BENCHMARKS)], "a folder; give a file name"),
    (["--out", __file__ + "/r.json"], "whose folder cannot hold it"),
    (["--hlo", __file__], "argument --hlo: got"),
    (["--profile", __file__], "argument --profile: got"),
])
def test_bad_arguments_are_refused(argv, needle):
    r = subprocess.run([sys.executable, str(BENCHMARKS / "boundary_probe.py"), *argv],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("n,k,sizes", [(81, 2, [40, 41]), (81, 40, [2] * 39 + [3]), (3, 16, [1, 1, 1]),
                                       (5, 1, [5]), (0, 4, [])])
def test_the_last_bucket_cut_into_groups(n, k, sizes):
    """leaves-last-K (and BucketLayout.of's last_bucket_pieces): at most K groups of consecutive
    leaves, in order, none empty, every leaf once."""
    from jax_blink.switch.merge import consecutive_groups
    groups = consecutive_groups(list(range(n)), k)
    assert [len(g) for g in groups] == sizes
    assert [x for g in groups for x in g] == list(range(n))


def test_the_tree_packed_as_the_switch_merges_it(dp):
    """tree-packed(-barrier): the leaves in groups of at most the bucket cap (merge_groups), one
    barrier per group; the barrier form adds one more per leaf of every group of several."""
    import re
    from jax_blink.switch.merge import merge_groups
    leaves = jax.tree.leaves({"grads": dp.state0["params"], "stats": dp.state0["stats"]})
    groups = merge_groups([jax.ShapeDtypeStruct(v.shape, v.dtype) for v in leaves], dp.layout.bucket_bytes)
    assert len(groups) > 2 and any(len(g) > 1 for g in groups)
    counts = {}
    for m in ("tree-packed", "tree-packed-barrier"):
        text = dp.step_fn("none", combine=lambda t, m=m: probe.boundary(m, t, dp.layout)).lower(
            dp.state0, dp.batches[0]).as_text()
        counts[m] = len(re.findall(r"stablehlo\.optimization_barrier", text))
    assert counts["tree-packed"] == len(groups)
    assert counts["tree-packed-barrier"] == len(groups) + sum(len(g) for g in groups if len(g) > 1)


def test_flat_barrier_packs_each_leaf_behind_a_barrier(dp):
    """flat-barrier: one barrier per bucket, as flat, and one more per leaf of every bucket of
    several leaves (jax_blink's default packing); flat has none of those."""
    import re
    counts = {}
    for m in ("flat", "flat-barrier"):
        text = dp.step_fn("none", combine=lambda t, m=m: probe.boundary(m, t, dp.layout)).lower(
            dp.state0, dp.batches[0]).as_text()
        counts[m] = len(re.findall(r"stablehlo\.optimization_barrier", text))
    buckets = dp.layout.buckets
    assert counts["flat"] == len(buckets)
    assert counts["flat-barrier"] == len(buckets) + sum(len(b.slots) for b in buckets if len(b.slots) > 1)


def test_overlap_calls_are_the_explicit_step_with_identity_calls(dp):
    """overlap-calls: the explicit overlapped step with a start and a done per bucket, each an
    identity custom call, the recent values held with each start but the first; -nohold holds
    none; both train as none (checked above); the patch is undone after the trace."""
    import re
    from jax_blink.api import buckets as _b, overlapped_grad as _g
    before = (_b.start_in_order, _b.done_after_last, _g._held)
    texts = {}
    for hold, mode in ((True, "overlap"), (False, "overlap-none")):
        assert probe.OVERLAP_SHAPES["overlap-calls" if hold else "overlap-calls-nohold"] == mode
        with probe.calls_for_starts():
            texts[hold] = dp.step_fn(mode).lower(dp.state0, dp.batches[0]).as_text()
    assert (_b.start_in_order, _b.done_after_last, _g._held) == before
    n = len(dp.layout.buckets)
    for text in texts.values():  # a start and a done per bucket
        assert len(re.findall(probe._START_TARGET, text)) == len(re.findall(probe._TARGET, text)) == n
    barriers = {h: len(re.findall(r"stablehlo\.optimization_barrier", t)) for h, t in texts.items()}
    assert barriers[True] > barriers[False], barriers  # the holds
    with pytest.raises(ValueError, match="a step of its own"):
        probe.boundary("overlap-calls", {}, dp.layout)
