"""Schedules: splitting, the program encoding, and the numpy reference interpreter."""
from types import SimpleNamespace

import ml_dtypes
import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jax_blink.planning import schedule as S


def _plan(collective, trees, devices):
    return SimpleNamespace(collective=collective, trees=trees,
                           topology=SimpleNamespace(devices=tuple(devices), n=len(devices)))


def _chain(nodes):
    return nx.DiGraph(list(zip(nodes, nodes[1:])))


def _star(root, nodes):
    return nx.DiGraph([(root, v) for v in nodes if v != root])


def _random_tree(rng, nodes):
    """A random arborescence over ``nodes`` rooted at a random node."""
    order = list(rng.permutation(nodes))
    g = nx.DiGraph()
    g.add_node(order[0])
    for i, v in enumerate(order[1:], start=1):
        g.add_edge(order[rng.integers(0, i)], v)
    return g


@given(st.lists(st.floats(0.0, 100.0), min_size=1, max_size=8).filter(lambda w: sum(w) > 0),
       st.integers(0, 10_000), st.sampled_from([1, 2, 4, 8]))
def test_split_elements_sums_and_aligns(weights, total, align):
    parts = S.split_elements(weights, total, align)
    assert sum(parts) == total
    assert all(p >= 0 for p in parts)
    assert all(p % align == 0 for p in parts[:-1])
    # Close to proportional: within one alignment unit (plus the tail on the last part).
    ideal = np.asarray(weights) / sum(weights) * (total // align * align)
    assert np.all(np.abs(np.asarray(parts[:-1]) - ideal[:-1]) <= align)


def test_split_elements_rejects_bad_weights():
    with pytest.raises(ValueError, match="weights"):
        S.split_elements([0.0, 0.0], 10, 1)
    with pytest.raises(ValueError, match="weights"):
        S.split_elements([1.0, -1.0], 10, 1)


def test_encode_decode_round_trip_and_layout():
    devices = [0, 1, 4, 5]
    plan = _plan("allreduce", [(_chain([4, 0, 1, 5]), 25.0), (_star(5, devices), 50.0)], devices)
    sched = S.build_schedule(plan, 1000, 4, chunk_bytes=256)
    prog = sched.program()
    assert prog.dtype == np.int32
    assert list(prog[:5]) == [S.PROGRAM_VERSION, 4, 2, 64, 1000]
    assert len(prog) == S.HEADER_LEN + 2 * (S.TREE_FIXED + 4)
    back = S.decode(prog)
    assert back == sched
    # Device ids became ranks: the chain 4 -> 0 -> 1 -> 5 is rank 2 -> 0 -> 1 -> 3.
    t0 = back.trees[0]
    assert t0.root == 2 and t0.parent == (2, 0, -1, 1)
    assert t0.phases == S.PHASE_REDUCE | S.PHASE_BROADCAST
    # Weights 25:50 split 1000 elements 1:2, 16-byte aligned.
    assert (t0.length, back.trees[1].length) == (332, 668)
    assert back.trees[1].offset == 332


def test_decode_rejects_garbage():
    with pytest.raises(ValueError):
        S.decode(np.array([99, 2, 0, 1, 0], np.int32))
    with pytest.raises(ValueError):
        S.decode(np.array([S.PROGRAM_VERSION, 2, 1, 1, 4, 0, 3], np.int32))


def test_build_schedule_limits():
    plan = _plan("allreduce", [(_chain([0, 1]), 1.0)], [0, 1])
    with pytest.raises(ValueError, match="int32"):
        S.build_schedule(plan, 2**31, 4)
    with pytest.raises(ValueError, match="chunk_bytes"):
        S.build_schedule(plan, 10, 4, chunk_bytes=8)
    with pytest.raises(ValueError, match="collective"):
        S.build_schedule(_plan("gossip", plan.trees, [0, 1]), 10, 4)
    # A chunk never exceeds the longest segment.
    assert S.build_schedule(plan, 10, 4).chunk_elems == 12


def _expected(op, xs):
    stack = np.stack([x.astype(np.float64) for x in xs])
    return {"sum": stack.sum(0), "max": stack.max(0), "min": stack.min(0)}[op]


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 8), st.integers(1, 300), st.integers(1, 4), st.sampled_from(["sum", "max", "min"]),
       st.sampled_from(["float32", "float64", "int32", "bfloat16", "float16"]), st.integers(0, 2**31 - 1))
