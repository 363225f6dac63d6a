"""Topology: presets, user links, subsets, errors, and NVML discovery against a fake pynvml."""
import sys
import types
import warnings

import networkx as nx
import numpy as np
import pytest

from jax_blink.planning import topology as topo_mod
from jax_blink.planning.topology import LINK_LATENCY_US, NVLINK_GBPS, Topology

DGX1V_DOUBLE = [(0, 3), (0, 4), (1, 2), (1, 5), (2, 3), (4, 7), (5, 6), (6, 7)]
DGX1V_SINGLE = [(0, 1), (0, 2), (1, 3), (2, 6), (3, 7), (4, 5), (4, 6), (5, 7)]


# ---------------------------------------------------------------- presets
def test_dgx1v_links_and_capacities():
    t = Topology.preset("dgx1v")
    assert t.devices == tuple(range(8)) and t.n == 8 and t.name == "dgx1v"
    assert t.graph.number_of_edges() == 2 * (2 * 8 + 8)  # one edge per physical link and direction
    for i, j in DGX1V_DOUBLE:
        assert t.capacity(i, j) == t.capacity(j, i) == 50.0
        assert t.graph.number_of_edges(i, j) == 2
    for i, j in DGX1V_SINGLE:
        assert t.capacity(i, j) == t.capacity(j, i) == 25.0
    linked = set(DGX1V_DOUBLE + DGX1V_SINGLE)
    for i in range(8):
        for j in range(i + 1, 8):
            if (i, j) not in linked:
                assert t.capacity(i, j) == 0.0
    for _, _, d in t.graph.edges(data=True):
        assert d["kind"] == "nvlink" and d["latency_us"] == LINK_LATENCY_US["nvlink"]
    assert t.is_connected()


def test_dgx1p_links():
    t = Topology.preset("dgx1p")
    s = t.simple_graph()
    assert s.number_of_edges() == 2 * 16
    assert all(d["capacity"] == 20.0 for _, _, d in s.edges(data=True))
    assert t.capacity(0, 4) == 20.0 and t.capacity(1, 2) == 20.0 and t.capacity(0, 5) == 0.0


def test_nvswitch_presets_are_uniform_meshes():
    t = Topology.preset("dgx2")
    assert t.n == 16 and t.kinds() == ("switch",)
    assert all(t.capacity(u, v) == pytest.approx(150 / 15) for u in range(16) for v in range(16) if u != v)
    h = Topology.preset("nvswitch:4")
    assert h.capacity(0, 3) == pytest.approx(18 * NVLINK_GBPS[4] / 3)
    assert Topology.preset("nvswitch:2").capacity(1, 0) == pytest.approx(18 * 26.6)


def test_pcie_option_connects_nvlink_gaps():
    t = Topology.preset("dgx1v", pcie=True)
    assert t.capacity(0, 5) == 10.0
    kinds = {d["kind"] for d in t.graph.get_edge_data(0, 5).values()}
    assert kinds == {"pcie"}
    assert t.capacity(0, 3) == 50.0  # NVLink pairs keep NVLink only
    assert not Topology.preset("dgx1v").subset([0, 5]).is_connected()
    assert t.subset([0, 5]).is_connected()


@pytest.mark.parametrize("bad", ["dgx3", "nvswitch", "nvswitch:1", "nvswitch:x", ""])
def test_unknown_preset(bad):
    with pytest.raises(ValueError, match="preset"):
        Topology.preset(bad)


def test_pcie_only_for_dgx1():
    with pytest.raises(ValueError, match="pcie"):
        Topology.preset("dgx2", pcie=True)


# ---------------------------------------------------------------- user links
def test_from_links_symmetric_and_directed():
    t = Topology.from_links({(0, 1): 10, (1, 2): 5, (2, 1): 7})
    assert t.devices == (0, 1, 2)
    assert t.capacity(0, 1) == t.capacity(1, 0) == 10
    assert t.capacity(1, 2) == 5 and t.capacity(2, 1) == 7
    assert t.capacity(0, 2) == 0


