"""Gradients summed over a mesh axis while the backward pass runs: DDP's overlap for JAX::

    step_grad = jax_blink.value_and_grad_overlapped(loss, "data")
    mine = lax.pcast(params, "data", to="varying")  # inside shard_map(check_vma=True)
    loss, grads = step_grad(mine, batch)        # grads: summed over "data" (psum's numbers)

It traces ``jax.value_and_grad(fun)``, packs the gradients into DDP buckets in the order the
backward pass makes them (:func:`jax_blink.api.buckets.gradient_order`), and runs the traced
program equation by equation, starting each bucket's all-reduce
(:func:`jax_blink.all_reduce_start`) right after the equation that completes it. Every value the
rest of the program still needs then passes through one ``optimization_barrier`` with the
start's output, so XLA cannot run the rest of the backward pass before the start, nor move the
start to the end of the step: XLA defers the weight-gradient matrix products that only the
all-reduce reads, and with them every start (GPT-2 on 2 x H200, 2026-11-27: all 13 starts after
the backward pass, nothing overlapped; docs/overlap.md). The waits (:func:`jax_blink.all_reduce_done`)
come after the last start, as DDP waits for its buckets at the end of the backward pass.

Nested ``jax.jit`` calls are inlined into the run so that a start can land inside them; loops,
``remat`` and other nested programs run whole (a ``scan`` over layers makes all its gradients at
once). On CPU host devices, several processes or the sizes the dispatch table gives to ``lax``,
the starts compute at once and the program equals the synchronous buckets; a bucket given to
``lax`` is XLA's own all-reduce, without the barrier, for XLA to place.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax import lax

from jax_blink.api import buckets as _buckets
from jax_blink.lowering import jaxpr_steps
from jax_blink.lowering.mesh import AxisName, axes_of, platform as _platform
from jax_blink.options import DEFAULT_BUCKET_BYTES, DEFAULT_FIRST_BUCKET_BYTES
from jax_blink.options.settings import check_piece_count
from jax_blink.switch.overlap import read_as_weight

#: What ``value_and_grad_overlapped(hold=...)`` takes.
HOLDS = ("recent", "all", "none", "weights")


def value_and_grad_overlapped(fun: Callable, axis_name: AxisName, *, argnums: int | Sequence[int] = 0,
                              has_aux: bool = False, reduce_aux: bool = False,
                              bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                              first_bucket_bytes: int | None = DEFAULT_FIRST_BUCKET_BYTES,
                              hold: str = "recent", large_leaf_alone: bool = False,
                              last_bucket_pieces: int = 1, **kwargs) -> Callable:
    """``jax.value_and_grad(fun)`` whose gradients come summed over ``axis_name``, each bucket's
    all-reduce started inside the backward pass as soon as its gradients exist.

    Call the result inside ``shard_map`` (or ``pmap``) over ``axis_name``, where the gradients
    are per-device: inside ``shard_map(check_vma=True)``, of parameters made varying with
    ``lax.pcast(params, axis_name, to="varying")``. A parameter left invariant there is refused
    (ValueError): jax's transpose would sum its gradient itself, and summing again would give the
    axis size times psum's numbers.

    Args:
        fun: The loss, as for ``jax.value_and_grad``.
        axis_name: The mesh axis (or tuple of axes) to sum over.
        argnums: The arguments to differentiate.
        has_aux: ``fun`` returns ``(loss, aux)``.
        reduce_aux: Also sum the array leaves of ``aux`` (e.g. BatchNorm statistics) over the
            axis, in the first buckets (they exist before the backward pass starts).
        bucket_bytes: DDP's bucket cap (default 25 MiB).
        first_bucket_bytes: The first bucket's cap (default 1 MiB).
        hold: Which values wait for each start (pass through its ``optimization_barrier``), so
            that XLA neither runs the rest of the backward pass before the start nor sinks the
            start to the end of the step:

            * ``"recent"`` (default): those the backward pass made since the previous start and
              that later steps read;
            * ``"weights"``: the function's arguments that only matrix products and convolutions
              read (:data:`jax_blink.switch.overlap.WEIGHT_READERS`) and that a later step reads:
              buffers already, and only the products that read a weight wait, so XLA may run the
              weight gradients (which fill the buckets) first;
            * ``"all"``: every value the rest of the program reads (the earlier form: XLA must
              then materialise the forward pass's values);
            * ``"none"``: nothing: XLA places the starts as it likes (on GPT-2 it sank them to
              the end of the step) but fuses across them.

            Any hold orders a bucket's producers before the rest of the pass, and XLA then splits
            its fusions that join them: on ResNet-50, 44-47 of 48 where a bucket boundary splits
            21, and with ``last_bucket_pieces=16`` ``"none"`` splits 1 (one H200, no
            communication; ``benchmarks/NOTES.md``, changes 32 and 33). Not yet timed on several
            GPUs.
        large_leaf_alone: A gradient of at least the cap gets a bucket of its own, the open
            bucket closed before it (:meth:`BucketLayout.of`); default False, DDP's buckets.
        last_bucket_pieces: The last bucket (the backward pass's last gradients) cut into this
            many buckets of consecutive leaves (:meth:`BucketLayout.of`); default 1.
        **kwargs: Passed to :func:`jax_blink.all_reduce_start` (``topology``, ``method``).

    Returns:
        A function of ``fun``'s arguments returning ``(value, grads)`` (``((value, aux), grads)``
        with ``has_aux``), the gradients (and with ``reduce_aux`` the aux leaves) summed.

    Raises:
        ValueError: ``hold`` is not one of :data:`HOLDS`, or ``last_bucket_pieces`` is below 1.
        TypeError: ``large_leaf_alone`` is not a bool, or ``last_bucket_pieces`` not a whole number.
    """
    if hold not in HOLDS:
        raise ValueError(f"value_and_grad_overlapped: hold must be one of {HOLDS}, got {hold!r}")
    if not isinstance(large_leaf_alone, bool):
        raise TypeError(f"value_and_grad_overlapped: large_leaf_alone must be True or False, got {large_leaf_alone!r}")
    last_bucket_pieces = check_piece_count("last_bucket_pieces", last_bucket_pieces)  # before any trace
    value_and_grad = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)

    def run(*args):
        closed, shapes = jax.make_jaxpr(value_and_grad, return_shape=True)(*args)
        program = jaxpr_steps.flatten(closed)
        n_value = len(jax.tree.leaves(shapes[0]))
        reduced = list(range(1 if reduce_aux else n_value, len(program.out_keys)))
        if not reduced:
            raise ValueError("value_and_grad_overlapped: nothing to sum (no gradient leaves)")
        _refuse_summed_gradients(program, n_value, shapes[1], axis_name)
        tree = [jax.ShapeDtypeStruct(closed.jaxpr.outvars[i].aval.shape, closed.jaxpr.outvars[i].aval.dtype)
                for i in reduced]
        order = _buckets.ready_order(program, [program.out_keys[i] for i in reduced])
        layout = _buckets.BucketLayout.of(tree, bucket_bytes, first_bucket_bytes, order=order,
                                          large_leaf_alone=large_leaf_alone, last_bucket_pieces=last_bucket_pieces)
        # The backward pass begins, for the barriers, at the first gradient it makes.
        backward = min((program.made(program.out_keys[i]) for i in range(n_value, len(program.out_keys))),
                       default=len(program.steps))
        flat = _run_with_starts(program, jax.tree.leaves(args), reduced, layout, axis_name, kwargs,
                                hold=hold, backward=backward)
        return jax.tree.unflatten(jax.tree.structure(shapes), flat)

    return run


def _refuse_summed_gradients(program: jaxpr_steps.FlatProgram, n_value: int, grad_shapes, axis_name) -> None:
    """Raise where jax's own transpose already summed a gradient over ``axis_name``.

    Inside ``shard_map(check_vma=True)`` a parameter that is the same on every device
    (invariant) enters the loss through a ``pvary``, whose transpose is a ``psum_invariant``: its
    gradient comes out summed. Summing it again would give the axis size times psum's numbers,
    and the all-reduces would run as jax's, one per leaf, with nothing overlapped.
    """
    axes = axes_of(axis_name)
    summed: set = set()
    for step in program.steps:
        eqn = step.eqn
        if ((eqn.primitive.name == "psum_invariant" and set(axes) & set(eqn.params.get("axes", ())))
                or any(k in summed for k in step.ins if not isinstance(k, jaxpr_steps.Lit))):
            summed.update(step.outs)
    leaves = jax.tree_util.tree_flatten_with_path(grad_shapes)[0]
    hit = [jax.tree_util.keystr(path) or "the argument"
           for (path, _), k in zip(leaves, program.out_keys[n_value:]) if k in summed]
    if hit:
        name = axes[0] if len(axes) == 1 else axes
        raise ValueError(
            f"value_and_grad_overlapped: jax already summed the gradient of {len(hit)} parameter leaf(s) over "
            f"{name!r} ({', '.join(hit[:3])}{', ...' if len(hit) > 3 else ''}): inside shard_map(check_vma=True) these "
            f"parameters are the same on every device, so jax's transpose sums their gradients itself, and summing "
            f"again would give the axis size times psum's numbers. Pass them made varying, "
            f"lax.pcast(params, {name!r}, to='varying'), as in docs/overlap.md")


def _run_with_starts(program: jaxpr_steps.FlatProgram, args: list, reduced: list[int], layout,
                     axis_name, kwargs, *, hold: str, backward: int) -> list:
    """Run the flattened program, starting each bucket after the step that completes it (see the
    module's docstring); the program's outputs with the reduced ones summed. ``backward``: the step
    that makes the first gradient."""
    leaf_keys = [program.out_keys[i] for i in reduced]
    due: dict[int, list[int]] = {}  # step index -> the buckets it completes (-1: before any step)
    for b, bucket in enumerate(layout.buckets):
        due.setdefault(max(program.made(leaf_keys[s.leaf]) for s in bucket.slots), []).append(b)
    last_bucket = due[max(due)][-1]  # started last: nothing is left to overlap, so the whole grid

    values: dict[int, Any] = {**program.consts, **dict(zip(program.in_keys, args))}
    kept = set(values)  # inputs and constants: never freed
    handles: list = [None] * len(layout.buckets)
    started: list = []
    since = backward - 1  # hold="recent": values made after this step are the recent ones
    weights = frozenset(_weights(program)) if hold == "weights" else frozenset()
    platform = _platform()  # the executor's bucket packing applies (lowering/packing.py)

    def read(k):
        return k.value if isinstance(k, jaxpr_steps.Lit) else values[k]

    def start_due(i: int) -> None:
        nonlocal since
        held_at = None
        for b in due.get(i, ()):
            bucket = layout.buckets[b]
            buf = bucket.pack({s.leaf: read(leaf_keys[s.leaf]) for s in bucket.slots}, platform)
            h = handles[b] = _buckets.start_in_order(buf, started, axis_name, full_grid=b == last_bucket, **kwargs)
            # What `hold` names waits for the start: the rest of the backward pass cannot run
            # before it, and the start cannot sink to the end of the step. Not for a start that
            # became XLA's own all-reduce (the dispatch table's lax sizes): XLA's scheduler places
            # and overlaps those itself, and the barriers cost its GPT-2 step 2.6% (4 x H200).
            live = _held(program, values, i, hold, since, backward, weights) if h.site is not None else []
            if live:
                tied = lax.optimization_barrier((h.passed, [values[k] for k in live]))
                values.update(zip(live, tied[1]))
                held_at = i
        if held_at is not None:  # buckets due at one step all hold the same recent values
            since = held_at

    start_due(-1)
    for i, step in enumerate(program.steps):
        values.update(zip(step.outs, jaxpr_steps.run_step(step, read)))
        start_due(i)
        for k in step.ins:  # free what no later step reads (as eval_jaxpr does)
            if not isinstance(k, jaxpr_steps.Lit) and program.last_use.get(k) == i and k not in kept:
                values.pop(k, None)
    unpacked = layout.unpack(_buckets.done_after_last(handles, started[-1]), platform)
    result = [read(k) for k in program.out_keys]
    for j, i in enumerate(reduced):
        result[i] = unpacked[j]
    return result


def _held(program: jaxpr_steps.FlatProgram, values: dict, i: int, hold: str, since: int, backward: int,
          weights: frozenset) -> list:
    """The keys that wait for a start made after step ``i``: those a later step reads and, for
    ``hold="recent"``, made after step ``since`` (else after the first gradient's step), for
    ``hold="weights"``, those of ``weights`` (the program's :func:`_weights`); for these two,
    none before the backward pass, where a start has no pass to hold back."""
    if hold == "none":
        return []
    live = [k for k, last in program.last_use.items() if last > i and k in values]
    if hold == "all":
        return live
    if i < backward:
        return []
    if hold == "weights":
        return [k for k in live if k in weights]
    recent = [k for k in live if program.made(k) > since]
    return recent or [k for k in live if program.made(k) >= backward]


def _weights(program: jaxpr_steps.FlatProgram) -> list:
    """The program's inputs that are weights by the switch's rule
    (:func:`jax_blink.switch.overlap.read_as_weight`): a BatchNorm scale or a bias, read by
    elementwise code, is not."""
    readers: dict = {k: set() for k in program.in_keys}
    for step in program.steps:
        for k in step.ins:
            if not isinstance(k, jaxpr_steps.Lit) and k in readers:
                readers[k].add(step.eqn.primitive.name)
    return [k for k, names in readers.items() if read_as_weight(names)]
