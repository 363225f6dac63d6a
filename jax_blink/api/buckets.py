"""Gradient buckets: a pytree of arrays packed into a few flat buffers, the way PyTorch's
DistributedDataParallel packs gradients, so that each all-reduce moves many bytes at once::

    layout = BucketLayout.of(grads, bucket_bytes=25 << 20)
    grads = bucketed_all_reduce(grads, "data", layout=layout)      # one call per bucket
    print(layout.describe())                                        # which leaf went where

The assignment is DDP's (``torch.distributed``'s ``compute_bucket_assignment_by_size``): leaves
in reverse order (DDP walks ``model.parameters()`` backwards, the order gradients become ready),
one open bucket per dtype, a leaf is never split, and a bucket is closed as soon as it holds at
least its cap; the first bucket's cap is smaller (DDP: 1 MiB), so that the first all-reduce can
start early. Where the leaf order is not the order in which the backward pass makes the gradients
(a tied embedding, used first and last, is summed only at the very end), :func:`gradient_order`
reads that order off the traced gradient program and ``BucketLayout.of(..., order=...)`` follows
it, as DDP rebuilds its buckets after the first iteration from the order it saw.

One departure from DDP, asked for with ``large_leaf_alone=True``: a leaf of at least the cap
closes the open bucket first and gets a bucket of its own, as the switch's merged all-reduces do.
DDP would add it to the open bucket, so the leaves there wait for it: a tied embedding, summed
last, holds back the first block's gradients and adds their bytes to the last all-reduce.
Another, with ``last_bucket_pieces=K``: the last bucket is cut into K buckets of consecutive
leaves, since a call that holds the backward pass's last leaves together splits some of XLA's
fusions there (ResNet-50; measured slower in the overlapped step on 2 GPUs all the same).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jax_blink.lowering import jaxpr_steps
from jax_blink.lowering import packing as _packing
from jax_blink.lowering.mesh import platform as _platform
from jax_blink.options import DEFAULT_BUCKET_BYTES, DEFAULT_FIRST_BUCKET_BYTES
from jax_blink.options.settings import check_piece_count
from jax_blink.switch.merge import consecutive_groups


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one leaf of the tree lies in its bucket.

    Attributes:
        leaf: The leaf's index in the tree's leaf order.
        path: The leaf's key path, for people.
        shape: The leaf's shape.
        offset: Its first element in the bucket.
        size: Its number of elements.
    """

    leaf: int           # index in the tree's leaf order
    path: str           # the leaf's key path, for people
    shape: tuple[int, ...]
    offset: int         # first element in the bucket
    size: int           # number of elements


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One flat buffer of leaves of one dtype.

    Attributes:
        dtype: The dtype of every leaf in it.
        slots: Where each of its leaves lies, in order.
    """

    dtype: np.dtype
    slots: tuple[Slot, ...]

    @property
    def size(self) -> int:
        """Elements in the bucket."""
        return sum(s.size for s in self.slots)

    @property
    def nbytes(self) -> int:
        """Bytes in the bucket."""
        return self.size * self.dtype.itemsize

    def pack(self, leaves: Sequence | Mapping[int, Any], platform: str | None = None) -> jax.Array:
        """This bucket's flat buffer from ``leaves``, indexed by leaf index (the tree's leaf order;
        a mapping needs only this bucket's leaves). ``platform``: the platform that jax_blink's
        executor sums it on, whose ``config.bucket_packing`` applies
        (:mod:`jax_blink.lowering.packing`); None: XLA's concatenation."""
        return _packing.join([leaves[s.leaf] for s in self.slots], platform)


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """Which leaf of a pytree goes into which flat buffer (see the module's docstring).

    Attributes:
        treedef: The tree's structure.
        buckets: The buckets, in the order their all-reduces run.
        bucket_bytes: The cap of every bucket but the first.
        first_bucket_bytes: The first bucket's cap.
        reversed_leaves: Whether the leaves went in reverse order (DDP's default), rather than in
            an order given (``order=``).
        large_leaf_alone: Whether a leaf of at least the cap got a bucket of its own.
        last_bucket_pieces: How many buckets the last bucket (the last whose all-reduce runs) was
            cut into: as many as asked, or one per leaf where it had fewer.
    """

    treedef: Any
    buckets: tuple[Bucket, ...]
    bucket_bytes: int
    first_bucket_bytes: int
    reversed_leaves: bool = True
    large_leaf_alone: bool = False
    last_bucket_pieces: int = 1

    @classmethod
    def of(cls, tree, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
           first_bucket_bytes: int | None = DEFAULT_FIRST_BUCKET_BYTES,
           order: Sequence[int] | None = None, large_leaf_alone: bool = False,
           last_bucket_pieces: int = 1) -> "BucketLayout":
        """The layout of a pytree, bucketed as DDP buckets gradients.

        Args:
            tree: A pytree of arrays, or of anything with ``shape`` and ``dtype`` (e.g.
                ``jax.ShapeDtypeStruct``).
            bucket_bytes: A bucket is closed once it holds at least this many bytes (default 25 MiB).
            first_bucket_bytes: The first bucket's cap (default 1 MiB); None gives every bucket
                the same cap.
            order: The leaf indices (in the tree's leaf order) in the order their gradients become
                ready, e.g. from :func:`gradient_order`; default: the leaves reversed (DDP's).
            large_leaf_alone: A leaf of at least its bucket's cap closes the open bucket (of its
                dtype) first and is a bucket of its own; default False, DDP's rule (it joins the
                open bucket).
            last_bucket_pieces: The last bucket (the last whose all-reduce runs: with one dtype,
                the backward pass's last gradients) cut into this many buckets of consecutive
                leaves, as even in leaf count as can be (at most one per leaf); default 1, DDP's. A
                collective that holds the backward pass's last bucket together splits XLA's
                fusions of its residual additions with BatchNorm's reductions on ResNet-50, and
                smaller groups split fewer on one GPU; but in the overlapped step on 2 x H200, 16
                pieces made ResNet-50's step 0.57-0.83 ms slower, each start splitting fusions of
                its own (``benchmarks/NOTES.md``, change 32).

        Returns:
            The layout.

        Raises:
            ValueError: A cap is not a positive number of bytes, or ``order`` is not a permutation
                of the leaf indices.
            TypeError: ``large_leaf_alone`` is not a bool, or ``last_bucket_pieces`` not a
                whole number.
        """
        if not isinstance(bucket_bytes, (int, np.integer)) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive number of bytes, got {bucket_bytes!r}")
        first = bucket_bytes if first_bucket_bytes is None else min(first_bucket_bytes, bucket_bytes)
        if first < 1:
            raise ValueError(f"first_bucket_bytes must be positive, got {first_bucket_bytes!r}")
        if not isinstance(large_leaf_alone, (bool, np.bool_)):
            raise TypeError(f"large_leaf_alone must be True or False, got {large_leaf_alone!r}")
        last_bucket_pieces = check_piece_count("last_bucket_pieces", last_bucket_pieces)
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
        if not with_paths:
            raise ValueError("BucketLayout.of: the tree has no leaves")
        if order is None:
            order = range(len(with_paths) - 1, -1, -1)
        elif sorted(int(i) for i in order) != list(range(len(with_paths))):
            raise ValueError(f"BucketLayout.of: order must list each of the tree's {len(with_paths)} leaf "
                             f"indices once (e.g. gradient_order(...)), got {list(order)[:12]}...")
        reversed_order = [int(i) for i in order] == list(range(len(with_paths) - 1, -1, -1))
        closed: list[Bucket] = []
        open_: dict[np.dtype, list[Slot]] = {}
        for i in order:
            i = int(i)
            path, leaf = with_paths[i]
            dtype = np.dtype(leaf.dtype)
            slots = open_.setdefault(dtype, [])
            size = int(np.prod(leaf.shape, dtype=np.int64))
            cap = first if not closed else bucket_bytes
            if large_leaf_alone and slots and size * dtype.itemsize >= cap:
                closed.append(Bucket(dtype, tuple(slots)))
                slots = open_[dtype] = []  # the leaf, at least the cap, then closes a bucket alone
            offset = sum(s.size for s in slots)
            slots.append(Slot(i, jax.tree_util.keystr(path), tuple(leaf.shape), offset, size))
            if (offset + size) * dtype.itemsize >= cap:
                closed.append(Bucket(dtype, tuple(slots)))
                del open_[dtype]
        closed += [Bucket(d, tuple(s)) for d, s in open_.items()]
        pieces = 1
        if last_bucket_pieces > 1:
            *closed, last = closed
            groups = consecutive_groups(last.slots, last_bucket_pieces)
            closed += [Bucket(last.dtype, _restarted(group)) for group in groups]
            pieces = len(groups)
        return cls(treedef, tuple(closed), int(bucket_bytes), int(first), reversed_order, bool(large_leaf_alone),
                   pieces)

    @property
    def nbytes(self) -> int:
        """Bytes in all buckets."""
        return sum(b.nbytes for b in self.buckets)

    def pack(self, tree, platform: str | None = None) -> list[jax.Array]:
        """The tree's leaves as one flat array per bucket (``platform``: as :meth:`Bucket.pack`).

        Raises:
            ValueError: The tree's structure, a leaf's shape or its dtype differs from the layout's.
        """
        leaves = self._leaves(tree)
        return [b.pack(leaves, platform) for b in self.buckets]

    def unpack(self, buffers, platform: str | None = None) -> Any:
        """The inverse of :meth:`pack`: the tree back from one flat array per bucket
        (``platform``: the one given to :meth:`pack`).

        Raises:
            ValueError: The number of buffers is not the number of buckets.
        """
        if len(buffers) != len(self.buckets):
            raise ValueError(f"expected {len(self.buckets)} buffers, got {len(buffers)}")
        leaves: list = [None] * self.treedef.num_leaves
        for b, buf in zip(self.buckets, buffers):
            for s, v in zip(b.slots, _packing.split(buf, [s.shape for s in b.slots], platform)):
                leaves[s.leaf] = v
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def _leaves(self, tree) -> list:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if treedef != self.treedef:
            raise ValueError(f"tree does not match the layout's structure:\n  {treedef}\nvs\n  {self.treedef}")
        for b in self.buckets:
            for s in b.slots:
                leaf = leaves[s.leaf]
                if tuple(leaf.shape) != s.shape or np.dtype(leaf.dtype) != b.dtype:
                    raise ValueError(f"leaf {s.path} is {leaf.dtype}{list(leaf.shape)}, the layout "
                                     f"has {b.dtype}{list(s.shape)}")
        return leaves

    def describe(self) -> str:
        """One line per bucket: its size, dtype, leaf count and first and last leaves."""
        lines = [f"{len(self.buckets)} bucket(s), {_fmt_bytes(self.nbytes)} in all, {self.treedef.num_leaves} "
                 f"leaves (cap {_fmt_bytes(self.bucket_bytes)}, first bucket {_fmt_bytes(self.first_bucket_bytes)}; "
                 + ("leaves in reverse order, as DDP" if self.reversed_leaves else
                    "leaves in the order their gradients become ready")
                 + ("; a leaf of at least the cap alone" if self.large_leaf_alone else "")
                 + (f"; the last bucket cut into {self.last_bucket_pieces}" if self.last_bucket_pieces > 1 else "")
                 + ")"]
        for i, b in enumerate(self.buckets):
            first, last = b.slots[0].path, b.slots[-1].path
            span = first if len(b.slots) == 1 else f"{first} .. {last}"
            lines.append(f"  bucket {i}: {_fmt_bytes(b.nbytes):>10} {b.dtype.name:>8} {b.size:>11} elements, "
                         f"{len(b.slots):>3} leaves: {span}")
        return "\n".join(lines)

    def explain(self, topology, **kwargs) -> str:
        """``jax_blink.explain`` of each bucket's all-reduce on ``topology`` (keyword arguments go
        to it)."""
        from jax_blink.api.explain import explain
        parts = []
        for i, b in enumerate(self.buckets):
            parts.append(f"--- bucket {i}: all-reduce of {_fmt_bytes(b.nbytes)} ({b.dtype.name})\n"
                         + explain(topology, b.nbytes, "allreduce", dtype=b.dtype, **kwargs))
        return "\n".join(parts)