def test_from_links_matrix():
    m = np.array([[0, 3, 0], [3, 0, 1.5], [0, 2, 0]])
    for links in (m, m.tolist()):
        t = Topology.from_links(links, kind="pcie", devices=[4, 5, 6])
        assert t.devices == (4, 5, 6)
        assert t.capacity(4, 5) == 3 and t.capacity(5, 6) == 1.5 and t.capacity(6, 5) == 2
        assert t.capacity(4, 6) == 0 and t.kinds() == ("pcie",)


@pytest.mark.parametrize("links, match", [
    ({(0, 0): 1}, "self loop"),
    ({(0, 1): 0}, "> 0"),
    ({(0, 1): -3}, "> 0"),
    ({(0, 1): float("nan")}, "> 0"),
    ({(0, -1): 1}, "non-negative"),
    ([[1, 1], [1, 0]], "self loop"),
    ([[0, -1], [1, 0]], ">= 0"),
    ([[0, 1, 0], [1, 0]], "square"),
])
def test_from_links_errors(links, match):
    with pytest.raises(ValueError, match=match):
        Topology.from_links(links)


def test_from_links_unknown_device_and_kind():
    with pytest.raises(ValueError, match="not one of the devices"):
        Topology.from_links({(0, 5): 1}, devices=[0, 1])
    with pytest.raises(ValueError, match="kind"):
        Topology.from_links({(0, 1): 1}, kind="ethernet")
    with pytest.raises(ValueError, match="duplicate"):
        Topology.from_links({(0, 1): 1}, devices=[0, 1, 1])


def test_isolated_device_is_disconnected():
    t = Topology.from_links({(0, 1): 1}, devices=[0, 1, 2])
    assert not t.is_connected()
    assert t.components() == [(0, 1), (2,)]


# ---------------------------------------------------------------- subset, key, immutability
def test_subset_keeps_ids_order_and_links():
    t = Topology.preset("dgx1v").subset([4, 0, 1])
    assert t.devices == (4, 0, 1) and t.rank_of(4) == 0 and t.rank_of(1) == 2
    assert set(t.graph.nodes) == {0, 1, 4}
    assert t.capacity(0, 4) == 50 and t.capacity(1, 4) == 0
    assert t.name == "dgx1v[4,0,1]"
    with pytest.raises(ValueError, match="not in topology"):
        t.rank_of(7)


@pytest.mark.parametrize("ids, match", [([0, 9], "not in topology"), ([1, 1], "duplicate"),
                                        ([], "at least one"), ([-1], "non-negative")])
def test_subset_errors(ids, match):
    with pytest.raises(ValueError, match=match):
        Topology.preset("dgx1v").subset(ids)


def test_key_equality_and_hash():
    a = Topology.preset("dgx1p").subset([0, 1])
    b = Topology.from_links({(0, 1): 20.0}, name="other")
    assert a.key() == b.key() and a == b and hash(a) == hash(b)
    assert Topology.preset("dgx1p").subset([1, 0]) != a  # device order matters (ranks)
    assert Topology.preset("dgx1v") != Topology.preset("dgx1p")


def test_graph_is_frozen():
    t = Topology.preset("dgx1v")
    with pytest.raises(nx.NetworkXError):
        t.graph.add_edge(0, 5)
    with pytest.raises(nx.NetworkXError):
        t.simple_graph().add_edge(0, 5)
    s = t.simple_graph()
    assert s[0][3]["capacity"] == 50 and not s.has_edge(0, 5)


def test_describe_and_repr():
    t = Topology.preset("dgx1v").subset([0, 1, 4])
    text = t.describe()
    assert "0 <-> 4" in text and "x2" in text and "50 GB/s" in text
    assert "dgx1v[0,1,4]" in repr(t)


def test_host_mesh():
    t = Topology.host(4)
    assert t.kinds() == ("host",) and t.capacity(0, 3) == topo_mod.HOST_GBPS
    assert Topology.host(2, devices=[7, 9]).devices == (7, 9)
    with pytest.raises(ValueError):
        Topology.host(0)


# ---------------------------------------------------------------- discovery
class _Dev:
    def __init__(self, id, platform="cpu", pci_bus_id=None, local_hardware_id=None):
        self.id = id
        self.platform = platform
        if pci_bus_id is not None:
            self.pci_bus_id = pci_bus_id
        self.local_hardware_id = id if local_hardware_id is None else local_hardware_id


