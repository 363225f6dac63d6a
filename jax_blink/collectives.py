"""The collectives users call, and their lowering to the ``jax_blink_collective`` custom call.

Each collective is planned at trace time (topology -> plan -> schedule), lowered to one
``jax.ffi.ffi_call`` whose attributes carry the schedule program, and differentiated exactly as
its ``lax`` counterpart (the backward pass is the ``lax`` one).
"""
from __future__ import annotations

import functools
import itertools
import os
import threading
import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _backends, chunk_cache, distributed as _distributed, hierarchy as _hierarchy, schedule as _schedule, tuning
from .options import AUTO, check_chunk_bytes, config, parse_byte_count
from .topology import DEFAULT_HOST_ENGINE, HOST_PATH_EFFICIENCY, NVLINK_EFFICIENCY, Topology
from .treegen import hybrid_share, plan as _plan

AxisName = str | tuple[str, ...]

SUPPORTED_DTYPES = ("float32", "float64", "bfloat16", "float16", "int32", "int64")

_comm_ids = itertools.count(1)
_comm_lock = threading.Lock()
_warned: set[str] = set()


def _next_comm_id() -> int:
    # One id per lowered call site: the executors key their rendezvous state on it.
    with _comm_lock:
        return next(_comm_ids)


# ---------------------------------------------------------------------------------------------
# Trace-time context: which axis, how many ranks, which topology, which executor.

def _axes(axis_name: AxisName) -> tuple[str, ...]:
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if not axes or not all(isinstance(a, str) for a in axes):
        raise TypeError(f"axis_name must be a mesh axis name or a tuple of them, got {axis_name!r}")
    return axes


def _axis_index(axes: tuple[str, ...]):
    """This rank's index along ``axes`` (row-major over a tuple of axes, as ``lax`` numbers them)."""
    return lax.axis_index(axes if len(axes) > 1 else axes[0])


def _axis_size(axes: tuple[str, ...]) -> int:
    try:
        return int(lax.axis_size(axes if len(axes) > 1 else axes[0]))
    except NameError as e:
        raise NameError(
            f"jax_blink: unknown axis {axes if len(axes) > 1 else axes[0]!r}: call the collective "
            "inside jax.shard_map or jax.pmap over a mesh that has this axis") from e


def _other_axes(axes: tuple[str, ...]) -> list[tuple[str, int]]:
    """Manual mesh axes besides ``axes``: each slice of them is an independent group."""
    try:
        mesh = jax.sharding.get_abstract_mesh()
        names, sizes = mesh.axis_names, mesh.axis_sizes
    except Exception:  # pmap, or no mesh in context
        return []
    manual = set(getattr(mesh, "manual_axes", names))
    return [(n, s) for n, s in zip(names, sizes) if n not in axes and n in manual and s > 1]


def _group_index(axes: tuple[str, ...]):
    group = jnp.int32(0)
    for name, size in _other_axes(axes):
        group = group * size + lax.axis_index(name).astype(jnp.int32)
    return group


def _abstract_device():
    """The kind of device of the mesh being traced (None under pmap or outside a mesh)."""
    try:
        return jax.sharding.get_abstract_mesh().abstract_device
    except Exception:  # older jax, or no mesh in context
        return None


def _platform() -> str:
    dev = _abstract_device()
    p = dev.platform if dev is not None else jax.default_backend()
    return "gpu" if p in ("gpu", "cuda", "rocm") else p


def _device_kind() -> str | None:
    dev = _abstract_device()
    if dev is not None:
        return dev.device_kind
    devices = jax.devices()
    return devices[0].device_kind if devices else None


def _use_lax(collective: str, n: int, x, axes: tuple[str, ...] | None = None) -> bool:
    """Whether this call of ``collective`` on operand ``x`` goes to XLA's own collective
    (``config.dispatch``; with ``"auto"`` the measured table of :mod:`jax_blink.tuning`, which
    counts the bytes of a rank's operand, for the layout of the ranks over ``axes``: in one
    process, or in several, where another executor runs; the entry for the operand's dtype where
    there is one)."""
    if config.dispatch == "lax":
        return True
    if config.dispatch == "blink":
        return False
    return tuning.prefer_lax(_device_kind(), n, x.size * np.dtype(x.dtype).itemsize, collective=collective,
                             layout=_layout(axes, n), dtype=np.dtype(x.dtype).name)


def _layout(axes: tuple[str, ...] | None, n: int) -> str:
    """Where the ranks of a collective over ``axes`` live, as the dispatch table names it."""
    if axes is None or jax.process_count() == 1:
        return "one process"
    procs = _distributed.lowering_attrs(axes, n)["rank_process"]
    return "one process" if _distributed.one_process_per_group(procs, n) else "several processes"


