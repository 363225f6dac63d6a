"""Every piece of jax's internals that the switch (:mod:`jax_blink.switch`) touches, in one place.

The switch replaces the lowering rules of jax's collective primitives, so it must name those
primitives, read and restore the table of registered rules, and read the axis context that a rule
sees. None of that is public API. Each use below says what it is and where it lives; checked
against jax 0.10.2, 0.11.2 and 0.12.0.1 (the CPU test suite on each; newest-jax.sh of issue 22).
``tests/unit/test_switch.py::test_jax_internals_are_where_the_switch_expects`` fails loudly if one moves.
"""
from __future__ import annotations

from contextlib import nullcontext as _nullcontext
from typing import Any

import numpy as np

# jax._src.lax.parallel: the primitives that lax.psum / pmax / pmin / all_gather / psum_scatter
# bind (psum_invariant_p under shard_map's vma checks; all_gather_invariant_p for to="invariant").
from jax._src.lax import parallel as _parallel
# jax._src.interpreters.mlir: _lowerings (rules for every platform) and
# _platform_specific_lowerings[platform] (rules that win over those) map a primitive to a
# LoweringRuleEntry(rule, inline). Read to keep the rule that the switch replaces, written to put
# it back (the public register_lowering can add a rule, not remove one).
from jax._src.interpreters import mlir as _mlir_internal
# jax._src.interpreters.pxla.axis_groups(axis_context, axes): the device ids (positions in the
# mesh, as partition_id numbers them) of each group that a collective over `axes` spans; the
# same replica groups that jax gives XLA's own collective.
from jax._src.interpreters import pxla as _pxla
# jax._src.pjit.jit_p: the primitive of a nested jax.jit call. Its lowering rule keeps the function
# it emits in ModuleContext.cached_primitive_lowerings under a key whose first item is jit_p, and
# calls it again from every call site of the same jaxpr.
from jax._src import pjit as _pjit
# jax._src.sharding_impls.SPMDAxisContext: the axis context of a shard_map body (and of pmap,
# which jax runs as a shard_map): .mesh and .manual_axes.
from jax._src import sharding_impls as _sharding_impls
# jax._src.lib.mlir: the StableHLO builder, for the partition_id op (this device's position in
# the mesh) that jax's own axis_index lowering uses.
from jax._src.lib.mlir import ir as _ir
from jax._src.lib.mlir.dialects import hlo as _hlo

#: The primitives the switch lowers, by the name the switch uses for them.
PRIMITIVES: dict[str, Any] = {
    "psum": _parallel.psum_p,
    "psum_invariant": _parallel.psum_invariant_p,
    "pmax": _parallel.pmax_p,
    "pmin": _parallel.pmin_p,
    "all_gather": _parallel.all_gather_p,
    "all_gather_invariant": _parallel.all_gather_invariant_p,
    "reduce_scatter": _parallel.reduce_scatter_p,
}


JIT_PRIMITIVE = _pjit.jit_p

# jax._src.lax.control_flow: while_p (while_loop, fori_loop, and scan, which jax lowers as a
# while) and cond_p (cond, switch); jax._src.ffi.ffi_call_p: what jax.ffi.ffi_call binds, its
# target in the equation's "target_name" parameter. jax_blink.lowering.call_order wraps their CPU rules.
from jax._src.lax import control_flow as _control_flow  # noqa: E402
from jax._src import ffi as _ffi  # noqa: E402
from jax._src import ad_checkpoint as _ad_checkpoint  # noqa: E402
from jax._src import custom_batching as _custom_batching  # noqa: E402
from jax._src import custom_derivatives as _custom_derivatives  # noqa: E402

WHILE_PRIMITIVE = _control_flow.while_p
# jax._src.core.closed_call_p (eval_jaxpr_p under that name on jax's main branch), its jaxpr in
# "call_jaxpr": a call that jax emits as a function of its own (a fully unrolled scan's bodies).
from jax._src import core as _core  # noqa: E402

