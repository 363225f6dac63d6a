"""The collectives users call, and their lowering to the ``jax_blink_collective`` custom call.

Each collective is planned at trace time (topology -> plan -> schedule), lowered to one
``jax.ffi.ffi_call`` whose attributes carry the schedule program, and differentiated exactly as
its ``lax`` counterpart (the backward pass is the ``lax`` one).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_blink.lowering import backends as _backends
from jax_blink.lowering import hierarchy as _hierarchy
from jax_blink.lowering import processes as _distributed
from jax_blink.lowering.custom_call import SUPPORTED_DTYPES, collective_call
from jax_blink.lowering.decision import across_hosts_to_lax, executor_ready, three_phases, use_lax
from jax_blink.lowering.mesh import (AxisName, axes_of, axis_index, axis_size, group_index, lax_type,
                                     on_mesh, platform as _platform)
from jax_blink.planning import schedule as _schedule
from jax_blink.planning.topology import Topology


def _check_dtype(x) -> np.dtype:
    dtype = np.dtype(x.dtype)
    if dtype.name not in SUPPORTED_DTYPES:
        raise TypeError(
            f"jax_blink: dtype {dtype.name} is not supported; supported: {', '.join(SUPPORTED_DTYPES)}"
            " (cast first, e.g. x.astype(jnp.float32))")
    return dtype


def _check_op(op: str) -> int:
    if op not in _schedule.OPS:
        raise ValueError(f"jax_blink: op {op!r} is not supported; supported: {sorted(_schedule.OPS)}")
    return _schedule.OPS[op]


def check_root(root: int, n: int) -> int:
    if not isinstance(root, (int, np.integer)) or not 0 <= root < n:
        raise ValueError(f"jax_blink: root must be a rank in [0, {n}), got {root!r}")
    return int(root)


@_distributed.in_program_order
def _run(what: str, x, n: int, forward, reference, *, axes: tuple[str, ...] = (),
         elementwise: bool = True, linear: bool = True, prefer_lax: bool = False):
    """``forward(x)`` through the executor, or ``reference(x)`` (the ``lax`` expression it equals)
    where the executor has nothing to do, cannot run, ``prefer_lax``, or an axis is vmap-bound.

    Differentiated in both modes as ``reference`` is: a ``custom_jvp`` whose tangent is
    ``reference`` of the tangent where the collective is ``linear`` (sums, gathers, broadcasts;
    ``jax.grad`` then transposes it as ``lax`` transposes its own), else ``reference``'s own jvp
    (``lax.pmax`` / ``pmin``: jax's rule, or jax's error where it has none).

    Under ``vmap``: an ``elementwise`` collective (each output element depends on the same element
    of every rank only) runs once over the whole batch, a larger operand; the others run once per
    batch element (``lax.map``).
    """
    if (n == 1 or x.size == 0 or prefer_lax or not on_mesh(axes)
            or not executor_ready(_platform(), what, n)):
        return reference(x)
    batched = jax.custom_batching.custom_vmap(forward)

    @batched.def_vmap
    def _batch_rule(axis_size, in_batched, v):
        del axis_size, in_batched  # v carries the batch as its leading axis
        return (batched(v) if elementwise else lax.map(forward, v)), True

    def differentiable(fn):
        f = jax.custom_jvp(fn)

        @f.defjvp
        def _jvp(primals, tangents):
            (v,), (t,) = primals, tangents
            t_out = reference(t) if linear else jax.jvp(reference, (v,), (t,))[1]
            return fn(v), t_out

        return f

    try:
        return differentiable(batched)(x)
    except Exception:  # noqa: BLE001
        # custom_vmap is checked on jax 0.10 only (0.11 was not at hand when this was written):
        # where it cannot trace, lose vmap support rather than the collective. A real error in
        # `forward` is raised again by the call below.
        return differentiable(forward)(x)


# ---------------------------------------------------------------------------------------------
# Public collectives.

def all_reduce(x, axis_name: AxisName, *, op: str = "sum", topology: Topology | None = None,
               method: str = "exact"):
    """Drop-in for ``lax.psum`` (``op="sum"``), ``lax.pmax`` and ``lax.pmin``.

    Call inside ``jax.shard_map`` or ``jax.pmap``. ``topology`` overrides discovery (its device
    count must equal the axis size); ``method`` picks the tree-packing solver ("exact" or "mwu").
    Where XLA's own collective was measured faster for this size on this machine
    (:mod:`jax_blink.lowering.dispatch_table`), the call goes to ``lax`` (``config.dispatch`` changes that).
    A bool ``x`` is summed as int32, as ``lax.psum`` sums it (its max and min stay bool).
    """
    opcode = _check_op(op)
    if np.dtype(x.dtype) == np.bool_:  # lax.psum converts bools to int32 before its sum
        as_int = all_reduce(x.astype(jnp.int32), axis_name, op=op, topology=topology, method=method)
        return as_int if op == "sum" else as_int.astype(jnp.bool_)
    _check_dtype(x)
    axes = axes_of(axis_name)
    n = axis_size(axes)
    lax_fn = {0: lax.psum, 1: lax.pmax, 2: lax.pmin}[opcode]

    def reference(v):
        return lax_fn(v, axes)

    def f(v):
        flat = v.reshape(-1)
        return collective_call(flat, axes, "allreduce", op=op, topology=topology, method=method,
                                result_type=lax_type(reference, flat)).reshape(v.shape)

    hosts, to_lax = three_phases("all_reduce", axes)
    if hosts is not None:  # ranks on several hosts: the three phases (jax_blink.lowering.hierarchy)
        def f(v):  # noqa: F811
            return _hierarchy.all_reduce(
                v, axes, op, hosts,
                functools.partial(collective_call, topology=topology, method=method),
                group_index(axes), lambda b: lax_type(lambda u: lax.psum(u, axes), b))

    return _run("all_reduce", x, n, f, reference, axes=axes, linear=op == "sum",
                prefer_lax=to_lax or use_lax("allreduce", n, x, None if hosts is not None else axes))


def broadcast(x, axis_name: AxisName, *, root: int = 0, topology: Topology | None = None,
              method: str = "exact"):
    """Every rank gets rank ``root``'s ``x`` (the same as ``lax.psum`` of ``x`` masked to root)."""
    _check_dtype(x)
    axes = axes_of(axis_name)
    n = axis_size(axes)
    root = check_root(root, n)

    def reference(v):
        idx = axis_index(axes)
        return lax.psum(jnp.where(idx == root, v, jnp.zeros_like(v)), axes)


    def f(v):
        flat = v.reshape(-1)
        return collective_call(flat, axes, "broadcast", root=root, topology=topology,
                                method=method, result_type=lax_type(reference, flat)).reshape(v.shape)

    return _run("broadcast", x, n, f, reference, axes=axes,
                prefer_lax=across_hosts_to_lax("broadcast", axes) or use_lax("broadcast", n, x, axes))