def test_discover_cpu_devices():
    t = Topology.discover([_Dev(3), _Dev(5)])
    assert t.devices == (3, 5) and t.kinds() == ("host",)


def test_discover_default_jax_devices():
    import jax

    t = Topology.discover()
    assert t.devices == tuple(d.id for d in jax.devices())


class FakeNVML(types.SimpleNamespace):
    """A pynvml stand-in: GPUs with PCI bus ids, NVLinks to remote bus ids, PCIe gen/width."""

    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 18

    class NVMLError(Exception):
        pass

    def __init__(self, buses, nvlinks, version=2, pcie=(3, 16)):
        super().__init__()
        self.buses = buses  # index -> bus id
        self.nvlinks = nvlinks  # index -> list of remote bus ids, one per active link
        self.version = version
        self.pcie = pcie
        self.calls = []

    def nvmlInit(self):
        self.calls.append("init")

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self):
        return len(self.buses)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetHandleByPciBusId(self, bus):
        return [b.lower() for b in self.buses].index(bus.lower())

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return int(uuid.split("-")[-1])

    def nvmlDeviceGetPciInfo(self, h):
        return types.SimpleNamespace(busId=self.buses[h].encode())

    def nvmlDeviceGetNvLinkState(self, h, link):
        if link >= len(self.nvlinks[h]):
            raise self.NVMLError("not supported")
        return 1

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return types.SimpleNamespace(busId=self.nvlinks[h][link])

    def nvmlDeviceGetNvLinkVersion(self, h, link):
        return self.version

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return self.pcie[0]

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return self.pcie[1]

    def nvmlDeviceGetName(self, h):
        return b"Tesla V100"


def _bus(i):
    return f"00000000:{16 + i:02X}:00.0"


def _dgx1v_fake():
    nv = {i: [] for i in range(8)}
    for (i, j), k in [((i, j), 2) for i, j in DGX1V_DOUBLE] + [((i, j), 1) for i, j in DGX1V_SINGLE]:
        nv[i] += [_bus(j)] * k
        nv[j] += [_bus(i)] * k
    return FakeNVML([_bus(i) for i in range(8)], nv)


def test_nvml_dgx1v_matches_preset_plus_pcie():
    fake = _dgx1v_fake()
    locs = [{"pci_bus_id": _bus(i).lower()} for i in range(8)]
    t = topo_mod._topology_from_nvml(fake, locs, list(range(8)))
    ref = Topology.preset("dgx1v")
    for u in range(8):
        for v in range(8):
            if u != v and ref.capacity(u, v):
                assert t.capacity(u, v) == ref.capacity(u, v)
                assert t.graph.number_of_edges(u, v) == ref.graph.number_of_edges(u, v)
    # no NVLink between 0 and 5: PCIe gen3 x16 from NVML
    assert t.capacity(0, 5) == pytest.approx(0.985 * 16)
    assert {d["kind"] for d in t.graph.get_edge_data(0, 5).values()} == {"pcie"}
    assert fake.calls == ["init", "shutdown"]


def test_nvml_subset_by_ordinal_and_visible_devices():
    fake = _dgx1v_fake()
    # CUDA_VISIBLE_DEVICES=4,0: CUDA ordinal 0 is NVML index 4, ordinal 1 is index 0
    locs = [{"ordinal": 0}, {"ordinal": 1}]
    t = topo_mod._topology_from_nvml(fake, locs, [0, 1], visible="4,0")
    assert t.capacity(0, 1) == 50.0  # GPUs 4 and 0: double NVLink
    t = topo_mod._topology_from_nvml(fake, locs, [0, 1], visible="GPU-x-5,GPU-x-6")
    assert t.capacity(0, 1) == 50.0  # GPUs 5 and 6


def test_nvml_nvswitch_makes_switch_mesh():
    switch_bus = "00000000:C0:00.0"
    fake = FakeNVML([_bus(i) for i in range(4)], {i: [switch_bus] * 18 for i in range(4)}, version=4)
    t = topo_mod._topology_from_nvml(fake, [{"ordinal": i} for i in range(4)], [0, 1, 2, 3], visible="")
    assert t.kinds() == ("switch",)
    assert t.capacity(0, 3) == pytest.approx(18 * NVLINK_GBPS[4] / 3)