def _restarted(slots: Sequence[Slot]) -> tuple[Slot, ...]:
    """``slots`` laid out again from offset 0, in order."""
    offsets = np.cumsum([0] + [s.size for s in slots])
    return tuple(dataclasses.replace(s, offset=int(o)) for s, o in zip(slots, offsets))


def bucketed(tree, reduce_bucket: Callable[[jax.Array], jax.Array],
             layout: BucketLayout | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
             ordered: bool = False, platform: str | None = None):
    """``tree`` with ``reduce_bucket`` applied to each of its buckets (one call per flat buffer).

    Args:
        tree: A pytree of arrays.
        reduce_bucket: What to do with each bucket's flat buffer (e.g. an all-reduce).
        layout: The layout (default: ``BucketLayout.of(tree, bucket_bytes)``).
        bucket_bytes: The bucket cap when no layout is given.
        ordered: Each bucket's call waits for the previous one's result, so that every device
            runs them in bucket order. jax_blink's calls need it: they block until their peers
            arrive, and XLA:CPU may run independent calls at once in an order of its choosing per
            device, which can leave two devices waiting on each other. On CPU the wait is the
            executor's ``jax_blink_after`` call (XLA:CPU's compiler removes optimization
            barriers); elsewhere a barrier.
        platform: The platform whose jax_blink executor sums the buckets (its
            ``config.bucket_packing`` packs them: :meth:`BucketLayout.pack`); None: XLA's packing.

    Returns:
        A pytree of ``tree``'s structure.
    """
    layout = layout or BucketLayout.of(tree, bucket_bytes)
    outs: list[jax.Array] = []
    for buf in layout.pack(tree, platform):
        if ordered and outs:
            buf = _wait_for(buf, outs[-1])
        outs.append(reduce_bucket(buf))
    return layout.unpack(outs, platform)


