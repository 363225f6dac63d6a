"""Topology: the devices of one mesh axis and the links between them.

A :class:`Topology` is an immutable directed multigraph (``networkx.MultiDiGraph``) whose nodes are
device ids and whose edges are physical links, one edge per link and direction, each with

* ``capacity``: GB/s that the link carries in that direction,
* ``kind``: one of ``"nvlink"``, ``"pcie"``, ``"host"``, ``"switch"``,
* ``latency_us``: the latency of one hop over a link of that kind (:data:`LINK_LATENCY_US`).

Topologies come from presets (:meth:`Topology.preset`), from the user (:meth:`Topology.from_links`),
from CPU host devices (:meth:`Topology.host`) or from NVML (:meth:`Topology.discover`); a partial
allocation is :meth:`Topology.subset`. The planners in :mod:`jax_blink.planning.packing` read
:meth:`Topology.simple_graph` (parallel links summed).

All numbers live in the module constants below, so that the models can be read in one place.
"""

from __future__ import annotations

import math
import operator
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import networkx as nx

__all__ = [
    "Topology",
    "LINK_KINDS",
    "LINK_LATENCY_US",
    "NVLINK_GBPS",
    "PCIE_GBPS",
    "HOST_GBPS",
    "HOST_PATH_EFFICIENCY",
    "DEFAULT_HOST_ENGINE",
    "NVLINK_EFFICIENCY",
    "SWITCH_EFFICIENCY",
    "SWITCH_MEASURED_BUSBW_GBPS",
    "measured_efficiency",
]

LINK_KINDS = ("nvlink", "pcie", "host", "switch")

#: One-hop latency per link kind, in microseconds (alpha of the alpha-beta model). NVLink and the
#: NVSwitch fabric: a peer store becomes visible in about 1-2 us; PCIe through a PLX switch or the
#: CPU root complex: ~5 us; "host" (CPU host devices exchanging through shared memory in one
#: process, with a thread rendezvous per step): ~10 us.
LINK_LATENCY_US: dict[str, float] = {"nvlink": 1.5, "switch": 2.0, "pcie": 5.0, "host": 10.0}

#: GB/s per NVLink per direction, by NVLink version (NVML's nvmlDeviceGetNvLinkVersion):
#: 1 = P100 (NVLink 1), 2 = V100 (NVLink 2), 3 = A100 (NVLink 3), 4 = H100/H200 (NVLink 4: 26.6
#: measured per link on the 2 x H200 machine, docs/DESIGN.md), 5 = B200 (NVLink 5).
NVLINK_GBPS: dict[int, float] = {1: 20.0, 2: 25.0, 3: 25.0, 4: 26.6, 5: 50.0}

#: Nominal PCIe GB/s per direction where NVML cannot say: gen4 x16 after protocol overhead.
PCIE_GBPS = 25.0

#: PCIe between DGX-1 GPUs without NVLink (``Topology.preset("dgx1v", pcie=True)``): gen3 x16
#: through PLX switches, about 10-12 GB/s measured; we take 10.
DGX1_PCIE_GBPS = 10.0

#: PCIe GB/s per lane per direction by PCIe generation (after 8b/10b or 128b/130b encoding).
PCIE_LANE_GBPS: dict[int, float] = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}

#: Of a GPU's PCIe link rate, what one GPU moves to another through pinned host memory per
#: direction, both directions at once, by the CUDA executor's host channel, per engine
#: (``JAX_BLINK_HOST_ENGINE``): ``"sm"`` the kernel's host blocks (SM stores into pinned memory,
#: SM loads from it; 16 blocks, 512 KiB chunks), 28 GB/s measured on the 2 x H200 machine (the
#: default); ``"ce"`` copy engines on side streams, 38 GB/s; against gen5 x16's 63 nominal
#: (benchmarks/results/hybrid-sweep-nvidia-h200-x2-2026-11-22-v0.4*.txt). Used by
#: :func:`host_path_gbps`, hence by the hybrid share of a plan.
HOST_PATH_EFFICIENCY: dict[str, float] = {"ce": 38.0 / (16 * 3.938), "sm": 28.0 / (16 * 3.938)}

#: The CUDA executor's host-channel engine when ``JAX_BLINK_HOST_ENGINE`` does not say.
DEFAULT_HOST_ENGINE = "sm"

#: Of the nominal NVLink rate, what SM-driven peer writes reach: 364 GB/s per direction with both
#: directions busy, measured on 2 x H200 (NV18), against 18 links x 26.6 GB/s nominal.
NVLINK_EFFICIENCY = 364.0 / (18 * NVLINK_GBPS[4])