def _chunk_bytes(collective: str, n: int, nbytes: int, dtype, device_kind: str | None = None):
    """The chunk of this call: ``config.chunk_bytes``, where that is ``"auto"`` the chunk tuned for
    its class (:mod:`jax_blink.chunk_cache`), else None (the schedule's default). Only reads the
    cache: a trace never times anything."""
    cb = config.chunk_bytes
    check_chunk_bytes(cb)
    if cb != AUTO:
        return cb
    return chunk_cache.lookup(device_kind or _device_kind(), n, collective, dtype, nbytes)


@functools.lru_cache(maxsize=None)
def default_topology(n: int, platform: str) -> Topology:
    """The topology a call plans on when the user gives none: the first ``n`` devices of the
    platform, discovered (NVML on GPUs; a uniform host mesh on CPU host devices)."""
    devices = jax.devices(platform)
    if n > len(devices):
        raise ValueError(f"axis of {n} ranks but only {len(devices)} {platform} devices")
    return Topology.discover(devices[:n])


@functools.lru_cache(maxsize=None)
def _devices_topology(devices: tuple) -> Topology:
    return Topology.discover(list(devices))


def _topology_for(n: int, platform: str, topology: Topology | None, axes=None) -> Topology:
    if topology is None:
        # The real devices of the collective's ranks where they are known (several processes, or
        # a concrete mesh in context), else the platform's first n.
        devs = _distributed.rank_devices(axes) if axes and (
            jax.process_count() > 1 or _distributed._concrete_mesh() is not None) else None
        if devs is not None and devs.shape[1] == n:
            return _devices_topology(tuple(devs[0]))
        return default_topology(n, platform)
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a jax_blink.Topology, got {type(topology).__name__}")
    if topology.n != n:
        raise ValueError(
            f"topology {topology.name!r} has {topology.n} devices but the axis has {n} ranks; "
            f"pass topology.subset([...]) with {n} device ids")
    return topology


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


def _check_root(root: int, n: int) -> int:
    if not isinstance(root, (int, np.integer)) or not 0 <= root < n:
        raise ValueError(f"jax_blink: root must be a rank in [0, {n}), got {root!r}")
    return int(root)


@functools.lru_cache(maxsize=None)
def _peer_access_problem(n: int) -> str | None:
    """Which pair of the first ``n`` GPUs lacks peer access (the CUDA executor needs every pair)."""
    mod = _backends.module("gpu")
    if mod is None or not hasattr(mod, "can_access_peer"):
        return None
    ids = [d.local_hardware_id for d in jax.devices("gpu")[:n]]
    for a in ids:
        for b in ids:
            if a != b and not mod.can_access_peer(a, b):
                return f"GPU {a} cannot access GPU {b}'s memory (no peer access)"
    return None


def _hosts_of(axes: tuple[str, ...]):
    """The host layout of a collective whose ranks span hosts (jax_blink.hierarchy), else None."""
    if jax.process_count() == 1 or not _distributed.has_client():
        return None  # no client: _executor_ready sends the call to lax and says why
    return _hierarchy.layout(axes)


def _across_hosts_to_lax(what: str, axes: tuple[str, ...]) -> bool:
    """True (after the fall-back warning, or an error with fallback=raise) where a collective
    without a three-phase form has ranks on several hosts: they cannot meet in shared memory."""
    if jax.process_count() == 1 or _hosts_of(axes) is None:
        return False
    _fall_back(f"{what} has no three-phase form for ranks on several hosts "
               "(all_reduce, reduce_scatter and all_gather have)", what)
    return True


def _three_phases(what: str, axes: tuple[str, ...]):
    """For a collective whose ranks span hosts: ``(layout, False)`` where its three phases
    (jax_blink.hierarchy) can run, ``(None, True)`` after the fall-back warning (or an error with
    fallback=raise) where they cannot, or without a word where every host holds one rank (all the
    traffic is between hosts, XLA's part: the executor has nothing to do); ``(None, False)`` where
    its ranks do not span hosts."""
    hosts = _hosts_of(axes)
    if hosts is None:
        return None, False
    if hosts.local == 1:
        return None, True
    problem = _hierarchy.problem(hosts, _platform())
    if problem is None:
        return hosts, False
    _fall_back(f"{what} across hosts: {problem}", what)
    return None, True


