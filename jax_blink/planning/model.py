"""The cost model: NCCL-style rings and an alpha-beta pipeline model (pure Python, no JAX).

The planner (:mod:`jax_blink.planning.forms`) weighs the all-reduce forms with it, and the tools
(:mod:`jax_blink.tools.simulate`, ``benchmarks/paper_comparison.py``) compare against NCCL with it.

Two pieces, both pure Python (no devices, no JAX):

* :func:`rings`: the ring baseline as NCCL builds it on a DGX-1: as many link-disjoint directed
  Hamiltonian rings over NVLink as the allocation has, each ring holding one physical link per hop
  (so a double NVLink can carry two rings in the same direction, and a ring and its reverse share
  no link direction); if the NVLinks hold no Hamiltonian ring, one ring over PCIe.
* :func:`time_us`: an alpha-beta model of a pipelined, chunked transfer through the trees of a
  :class:`~jax_blink.planning.packing.Plan` or through a :class:`RingPlan`; :func:`compare` puts the two side
  by side for one topology, collective and size.

Model parameters, all in one place (:data:`MODEL`):

* ``alpha`` (us): the latency of one hop, per link kind, :data:`jax_blink.planning.topology.LINK_LATENCY_US`
  (nvlink 1.5, switch 2, pcie 5, host 10). A tree or ring pays the slowest kind it uses per hop.
* ``beta``: 1 / capacity; capacities are the topology's GB/s per link per direction
  (1 GB/s = 1000 bytes/us).
* the nominal PCIe rate of a DGX-1 ring when the topology has no PCIe links to read it from,
  :data:`jax_blink.planning.topology.DGX1_PCIE_GBPS` (10 GB/s: gen3 x16 through PLX switches, measured 10-12).

Formulas (S = bytes per device, c = chunk bytes, alpha = per-hop latency):

* A tree of weight w (GB/s) with depth D carries the share s = S * w / rate of the data in
  k = ceil(s / c) chunks; pipelined through D hops it takes ``(D + k - 1) * (alpha + c / w)``.
  Broadcast and reduce: the plan's time is the slowest of its trees (they run at once on
  disjoint link capacity). All-reduce (Blink's form): the reduce toward the tree's root and the
  broadcast away from it run on opposite link directions and are pipelined one after the other
  per chunk, so the pipeline is 2D deep: ``(2D + k - 1) * (alpha + c / w)``.
* Ring broadcast/reduce: each ring is a chain of n - 1 hops from the root, the same formula with
  D = n - 1 and w = the ring's rate; the data is split over the rings by rate.
* Ring all-reduce (NCCL's formula): 2(n - 1) steps, each moving S / n bytes of each ring's share:
  ``2(n - 1) * (alpha + S_r / (n * b_r))`` = ``2(n - 1) * alpha + 2(n - 1)/n * S / B`` with B the
  sum of ring rates.
* With ``chunk_bytes=None`` the chunk size is the best power of two from 1 KiB up to S (or S itself).

At the *rate* level (large sizes, latency gone) the algorithm bandwidth algbw = S / time is:
trees: ``plan.rate`` for all three collectives; rings: B for broadcast/reduce and
``B * n / (2(n - 1))`` for all-reduce.

The model leaves out the reduction's arithmetic, kernel launch costs and NCCL's protocol choices
(LL/LL128/Simple); it is for comparing shapes of plans, not for predicting wall time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any

import networkx as nx

from jax_blink.planning.topology import DGX1_PCIE_GBPS, LINK_LATENCY_US, Topology

__all__ = ["RingPlan", "rings", "time_us", "best_time", "ring_allreduce_us", "compare", "algbw", "MODEL",
           "COLLECTIVES"]

COLLECTIVES = ("broadcast", "reduce", "allreduce")

#: Every number the model uses, in one place.
MODEL: dict[str, Any] = {
    "alpha_us": LINK_LATENCY_US,  # per-hop latency by link kind
    "pcie_ring_gbps": DGX1_PCIE_GBPS,  # NCCL's PCIe ring when the topology has no PCIe links
    "bytes_per_us_per_gbps": 1e3,  # 1 GB/s = 1e9 B/s = 1e3 B/us
    "min_chunk_bytes": 1 << 10,  # smallest chunk tried when chunk_bytes is None
}

# Hard cap on the number of Hamiltonian cycles enumerated before packing them (dense user graphs).
_MAX_CYCLES = 200_000


# ---------------------------------------------------------------------------------------- rings
@dataclass(frozen=True)
class RingPlan:
    """NCCL's ring baseline on one topology.

    Attributes:
        topology: the topology the rings run on.
        rings: each ring a tuple of device ids in ring order (``r[i] -> r[i+1]``, last -> first).
        rates: GB/s of each ring (the slowest link it holds).
        kind: ``"nvlink"`` (link-disjoint NVLink rings), ``"pcie"`` (the PCIe fallback),
            ``"mesh"`` (a uniform full mesh: switch or host) or ``"none"`` (one device).
        alphas: per-hop latency (us) of each ring: its slowest link kind.
        note: how the rings were found.
    """

    topology: Topology
    rings: tuple[tuple[int, ...], ...]
    rates: tuple[float, ...]
    kind: str
    alphas: tuple[float, ...] = ()
    note: str = ""

    @property
    def rate(self) -> float:
        """Total GB/s of the rings (sum of ring rates)."""
        return float(sum(self.rates))

    @property
    def num_rings(self) -> int:
        return len(self.rings)

    @property
    def n(self) -> int:
        return self.topology.n

    def __repr__(self) -> str:
        return (f"RingPlan({self.topology.name}, {self.num_rings} {self.kind} ring(s), "
                f"{self.rate:g} GB/s)")

    def describe(self) -> str:
        lines = [f"{self.num_rings} {self.kind} ring(s) on {self.topology.name}, "
                 f"{self.rate:g} GB/s in all" + (f" ({self.note})" if self.note else "")]
        for r, b in zip(self.rings, self.rates):
            lines.append(f"  {' -> '.join(map(str, r))} -> {r[0]}: {b:g} GB/s")
        return "\n".join(lines)


def _links_by_pair(topology: Topology, kinds: set[str] | None) -> dict[tuple[int, int], list[tuple[float, str]]]:
    """(u, v) -> the physical links u->v of the given kinds, as (capacity, kind), fastest first."""
    out: dict[tuple[int, int], list[tuple[float, str]]] = {}
    for u, v, d in topology.graph.edges(data=True):
        if kinds is None or d["kind"] in kinds:
            out.setdefault((u, v), []).append((float(d["capacity"]), d["kind"]))
    for links in out.values():
        links.sort(key=lambda x: -x[0])
    return out


def _hamiltonian_cycles(nodes: list[int], succ: dict[int, list[int]], limit: int = _MAX_CYCLES):
    """All directed Hamiltonian cycles over ``nodes`` (each once, starting at ``nodes[0]``).

    Backtracking; stops after ``limit`` cycles (returns what it found and a flag)."""
    n = len(nodes)
    start = nodes[0]
    found: list[tuple[int, ...]] = []
    path = [start]
    used = {start}

    def dfs() -> bool:
        u = path[-1]
        if len(path) == n:
            if start in succ.get(u, ()):
                found.append(tuple(path))
                return len(found) < limit
            return True
        for v in succ.get(u, ()):
            if v not in used:
                path.append(v)
                used.add(v)
                ok = dfs()
                used.discard(v)
                path.pop()
                if not ok:
                    return False
        return True

    complete = dfs()
    return found, complete


def _cycle_pairs(cycle: tuple[int, ...]) -> list[tuple[int, int]]:
    return [(cycle[i], cycle[(i + 1) % len(cycle)]) for i in range(len(cycle))]


def _pack_rings(nodes: list[int], links: dict[tuple[int, int], list[tuple[float, str]]]):
    """Most GB/s of link-disjoint directed Hamiltonian rings: each ring holds one physical link per
    hop; a ring's rate is the slowest link it holds. Exact branch and bound over the enumerated
    cycles (each cycle may be taken several times where the pairs have several links).

    Returns (rings, rates, kinds_per_ring, exact)."""
    succ: dict[int, list[int]] = {u: [] for u in nodes}
    for (u, v) in links:
        succ[u].append(v)
    for u in succ:
        succ[u].sort()
    cycles, exact = _hamiltonian_cycles(nodes, succ)
    if not cycles:
        return [], [], [], exact
    # Links of one pair differ only in capacity (same kind on DGX machines); a ring takes the
    # fastest free link of each pair, so remaining links per pair are a stack, fastest first.
    remaining = {p: list(ls) for p, ls in links.items()}
    out_cap = {u: sum(c for (a, _), ls in links.items() if a == u for c, _ in ls) for u in nodes}
    cyc_pairs = [_cycle_pairs(c) for c in cycles]

    best: dict[str, Any] = {"rate": 0.0, "sel": []}
    chosen: list[tuple[int, float, list[str]]] = []
    cur_out = dict(out_cap)

    def bound() -> float:
        return min(cur_out.values())

    def dfs(i: int, rate: float) -> bool:
        # Recursion only for a cycle taken (at most one per out-link of a device); skipping a cycle
        # is the loop, so dense graphs with thousands of cycles do not exhaust Python's stack.
        while True:
            if rate > best["rate"] + 1e-9:
                best["rate"], best["sel"] = rate, list(chosen)
            if best["rate"] >= upper - 1e-9:
                return True  # optimal: stop
            if i >= len(cycles) or rate + bound() <= best["rate"] + 1e-9:
                return False
            pairs = cyc_pairs[i]
            if all(remaining[p] for p in pairs):
                taken = [remaining[p].pop(0) for p in pairs]
                r = min(c for c, _ in taken)
                for (u, _), (c, _) in zip(pairs, taken):
                    cur_out[u] -= c
                chosen.append((i, r, [k for _, k in taken]))
                if dfs(i, rate + r):  # the same cycle again (parallel links), then the next ones
                    return True
                chosen.pop()
                for (u, _), (c, k) in zip(pairs, taken):
                    cur_out[u] += c
                for p, t in zip(pairs, taken):
                    remaining[p].insert(0, t)
            i += 1

    upper = min(out_cap.values())
    dfs(0, 0.0)
    sel = best["sel"]
    return ([cycles[i] for i, _, _ in sel], [r for _, r, _ in sel], [ks for _, _, ks in sel], exact)


def _best_single_ring(nodes: list[int], links: dict[tuple[int, int], list[tuple[float, str]]]):
    """One Hamiltonian ring with the largest bottleneck capacity (None if there is none)."""
    caps = sorted({ls[0][0] for ls in links.values()}, reverse=True)
    for thr in caps:
        succ: dict[int, list[int]] = {u: [] for u in nodes}
        for (u, v), ls in links.items():
            if ls[0][0] >= thr:
                succ[u].append(v)
        cyc, _ = _hamiltonian_cycles(nodes, succ, limit=1)
        if cyc:
            pairs = _cycle_pairs(cyc[0])
            return cyc[0], min(links[p][0][0] for p in pairs), [links[p][0][1] for p in pairs]
    return None


def _uniform_mesh(topology: Topology) -> float | None:
    """Per-pair capacity if the topology is a full mesh with one capacity everywhere, else None."""
    s = topology.simple_graph()
    n = topology.n
    if s.number_of_edges() != n * (n - 1):
        return None
    caps = {d["capacity"] for _, _, d in s.edges(data=True)}
    return caps.pop() if len(caps) == 1 else None


def _alpha(kinds) -> float:
    return max(MODEL["alpha_us"][k] for k in kinds) if kinds else 0.0


_RING_CACHE: dict[tuple, RingPlan] = {}


def rings(topology: Topology) -> RingPlan:
    """The ring baseline as NCCL builds it on ``topology``.

    1. Over NVLink: as many link-disjoint directed Hamiltonian rings as the links allow, found by
       an exact search (enumerate the Hamiltonian cycles, then branch and bound on how many times
       to take each; a cycle can be taken once per parallel link on each of its pairs). A ring
       holds one physical link per hop and runs at its slowest link; the search maximises the sum
       of ring rates. DGX-1V, 8 GPUs: each GPU has 6 NVLinks, so at most 6 directed rings (one
       out-link per GPU each); the search finds 6 (three edge-disjoint Hamiltonian cycles, each
       run in both directions), 150 GB/s, which is what NCCL reaches there.
    2. Uniform full meshes (NVSwitch, CPU host devices): no search; NCCL's rings reach the per-GPU
       fabric rate, recorded as one logical ring at ``(n - 1) x`` the pair capacity.
    3. No NVLink ring: one ring over PCIe: the best Hamiltonian ring over all the topology's links
       (its slowest link sets the rate) when the topology has PCIe links, else one ring at
       :data:`MODEL` ``["pcie_ring_gbps"]`` (10 GB/s, DGX-1's gen3 x16 through PLX switches).

    Results are cached by the topology's key.
    """
    key = topology.key()
    if key in _RING_CACHE:
        return _RING_CACHE[key]
    nodes = list(topology.devices)
    n = len(nodes)
    if n <= 1:
        rp = RingPlan(topology, (), (), "none", (), "one device: nothing to move")
    else:
        mesh_cap = _uniform_mesh(topology)
        kinds = set(topology.kinds())
        if mesh_cap is not None and kinds <= {"switch", "host"}:
            rp = RingPlan(topology, (tuple(nodes),), ((n - 1) * mesh_cap,), "mesh",
                          (_alpha(kinds),), "uniform full mesh: rings reach the per-device fabric rate")
        else:
            nv = _links_by_pair(topology, {"nvlink", "switch"})
            rs, rates, ks, exact = _pack_rings(nodes, nv) if nv else ([], [], [], True)
            if rs:
                note = "link-disjoint NVLink rings" + ("" if exact else " (cycle enumeration capped)")
                rp = RingPlan(topology, tuple(rs), tuple(rates), "nvlink",
                              tuple(_alpha(k) for k in ks), note)
            else:
                alll = _links_by_pair(topology, None)
                best = _best_single_ring(nodes, alll) if "pcie" in kinds else None
                if best is not None:
                    cyc, rate, k = best
                    rp = RingPlan(topology, (cyc,), (rate,), "pcie", (_alpha(k),),
                                  "no NVLink ring: one ring over the topology's PCIe links")
                else:
                    rp = RingPlan(topology, (tuple(nodes),), (float(MODEL["pcie_ring_gbps"]),), "pcie",
                                  (MODEL["alpha_us"]["pcie"],),
                                  f"no NVLink ring: one ring over PCIe at a nominal "
                                  f"{MODEL['pcie_ring_gbps']:g} GB/s")
    _RING_CACHE[key] = rp
    return rp


# ---------------------------------------------------------------------------------------- model
def _check_collective(collective: str) -> str:
    c = str(collective).lower().replace("-", "").replace("_", "")
    if c not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; allowed: {', '.join(COLLECTIVES)}")
    return c


def _tree_root(tree: nx.DiGraph) -> int:
    roots = [v for v in tree.nodes if tree.in_degree(v) == 0]
    if len(roots) != 1:
        raise ValueError(f"a tree must have exactly one root (node with no incoming edge), got {roots}")
    return roots[0]


def _tree_depth_alpha(tree: nx.DiGraph, topology: Topology) -> tuple[int, float]:
    """Depth (hops from the root to the farthest leaf) and per-hop latency (slowest kind used)."""
    root = _tree_root(tree)
    depth = max(nx.single_source_shortest_path_length(tree, root).values())
    s = topology.simple_graph()
    kinds = set()
    for u, v in tree.edges:
        if s.has_edge(u, v):
            kinds.update(s[u][v].get("kinds", ()))
        if s.has_edge(v, u):
            kinds.update(s[v][u].get("kinds", ()))
    if not kinds:
        kinds = set(topology.kinds())
    return depth, _alpha(kinds)


def _pipelines(obj: Any, collective: str) -> tuple[list[tuple[float, int, float]], float, int]:
    """The parallel pipelines of a plan or rings: [(rate GB/s, depth, alpha us)], total rate, n.

    For all-reduce over rings returns an empty list (NCCL's closed formula is used instead)."""
    if isinstance(obj, RingPlan):
        n = obj.n
        pipes = [(b, n - 1, a) for b, a in zip(obj.rates, obj.alphas or [MODEL["alpha_us"]["pcie"]] * len(obj.rates))]
        return pipes, obj.rate, n
    trees = getattr(obj, "trees", None)
    topo = getattr(obj, "topology", None)
    if trees is None or topo is None:
        raise TypeError(f"expected a Plan (with .trees and .topology) or a RingPlan, got {type(obj).__name__}")
    pipes = []
    for tree, w in trees:
        if w <= 0:
            continue
        d, a = _tree_depth_alpha(tree, topo)
        pipes.append((float(w), d, a))
    return pipes, float(sum(p[0] for p in pipes)), topo.n


def ring_allreduce_us(n: int, rates: Sequence[float], alphas: Sequence[float], nbytes: float) -> float:
    """NCCL's ring all-reduce formula: rings of ``rates`` GB/s (per-hop latency ``alphas`` us) over
    ``n`` devices, ``nbytes`` per device split over the rings by rate, each ring 2(n - 1) steps of
    its share / n: ``max over rings of 2(n - 1) * (alpha_r + S_r / (n * b_r))``
    = ``2(n - 1) * alpha + 2(n - 1)/n * S / B``. The ONE formula of a ring all-reduce: the NCCL
    baseline and the planner's ring form (:mod:`jax_blink.planning.forms`) both use it.

    Args:
        n: devices on each ring.
        rates: GB/s of each ring.
        alphas: per-hop latency (us) of each ring.
        nbytes: bytes per device.

    Returns:
        Modelled time in us (0.0 for one device, no bytes or no rings).
    """
    total = float(sum(rates))
    if n <= 1 or nbytes <= 0 or total <= 0:
        return 0.0
    bpu = MODEL["bytes_per_us_per_gbps"]
    return max(2 * (n - 1) * (a + (nbytes * b / total) / (n * b * bpu)) for b, a in zip(rates, alphas) if b > 0)


def _chunk_candidates(nbytes: float) -> list[float]:
    c = MODEL["min_chunk_bytes"]
    out = []
    while c < nbytes:
        out.append(float(c))
        c *= 2
    out.append(float(nbytes))
    return out


def _pipeline_time(pipes, total: float, nbytes: float, c: float, deep: int) -> float:
    bpu = MODEL["bytes_per_us_per_gbps"]
    t = 0.0
    for w, d, a in pipes:
        share = nbytes * w / total
        k = max(1, math.ceil(share / c - 1e-9))
        cc = min(c, share)
        t = max(t, (deep * d + k - 1) * (a + cc / (w * bpu)))
    return t


def best_time(obj: Any, collective: str, nbytes: float, chunk_bytes: float | None = None) -> tuple[float, float | None]:
    """(time in us, chunk bytes used) of ``collective`` of ``nbytes`` per device through ``obj``
    (a Plan or a RingPlan); see the module docstring for the formulas. The chunk is None for ring
    all-reduce (NCCL's closed formula has none)."""
    collective = _check_collective(collective)
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    pipes, total, n = _pipelines(obj, collective)
    if n <= 1 or nbytes == 0 or not pipes:
        return 0.0, None
    if isinstance(obj, RingPlan) and collective == "allreduce":
        return ring_allreduce_us(n, [b for b, _, _ in pipes], [a for _, _, a in pipes], nbytes), None
    deep = 2 if collective == "allreduce" else 1
    if chunk_bytes is not None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        return _pipeline_time(pipes, total, nbytes, float(chunk_bytes), deep), float(chunk_bytes)
    best = min((_pipeline_time(pipes, total, nbytes, c, deep), c) for c in _chunk_candidates(nbytes))
    return best


def time_us(plan_or_rings: Any, collective: str, nbytes: float, chunk_bytes: float | None = None) -> float:
    """Modelled time in microseconds of ``collective`` of ``nbytes`` (per device) through a Plan's
    trees or a :class:`RingPlan`.

    Trees (weight w GB/s, depth D, share s = nbytes * w / rate, chunk c, k = ceil(s / c) chunks,
    alpha = per-hop latency of the slowest link kind in the tree)::

        broadcast, reduce:  max over trees of (D  + k - 1) * (alpha + c / w)
        allreduce:          max over trees of (2D + k - 1) * (alpha + c / w)

    Rings (n devices, ring rates b_r summing to B): broadcast/reduce as a chain of D = n - 1 hops
    per ring with the formula above; all-reduce by NCCL's formula
    ``2(n - 1) * alpha + 2(n - 1)/n * nbytes / B``.

    ``chunk_bytes=None`` takes the best power-of-two chunk (1 KiB .. nbytes) for this size.
    """
    return best_time(plan_or_rings, collective, nbytes, chunk_bytes)[0]


def algbw(obj: Any, collective: str) -> float:
    """Algorithm bandwidth (GB/s of data per device) at large sizes: ``plan.rate`` for trees; the
    ring rate B for ring broadcast/reduce and ``B * n / (2(n - 1))`` for ring all-reduce."""
    collective = _check_collective(collective)
    if isinstance(obj, RingPlan):
        n = obj.n
        if n <= 1:
            return math.inf
        return obj.rate * n / (2 * (n - 1)) if collective == "allreduce" else obj.rate
    return float(obj.rate)


def compare(topology: Topology, collective: str, nbytes: float = 500e6, *, root: int | None = None,
            method: str = "exact", plan: Any = None) -> dict[str, Any]:
    """Blink's trees against NCCL's rings on ``topology`` for ``collective`` of ``nbytes``.

    Returns a dict: ``collective``, ``n``, ``devices``, ``root``, ``num_trees``, ``tree_rate`` and
    ``bound`` (GB/s, from the plan), ``num_rings``, ``ring_kind``, ``ring_rate`` (GB/s, sum of ring
    rates), ``tree_algbw``/``ring_algbw`` (GB/s at large sizes, see :func:`algbw`),
    ``rate_speedup`` (their ratio), ``nbytes``, ``tree_time_us``/``ring_time_us`` (the model, best
    chunk each), ``tree_chunk``/``ring_chunk`` and ``speedup`` (ring time / tree time).
    Pass ``plan`` to reuse a plan already made.
    """
    collective = _check_collective(collective)
    if plan is None:
        from jax_blink.planning.packing import plan as make_plan

        plan = make_plan(topology, collective, root, method=method)
    rp = rings(topology)
    tt, tc = best_time(plan, collective, nbytes)
    rt, rc = best_time(rp, collective, nbytes)
    ta, ra = algbw(plan, collective), algbw(rp, collective)
    return {
        "collective": collective,
        "n": topology.n,
        "devices": tuple(topology.devices),
        "root": getattr(plan, "root", root),
        "num_trees": len(plan.trees),
        "tree_rate": float(plan.rate),
        "bound": float(getattr(plan, "bound", float("nan"))),
        "num_rings": rp.num_rings,
        "ring_kind": rp.kind,
        "ring_rate": rp.rate,
        "tree_algbw": ta,
        "ring_algbw": ra,
        "rate_speedup": ta / ra if ra > 0 else math.inf,
        "nbytes": nbytes,
        "tree_time_us": tt,
        "ring_time_us": rt,
        "tree_chunk": tc,
        "ring_chunk": rc,
        "speedup": rt / tt if tt > 0 else math.nan,
    }
