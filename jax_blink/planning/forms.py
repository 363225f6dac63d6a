"""The forms of an all-reduce, their modelled times, and the planner's choice among them.

An all-reduce can run in several forms, each a program the executors already run (one flat int32
program of :mod:`jax_blink.planning.schedule`: segments, each with a tree, reduce and broadcast
phases, checked bitwise against ``lax`` in ``tests/unit/test_forms.py``):

* ``reduce_broadcast``: Blink's form: the packed trees of :func:`jax_blink.planning.packing.plan`,
  each reduces its share of the operand toward its root and broadcasts it back.
* ``scatter_gather``: reduce-scatter + all-gather over the same trees: the operand is cut in n
  blocks, block k is reduced up each tree re-rooted at rank k and broadcast down from rank k (one
  segment per tree and block, both phases).
* ``rings``: NCCL's rings where the links hold them: block k of ring R is a chain along R whose
  root is R[k] (its reduce runs along the ring, its broadcast back against it, on the reverse
  links, which the reverse ring leaves free), i.e. a ring reduce-scatter + all-gather.
* ``shallow_trees``: fewer, shallower trees: a subset of the packed trees and of the widest
  breadth-first (minimum-depth) spanning trees, re-weighted by a small LP and each rooted at its
  centre; at middle sizes a few shallow trees in few pipeline steps beat many deep, light ones.
* ``one_hop``: the CUDA executor's one-hop kernels (LL up to :data:`LL_MAX_BYTES` on at most
  :data:`LL_MAX_RANKS` GPUs, one-shot up to :data:`ONESHOT_MAX_BYTES` on 2): every rank writes its
  operand into every peer's inbox. Only on GPU topologies (no ``host`` links) whose every pair is
  linked directly; the program is the ``reduce_broadcast`` one (the executor picks its one-hop
  kernel for any gap-free all-reduce program within its limits).

Times (:mod:`jax_blink.planning.model`, S bytes per device, alpha per hop, c the chunk):

* trees (``reduce_broadcast``, ``shallow_trees``): ``max over trees (2D + k - 1)(alpha + c / w)``
  with the best chunk, the model's tree formula (:func:`jax_blink.planning.model.best_time`);
* ``scatter_gather``: the same per (tree, block) pipeline, each carrying S w / (n R) at w / n
  (the n blocks share the tree's links), depth from rank k;
* ``rings``: NCCL's formula :func:`jax_blink.planning.model.ring_allreduce_us`, the one the NCCL
  baseline uses, on the rings of :func:`jax_blink.planning.model.rings` at the rate their chain
  realisation reaches on the links (equal to the baseline's where each link's two directions carry
  as many rings: then the ring form is modelled exactly as the baseline);
* ``one_hop``: ``alpha + f S / c_min`` (f = 2 for LL, whose lines carry a flag beside the data;
  1 for one-shot), c_min the slowest pair's capacity.

:func:`choose` ranks every form that applies and returns the fastest; the expensive part (plans,
the shallow-tree search) is cached per topology and size class (:func:`size_class`), the ranking
per exact size.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from jax_blink.options.settings import ALLREDUCE_FORMS
from jax_blink.planning import schedule as _schedule
from jax_blink.planning.model import (MODEL, RingPlan, _chunk_candidates, _links_by_pair, _pack_rings,
                                      _pipeline_time, best_time, ring_allreduce_us, rings)
from jax_blink.planning.packing import max_weights, plan as _plan
from jax_blink.planning.topology import Topology

__all__ = ["FORMS", "AUTO", "Form", "Choice", "choose", "forms_at", "segments", "size_class",
           "LL_MAX_BYTES", "LL_MAX_RANKS", "ONESHOT_MAX_BYTES", "clear_cache", "runs_ll", "runs_ll_blocks"]

#: The all-reduce forms, in the order ties are broken (the first of equal times wins).
#: ``config.allreduce_form`` value: let the planner choose.
AUTO = "auto"
#: The all-reduce forms, in the order ties are broken (the first of equal times wins): the values of
#: ``config.allreduce_form`` but "auto", which the options layer checks.
FORMS = tuple(f for f in ALLREDUCE_FORMS if f != AUTO)
#: The CUDA executor's one-hop limits (kernels/cuda/executor.h defaults: kDefaultLLMaxBytes,
#: kMaxLLRanks, kDefaultOneShotMaxBytes; the one-shot kernel runs on 2 GPUs only).
LL_MAX_BYTES, LL_MAX_RANKS, ONESHOT_MAX_BYTES = 512 << 10, 8, 8 << 20

#: Most devices of a uniform mesh whose rings the exact ring search finds (beyond: stride rings).
_EXACT_MESH_RINGS = 8
_BOTH = _schedule.PHASE_REDUCE | _schedule.PHASE_BROADCAST
# A piece: (root rank, parent rank per rank, weight GB/s). A block: the pieces sharing one
# contiguous range of the operand, split by weight.
Piece = tuple[int, tuple[int, ...], float]


@dataclass(frozen=True)
class Form:
    """One all-reduce form on one topology, priced at one size.

    Attributes:
        name: one of :data:`FORMS`.
        time_us: modelled time (us) of the all-reduce at ``nbytes`` per device.
        nbytes: the size priced, bytes per device.
        chunk_bytes: the pipelining chunk the model priced (tree forms), None where the program
            keeps the schedule's default (rings, one hop).
        blocks: the program's layout: blocks of pieces ``(root rank, parents by rank, weight)``;
            the operand is cut in ``len(blocks)`` equal blocks, each split over its pieces by weight.
        why: what the form is and what its time is made of, in words.
    """

    name: str
    time_us: float
    nbytes: float
    chunk_bytes: int | None
    blocks: tuple[tuple[Piece, ...], ...]
    why: str


@dataclass(frozen=True)
class Choice:
    """The forms that apply on a topology at one size, fastest first (``ranked[0]`` is chosen).

    Attributes:
        ranked: the forms, by modelled time (ties: :data:`FORMS` order).
        forced: True when ``ranked[0]`` was asked for (``form=``) rather than chosen.
    """

    ranked: tuple[Form, ...]
    forced: bool = False

    @property
    def form(self) -> Form:
        """The form that runs."""
        return self.ranked[0]

    def runner_up(self) -> Form | None:
        """The fastest form other than the one that runs, or None if it is the only one."""
        return self.ranked[1] if len(self.ranked) > 1 else None

    def margin(self) -> float:
        """Modelled time of the runner-up over the chosen one's (1.0 with no runner-up)."""
        r = self.runner_up()
        if r is None or self.form.time_us <= 0:
            return 1.0
        return r.time_us / self.form.time_us

    def line(self) -> str:
        """One line: which form, by how much it beat the next (modelled), and why."""
        f, r = self.form, self.runner_up()
        head = (f"all-reduce form: {f.name} ({'forced by allreduce_form' if self.forced else 'chosen'}; "
                f"modelled {f.time_us:.1f} us at {f.nbytes:.0f} bytes per rank")
        if r is not None:
            head += (f", {self.margin():.2f}x the speed of the next, {r.name} at {r.time_us:.1f} us"
                     if not self.forced else f"; {r.name} is modelled at {r.time_us:.1f} us")
        others = ", ".join(f"{x.name} {x.time_us:.1f} us" for x in self.ranked[2:])
        return head + (f"; then {others}" if others else "") + f"): {f.why}"