def _wait_for(buf: jax.Array, prev: jax.Array) -> jax.Array:
    """``buf``, computed only once ``prev`` exists, in a way the compiled program keeps."""
    from jax_blink.lowering import backends as _backends
    from jax_blink.lowering import processes as distributed
    if distributed._platform_of(buf) == "cpu" and _backends.register("cpu"):
        return distributed.after(buf, prev.reshape(-1)[:1])
    return jax.lax.optimization_barrier((buf, prev))[0]


def bucketed_all_reduce(tree, axis_name, *, layout: BucketLayout | None = None,
                        bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlap: bool = False, **kwargs):
    """Sum every leaf of ``tree`` over ``axis_name`` with :func:`jax_blink.all_reduce`, one call per bucket.

    Args:
        tree: A pytree of arrays (e.g. gradients), inside ``shard_map`` or ``pmap``.
        axis_name: The mesh axis (or tuple of axes) to sum over.
        layout: The layout (default: ``BucketLayout.of(tree, bucket_bytes)``).
        bucket_bytes: The bucket cap when no layout is given.
        overlap: Each bucket's all-reduce is started as soon as its gradients exist and awaited
            only after the next bucket's start (:func:`jax_blink.all_reduce_start` /
            :func:`jax_blink.all_reduce_done`, DDP's order): on GPUs it runs on a side stream
            beside the rest of the backward pass. Not differentiable. Same results either way.
        **kwargs: Passed to :func:`jax_blink.all_reduce` (``topology``, ``method``).

    Returns:
        The summed pytree; the calls run (start) in bucket order.
    """
    if not overlap:
        from jax_blink.api.collectives import all_reduce
        return bucketed(tree, lambda buf: all_reduce(buf, axis_name, **kwargs), layout, bucket_bytes,
                        ordered=True, platform=_platform())
    return _overlapped_all_reduce(tree, axis_name, layout or BucketLayout.of(tree, bucket_bytes), **kwargs)