def test_reference_allreduce_matches_float64(n, size, ntrees, op, dtype, seed):
    rng = np.random.default_rng(seed)
    devices = list(range(n))
    trees = [(_random_tree(rng, devices), float(rng.uniform(1, 10))) for _ in range(ntrees)]
    sched = S.build_schedule(_plan("allreduce", trees, devices), size, np.dtype(_np_dtype(dtype)).itemsize,
                             chunk_bytes=64)
    xs = [_random(rng, dtype, size) for _ in range(n)]
    outs = S.run_reference(sched, xs, op)
    for o in outs[1:]:  # every rank ends with the root's bits
        np.testing.assert_array_equal(o.view(np.uint8), outs[0].view(np.uint8))
    want = _expected(op, xs)
    tol = {"float32": 1e-5, "float64": 1e-12, "int32": 0, "bfloat16": 3e-2, "float16": 3e-3}[dtype]
    np.testing.assert_allclose(outs[0].astype(np.float64), want, rtol=tol, atol=tol * n)


def test_reference_broadcast_and_reduce():
    rng = np.random.default_rng(0)
    devices = [3, 1, 2, 0]
    tree = _chain([1, 0, 3, 2])  # rooted at device 1 = rank 1
    xs = [rng.standard_normal(37).astype(np.float32) for _ in devices]
    bc = S.run_reference(S.build_schedule(_plan("broadcast", [(tree, 5.0)], devices), 37, 4), xs)
    for o in bc:
        np.testing.assert_array_equal(o, xs[1])
    red = S.run_reference(S.build_schedule(_plan("reduce", [(tree, 5.0)], devices), 37, 4), xs)
    np.testing.assert_allclose(red[1], _expected("sum", xs), rtol=1e-5)
    # Rank 2 (device 2) is the leaf of the chain: it keeps its own input.
    np.testing.assert_array_equal(red[2], xs[2])


def test_reference_rejects_detached_tree():
    bad = S.Schedule(3, 4, 4, (S.TreeSegment(0, 3, 0, 4, (-1, 2, 1)),))
    with pytest.raises(ValueError, match="span"):
        S.run_reference(bad, [np.ones(4, np.float32)] * 3)


def _np_dtype(name):
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def _random(rng, dtype, size):
    if dtype == "int32":
        return rng.integers(-1000, 1000, size).astype(np.int32)
    return rng.standard_normal(size).astype(_np_dtype(dtype))


@pytest.mark.parametrize("preset", ["nvswitch:2", "nvswitch:3", "nvswitch:4", "dgx1v"])
@pytest.mark.parametrize("collective", ["allgather", "reducescatter"])
@pytest.mark.parametrize("per,itemsize", [(3, 2), (1024, 4), (100_003, 4)])
def test_gather_and_scatter_programs_are_blocks_rooted_at_their_owners(preset, collective, per, itemsize):
    """What the CUDA executor's one-hop reduce-scatter and all-gather take (BlockShape in
    kernels/cuda/executor.cu): the trees cover the operand in order, all reduce only or all
    broadcast only, and each lies inside block `root` of n equal blocks. Every program the planner
    makes for these two collectives must be so, or the one-hop kernel never runs."""
    import jax_blink
    from jax_blink.lowering.custom_call import build_program

    topo = jax_blink.Topology.preset(preset)
    if preset == "dgx1v":
        topo = topo.subset([0, 1, 2, 4])
    n = topo.n
    sched = S.decode(build_program(topo, collective, None, n * per, itemsize, None, "exact"))
    assert sched.nranks == n and sched.total_elems == n * per
    at = 0
    for t in sorted((t for t in sched.trees if t.length), key=lambda t: t.offset):
        assert t.offset == at, "the trees must cover the operand without gaps"
        assert t.phases == (S.PHASE_REDUCE if collective == "reducescatter" else S.PHASE_BROADCAST)
        assert t.root * per <= t.offset and t.offset + t.length <= (t.root + 1) * per, (t.root, t.offset, t.length)
        at = t.offset + t.length
    assert at == n * per