def size_class(nbytes: float) -> int:
    """The size class of ``nbytes``: its power of two rounded (the structures of the forms, such as
    the shallow-tree subset, are searched once per class; 0 for less than 2 bytes)."""
    return 0 if nbytes < 2 else int(round(math.log2(nbytes)))


def clear_cache() -> None:
    """Forget every cached form structure and choice."""
    _structures.cache_clear()
    _shallow.cache_clear()
    _choose_cached.cache_clear()


# ------------------------------------------------------------------------------------ helpers
def _depth(parent: Sequence[int]) -> int:
    best = 0
    for r in range(len(parent)):
        d, v = 0, r
        while parent[v] != -1:
            v, d = parent[v], d + 1
            if d > len(parent):
                raise ValueError(f"parent array {tuple(parent)} has a cycle")
        best = max(best, d)
    return best


def _alpha(topology: Topology, parent: Sequence[int]) -> float:
    """Per-hop latency of a tree: its slowest link kind (both directions: reduce and broadcast)."""
    s, devs = topology.simple_graph(), topology.devices
    kinds: set[str] = set()
    for r, p in enumerate(parent):
        if p == -1:
            continue
        for a, b in ((devs[r], devs[p]), (devs[p], devs[r])):
            if s.has_edge(a, b):
                kinds.update(s[a][b].get("kinds", ()))
    kinds = kinds or set(topology.kinds())
    return max((MODEL["alpha_us"][k] for k in kinds), default=0.0)


