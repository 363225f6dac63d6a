"""The switch: run an existing program's ``lax`` collectives on jax_blink without editing it.

    jax_blink.install()                # process-wide, idempotent; jax_blink.uninstall() undoes it
    with jax_blink.installed(): ...    # the same for a block
    python -m jax_blink run train.py --lr 0.1   # the program as `python train.py --lr 0.1` runs it

Where it works: jax turns ``psum`` / ``pmean`` / ``pmax`` / ``pmin`` / ``all_gather`` /
``psum_scatter`` into a program through the lowering rules of their primitives (``psum_p``,
``psum_invariant_p``, ``pmax_p``, ``pmin_p``, ``all_gather_p``, ``all_gather_invariant_p``,
``reduce_scatter_p``). The switch registers its own rule for those primitives on the platforms
that have an executor (``cpu``, ``cuda``); every other platform keeps jax's. So everything jax
does before lowering stays jax's own - tracing, ``jax.grad`` and its transposes, ``jvp``,
``vmap`` (a collective over a vmap-bound axis never reaches lowering as a collective), pytrees,
result types under ``shard_map``'s checks, the errors for bad calls - and it reaches collectives
that optax, flax or the user's own references to ``jax.lax.psum`` bind, since all of them bind the
same primitives.

Per call, the rule decides: the ``jax_blink_collective`` custom call (the executor), or the rule
it replaced (XLA's own collective) where jax_blink cannot run the call or should not (dtype,
platform, several processes, a partially manual mesh, asynchronous collectives, uneven groups, the
dispatch table's size ranges, ...). Each decision is kept, with its reason: :func:`switch_report`.

A pytree all-reduce (``lax.psum(grads)``: one equation per leaf) is one call per dtype: the switch
also wraps shard_map's rule, which merges each run of adjacent all-reduces of its body first
(:mod:`jax_blink.switch.merge`, :func:`_merged_rule`; ``jax_blink.config.merge_bytes`` caps a call).

Compiled programs are cached by jax; a program compiled before :func:`install` would keep XLA's
collectives. ``install`` and ``uninstall`` therefore clear jax's caches (``jax.clear_caches``):
the next call of every jitted function lowers again under the rules now in force.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import os
import runpy
import sys
import threading
from collections.abc import Sequence

import jax
import numpy as np
from jax import lax
from jax.interpreters import mlir

from jax_blink.lowering import jax_internals as _jx
from jax_blink.lowering import custom_call
from jax_blink.lowering import decision as _decision
from jax_blink.lowering import processes as _distributed
from jax_blink.options import config
from jax_blink.switch import merge as _merge
from jax_blink.switch import overlap as _overlap
from jax_blink.switch import sparse as _sparse
from jax_blink.lowering import async_call as _async
from jax_blink.lowering import packing as _packing
from jax_blink.lowering import call_order as _call_order
from jax_blink.lowering.call_order import CHAIN as _chain, chains_on_cpu as _chains_on_cpu
from jax_blink.lowering.hierarchy import SubGroup

#: lowering platform (as jax names it when it lowers) -> executor platform (jax_blink's name).
LOWERING_PLATFORMS = {"cpu": "cpu", "cuda": "gpu"}

_ALL_REDUCE = {"psum": "sum", "psum_invariant": "sum", "pmax": "max", "pmin": "min"}
_KIND = {**{p: "allreduce" for p in _ALL_REDUCE}, "all_gather": "allgather",
         "all_gather_invariant": "allgather", "reduce_scatter": "reducescatter"}

_lock = threading.RLock()
_saved: dict[tuple[str, str], object] = {}  # (primitive name, platform) -> the entry replaced
_was_uncacheable: dict[str, bool] = {}
_installed = False
_decisions: collections.deque = collections.deque(maxlen=10_000)
_rewrites: collections.deque = collections.deque(maxlen=1_000)  # the overlap's word on the bodies it rewrote or could not
_sites: dict[int, object] = {}  # an overlapped bucket's id -> its start's Site (None: XLA's all-reduce)


@dataclasses.dataclass(frozen=True)
class SwitchRecord:
    """What the switch did with one collective when a program was lowered.

    ``str(record)`` is one line: the collective, its axes, dtype and shape, and where it runs.

    Attributes:
        primitive: The ``lax`` primitive: ``psum``, ``psum_invariant``, ``pmax``, ``pmin``,
            ``all_gather``, ``all_gather_invariant`` or ``reduce_scatter``.
        axes: The axis names (and vmap-positional axes) of the call.
        shape: The per-rank operand shape (merged operands: all of them, flat).
        dtype: The operand's dtype name.
        ranks: Devices per group, where known, else None.
        platform: The platform the program was lowered for.
        runs_on: ``"jax_blink"`` or ``"xla"``.
        reason: Why.
        operands: How many operands of adjacent psums were merged into this one call.
        overlapped: The call is one bucket of all-reduces that the switch started as soon as their
            operands existed and awaited where their results are first read
            (:mod:`jax_blink.switch.overlap`, ``jax_blink.config.switch_overlap``).
    """

    primitive: str          # psum, psum_invariant, pmax, pmin, all_gather, all_gather_invariant, reduce_scatter
    axes: tuple             # the axis names (and vmap-positional axes) of the call
    shape: tuple            # per-rank operand shape
    dtype: str
    ranks: int | None       # devices per group, where known
    platform: str           # the platform lowered for
    runs_on: str            # "jax_blink" or "xla"
    reason: str             # why
    operands: int = 1       # operands of one pytree psum merged into this call (shape: all of them, flat)
    overlapped: bool = False  # started early, awaited where first read (jax_blink.switch.overlap)

    def __str__(self) -> str:
        where = "jax_blink executor" if self.runs_on == "jax_blink" else "XLA's own collective"
        if self.operands > 1:
            where = (f"one jax_blink executor call for {self.operands} operands" if self.runs_on == "jax_blink"
                     else f"XLA's own collective for each of {self.operands} operands")
        if self.overlapped:
            where = (f"one jax_blink executor call for {self.operands} operand(s), started as they became "
                     "ready" if self.runs_on == "jax_blink" else
                     f"XLA's own collective of {self.operands} operand(s) concatenated, started as they became ready")
        ranks = f", {self.ranks} ranks" if self.ranks else ""
        return (f"{self.primitive} over {self.axes} of {self.dtype}{list(self.shape)}{ranks} on "
                f"{self.platform}: {where} ({self.reason})")


def is_installed() -> bool:
    """Whether the switch is on.

    Returns:
        True between :func:`install` and :func:`uninstall` (or inside :func:`installed`).
    """
    return _installed


def install() -> None:
    """Turn the switch on for the whole process.

    From the next lowering on, the ``lax`` collectives of every program (``psum``, ``pmean``,
    ``pmax``, ``pmin``, ``all_gather``, ``psum_scatter``) run on jax_blink where it can run them;
    :func:`switch_report` says per call where each went and why. Calling it again does nothing.
    It clears jax's caches of compiled programs, so that none keeps XLA's collectives.
    """
    global _installed
    with _lock:
        if _installed:
            return
        for name, prim in _rewritten_primitives():
            for platform in LOWERING_PLATFORMS:
                own = _jx.registered_rule(prim, platform)
                replaced = own if own is not None else _jx.generic_rule(prim)
                if replaced is None:  # jax lowers it nowhere: nothing to replace
                    continue
                _saved[(name, platform)] = own
                rule = _RULES.get(name, _make_rule)(name, platform, _jx.rule_of(replaced))
                mlir.register_lowering(prim, rule, platform=platform, inline=_jx.inline_of(replaced))
            if name in _jx.PRIMITIVES:
                # Each call site its own comm_id (the executors tell calls apart by it): jax must not
                # emit one shared function for equal equations, which XLA:CPU may run at once.
                _was_uncacheable[name] = _jx.set_uncacheable(prim, True)
        for name, (prim, make) in _own_primitives().items():  # jax_blink's own: nothing replaced
            for platform in LOWERING_PLATFORMS:
                _saved[(name, platform)] = None
                mlir.register_lowering(prim, make(platform), platform=platform)
            _was_uncacheable[name] = _jx.set_uncacheable(prim, True)  # as above
        _installed = True
        _call_order.set_switched(_jx.PRIMITIVES.values())
        jax.clear_caches()


def uninstall() -> None:
    """Turn the switch off: jax's own lowering rules again, jax's caches cleared.

    Calling it while the switch is off does nothing.
    """
    global _installed
    with _lock:
        if not _installed:
            return
        prims = dict(_rewritten_primitives(), **{name: prim for name, (prim, _) in _own_primitives().items()})
        for (name, platform), own in _saved.items():
            _jx.restore_rule(prims[name], platform, own)
        for name, was in _was_uncacheable.items():
            _jx.set_uncacheable(prims[name], was)
        _saved.clear()
        _was_uncacheable.clear()
        _installed = False
        _call_order.set_switched(())
        jax.clear_caches()


@contextlib.contextmanager
def installed():
    """A context manager: the switch on inside the ``with`` block, left as it was found after.

    Example::

        with jax_blink.installed():
            out = train_step(params, batch)   # its lax collectives on jax_blink
    """
    was = is_installed()
    install()
    try:
        yield
    finally:
        if not was:
            uninstall()


def switch_report(clear: bool = False) -> list[SwitchRecord]:
    """The switch's decisions, one per collective lowered since the last ``clear``.

    Args:
        clear: Forget the decisions after returning them.

    Returns:
        One :class:`SwitchRecord` per collective lowered (oldest first, at most the last 10,000):
        which run on jax_blink and which go to XLA, and why.
    """
    with _lock:
        out = list(_decisions)
        if clear:
            _decisions.clear()
    return out


def explain_lowering(fun, *args, **kwargs) -> str:
    """Lower ``jax.jit(fun)(*args, **kwargs)`` under the switch and say where each collective runs.

    Nothing is run; the switch is left as it was found.

    Args:
        fun: The function (jitted or not).
        *args: Its arguments (arrays, or ``jax.ShapeDtypeStruct``).
        **kwargs: Its keyword arguments.

    Returns:
        One line per collective (see :class:`SwitchRecord`), then an ``overlap: ...`` line per
        ``shard_map`` body whose all-reduces started early, or could have but for another
        collective between them (:mod:`jax_blink.switch.overlap`), or ``"no collective reached
        lowering"``.
    """
    with _lock:
        start, rewritten = len(_decisions), len(_rewrites)
        with installed():
            jax.jit(fun).lower(*args, **kwargs)
        made = list(_decisions)[start:]
        reasons = list(_rewrites)[rewritten:]
    lines = [*map(str, made), *(f"overlap: {r}" for r in reasons)] if made else []
    return "\n".join(lines) or "no collective reached lowering"


# ---------------------------------------------------------------------------------------------
# The rule.

def _make_rule(name: str, platform: str, replaced):
    def rule(ctx, *args, **params):
        decision, plan = _decide(name, platform, ctx, params)
        with _lock:
            _decisions.append(decision)
        if plan is None:
            return replaced(ctx, *args, **params)
        return _EMIT[_KIND[name]](ctx, *args, plan=plan, **params)

    rule.__name__ = f"jax_blink_{name}_lowering"
    return rule


def _jit_rule(name: str, platform: str, replaced):
    """A nested jax.jit call lowered as jax does, but never through a function that an earlier call
    site of the same jaxpr emitted: two call sites of one function would share the comm_ids of
    the collectives inside it, and XLA:CPU may run independent calls at once. (On CPU, ``replaced``
    is jax_blink.lowering.call_order's rule: a call whose jaxpr holds collectives joins its block's chain.)"""
    del name, platform

    def rule(ctx, *args, **params):
        _jx.forget_lowered_jit_functions(ctx)
        return replaced(ctx, *args, **params)

    rule.__name__ = "jax_blink_jit_lowering"
    return rule


def _shard_map_rule(name: str, platform: str, replaced):
    """A shard_map (or pmap) lowered as jax does, its body's runs of adjacent all-reduces of one
    kind and axes (what ``lax.psum(tree)`` binds: one equation per leaf) first merged into one
    equation each (:mod:`jax_blink.switch.merge`), which :func:`_merged_rule` lowers as one call per dtype;
    before that, with ``config.switch_overlap``, its gradient all-reduces become buckets started as
    their operands exist (:mod:`jax_blink.switch.overlap`, :func:`_overlap_start_rule`).
    Only for a lowering for this platform alone, not for export: there every collective stays
    XLA's, and the merged primitive has no rule on other platforms."""
    del name

    def rule(ctx, *args, jaxpr, **params):
        if _jx.lowering_platforms(ctx) == (platform,) and not _jx.lowering_for_export(ctx):
            if config.switch_overlap:
                rewrite = _overlap_body(jaxpr, _axis_sizes(params.get("mesh")))
                if rewrite.buckets or rewrite.blocked:  # what explain_lowering says
                    with _lock:
                        _rewrites.append(rewrite.reason)
                jaxpr = rewrite.jaxpr
            if config.merge_bytes > 0:
                jaxpr = _merge.merge_all_reduces(jaxpr)
        return replaced(ctx, *args, jaxpr=jaxpr, **params)

    rule.__name__ = "jax_blink_shard_map_lowering"
    return rule