CALL_PRIMITIVE = _core.closed_call_p
# jax._src.ad_util.add_jaxvals_p ("add_any": the sum of two cotangents of one value),
# jax._src.lax.lax.optimization_barrier_p and jax._src.lax.slicing.slice_p: equations the switch
# writes into a body it rewrites.
from jax._src import ad_util as _ad_util  # noqa: E402
from jax._src.lax import lax as _lax_impl  # noqa: E402
from jax._src.lax import slicing as _slicing  # noqa: E402

ADD_ANY = _ad_util.add_jaxvals_p
OPTIMIZATION_BARRIER = _lax_impl.optimization_barrier_p
SLICE = _slicing.slice_p  # parameters: start_indices, limit_indices, strides
COND_PRIMITIVE = _control_flow.cond_p
FFI_CALL_PRIMITIVE = _ffi.ffi_call_p

#: Primitives whose lowering holds a sub-jaxpr (or is a custom call) that jax_blink calls live in:
#: scan, custom_jvp (every explicit call is one), custom_vmap, checkpoint, while, cond, ffi_call.
#: jax emits a cacheable primitive's lowering into a function of its own first and copies it to
#: the call site after (mlir._cached_lowering_miss), so a rule lowered there cannot see the
#: block's earlier calls; jax_blink.lowering.call_order marks these uncacheable (the same program results).
CALL_HOLDING_PRIMITIVES = (_control_flow.scan_p, _custom_derivatives.custom_jvp_call_p,
                           _custom_batching.custom_vmap_p, _ad_checkpoint.remat_p,
                           WHILE_PRIMITIVE, COND_PRIMITIVE, FFI_CALL_PRIMITIVE)


def set_uncacheable(prim, uncacheable: bool) -> bool:
    """Mark ``prim``'s lowering as one that jax must emit afresh at each equation (never a shared
    function for equal equations); returns whether it was so marked before.
    (mlir._uncacheable_primitives: register_lowering(cacheable=False) adds to it, nothing removes.)"""
    table = _mlir_internal._uncacheable_primitives
    was = prim in table
    if uncacheable:
        table.add(prim)
    else:
        table.discard(prim)
    return was


def forget_lowered_jit_functions(ctx) -> None:
    """Drop the functions that nested jit calls emitted so far in this module, so that the next
    call site lowers its own copy."""
    cache = ctx.module_context.cached_primitive_lowerings
    for key in [k for k in cache if type(k) is tuple and k and k[0] is JIT_PRIMITIVE]:
        del cache[key]


def registered_rule(prim, platform: str):
    """The entry registered for ``prim`` on ``platform`` only (None if it has none there)."""
    return _mlir_internal._platform_specific_lowerings[platform].get(prim)


def generic_rule(prim):
    """The entry registered for ``prim`` on every platform (None if none)."""
    return _mlir_internal._lowerings.get(prim)


def restore_rule(prim, platform: str, entry) -> None:
    """Put back what :func:`registered_rule` returned (None: remove the platform's own rule)."""
    table = _mlir_internal._platform_specific_lowerings[platform]
    if entry is None:
        table.pop(prim, None)
    else:
        table[prim] = entry


def rule_of(entry):
    """The lowering function inside a registered entry."""
    return entry.rule


def inline_of(entry) -> bool:
    """Whether jax emits the entry's rule inline (False: as a function of its own)."""
    return entry.inline


def lowering_for_export(ctx) -> bool:
    """Whether jax lowers this module for jax.export (ModuleContext.lowering_parameters.for_export):
    a serialized program may run where no jax_blink executor is registered."""
    return bool(getattr(ctx.module_context.lowering_parameters, "for_export", False))


def lowering_platforms(ctx) -> tuple[str, ...]:
    """The platforms the module is lowered for (more than one only when exporting)."""
    return tuple(ctx.module_context.platforms)


def manual_mesh(ctx) -> tuple[tuple[str, ...], tuple[int, ...], frozenset] | None:
    """(axis names, axis sizes, manual axes) of the mesh a rule is lowered in, or None when the
    rule is not lowered inside a shard_map / pmap body."""
    axis_ctx = ctx.module_context.axis_context
    if not isinstance(axis_ctx, _sharding_impls.SPMDAxisContext):
        return None
    mesh = axis_ctx.mesh
    return tuple(mesh.axis_names), tuple(int(s) for s in mesh.axis_sizes), frozenset(axis_ctx.manual_axes)