def _reroot(parent: Sequence[int], root: int) -> tuple[int, ...]:
    """The same undirected tree, its edges pointing away from ``root``."""
    n = len(parent)
    adj: list[list[int]] = [[] for _ in range(n)]
    for r, p in enumerate(parent):
        if p != -1:
            adj[r].append(p)
            adj[p].append(r)
    out = [-2] * n
    out[root] = -1
    stack = [root]
    while stack:
        u = stack.pop()
        for v in adj[u]:
            if out[v] == -2:
                out[v] = u
                stack.append(v)
    if -2 in out:
        raise ValueError("tree does not span every rank")
    return tuple(out)


def _centre(parent: Sequence[int]) -> tuple[int, tuple[int, ...]]:
    """The root (lowest rank among ties) that makes the tree shallowest, and the tree rooted there."""
    best = min(range(len(parent)), key=lambda r: (_depth(_reroot(parent, r)), r))
    return best, _reroot(parent, best)


def _tree_time(topology: Topology, pieces: Sequence[Piece], nbytes: float, blocks: int = 1
               ) -> tuple[float, float | None]:
    """(us, chunk) of pieces through the model's tree formula; ``blocks`` > 1: each piece is one of
    ``blocks`` sharing its tree's links (weight / blocks each, share S w / (blocks R))."""
    pipes = [(w / blocks, _depth(par), _alpha(topology, par)) for _, par, w in pieces if w > 0]
    if not pipes or nbytes <= 0 or topology.n <= 1:
        return 0.0, None
    total = sum(p[0] for p in pipes)
    return min((_pipeline_time(pipes, total, nbytes, c, 2), c) for c in _chunk_candidates(nbytes))


def _plan_pieces(p) -> tuple[Piece, ...]:
    ranks = {d: i for i, d in enumerate(p.topology.devices)}
    out = []
    for (tree, w), r in zip(p.trees, p.roots):
        parent = [-1] * len(ranks)
        for u, v in tree.edges:
            parent[ranks[v]] = ranks[u]
        out.append((ranks[r], tuple(parent), float(w)))
    return tuple(out)


# ------------------------------------------------------------------------------------ the forms
def _undirected_pairs(topology: Topology) -> dict[tuple[int, int], float]:
    """``{(a, b) ranks, a < b: min capacity of the two directions}``: what a both-phase tree edge may
    carry (the allreduce packing's accounting)."""
    s, devs = topology.simple_graph(), topology.devices
    out = {}
    for i, u in enumerate(devs):
        for j in range(i + 1, len(devs)):
            v = devs[j]
            if s.has_edge(u, v) and s.has_edge(v, u):
                out[(i, j)] = min(s[u][v]["capacity"], s[v][u]["capacity"])
    return out


def _edges_of(parent: Sequence[int]) -> frozenset[tuple[int, int]]:
    return frozenset((min(r, p), max(r, p)) for r, p in enumerate(parent) if p != -1)