def _fall_back(problem: str, what: str) -> None:
    """``what`` goes to XLA's own collective because of ``problem``: raise, warn once per problem,
    or say nothing, as ``config.fallback`` says."""
    if config.fallback == "raise":
        raise RuntimeError(f"jax_blink: {problem}; {what} cannot run on jax_blink's executor "
                           "(JAX_BLINK_FALLBACK=raise; with warn or silent it goes to XLA's own collective)")
    msg = (f"jax_blink: {problem}; {what} falls back to XLA's own "
           "collective (set JAX_BLINK_FALLBACK=raise to make this an error)")
    if config.fallback == "warn" and problem not in _warned:
        _warned.add(problem)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)


def _executor_ready(platform: str, what: str, n: int = 0) -> bool:
    """Register the platform's executor; where it cannot run, fall back as ``config.fallback`` says."""
    problem = None
    if jax.process_count() > 1:
        # Ranks in several processes meet through the job's shared memory (CPU executor).
        problem = _distributed.executor_problem(platform, what)
    elif not _backends.register(platform):
        problem = f"no {platform} executor in this build"
    elif platform == "gpu":
        problem = _peer_access_problem(n)
    if problem is None:
        return True
    _fall_back(problem, what)
    return False


# ---------------------------------------------------------------------------------------------
# The custom call.

def _shared_memory(topology: Topology) -> bool:
    """Whether every link of ``topology`` is shared host memory (CPU host devices)."""
    return topology.graph.number_of_edges() > 0 and all(
        d.get("kind") == "host" for _, _, d in topology.graph.edges(data=True))


@functools.lru_cache(maxsize=256)
def _program(topology: Topology, collective: str, root, total_elems: int, itemsize: int,
             chunk_bytes, method: str) -> np.ndarray:
    # Cached per topology (Topology hashes and compares by its links), collective and operand.
    n = topology.n
    if collective in ("allreduce", "broadcast", "reduce"):
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


def _host_engine() -> str:
    """The CUDA executor's host-channel engine for the calls lowered now: ``JAX_BLINK_HOST_ENGINE``
    (``"ce"`` or ``"sm"``, read as the executor reads it), else the default; always ``"sm"`` with
    command buffers, whose handler keeps the SM channel (copy engines are enqueued per call)."""
    if config.command_buffers:
        return "sm"
    raw = os.environ.get("JAX_BLINK_HOST_ENGINE", "")
    e = raw.lower()  # as the executor reads it: case-insensitive, nothing else
    if not e:
        return DEFAULT_HOST_ENGINE
    if e not in HOST_PATH_EFFICIENCY:  # the executor refuses it at set-up too: say so at trace time
        raise ValueError(f"JAX_BLINK_HOST_ENGINE={raw!r} is not understood: it takes "
                         f"{' or '.join(sorted(HOST_PATH_EFFICIENCY))}; fix or unset it (unset: {DEFAULT_HOST_ENGINE})")
    return e


def _host_share(platform: str, topology: Topology, collective: str, root, method: str) -> float:
    """The ``host_share`` attribute of a call: the fraction of an all-reduce's elements that the
    executor may send through pinned host memory (Blink's hybrid transfer), from the plan; 0.0
    off the GPU, for other collectives, or where the topology knows no host links. The CUDA
    executor uses it for 2-rank all-reduces of at least ``JAX_BLINK_HOST_MIN_BYTES`` only."""
    if platform != "gpu" or collective != "allreduce" or not topology.host_links:
        return 0.0
    return _plan_share(topology, collective, root, method, _host_engine())


def _collective_call(flat, axes, collective: str, *, op: str = "sum", root=None,
                     topology=None, method="exact", result_type=None, in_place: bool = False,
                     sub=None, platform: str | None = None):
    """One ``jax_blink_collective`` custom call over a flat operand (among the ranks of one host
    of ``axes`` where ``sub``, a :class:`jax_blink.hierarchy.SubGroup`, says so). ``result_type``:
    the type of the ``lax`` expression the call computes (``_lax_type``); None only for the
    inside phases of :mod:`jax_blink.hierarchy`, whose results are a rank's own. ``platform``: the
    one being lowered for, where the caller knows it (the switch's lowering rules)."""
    config.validate()  # options set in code are checked here, when a call uses them
    platform = platform or _platform()
    if sub is None:
        n = _axis_size(axes)
        topo = _topology_for(n, platform, topology, axes)
    else:
        n = sub.n
        topo = _topology_for(n, platform, topology) if topology is not None else _devices_topology(sub.devices)
    itemsize = np.dtype(flat.dtype).itemsize
    chunk = _chunk_bytes(collective, n, int(flat.size) * itemsize, flat.dtype)
    program = _program(topo, collective, root, int(flat.size), itemsize, chunk, method)
    share = _host_share(platform, topo, collective, root, method)
    rank = _axis_index(axes).astype(jnp.int32) if sub is None else sub.rank
    group = _group_index(axes) if sub is None else sub.group
    if result_type is None:
        result_type = jax.ShapeDtypeStruct(flat.shape, flat.dtype)
    elif result_type.shape != flat.shape or result_type.dtype != flat.dtype:
        raise AssertionError(f"the call's result type {result_type} must be the lax expression's type of "
                             f"shape {flat.shape} and dtype {flat.dtype}")
    target = _backends.TARGET_CB if config.command_buffers else _backends.TARGET
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
    # removes it; tests/test_ordering.py checks the compiled program).
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


