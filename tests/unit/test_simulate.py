"""The ring baseline and the alpha-beta model (jax_blink.tools.simulate)."""

import itertools
import math
from collections import Counter
from types import SimpleNamespace

import networkx as nx
import pytest

from jax_blink.tools import simulate
from jax_blink.tools.simulate import MODEL, RingPlan, algbw, best_time, compare, rings, time_us
from jax_blink.planning.topology import Topology

DGX1V = Topology.preset("dgx1v")
DGX1P = Topology.preset("dgx1p")


def _nvlink_degree(topo: Topology, u: int) -> int:
    """Number of NVLinks leaving u (physical links, one direction)."""
    return sum(1 for _, _, d in topo.graph.out_edges(u, data=True) if d["kind"] == "nvlink")


def _check_rings_fit(rp: RingPlan) -> None:
    """Every ring visits every device once and the rings together use no more physical links
    per direction than there are."""
    topo = rp.topology
    used = Counter()
    for r in rp.rings:
        assert sorted(r) == sorted(topo.devices)
        for i in range(len(r)):
            used[(r[i], r[(i + 1) % len(r)])] += 1
    for (u, v), k in used.items():
        assert topo.graph.number_of_edges(u, v) >= k, (u, v, k)


def _planner():
    treegen = pytest.importorskip("jax_blink.planning.packing")
    if not hasattr(treegen, "plan"):
        pytest.skip("jax_blink.planning.packing.plan not available yet")
    return treegen.plan


# ------------------------------------------------------------------------------------ rings
def test_dgx1v_all_eight_six_rings():
    # Each V100 has 6 NVLinks and a directed ring takes one outgoing link of every GPU, so at most
    # 6 link-disjoint directed rings; the DGX-1V's 24 NVLinks split into three edge-disjoint
    # Hamiltonian cycles, each run both ways: 6 rings x 25 GB/s = 150 GB/s, NCCL's figure there.
    assert {_nvlink_degree(DGX1V, u) for u in range(8)} == {6}
    rp = rings(DGX1V)
    assert rp.kind == "nvlink"
    assert rp.num_rings == 6
    assert rp.rate == pytest.approx(150.0)
    assert set(rp.rates) == {25.0}
    _check_rings_fit(rp)
    # All 48 link directions are used: every link of the machine carries exactly one ring.
    assert sum(len(r) for r in rp.rings) == DGX1V.graph.number_of_edges()


def test_dgx1p_all_eight_four_rings():
    # P100: 4 NVLinks per GPU (3 inside its quad, 1 across) -> at most 4 directed rings, found.
    assert {_nvlink_degree(DGX1P, u) for u in range(8)} == {4}
    rp = rings(DGX1P)
    assert (rp.kind, rp.num_rings) == ("nvlink", 4)
    assert rp.rate == pytest.approx(80.0)
    _check_rings_fit(rp)


def test_quad_and_triangle():
    # {0,1,2,3}: GPU 0 has 4 NVLinks inside the quad (0-1, 0-2, 0-3 x2) and GPU 1 too -> 4 rings.
    rp = rings(DGX1V.subset([0, 1, 2, 3]))
    assert (rp.kind, rp.num_rings, rp.rate) == ("nvlink", 4, 100.0)
    _check_rings_fit(rp)
    # {0,1,2}: single links 0-1, 0-2 and a double 1-2: one ring each way.
    rp = rings(DGX1V.subset([0, 1, 2]))
    assert (rp.num_rings, rp.rate) == (2, 50.0)
    _check_rings_fit(rp)


def test_no_nvlink_ring_falls_back_to_pcie():
    # {0,1,4}: 1 and 4 have no NVLink, so no Hamiltonian ring over NVLink: NCCL uses PCIe.
    rp = rings(DGX1V.subset([0, 1, 4]))
    assert rp.kind == "pcie" and rp.num_rings == 1
    assert rp.rate == MODEL["pcie_ring_gbps"] == 10.0
    # With the PCIe links in the topology, the ring is over them (and NVLink where it can).
    rp = rings(Topology.preset("dgx1v", pcie=True).subset([0, 1, 4]))
    assert rp.kind == "pcie" and rp.rate == 10.0
    _check_rings_fit(rp)


def test_ring_counts_bounded_by_degree_on_every_allocation():
    for topo in (DGX1V, DGX1P):
        for k in range(3, 9):
            for a in itertools.combinations(range(8), k):
                sub = topo.subset(a)
                if not sub.is_connected():
                    continue
                rp = rings(sub)
                if rp.kind == "nvlink":
                    _check_rings_fit(rp)
                    assert rp.num_rings <= min(_nvlink_degree(sub, u) for u in a)
                else:
                    # No NVLink ring exists: check with networkx on the simple graph.
                    assert rp.kind == "pcie"
                    assert not _has_hamiltonian_cycle(sub.simple_graph())


def _has_hamiltonian_cycle(g: nx.DiGraph) -> bool:
    nodes = sorted(g.nodes)
    first, rest = nodes[0], nodes[1:]
    for perm in itertools.permutations(rest):
        cyc = (first, *perm, first)
        if all(g.has_edge(cyc[i], cyc[i + 1]) for i in range(len(cyc) - 1)):
            return True
    return False


def test_uniform_meshes():
    rp = rings(Topology.host(8))
    assert rp.kind == "mesh" and rp.rate == pytest.approx(70.0)
    rp = rings(Topology.preset("dgx2"))
    assert rp.rate == pytest.approx(150.0)
    assert rings(Topology.host(1)).num_rings == 0


