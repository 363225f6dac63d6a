"""The ``jax_blink_collective`` custom call: the topology a call plans on, its program (plan ->
schedule, cached), the executor's attributes, and the ``jax.ffi.ffi_call`` that carries them."""
from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np

from jax_blink.lowering import backends as _backends
from jax_blink.lowering import chunk_cache
from jax_blink.lowering import processes as _distributed
from jax_blink.lowering.mesh import axis_index, axis_size, device_kind, group_index, platform as current_platform
from jax_blink.options import AUTO, check_chunk_bytes, config, env_value
from jax_blink.planning import forms as _forms
from jax_blink.planning import schedule as _schedule
from jax_blink.planning.packing import hybrid_share, plan as _plan
from jax_blink.planning.topology import DEFAULT_HOST_ENGINE, HOST_PATH_EFFICIENCY, Topology

#: The dtypes the executors reduce and move.
SUPPORTED_DTYPES = ("float32", "float64", "bfloat16", "float16", "int32", "int64")

_comm_lock = threading.Lock()
#: Comm ids of epoch e count from e << 44 + 1 (:func:`start_comm_epoch`).
COMM_EPOCH_SHIFT = 44
_comm_epoch = 0
_comm_next = 1


def _next_comm_id() -> int:
    # One id per lowered call site: the executors key their rendezvous state on it. The processes
    # of a job pair their sites by it, so each must have lowered as many sites since the epoch began.
    global _comm_next
    with _comm_lock:
        _comm_next += 1
        return _comm_next - 1


def upcoming_comm_id() -> int:
    """The comm id the next call site lowered in this process will take (nothing is drawn): to
    compare the processes of a job after a failure."""
    with _comm_lock:
        return _comm_next


def start_comm_epoch() -> int:
    """Count the comm ids of new call sites from a new base, ``epoch << COMM_EPOCH_SHIFT``, and
    return the epoch. A failure can leave the processes of a job with different numbers of sites
    lowered (one that never reached a site, one that failed before its set-up); every process
    starting the same next epoch (``jax_blink.reset()``) pairs their new sites again."""
    global _comm_next, _comm_epoch
    with _comm_lock:
        _comm_epoch += 1
        _comm_next = (_comm_epoch << COMM_EPOCH_SHIFT) + 1
        return _comm_epoch


def chunk_bytes_for(collective: str, n: int, nbytes: int, dtype, kind: str | None = None):
    """The chunk of this call: ``config.chunk_bytes``, where that is ``"auto"`` the chunk tuned for
    its class (:mod:`jax_blink.lowering.chunk_cache`), else None (the schedule's default). Only reads the
    cache: a trace never times anything."""
    cb = config.chunk_bytes
    check_chunk_bytes(cb)
    if cb != AUTO:
        return cb
    return chunk_cache.lookup(kind or device_kind(), n, collective, dtype, nbytes)


@functools.lru_cache(maxsize=None)
def default_topology(n: int, platform: str) -> Topology:
    """The topology a call plans on when the user gives none: the first ``n`` devices of the
    platform, discovered (NVML on GPUs; a uniform host mesh on CPU host devices)."""
    devices = jax.devices(platform)
    if n > len(devices):
        raise ValueError(f"axis of {n} ranks but only {len(devices)} {platform} devices")
    return Topology.discover(devices[:n])


@functools.lru_cache(maxsize=None)
def devices_topology(devices: tuple) -> Topology:
    return Topology.discover(list(devices))


def topology_for(n: int, platform: str, topology: Topology | None, axes=None) -> Topology:
    if topology is None:
        # The real devices of the collective's ranks where they are known (several processes, or
        # a concrete mesh in context), else the platform's first n.
        devs = _distributed.rank_devices(axes) if axes and (
            jax.process_count() > 1 or _distributed._concrete_mesh() is not None) else None
        if devs is not None and devs.shape[1] == n:
            return devices_topology(tuple(devs[0]))
        return default_topology(n, platform)
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a jax_blink.Topology, got {type(topology).__name__}")
    if topology.n != n:
        raise ValueError(
            f"topology {topology.name!r} has {topology.n} devices but the axis has {n} ranks; "
            f"pass topology.subset([...]) with {n} device ids")
    return topology