def _light_binding(platform: str) -> bool:
    """Whether GPU calls lowered now take the light binding: where the executor has it, unless
    ``JAX_BLINK_FULL_BINDING=1`` asks for every attribute on every call (an executable run in a
    process that did not lower it, e.g. exported, has no registered call sites)."""
    raw = os.environ.get("JAX_BLINK_FULL_BINDING", "")
    if raw.strip() not in ("", "0", "1"):
        raise ValueError(f"JAX_BLINK_FULL_BINDING={raw!r} is not understood: it takes 1 (every attribute on every "
                         "call) or 0; fix or unset it (unset: the light binding)")
    return platform == "gpu" and raw.strip() != "1" and _backends.has_call_sites(platform)


def _lax_type(lax_expr, flat):
    """The type of ``lax_expr(flat)``, the ``lax`` expression a call computes: the custom call
    declares it, so that under ``shard_map`` its result is invariant along the axis exactly where
    lax's is (replicated: psum; varying: all_gather, psum_scatter, a reduce's non-roots) and
    ``out_specs`` are checked as for lax. Asked of jax (every version) rather than built by hand."""
    return jax.eval_shape(lax_expr, flat)


def _on_mesh(axes: tuple[str, ...]) -> bool:
    """Whether every one of ``axes`` is a manual mesh axis (shard_map, pmap) rather than an axis
    bound by ``vmap``, which the executor has no devices for (``lax`` handles it by batching)."""
    try:
        mesh = jax.sharding.get_abstract_mesh()
        names, manual = tuple(mesh.axis_names), set(getattr(mesh, "manual_axes", mesh.axis_names))
    except Exception:  # older jax: no abstract mesh
        names, manual = (), set()
    if names:
        return all(a in manual for a in axes)
    # No mesh in context (pmap where jax does not run it as a shard_map, or vmap alone): an axis
    # that vmap binds gives a batched index.
    from ._jax_internals import is_vmap_batched
    return not any(is_vmap_batched(lax.axis_index(a)) for a in axes)


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
    if (n == 1 or x.size == 0 or prefer_lax or not _on_mesh(axes)
            or not _executor_ready(_platform(), what, n)):
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
    (:mod:`jax_blink.tuning`), the call goes to ``lax`` (``config.dispatch`` changes that).
    """
    _check_dtype(x)
    opcode = _check_op(op)
    axes = _axes(axis_name)
    n = _axis_size(axes)
    lax_fn = {0: lax.psum, 1: lax.pmax, 2: lax.pmin}[opcode]

    def reference(v):
        return lax_fn(v, axes)

    def f(v):
        flat = v.reshape(-1)
        return _collective_call(flat, axes, "allreduce", op=op, topology=topology, method=method,
                                result_type=_lax_type(reference, flat)).reshape(v.shape)

    hosts, to_lax = _three_phases("all_reduce", axes)
    if hosts is not None:  # ranks on several hosts: the three phases (jax_blink.hierarchy)
        def f(v):  # noqa: F811
            return _hierarchy.all_reduce(
                v, axes, op, hosts,
                functools.partial(_collective_call, topology=topology, method=method),
                _group_index(axes), lambda b: _lax_type(lambda u: lax.psum(u, axes), b))

    return _run("all_reduce", x, n, f, reference, axes=axes, linear=op == "sum",
                prefer_lax=to_lax or _use_lax("allreduce", n, x, None if hosts is not None else axes))


def broadcast(x, axis_name: AxisName, *, root: int = 0, topology: Topology | None = None,
              method: str = "exact"):
    """Every rank gets rank ``root``'s ``x`` (the same as ``lax.psum`` of ``x`` masked to root)."""
    _check_dtype(x)
    axes = _axes(axis_name)
    n = _axis_size(axes)
    root = _check_root(root, n)

    def reference(v):
        idx = _axis_index(axes)
        return lax.psum(jnp.where(idx == root, v, jnp.zeros_like(v)), axes)


    def f(v):
        flat = v.reshape(-1)
        return _collective_call(flat, axes, "broadcast", root=root, topology=topology,
                                method=method, result_type=_lax_type(reference, flat)).reshape(v.shape)

    return _run("broadcast", x, n, f, reference, axes=axes,
                prefer_lax=_across_hosts_to_lax("broadcast", axes) or _use_lax("broadcast", n, x, axes))