#: What the links of an NVSwitch machine were measured to carry in an all-reduce, per GPU: the bus
#: bandwidth (busbw = algbw x 2(n-1)/n, on a switch what each GPU sends and receives per second) of
#: the best all-reduce measured there. Source: issue 27, 4 x H200 of one host (every pair NV18
#: through NVSwitch), jax 0.11.2, NCCL 2.28 under XLA, 2026-11-26, the bench's interleaved method at
#: 1 GiB float32: lax.psum 348.3 GB/s busbw (232.2 algbw), jax_blink's executor 294.7 (196.5 algbw);
#: NCCL through torch.distributed 338.7 at 256 MiB. Replace these three lines when a new measurement
#: lands (the demo and explain() quote them).
SWITCH_MEASURED_BUSBW_GBPS = 348.3
SWITCH_MEASURED_ON = ("4 x H200 (NV18 switch): lax.psum's all-reduce at 1 GiB float32, 348.3 GB/s busbw, "
                      "2026-11-26, issue 27")

#: Of the nominal NVSwitch rate per GPU (18 NVLink 4 links x 26.6 GB/s), what an all-reduce was
#: measured to reach (:data:`SWITCH_MEASURED_BUSBW_GBPS`): 0.73.
SWITCH_EFFICIENCY = SWITCH_MEASURED_BUSBW_GBPS / (18 * NVLINK_GBPS[4])


def measured_efficiency(topology: "Topology") -> tuple[float, str] | None:
    """``(fraction of the nominal rate reached, where it was measured)`` for a topology whose links
    are all NVSwitch (:data:`SWITCH_EFFICIENCY`) or all direct NVLink (:data:`NVLINK_EFFICIENCY`);
    None for others (PCIe, host devices: no measurement)."""
    kinds = set(topology.kinds())
    if kinds == {"switch"}:
        return SWITCH_EFFICIENCY, SWITCH_MEASURED_ON
    if kinds == {"nvlink"}:
        return NVLINK_EFFICIENCY, "2 x H200 (NV18): SM-driven peer writes, 364 GB/s per direction, 2026-11-22"
    return None


#: Nominal GB/s per direction between two CPU host devices of one process (memcpy through
#: shared memory). The planners only need the ratio between links, and a host mesh is uniform.
HOST_GBPS = 10.0

#: The DGX-1 NVLink wiring (nvidia-smi numbering): (i, j) -> number of links.
_DGX1V_LINKS = {
    (0, 3): 2, (0, 4): 2, (1, 2): 2, (1, 5): 2, (2, 3): 2, (4, 7): 2, (5, 6): 2, (6, 7): 2,
    (0, 1): 1, (0, 2): 1, (1, 3): 1, (2, 6): 1, (3, 7): 1, (4, 5): 1, (4, 6): 1, (5, 7): 1,
}
_DGX1P_LINKS = {
    **{(i, j): 1 for i in range(4) for j in range(i + 1, 4)},
    **{(i, j): 1 for i in range(4, 8) for j in range(i + 1, 8)},
    **{(i, i + 4): 1 for i in range(4)},
}

#: NVSwitch machines: (GPUs, GB/s per GPU per direction into the switch fabric).
_DGX2 = (16, 6 * NVLINK_GBPS[2])  # 16 V100, 6 NVLinks of 25 GB/s each
_HGX_H100_PER_GPU = 18 * NVLINK_GBPS[4]  # 18 NVLink 4 links per H100/H200

_PRESETS = ("dgx1p", "dgx1v", "dgx2", "nvswitch:N")


def _check_id(i: Any) -> int:
    """Return ``i`` as a device id (a non-negative int; numpy ints accepted) or raise ValueError."""
    try:
        if isinstance(i, bool):
            raise TypeError
        j = operator.index(i)
    except TypeError:
        raise ValueError(f"device ids must be non-negative integers, got {i!r}") from None
    if j < 0:
        raise ValueError(f"device ids must be non-negative integers, got {i!r}")
    return j


def _check_capacity(u: int, v: int, gbps: Any) -> float:
    """Return ``gbps`` as a float capacity for the link u->v, or raise ValueError."""
    try:
        c = float(gbps)
    except (TypeError, ValueError):
        raise ValueError(f"capacity of link {u}->{v} must be a number of GB/s, got {gbps!r}") from None
    if not math.isfinite(c) or c <= 0:
        raise ValueError(
            f"capacity of link {u}->{v} must be a finite number of GB/s > 0, got {gbps!r}"
        )
    return c


