"""Gradients summed over a mesh axis while the backward pass runs: DDP's overlap for JAX::

    step_grad = jax_blink.value_and_grad_overlapped(loss, "data")
    loss, grads = step_grad(params, batch)      # grads: summed over "data" (psum's numbers)

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
the starts compute at once and the program equals the synchronous buckets.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax import lax

from jax_blink.api import buckets as _buckets
from jax_blink.lowering import jax_internals as _internals
from jax_blink.lowering.mesh import AxisName
from jax_blink.options import DEFAULT_BUCKET_BYTES, DEFAULT_FIRST_BUCKET_BYTES


@dataclasses.dataclass(frozen=True)
class _Step:
    """One equation of the flattened program: its inputs (keys, or ``_Lit`` constants) and the
    keys of its results."""

    eqn: Any
    ins: tuple
    outs: tuple


@dataclasses.dataclass(frozen=True)
class _Lit:
    value: Any


def value_and_grad_overlapped(fun: Callable, axis_name: AxisName, *, argnums: int | Sequence[int] = 0,
                              has_aux: bool = False, reduce_aux: bool = False,
                              bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                              first_bucket_bytes: int | None = DEFAULT_FIRST_BUCKET_BYTES,
                              **kwargs) -> Callable:
    """``jax.value_and_grad(fun)`` whose gradients come summed over ``axis_name``, each bucket's
    all-reduce started inside the backward pass as soon as its gradients exist.

    Call the result inside ``shard_map`` (or ``pmap``) over ``axis_name``, where the gradients
    are per-device (e.g. of parameters made varying with ``lax.pcast``).

    Args:
        fun: The loss, as for ``jax.value_and_grad``.
        axis_name: The mesh axis (or tuple of axes) to sum over.
        argnums: The arguments to differentiate.
        has_aux: ``fun`` returns ``(loss, aux)``.
        reduce_aux: Also sum the array leaves of ``aux`` (e.g. BatchNorm statistics) over the
            axis, in the first buckets (they exist before the backward pass starts).
        bucket_bytes: DDP's bucket cap (default 25 MiB).
        first_bucket_bytes: The first bucket's cap (default 1 MiB).
        **kwargs: Passed to :func:`jax_blink.all_reduce_start` (``topology``, ``method``).

    Returns:
        A function of ``fun``'s arguments returning ``(value, grads)`` (``((value, aux), grads)``
        with ``has_aux``), the gradients (and with ``reduce_aux`` the aux leaves) summed.
    """
    value_and_grad = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)

    def run(*args):
        closed, shapes = jax.make_jaxpr(value_and_grad, return_shape=True)(*args)
        value_part = shapes[0]
        n_value = len(jax.tree.leaves(value_part))
        first_reduced = 1 if reduce_aux else n_value
        reduced = list(range(first_reduced, len(closed.jaxpr.outvars)))
        places = _buckets._made_at(closed.jaxpr)
        order = sorted(range(len(reduced)), key=lambda i: (places[reduced[i]], -i))
        tree = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in
                (closed.jaxpr.outvars[i] for i in reduced)]
        if not tree:
            raise ValueError("value_and_grad_overlapped: nothing to sum (no gradient leaves)")
        layout = _buckets.BucketLayout.of(tree, bucket_bytes, first_bucket_bytes, order=order)
        flat = _run_with_starts(closed, jax.tree.leaves(args), reduced, layout, axis_name, kwargs)
        out_tree = jax.tree.structure(shapes)
        return jax.tree.unflatten(out_tree, flat)

    return run


def _flatten(jaxpr, env: dict, consts: dict, steps: list, fresh: Callable[[], int]) -> None:
    """Append ``jaxpr``'s equations to ``steps`` with nested ``jit`` / ``closed_call`` programs
    inlined; ``env`` maps this program's variables to keys (``_Lit`` for constants)."""
    def key(atom):
        lit = _internals.literal_value(atom)
        return _Lit(lit) if not _internals.is_var(atom) else env[atom]

    for eqn in jaxpr.eqns:
        ins = tuple(key(v) for v in eqn.invars)
        inner = _internals.inlined_call_jaxpr(eqn)
        if inner is not None:
            sub = {}
            for cv, c in zip(inner.jaxpr.constvars, inner.consts):
                k = fresh()
                consts[k] = c
                sub[cv] = k
            sub.update(zip(inner.jaxpr.invars, ins))
            _flatten(inner.jaxpr, sub, consts, steps, fresh)
            for ov, outer in zip(inner.jaxpr.outvars, eqn.outvars):
                env[outer] = _Lit(_internals.literal_value(ov)) if not _internals.is_var(ov) else sub[ov]
            continue
        outs = tuple(fresh() for _ in eqn.outvars)
        env.update(zip(eqn.outvars, outs))
        steps.append(_Step(eqn, ins, outs))