def reduce(x, axis_name: AxisName, *, root: int = 0, op: str = "sum",
           topology: Topology | None = None, method: str = "exact"):
    """Rank ``root`` gets the reduction of every rank's ``x``; every other rank gets its ``x`` back."""
    _check_dtype(x)
    opcode = _check_op(op)
    axes = axes_of(axis_name)
    n = axis_size(axes)
    root = check_root(root, n)
    lax_fn = {0: lax.psum, 1: lax.pmax, 2: lax.pmin}[opcode]

    def is_root():
        return axis_index(axes) == root

    def reference(v):
        return jnp.where(is_root(), lax_fn(v, axes), v)


    def f(v):
        flat = v.reshape(-1)
        out = collective_call(flat, axes, "reduce", op=op, root=root, topology=topology,
                               method=method, result_type=lax_type(reference, flat)).reshape(v.shape)
        # Non-root ranks hold their subtree's partial result: give them their input back.
        return jnp.where(is_root(), out, v)

    return _run("reduce", x, n, f, reference, axes=axes, linear=op == "sum",
                prefer_lax=across_hosts_to_lax("reduce", axes) or use_lax("reduce", n, x, axes))


def all_gather(x, axis_name: AxisName, *, axis: int = 0, tiled: bool = False, to: str = "varying",
               topology: Topology | None = None, method: str = "exact"):
    """Drop-in for ``lax.all_gather``: every rank's ``x`` stacked (or, tiled, concatenated).

    ``to`` is ``lax.all_gather``'s: the result's manual axis type. The executor runs ``"varying"``
    (the default); ``"invarying"`` and ``"reduced"`` go to ``lax.all_gather`` itself.
    """
    if to != "varying":  # types the executor's result is not declared with: lax's own does it
        return lax.all_gather(x, axis_name, axis=axis, tiled=tiled, to=to)
    _check_dtype(x)
    axes = axes_of(axis_name)
    n = axis_size(axes)
    ndim_out = x.ndim if tiled else x.ndim + 1
    if not -ndim_out <= axis < ndim_out:
        raise ValueError(f"jax_blink.all_gather: axis {axis} out of range for a result of rank {ndim_out}")

    def reference(v):
        return lax.all_gather(v, axes, axis=axis, tiled=tiled)


    hosts, to_lax = three_phases("all_gather", axes)

    def f(v):
        # Declared as lax.all_gather's result (varying along the axis, as lax's is).
        gathered = lax_type(lambda u: lax.all_gather(u, axes, tiled=True), v.reshape(-1))
        if hosts is not None:  # ranks on several hosts: among the hosts, then inside (hierarchy)
            out = _hierarchy.all_gather(v.reshape(-1), axes, hosts,
                                        functools.partial(collective_call, topology=topology, method=method),
                                        group_index(axes), gathered)
        else:
            # Rank k's segment k must hold its x; the executor reads no other segment of a rank's
            # operand, so n copies of x serve (one fused write; zeros + dynamic_update_slice made
            # XLA keep a copy of the zeros per chained call: 40 MiB of temporaries at 2 MiB per rank).
            buf = jnp.broadcast_to(v.reshape(1, -1), (n, v.size)).reshape(-1)
            out = collective_call(buf, axes, "allgather", topology=topology, method=method,
                                   result_type=gathered, in_place=True)
        stacked = out.reshape((n,) + v.shape)
        if tiled:
            a = axis % v.ndim
            stacked = jnp.moveaxis(stacked, 0, a)
            return stacked.reshape(v.shape[:a] + (n * v.shape[a],) + v.shape[a + 1:])
        return jnp.moveaxis(stacked, 0, axis % ndim_out)

    return _run("all_gather", x, n, f, reference, axes=axes, elementwise=False,
                prefer_lax=to_lax or use_lax("allgather", n, x, None if hosts is not None else axes))