class Topology:
    """The devices of one mesh axis and their links, with per-direction capacity in GB/s.

    Immutable: the graph handed out by :attr:`graph` is frozen. Two topologies with the same
    devices (in the same order) and the same links compare equal and have the same :meth:`key`
    whatever their names, which is what plan caching keys on.

    Attributes:
        devices: device ids in mesh-axis order (rank ``i`` is ``devices[i]``).
        n: number of devices.
        name: a readable name (``"dgx1v"``, ``"dgx1v[0,1,4]"``, ``"custom"``...).
        graph: ``networkx.MultiDiGraph``: nodes are device ids, one edge per physical link and
            direction with attributes ``capacity`` (GB/s), ``kind`` and ``latency_us``.
        host_links: device id -> GB/s per direction between that GPU and pinned host memory (its
            PCIe link), for the devices where it is known (:meth:`discover` fills it). Not a
            link of the graph: trees never route through the host; it is the second channel of
            Blink's hybrid transfer (:func:`host_path_gbps`).
    """

    __slots__ = ("_devices", "_name", "_graph", "_key", "_simple", "_rank", "_host")

    def __init__(
        self,
        devices: Iterable[int],
        links: Iterable[tuple[int, int, float, str]],
        name: str = "custom",
        host_links: Mapping[int, float] | None = None,
    ) -> None:
        """Build a topology from device ids and directed links ``(u, v, gbps, kind)``.

        Each tuple is one physical link in one direction; repeat a tuple for parallel links.
        ``host_links`` maps device ids to their GB/s per direction to pinned host memory.
        Prefer the constructors :meth:`from_links`, :meth:`preset`, :meth:`host`, :meth:`discover`.

        Raises:
            ValueError: duplicate or negative device ids, a link to an unknown device, a self
                loop, a capacity that is not a finite number > 0, an unknown link kind, a host
                link of an unknown device or with such a capacity.
        """
        devs = tuple(_check_id(d) for d in devices)
        if len(set(devs)) != len(devs):
            dups = sorted({d for d in devs if devs.count(d) > 1})
            raise ValueError(f"duplicate device ids {dups} in {list(devs)}; each device once")
        g = nx.MultiDiGraph()
        g.add_nodes_from(devs)
        known = set(devs)
        for u, v, gbps, kind in links:
            u, v = _check_id(u), _check_id(v)
            if u == v:
                raise ValueError(f"self loop on device {u}: links must join two different devices")
            for x in (u, v):
                if x not in known:
                    raise ValueError(
                        f"link {u}->{v} names device {x}, which is not one of the devices {list(devs)}"
                    )
            if kind not in LINK_KINDS:
                raise ValueError(f"unknown link kind {kind!r}; allowed: {', '.join(LINK_KINDS)}")
            g.add_edge(u, v, capacity=_check_capacity(u, v, gbps), kind=kind,
                       latency_us=LINK_LATENCY_US[kind])
        host: dict[int, float] = {}
        for d, gbps in (host_links or {}).items():
            d = _check_id(d)
            if d not in known:
                raise ValueError(f"host link of device {d}, which is not one of the devices {list(devs)}")
            host[d] = _check_capacity(d, "host", gbps)
        self._devices = devs
        self._name = str(name)
        self._graph = nx.freeze(g)
        self._rank = {d: i for i, d in enumerate(devs)}
        self._host = host
        edges = sorted(
            (u, v, d["kind"], d["capacity"]) for u, v, d in g.edges(data=True)
        )
        self._key = (devs, tuple(edges), tuple(sorted(host.items())))
        self._simple: nx.DiGraph | None = None

    # ------------------------------------------------------------------ basic accessors
    @property
    def devices(self) -> tuple[int, ...]:
        """Device ids in mesh-axis order: rank ``i`` is ``devices[i]``."""
        return self._devices

    @property
    def n(self) -> int:
        """Number of devices."""
        return len(self._devices)

    @property
    def name(self) -> str:
        """Readable name of the topology."""
        return self._name

    @property
    def graph(self) -> nx.MultiDiGraph:
        """The frozen link multigraph (one edge per physical link and direction)."""
        return self._graph

    @property
    def host_links(self) -> dict[int, float]:
        """Device id -> GB/s per direction to pinned host memory, where known (a copy)."""
        return dict(self._host)

    def rank_of(self, device_id: int) -> int:
        """The mesh-axis rank of a device.

        Args:
            device_id: A device id of this topology.

        Returns:
            Its rank: the index of ``device_id`` in :attr:`devices`.

        Raises:
            ValueError: ``device_id`` is not a device of this topology.
        """
        try:
            return self._rank[device_id]
        except (KeyError, TypeError):
            raise ValueError(
                f"device {device_id!r} is not in topology {self._name}; devices: {list(self._devices)}"
            ) from None

    def capacity(self, u: int, v: int) -> float:
        """Total GB/s from ``u`` to ``v`` summed over parallel links (0.0 if there is no link)."""
        if u not in self._rank or v not in self._rank:
            raise ValueError(
                f"capacity({u!r}, {v!r}): both must be devices of {self._name}: {list(self._devices)}"
            )
        data = self._graph.get_edge_data(u, v)
        return float(sum(d["capacity"] for d in data.values())) if data else 0.0

    def simple_graph(self) -> nx.DiGraph:
        """A ``networkx.DiGraph`` with one edge u->v per linked ordered pair, ``capacity`` = sum.

        This is what the solvers read. The graph is frozen; copy it (``nx.DiGraph(g)``) to edit.
        """
        if self._simple is None:
            s = nx.DiGraph()
            s.add_nodes_from(self._devices)
            for u, v, d in self._graph.edges(data=True):
                if s.has_edge(u, v):
                    s[u][v]["capacity"] += d["capacity"]
                    s[u][v]["kinds"] = tuple(sorted(set(s[u][v]["kinds"]) | {d["kind"]}))
                else:
                    s.add_edge(u, v, capacity=d["capacity"], kinds=(d["kind"],))
            self._simple = nx.freeze(s)
        return self._simple

    def key(self) -> tuple:
        """A hashable key, equal for equal topologies (same device order, same links)."""
        return self._key

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Topology) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def is_connected(self) -> bool:
        """True when every device reaches every other device over links (strong connectivity)."""
        return self.n <= 1 or nx.is_strongly_connected(self.simple_graph())

    def components(self) -> list[tuple[int, ...]]:
        """Strongly connected components of the link graph, each sorted, largest first."""
        comps = [tuple(sorted(c)) for c in nx.strongly_connected_components(self.simple_graph())]
        return sorted(comps, key=lambda c: (-len(c), c))

    def kinds(self) -> tuple[str, ...]:
        """The link kinds present, sorted."""
        return tuple(sorted({d["kind"] for _, _, d in self._graph.edges(data=True)}))

    # ------------------------------------------------------------------ printing
    def describe(self) -> str:
        """A multi-line description: devices, then one line per linked pair (both directions)."""
        lines = [f"Topology {self._name}: {self.n} devices {list(self._devices)}, "
                 f"links: {', '.join(self.kinds()) or 'none'}"]
        s = self.simple_graph()
        seen = set()
        for u in self._devices:
            for v in self._devices:
                if (v, u) in seen or not (s.has_edge(u, v) or s.has_edge(v, u)):
                    continue
                seen.add((u, v))
                nuv = self._graph.number_of_edges(u, v)
                kinds = sorted({d["kind"] for d in (self._graph.get_edge_data(u, v) or {}).values()}
                               | {d["kind"] for d in (self._graph.get_edge_data(v, u) or {}).values()})
                cuv, cvu = self.capacity(u, v), self.capacity(v, u)
                caps = f"{cuv:g} GB/s" if cuv == cvu else f"{cuv:g} GB/s ->, {cvu:g} GB/s <-"
                links = f" x{nuv}" if nuv > 1 else ""
                lines.append(f"  {u:>3} <-> {v:<3} {'/'.join(kinds)}{links}: {caps}")
        if self._host:
            lines.append("  host (pinned memory, PCIe): "
                         + ", ".join(f"{d}: {g:g} GB/s" for d, g in sorted(self._host.items())))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"Topology({self._name!r}, devices={list(self._devices)}, "
                f"links={self._graph.number_of_edges()}, kinds={list(self.kinds())})")

    # ------------------------------------------------------------------ derived topologies
    def subset(self, ids: Iterable[int]) -> Topology:
        """The topology of the devices ``ids`` (a partial allocation), in the order given.

        Keeps the original device ids as node names and every link between two chosen devices.

        Args:
            ids: Device ids of this topology; their order is the new topology's rank order.

        Returns:
            The topology of those devices, named e.g. ``"dgx1v[0,1,4]"``.

        Raises:
            ValueError: an id that is not a device of this topology, a duplicate id, no ids.

        Example::

            >>> Topology.preset("dgx1v").subset([0, 1, 4]).name
            'dgx1v[0,1,4]'
        """
        ids = [_check_id(i) for i in ids]
        if not ids:
            raise ValueError(f"subset() needs at least one device of {list(self._devices)}")
        unknown = [i for i in ids if i not in self._rank]
        if unknown:
            raise ValueError(
                f"devices {unknown} are not in topology {self._name}; allowed: {list(self._devices)}"
            )
        if len(set(ids)) != len(ids):
            dups = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"duplicate device ids {dups} in subset {ids}; each device once")
        chosen = set(ids)
        links = [(u, v, d["capacity"], d["kind"]) for u, v, d in self._graph.edges(data=True)
                 if u in chosen and v in chosen]
        base = self._name.split("[")[0]
        return Topology(ids, links, name=f"{base}[{','.join(map(str, ids))}]",
                        host_links={d: g for d, g in self._host.items() if d in chosen})

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_links(
        cls,
        links: Mapping[tuple[int, int], float] | Sequence[Sequence[float]] | Any,
        kind: str = "nvlink",
        devices: Iterable[int] | None = None,
        name: str = "custom",
    ) -> Topology:
        """A topology from links given by the user.

        Args:
            links: either a mapping ``(i, j) -> GB/s`` per direction (symmetric: ``(i, j)`` also
                gives ``j -> i`` unless ``(j, i)`` is given too), or an adjacency matrix (numpy
                array or nested lists) whose entry ``[i][j]`` is GB/s from ``i`` to ``j``, 0 for no
                link. Matrix rows/columns index ``devices`` (default ``0..n-1``).
            kind: link kind of every link, one of :data:`LINK_KINDS`.
            devices: device ids in mesh-axis order. Default: sorted ids named in ``links``
                (mapping) or ``range(n)`` (matrix). May name devices without links.
            name: readable name.

        Raises:
            ValueError: self loops, capacities <= 0 (mapping) or < 0 (matrix), links to devices
                not in ``devices``, a matrix that is not square or does not match ``devices``.
        """
        if kind not in LINK_KINDS:
            raise ValueError(f"unknown link kind {kind!r}; allowed: {', '.join(LINK_KINDS)}")
        if isinstance(links, Mapping):
            directed: dict[tuple[int, int], float] = {}
            for (i, j), gbps in links.items():
                i, j = _check_id(i), _check_id(j)
                if i == j:
                    raise ValueError(f"self loop ({i}, {j}): links must join two different devices")
                directed[(i, j)] = _check_capacity(i, j, gbps)
            for (i, j), c in list(directed.items()):
                directed.setdefault((j, i), c)  # symmetric unless both directions are given
            devs = sorted({x for e in directed for x in e}) if devices is None else list(devices)
            return cls(devs, [(i, j, c, kind) for (i, j), c in sorted(directed.items())], name)
        rows = [list(r) for r in links]
        n = len(rows)
        if any(len(r) != n for r in rows):
            raise ValueError(f"adjacency matrix must be square, got rows of lengths {[len(r) for r in rows]}")
        devs = list(range(n)) if devices is None else list(devices)
        if len(devs) != n:
            raise ValueError(f"adjacency matrix is {n}x{n} but {len(devs)} devices were given: {devs}")
        out = []
        for a in range(n):
            for b in range(n):
                c = float(rows[a][b])
                if math.isnan(c) or c < 0:
                    raise ValueError(f"adjacency entry [{a}][{b}] = {rows[a][b]!r}: GB/s must be >= 0")
                if c == 0:
                    continue
                if a == b:
                    raise ValueError(f"self loop: diagonal entry [{a}][{a}] = {c:g} must be 0")
                out.append((devs[a], devs[b], c, kind))
        return cls(devs, out, name)

    @classmethod
    def preset(cls, name: str, *, pcie: bool = False) -> Topology:
        """A known machine.

        * ``"dgx1v"``: 8 V100, NVLink 2 at 25 GB/s per link per direction; double links 0-3, 0-4,
          1-2, 1-5, 2-3, 4-7, 5-6, 6-7 and single links 0-1, 0-2, 1-3, 2-6, 3-7, 4-5, 4-6, 5-7.
        * ``"dgx1p"``: 8 P100, NVLink 1 at 20 GB/s, single links: 0-3 fully connected, 4-7 fully
          connected, plus i <-> i+4.
        * ``"dgx2"``: 16 V100 behind NVSwitch, 6 NVLinks x 25 GB/s = 150 GB/s per GPU per direction.
        * ``"nvswitch:N"``: N >= 2 H100/H200-like GPUs behind NVSwitch, 18 NVLink 4 links x 26.6
          GB/s = 478.8 GB/s per GPU per direction.

        NVSwitch model: a full mesh where every ordered pair gets ``per_gpu / (N - 1)`` GB/s,
        kind ``"switch"``. It is exact for traffic that a GPU spreads evenly over its peers (the
        one-hop stars of all-reduce, broadcast from one root), and pessimistic for uneven traffic:
        the real switch lets one GPU send its whole ``per_gpu`` to a single peer. It ignores the
        switch's own limits (none on DGX-2/HGX: the fabric is non-blocking).

        DGX-1 presets are NVLink-only (the paper's comparison). ``pcie=True`` adds, for every GPU
        pair without NVLink, one kind-``"pcie"`` link of :data:`DGX1_PCIE_GBPS` (10 GB/s) per
        direction: GPUs sit two per PLX switch (0-1, 2-3, 4-5, 6-7), 0-3 on one socket and 4-7 on
        the other, and gen3 x16 gives about 10-12 GB/s. The model is simple and optimistic: each
        pair gets its own 10 GB/s although a GPU's PCIe paths share one x16 uplink (and cross-socket
        pairs share QPI), so a plan that uses many PCIe links at once overrates them. It is meant
        to let an allocation whose NVLinks are disconnected (e.g. GPUs 0 and 5) still plan.

        Args:
            name: ``"dgx1v"``, ``"dgx1p"``, ``"dgx2"`` or ``"nvswitch:N"``.
            pcie: DGX-1 presets only: add the PCIe links described above.

        Returns:
            The machine's topology.

        Raises:
            ValueError: unknown name, bad N, or ``pcie=True`` for an NVSwitch preset.
        """
        key = str(name).strip().lower()
        if key in ("dgx1v", "dgx1p"):
            wiring, gbps = (_DGX1V_LINKS, NVLINK_GBPS[2]) if key == "dgx1v" else (_DGX1P_LINKS, NVLINK_GBPS[1])
            links = []
            for (i, j), count in sorted(wiring.items()):
                for _ in range(count):  # one edge per physical link and direction
                    links += [(i, j, gbps, "nvlink"), (j, i, gbps, "nvlink")]
            if pcie:
                for i in range(8):
                    for j in range(i + 1, 8):
                        if (i, j) not in wiring:
                            links += [(i, j, DGX1_PCIE_GBPS, "pcie"), (j, i, DGX1_PCIE_GBPS, "pcie")]
            return cls(range(8), links, name=key + ("+pcie" if pcie else ""))
        if key == "dgx2" or key.startswith("nvswitch"):
            if pcie:
                raise ValueError(f"pcie=True only applies to the DGX-1 presets (dgx1p, dgx1v), not {name!r}")
            if key == "dgx2":
                n, per_gpu = _DGX2
            else:
                _, _, arg = key.partition(":")
                try:
                    n = int(arg)
                except ValueError:
                    n = -1
                if n < 2:
                    raise ValueError(f"preset {name!r}: write 'nvswitch:N' with an integer N >= 2")
                per_gpu = _HGX_H100_PER_GPU
            return cls._switch_mesh(range(n), per_gpu, key)
        raise ValueError(f"unknown preset {name!r}; allowed: {', '.join(_PRESETS)}")

    @classmethod
    def _switch_mesh(cls, devices: Iterable[int], per_gpu: float, name: str,
                     host_links: Mapping[int, float] | None = None) -> Topology:
        """Full mesh of kind "switch": each ordered pair gets ``per_gpu / (n - 1)`` GB/s."""
        devs = list(devices)
        n = len(devs)
        pair = per_gpu / max(n - 1, 1)
        return cls(devs, [(u, v, pair, "switch") for u in devs for v in devs if u != v], name, host_links)

    @classmethod
    def host(cls, n: int, devices: Iterable[int] | None = None) -> Topology:
        """A uniform full mesh of ``n`` CPU host devices, :data:`HOST_GBPS` per pair and direction.

        Host devices of one process exchange through shared memory, so no pair is better placed
        than another; the planners then choose the one-hop stars.

        Args:
            n: The number of devices, >= 1.
            devices: Their ids (default ``0..n-1``).

        Returns:
            The topology, named ``"host:N"``.

        Raises:
            ValueError: ``n`` is not an integer >= 1, or ``devices`` does not hold ``n`` ids.
        """
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"host(n): n must be an integer >= 1, got {n!r}")
        devs = list(range(n)) if devices is None else list(devices)
        if len(devs) != n:
            raise ValueError(f"host({n}) got {len(devs)} device ids: {devs}")
        return cls(devs, [(u, v, HOST_GBPS, "host") for u in devs for v in devs if u != v], f"host:{n}")

    @classmethod
    def discover(cls, devices: Sequence[Any] | None = None) -> Topology:
        """The topology of ``devices`` (jax devices, default ``jax.devices()``).

        * CPU host devices: :meth:`host` with the devices' ids.
        * GPUs: NVML (package ``nvidia-ml-py``) counts the active NVLinks of each GPU pair and
          multiplies by the per-link speed of the NVLink version (:data:`NVLINK_GBPS`); links
          into an NVSwitch make a ``"switch"`` full mesh (per-GPU bandwidth / (n - 1)); pairs
          without NVLink get a ``"pcie"`` link at the slower GPU's PCIe gen x width; every GPU's
          own PCIe gen x width becomes its :attr:`host_links` entry (the host channel).
          jax devices are matched to NVML handles by PCI bus id when the device has one
          (``device.pci_bus_id``), else by the CUDA ordinal ``device.local_hardware_id``
          mapped through ``CUDA_VISIBLE_DEVICES`` (integers or UUIDs; CUDA is assumed to number
          GPUs in PCI bus order like NVML, true on homogeneous machines or with
          ``CUDA_DEVICE_ORDER=PCI_BUS_ID``).
        * Fallback: if NVML cannot be imported or fails, warn (once) and return a uniform
          ``"pcie"`` full mesh at :data:`PCIE_GBPS`.

        Args:
            devices: jax devices of one platform (default ``jax.devices()``).

        Returns:
            Their topology, ranks in the order given.

        Raises:
            ValueError: No devices, or devices that are neither CPU nor NVIDIA GPUs (or a mix).
        """
        if devices is None:
            import jax

            devices = jax.devices()
        devices = list(devices)
        if not devices:
            raise ValueError("discover() needs at least one device")
        ids = [int(d.id) for d in devices]
        platforms = {str(getattr(d, "platform", "cpu")).lower() for d in devices}
        if platforms == {"cpu"}:
            return cls.host(len(ids), ids)
        if not platforms <= {"gpu", "cuda"}:
            raise ValueError(f"discover() handles CPU or NVIDIA GPU devices, got platforms {sorted(platforms)}")
        try:
            import pynvml  # nvidia-ml-py, only needed on GPU machines

            return _topology_from_nvml(pynvml, [_nvml_locator(d) for d in devices], ids)
        except Exception as e:  # NVML missing or failing: documented fallback
            _warn_once(f"jax_blink: NVML topology discovery failed ({type(e).__name__}: {e}); "
                       f"assuming a uniform PCIe mesh of {PCIE_GBPS:g} GB/s between {len(ids)} GPUs")
            links = [(u, v, PCIE_GBPS, "pcie") for u in ids for v in ids if u != v]
            return cls(ids, links, name=f"pcie-fallback:{len(ids)}")