def _axis_sizes(mesh) -> dict:
    """A shard_map's mesh axes by name -> size (empty where the parameter holds no mesh)."""
    try:
        return {str(k): int(v) for k, v in dict(mesh.shape).items()}
    except (AttributeError, TypeError, ValueError):
        return {}


def _overlap_body(jaxpr, axis_sizes: dict) -> _overlap.Rewrite:
    """A shard_map body with its gradient all-reduces started early (:mod:`jax_blink.switch.overlap`),
    its row-sparse gradients first split off and gathered after the wait where
    ``config.switch_sparse_gradients`` (:mod:`jax_blink.switch.sparse`; kept only where the
    overlap then happens: alone, the split moves more bytes)."""
    late, pieces, hold = config.switch_late_last_wait, config.switch_last_bucket_pieces, config.switch_hold
    if config.switch_sparse_gradients:
        split = _sparse.split_row_sparse(jaxpr, axis_sizes, _overlap.OVERLAPPABLE_PRIMITIVES)
        if split.gradients:
            rewrite = _overlap.overlap_all_reduces(split.jaxpr, config.merge_bytes, late_last_wait=late,
                                                   last_bucket_pieces=pieces, hold=hold)
            tied = (_sparse.gather_after_wait(rewrite.jaxpr, split.gathered, _overlap.done_p)
                    if rewrite.buckets else None)
            if tied is not None:
                return dataclasses.replace(rewrite, jaxpr=tied, reason=(
                    f"{rewrite.reason}; {split.gradients} row-sparse gradient(s) (embedding lookups) "
                    "all-gathered after the wait"))
    return _overlap.overlap_all_reduces(jaxpr, config.merge_bytes, late_last_wait=late, last_bucket_pieces=pieces,
                                        hold=hold)