def _bfs_trees(n: int, caps: dict[tuple[int, int], float]) -> list[tuple[int, ...]]:
    """Per root, a minimum-depth spanning tree whose every rank hangs off its widest link to the
    previous layer (parents of the root's breadth-first layers)."""
    adj: dict[int, list[int]] = {r: [] for r in range(n)}
    for a, b in caps:
        adj[a].append(b)
        adj[b].append(a)
    out = []
    for root in range(n):
        layer = {root: 0}
        frontier = [root]
        while frontier:
            nxt = []
            for u in frontier:
                for v in adj[u]:
                    if v not in layer:
                        layer[v] = layer[u] + 1
                        nxt.append(v)
            frontier = nxt
        if len(layer) < n:
            continue
        parent = [-1] * n
        for v in range(n):
            if v != root:
                ups = [u for u in adj[v] if layer[u] == layer[v] - 1]
                parent[v] = max(ups, key=lambda u: (caps[(min(u, v), max(u, v))], -u))
        out.append(tuple(parent))
    return out


@functools.lru_cache(maxsize=256)
def _structures(topology: Topology, method: str) -> dict:
    """The size-independent part of every form on ``topology``: the packed plan's pieces, the ring
    realisation and the candidate trees of the shallow form."""
    n = topology.n
    p = _plan(topology, "allreduce", None, method=method)
    packed = _plan_pieces(p)
    caps = _undirected_pairs(topology)
    # Candidate trees of the shallow form: the packed ones (as undirected trees) and the BFS ones.
    cands: list[frozenset] = []
    for par in [par for _, par, _ in packed] + _bfs_trees(n, caps):
        e = _edges_of(par)
        if e not in cands:
            cands.append(e)
    return {"plan": p, "packed": packed, "caps": caps, "candidates": tuple(cands),
            "rings": _ring_structure(topology)}


def _ring_structure(topology: Topology) -> dict | None:
    """NCCL's rings on ``topology`` as the executor can run them (chains over the topology's own
    links), with the rate their chain realisation reaches; None where the rings leave the topology's
    links (the PCIe fallback of a topology without PCIe links) or there are none."""
    rp: RingPlan = rings(topology)
    n, devs = topology.n, topology.devices
    if n < 2 or not rp.rings:
        return None
    s = topology.simple_graph()
    rank = {d: i for i, d in enumerate(devs)}
    if rp.kind == "mesh":
        # One logical ring at the fabric rate in the baseline: run it as link-disjoint directed
        # Hamiltonian rings of the full mesh, n - 1 of them at the pair capacity where the exact
        # search is quick (up to 8 devices: 0.03 s; 16 took minutes), else the coprime-stride rings.
        # Not on CPU host devices: their executor reads peers' memory in one hop, and chains of
        # n - 1 hand-offs measured slower there than stars (custom_call's all-gather note).
        cap = rp.rates[0] / (n - 1)
        exact = n <= _EXACT_MESH_RINGS and "host" not in topology.kinds()
        found = _pack_rings(list(devs), _links_by_pair(topology, None)) if exact else ([],)
        if found[0]:
            rank_rings = [tuple(rank[d] for d in r) for r in found[0]]
            rates = [float(b) for b in found[1]]
        else:
            strides = [k for k in range(1, n) if math.gcd(k, n) == 1]
            rank_rings = [tuple((i * k) % n for i in range(n)) for k in strides]
            rates = [cap] * len(rank_rings)
        alphas = [rp.alphas[0]] * len(rank_rings)
    else:
        rank_rings = [tuple(rank[d] for d in r) for r in rp.rings]
        rates, alphas = list(rp.rates), list(rp.alphas)
    for r in rank_rings:
        for i in range(n):
            if not s.has_edge(devs[r[i]], devs[r[(i + 1) % n]]) or not s.has_edge(devs[r[(i + 1) % n]], devs[r[i]]):
                return None
    # Each ring's blocks reduce along the ring and broadcast against it: per directed link, the
    # rings through the pair either way, each (n-1)/n of its share. NCCL's rings put 2(n-1)/n of a
    # share on their own direction only; the ratio gives the rate the realisation reaches.
    total = float(sum(rates))
    load: dict[tuple[int, int], float] = {}
    for r, b in zip(rank_rings, rates):
        for i in range(n):
            a, c = r[i], r[(i + 1) % n]
            for e in ((a, c), (c, a)):
                load[e] = load.get(e, 0.0) + b
    worst = max(load[(a, c)] / s[devs[a]][devs[c]]["capacity"] for a, c in load)
    scale = min(1.0, 2.0 / worst) if worst > 0 else 1.0
    return {"ringplan": rp, "rings": tuple(rank_rings), "rates": tuple(b * scale for b in rates),
            "alphas": tuple(alphas), "baseline_rate": rp.rate, "rate": total * scale}