# ---------------------------------------------------------------------- NVML discovery
_WARNED: set[str] = set()


def _warn_once(msg: str) -> None:
    """Emit ``msg`` as a RuntimeWarning the first time only."""
    if msg not in _WARNED:
        _WARNED.add(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _norm_bus_id(bus_id: Any) -> str:
    """Normalise a PCI bus id (bytes or str, 8- or 4-digit domain) to ``dddd:bb:dd.f`` lowercase."""
    s = bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)
    s = s.strip().lower().rstrip("\x00")
    parts = s.split(":")
    if len(parts) == 3:
        parts[0] = parts[0][-4:].rjust(4, "0")
    return ":".join(parts)


def _nvml_locator(device: Any) -> dict[str, Any]:
    """What we know to find a jax GPU device in NVML: its PCI bus id or its CUDA ordinal."""
    loc: dict[str, Any] = {"id": int(device.id)}
    bus = getattr(device, "pci_bus_id", None)
    if bus:
        loc["pci_bus_id"] = _norm_bus_id(bus)
    ordinal = getattr(device, "local_hardware_id", None)
    loc["ordinal"] = int(device.id if ordinal is None else ordinal)
    return loc


def nvml_handles(nvml: Any, devices: Sequence[Any], all_gpus: Mapping[str, Any] | None = None) -> list[Any]:
    """The NVML handle of each jax GPU device in ``devices`` (``nvml``: the ``pynvml`` module,
    initialised); see :func:`_nvml_handles_of`."""
    return _nvml_handles_of(nvml, [_nvml_locator(d) for d in devices],
                            os.environ.get("CUDA_VISIBLE_DEVICES"), all_gpus)


