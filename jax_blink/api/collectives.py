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
from jax_blink.lowering.custom_call import SUPPORTED_DTYPES, collective_call, start_comm_epoch
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
    """Reduce ``x`` over the ranks of a mesh axis: drop-in for ``lax.psum``, ``lax.pmax``, ``lax.pmin``.

    Call inside ``jax.shard_map`` or ``jax.pmap`` (under ``jit``). Every rank gets the same result,
    bit for bit. Where XLA's own collective was measured faster for this collective, size and
    dtype on this kind of machine (:mod:`jax_blink.lowering.dispatch_table`), the call goes to
    ``lax`` instead (``jax_blink.config.dispatch = "blink"`` runs the executor anyway); where no
    executor can run it, ``jax_blink.config.fallback`` says what happens. Gradients are ``lax``'s.

    Args:
        x: This rank's operand: float32, bfloat16, float16, int32 or bool (float64 and int64
            with ``jax_enable_x64``).
        axis_name: A mesh axis name, or a tuple of names (the ranks of all of them).
        op: ``"sum"``, ``"max"`` or ``"min"``.
        topology: The links of the axis's devices to plan on (default: discovered, or the
            platform's uniform graph); its device count must equal the axis size.
        method: The tree-packing solver: ``"exact"`` (LP with column generation) or ``"mwu"``
            (the paper's multiplicative weights).

    Returns:
        An array of ``x``'s shape and dtype: the reduction over the axis, as ``lax`` gives it
        (a bool ``x`` is summed as int32, as ``lax.psum`` sums it; its max and min stay bool).

    Raises:
        TypeError: ``x``'s dtype is not one the executors take.
        ValueError: ``op`` is not one of the three; or, with ``fallback="raise"``, no executor
            can run the call (the message says why).

    Example::

        @jax.jit
        @jax.shard_map(mesh=mesh, in_specs=P("data"), out_specs=P())
        def step(g):
            return jax_blink.all_reduce(g, "data")   # where you wrote lax.psum(g, "data")
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
    """Give every rank of the axis rank ``root``'s ``x``.

    The same result as ``lax.psum`` of ``x`` masked to ``root``, over trees that carry one copy.
    Call inside ``jax.shard_map`` or ``jax.pmap``.

    Args:
        x: This rank's operand (only ``root``'s is read): a dtype :func:`all_reduce` takes.
        axis_name: A mesh axis name, or a tuple of names.
        root: The rank whose ``x`` every rank gets, in ``[0, axis size)``.
        topology: The links of the axis's devices to plan on (default: discovered, or the
            platform's uniform graph); its device count must equal the axis size.
        method: The tree-packing solver: ``"exact"`` (LP with column generation) or ``"mwu"``
            (the paper's multiplicative weights).

    Returns:
        ``root``'s ``x``, on every rank.

    Raises:
        TypeError: ``x``'s dtype is not one the executors take.
        ValueError: ``root`` is not a rank of the axis.
    """
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
    """Reduce every rank's ``x`` to rank ``root``.

    Call inside ``jax.shard_map`` or ``jax.pmap``.

    Args:
        x: This rank's operand: a dtype :func:`all_reduce` takes.
        axis_name: A mesh axis name, or a tuple of names.
        root: The rank that gets the reduction, in ``[0, axis size)``.
        op: ``"sum"``, ``"max"`` or ``"min"``.
        topology: The links of the axis's devices to plan on (default: discovered, or the
            platform's uniform graph); its device count must equal the axis size.
        method: The tree-packing solver: ``"exact"`` (LP with column generation) or ``"mwu"``
            (the paper's multiplicative weights).

    Returns:
        On ``root``, the reduction of every rank's ``x``; on every other rank, its own ``x``.

    Raises:
        TypeError: ``x``'s dtype is not one the executors take.
        ValueError: ``root`` is not a rank of the axis, or ``op`` not one of the three.
    """
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
    """Gather every rank's ``x`` on every rank: drop-in for ``lax.all_gather``.

    Call inside ``jax.shard_map`` or ``jax.pmap``.

    Args:
        x: This rank's operand: a dtype :func:`all_reduce` takes.
        axis_name: A mesh axis name, or a tuple of names.
        axis: Where the ranks' operands go in the result (a new dimension, or with ``tiled`` the
            dimension they are concatenated along).
        tiled: Concatenate along ``axis`` instead of stacking in a new dimension.
        to: ``lax.all_gather``'s manual axis type of the result. The executor runs ``"varying"``
            (the default); ``"invarying"`` and ``"reduced"`` go to ``lax.all_gather`` itself.
        topology: The links of the axis's devices to plan on (default: discovered, or the
            platform's uniform graph); its device count must equal the axis size.
        method: The tree-packing solver: ``"exact"`` (LP with column generation) or ``"mwu"``
            (the paper's multiplicative weights).

    Returns:
        The operands of all ranks in rank order, as ``lax.all_gather(x, axis_name, axis=axis,
        tiled=tiled)`` gives them.

    Raises:
        TypeError: ``x``'s dtype is not one the executors take.
        ValueError: ``axis`` is out of range for the result.
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
    """Sum ``x`` over the axis and give rank k block k of the sum: drop-in for ``lax.psum_scatter``.

    Call inside ``jax.shard_map`` or ``jax.pmap``.

    Args:
        x: This rank's operand: a dtype :func:`all_reduce` takes.
        axis_name: A mesh axis name, or a tuple of names.
        scatter_dimension: The dimension of ``x`` split into the ranks' blocks.
        tiled: Blocks of ``x.shape[scatter_dimension] / n`` rows kept as a dimension (else that
            dimension must equal the axis size ``n`` and is dropped).
        topology: The links of the axis's devices to plan on (default: discovered, or the
            platform's uniform graph); its device count must equal the axis size.
        method: The tree-packing solver: ``"exact"`` (LP with column generation) or ``"mwu"``
            (the paper's multiplicative weights).

    Returns:
        This rank's block of the sum, as ``lax.psum_scatter`` gives it.

    Raises:
        TypeError: ``x``'s dtype is not one the executors take.
        ValueError: ``scatter_dimension`` is out of range, or its size does not fit the axis size.
    """
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
    """Which executors this installation has.

    Returns:
        ``{"cpu": bool, "gpu": bool}``: whether the CPU executor and the CUDA executor were built
        and load.

    Example::

        >>> jax_blink.backends()
        {'cpu': True, 'gpu': False}
    """
    return _backends.available()


check = _backends.check
check_environment = _backends.check_environment


def reset() -> None:
    """Clear every executor's recorded failures and call counts, so collectives run again.

    After a failure on a GPU, that GPU's collectives keep failing until this is called; a call
    site whose processes lost step (CUDA IPC) stays failed, and sites traced afterwards run.
    It also starts a new epoch of call-site ids: in a job of several processes, call it in every
    process, as many times in each, and the sites traced afterwards pair across the processes
    again, also where the failure left them with different numbers of sites traced (a process
    that never reached one). Call it only while no collective runs.

    Raises:
        RuntimeError: A collective is running.
    """
    _backends.reset()
    start_comm_epoch()


# The asynchronous all-reduce (jax_blink/api/overlap.py), exported beside the synchronous one.
from jax_blink.api.overlap import AllReduceHandle, all_reduce_done, all_reduce_start  # noqa: E402,F401