def _ring_blocks(n: int, rank_rings: Sequence[tuple[int, ...]], rates: Sequence[float]
                 ) -> tuple[tuple[Piece, ...], ...]:
    """Block k: on each ring R a chain rooted at R[k], ``parent(R[i]) = R[i + 1]`` (reduce flows along
    the ring into R[k], broadcast back against it)."""
    blocks = []
    for k in range(n):
        pieces = []
        for r, b in zip(rank_rings, rates):
            parent = [-1] * n
            for i in range(n):
                if i != k:
                    parent[r[i]] = r[(i + 1) % n]
            pieces.append((r[k], tuple(parent), float(b)))
        blocks.append(tuple(pieces))
    return tuple(blocks)


@functools.lru_cache(maxsize=1024)
def _shallow(topology: Topology, method: str, cls: int) -> tuple[Piece, ...]:
    """The shallow form's trees for size class ``cls``: from the candidates, drop trees greedily
    (the one whose loss, after re-weighting the rest by LP, models fastest at the class's size)
    and keep the fastest subset seen."""
    st = _structures(topology, method)
    caps = st["caps"]
    pairs = list(caps)
    index = {p: i for i, p in enumerate(pairs)}
    cap_list = [caps[p] for p in pairs]
    cands = list(st["candidates"])
    nbytes = float(2 ** cls)
    rooted = {}
    for e in cands:
        par = [-1] * topology.n
        # any parent array of the undirected tree, then its centre
        adj: dict[int, list[int]] = {}
        for a, b in e:
            adj.setdefault(a, []).append(b)
            adj.setdefault(b, []).append(a)
        seen, stack = {0}, [0]
        while stack:
            u = stack.pop()
            for v in adj.get(u, ()):
                if v not in seen:
                    seen.add(v)
                    par[v] = u
                    stack.append(v)
        rooted[e] = _centre(par)

    def evaluate(subset: Sequence[frozenset]) -> tuple[float, tuple[Piece, ...]]:
        cols = [tuple(sorted(index[p] for p in e)) for e in subset]
        _, x = max_weights(cap_list, cols)
        pieces = tuple((rooted[e][0], rooted[e][1], float(w)) for e, w in zip(subset, x) if w > 1e-9)
        if not pieces:
            return math.inf, ()
        return _tree_time(topology, pieces, nbytes)[0], pieces

    cur = [e for e in cands]
    best_t, best_p = evaluate(cur)
    # Drop the trees the LP leaves at zero first (they carry nothing).
    cur = [e for e in cur if any(_edges_of(par) == e for _, par, _ in best_p)]
    while len(cur) > 1:
        trials = [(evaluate(cur[:i] + cur[i + 1:]), i) for i in range(len(cur))]
        (t, pieces), i = min(trials, key=lambda x: x[0][0])
        cur = cur[:i] + cur[i + 1:]
        if t < best_t - 1e-9:
            best_t, best_p = t, pieces
    return best_p


def runs_ll(n: int, nbytes: float) -> bool:
    """Whether the CUDA executor runs an all-reduce of ``nbytes`` per rank on ``n`` GPUs (of one
    process, every pair linked) as its LL kernel, with the default limits."""
    return n <= LL_MAX_RANKS and nbytes <= LL_MAX_BYTES


