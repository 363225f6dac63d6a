"""Schedules: a plan's trees turned into the flat int32 program that both executors run.

A plan says which trees carry how much (GB/s); a schedule says which elements of one operand each
tree carries and in which chunks. The program layout is defined once, in ``kernels/common/program.h``;
:func:`encode` writes it and :func:`run_reference` interprets it over numpy arrays, exactly as the
executors must (the reference both are tested against).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

# Keep in step with kernels/common/program.h.
PROGRAM_VERSION = 1
HEADER_LEN = 5
TREE_FIXED = 4
PHASE_REDUCE = 1
PHASE_BROADCAST = 2

OPS = {"sum": 0, "max": 1, "min": 2}

#: Segments start on 16-byte boundaries so that executors can use 16-byte vector accesses.
ALIGN_BYTES = 16
#: Default chunk: large enough that per-chunk overhead is small, small enough to pipeline.
DEFAULT_CHUNK_BYTES = 512 * 1024
_INT32_MAX = np.iinfo(np.int32).max


@dataclasses.dataclass(frozen=True)
class TreeSegment:
    """One tree's part of a schedule.

    ``parent[r]`` is the parent rank of rank ``r`` (``-1`` for the root); the tree carries elements
    ``[offset, offset + length)`` of the operand, in the phases given by the ``PHASE_*`` bits.
    """

    root: int
    phases: int
    offset: int
    length: int
    parent: tuple[int, ...]

    def children(self, rank: int) -> list[int]:
        """Children of ``rank`` in ascending rank order (the executors' combining order)."""
        return [r for r, p in enumerate(self.parent) if p == rank]

    def depth(self) -> int:
        """Number of hops from the root to its farthest rank."""
        best = 0
        for r in range(len(self.parent)):
            d, v = 0, r
            while self.parent[v] != -1:
                v, d = self.parent[v], d + 1
            best = max(best, d)
        return best


@dataclasses.dataclass(frozen=True)
class Schedule:
    """What every rank of a group runs for one operand: trees, their segments, the chunk size."""

    nranks: int
    total_elems: int
    chunk_elems: int
    trees: tuple[TreeSegment, ...]

    def program(self) -> np.ndarray:
        """The int32 program of ``kernels/common/program.h``."""
        return encode(self)


def _tree_parents(tree, ranks: dict) -> tuple[int, tuple[int, ...]]:
    """Root rank and parent-by-rank of an arborescence whose nodes are device ids."""
    roots = [v for v in tree.nodes if tree.in_degree(v) == 0]
    if len(roots) != 1:
        raise ValueError(f"a plan tree must have exactly one root, this one has {roots}")
    parent = [-1] * len(ranks)
    for u, v in tree.edges:
        parent[ranks[v]] = ranks[u]
    return ranks[roots[0]], tuple(parent)


def split_elements(weights: Sequence[float], total_elems: int, align_elems: int) -> list[int]:
    """Split ``total_elems`` in proportion to ``weights``; every part but the last a multiple of
    ``align_elems``. Parts sum to ``total_elems`` exactly (largest remainders get the leftovers)."""
    if total_elems < 0:
        raise ValueError("total_elems must be >= 0")
    w = np.asarray(weights, dtype=np.float64)
    if w.size == 0 or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {list(weights)}")
    units = total_elems // align_elems
    ideal = w / w.sum() * units
    parts = np.floor(ideal).astype(np.int64)
    for i in np.argsort(-(ideal - parts), kind="stable")[: units - int(parts.sum())]:
        parts[i] += 1
    out = [int(p) * align_elems for p in parts]
    out[-1] += total_elems - units * align_elems
    return out


def _phases(collective: str) -> int:
    phases = {"allreduce": PHASE_REDUCE | PHASE_BROADCAST, "reduce": PHASE_REDUCE,
              "broadcast": PHASE_BROADCAST}.get(collective)
    if phases is None:
        raise ValueError(f"cannot schedule collective {collective!r}; "
                         "supported: allreduce, reduce, broadcast")
    return phases


def tree_segments(plan, offset: int, length: int, itemsize: int) -> list[TreeSegment]:
    """``plan``'s trees over elements ``[offset, offset + length)``, each tree a share of them
    proportional to its weight (so that all trees finish together); empty shares are dropped."""
    ranks = {d: i for i, d in enumerate(plan.topology.devices)}
    if len(ranks) == 1 or length == 0:
        return []
    lengths = split_elements([w for _, w in plan.trees], length, max(1, ALIGN_BYTES // itemsize))
    phases = _phases(plan.collective)
    out = []
    for (tree, _), part in zip(plan.trees, lengths):
        if part:
            root, parent = _tree_parents(tree, ranks)
            out.append(TreeSegment(root, phases, offset, part, parent))
            offset += part
    return out


def make_schedule(nranks: int, total_elems: int, itemsize: int, segments: Sequence[TreeSegment],
                  *, chunk_bytes: int | None = None) -> Schedule:
    """A schedule of ``segments`` (non-overlapping) with chunks of about ``chunk_bytes``."""
    if total_elems > _INT32_MAX:
        raise ValueError(
            f"operand of {total_elems} elements is over the program's int32 limit ({_INT32_MAX}); "
            "split it into several calls")
    chunk_bytes = DEFAULT_CHUNK_BYTES if chunk_bytes is None else int(chunk_bytes)
    if chunk_bytes < ALIGN_BYTES:
        raise ValueError(f"chunk_bytes must be at least {ALIGN_BYTES}, got {chunk_bytes}")
    align_elems = max(1, ALIGN_BYTES // itemsize)
    chunk_elems = max(align_elems, chunk_bytes // itemsize // align_elems * align_elems)
    longest = max((t.length for t in segments), default=0)
    # No chunk longer than the longest segment: one chunk is then one whole segment.
    chunk_elems = min(chunk_elems, max(align_elems, -(-longest // align_elems) * align_elems))
    return Schedule(nranks, total_elems, chunk_elems, tuple(segments))


def build_schedule(plan, total_elems: int, itemsize: int, *, chunk_bytes: int | None = None) -> Schedule:
    """Schedule ``total_elems`` elements of ``itemsize`` bytes through ``plan``'s trees.

    ``plan.collective`` picks the phases: ``allreduce`` reduces toward each tree's root and
    broadcasts back; ``reduce`` and ``broadcast`` run one phase over the whole operand.
    """
    segments = tree_segments(plan, 0, total_elems, itemsize)
    return make_schedule(plan.topology.n, total_elems, itemsize, segments, chunk_bytes=chunk_bytes)


def encode(schedule: Schedule) -> np.ndarray:
    """Write ``schedule`` as the int32 program array of ``kernels/common/program.h``."""
    n = schedule.nranks
    words = [PROGRAM_VERSION, n, len(schedule.trees), schedule.chunk_elems, schedule.total_elems]
    for t in schedule.trees:
        if len(t.parent) != n:
            raise ValueError(f"tree has {len(t.parent)} parent entries for {n} ranks")
        words += [t.root, t.phases, t.offset, t.length, *t.parent]
    return np.asarray(words, dtype=np.int32)


def decode(program: np.ndarray) -> Schedule:
    """Read a program array back into a :class:`Schedule` (checks the layout)."""
    p = [int(v) for v in np.asarray(program, dtype=np.int32)]
    if len(p) < HEADER_LEN or p[0] != PROGRAM_VERSION:
        raise ValueError("not a jax_blink program (bad header or version)")
    _, n, ntrees, chunk, total = p[:HEADER_LEN]
    stride = TREE_FIXED + n
    if len(p) != HEADER_LEN + ntrees * stride:
        raise ValueError("program length does not match its header")
    trees = []
    for t in range(ntrees):
        w = p[HEADER_LEN + t * stride: HEADER_LEN + (t + 1) * stride]
        trees.append(TreeSegment(w[0], w[1], w[2], w[3], tuple(w[TREE_FIXED:])))
    return Schedule(n, total, chunk, tuple(trees))


def _combine(op: str, acc: np.ndarray, other: np.ndarray) -> np.ndarray:
    if op == "sum":
        return acc + other
    if op == "max":
        return np.maximum(acc, other)
    if op == "min":
        return np.minimum(acc, other)
    raise ValueError(f"unknown op {op!r}; supported: {sorted(OPS)}")


def _accumulator_dtype(dtype: np.dtype) -> np.dtype:
    # 16-bit floats (float16, bfloat16) accumulate in float32 and round once per hop.
    if dtype.kind in "fV" and dtype.itemsize == 2 or dtype.name == "bfloat16":
        return np.dtype(np.float32)
    return dtype


def run_reference(schedule: Schedule, inputs: Sequence[np.ndarray], op: str = "sum") -> list[np.ndarray]:
    """Interpret ``schedule`` over one flat input per rank, as the executors do.

    Returns each rank's output. Chunking does not change the result (the combining is elementwise),
    so the reference works on whole segments; the combining order is the executors': own value
    first, then children in ascending rank order, one rounding per hop for 16-bit types.
    """
    if len(inputs) != schedule.nranks:
        raise ValueError(f"{len(inputs)} inputs for a schedule of {schedule.nranks} ranks")
    xs = [np.asarray(x).reshape(-1) for x in inputs]
    if any(x.size != schedule.total_elems for x in xs):
        raise ValueError(f"every input must have {schedule.total_elems} elements")
    outs = [x.copy() for x in xs]
    acc_t = _accumulator_dtype(xs[0].dtype)
    for t in schedule.trees:
        seg = slice(t.offset, t.offset + t.length)
        order = _postorder(t)
        if t.phases & PHASE_REDUCE:
            for r in order:  # children before parents
                acc = xs[r][seg].astype(acc_t)
                for c in t.children(r):
                    acc = _combine(op, acc, outs[c][seg].astype(acc_t))
                outs[r][seg] = acc.astype(xs[r].dtype)
        if t.phases & PHASE_BROADCAST:
            for r in reversed(order):  # parents before children
                if t.parent[r] != -1:
                    outs[r][seg] = outs[t.parent[r]][seg]
    return [o.reshape(np.shape(x)) for o, x in zip(outs, inputs)]


def _postorder(t: TreeSegment) -> list[int]:
    """Ranks of tree ``t``, every child before its parent."""
    out, stack = [], [(t.root, False)]
    while stack:
        v, done = stack.pop()
        if done:
            out.append(v)
            continue
        stack.append((v, True))
        stack.extend((c, False) for c in t.children(v))
    if len(out) != len(t.parent):
        raise ValueError("tree does not span every rank (a parent cycle or a detached rank)")
    return out