def _shared_memory(topology: Topology) -> bool:
    """Whether every link of ``topology`` is shared host memory (CPU host devices)."""
    return topology.graph.number_of_edges() > 0 and all(
        d.get("kind") == "host" for _, _, d in topology.graph.edges(data=True))


def build_program(topology: Topology, collective: str, root, total_elems: int, itemsize: int,
                  chunk_bytes, method: str, form: str | None = None) -> np.ndarray:
    """The int32 program of one call (read-only; cached per topology, collective, operand, chunk,
    method and all-reduce form).

    Args:
        topology: the ranks' devices and links.
        collective: ``"allreduce"``, ``"broadcast"``, ``"reduce"``, ``"allgather"`` or ``"reducescatter"``.
        root: the root rank (broadcast, reduce), else None.
        total_elems: elements of the operand.
        itemsize: bytes per element.
        chunk_bytes: the pipelining chunk, or None: the all-reduce form's modelled chunk (other
            collectives and forms without one: the schedule's default).
        method: the packing method (``"exact"`` or ``"mwu"``).
        form: the all-reduce form (:mod:`jax_blink.planning.forms`); None: ``config.allreduce_form``.

    Returns:
        The program array of ``kernels/common/program.h``.

    Raises:
        ValueError: a forced all-reduce form that cannot run on this topology and size.
    """
    return _build_program(topology, collective, root, total_elems, itemsize, chunk_bytes, method,
                          config.allreduce_form if form is None else form)


def allreduce_choice(topology: Topology, nbytes: int, method: str = "exact",
                     form: str | None = None) -> _forms.Choice | None:
    """The all-reduce form a call of ``nbytes`` per rank runs on ``topology`` (None for one rank)."""
    if topology.n < 2:
        return None
    return _forms.choose(topology, nbytes, config.allreduce_form if form is None else form, method=method)


@functools.lru_cache(maxsize=256)
def _build_program(topology: Topology, collective: str, root, total_elems: int, itemsize: int,
                   chunk_bytes, method: str, form: str) -> np.ndarray:
    # Cached per topology (Topology hashes and compares by its links), collective and operand.
    n = topology.n
    if collective == "allreduce" and root is None and n > 1:
        # The form the model finds fastest at this size (or the one forced), as segments.
        choice = _forms.choose(topology, total_elems * itemsize, form, method=method)
        segments = _forms.segments(choice.form, total_elems, itemsize)
        chunk = chunk_bytes if chunk_bytes is not None else choice.form.chunk_bytes
        sched = _schedule.make_schedule(n, total_elems, itemsize, segments,
                                        chunk_bytes=None if chunk is None else max(chunk, _schedule.ALIGN_BYTES))
    elif collective in ("allreduce", "broadcast", "reduce"):
        p = _plan(topology, collective, None if root is None else topology.devices[root], method=method)
        sched = _schedule.build_schedule(p, total_elems, itemsize, chunk_bytes=chunk_bytes)
    else:
        # all-gather / reduce-scatter: segment k belongs to rank k and travels through the
        # broadcast (reduce) trees rooted at rank k.
        kind = {"allgather": "broadcast", "reducescatter": "reduce"}[collective]
        per = total_elems // n
        segments = []
        for k in range(n):
            if _shared_memory(topology) and per:
                # Host devices read each other's memory: segment k goes in one hop from (to) rank
                # k. Trees that share out links model links that shared memory does not have,
                # and the CPU executor must keep their hop-by-hop order of partial sums (measured:
                # 8 ranks' reduce-scatter 2-3x slower through the planner's trees).
                phases = _schedule.PHASE_BROADCAST if kind == "broadcast" else _schedule.PHASE_REDUCE
                star = tuple(-1 if r == k else k for r in range(n))
                segments.append(_schedule.TreeSegment(k, phases, k * per, per, star))
                continue
            p = _plan(topology, kind, topology.devices[k], method=method)
            segments += _schedule.tree_segments(p, k * per, per, itemsize)
        sched = _schedule.make_schedule(n, total_elems, itemsize, segments, chunk_bytes=chunk_bytes)
    program = sched.program()
    program.setflags(write=False)
    return program