def reduce(x, axis_name: AxisName, *, root: int = 0, op: str = "sum",
           topology: Topology | None = None, method: str = "exact"):
    """Rank ``root`` gets the reduction of every rank's ``x``; every other rank gets its ``x`` back."""
    _check_dtype(x)
    opcode = _check_op(op)
    axes = _axes(axis_name)
    n = _axis_size(axes)
    root = _check_root(root, n)
    lax_fn = {0: lax.psum, 1: lax.pmax, 2: lax.pmin}[opcode]

    def is_root():
        return _axis_index(axes) == root

    def reference(v):
        return jnp.where(is_root(), lax_fn(v, axes), v)


    def f(v):
        flat = v.reshape(-1)
        out = _collective_call(flat, axes, "reduce", op=op, root=root, topology=topology,
                               method=method, result_type=_lax_type(reference, flat)).reshape(v.shape)
        # Non-root ranks hold their subtree's partial result: give them their input back.
        return jnp.where(is_root(), out, v)

    return _run("reduce", x, n, f, reference, axes=axes, linear=op == "sum",
                prefer_lax=_across_hosts_to_lax("reduce", axes) or _use_lax("reduce", n, x, axes))


def all_gather(x, axis_name: AxisName, *, axis: int = 0, tiled: bool = False,
               topology: Topology | None = None, method: str = "exact"):
    """Drop-in for ``lax.all_gather``: every rank's ``x`` stacked (or, tiled, concatenated)."""
    _check_dtype(x)
    axes = _axes(axis_name)
    n = _axis_size(axes)
    ndim_out = x.ndim if tiled else x.ndim + 1
    if not -ndim_out <= axis < ndim_out:
        raise ValueError(f"jax_blink.all_gather: axis {axis} out of range for a result of rank {ndim_out}")

    def reference(v):
        return lax.all_gather(v, axes, axis=axis, tiled=tiled)


    hosts, to_lax = _three_phases("all_gather", axes)

    def f(v):
        # Declared as lax.all_gather's result (varying along the axis, as lax's is).
        gathered = _lax_type(lambda u: lax.all_gather(u, axes, tiled=True), v.reshape(-1))
        if hosts is not None:  # ranks on several hosts: among the hosts, then inside (hierarchy)
            out = _hierarchy.all_gather(v.reshape(-1), axes, hosts,
                                        functools.partial(_collective_call, topology=topology, method=method),
                                        _group_index(axes), gathered)
        else:
            # Rank k's segment k must hold its x; the executor reads no other segment of a rank's
            # operand, so n copies of x serve (one fused write; zeros + dynamic_update_slice made
            # XLA keep a copy of the zeros per chained call: 40 MiB of temporaries at 2 MiB per rank).
            buf = jnp.broadcast_to(v.reshape(1, -1), (n, v.size)).reshape(-1)
            out = _collective_call(buf, axes, "allgather", topology=topology, method=method,
                                   result_type=gathered, in_place=True)
        stacked = out.reshape((n,) + v.shape)
        if tiled:
            a = axis % v.ndim
            stacked = jnp.moveaxis(stacked, 0, a)
            return stacked.reshape(v.shape[:a] + (n * v.shape[a],) + v.shape[a + 1:])
        return jnp.moveaxis(stacked, 0, axis % ndim_out)

    return _run("all_gather", x, n, f, reference, axes=axes, elementwise=False,
                prefer_lax=to_lax or _use_lax("allgather", n, x, None if hosts is not None else axes))