# ------------------------------------------------------------------------------------ model
def _path_plan(topo: Topology, path: list[int], w: float, collective: str = "broadcast"):
    t = nx.DiGraph()
    t.add_nodes_from(path)
    t.add_edges_from(zip(path, path[1:]))
    return SimpleNamespace(trees=((t, w),), topology=topo, rate=w, bound=w, root=path[0],
                           collective=collective)


def test_tree_formula_by_hand():
    topo = DGX1V.subset([0, 3, 2])
    p = _path_plan(topo, [0, 3, 2], 50.0)  # depth 2, NVLink alpha
    a = MODEL["alpha_us"]["nvlink"]
    S, c = 1e6, 1e5  # 10 chunks
    expect = (2 + 10 - 1) * (a + c / (50.0 * 1e3))
    assert time_us(p, "broadcast", S, chunk_bytes=c) == pytest.approx(expect)
    expect_ar = (4 + 10 - 1) * (a + c / (50.0 * 1e3))
    assert time_us(p, "allreduce", S, chunk_bytes=c) == pytest.approx(expect_ar)
    # The best chunk is no worse than any fixed one.
    assert time_us(p, "broadcast", S) <= time_us(p, "broadcast", S, chunk_bytes=c) + 1e-9


def test_ring_allreduce_is_nccl_formula():
    rp = rings(DGX1V)
    n, a, B, S = 8, MODEL["alpha_us"]["nvlink"], 150.0, 256e6
    assert time_us(rp, "allreduce", S) == pytest.approx(2 * (n - 1) * a + 2 * (n - 1) / n * S / (B * 1e3))


@pytest.mark.parametrize("collective", ["broadcast", "reduce", "allreduce"])
def test_time_grows_with_size_and_tends_to_algbw(collective):
    rp = rings(DGX1V.subset([0, 1, 2, 3]))
    p = _path_plan(DGX1V.subset([0, 3, 2]), [0, 3, 2], 50.0)
    for obj in (rp, p):
        ts = [time_us(obj, collective, s) for s in (1e3, 1e5, 1e7, 1e9)]
        assert all(x < y for x, y in zip(ts, ts[1:]))
        S = 1e11
        assert S / (time_us(obj, collective, S) * 1e3) == pytest.approx(algbw(obj, collective), rel=0.01)
    assert time_us(rp, collective, 0) == 0.0


def test_bad_input():
    with pytest.raises(ValueError, match="collective"):
        time_us(rings(DGX1V), "gather", 1e6)
    with pytest.raises(ValueError):
        best_time(rings(DGX1V), "broadcast", 1e6, chunk_bytes=0)
    with pytest.raises(TypeError):
        time_us(object(), "broadcast", 1e6)


# ------------------------------------------------------------------------------ with plans
@pytest.mark.parametrize("collective", ["broadcast", "allreduce"])
def test_trees_never_slower_than_rings_on_dgx1v(collective):
    plan = _planner()
    for k in range(3, 9):
        for a in itertools.combinations(range(8), k):
            sub = DGX1V.subset(a)
            if not sub.is_connected():
                continue
            root = None if collective == "allreduce" else a[0]
            p = plan(sub, collective, root)
            # The planner promises >= 99% of the cut bound, and the bound is >= what rings reach.
            assert algbw(p, collective) >= algbw(rings(sub), collective) * 0.99, a


def test_paper_examples_speedup():
    plan = _planner()
    # {0,1,4}: no NVLink ring, NCCL on PCIe; Blink's tree 1-0-4 runs at 25 GB/s.
    sub = DGX1V.subset([0, 1, 4])
    for collective in ("broadcast", "allreduce"):
        c = compare(sub, collective, 500e6, root=None if collective == "allreduce" else 0,
                    plan=plan(sub, collective, None if collective == "allreduce" else 0))
        assert c["ring_kind"] == "pcie"
        assert c["tree_rate"] == pytest.approx(25.0, rel=0.01)
        assert c["speedup"] > 2 and c["rate_speedup"] > 2
        assert c["tree_time_us"] < c["ring_time_us"]
    # All 8 GPUs: both reach the link limit, no speedup at the rate level (as in the paper).
    c = compare(DGX1V, "broadcast", 500e6, plan=plan(DGX1V, "broadcast", 0))
    assert c["tree_rate"] == pytest.approx(150.0, rel=0.01)
    assert c["rate_speedup"] == pytest.approx(1.0, rel=0.01)
    c = compare(DGX1V, "allreduce", 500e6, plan=plan(DGX1V, "allreduce"))
    assert c["tree_algbw"] == pytest.approx(600 / 7, rel=0.01)
    assert c["ring_algbw"] == pytest.approx(150 * 8 / 14, rel=1e-6)
    assert set(c) >= {"num_trees", "ring_rate", "speedup", "tree_time_us", "ring_time_us"}
    assert math.isfinite(c["speedup"])


def test_one_ring_formula_for_the_baseline_and_the_planner():
    """The NCCL baseline's all-reduce time is ring_allreduce_us on its rings, the closed form
    2(n-1) alpha + 2(n-1)/n S / B; the planner's ring form calls the same function."""
    from jax_blink.planning import forms, model

    rp = rings(DGX1V)
    S = 4 << 20
    t = simulate.ring_allreduce_us(rp.n, rp.rates, rp.alphas, S)
    assert time_us(rp, "allreduce", S) == t
    bpu = MODEL["bytes_per_us_per_gbps"]
    assert t == pytest.approx(2 * 7 * 1.5 + 2 * 7 / 8 * S / (rp.rate * bpu))
    assert simulate.ring_allreduce_us is model.ring_allreduce_us
    assert {f.name: f.time_us for f in forms.forms_at(DGX1V, S)}["rings"] == pytest.approx(t, rel=1e-12)
    assert simulate.ring_allreduce_us(1, (10.0,), (1.0,), S) == 0.0