@functools.lru_cache(maxsize=256)
def _plan_share(topology: Topology, collective: str, root, method: str, engine: str) -> float:
    # The plan's hybrid share (treegen.hybrid_share): the plan is the one _program schedules
    # (treegen caches it; this cache keeps the number even where that cache was cleared, so a
    # trace never solves again for it).
    root_id = None if root is None else topology.devices[root]
    return float(hybrid_share(_plan(topology, collective, root_id, method=method), engine)[1])


def host_engine() -> str:
    """The CUDA executor's host-channel engine for the calls lowered now: ``JAX_BLINK_HOST_ENGINE``
    (``"ce"`` or ``"sm"``, read as the executor reads it), else the default; always ``"sm"`` with
    command buffers, whose handler keeps the SM channel (copy engines are enqueued per call)."""
    if config.command_buffers is True:
        return "sm"
    return env_value("JAX_BLINK_HOST_ENGINE", _engine, f"{' or '.join(sorted(HOST_PATH_EFFICIENCY))} "
                     f"(unset: {DEFAULT_HOST_ENGINE})", default=DEFAULT_HOST_ENGINE)


def _engine(text: str) -> str:
    e = text.lower()  # as the executor reads it: case-insensitive, nothing else
    if e not in HOST_PATH_EFFICIENCY:  # the executor refuses it at set-up too: say so at trace time
        raise ValueError("not an engine")
    return e


def _host_share(platform: str, topology: Topology, collective: str, root, method: str) -> float:
    """The ``host_share`` attribute of a call: the fraction of an all-reduce's elements that the
    executor may send through pinned host memory (Blink's hybrid transfer), from the plan; 0.0
    off the GPU, for other collectives, or where the topology knows no host links. The CUDA
    executor uses it for 2-rank all-reduces of at least ``JAX_BLINK_HOST_MIN_BYTES`` only."""
    if platform != "gpu" or collective != "allreduce" or not topology.host_links:
        return 0.0
    return _plan_share(topology, collective, root, method, host_engine())