def nvml_gpus(nvml: Any) -> dict[str, Any]:
    """Every GPU NVML sees (``nvml`` initialised): its normalised PCI bus id -> its handle."""
    return {_norm_bus_id(nvml.nvmlDeviceGetPciInfo(h).busId): h
            for h in (nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount()))}


def _nvml_handles_of(nvml: Any, locators: Sequence[Mapping[str, Any]], visible: str | None,
                     all_gpus: Mapping[str, Any] | None = None) -> list[Any]:
    """The NVML handle of each locator (:func:`_nvml_locator`): by its PCI bus id where it has one,
    else by its CUDA ordinal through ``visible`` (CUDA_VISIBLE_DEVICES); ``all_gpus``:
    :func:`nvml_gpus`, read here if not given. Raises NVML's errors, or ValueError for a bus id
    NVML does not list or an ordinal ``visible`` does not."""
    all_gpus = nvml_gpus(nvml) if all_gpus is None else all_gpus
    handles = []
    for loc in locators:
        if loc.get("pci_bus_id"):
            bus = _norm_bus_id(loc["pci_bus_id"])
            if bus not in all_gpus:
                raise ValueError(f"no GPU with PCI bus id {bus} in NVML: {sorted(all_gpus)}")
            handles.append(all_gpus[bus])
            continue
        idx = _nvml_index_of_ordinal(int(loc["ordinal"]), visible)
        handles.append(nvml.nvmlDeviceGetHandleByIndex(idx) if isinstance(idx, int)
                       else nvml.nvmlDeviceGetHandleByUUID(idx))
    return handles