def _overlapped_all_reduce(tree, axis_name, layout: BucketLayout, **kwargs):
    """:func:`bucketed_all_reduce` with ``overlap=True``: start every bucket (in bucket order: the
    gradients the backward pass makes first come first; the last on the whole grid, nothing is left
    to overlap), then every done after the last start."""
    started: list = []
    platform = _platform()
    bufs = layout.pack(tree, platform)
    for k, buf in enumerate(bufs):
        start_in_order(buf, started, axis_name, full_grid=k == len(bufs) - 1, **kwargs)
    return layout.unpack(done_after_last(started, started[-1]), platform)


def gradient_order(grad_fn: Callable, *args, **kwargs) -> list[int]:
    """The leaves of ``grad_fn(*args, **kwargs)``'s result, in the order its traced program makes
    them: the order for :meth:`BucketLayout.of`'s ``order`` (DDP rebuilds its buckets from the
    order it saw gradients become ready; this reads it off the program instead).

    A leaf's place is the equation that computes it, nested ``jax.jit`` calls inlined
    (:mod:`jax_blink.lowering.jaxpr_steps`: the places where :func:`jax_blink.value_and_grad_overlapped`
    can start a bucket); leaves that the program only passes through come first, and ties (several
    leaves of one equation, e.g. of a ``remat`` or a loop) go to the later leaf first (DDP's
    reverse order).

    Args:
        grad_fn: A function returning a pytree of arrays, e.g. ``jax.grad(loss)``.
        *args: Its arguments: arrays or ``jax.ShapeDtypeStruct`` (it is traced, not run).
        **kwargs: Its keyword arguments.

    Returns:
        The indices of the result's leaves (in ``jax.tree.leaves`` order), first made first.
    """
    program = jaxpr_steps.flatten(jax.make_jaxpr(grad_fn)(*args, **kwargs))
    return ready_order(program, program.out_keys)