def reduce_scatter(x, axis_name: AxisName, *, scatter_dimension: int = 0, tiled: bool = False,
                   topology: Topology | None = None, method: str = "exact"):
    """Drop-in for ``lax.psum_scatter``: rank k gets block k of the sum."""
    _check_dtype(x)
    axes = axes_of(axis_name)
    n = axis_size(axes)
    if not -x.ndim <= scatter_dimension < x.ndim:
        raise ValueError(f"jax_blink.reduce_scatter: scatter_dimension {scatter_dimension} out of "
                         f"range for an operand of rank {x.ndim}")
    d = scatter_dimension % x.ndim
    if (tiled and x.shape[d] % n) or (not tiled and x.shape[d] != n):
        need = f"a multiple of {n}" if tiled else f"equal to the axis size {n}"
        raise ValueError(f"jax_blink.reduce_scatter: dimension {d} has size {x.shape[d]}, must be {need}")

    def reference(v):
        return lax.psum_scatter(v, axes, scatter_dimension=d, tiled=tiled)


    hosts, to_lax = three_phases("reduce_scatter", axes)

    def f(v):
        blocks = jnp.moveaxis(v, d, 0)
        block_shape = (blocks.shape[0] // n,) + blocks.shape[1:]
        if hosts is not None:  # ranks on several hosts: inside, then among the hosts (hierarchy)
            mine = _hierarchy.reduce_scatter(
                blocks.reshape(n, -1), axes, hosts,
                functools.partial(collective_call, topology=topology, method=method),
                group_index(axes)).reshape(block_shape)
            mine = jnp.moveaxis(mine, 0, d)
            return mine if tiled else jnp.squeeze(mine, d)
        flat = blocks.reshape(-1)
        # Declared varying along the axis, as lax.psum_scatter's result (n blocks: the call's
        # result holds every block, of which this rank keeps its own).
        scattered = lax_type(lambda u: jnp.tile(lax.psum_scatter(u, axes, tiled=True), n), flat)
        out = collective_call(flat, axes, "reducescatter", topology=topology, method=method,
                               result_type=scattered, in_place=True)
        idx = axis_index(axes)
        mine = lax.dynamic_slice_in_dim(out.reshape(n, -1), idx, 1, axis=0).reshape(block_shape)
        mine = jnp.moveaxis(mine, 0, d)
        return mine if tiled else jnp.squeeze(mine, d)

    return _run("reduce_scatter", x, n, f, reference, axes=axes, elementwise=False,
                prefer_lax=to_lax or use_lax("reducescatter", n, x, None if hosts is not None else axes))


def backends() -> dict[str, bool]:
    """Which executors this build has (``{"cpu": ..., "gpu": ...}``)."""
    return _backends.available()


check = _backends.check
reset = _backends.reset
check_environment = _backends.check_environment