def test_discover_gpus_through_fake_pynvml(monkeypatch):
    fake = _dgx1v_fake()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    devs = [_Dev(i, "gpu", pci_bus_id=_bus(j)) for i, j in enumerate([0, 3, 7])]
    t = Topology.discover(devs)
    assert t.devices == (0, 1, 2)
    assert t.capacity(0, 1) == 50.0 and t.capacity(1, 2) == 25.0  # GPUs 0-3 x2, 3-7 x1
    assert t.capacity(0, 2) == pytest.approx(0.985 * 16)


def test_discover_falls_back_without_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    monkeypatch.setattr(topo_mod, "_WARNED", set())
    devs = [_Dev(i, "gpu") for i in range(3)]
    with pytest.warns(RuntimeWarning, match="NVML"):
        t = Topology.discover(devs)
    assert t.kinds() == ("pcie",) and t.capacity(0, 2) == topo_mod.PCIE_GBPS
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second time: no warning
        Topology.discover(devs)


# ---------------------------------------------------------------- host links (Blink's second channel)

def _pair(host=None):
    return Topology([0, 1], [(0, 1, 478.8, "nvlink"), (1, 0, 478.8, "nvlink")], "pair", host_links=host)


def test_host_links_are_validated_kept_and_keyed():
    t = _pair({0: 63.0, 1: 50.0})
    assert t.host_links == {0: 63.0, 1: 50.0}
    t.host_links[0] = 1.0  # a copy: the topology stays immutable
    assert t.host_links[0] == 63.0
    assert t != _pair() and t.key() != _pair().key() and t == _pair({1: 50.0, 0: 63.0})
    assert "host (pinned memory, PCIe): 0: 63 GB/s, 1: 50 GB/s" in t.describe()
    assert "host" not in _pair().describe().splitlines()[-1]
    with pytest.raises(ValueError, match="host link of device 7"):
        _pair({7: 10.0})
    with pytest.raises(ValueError, match="finite number of GB/s > 0"):
        _pair({0: 0.0})
    big = Topology.preset("dgx1v")
    big = Topology(big.devices, [(u, v, d["capacity"], d["kind"]) for u, v, d in big.graph.edges(data=True)],
                   "dgx1v", host_links={i: 15.0 + i for i in range(8)})
    assert big.subset([5, 2]).host_links == {5: 20.0, 2: 17.0}


def test_nvml_discovery_fills_host_links():
    fake = _dgx1v_fake()
    t = topo_mod._topology_from_nvml(fake, [{"pci_bus_id": _bus(i).lower()} for i in range(8)], list(range(8)))
    assert t.host_links == {i: pytest.approx(0.985 * 16) for i in range(8)}
    switch_bus = "00000000:C0:00.0"
    fake = FakeNVML([_bus(i) for i in range(2)], {i: [switch_bus] * 18 for i in range(2)}, version=4, pcie=(5, 16))
    t = topo_mod._topology_from_nvml(fake, [{"ordinal": i} for i in range(2)], [3, 4], visible="")
    assert t.host_links == {3: pytest.approx(3.938 * 16), 4: pytest.approx(3.938 * 16)}


def test_host_path_gbps():
    t = _pair({0: 63.0, 1: 31.5})
    assert topo_mod.host_path_gbps(t, 0, 1, "sm") == pytest.approx(31.5 * topo_mod.HOST_PATH_EFFICIENCY["sm"])
    assert topo_mod.host_path_gbps(t, 0, 0) == 0.0
    assert topo_mod.host_path_gbps(_pair({0: 63.0}), 0, 1) == 0.0  # device 1's link unknown
    # gen5 x16 gives what the executor's host channel moved per direction on 2 x H200: 38 GB/s on
    # copy engines, 28 by SMs (the default engine)
    gen5 = _pair({0: 3.938 * 16, 1: 3.938 * 16})
    assert topo_mod.host_path_gbps(gen5, 1, 0, "ce") == pytest.approx(38.0)
    assert topo_mod.host_path_gbps(gen5, 1, 0, "sm") == pytest.approx(28.0)
    assert topo_mod.host_path_gbps(gen5, 1, 0) == pytest.approx(28.0)
    with pytest.raises(ValueError, match="device 9"):
        topo_mod.host_path_gbps(t, 0, 9)