def _rewritten_primitives() -> list[tuple[str, object]]:
    """(name, primitive) of every primitive whose lowering rule the switch replaces."""
    return [*_jx.PRIMITIVES.items(), ("jit", _jx.JIT_PRIMITIVE), ("shard_map", _jx.SHARD_MAP_PRIMITIVE)]


_RULES = {"jit": _jit_rule, "shard_map": _shard_map_rule}  # the rest: _make_rule


def _own_primitives() -> dict:
    """name -> (primitive, rule maker) of the primitives that exist only in bodies the switch
    rewrote before lowering them (merged runs, overlapped buckets)."""
    return {"merged": (_merge.merged_all_reduce_p, _merged_rule),
            "overlap_start": (_overlap.start_p, _overlap_start_rule),
            "overlap_done": (_overlap.done_p, _overlap_done_rule)}


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What the emitter needs: ranks, the rank and group of each mesh position, the executor."""

    n: int
    exec_platform: str
    rank_of: np.ndarray    # int32[mesh size]: the rank of each mesh position in its group
    group_of: np.ndarray   # int32[mesh size]: the group of each mesh position
    positional: tuple[int, ...]  # vmap-positional axes reduced locally first (psum family)
    op: str                # the reduction: sum, max or min


def _axes_of(name: str, params: dict) -> tuple:
    axes = params["axes"] if name in _ALL_REDUCE else params["axis_name"]
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def _devices(exec_platform: str) -> list:
    try:
        return jax.devices(exec_platform)
    except RuntimeError:  # no backend of that platform in this process
        return []


def _device_kind(exec_platform: str) -> str | None:
    devices = _devices(exec_platform)
    return devices[0].device_kind if devices else None


def _decide(name: str, platform: str, ctx, params: dict, aval=None) -> tuple[SwitchRecord, _Plan | None]:
    """Where one collective runs. ``aval`` (shape and dtype; default: the equation's operand) is the
    operand to decide for: a merged run's concatenation (:func:`_merged_rule`)."""
    aval = ctx.avals_in[0] if aval is None else aval
    axes = _axes_of(name, params)
    shape = tuple(aval.shape)
    dtype = np.dtype(aval.dtype).name
    exec_platform = LOWERING_PLATFORMS[platform]
    n = None

    def to_xla(reason: str):
        return SwitchRecord(name, axes, shape, dtype, n, platform, "xla", reason), None

    if params.get("is_async"):
        return to_xla("asynchronous collectives (start/done pairs) stay XLA's")
    if _jx.lowering_for_export(ctx):
        return to_xla("lowered for jax.export: the serialized program may run without jax_blink")
    if len(_jx.lowering_platforms(ctx)) > 1:
        return to_xla(f"lowered for several platforms at once {_jx.lowering_platforms(ctx)}")
    positional = tuple(a for a in axes if isinstance(a, int))
    named = tuple(a for a in axes if not isinstance(a, int))
    if not named:
        return to_xla("vmap-bound axes only: a local reduction, no communication")
    mesh = _jx.manual_mesh(ctx)
    if mesh is None:
        return to_xla("not lowered inside a shard_map or pmap body")
    names, sizes, manual = mesh
    auto = [a for a, s in zip(names, sizes) if a not in manual and s > 1]
    if auto:
        return to_xla(f"a partially manual shard_map (mesh axes {auto} are automatic)")
    if dtype not in custom_call.SUPPORTED_DTYPES:
        return to_xla(f"dtype {dtype}: the executors take {', '.join(custom_call.SUPPORTED_DTYPES)}")
    if not all(isinstance(d, (int, np.integer)) for d in shape):
        return to_xla("a shape with symbolic dimensions")
    groups = _jx.device_groups(ctx, named)
    index_groups = params.get("axis_index_groups")
    if index_groups is not None:
        groups = tuple(tuple(g[i] for i in ig) for g in groups for ig in index_groups)
    n = len(groups[0])
    if any(len(g) != n for g in groups):
        return to_xla("axis_index_groups of unequal sizes")
    mesh_size = int(np.prod(sizes))
    covered = sorted(d for g in groups for d in g)
    if covered != list(range(mesh_size)):
        return to_xla("groups that do not cover every device once")
    if n == 1:
        return to_xla("one device per group: nothing to exchange")
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize
    if positional:
        nbytes //= max(1, int(np.prod([shape[a] for a in positional])))
    if nbytes == 0:
        return to_xla("an empty operand")
    devices = _devices(exec_platform)
    if len(devices) < n:
        return to_xla(f"{len(devices)} {exec_platform} device(s) in this process for an axis of {n} ranks "
                      "(lowered for devices this process does not have)")
    problem = _decision.executor_problem(exec_platform, "the switch's collectives", n, several_processes=False)
    if problem is not None:
        _decision.fall_back(problem, f"the switch's collectives on {platform}")
        return to_xla(problem)
    dispatch = _decision.dispatch(_KIND[name], n, nbytes, dtype, _device_kind(exec_platform))
    if not dispatch.executor:
        return to_xla(dispatch.reason)
    rank_of = np.full(mesh_size, -1, np.int32)
    group_of = np.full(mesh_size, -1, np.int32)
    for gi, g in enumerate(groups):
        for r, d in enumerate(g):
            rank_of[d], group_of[d] = r, gi
    plan = _Plan(n, exec_platform, rank_of, group_of, positional, _ALL_REDUCE.get(name, "sum"))
    why = "axis_index_groups, " if index_groups is not None else ""
    return (SwitchRecord(name, axes, shape, dtype, n, platform, "jax_blink",
                     f"{why}{nbytes} bytes per rank, {len(groups)} group(s)"), plan)


# ---------------------------------------------------------------------------------------------
# Emitting the custom call: a traced function lowered in place of the primitive
# (mlir.lower_fun), given this device's mesh position as an extra operand.

def _ranks(plan: _Plan, position) -> SubGroup:
    """This device's rank and group from its mesh position (a lowering rule sees no axis
    environment, so no axis index)."""
    return SubGroup(n=plan.n, rank=jax.numpy.asarray(plan.rank_of)[position],
                    group=jax.numpy.asarray(plan.group_of)[position], devices=(),
                    rank_process=None, rank_device=None)


def _call(flat, plan: _Plan, position, collective: str, op: str = "sum"):
    """The ``jax_blink_collective`` custom call over a flat operand, inside a traced function: the
    lowering's own call (jax_blink.lowering.custom_call.collective_call), its ranks from the mesh
    position (:func:`_ranks`)."""
    return custom_call.collective_call(flat, (), collective, op=op, platform=plan.exec_platform,
                                       topology=custom_call.default_topology(plan.n, plan.exec_platform),
                                       sub=_ranks(plan, position))


def _replaced_rule(name: str, platform: str):
    """The rule the switch replaced for primitive ``name`` on ``platform`` (jax's own, or its generic
    one): what a call that goes to XLA lowers with."""
    own = _saved.get((name, platform))
    return _jx.rule_of(own if own is not None else _jx.generic_rule(_jx.PRIMITIVES[name]))


def _lower(ctx, body, *args, multiple_results: bool = False):
    """Lower ``body(*args, position)`` in place of the primitive (``multiple_results``: ``body``
    returns a list, one result per ``ctx.avals_out``; the block's next call waits for the first).

    ``position`` waits for the previous jax_blink call of the same block: XLA:CPU runs independent
    custom calls at once, in an order of its choosing per device, and calls that block for their
    peers can then wait on each other in a cycle (seen: FSDP + TP gradients on a 4 x 2 mesh, a
    GPT-2 value_and_grad step). On CPU the wait is a ``jax_blink_after`` custom call taking the
    previous call's result as an operand: XLA:CPU's compiler removes ``optimization_barrier``s
    (OptimizationBarrierExpander), which left every call independent in the compiled program."""
    i32 = _jx.int32_scalar_aval()
    position = _jx.device_position(ctx)
    last = _chain.last(ctx)
    if not last:
        sub = ctx.replace(primitive=None, avals_in=[*ctx.avals_in, i32])
        outs = mlir.lower_fun(body, multiple_results=multiple_results)(sub, *args, position)
    elif _chains_on_cpu(ctx):
        def waiting(*operands):
            *xs, pos = operands[:len(args) + 1]
            for prev in operands[len(args) + 1:]:
                pos = _distributed.after(pos, prev)
            return body(*xs, pos)

        sub = ctx.replace(primitive=None, avals_in=[*ctx.avals_in, i32, *(a for _, a in last)])
        outs = mlir.lower_fun(waiting, multiple_results=multiple_results)(
            sub, *args, position, *(v for v, _ in last))
    else:  # GPU: each device runs one program's thunks in one order, the barrier is enough
        sub = ctx.replace(primitive=None, avals_in=[*ctx.avals_in, i32])
        for prev, _ in last:
            position = _jx.optimization_barrier_after(position, prev)
        outs = mlir.lower_fun(body, multiple_results=multiple_results)(sub, *args, position)
    _chain.record(ctx, [(outs[0], ctx.avals_out[0])])
    return outs


_POSITIONAL_REDUCE = {"sum": lax.reduce_sum, "max": lax.reduce_max, "min": lax.reduce_min}


def _emit_all_reduce(ctx, x, *, plan: _Plan, axes, **params):
    op = plan.op

    def body(v, position):
        if plan.positional:
            v = _POSITIONAL_REDUCE[op](v, plan.positional)
        return _call(v.reshape(-1), plan, position, "allreduce", op).reshape(v.shape)

    return _lower(ctx, body, x)


def _merged_rule(platform: str):
    """The lowering of a merged run of all-reduces (:data:`jax_blink.switch.merge.merged_all_reduce_p`):
    per group of :func:`jax_blink.switch.merge.merge_groups` (one dtype, at most ``config.merge_bytes``), one
    decision for the group as one flat operand of its total size (the dispatch table decides on the
    merged size; a dtype the executors do not take goes to XLA as before), and then one jax_blink
    call on the concatenated operands, split back to their shapes, or XLA's collective for each
    operand as jax lowers it. A group of one operand is the switch's ordinary rule."""

    def rule(ctx, *args, name, params):
        params = dict(params)
        prim = _jx.PRIMITIVES[name]
        replaced = _replaced_rule(name, platform)
        outs: list = [None] * len(args)

        def one(i):  # operand i as jax's equation of its own would lower it
            sub = ctx.replace(primitive=prim, avals_in=[ctx.avals_in[i]], avals_out=[ctx.avals_out[i]])
            return sub, args[i]

        for group in _merge.merge_groups(ctx.avals_in, config.merge_bytes):
            if len(group) == 1:
                outs[group[0]], = _make_rule(name, platform, replaced)(*one(group[0]), **params)
                continue
            avals = [ctx.avals_in[i] for i in group]
            sizes = [int(np.prod(a.shape, dtype=np.int64)) for a in avals]
            flat = jax.ShapeDtypeStruct((sum(sizes),), avals[0].dtype)
            sub = ctx.replace(primitive=prim, avals_in=avals, avals_out=[ctx.avals_out[i] for i in group])
            decision, plan = _decide(name, platform, sub, params, aval=flat)
            with _lock:
                _decisions.append(dataclasses.replace(decision, operands=len(group)))
            if plan is None:
                for i in group:
                    outs[i], = replaced(*one(i), **params)
                continue

            def body(*operands, plan=plan, avals=avals):
                *xs, position = operands
                at = plan.exec_platform
                return _packing.split(_call(_packing.join(xs, at), plan, position, "allreduce", plan.op),
                                      [a.shape for a in avals], at)

            for i, piece in zip(group, _lower(sub, body, *(args[i] for i in group), multiple_results=True)):
                outs[i] = piece
        return outs

    rule.__name__ = "jax_blink_merged_all_reduce_lowering"
    return rule


def _overlap_start_rule(platform: str):
    """The lowering of one overlapped bucket's start (:data:`jax_blink.switch.overlap.start_p`): one
    decision for the bucket as one flat operand of its total size, as for a merged run. On the
    executor: the operands concatenated, :func:`jax_blink.lowering.async_call.start_call` (a side
    stream on GPUs, the synchronous call elsewhere), and the held values tied to the start by an
    ``optimization_barrier``. On XLA: its all-reduce of the concatenation, nothing held back (XLA
    places its own collectives)."""

    def rule(ctx, *args, bucket, name, params, count, last):
        params = dict(params)
        prim = _jx.PRIMITIVES[name]
        replaced = _replaced_rule(name, platform)
        result_aval, flat_aval = ctx.avals_out[0], ctx.avals_out[1]
        operands, avals = args[:count], ctx.avals_in[:count]
        sub = ctx.replace(primitive=prim, avals_in=list(avals), avals_out=[result_aval])
        decision, plan = _decide(name, platform, sub, params, aval=flat_aval)
        with _lock:
            _decisions.append(dataclasses.replace(decision, operands=count, overlapped=True))

        if plan is None:
            with _lock:
                _sites[bucket] = None
            flat, = mlir.lower_fun(lambda *xs: _packing.join(xs), multiple_results=False)(
                ctx.replace(primitive=None, avals_in=list(avals), avals_out=[flat_aval]), *operands)
            result, = replaced(ctx.replace(primitive=prim, avals_in=[flat_aval], avals_out=[result_aval]),
                               flat, **params)
            return [result, flat, *args[count:]]

        def body(*operands_held_position):
            *values, position = operands_held_position
            xs, held = values[:count], values[count:]
            flat = _packing.join(xs, plan.exec_platform)
            passed, result, site = _async.start_call(
                flat, (), op=plan.op, platform=plan.exec_platform, full_grid=last, sub=_ranks(plan, position),
                topology=custom_call.default_topology(plan.n, plan.exec_platform),
                result_type=jax.ShapeDtypeStruct(flat.shape, flat.dtype))
            with _lock:
                _sites[bucket] = site
            if held:
                passed, held = lax.optimization_barrier((passed, list(held)))
            return [result, passed, *held]

        return _lower(ctx, body, *args, multiple_results=True)

    rule.__name__ = "jax_blink_overlap_start_lowering"
    return rule


def _overlap_done_rule(platform: str):
    """The lowering of the overlapped buckets' waits (:data:`jax_blink.switch.overlap.done_p`): per
    bucket, :func:`jax_blink.lowering.async_call.done_call` after the token (XLA's stream waits for
    the side stream; CPU: the result once the token exists), split back into the all-reduces'
    results; a late wait's token passes an ``optimization_barrier`` with the values it is tied
    behind first. The block's next jax_blink call waits for every bucket's wait."""
    del platform

    def rule(ctx, *args, ids, buckets, after=0):
        at = 2 * len(ids)
        token, token_aval = args[at], ctx.avals_in[at]
        if after:  # a late wait: the token only once every value it is tied behind exists
            sub = ctx.replace(primitive=None, avals_in=list(ctx.avals_in[at:]), avals_out=[token_aval])
            token, = mlir.lower_fun(lambda t, *xs: lax.optimization_barrier((t, list(xs)))[0],
                                    multiple_results=False)(sub, token, *args[at + 1:])
        outs, waited = [], []
        first = 0
        for b, (bucket, count) in enumerate(zip(ids, buckets)):
            result, passed = args[2 * b], args[2 * b + 1]
            result_aval, passed_aval = ctx.avals_in[2 * b], ctx.avals_in[2 * b + 1]
            with _lock:
                site = _sites.pop(bucket, None)
            avals = list(ctx.avals_out[first:first + count])

            def body(result, passed, token, site=site, avals=avals):
                done = result if site is None else _async.done_call(passed, result, token, site)
                # XLA's all-reduce (no site) took XLA's concatenation
                return [done, *_packing.split(done, [a.shape for a in avals], site and site.platform)]

            sub = ctx.replace(primitive=None, avals_in=[result_aval, passed_aval, token_aval],
                              avals_out=[result_aval, *avals])
            done, *pieces = mlir.lower_fun(body, multiple_results=True)(sub, result, passed, token)
            waited.append((done, result_aval))
            outs += pieces
            first += count
        _chain.record(ctx, waited)
        return outs

    rule.__name__ = "jax_blink_overlap_done_lowering"
    return rule


def _emit_all_gather(ctx, x, *, plan: _Plan, all_gather_dimension, tiled, **params):
    n, d = plan.n, all_gather_dimension

    def body(v, position):
        rank = jax.numpy.asarray(plan.rank_of)[position]
        buf = jax.numpy.zeros((n, v.size), v.dtype)
        buf = lax.dynamic_update_slice(buf, v.reshape(1, -1), (rank, jax.numpy.int32(0)))
        stacked = _call(buf.reshape(-1), plan, position, "allgather").reshape((n,) + v.shape)
        if tiled:
            moved = jax.numpy.moveaxis(stacked, 0, d)
            return moved.reshape(v.shape[:d] + (n * v.shape[d],) + v.shape[d + 1:])
        return jax.numpy.moveaxis(stacked, 0, d)

    return _lower(ctx, body, x)


def _emit_reduce_scatter(ctx, x, *, plan: _Plan, scatter_dimension, tiled, **params):
    n, d = plan.n, scatter_dimension
    out_shape = tuple(ctx.avals_out[0].shape)

    def body(v, position):
        rank = jax.numpy.asarray(plan.rank_of)[position]
        blocks = jax.numpy.moveaxis(v, d, 0)
        per = blocks.size // n
        out = _call(blocks.reshape(-1), plan, position, "reducescatter").reshape(n, per)
        mine = lax.dynamic_slice(out, (rank, jax.numpy.int32(0)), (1, per))
        mine = mine.reshape((blocks.shape[0] // n,) + blocks.shape[1:])
        return jax.numpy.moveaxis(mine, 0, d).reshape(out_shape)

    return _lower(ctx, body, x)


_EMIT = {"allreduce": _emit_all_reduce, "allgather": _emit_all_gather,
         "reducescatter": _emit_reduce_scatter}


# ---------------------------------------------------------------------------------------------
# python -m jax_blink run SCRIPT.py [ARGS...]

RUN_USAGE = "usage: python -m jax_blink run [--report] SCRIPT.py [ARGS...]"


def run_script(argv: Sequence[str]) -> int:
    """Run ``SCRIPT.py`` with ``ARGS`` as ``python SCRIPT.py ARGS...`` would, with the switch on.

    The script's ``sys.argv``, ``__name__ == "__main__"``, ``SystemExit`` and exceptions are its own
    (they pass through unchanged); returns 0 when it ends normally. ``--report`` (before the
    script) prints the switch's decisions to stderr when the process exits."""
    argv = list(argv)
    report = False
    while argv and argv[0].startswith("-"):
        opt = argv.pop(0)
        if opt == "--report":
            report = True
        elif opt in ("-h", "--help"):
            print(RUN_USAGE)
            return 0
        else:
            print(f"{RUN_USAGE}\npython -m jax_blink run: unknown option {opt!r}", file=sys.stderr)
            return 2
    if not argv:
        print(RUN_USAGE, file=sys.stderr)
        return 2
    path = argv[0]
    if not os.path.isfile(path):
        print(f"python -m jax_blink run: can't open file {path!r}: no such file", file=sys.stderr)
        return 2
    sys.argv = argv
    sys.path[0] = os.path.dirname(os.path.abspath(path))  # as `python SCRIPT` puts its folder first
    if report:
        atexit.register(_print_report)
    install()
    runpy.run_path(path, run_name="__main__")
    return 0


def _print_report() -> None:
    decisions = switch_report()
    on = sum(d.runs_on == "jax_blink" for d in decisions)
    lines = [f"jax_blink switch: {len(decisions)} collective(s) lowered, {on} on jax_blink, "
             f"{len(decisions) - on} on XLA"] + [f"  {d}" for d in decisions]
    print("\n".join(lines), file=sys.stderr)