def _nvml_index_of_ordinal(ordinal: int, visible: str | None) -> int | str:
    """Map a CUDA ordinal to an NVML index (int) or a UUID (str) through CUDA_VISIBLE_DEVICES."""
    if not visible:
        return ordinal
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if ordinal >= len(entries):
        raise ValueError(f"CUDA ordinal {ordinal} but CUDA_VISIBLE_DEVICES={visible!r}")
    e = entries[ordinal]
    return int(e) if e.isdigit() else e


def _topology_from_nvml(
    nvml: Any,
    locators: Sequence[Mapping[str, Any]],
    ids: Sequence[int],
    visible: str | None = None,
) -> Topology:
    """Build the topology of the GPUs ``locators`` from an nvml-like module (``pynvml`` API).

    Each locator has ``pci_bus_id`` (preferred) or ``ordinal`` (CUDA ordinal, mapped through
    ``visible`` = CUDA_VISIBLE_DEVICES, default from the environment). ``ids`` are the device ids
    of the result, one per locator. Calls nvmlInit/nvmlShutdown. Raises on any NVML failure.
    """
    if visible is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    nvml.nvmlInit()
    try:
        all_gpus = nvml_gpus(nvml)
        handles = _nvml_handles_of(nvml, locators, visible, all_gpus)
        by_bus = {_norm_bus_id(nvml.nvmlDeviceGetPciInfo(h).busId): pos  # our GPUs: bus id -> position
                  for pos, h in enumerate(handles)}
        n = len(handles)
        max_links = int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))
        enabled = getattr(nvml, "NVML_FEATURE_ENABLED", 1)
        pair_links: dict[tuple[int, int], int] = {}
        switch_gbps = [0.0] * n
        link_gbps = [0.0] * n
        for a, h in enumerate(handles):
            for link in range(max_links):
                try:
                    if nvml.nvmlDeviceGetNvLinkState(h, link) != enabled:
                        continue
                    remote = _norm_bus_id(nvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId)
                except nvml.NVMLError:
                    continue  # link not present / not supported on this GPU
                gbps = _nvlink_gbps(nvml, h, link)
                link_gbps[a] = max(link_gbps[a], gbps)
                if remote in by_bus:
                    b = by_bus[remote]
                    if b != a:
                        pair_links[(a, b)] = pair_links.get((a, b), 0) + 1
                elif remote not in all_gpus:
                    switch_gbps[a] += gbps  # remote is an NVSwitch
                # else: a GPU outside this device set; not ours to plan over
        name = _nvml_name(nvml, handles[0])
        host = {ids[a]: _pcie_gbps(nvml, handles[a]) for a in range(n)}
        if any(switch_gbps):
            per_gpu = min(g for g in switch_gbps if g > 0)
            return Topology._switch_mesh(ids, per_gpu, f"nvswitch:{n}({name})", host)
        links = []
        for a in range(n):
            for b in range(n):
                if a == b:
                    continue
                k = pair_links.get((a, b), 0)
                if k:
                    links += [(ids[a], ids[b], link_gbps[a], "nvlink")] * k
                else:
                    links.append((ids[a], ids[b], min(host[ids[a]], host[ids[b]]), "pcie"))
        return Topology(ids, links, name=f"nvml:{n}({name})", host_links=host)
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def _nvlink_gbps(nvml: Any, handle: Any, link: int) -> float:
    """GB/s per direction of one NVLink, from its NVLink version (V100's 25 if unknown)."""
    try:
        return NVLINK_GBPS.get(int(nvml.nvmlDeviceGetNvLinkVersion(handle, link)), NVLINK_GBPS[2])
    except Exception:
        return NVLINK_GBPS[2]


