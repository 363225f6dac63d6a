"""The three-phase layer without processes: host layouts, explain(), the cost model, the options.

The three phases themselves run in jobs of several processes: tests/multiprocess/test_multiprocess.py.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from jax_blink.lowering import processes as distributed
from jax_blink.lowering import hierarchy
from jax_blink.tools import simulate  # noqa: E402
from jax_blink.api.explain import explain  # noqa: E402
from jax_blink.planning.topology import Topology  # noqa: E402


def _fake_devices(procs_per_rank, groups=1):
    n = len(procs_per_rank)
    return np.array([[SimpleNamespace(process_index=p, id=g * 100 + r) for r, p in enumerate(procs_per_rank)]
                     for g in range(groups)], dtype=object).reshape(groups, n)


@pytest.fixture
def two_processes(monkeypatch):
    monkeypatch.setattr(hierarchy.jax, "process_count", lambda: 2)
    yield monkeypatch
    distributed.set_processes_per_host(None)


def test_layout_of_host_local_axes(two_processes):
    # 2 hosts (one process each) x 3 ranks, host-major as a ("host", "local") mesh lays them out.
    two_processes.setattr(distributed, "rank_devices", lambda axes: _fake_devices([0, 0, 0, 1, 1, 1], groups=2))
    distributed.set_processes_per_host(1)
    lay = hierarchy.layout(("host", "local"))
    assert (lay.hosts, lay.local) == (2, 3)
    assert lay.host == (0, 0, 0, 1, 1, 1) * 2 and lay.local_index == (0, 1, 2) * 4
    assert lay.rank_of == ((0, 1, 2), (3, 4, 5)) and lay.host_axis == "host"
    # the executor's tables for the sub-communicators, [(g * hosts + h) * local + l]
    assert lay.sub_device == (0, 1, 2, 3, 4, 5, 100, 101, 102, 103, 104, 105)


def test_layout_of_a_single_axis_interleaved_over_hosts(two_processes):
    # ranks alternate between the hosts: no host axis, ppermute rounds between them
    two_processes.setattr(distributed, "rank_devices", lambda axes: _fake_devices([0, 1, 0, 1]))
    distributed.set_processes_per_host(1)
    lay = hierarchy.layout(("x",))
    assert lay.rank_of == ((0, 2), (1, 3)) and lay.host_axis is None
    assert lay.host == (0, 1, 0, 1) and lay.local_index == (0, 0, 1, 1)


def test_layout_groups_processes_into_hosts_and_needs_equal_hosts(two_processes):
    two_processes.setattr(distributed, "rank_devices", lambda axes: _fake_devices([0, 1, 2, 3]))
    distributed.set_processes_per_host(4)
    assert hierarchy.layout(("x",)) is None  # one host: flat
    distributed.set_processes_per_host(2)
    assert hierarchy.layout(("x",)).rank_of == ((0, 1), (2, 3))
    two_processes.setattr(distributed, "rank_devices", lambda axes: _fake_devices([0, 0, 0, 1]))
    distributed.set_processes_per_host(1)
    with pytest.raises(ValueError, match="different numbers of ranks"):
        hierarchy.layout(("x",))


def test_processes_per_host_and_setup_budget_from_the_environment(monkeypatch):
    monkeypatch.setenv("JAX_BLINK_PROCESSES_PER_HOST", "4")
    assert distributed.processes_per_host() == 4
    monkeypatch.setenv("JAX_BLINK_PROCESSES_PER_HOST", "zero")
    with pytest.raises(ValueError, match="JAX_BLINK_PROCESSES_PER_HOST"):
        distributed.processes_per_host()
    with pytest.raises(ValueError, match="positive int"):
        distributed.set_processes_per_host(0)
    monkeypatch.setenv("JAX_BLINK_SETUP_TIMEOUT_S", "2.5")
    assert distributed.setup_timeout_s() == 2.5
    monkeypatch.setenv("JAX_BLINK_SETUP_TIMEOUT_S", "-1")
    with pytest.raises(ValueError, match="JAX_BLINK_SETUP_TIMEOUT_S"):
        distributed.setup_timeout_s()


def test_one_process_per_group():
    assert distributed.one_process_per_group(np.array([0, 0, 1, 1], np.int32), 2)
    assert not distributed.one_process_per_group(np.array([0, 1, 0, 1], np.int32), 2)
    assert not distributed.one_process_per_group(np.array([-1, -1], np.int32), 2)  # unknown


def test_explain_shows_the_phases_and_their_bytes():
    topo = Topology.preset("dgx1v")
    nbytes, hosts = 1 << 24, 4
    text = explain(topo, nbytes, hosts=hosts)
    piece = nbytes // 8
    assert f"three phases over {hosts} hosts x 8 ranks" in text
    assert f"8 pieces of {piece} bytes" in text
    assert f"{2 * (hosts - 1) / hosts * piece:.0f} bytes sent per rank over the network" in text
    assert f"{nbytes * 7 / 8:.0f} bytes sent per rank" in text
    assert "segment k goes through the reduce trees rooted at rank k" in text  # the inside
    assert "no three-phase form" in explain(topo, nbytes, "broadcast", hosts=hosts)


def test_explain_shows_the_phases_of_reduce_scatter_and_all_gather():
    topo = Topology.preset("dgx1v")
    nbytes, hosts = 1 << 20, 4
    rs = explain(topo, nbytes, "reducescatter", hosts=hosts)
    assert f"two phases over {hosts} hosts x 8 ranks ({nbytes} bytes per rank in, {nbytes // 32} out)" in rs
    assert f"8 pieces of {nbytes // 8} bytes ({hosts} blocks each" in rs
    assert f"{nbytes * 7 / 8:.0f} bytes sent per rank" in rs
    assert f"{(hosts - 1) / hosts * nbytes / 8:.0f} bytes sent per rank over the network" in rs
    assert "segment k goes through the reduce trees rooted at rank k" in rs  # the inside
    ag = explain(topo, nbytes, "allgather", hosts=hosts)
    assert f"{(hosts - 1) * nbytes} bytes sent per rank over the network" in ag
    assert f"8 segments of {hosts * nbytes} bytes, {7 * hosts * nbytes} bytes sent per rank" in ag
    assert f"allgather of {hosts * nbytes} bytes per rank over 8 ranks" in ag  # the inside
    with pytest.raises(ValueError, match="no three-phase form"):
        hierarchy.explain_phases(topo, hosts, nbytes, collective="broadcast")


def test_problem_names_what_cannot_run_in_phases(two_processes):
    distributed.set_processes_per_host(1)
    two_processes.setattr(distributed, "rank_devices", lambda axes: _fake_devices([0, 0, 1, 1], groups=2))
    lay = hierarchy.layout(("x",))
    assert hierarchy.problem(lay, "cpu") is None and hierarchy.problem(lay, "gpu") is None
    # one process per device, two processes per host: on GPUs the inside phases cannot run
    two_processes.setattr(distributed, "rank_devices", lambda axes: _fake_devices([0, 1, 2, 3]))
    distributed.set_processes_per_host(2)
    lay = hierarchy.layout(("x",))
    assert hierarchy.problem(lay, "cpu") is None
    assert "one process per GPU" in hierarchy.problem(lay, "gpu")
    # the second group's ranks alternate between the hosts, the first group's do not
    devs = np.concatenate([_fake_devices([0, 0, 1, 1]), _fake_devices([0, 1, 0, 1])])
    two_processes.setattr(distributed, "rank_devices", lambda axes: devs)
    distributed.set_processes_per_host(1)
    assert "differs between groups" in hierarchy.problem(hierarchy.layout(("x",)), "cpu")


def test_cost_model_against_its_formulas():
    topo = Topology.preset("dgx1v")
    from jax_blink.planning.packing import plan

    S, H, B = float(1 << 28), 4, 50.0
    t = simulate.model_times_us(H, B, S, topo)
    bpu = simulate.MODEL["bytes_per_us_per_gbps"]
    inter = 2 * (H - 1) * (hierarchy.NET_ALPHA_US + S / 8 / (H * B * bpu))
    assert t["blink_3phase"] == pytest.approx(simulate.time_us(plan(topo, "allreduce"), "allreduce", S) + inter)
    rp = simulate.rings(topo)
    assert t["nccl_hier_rings"] == pytest.approx(2 * 7 * (simulate.MODEL["alpha_us"]["nvlink"] + S / (8 * rp.rate * bpu)) + inter)
    N = 8 * H
    assert t["flat_ring"] == pytest.approx(2 * (N - 1) * (hierarchy.NET_ALPHA_US + S / (N * rp.num_rings * min(min(rp.rates), B) * bpu)))
    # more hosts, slower; a faster network, faster
    assert simulate.model_times_us(8, B, S, topo)["blink_3phase"] > t["blink_3phase"]
    assert simulate.model_times_us(H, 100.0, S, topo)["blink_3phase"] < t["blink_3phase"]
    assert math.isfinite(simulate.model_times_us(1, B, S, topo)["flat_ring"])


def test_which_collectives_run_in_phases(two_processes):
    """The lowering's dispatch across hosts: phases where they can run; lax without a word where
    every host holds one rank (nothing for the executor); else lax with the fall-back's message."""
    from jax_blink import config
    from jax_blink.lowering import decision

    two_processes.setattr(distributed, "has_client", lambda: True)
    two_processes.setattr(decision, "_warned", set())
    two_processes.setattr(config, "fallback", "raise")
    distributed.set_processes_per_host(1)
    two_processes.setattr(distributed, "rank_devices", lambda axes: _fake_devices([0, 0, 1, 1]))
    lay, to_lax = decision.three_phases("reduce_scatter", ("x",))
    assert (lay.hosts, lay.local, to_lax) == (2, 2, False)
    two_processes.setattr(distributed, "rank_devices", lambda axes: _fake_devices([0, 1]))
    assert decision.three_phases("all_gather", ("x",)) == (None, True)  # no error with raise
    two_processes.setattr(distributed, "rank_devices", lambda axes: _fake_devices([0, 1, 2, 3]))
    distributed.set_processes_per_host(2)
    two_processes.setattr(decision, "current_platform", lambda: "gpu")
    with pytest.raises(RuntimeError, match="all_gather across hosts: .*one process per GPU.*cannot run on jax_blink"):
        decision.three_phases("all_gather", ("x",))
    two_processes.setattr(config, "fallback", "warn")
    with pytest.warns(RuntimeWarning, match="reduce_scatter across hosts: .*one process per GPU"):
        assert decision.three_phases("reduce_scatter", ("x",)) == (None, True)