def device_groups(ctx, axes: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """The groups of device ids (mesh positions) that a collective over ``axes`` spans, each in
    rank order, as jax gives them to XLA's collective."""
    return tuple(tuple(int(d) for d in g) for g in _pxla.axis_groups(ctx.module_context.axis_context, axes))


def device_position(ctx):
    """An int32 scalar: this device's position in the mesh (``partition_id``, as jax's own
    ``axis_index`` lowering computes it inside a fully manual shard_map)."""
    del ctx
    i32 = _ir.RankedTensorType.get([], _ir.IntegerType.get_signless(32))
    return _hlo.convert(i32, _hlo.partition_id())


class CallChain:
    """The last jax_blink call emitted in each block of the modules being lowered, so that the next
    call of the same block can wait for it (:meth:`last`, :meth:`record`).

    Keyed by MLIR block, per module; the most recent modules only, held by a strong reference
    while they are in here so that no block of a freed module can be mistaken for a new one."""

    def __init__(self, modules: int = 4):
        import threading
        self._lock = threading.Lock()
        self._modules: list[tuple[object, dict]] = []  # (ir.Module, {block: value}), newest last
        self._keep = modules

    def _blocks(self, ctx) -> dict:
        module = ctx.module_context.module  # one ir.Module object per lowering, kept by replace()
        for m, blocks in self._modules:
            if m is module:
                return blocks
        blocks: dict = {}
        self._modules = [*self._modules[-(self._keep - 1):], (module, blocks)]
        return blocks

    def last(self, ctx) -> list | None:
        """[(value, abstract value), ...]: what the block's next call waits for (None: nothing)."""
        block = _ir.InsertionPoint.current.block
        with self._lock:
            return self._blocks(ctx).get(block)

    def record(self, ctx, deps: list) -> None:
        """``deps`` ([(value, abstract value), ...], outputs of a call just emitted in the current
        block: a collective's result, or every result of a nested call holding collectives) are
        what the block's next call waits for."""
        block = _ir.InsertionPoint.current.block
        with self._lock:
            self._blocks(ctx)[block] = list(deps)


def holds_equation(jaxpr, predicate) -> bool:
    """Whether a (closed) jaxpr has an equation for which ``predicate(eqn)`` holds, at any depth
    (:func:`nested_jaxprs`)."""
    stack = [getattr(jaxpr, "jaxpr", jaxpr)]
    while stack:
        for eqn in stack.pop().eqns:
            if predicate(eqn):
                return True
            stack.extend(nested_jaxprs(eqn))
    return False


def nested_jaxprs(eqn) -> list:
    """The jaxprs in an equation's parameters (a nested jit's, a loop's body, a cond's branches)."""
    from jax._src import core
    return list(core.jaxprs_in_params(eqn.params))


def holds_collective(jaxpr) -> bool:
    """Whether a (closed) jaxpr binds one of :data:`PRIMITIVES`, at any depth."""
    prims = set(PRIMITIVES.values())
    return holds_equation(jaxpr, lambda eqn: eqn.primitive in prims)


def operands_of_definition(value) -> list:
    """The operands of the MLIR operation that defines ``value`` (none for a block argument:
    ir.Value.owner is then the Block)."""
    return list(getattr(value.owner, "operands", ()))


def optimization_barrier_after(value, dep):
    """``value`` tied to ``dep`` by a StableHLO ``optimization_barrier`` of both. XLA:CPU's
    compiler removes these barriers; the GPU compiler keeps one schedule for every device."""
    return _hlo.OptimizationBarrierOp([value, dep]).results[0]


def int32_scalar_aval():
    """The abstract value of :func:`device_position` (plain, outside any mesh)."""
    import jax
    return jax.core.ShapedArray((), np.int32)


# jax._src.interpreters.batching.BatchTracer: the value of ``lax.axis_index`` over an axis that
# ``vmap`` binds (an axis the executors have no devices for) is one of these.
from jax._src.interpreters import batching as _batching  # noqa: E402


def is_vmap_batched(value) -> bool:
    """Whether ``value`` is being batched by ``vmap`` at this point of the trace."""
    return isinstance(value, _batching.BatchTracer)


# jax._src.shard_map.shard_map_p: the primitive of a shard_map (and of pmap, which jax runs as one);
# its lowering rule takes the body as the ``jaxpr`` parameter (a core.Jaxpr). The switch rewrites
# that body before jax lowers it (:mod:`jax_blink.switch.merge`).
from jax._src import shard_map as _shard_map  # noqa: E402
# jax._src.core: Jaxpr.replace(eqns=...) and new_jaxpr_eqn, to put one equation in place of several.
from jax._src import core as _core  # noqa: E402

SHARD_MAP_PRIMITIVE = _shard_map.shard_map_p


def replace_eqns(jaxpr, eqns: list, outvars: list | None = None):
    """``jaxpr`` (a core.Jaxpr) with ``eqns`` as its equations (same inputs and effects; the same
    outputs unless ``outvars`` names them)."""
    return jaxpr.replace(eqns=eqns) if outvars is None else jaxpr.replace(eqns=eqns, outvars=outvars)


def new_var(aval):
    """A fresh jaxpr variable of abstract value ``aval``."""
    return _core.Var(aval)


def is_plain_array(aval) -> bool:
    """Whether ``aval`` is an array of an ordinary dtype (not a token, a PRNG key, a reference)."""
    import jax
    return (isinstance(aval, _core.ShapedArray)
            and not jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended))