def runs_ll_blocks(n: int, block_bytes: float, ll_max: int = LL_MAX_BYTES) -> bool:
    """Whether the CUDA executor runs a reduce-scatter or all-gather whose ranks' blocks hold
    ``block_bytes`` each, on ``n`` GPUs of one process, as its LL blocks kernel (every rank writes
    each peer only the block that peer needs, in one hop): blocks of at most the LL limit each
    (``ll_max``: the default limit, or what ``JAX_BLINK_LL_BYTES`` sets)."""
    return 2 <= n <= LL_MAX_RANKS and 0 < block_bytes <= ll_max


def _one_hop(topology: Topology, nbytes: float) -> tuple[float, str] | None:
    """(us, kernel) of the CUDA executor's one-hop all-reduce, where it runs: a GPU topology
    (no ``host`` links) with every pair linked directly, within the kernels' limits."""
    n = topology.n
    kinds = set(topology.kinds())
    if n < 2 or not kinds or "host" in kinds:
        return None
    s, devs = topology.simple_graph(), topology.devices
    caps, alphas = [], []
    for u in devs:
        for v in devs:
            if u != v:
                if not s.has_edge(u, v):
                    return None
                caps.append(s[u][v]["capacity"])
                alphas.append(max(MODEL["alpha_us"][k] for k in s[u][v]["kinds"]))
    bpu = MODEL["bytes_per_us_per_gbps"]
    if runs_ll(n, nbytes):
        return max(alphas) + 2 * nbytes / (min(caps) * bpu), "LL"
    if n == 2 and nbytes <= ONESHOT_MAX_BYTES:
        return max(alphas) + nbytes / (min(caps) * bpu), "one-shot"
    return None


def forms_at(topology: Topology, nbytes: float, *, method: str = "exact") -> tuple[Form, ...]:
    """Every all-reduce form that applies on ``topology``, priced at ``nbytes`` per device, fastest
    first (ties in :data:`FORMS` order).

    Args:
        topology: the devices and links.
        nbytes: bytes per device.
        method: the packing method of the trees (``"exact"`` or ``"mwu"``).

    Returns:
        The forms, fastest first; empty for one device.
    """
    n = topology.n
    if n < 2:
        return ()
    nbytes = float(nbytes)
    st = _structures(topology, method)
    out: list[Form] = []
    p = st["plan"]
    t, c = best_time(p, "allreduce", nbytes)
    out.append(Form("reduce_broadcast", t, nbytes, _chunk(c), (st["packed"],),
                    f"Blink's form: {len(st['packed'])} packed trees at {p.rate:g} GB/s each reduce their "
                    f"share toward their root and broadcast it back, (2D + k - 1) pipeline steps of a "
                    f"{_bytes(c)} chunk (D the tree's depth, k its chunks)"))
    rs = st["rings"]
    if rs is not None:
        t = ring_allreduce_us(n, rs["rates"], rs["alphas"], nbytes)
        same = abs(rs["rate"] - rs["baseline_rate"]) <= 1e-9 * rs["baseline_rate"]
        out.append(Form("rings", t, nbytes, None, _ring_blocks(n, rs["rings"], rs["rates"]),
                        f"NCCL's ring all-reduce on {len(rs['rings'])} ring(s) at {rs['rate']:g} GB/s "
                        + ("(the NCCL baseline's rate)" if same else
                           f"(the baseline's {rs['baseline_rate']:g} GB/s as chains on these links)")
                        + f": 2(n-1) = {2 * (n - 1)} steps of 1/{n} of the data, "
                        "reduce-scatter then all-gather along chains"))
    packed = st["packed"]
    sg_blocks = tuple(tuple((k, _reroot(par, k), w) for _, par, w in packed) for k in range(n))
    t, c = _tree_time(topology, [pc for b in sg_blocks for pc in b], nbytes, blocks=n)
    out.append(Form("scatter_gather", t, nbytes, _chunk(c), sg_blocks,
                    f"reduce-scatter + all-gather over the {len(packed)} packed trees: block k of {n} is "
                    f"reduced toward rank k and broadcast from it, the {n} blocks sharing each tree's links"))
    pieces = _shallow(topology, method, size_class(nbytes))
    if pieces:
        t, c = _tree_time(topology, pieces, nbytes)
        depth = max(_depth(par) for _, par, _ in pieces)
        out.append(Form("shallow_trees", t, nbytes, _chunk(c), (pieces,),
                        f"{len(pieces)} tree(s) of depth <= {depth} at {sum(w for *_, w in pieces):g} GB/s, "
                        f"each rooted at its centre, in chunks of {_bytes(c)}: fewer pipeline steps than "
                        f"the packed trees at this size"))
    oh = _one_hop(topology, nbytes)
    if oh is not None:
        out.append(Form("one_hop", oh[0], nbytes, None, (st["packed"],),
                        f"the CUDA executor's {oh[1]} kernel: every rank writes its operand into every "
                        "peer's inbox and reduces the copies, one hop"))
    order = {name: i for i, name in enumerate(FORMS)}
    return tuple(sorted(out, key=lambda f: (round(f.time_us, 9), order[f.name])))


