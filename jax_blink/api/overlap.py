"""The asynchronous all-reduce: start it where its operand exists, take its result where it is used,
and let the compute in between run beside it (GPUs; ``docs/overlap.md``)::

    h = jax_blink.all_reduce_start(g1, "data")      # launched on a side stream; returns at once
    g2 = backward_of_the_next_layers(...)           # runs beside the all-reduce
    h2 = jax_blink.all_reduce_start(g2, "data")
    s1 = jax_blink.all_reduce_done(h, after=h2)     # waits (on the GPU, not the host) for h
    s2 = jax_blink.all_reduce_done(h2)

``all_reduce_done(h)`` equals ``lax.psum(x, axis)`` bit for bit, as :func:`jax_blink.all_reduce`
does. Every start needs exactly one done, and every rank must run the same starts in the same
order (they do: one program). ``after=`` makes the done wait until another handle's start ran
(or an array exists), so that XLA cannot place the wait early. Where no asynchronous executor runs
(CPU host devices, several processes, one rank, the dispatch table's ``lax`` sizes) the start
computes the result at once and the done returns it: the same program, the same numbers. The
pair is not differentiable (use :func:`jax_blink.all_reduce` under ``jax.grad``).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax import lax

from jax_blink.lowering import async_call as _async
from jax_blink.lowering.custom_call import SUPPORTED_DTYPES
from jax_blink.lowering.decision import executor_ready, three_phases, use_lax
from jax_blink.lowering.mesh import AxisName, axes_of, axis_size, lax_type, on_mesh, platform as _platform
from jax_blink.planning import schedule as _schedule
from jax_blink.planning.topology import Topology


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class AllReduceHandle:
    """An all-reduce in flight (:func:`all_reduce_start`); :func:`all_reduce_done` gives its result.

    Attributes:
        passed: The operand handed back by the start (kept alive until the done), flat.
        result: The result buffer, flat (in flight until the done).
        site: What the done needs (None where the start already computed the result).
        shape: The operand's shape.
    """

    passed: Any
    result: Any
    site: Any
    shape: tuple[int, ...]

    def tree_flatten(self):
        return (self.passed, self.result), (self.site, self.shape)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], children[1], *aux)


def all_reduce_start(x, axis_name: AxisName, *, op: str = "sum", topology: Topology | None = None,
                     method: str = "exact", full_grid: bool = False) -> AllReduceHandle:
    """Start the all-reduce of ``x`` over a mesh axis; :func:`all_reduce_done` gives its result.

    Args:
        x: This rank's operand (float32, bfloat16, float16, int32; float64 and int64 with x64).
        axis_name: A mesh axis name, or a tuple of names.
        op: ``"sum"``, ``"max"`` or ``"min"``.
        topology: The links to plan on (default: discovered).
        method: The tree-packing solver (``"exact"`` or ``"mwu"``).
        full_grid: Run on every SM the executor uses, not the small asynchronous grid
            (``JAX_BLINK_ASYNC_BLOCKS``, default 24 blocks) that leaves most SMs to compute: for
            the last all-reduce of a step, which nothing is left to overlap.

    Returns:
        The handle of the call in flight.

    Raises:
        TypeError: ``x``'s dtype is not one the executors take (cast it first), or ``full_grid``
            is not a bool.
        ValueError: ``op`` is not one of the three.
    """
    if op not in _schedule.OPS:
        raise ValueError(f"jax_blink: op {op!r} is not supported; supported: {sorted(_schedule.OPS)}")
    if not isinstance(full_grid, (bool, np.bool_)):
        raise TypeError(f"jax_blink.all_reduce_start: full_grid must be True or False, got {full_grid!r}")
    dtype = np.dtype(x.dtype)
    if dtype.name not in SUPPORTED_DTYPES:
        raise TypeError(f"jax_blink.all_reduce_start: dtype {dtype.name} is not supported; supported: "
                        f"{', '.join(SUPPORTED_DTYPES)} (cast first, e.g. x.astype(jnp.float32))")
    axes = axes_of(axis_name)
    n = axis_size(axes)
    lax_fn = {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}[op]
    shape = tuple(x.shape)
    flat = x.reshape(-1)

    def reference(v):
        return lax_fn(v, axes)

    hosts, to_lax = three_phases("all_reduce", axes)
    platform = _platform()
    if (n == 1 or x.size == 0 or hosts is not None or to_lax or not on_mesh(axes)
            or not executor_ready(platform, "all_reduce", n) or use_lax("allreduce", n, x, axes)):
        return AllReduceHandle(flat, reference(flat), None, shape)
    passed, result, site = _async.start_call(flat, axes, op=op, topology=topology, method=method,
                                             result_type=lax_type(reference, flat), platform=platform,
                                             full_grid=full_grid)
    return AllReduceHandle(passed, result, site, shape)


def all_reduce_done(handle: AllReduceHandle, *, after=None):
    """The result of :func:`all_reduce_start`: ``lax.psum`` (``pmax``, ``pmin``) of its operand.

    Args:
        handle: The start's handle; each handle is awaited exactly once.
        after: Another handle (the done then waits until that one's start ran: DDP's order, this
            bucket's wait after the next bucket's start) or an array that must exist first; None:
            no order beyond the start's own.

    Returns:
        The reduced array, of the operand's shape.

    Raises:
        TypeError: ``handle`` is not an :class:`AllReduceHandle`.
    """
    if not isinstance(handle, AllReduceHandle):
        raise TypeError(f"jax_blink.all_reduce_done takes the handle of all_reduce_start, got {type(handle).__name__}")
    if handle.site is None:
        return handle.result.reshape(handle.shape)
    token = after.passed if isinstance(after, AllReduceHandle) else after
    return _async.done_call(handle.passed, handle.result, token, handle.site).reshape(handle.shape)