def new_eqn(invars: list, outvars: list, prim, params: dict, effects, like):
    """An equation of ``prim`` with the source info and context of the equation ``like``."""
    return _core.new_jaxpr_eqn(invars, outvars, prim, params, effects, like.source_info, like.ctx)


def is_var(atom) -> bool:
    """Whether a jaxpr atom is a variable (not a literal constant)."""
    return isinstance(atom, _core.Var)


def producers(eqns) -> dict:
    """Each variable that ``eqns`` (a jaxpr's equations) make -> the index of the equation that makes it."""
    return {v: i for i, e in enumerate(eqns) for v in e.outvars}


def readers(eqns) -> dict:
    """Each variable that ``eqns`` read -> the indices of the equations that read it, in order
    (an equation that reads it twice is listed twice)."""
    found: dict = {}
    for i, e in enumerate(eqns):
        for v in e.invars:
            if is_var(v):
                found.setdefault(v, []).append(i)
    return found


def compute_on_call():
    """jax's function form of compute_on (``fn(f, compute_type=..., out_memory_spaces=...)``: ``f``
    lowered as a call annotated with the compute type, e.g. "gpu_stream:1"), or None if this jax
    lacks it. Public, experimental: jax.experimental.compute_on.compute_on2 in jax 0.10; jax 0.11
    renamed it compute_on (same arguments) and removed the context manager of that name."""
    import inspect
    from jax.experimental import compute_on as _compute_on
    fn = getattr(_compute_on, "compute_on2", None) or getattr(_compute_on, "compute_on", None)
    if fn is None or "out_memory_spaces" not in inspect.signature(fn).parameters:
        return None  # compute_on(compute_type) alone is the context manager: not this form
    return fn


def bind_equation(eqn, invals: list) -> list:
    """Run one jaxpr equation on values (jax._src.core.eval_jaxpr's loop body, in its source
    context; ``Primitive.get_bind_params`` returns the parameters, or in older jax
    ``(subfuns, params)``): the list of its results."""
    from jax._src import source_info_util
    got = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = ([], got) if isinstance(got, dict) else got
    ctx = getattr(getattr(eqn, "ctx", None), "manager", None)
    with source_info_util.user_context(eqn.source_info.traceback), (ctx if ctx is not None else _nullcontext()):
        ans = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(ans) if eqn.primitive.multiple_results else [ans]


def literal_value(atom):
    """The value of a jaxpr literal, or None for a variable."""
    return None if isinstance(atom, _core.Var) else atom.val


def inlined_call_jaxpr(eqn):
    """The closed jaxpr of a nested ``jax.jit`` or ``closed_call`` equation (whose inlining
    changes nothing but the schedule's freedom), or None for any other equation."""
    if eqn.primitive is JIT_PRIMITIVE:
        return eqn.params["jaxpr"]
    if eqn.primitive is CALL_PRIMITIVE:
        return eqn.params["call_jaxpr"]
    return None

