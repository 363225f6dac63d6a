"""The asynchronous all-reduce: a ``jax_blink_start`` / ``jax_blink_done`` pair of custom calls.

On GPUs (one process) the start launches the executor's kernel on a side stream of its own and
returns at once; the done makes XLA's stream wait for it (an event, no host synchronisation), so
the compute that XLA schedules between the two runs beside the collective
(``kernels/cuda/async_ffi.cc``, ``docs/overlap.md``)::

    passed, result, site = start_call(flat, axes, result_type=t)   # x's buffer, the sum in flight
    ...                                                              # compute here overlaps
    out = done_call(passed, result, token, site)                     # token: what done waits for

* ``passed`` is the operand handed back (aliased to it): done consumes it, so XLA keeps the
  operand's buffer alive and untouched until the kernel that reads it has finished.
* ``token`` is any array that must exist before done runs: the training step passes the next
  bucket's ``passed``, so bucket k's done comes after bucket k+1's start (DDP's order).

Where there are no streams (CPU host devices) or no asynchronous executor (several processes, a
build without the handlers), the start is the synchronous ``jax_blink_collective`` call and the
done is ``jax_blink_after`` (CPU: the result, once the token exists) or the result itself: the
same program runs and gives the same bits. On CPU the start is an ordinary collective call, so
the call-order chain (:mod:`jax_blink.lowering.call_order`) orders it like any other.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jax_blink.lowering import backends as _backends
from jax_blink.lowering import custom_call as _custom_call
from jax_blink.lowering import processes as _distributed
from jax_blink.lowering.mesh import axis_index, axis_size, group_index, platform as current_platform
from jax_blink.options import config
from jax_blink.planning import schedule as _schedule

#: GPU: launch the all-reduce on the side stream; results (operand passed through, result).
TARGET_START = _backends.TARGET_START
#: GPU: XLA's stream waits for the oldest start of the same site; result = the start's result.
TARGET_DONE = _backends.TARGET_DONE

@dataclasses.dataclass(frozen=True)
class Site:
    """One lowered start: what its done needs.

    Attributes:
        comm_id: The call site's id (the executor's FIFO of started calls is keyed on it); None
            where the start ran synchronously and the done only passes its result on.
        platform: The platform it was lowered for (``"gpu"``, ``"cpu"``).
    """

    comm_id: int | None
    platform: str


def register_async(platform: str) -> bool:
    """Whether ``platform``'s executor has the start and done handlers, registered with XLA (by
    :func:`jax_blink.lowering.backends.register`, with the rest); False on CPU, where the
    synchronous call stands in."""
    return (platform == "gpu" and _backends.register(platform)
            and TARGET_START in _backends.module(platform).registrations())


def runs_async(platform: str) -> bool:
    """Whether a start lowered now for ``platform`` runs on a side stream (GPU, one process, a
    build with the handlers), rather than synchronously."""
    return platform == "gpu" and jax.process_count() == 1 and register_async(platform)


def start_call(flat, axes, *, op: str = "sum", topology=None, method: str = "exact", result_type=None,
               platform: str | None = None, full_grid: bool = False, sub=None):
    """Start an all-reduce of the flat operand ``flat`` over ``axes``.

    Args:
        flat: This rank's operand, one dimension.
        axes: The mesh axes of the ranks.
        op: ``"sum"``, ``"max"`` or ``"min"``.
        topology: The links to plan on (default: discovered).
        method: The packing method.
        result_type: The type of the ``lax`` expression it equals (``lax_type``).
        platform: The platform being lowered for (default: the current one).
        full_grid: Run on the executor's whole grid (a communicator of its own), not the small
            asynchronous one: for the last bucket of a step, when nothing is left to overlap.
        sub: The ranks as a :class:`jax_blink.lowering.hierarchy.SubGroup` (its ``n``, ``rank`` and
            ``group``) instead of ``axes``: the switch's lowering rules, which see no axis
            environment, give this device's rank from its mesh position.

    Returns:
        ``(passed, result, site)``: the operand handed back, the result (in flight until the done),
        and the :class:`Site` that :func:`done_call` takes.
    """
    platform = platform or current_platform()
    if not runs_async(platform):
        result = _custom_call.collective_call(flat, axes, "allreduce", op=op, topology=topology,
                                              method=method, result_type=result_type, platform=platform,
                                              sub=sub)
        return flat, result, Site(None, platform)
    config.validate()
    n = axis_size(axes) if sub is None else sub.n
    topo = (_custom_call.topology_for(n, platform, topology, axes) if sub is None
            else _custom_call.topology_for(n, platform, topology))
    itemsize = np.dtype(flat.dtype).itemsize
    chunk = _custom_call.chunk_bytes_for("allreduce", n, int(flat.size) * itemsize, flat.dtype)
    program = _custom_call.build_program(topo, "allreduce", None, int(flat.size), itemsize, chunk, method)
    passed_type = jax.eval_shape(lambda v: v, flat)  # the operand's own type (varying under shard_map)
    if result_type is None:
        result_type = jax.ShapeDtypeStruct(flat.shape, flat.dtype)
    comm_id = _custom_call._next_comm_id()
    # No side effect, like the synchronous call: each site has its own comm_id (never merged), and
    # its results are used (done consumes both), so XLA neither drops nor duplicates it.
    call = jax.ffi.ffi_call(TARGET_START, (passed_type, result_type), has_side_effect=False,
                            input_output_aliases={0: 0})
    rank = axis_index(axes).astype(np.int32) if sub is None else sub.rank
    group = group_index(axes) if sub is None else sub.group
    passed, result = call(flat, rank, group,
                          program=program, op=np.int32(_schedule.OPS[op]), comm_id=np.int64(comm_id),
                          timeout_ms=np.int64(round(config.timeout_s * 1000)), full_grid=np.int32(full_grid))
    return passed, result, Site(comm_id, platform)


def done_call(passed, result, token, site: Site):
    """The result of a :func:`start_call`, once the collective has finished and ``token`` exists.

    Args:
        passed: The start's operand handed back.
        result: The start's result.
        token: An array that must exist before this done runs (e.g. the next bucket's ``passed``);
            None: no ordering beyond the start's own.
        site: The start's :class:`Site`.

    Returns:
        The all-reduced array (the start's result buffer).
    """
    if site.comm_id is None:
        if (token is not None and site.platform == "cpu" and token.size and result.size
                and _backends.register("cpu")):
            return _distributed.after(result, token.reshape(-1)[:1])
        return result
    if token is None:
        token = passed
    result_type = jax.eval_shape(lambda v: v, result)
    call = jax.ffi.ffi_call(TARGET_DONE, result_type, has_side_effect=False, input_output_aliases={1: 0})
    return call(passed, result, token, comm_id=np.int64(site.comm_id))