def reduce_scatter(x, axis_name: AxisName, *, scatter_dimension: int = 0, tiled: bool = False,
                   topology: Topology | None = None, method: str = "exact"):
    """Drop-in for ``lax.psum_scatter``: rank k gets block k of the sum."""
    _check_dtype(x)
    axes = _axes(axis_name)
    n = _axis_size(axes)
    if not -x.ndim <= scatter_dimension < x.ndim:
        raise ValueError(f"jax_blink.reduce_scatter: scatter_dimension {scatter_dimension} out of "
                         f"range for an operand of rank {x.ndim}")
    d = scatter_dimension % x.ndim
    if (tiled and x.shape[d] % n) or (not tiled and x.shape[d] != n):
        need = f"a multiple of {n}" if tiled else f"equal to the axis size {n}"
        raise ValueError(f"jax_blink.reduce_scatter: dimension {d} has size {x.shape[d]}, must be {need}")

    def reference(v):
        return lax.psum_scatter(v, axes, scatter_dimension=d, tiled=tiled)


    hosts, to_lax = _three_phases("reduce_scatter", axes)

    def f(v):
        blocks = jnp.moveaxis(v, d, 0)
        block_shape = (blocks.shape[0] // n,) + blocks.shape[1:]
        if hosts is not None:  # ranks on several hosts: inside, then among the hosts (hierarchy)
            mine = _hierarchy.reduce_scatter(
                blocks.reshape(n, -1), axes, hosts,
                functools.partial(_collective_call, topology=topology, method=method),
                _group_index(axes)).reshape(block_shape)
            mine = jnp.moveaxis(mine, 0, d)
            return mine if tiled else jnp.squeeze(mine, d)
        flat = blocks.reshape(-1)
        # Declared varying along the axis, as lax.psum_scatter's result (n blocks: the call's
        # result holds every block, of which this rank keeps its own).
        scattered = _lax_type(lambda u: jnp.tile(lax.psum_scatter(u, axes, tiled=True), n), flat)
        out = _collective_call(flat, axes, "reducescatter", topology=topology, method=method,
                               result_type=scattered, in_place=True)
        idx = _axis_index(axes)
        mine = lax.dynamic_slice_in_dim(out.reshape(n, -1), idx, 1, axis=0).reshape(block_shape)
        mine = jnp.moveaxis(mine, 0, d)
        return mine if tiled else jnp.squeeze(mine, d)

    return _run("reduce_scatter", x, n, f, reference, axes=axes, elementwise=False,
                prefer_lax=to_lax or _use_lax("reducescatter", n, x, None if hosts is not None else axes))


# ---------------------------------------------------------------------------------------------
# Looking inside.

#: The CUDA executor's defaults for its size limits (kernels/cuda/executor.h: kDefaultLLMaxBytes,
#: kDefaultOneShotMaxBytes, kDefaultHostMinBytes; a test keeps them equal), for explain().
LL_BYTES, ONESHOT_BYTES, HOST_MIN_BYTES = 512 << 10, 8 << 20, 256 << 20
_EXECUTOR_BYTES = {"JAX_BLINK_LL_BYTES": LL_BYTES, "JAX_BLINK_ONESHOT_BYTES": ONESHOT_BYTES,
                   "JAX_BLINK_HOST_MIN_BYTES": HOST_MIN_BYTES}


def _executor_bytes(name: str) -> int:
    """A size limit of the CUDA executor as it reads it: the variable, else its default (a value
    it does not understand fails its set-up, and a ValueError here)."""
    text = os.environ.get(name, "")
    if not text:
        return _EXECUTOR_BYTES[name]
    try:
        return parse_byte_count(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not understood: it takes a byte count such as "
                         "8388608, 512K, 16M or 1G; fix or unset it") from None


def _host_min_bytes() -> int:
    return max(_executor_bytes("JAX_BLINK_HOST_MIN_BYTES"), 1)


def _gpu_kernel(n: int, nbytes: int) -> str:
    """Which kernel the CUDA executor runs for an all-reduce of ``nbytes`` per rank on ``n`` GPUs."""
    if nbytes <= _executor_bytes("JAX_BLINK_LL_BYTES") and n <= 8:
        return "one LL kernel (data and flag in one 8-byte store, one hop; JAX_BLINK_LL_BYTES)"
    if n == 2 and nbytes <= _executor_bytes("JAX_BLINK_ONESHOT_BYTES"):
        return "one one-shot kernel (every rank writes into the other's inbox, one hop; JAX_BLINK_ONESHOT_BYTES)"
    return "the trees below"


def _topology_platform(topology: Topology) -> str:
    """``"cpu"`` for a mesh of CPU host devices (its links are of kind ``"host"``), ``"gpu"`` for
    any other (the presets, NVML discovery, NVLink/PCIe/switch graphs); a single device, which has
    no links: the platform of this process's devices."""
    kinds = set(topology.kinds())
    if not kinds:
        return _platform()
    return "cpu" if kinds == {"host"} else "gpu"


def _executor_line(platform: str, collective: str, n: int, nbytes: int) -> str:
    """Which executor runs ``collective`` on ``n`` devices of ``platform``, and how."""
    if platform == "cpu":
        return (f"CPU executor: {nbytes} bytes per rank on {n} CPU host devices run through the trees "
                "below (a thread per device, meeting its peers in this process)")
    if collective == "allreduce":
        return f"CUDA executor: {nbytes} bytes per rank on {n} GPUs run as {_gpu_kernel(n, nbytes)}"
    return f"CUDA executor: {nbytes} bytes per rank on {n} GPUs run through the trees below"


_LAX_NAME = {"allreduce": "lax.psum", "broadcast": "lax.psum (of the root's value)",
             "reduce": "lax.psum", "allgather": "lax.all_gather", "reducescatter": "lax.psum_scatter"}


def _dispatch_line(kind: str | None, platform: str, collective: str, n: int, nbytes: int,
                   dtype: str | None = None) -> str:
    """What ``config.dispatch`` does with this call on ``n`` devices of ``kind`` (None: unknown)."""
    lax_name = _LAX_NAME[collective]
    if config.dispatch == "lax":
        return f"dispatch=lax: {lax_name} runs every call instead of the executor"
    if config.dispatch == "blink":
        return "dispatch=blink: the executor runs every call, whatever jax_blink/tuning.py measured"
    if kind is None:
        devs, example = ("GPUs", "'NVIDIA H200'") if platform == "gpu" else ("CPU host devices", "'cpu'")
        return (f"dispatch=auto: the executor, unless jax_blink/tuning.py measured {lax_name} faster on "
                f"these {devs}: name their kind with device_kind= (e.g. {example}) to see its entry")
    entry = tuning.entry(kind, n, collective, dtype=dtype)
    if entry is None:
        return f"dispatch=auto: the executor runs this call (jax_blink/tuning.py has no entry for {n} x {kind})"
    which = f" in {entry.dtype}" if entry.dtype else ""
    if entry.prefers_lax(nbytes):
        return (f"dispatch=auto: {lax_name} runs this call instead: it was measured faster on {n} x {kind} "
                f"at this size{which} (jax_blink/tuning.py, from {', '.join(entry.sources)})")
    return (f"dispatch=auto: the executor runs this call, as the entry for {n} x {kind} says at this "
            f"size{which} (jax_blink/tuning.py, from {', '.join(entry.sources)})")


def explain(topology: Topology, nbytes: int, collective: str = "allreduce", *, root: int = 0,
            dtype="float32", method: str = "exact", device_kind: str | None = None,
            hosts: int = 1) -> str:
    """Which trees a call of ``collective`` over ``nbytes`` per rank on ``topology`` will use, how the
    data is split between them, in which chunks, and why (the plan's own explanation); which
    executor runs them on that topology's devices, and whether the dispatch table hands the call to
    ``lax`` instead.

    ``device_kind`` (e.g. ``"NVIDIA H200"``, ``"cpu"``) picks the dispatch table's entry and the
    tuned chunk that ``config.chunk_bytes = "auto"`` reads. Default: the kind of this process's
    devices when the topology is of their platform (CPU host devices: links of kind ``"host"``;
    GPUs: any other), else none: a GPU preset explained on a machine without GPUs is not judged by
    this machine's CPU measurements. ``hosts`` > 1: ``topology`` is the inside of one of that many
    hosts, and an all-reduce, reduce-scatter or all-gather runs in phases inside and among the hosts
    (:mod:`jax_blink.hierarchy`)."""
    if collective not in _LAX_NAME:
        raise ValueError(f"unknown collective {collective!r}; allowed: {', '.join(_LAX_NAME)}")
    if hosts > 1:
        return _explain_hosts(topology, nbytes, collective, hosts=hosts, dtype=dtype, method=method,
                              device_kind=device_kind)
    itemsize = np.dtype(jnp.dtype(dtype)).itemsize
    if nbytes % itemsize:
        raise ValueError(f"nbytes={nbytes} is not a whole number of {np.dtype(jnp.dtype(dtype)).name}")
    n = topology.n
    if collective in ("allgather", "reducescatter"):
        total = nbytes // itemsize * (n if collective == "allgather" else 1)
        lines = [f"{collective} of {nbytes} bytes per rank over {n} ranks: segment k goes through "
                 f"the {'broadcast' if collective == 'allgather' else 'reduce'} trees rooted at rank k"]
    else:
        p = _plan(topology, collective, topology.devices[_check_root(root, n)]
                  if collective != "allreduce" else None, method=method)
        lines = [p.explain()]
        total = nbytes // itemsize
        host, share = hybrid_share(p, _host_engine())
        if host > 0:
            min_bytes = _host_min_bytes()
            lines.append(
                f"host channel (pinned memory over PCIe): {host:.1f} GB/s beside the trees' "
                f"{p.rate * NVLINK_EFFICIENCY:.1f} (their {p.rate:.1f} at NVLink's measured "
                f"efficiency); Blink's hybrid transfer sends {share:.1%} of the data through it. "
                f"The CUDA executor does so for all-reduces of at least JAX_BLINK_HOST_MIN_BYTES "
                f"({HOST_MIN_BYTES >> 20} MiB by default) on 2 GPUs; smaller ones take NVLink only. This one "
                f"({nbytes} bytes per rank, the limit now {min_bytes}): "
                + ("host channel and NVLink." if nbytes >= min_bytes else "NVLink only.")
                + (f" JAX_BLINK_HOST_SHARE={os.environ['JAX_BLINK_HOST_SHARE']} overrides the share."
                   if os.environ.get("JAX_BLINK_HOST_SHARE") else ""))
    platform = _topology_platform(topology)
    kind = device_kind or (_device_kind() if platform == _platform() else None)
    lines.append(_executor_line(platform, collective, n, nbytes))
    lines.append(_dispatch_line(kind, platform, collective, n, nbytes, np.dtype(jnp.dtype(dtype)).name))
    # No device kind: no tuned chunk either (the cache is keyed by it), the schedule's default.
    chunk = _chunk_bytes(collective, n, total * itemsize, dtype, kind) \
        if kind is not None or config.chunk_bytes != AUTO else None
    prog = _program(topology, collective,
                    None if collective == "allreduce" else root, total, itemsize,
                    chunk, method)
    sched = _schedule.decode(prog)
    if config.chunk_bytes == AUTO:
        lines.append(f"chunk_bytes=auto: {f'tuned chunk of {chunk} bytes' if chunk else 'nothing tuned'} "
                     f"for {kind or 'no device kind (pass device_kind=)'}, {n} ranks, {collective}, "
                     f"{jnp.dtype(dtype).name}, "
                     f"size class {chunk_cache.size_class(total * itemsize)}"
                     + ("" if chunk else " (the schedule's default)"))
    lines.append(f"schedule: {len(sched.trees)} tree segments, chunks of {sched.chunk_elems} "
                 f"elements ({sched.chunk_elems * itemsize} bytes)")
    for i, t in enumerate(sched.trees):
        chunks = -(-t.length // sched.chunk_elems)
        lines.append(f"  tree {i}: root rank {t.root}, depth {t.depth()}, elements "
                     f"[{t.offset}, {t.offset + t.length}) in {chunks} chunk(s)")
    return "\n".join(lines)


def _explain_hosts(topology: Topology, nbytes: int, collective: str, *, hosts: int, **kw) -> str:
    """explain() of a collective over ``hosts`` hosts whose insides are ``topology``: the three
    phases and their bytes, then the inside of a host as a one-host call explains it."""
    if not isinstance(hosts, int) or hosts < 1:
        raise ValueError(f"hosts must be a positive int, got {hosts!r}")
    if collective not in ("allreduce", "reducescatter", "allgather"):
        return (f"{collective} over {hosts} hosts: no three-phase form; lax runs it "
                "(jax_blink's collectives across hosts are all_reduce, reduce_scatter and all_gather)")
    method = kw.get("method", "exact")
    phases = _hierarchy.explain_phases(topology, hosts, nbytes, method=method, collective=collective)
    if collective == "reducescatter":
        return "\n".join([phases, f"inside each host, phase 1 is the reduce-scatter of {nbytes} bytes per rank:",
                          explain(topology, nbytes, "reducescatter", **kw)])
    if collective == "allgather":
        return "\n".join([phases, f"inside each host, phase 2 is the all-gather of {hosts * nbytes} bytes per rank:",
                          explain(topology, hosts * nbytes, "allgather", **kw)])
    piece = -(-nbytes // topology.n)
    return "\n".join([phases,
                      "inside each host, phases 1 and 3 are the reduce-scatter and all-gather of "
                      f"{nbytes} bytes per rank ({piece} bytes per piece):",
                      explain(topology, piece * topology.n, "reducescatter", **kw)])


def backends() -> dict[str, bool]:
    """Which executors this build has (``{"cpu": ..., "gpu": ...}``)."""
    return _backends.available()


check = _backends.check