def _run_with_starts(closed, args: list, reduced: list[int], layout, axis_name, kwargs) -> list:
    """Run the traced program, starting each bucket after the step that completes it (see the
    module's docstring); the program's outputs with the reduced ones summed."""
    from jax_blink.api.overlap import all_reduce_done, all_reduce_start

    counter = iter(range(1 << 62))
    fresh = lambda: next(counter)  # noqa: E731
    env_map, consts, steps = {}, {}, []
    for cv, c in zip(closed.jaxpr.constvars, closed.consts):
        k = fresh()
        consts[k] = c
        env_map[cv] = k
    for v, a in zip(closed.jaxpr.invars, args):
        k = fresh()
        env_map[v] = k
        consts[k] = a
    _flatten(closed.jaxpr, env_map, consts, steps, fresh)
    out_keys = [_Lit(_internals.literal_value(v)) if not _internals.is_var(v) else env_map[v]
                for v in closed.jaxpr.outvars]

    made_at = {k: i for i, s in enumerate(steps) for k in s.outs}
    last_use: dict[int, int] = {}
    for i, s in enumerate(steps):
        for k in s.ins:
            if not isinstance(k, _Lit):
                last_use[k] = i
    for k in out_keys:
        if not isinstance(k, _Lit):
            last_use[k] = len(steps)
    # Bucket b is complete after step ready[b] (-1: before the first step).
    leaf_keys = [out_keys[i] for i in reduced]
    ready = [max((made_at.get(leaf_keys[s.leaf], -1) if not isinstance(leaf_keys[s.leaf], _Lit) else -1)
                 for s in b.slots) for b in layout.buckets]
    due: dict[int, list[int]] = {}
    for b, i in enumerate(ready):
        due.setdefault(i, []).append(b)
    last_bucket = due[max(due)][-1]  # started last: nothing is left to overlap, so the whole grid

    values: dict[int, Any] = dict(consts)
    handles: list = [None] * len(layout.buckets)
    started: list = []

    def read(k):
        return k.value if isinstance(k, _Lit) else values[k]

    def start_due(i: int) -> None:
        for b in due.get(i, ()):
            bucket = layout.buckets[b]
            leaves = [jax.numpy.ravel(read(leaf_keys[s.leaf])) for s in bucket.slots]
            buf = leaves[0] if len(leaves) == 1 else jax.numpy.concatenate(leaves)
            if started and _buckets._on_cpu(buf):  # CPU: the synchronous starts in one order
                buf = _buckets._wait_for(buf, started[-1].result)
            h = all_reduce_start(buf, axis_name, full_grid=b == last_bucket, **kwargs)
            handles[b] = h
            started.append(h)
            # Everything still needed waits for the start: the rest of the backward pass cannot
            # run before it, and the start cannot sink to the end of the step.
            live = [k for k, last in last_use.items() if last > i and k in values]
            if live:
                tied = lax.optimization_barrier((h.passed, [values[k] for k in live]))
                values.update(zip(live, tied[1]))

    start_due(-1)
    for i, s in enumerate(steps):
        outs = _internals.bind_equation(s.eqn, [read(k) for k in s.ins])
        values.update(zip(s.outs, outs))
        start_due(i)
        for k in s.ins:  # free what no later step reads (as eval_jaxpr does)
            if not isinstance(k, _Lit) and last_use.get(k, -1) == i and k not in consts:
                values.pop(k, None)
    last = started[-1]
    summed = [all_reduce_done(h, after=last if h is not last else None) for h in handles]
    unpacked = layout.unpack(summed)
    result = [read(k) for k in out_keys]
    for j, i in enumerate(reduced):
        result[i] = unpacked[j]
    return result