def _chunk(c: float | None) -> int | None:
    return None if c is None else int(c)


def _bytes(c: float | None) -> str:
    return "whole-share" if c is None else f"{int(c)}-byte"


@functools.lru_cache(maxsize=4096)
def _choose_cached(topology: Topology, nbytes: float, form: str, method: str) -> Choice:
    ranked = forms_at(topology, nbytes, method=method)
    if form == AUTO:
        return Choice(ranked)
    picked = [f for f in ranked if f.name == form]
    if not picked:
        have = ", ".join(f.name for f in ranked)
        raise ValueError(
            f"allreduce_form={form!r} does not run on {topology.name} at {nbytes:.0f} bytes per rank "
            f"(the forms that do: {have}); set allreduce_form to one of them or to 'auto'")
    return Choice((picked[0],) + tuple(f for f in ranked if f.name != form), forced=True)


def choose(topology: Topology, nbytes: float, form: str = AUTO, *, method: str = "exact") -> Choice:
    """The all-reduce form that runs on ``topology`` for ``nbytes`` per device: the fastest by the
    model, or ``form`` where one is forced. Cached (warm calls are a dictionary look-up).

    Args:
        topology: the devices and links.
        nbytes: bytes per device.
        form: :data:`AUTO` or one of :data:`FORMS`.
        method: the packing method (``"exact"`` or ``"mwu"``).

    Returns:
        A :class:`Choice` (its ``form`` runs; ``ranked`` has the others).

    Raises:
        ValueError: an unknown form, a form that does not run on this topology at this size, or a
            topology of one device.
    """
    if form != AUTO and form not in FORMS:
        raise ValueError(f"unknown all-reduce form {form!r}; allowed: {AUTO!r}, {', '.join(map(repr, FORMS))}")
    if topology.n < 2:
        raise ValueError(f"an all-reduce over {topology.name} (one device) has no form: nothing moves")
    return _choose_cached(topology, float(nbytes), form, method)


def segments(form: Form, total_elems: int, itemsize: int) -> list[_schedule.TreeSegment]:
    """The program segments of ``form`` over an operand of ``total_elems`` elements: the operand cut
    in ``len(form.blocks)`` blocks (equal, 16-byte aligned), each split over its pieces by weight;
    every segment reduces and broadcasts. Empty segments are dropped.

    Args:
        form: a :class:`Form`.
        total_elems: elements of the operand.
        itemsize: bytes per element.

    Returns:
        The segments, in offset order, covering the operand without gaps or overlaps.
    """
    align = max(1, _schedule.ALIGN_BYTES // itemsize)
    if total_elems == 0 or not form.blocks:
        return []
    lens = _schedule.split_elements([1.0] * len(form.blocks), total_elems, align)
    out, offset = [], 0
    for block, blen in zip(form.blocks, lens):
        parts = _schedule.split_elements([w for *_, w in block], blen, align) if blen else [0] * len(block)
        for (root, parent, _), part in zip(block, parts):
            if part:
                out.append(_schedule.TreeSegment(root, _BOTH, offset, part, parent))
                offset += part
    return out