def _pcie_gbps(nvml: Any, handle: Any) -> float:
    """GB/s per direction of a GPU's PCIe link: max gen x max width (idle GPUs downshift the
    current gen), or :data:`PCIE_GBPS` when NVML does not say."""
    try:
        gen = int(nvml.nvmlDeviceGetMaxPcieLinkGeneration(handle))
        width = int(nvml.nvmlDeviceGetMaxPcieLinkWidth(handle))
        return PCIE_LANE_GBPS[gen] * width
    except Exception:
        return PCIE_GBPS


def _nvml_name(nvml: Any, handle: Any) -> str:
    """The GPU's product name, or "gpu"."""
    try:
        s = nvml.nvmlDeviceGetName(handle)
        return s.decode() if isinstance(s, bytes) else str(s)
    except Exception:
        return "gpu"


def host_path_gbps(topology: Topology, a: int, b: int, engine: str = DEFAULT_HOST_ENGINE) -> float:
    """GB/s per direction that device ``a`` can move to device ``b`` through pinned host memory
    (Blink's second channel) with the executor's host-channel ``engine`` (``"ce"`` or ``"sm"``):
    the slower of the two PCIe links times
    :data:`HOST_PATH_EFFICIENCY` of that engine; 0.0 when either host link is unknown."""
    for d in (a, b):
        topology.rank_of(d)  # ValueError for a device that is not here
    host = topology.host_links
    if a == b or a not in host or b not in host:
        return 0.0
    return min(host[a], host[b]) * HOST_PATH_EFFICIENCY[engine]
