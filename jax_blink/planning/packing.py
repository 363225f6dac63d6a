"""Tree packing: the trees (and their rates) that move data through a :class:`Topology`.

``plan(topology, collective, root)`` returns a :class:`Plan`: spanning arborescences over all
devices with a weight (GB/s) each, their total ``rate`` and, next to it, a ``bound`` on any plan
of that form computed independently of the solver (networkx max-flow or the partition bound).

Link accounting (what a tree of weight ``w`` uses):

* ``broadcast`` from ``r``: ``w`` on each tree edge ``u -> v`` (edges point away from ``r``).
* ``reduce`` to ``r``: the tree's edges still point away from ``r``, but data flows toward it,
  so edge ``u -> v`` uses ``w`` of the link ``v -> u``.
* ``allreduce`` (Blink's form): a tree reduces toward its root, then broadcasts away from it, so
  each tree edge ``{u, v}`` uses ``w`` of ``u -> v`` *and* ``w`` of ``v -> u``. This is spanning-tree
  packing in the undirected graph with capacity ``min(c(u, v), c(v, u))`` per pair; the roots
  change nothing on the links.

Solvers (OR-Tools, at trace time):

* ``method="exact"``: the packing LP ``max sum x_T s.t. sum_{T contains e} x_T <= c_e`` solved by
  column generation (GLOP): pricing is a minimum-weight arborescence (Edmonds) or minimum spanning
  tree (allreduce) under the dual prices. The LP optimum equals the bound (Edmonds' branching
  theorem; Tutte-Nash-Williams), so generation stops as soon as the LP reaches the bound. Then an
  integer program (SCIP) over the generated trees keeps as few trees as possible at >= 99% of the LP
  rate (and, among as few trees, the highest rate); a last LP re-maximises the weights of the kept
  trees.
* ``method="mwu"``: the paper's multiplicative-weights packing (Garg-Koenemann), then the same
  tree-count minimisation over the trees it produced.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import networkx as nx

from jax_blink.planning.topology import DEFAULT_HOST_ENGINE, NVLINK_EFFICIENCY, Topology, host_path_gbps

__all__ = ["Plan", "plan", "COLLECTIVES", "METHODS", "broadcast_bound", "partition_bound",
           "clear_plan_cache", "max_weights"]

COLLECTIVES = ("broadcast", "reduce", "allreduce")
METHODS = ("exact", "mwu")

#: The integer program keeps this fraction of the LP rate (the issue's "within 1%").
IP_RATE_FRACTION = 0.99
_TOL = 1e-9

Column = tuple[int, ...]  # a tree as sorted resource (edge or pair) indices


# ============================================================================ combinatorial pieces
def min_arborescence(nodes: Sequence[int], root: int,
                     edges: Sequence[tuple[int, int, float]]) -> list[int] | None:
    """Indices into ``edges`` of a minimum-weight spanning arborescence rooted at ``root``.

    ``edges`` are ``(u, v, weight)``; the arborescence spans ``nodes`` with edges pointing away
    from ``root``. Chu-Liu/Edmonds, O(V E), written for the small dense graphs of a node (networkx's
    general version is ~20x slower here). Returns None if some node cannot be reached.
    """
    work = [(u, v, w, i) for i, (u, v, w) in enumerate(edges) if v != root and u != v]
    return _edmonds(list(nodes), root, work, max(nodes, default=0) + 1)


def _edmonds(nodes: list[int], root: int, edges: list[tuple], fresh: int) -> list[int] | None:
    """Recursive Chu-Liu/Edmonds on ``edges`` = ``(u, v, w, ref)``; returns refs of chosen edges.

    ``ref`` is the edge's index at the top level, or the edge tuple of the level above.
    """
    best: dict[int, tuple] = {}
    for e in edges:
        v = e[1]
        if v != root and (v not in best or e[2] < best[v][2]):
            best[v] = e
    if len(best) < len(nodes) - 1:
        return None
    # look for a cycle among the chosen in-edges
    color: dict[int, int] = {root: -1}
    cycle: list[int] | None = None
    for start in nodes:
        path = []
        v = start
        while v not in color:
            color[v] = start
            path.append(v)
            v = best[v][0]
        if color[v] == start:  # closed a cycle on this walk
            cycle = path[path.index(v):]
            break
    if cycle is None:
        return [best[v][3] for v in best]
    cyc = set(cycle)
    c = fresh
    contracted = []
    for e in edges:
        u, v, w, _ = e
        if u in cyc and v in cyc:
            continue
        if v in cyc:
            contracted.append((u, c, w - best[v][2], e))
        elif u in cyc:
            contracted.append((c, v, w, e))
        else:
            contracted.append((u, v, w, e))
    sub_nodes = [x for x in nodes if x not in cyc] + [c]
    chosen = _edmonds(sub_nodes, root, contracted, fresh + 1)
    if chosen is None:
        return None
    out = []
    entered = None
    for e in chosen:  # e is an edge tuple of this level
        out.append(e[3])
        if e[1] in cyc:
            entered = e[1]
    out += [best[v][3] for v in cycle if v != entered]
    return out


def min_spanning_tree(n: int, pairs: Sequence[tuple[int, int]], weights: Sequence[float]) -> list[int] | None:
    """Indices into ``pairs`` (undirected edges over nodes ``0..n-1``) of a minimum spanning tree
    under ``weights`` (Kruskal), or None if the graph is disconnected."""
    parent = list(range(n))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    out = []
    for i in sorted(range(len(pairs)), key=weights.__getitem__):
        a, b = find(pairs[i][0]), find(pairs[i][1])
        if a != b:
            parent[a] = b
            out.append(i)
            if len(out) == n - 1:
                break
    return out if len(out) == n - 1 else None


# ============================================================================ bounds
def broadcast_bound(g: nx.DiGraph, root: int) -> tuple[float, int | None, frozenset]:
    """Max broadcast rate from ``root`` in ``g`` (edge attribute ``capacity``, GB/s).

    Returns ``(min over v != root of maxflow(root, v), the v attaining it, the source side of
    its minimum cut)``. By Edmonds' branching theorem this is the best fractional arborescence
    packing. For a reduce to ``root``, pass ``g.reverse()``.
    """
    best, arg, side = math.inf, None, frozenset()
    for v in g.nodes:
        if v == root:
            continue
        f = nx.maximum_flow_value(g, root, v, capacity="capacity")
        if f < best - _TOL:
            best, arg = f, v
    if arg is not None:
        _, (s, _) = nx.minimum_cut(g, root, arg, capacity="capacity")
        side = frozenset(s)
    return best, arg, side


def _undirected_caps(g: nx.DiGraph) -> dict[tuple[int, int], float]:
    """``{(u, v): min(c(u, v), c(v, u))}`` for u < v linked both ways: what an allreduce tree
    edge may carry (it uses both directions)."""
    out = {}
    for u, v, d in g.edges(data=True):
        if u < v and g.has_edge(v, u):
            out[(u, v)] = min(d["capacity"], g[v][u]["capacity"])
    return out


def _set_partitions(items: list[int]):
    """All partitions of ``items`` as lists of part labels (restricted growth strings)."""
    n = len(items)
    labels = [0] * n

    def rec(i: int, k: int):
        if i == n:
            yield labels
            return
        for lab in range(k + 1):
            labels[i] = lab
            yield from rec(i + 1, max(k, lab + 1))

    if n:
        labels[0] = 0
        yield from rec(1, 1)


def partition_bound_enumerate(nodes: Sequence[int], caps: dict[tuple[int, int], float]
                              ) -> tuple[float, tuple[frozenset, ...]]:
    """min over partitions P of ``nodes`` into >= 2 parts of ``cap(crossing P) / (|P| - 1)``, by
    enumerating every partition (Bell(n): use for n <= 8). ``caps`` maps undirected pairs to GB/s."""
    nodes = list(nodes)
    pos = {v: i for i, v in enumerate(nodes)}
    es = [(pos[u], pos[v], c) for (u, v), c in caps.items()]
    best, arg = math.inf, None
    for lab in _set_partitions(nodes):
        k = max(lab) + 1
        if k < 2:
            continue
        cross = sum(c for a, b, c in es if lab[a] != lab[b])
        r = cross / (k - 1)
        if r < best - _TOL:
            best, arg = r, list(lab)
    parts = tuple(frozenset(v for v, l in zip(nodes, arg) if l == p) for p in range(max(arg) + 1))
    return best, parts


def _dilworth_min(nodes: list[int], caps: dict[tuple[int, int], float], lam: float
                  ) -> tuple[float, list[set]]:
    """min over partitions P of ``cap(crossing P) - lam * |P|``, and a minimising partition.

    The sum over parts of the submodular ``f(S) = cap(delta(S)) / 2 - lam`` is minimised by the
    greedy algorithm for the Dilworth truncation: taking nodes in order, ``x(v_k) = min{f(S) -
    x(S - v_k) : v_k in S, S within v_1..v_k}``, each a minimum s-t cut; the maximal tight sets
    are the parts (Cunningham's "optimal attack", 1985). n minimum cuts.
    """
    sink = ("sink",)
    x: dict[int, float] = {}
    parts: list[set] = []
    for k, v in enumerate(nodes):
        h = nx.DiGraph()
        h.add_nodes_from(nodes)
        h.add_node(sink)
        for (a, b), c in caps.items():
            for p, q in ((a, b), (b, a)):
                if h.has_edge(p, q):
                    h[p][q]["capacity"] += c / 2
                else:
                    h.add_edge(p, q, capacity=c / 2)
        for u in nodes[k + 1:]:
            h.add_edge(u, sink)  # no capacity attribute: infinite, keeps later nodes out of S
        const = 0.0
        for u in nodes[:k]:
            if x[u] > 0:  # reward for taking u into S: pay x(u) when u is left out
                const -= x[u]
                if h.has_edge(v, u):
                    h[v][u]["capacity"] += x[u]
                else:
                    h.add_edge(v, u, capacity=x[u])
            elif x[u] < 0:
                h.add_edge(u, sink, capacity=-x[u])
        cut, (s_side, _) = nx.minimum_cut(h, v, sink, capacity="capacity")
        x[v] = cut + const - lam
        s = set(s_side) - {sink}
        merged = set(s)
        keep = []
        for p in parts:
            if p & s:
                merged |= p
            else:
                keep.append(p)
        parts = keep + [merged]
    return sum(x.values()), parts


def partition_bound(nodes: Sequence[int], caps: dict[tuple[int, int], float],
                    *, enumerate_up_to: int = 7) -> tuple[float, tuple[frozenset, ...]]:
    """The Tutte-Nash-Williams partition bound and a partition attaining it.

    ``min over partitions P of nodes into k >= 2 parts of cap(edges crossing P) / (k - 1)``,
    ``caps`` mapping undirected pairs ``(u, v)`` to GB/s. It equals the best fractional spanning
    tree packing. Exact either way: enumeration for ``len(nodes) <= enumerate_up_to``, else
    Dinkelbach's iteration on ``lam`` with :func:`_dilworth_min` (a handful of rounds of n minimum
    cuts each). Returns ``(0.0, components)`` for a disconnected graph.
    """
    nodes = list(nodes)
    if len(nodes) < 2:
        return math.inf, (frozenset(nodes),)
    ug = nx.Graph()
    ug.add_nodes_from(nodes)
    ug.add_edges_from(caps)
    if not nx.is_connected(ug):
        return 0.0, tuple(frozenset(c) for c in nx.connected_components(ug))
    if len(nodes) <= enumerate_up_to:
        return partition_bound_enumerate(nodes, caps)
    total = sum(caps.values())
    lam = total / (len(nodes) - 1)
    best_parts = tuple(frozenset([v]) for v in nodes)
    for _ in range(4 * len(nodes)):
        val, parts = _dilworth_min(nodes, caps, lam)
        if val + lam >= -1e-9 * max(lam, 1.0):
            break  # no partition beats lam: lam is the minimum ratio
        side = {v: i for i, p in enumerate(parts) for v in p}
        cross = sum(c for (a, b), c in caps.items() if side[a] != side[b])
        new = cross / (len(parts) - 1)
        if new >= lam - 1e-12:
            break
        lam, best_parts = new, tuple(frozenset(p) for p in parts)
    return lam, best_parts


# ============================================================================ packing problem
@dataclass
class _Problem:
    """A packing problem: resources with capacities, and a pricing oracle for trees.

    ``price(weights, usable) -> column`` returns a minimum-weight tree under per-resource weights
    using only resources whose ``usable`` flag is set (None if nothing spans).
    """

    caps: list[float]
    price: Callable[[Sequence[float], Sequence[bool]], Column | None]
    bound: float


def _broadcast_problem(g: nx.DiGraph, root: int, bound: float) -> tuple[_Problem, list[tuple[int, int]]]:
    """Arborescence packing from ``root``: one resource per edge of ``g`` (capacity attribute)."""
    edges = [(u, v) for u, v in g.edges if v != root]
    caps = [g[u][v]["capacity"] for u, v in edges]
    nodes = list(g.nodes)

    def price(w: Sequence[float], usable: Sequence[bool]) -> Column | None:
        live = [i for i in range(len(edges)) if usable[i]]
        idx = min_arborescence(nodes, root, [(*edges[i], w[i]) for i in live])
        return None if idx is None else tuple(sorted(live[i] for i in idx))

    return _Problem(caps, price, bound), edges


def _spanning_problem(nodes: list[int], ucaps: dict[tuple[int, int], float], bound: float
                      ) -> tuple[_Problem, list[tuple[int, int]]]:
    """Spanning-tree packing in the undirected graph ``ucaps``: one resource per pair."""
    pairs = sorted(ucaps)
    caps = [ucaps[p] for p in pairs]
    pos = {v: i for i, v in enumerate(nodes)}
    ipairs = [(pos[a], pos[b]) for a, b in pairs]

    def price(w: Sequence[float], usable: Sequence[bool]) -> Column | None:
        live = [i for i in range(len(pairs)) if usable[i]]
        idx = min_spanning_tree(len(nodes), [ipairs[i] for i in live], [w[i] for i in live])
        return None if idx is None else tuple(sorted(live[i] for i in idx))

    return _Problem(caps, price, bound), pairs


class _MasterLP:
    """The restricted master LP ``max sum x_T s.t. sum_{T contains e} x_T <= c_e``, on GLOP.

    Columns are kept across solves (GLOP re-solves incrementally); capacities can be lowered
    with :meth:`set_caps` for the residual problems of the dive.
    """

    def __init__(self, caps: Sequence[float]):
        self.caps = list(caps)
        self.cols: list[Column] = []
        self.seen: set[Column] = set()
        self._build()

    def _build(self) -> None:
        from ortools.linear_solver import pywraplp

        self.s = pywraplp.Solver.CreateSolver("GLOP")
        self.cons = [self.s.Constraint(-self.s.infinity(), c) for c in self.caps]
        self.obj = self.s.Objective()
        self.obj.SetMaximization()
        self.vars = []
        for col in self.cols:
            self._add_var(col)

    def _add_var(self, col: Column) -> None:
        var = self.s.NumVar(0.0, self.s.infinity(), "")
        for e in col:
            self.cons[e].SetCoefficient(var, 1.0)
        self.obj.SetCoefficient(var, 1.0)
        self.vars.append(var)

    def add(self, col: Column) -> bool:
        """Add a column (tree); False if it is already there."""
        if col in self.seen:
            return False
        self.seen.add(col)
        self.cols.append(col)
        self._add_var(col)
        return True

    def set_caps(self, caps: Sequence[float]) -> None:
        """Change the right-hand sides (capacities)."""
        self.caps = list(caps)
        for c, v in zip(self.cons, caps):
            c.SetUb(v)

    def solve(self) -> tuple[float, list[float], list[float]]:
        """Solve; return (objective, x per column, dual price per resource, >= 0).

        GLOP's incremental re-solve occasionally reports ABNORMAL on these degenerate LPs; the
        model is then rebuilt and solved from scratch.
        """
        for attempt in range(2):
            status = self.s.Solve()
            if status == self.s.OPTIMAL:
                break
            self._build()
        else:
            raise RuntimeError(f"GLOP failed on the packing LP (status {status})")
        x = [max(v.solution_value(), 0.0) for v in self.vars]
        y = [max(c.dual_value(), 0.0) for c in self.cons]
        return self.obj.Value(), x, y


def _column_generation(prob: _Problem, lp: _MasterLP, target: float, max_rounds: int = 5000
                       ) -> tuple[float, list[float], int]:
    """Solve the master LP (capacities ``lp.caps``) to optimality by column generation.

    Each round prices a minimum-weight tree under the dual prices ``y`` and adds it if its
    reduced cost ``1 - y(T)`` is negative. Among trees of (nearly) equal price the pricing prefers
    resources with slack (a small term ``load / cap``): without it the many zero duals of these
    degenerate LPs let pricing return useless trees and generation tails off. Stops when the LP
    value reaches ``target`` (an upper bound on it, computed independently), when no tree prices
    out, or after ``max_rounds``. Returns (LP value, x per column of ``lp``, rounds).
    """
    caps = lp.caps
    scale = max(caps)
    usable = [c > 1e-9 * scale for c in caps]
    z, x, y = lp.solve()
    rounds = 0
    while rounds < max_rounds and z < target * (1 - 1e-9):
        load = [0.0] * len(caps)
        for col, v in zip(lp.cols, x):
            for e in col:
                load[e] += v
        ypos = [v for v in y if v > 0]
        tau = 1e-3 * (min(ypos) if ypos else 1.0 / max(z, 1e-9 * scale))
        col = prob.price([y[e] + tau * load[e] / caps[e] if usable[e] else 0.0
                          for e in range(len(caps))], usable)
        rounds += 1
        if col is None:
            break
        if sum(y[e] for e in col) >= 1 - 1e-9 or col in lp.seen:
            # the slack-preferring pricing found nothing: price the plain duals to be sure
            col = prob.price([y[e] + 1e-12 * scale / caps[e] if usable[e] else 0.0
                              for e in range(len(caps))], usable)
            if col is None or sum(y[e] for e in col) >= 1 - 1e-9 or not lp.add(col):
                break
        else:
            lp.add(col)
        z, x, y = lp.solve()
    return z, x, rounds


def _dive(prob: _Problem, lp: _MasterLP, z: float, x: Sequence[float], *, target: float,
          pick: str = "weight", cg_rounds: int = 50) -> tuple[list[Column], list[float], int]:
    """Turn an optimal LP packing of rate ``z`` into few trees of total rate >= ``target``
    (a price-and-dive heuristic).

    Repeatedly take a column of the current LP solution (``pick="weight"``: the heaviest;
    ``"wide"``: the one with the widest residual bottleneck) and commit it at the largest weight
    the residual capacities allow (it saturates one of its links) if the rest can still reach the
    remaining target; otherwise at its LP weight (which always leaves the rest of the LP solution
    feasible). Commits are taken off the capacities and the LP re-optimises the residual problem;
    to test a full-weight commit, column generation (at most ``cg_rounds`` rounds) may add trees
    to ``lp``. Returns (trees, weights, column generation rounds).
    """
    caps = list(lp.caps)
    res = list(caps)
    scale = max(caps)
    trees: list[Column] = []
    weights: list[float] = []
    placed = 0.0
    rounds = 0
    while placed < target * (1 - 1e-9):
        live = [t for t in range(len(x)) if x[t] > 1e-9 * scale]
        if not live:
            break
        if pick == "wide":
            t = max(live, key=lambda t: (min(res[e] for e in lp.cols[t]), x[t]))
        else:
            t = max(live, key=x.__getitem__)
        col, xt = lp.cols[t], x[t]
        full = min(min(res[e] for e in col), z - placed)
        committed = None
        if full > xt * (1 + 1e-9):
            need = max(target - placed - full, 0.0)
            lp.set_caps([r - full if e in col else r for e, r in enumerate(res)])
            z2, x2, _ = lp.solve()  # the trees we have first; new ones only if they fall short
            if z2 < need * (1 - 1e-9):
                z2, x2, r2 = _column_generation(prob, lp, z - placed - full, max_rounds=cg_rounds)
                rounds += r2
            if z2 >= need * (1 - 1e-9):
                committed, x = full, x2
        if committed is None:
            # at its LP weight the rest of the LP solution still fits: no new trees needed
            committed = min(xt, z - placed)
            lp.set_caps([r - committed if e in col else r for e, r in enumerate(res)])
            _, x, _ = lp.solve()
        cset = set(col)
        res = [max(r - committed, 0.0) if e in cset else r for e, r in enumerate(res)]
        trees.append(col)
        weights.append(committed)
        placed += committed
    lp.set_caps(caps)
    merged: dict[Column, float] = {}
    for c, w in zip(trees, weights):
        merged[c] = merged.get(c, 0.0) + w
    return list(merged), list(merged.values()), rounds


def _mwu(prob: _Problem, eps: float = 0.05, target: float | None = None,
         max_iter: int = 200_000) -> tuple[float, list[Column], list[float], int]:
    """Garg-Koenemann multiplicative weights for the packing LP (the paper's approximate method).

    Lengths start at ``delta / c_e``; each round routes the bottleneck capacity on a shortest
    (minimum-length) tree and multiplies the length of each of its edges by ``1 + eps * c_min / c_e``,
    until ``sum c_e l_e >= 1``; the flow is then scaled down by its worst congestion so it is
    feasible. Also stops early once the scaled rate reaches ``target``. Returns (rate, columns,
    weights, rounds).
    """
    caps = prob.caps
    m = len(caps)
    delta = (1 + eps) / ((1 + eps) * m) ** (1 / eps)
    length = [delta / c for c in caps]
    load = [0.0] * m
    flow: dict[Column, float] = {}
    rounds = 0
    total = 0.0
    usable = [True] * m
    while rounds < max_iter and sum(c * l for c, l in zip(caps, length)) < 1:
        col = prob.price(length, usable)
        if col is None:
            break
        rounds += 1
        cmin = min(caps[e] for e in col)
        flow[col] = flow.get(col, 0.0) + cmin
        total += cmin
        for e in col:
            load[e] += cmin
            length[e] *= 1 + eps * cmin / caps[e]
        if target is not None and rounds % 16 == 0:
            if total / max(load[e] / caps[e] for e in range(m)) >= target:
                break
    cong = max(load[e] / caps[e] for e in range(m))
    cols = list(flow)
    return total / cong, cols, [flow[c] / cong for c in cols], rounds


def _solve_lp_over(caps: Sequence[float], cols: Sequence[Column]) -> tuple[float, list[float]]:
    """Max total weight of the given trees under the capacities (a small LP)."""
    lp = _MasterLP(caps)
    for c in cols:
        lp.add(c)
    z, x, _ = lp.solve()
    return z, x


def max_weights(caps: Sequence[float], cols: Sequence[Sequence[int]]) -> tuple[float, list[float]]:
    """The heaviest weights of the given trees under the capacities: the LP
    ``max sum x_T s.t. sum_{T contains e} x_T <= caps[e], x >= 0``.

    Args:
        caps: capacity (GB/s) of each resource (edge or undirected pair).
        cols: each tree as the indices of the resources it uses.

    Returns:
        ``(total rate, weight of each tree)``.
    """
    return _solve_lp_over(caps, [tuple(sorted(c)) for c in cols])


def _widest_bottleneck(prob: _Problem) -> float:
    """The largest ``t`` such that the resources of capacity >= ``t`` still hold a tree (the
    widest any single tree can be)."""
    caps = prob.caps
    for t in sorted(set(caps), reverse=True):
        usable = [c >= t for c in caps]
        if prob.price([0.0] * len(caps), usable) is not None:
            return t
    return 0.0


def _fewest_trees(caps: Sequence[float], cols: Sequence[Column], hint: Sequence[float], lp_rate: float,
                  deterministic_s: float) -> tuple[list[Column], str]:
    """Choose as few of ``cols`` as possible that carry >= IP_RATE_FRACTION * lp_rate (CP-SAT).

    Integer program, weights in units of ``lp_rate / 4000``: ``x_T`` in ``[0, cap_T]``, ``x_T > 0``
    only if the boolean ``y_T``; ``sum_{T contains e} x_T <= c_e``; ``sum x_T >= 0.99 lp_rate``;
    minimise ``(S + 1) * sum y_T - sum x_T`` (fewest trees first, then the highest rate). One
    worker and a deterministic time limit, so that every process plans the same trees; ``hint``
    (a feasible packing, e.g. the dive's) starts the search. Returns (kept columns, status).
    """
    from ortools.sat.python import cp_model

    steps = 4000
    unit = lp_rate / steps
    m = cp_model.CpModel()
    xs, ys = [], []
    for c in cols:
        cap_t = int(math.floor(min(caps[e] for e in c) / unit + 1e-9))
        x, y = m.NewIntVar(0, cap_t, ""), m.NewBoolVar("")
        m.Add(x <= cap_t * y)
        m.Add(x >= 1).OnlyEnforceIf(y)
        xs.append(x)
        ys.append(y)
    by_res: list[list[int]] = [[] for _ in caps]
    for t, c in enumerate(cols):
        for e in c:
            by_res[e].append(t)
    for e, ts in enumerate(by_res):
        if ts:
            m.Add(sum(xs[t] for t in ts) <= int(math.floor(caps[e] / unit + 1e-9)))
    hint_units = [int(math.floor(h / unit)) for h in hint]
    # the hint's weights are rounded down to whole units: never ask for more than it carries
    m.Add(sum(xs) >= min(int(math.ceil(IP_RATE_FRACTION * steps)), sum(hint_units)))
    m.Minimize((steps + 1) * sum(ys) - sum(xs))
    for t, hx in enumerate(hint_units):
        m.AddHint(xs[t], hx)
        m.AddHint(ys[t], 1 if hx > 0 else 0)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_deterministic_time = deterministic_s
    status = solver.Solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return [], solver.StatusName(status)
    return [cols[t] for t in range(len(cols)) if solver.Value(ys[t])], solver.StatusName(status)


def _ip_time(n: int) -> float:
    """CP-SAT deterministic time budget (about seconds on one core) for ``n`` devices."""
    return 0.3 if n <= 8 else 2.0


def _pack(prob: _Problem, n: int, method: str) -> tuple[list[Column], list[float], dict[str, Any]]:
    """Pack trees for ``prob``: LP (column generation or MWU), dive, then fewest trees (CP-SAT).

    Returns (trees, weights in GB/s, info for :meth:`Plan.explain`).
    """
    info: dict[str, Any] = {}
    lp = _MasterLP(prob.caps)
    if method == "mwu":
        z, cols, w, rounds = _mwu(prob, target=IP_RATE_FRACTION * prob.bound)
        info.update(mwu_rounds=rounds, mwu_trees=len(cols), mwu_rate=z)
        for c in cols:
            lp.add(c)
        # the same minimisation as the exact path, restricted to the trees MWU found
        z, x, _ = lp.solve()
        info.update(lp_rate=z, columns=len(cols))
        hint_sets = [(cols, w)] + [_dive(prob, lp, z, x, target=IP_RATE_FRACTION * z, pick=pick,
                                         cg_rounds=0)[:2] for pick in ("weight", "wide")]
    else:
        z, x, rounds = _column_generation(prob, lp, prob.bound)
        info.update(cg_rounds=rounds, lp_rate=z, lp_trees=sum(1 for v in x if v > 1e-9 * z))
        hint_sets = []
        variants = (1.0, IP_RATE_FRACTION) if n <= 8 else (IP_RATE_FRACTION,)
        for pick in ("weight", "wide"):
            for frac in variants:
                hint_sets.append(_dive(prob, lp, z, x, target=frac * z, pick=pick)[:2])
        info["columns"] = len(lp.cols)
    best_cols, best_w = min(hint_sets, key=lambda cw: (len(cw[0]), -sum(cw[1])))
    info["dive_trees"] = len(best_cols)
    lower = math.ceil(IP_RATE_FRACTION * z / max(_widest_bottleneck(prob), 1e-300) - 1e-9)
    info["tree_lower_bound"] = lower
    status = "dive reached the lower bound"
    if len(best_cols) > lower:
        index = {c: i for i, c in enumerate(lp.cols)}
        hint = [0.0] * len(lp.cols)
        for c, v in zip(best_cols, best_w):
            hint[index[c]] += v
        kept, status = _fewest_trees(prob.caps, lp.cols, hint, z, _ip_time(n))
        if kept and len(kept) <= len(best_cols):
            rate, w = _solve_lp_over(prob.caps, kept)
            if rate >= IP_RATE_FRACTION * z * (1 - 1e-9) and (len(kept), -rate) < (len(best_cols), -sum(best_w)):
                best_cols, best_w = kept, w
    info["ip_status"] = status
    pairs = [(c, v) for c, v in zip(best_cols, best_w) if v > 1e-9 * z]
    pairs.sort(key=lambda cv: (-cv[1], cv[0]))
    return [c for c, _ in pairs], [v for _, v in pairs], info


# ============================================================================ the Plan
def _n_trees(k, noun: str = "tree") -> str:
    """``k`` trees in words: "1 tree", "3 trees"."""
    return f"{k} {noun}{'s' if k != 1 else ''}"


@dataclass(frozen=True)
class Plan:
    """Trees and weights that carry one collective over a topology, with their certificate.

    Attributes:
        collective: ``"broadcast"``, ``"reduce"`` or ``"allreduce"``.
        root: the root device id (broadcast/reduce, or an allreduce asked for one root), else None.
        trees: ``((tree, weight), ...)``: each tree a frozen ``networkx.DiGraph`` spanning
            arborescence over all devices of the topology, edges pointing away from its root;
            weight in GB/s. Convention: for ``reduce`` the edges point away from the root but the
            data flows against them (edge ``u -> v`` sends from ``v`` to ``u``); for
            ``allreduce`` data flows against the edges (reduce) and then along them (broadcast).
        rate: GB/s of the whole collective (sum of the weights).
        bound: GB/s no plan of this form can beat, computed independently of the solver
            (broadcast/reduce: min over devices of a max-flow; allreduce: partition bound).
        topology: the :class:`Topology` planned over.
        method: ``"exact"`` or ``"mwu"``.
        roots: each tree's root, in the order of ``trees``.
        info: solver statistics behind :meth:`explain` (not part of equality).
    """

    collective: str
    root: int | None
    trees: tuple[tuple[nx.DiGraph, float], ...]
    rate: float
    bound: float
    topology: Topology
    method: str
    roots: tuple[int, ...]
    info: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_trees(self) -> int:
        """Number of trees."""
        return len(self.trees)

    @property
    def efficiency(self) -> float:
        """``rate / bound`` (1.0 for a single device)."""
        if math.isinf(self.bound):
            return 1.0
        return self.rate / self.bound if self.bound > 0 else 0.0

    def link_loads(self) -> dict[tuple[int, int], float]:
        """GB/s that the plan puts on each directed link ``(u, v)`` (see the class docstring's
        convention: broadcast uses ``u -> v`` of a tree edge, reduce ``v -> u``, allreduce both)."""
        loads: dict[tuple[int, int], float] = {}
        for tree, w in self.trees:
            for u, v in tree.edges:
                dirs = {"broadcast": [(u, v)], "reduce": [(v, u)]}.get(self.collective, [(u, v), (v, u)])
                for d in dirs:
                    loads[d] = loads.get(d, 0.0) + w
        return loads

    def check(self, tol: float = 1e-6) -> None:
        """Check the plan: every tree spans all devices from its root, no link is over capacity.

        Args:
            tol: GB/s a link may carry above its capacity (rounding).

        Raises:
            AssertionError: A tree is not a spanning arborescence rooted at its root, a weight
                is not positive, a link carries more than its capacity, or the rate is not the
                sum of the weights.
        """
        devs = set(self.topology.devices)
        for (tree, w), r in zip(self.trees, self.roots):
            assert set(tree.nodes) == devs, f"tree rooted at {r} does not span {sorted(devs)}"
            assert nx.is_arborescence(tree), f"tree rooted at {r} is not an arborescence"
            assert tree.in_degree(r) == 0, f"tree's root is not {r}"
            assert w > 0, f"tree rooted at {r} has weight {w}"
        for (u, v), load in self.link_loads().items():
            cap = self.topology.capacity(u, v)
            assert load <= cap + tol, f"link {u}->{v} carries {load:.6g} GB/s > capacity {cap:.6g}"
        assert abs(self.rate - sum(w for _, w in self.trees)) <= tol * max(1.0, self.rate) or not self.trees

    def __repr__(self) -> str:
        head = (f"Plan({self.collective}, {self.topology.name}, root={self.root}, method={self.method}: "
                f"{self.num_trees} tree{'s' if self.num_trees != 1 else ''}, rate {self.rate:.2f} GB/s, bound {self.bound:.2f} GB/s, "
                f"efficiency {100 * self.efficiency:.1f}%)")
        lines = [head]
        for k, ((tree, w), r) in enumerate(zip(self.trees, self.roots)):
            edges = " ".join(f"{u}->{v}" for u, v in tree.edges)
            lines.append(f"  tree {k}: root {r}, {w:.3f} GB/s, edges {edges}")
        return "\n".join(lines)

    def explain(self) -> str:
        """Why these trees: rate against the bound, the binding cut, the solver's path, roots."""
        i = self.info
        t = self.topology
        out = [f"{self.collective} over {t.n} devices {list(t.devices)} of {t.name}: {self.num_trees} "
               f"tree{'s' if self.num_trees != 1 else ''}, rate {self.rate:.2f} GB/s = {100 * self.efficiency:.1f}% of the bound "
               f"{self.bound:.2f} GB/s."]
        if t.n == 1:
            return out[0] + " A single device: nothing moves."
        if self.collective in ("broadcast", "reduce"):
            toward = "to" if self.collective == "broadcast" else "from"
            side = sorted(i.get("cut_side", ()))
            other = sorted(set(t.devices) - set(side))
            direction = f"{side} -> {other}" if self.collective == "broadcast" else f"{other} -> {side}"
            out.append(
                f"Bound: the max-flow {toward} device {i.get('cut_node')} is the smallest, "
                f"{self.bound:.2f} GB/s: the links of the cut {direction} bind. By Edmonds' "
                f"branching theorem arborescences from the root can fill it.")
        else:
            parts = i.get("partition", ())
            out.append(
                f"Bound: the partition {' | '.join(str(sorted(p)) for p in parts)} has "
                f"{self.bound * (len(parts) - 1):.2f} GB/s (the smaller direction of each pair) "
                f"crossing between its {len(parts)} parts, and each tree crosses at least "
                f"{len(parts) - 1} of them: {self.bound:.2f} GB/s. By Tutte-Nash-Williams spanning "
                f"trees can reach it. Each tree of weight w uses w on both directions of its links.")
        if i.get("stars"):
            out.append(
                f"All pairs are linked and {t.n} one-hop stars (each device the root of its own "
                f"1/{t.n} of the data, {self.trees[0][1]:.2f} GB/s each) reach the bound, so the "
                f"plan is exactly that: the fewest hops, the lowest latency. No solver ran.")
            return "\n".join(out)
        if self.method == "mwu":
            out.append(f"Solver: multiplicative weights (Garg-Koenemann), {i.get('mwu_rounds')} rounds, "
                       f"{_n_trees(i.get('mwu_trees'), 'distinct tree')} at {i.get('mwu_rate', 0):.2f} GB/s (an LP "
                       f"over those trees: {i.get('lp_rate', 0):.2f} GB/s); dives gave "
                       f"{_n_trees(i.get('dive_trees'))}.")
        else:
            out.append(f"Solver: LP by column generation ({i.get('cg_rounds')} pricing rounds, "
                       f"minimum-weight {'spanning trees' if self.collective == 'allreduce' else 'arborescences'}), "
                       f"LP rate {i.get('lp_rate', 0):.2f} GB/s with {_n_trees(i.get('lp_trees'))}; "
                       f"dives gave {_n_trees(i.get('dive_trees'))}.")
        out.append(f"Fewest trees: integer program over "
                   f"{_n_trees(i.get('columns', i.get('mwu_trees')), 'candidate tree')} at >= {100 * IP_RATE_FRACTION:.0f}% of the LP rate ({i.get('ip_status')}; "
                   f"no fewer than {_n_trees(i.get('tree_lower_bound'))} can carry it, as no tree is "
                   f"wider than its narrowest link). Kept {i.get('solver_trees', self.num_trees)}.")
        if self.collective == "allreduce":
            if self.root is None:
                out.append(
                    "Roots: a tree's link use does not depend on its root, so one root would reach the "
                    f"same rate; the weights of the {_n_trees(i.get('solver_trees'))} are split into "
                    f"{self.num_trees} (tree, root) pieces so that each device roots "
                    f"{self.rate / t.n:.2f} GB/s (1/n of the data), which spreads the final "
                    "reductions over all devices.")
            else:
                out.append(f"Roots: all trees rooted at {self.root}, as asked; the rate does not depend on it.")
        out.append(f"Planned in {i.get('solve_s', 0):.3f} s.")
        return "\n".join(out)


# ============================================================================ building trees
def _arborescence(devices: Sequence[int], edges: Sequence[tuple[int, int]]) -> nx.DiGraph:
    """A frozen DiGraph on ``devices`` (in order) with ``edges`` in BFS order from the root."""
    g = nx.DiGraph()
    g.add_nodes_from(devices)
    children: dict[int, list[int]] = {}
    indeg = {v: 0 for v in devices}
    for u, v in edges:
        children.setdefault(u, []).append(v)
        indeg[v] += 1
    root = next(v for v in devices if indeg[v] == 0)
    order = [root]
    for u in order:
        for v in sorted(children.get(u, ())):
            g.add_edge(u, v)
            order.append(v)
    return nx.freeze(g)


def _orient(devices: Sequence[int], pairs: Sequence[tuple[int, int]], root: int) -> nx.DiGraph:
    """The undirected tree ``pairs`` as an arborescence pointing away from ``root``."""
    ug = nx.Graph(list(pairs))
    ug.add_nodes_from(devices)
    return _arborescence(devices, list(nx.bfs_edges(ug, root)))


def _split_roots(devices: Sequence[int], cols: Sequence[Column], weights: Sequence[float]
                 ) -> list[tuple[Column, int, float]]:
    """Give each device ``sum(weights) / n`` of root duty: lay the trees' weights end to end,
    cut that line into n equal segments, and root each piece at its segment's device.
    Returns ``(tree, root, weight)`` pieces: at most ``len(cols) + n - 1``."""
    n = len(devices)
    share = sum(weights) / n
    pieces = []
    start = 0.0
    for col, w in zip(cols, weights):
        a, b = start, start + w
        start = b
        k = min(int(a / share), n - 1)
        while a < b - 1e-12 * share:
            end = min(b, (k + 1) * share) if k < n - 1 else b
            if end - a > 1e-9 * share:
                pieces.append((col, devices[k], end - a))
            a = end
            k += 1
    return pieces


# ============================================================================ planning
def _check_args(topology: Topology, collective: str, root: int | None, method: str) -> int | None:
    """Validate the arguments of :func:`plan`; return the root to use."""
    if not isinstance(topology, Topology):
        raise ValueError(f"plan() needs a Topology, got {type(topology).__name__}")
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; allowed: {', '.join(COLLECTIVES)}")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; allowed: {', '.join(METHODS)}")
    if root is None:
        return None if collective == "allreduce" else topology.devices[0]
    if isinstance(root, bool) or not isinstance(root, int) or root not in topology.devices:
        raise ValueError(f"root {root!r} is not a device of {topology.name}; allowed: {list(topology.devices)}")
    return root


def _not_connected(topology: Topology, reached: set, what: str) -> ValueError:
    """The error for a topology whose links do not join all devices for a collective."""
    missing = sorted(set(topology.devices) - reached)
    return ValueError(
        f"devices {missing} are not connected to {sorted(reached)} over the links of "
        f"{topology.name} ({what}); no tree can span them. Use Topology.preset(..., pcie=True) "
        f"or pass links for the missing pairs (Topology.from_links).")


def plan(topology: Topology, collective: str, root: int | None = None, *, method: str = "exact") -> Plan:
    """Plan ``collective`` over ``topology``: trees, weights (GB/s), rate and its bound.

    Args:
        topology: the devices and links (:class:`~jax_blink.planning.topology.Topology`).
        collective: ``"broadcast"``, ``"reduce"`` or ``"allreduce"``.
        root: broadcast source / reduce destination (default ``topology.devices[0]``). For
            allreduce, None lets the planner choose (spread) the roots; a device id roots every
            tree there.
        method: ``"exact"`` (LP by column generation, then fewest trees) or ``"mwu"``
            (multiplicative weights, then fewest trees).

    Returns:
        A :class:`Plan`; cached per (topology key, collective, root, method).

    Raises:
        ValueError: unknown collective/method, root not a device, or links that do not connect
            the devices (the message names them).

    Example::

        >>> p = jax_blink.plan(jax_blink.Topology.preset("dgx1v"), "broadcast", 0)
        >>> p.num_trees, round(p.rate), round(p.bound)
        (6, 150, 150)
    """
    root = _check_args(topology, collective, root, method)
    p = _plan_cached(topology, collective, root, method)
    return p if p.topology is topology else replace(p, topology=topology)


def clear_plan_cache() -> None:
    """Forget every cached plan."""
    _plan_cached.cache_clear()


@functools.lru_cache(maxsize=1024)
def _plan_cached(topology: Topology, collective: str, root: int | None, method: str) -> Plan:
    """:func:`plan` after argument checks (Topology hashes and compares by its key)."""
    t0 = time.perf_counter()
    devs = list(topology.devices)
    g = topology.simple_graph()
    if topology.n == 1:
        # one device: nothing moves; no trees, infinite rate
        return Plan(collective, root, (), math.inf, math.inf, topology, method, (), {"solve_s": 0.0})
    if collective == "allreduce":
        p = _plan_allreduce(topology, g, root, method)
    else:
        p = _plan_rooted(topology, g, collective, root, method)
    p.info["solve_s"] = time.perf_counter() - t0
    return p


def _plan_rooted(topology: Topology, g: nx.DiGraph, collective: str, root: int, method: str) -> Plan:
    """Broadcast from / reduce to ``root``: arborescence packing (reduce on reversed links)."""
    work = g if collective == "broadcast" else nx.DiGraph(g).reverse(copy=True)
    reached = {root} | nx.descendants(work, root)
    if len(reached) < topology.n:
        raise _not_connected(topology, reached, f"{collective} {'from' if collective == 'broadcast' else 'to'} {root}")
    bound, cut_node, side = broadcast_bound(work, root)
    prob, edges = _broadcast_problem(work, root, bound)
    cols, weights, info = _pack(prob, topology.n, method)
    info.update(cut_node=cut_node, cut_side=tuple(sorted(side)))
    trees = tuple((_arborescence(topology.devices, [edges[e] for e in c]), w) for c, w in zip(cols, weights))
    return Plan(collective, root, trees, sum(weights), bound, topology, method,
                tuple(root for _ in trees), info)


def _plan_allreduce(topology: Topology, g: nx.DiGraph, root: int | None, method: str) -> Plan:
    """Allreduce: spanning-tree packing on ``min(c(u,v), c(v,u))``; roots spread or fixed."""
    devs = list(topology.devices)
    ucaps = _undirected_caps(g)
    ug = nx.Graph()
    ug.add_nodes_from(devs)
    ug.add_edges_from(ucaps)
    if not nx.is_connected(ug):
        start = root if root is not None else devs[0]
        raise _not_connected(topology, nx.node_connected_component(ug, start),
                             "allreduce needs links in both directions")
    bound, parts = partition_bound(devs, ucaps)
    info: dict[str, Any] = {"partition": parts}
    n = len(devs)
    if root is None and len(ucaps) == n * (n - 1) // 2:
        w = min(ucaps.values()) / 2  # star i and star j both use pair {i, j}
        if n * w >= bound * (1 - 1e-9):
            info["stars"] = True
            trees = tuple((_arborescence(devs, [(r, v) for v in devs if v != r]), w) for r in devs)
            return Plan("allreduce", None, trees, n * w, bound, topology, method, tuple(devs), info)
    prob, pairs = _spanning_problem(devs, ucaps, bound)
    cols, weights, pinfo = _pack(prob, n, method)
    info.update(pinfo)
    info["solver_trees"] = len(cols)
    if root is None:
        pieces = _split_roots(devs, cols, weights)
    else:
        pieces = [(c, root, w) for c, w in zip(cols, weights)]
    trees = tuple((_orient(devs, [pairs[e] for e in c], r), w) for c, r, w in pieces)
    return Plan("allreduce", root, trees, sum(w for *_, w in pieces), bound, topology, method,
                tuple(r for _, r, _ in pieces), info)


#: Link kinds that are NVLink: direct links, and the NVSwitch fabric (links into a switch).
_NVLINK_KINDS = frozenset({"nvlink", "switch"})


def hybrid_share(plan: Plan, engine: str = DEFAULT_HOST_ENGINE) -> tuple[float, float]:
    """Blink's hybrid transfer for a 2-device all-reduce: ``(host_gbps, fraction)``.

    ``host_gbps`` is what the host channel (GPU -> pinned host memory -> GPU,
    :func:`jax_blink.planning.topology.host_path_gbps` with the executor's ``engine``, ``"ce"`` or ``"sm"``;
    the slower direction) moves beside the trees. The
    trees reach ``nv = plan.rate * NVLINK_EFFICIENCY`` (:data:`jax_blink.planning.topology.NVLINK_EFFICIENCY`:
    the plan's rate is nominal, SM-driven peer writes reach less of it), and
    ``fraction = host / (nv + host)`` is the share of the elements to send through the host so
    that both channels, each at the rate it actually reaches, finish together (2 x H200, NV18,
    gen5 x16: 38 / (364 + 38) = 0.095 with copy engines, 28 / (364 + 28) = 0.071 with SMs).

    ``(0.0, 0.0)`` for other collectives, other device counts, unknown host links, or two devices
    not linked by NVLink alone (kind ``"nvlink"`` or ``"switch"`` in both directions): where the
    trees run over PCIe or host links, the host path would share those same links, so it is no
    second channel."""
    devs = plan.topology.devices
    if plan.collective != "allreduce" or len(devs) != 2 or plan.rate <= 0:
        return 0.0, 0.0
    a, b = devs
    g = plan.topology.simple_graph()
    for u, v in ((a, b), (b, a)):
        if not g.has_edge(u, v) or not set(g[u][v]["kinds"]) <= _NVLINK_KINDS:
            return 0.0, 0.0
    host = min(host_path_gbps(plan.topology, a, b, engine), host_path_gbps(plan.topology, b, a, engine))
    if host <= 0:
        return 0.0, 0.0
    nv = plan.rate * NVLINK_EFFICIENCY
    return host, host / (nv + host)