def collective_call(flat, axes, collective: str, *, op: str = "sum", root=None,
                     topology=None, method="exact", result_type=None, in_place: bool = False,
                     sub=None, platform: str | None = None):
    """One ``jax_blink_collective`` custom call over a flat operand (among the ranks of one host
    of ``axes`` where ``sub``, a :class:`jax_blink.lowering.hierarchy.SubGroup`, says so). ``result_type``:
    the type of the ``lax`` expression the call computes (``lax_type``); None only for the
    inside phases of :mod:`jax_blink.lowering.hierarchy`, whose results are a rank's own. ``platform``: the
    one being lowered for, where the caller knows it (the switch's lowering rules)."""
    config.validate()  # options set in code are checked here, when a call uses them
    platform = platform or current_platform()
    if sub is None:
        n = axis_size(axes)
        topo = topology_for(n, platform, topology, axes)
    else:
        n = sub.n
        topo = topology_for(n, platform, topology) if topology is not None else devices_topology(sub.devices)
    itemsize = np.dtype(flat.dtype).itemsize
    chunk = chunk_bytes_for(collective, n, int(flat.size) * itemsize, flat.dtype)
    program = build_program(topo, collective, root, int(flat.size), itemsize, chunk, method)
    share = _host_share(platform, topo, collective, root, method)
    rank = axis_index(axes).astype(jnp.int32) if sub is None else sub.rank
    group = group_index(axes) if sub is None else sub.group
    if result_type is None:
        result_type = jax.ShapeDtypeStruct(flat.shape, flat.dtype)
    elif result_type.shape != flat.shape or result_type.dtype != flat.dtype:
        raise AssertionError(f"the call's result type {result_type} must be the lax expression's type of "
                             f"shape {flat.shape} and dtype {flat.dtype}")
    target = (_backends.TARGET_CB if captured_handler(platform, collective, n, int(flat.size) * itemsize)
              else _backends.TARGET)
    extra = {}
    comm_id = _next_comm_id()
    if jax.process_count() > 1:  # ranks in several processes: shared memory (CPU), CUDA IPC (GPU)
        attrs = (_distributed.lowering_attrs(axes, n) if sub is None else
                 _distributed.lowering_attrs(axes, n, (sub.rank_process, sub.rank_device)))
        if not _distributed.one_process_per_group(attrs["rank_process"], n):
            if platform == "gpu":  # every collective: CUDA IPC (kernels/cuda/ipc.h)
                _distributed.ipc_setup(comm_id, n, int(flat.size) * itemsize,
                                       attrs["rank_process"], attrs["rank_device"], collective, root)
                target, extra = _backends.TARGET_IPC, attrs
            else:
                target, extra = _backends.TARGET_MP, attrs
    # No side effect: the call is a pure function of its operand, as lax.psum is. Marked as a
    # side effect it cost 4-8 us more per call and sent jax's dispatch down the runtime-token path
    # (benchmarks/xla_call_overhead.py, NOTES.md change 5). The mark would not order the calls
    # either: every call site has its own comm_id (never CSE'd), and on CPU, where XLA runs
    # independent calls in an order of its own per device, distributed.in_program_order makes each
    # call's operand depend on the previous call's result (an optimization barrier does not: XLA:CPU
    # removes it; tests/unit/test_ordering.py checks the compiled program).
    # in_place: the result takes the operand's buffer (where the operand is a temporary of the
    # caller, XLA then needs no second one, and the executor copies nothing outside what moves).
    call_op, timeout_ms = np.int32(_schedule.OPS[op]), np.int64(round(config.timeout_s * 1000))
    if target in (_backends.TARGET, _backends.TARGET_CB) and _light_binding(platform):
        # One process, GPU: the site's program, op, budget and share go to the executor once, here,
        # and each call carries its comm_id alone (issue 17: XLA decodes a call's attributes on every call).
        _backends.register_call_site(platform, comm_id, program, call_op, timeout_ms, share)
        target = _backends.TARGET_LITE_CB if target == _backends.TARGET_CB else _backends.TARGET_LITE
        call = jax.ffi.ffi_call(target, result_type, has_side_effect=False,
                                input_output_aliases={0: 0} if in_place else None)
        return call(flat, rank, group, comm_id=np.int64(comm_id))
    call = jax.ffi.ffi_call(target, result_type, has_side_effect=False,
                            input_output_aliases={0: 0} if in_place else None)
    return call(flat, rank, group, program=program,
                op=call_op, comm_id=np.int64(comm_id), timeout_ms=timeout_ms,
                host_share=np.float32(share), **extra)


def captured_handler(platform: str, collective: str, n: int, nbytes: int) -> bool:
    """Whether a call lowered now takes the handler that XLA may capture in its command buffers
    (``config.command_buffers``): always (True), never (False), or under ``"auto"`` for the calls
    that the CUDA executor runs in one hop: all-reduces of at most ``LL_MAX_BYTES`` per rank, and
    reduce-scatters and all-gathers whose blocks (``nbytes``, the call's whole operand, over ``n``)
    are at most ``LL_MAX_BYTES`` each, on at most ``LL_MAX_RANKS`` GPUs. These are the latency-bound
    calls of a decode step, where a call outside XLA's graph split it (2 x H200: 5.8 against 3.6 us per
    all-reduce inside a step, docs/tensor_parallel.md); never the host channel's sizes."""
    cb = config.command_buffers
    if cb == "auto":
        if platform != "gpu":
            return False
        if collective == "allreduce":
            return _forms.runs_ll(n, nbytes)
        if collective in ("allgather", "reducescatter"):
            return n > 0 and nbytes % n == 0 and _forms.runs_ll_blocks(n, nbytes // n)
        return False
    return bool(cb)


def _light_binding(platform: str) -> bool:
    """Whether GPU calls lowered now take the light binding: where the executor has it, unless
    ``JAX_BLINK_FULL_BINDING=1`` asks for every attribute on every call (an executable run in a
    process that did not lower it, e.g. exported, has no registered call sites)."""
    full = env_value("JAX_BLINK_FULL_BINDING", _zero_or_one,
                     "1 (every attribute on every call) or 0 (unset: the light binding)", default=False)
    return platform == "gpu" and not full and _backends.has_call_sites(platform)


def _zero_or_one(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError("not 0 or 1")
    return text == "1"