def ready_order(program: jaxpr_steps.FlatProgram, keys: Sequence) -> list[int]:
    """The indices of ``keys`` (values of ``program``) by the step that makes each, ties later first."""
    return sorted(range(len(keys)), key=lambda i: (program.made(keys[i]), -i))


def start_in_order(buf, started: list, axis_name, *, full_grid: bool, **kwargs):
    """:func:`jax_blink.all_reduce_start` of one bucket, appended to ``started``. On CPU host devices
    (synchronous starts) its operand first waits for the previous start's result, so that every
    device runs the calls in one order (see :func:`bucketed`): XLA's CPU collectives too, which
    would otherwise run beside ours in an order of each device's own."""
    from jax_blink.api.overlap import all_reduce_start
    if started and _on_cpu(buf):
        buf = _wait_for(buf, started[-1].result)
    started.append(all_reduce_start(buf, axis_name, full_grid=full_grid, **kwargs))
    return started[-1]


def done_after_last(handles: Sequence, last) -> list:
    """Every handle's :func:`jax_blink.all_reduce_done`, each after ``last``'s start (DDP waits for
    its buckets at the end of the backward pass): XLA places a done as early as its operands allow
    (it frees a buffer), so with done k after start k + 1 only, the compute stream waited for
    bucket k at once (2 x H200, benchmarks/overlap_schedule.py)."""
    from jax_blink.api.overlap import all_reduce_done
    return [all_reduce_done(h, after=last if h is not last else None) for h in handles]


def _on_cpu(buf) -> bool:
    from jax_blink.lowering import processes as distributed
    return distributed._platform_of(buf) == "cpu"


def _fmt_bytes(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"
