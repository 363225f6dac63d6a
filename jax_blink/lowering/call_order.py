"""One order of jax_blink calls in a compiled CPU program, kept when the program is lowered.

XLA:CPU runs independent custom calls in an order of its own on each device, and a jax_blink call
blocks until its peers arrive: two devices that start different calls first wait on each other
until the time budget ends. So every jax_blink call of a block must depend on the block's previous
one, through a ``jax_blink_after`` custom call (:func:`jax_blink.lowering.processes.after`), which XLA
keeps (it removes ``optimization_barrier``\\ s on CPU).

Explicit calls (``jax_blink.all_reduce`` ...) chain in the trace they are written in
(:func:`jax_blink.lowering.processes.in_program_order`); the switch's calls chain in its lowering rule
(``jax_blink.switch._lower``). What neither sees is kept here, in the lowering rules that
:func:`register` installs on CPU while jax_blink is imported:

* every jax_blink call lowered in a block is recorded in :data:`CHAIN`, and one whose operands do
  not already depend on the block's previous call waits for it (the call after a loop, the copies
  of one traced body in an unrolled ``scan``, calls traced in a ``checkpoint`` beside others);
* a ``while`` (``fori_loop``, ``scan``), ``cond`` / ``switch``, nested ``jit`` or call (a fully
  unrolled ``scan``'s bodies) whose jaxprs hold jax_blink calls joins the chain as one call: its
  operands wait for the block's previous call, and the block's next call waits for its results.
  Inside a body the calls chain among themselves; XLA runs a loop's body to its end before the
  next iteration starts.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.interpreters import mlir

from jax_blink.lowering import backends as _backends
from jax_blink.lowering import jax_internals as _jx
from jax_blink.lowering import processes as _distributed

#: The custom-call targets of jax_blink's collectives (every binding, handler and executor).
COLLECTIVE_TARGETS = frozenset({_backends.TARGET, _backends.TARGET_CB, _backends.TARGET_LITE,
                                _backends.TARGET_LITE_CB, _backends.TARGET_MP, _backends.TARGET_IPC})

#: The last jax_blink call (or call-holding loop, cond, nested jit) lowered in each block.
CHAIN = _jx.CallChain()
# The lax primitives that the switch lowers to jax_blink while it is installed (it says so here).
_switched: frozenset = frozenset()


def set_switched(primitives) -> None:
    """The switch's ``install`` / ``uninstall``: which lax primitives now lower to jax_blink calls."""
    global _switched
    _switched = frozenset(primitives)

#: How many values up from a call's operands :func:`_depends_on` looks for the previous call's
#: result before it stops and adds a wait (an explicit call's trace-level wait is a few values up).
_SEARCH_BUDGET = 256

_lock = threading.Lock()
_registered = False


def single(value):
    """The one MLIR value of a rule's result (jax gives some as a 1-tuple); None if several."""
    if isinstance(value, (tuple, list)):
        return value[0] if len(value) == 1 else None
    return value


def chains_on_cpu(ctx) -> bool:
    """Whether this lowering orders jax_blink calls with the CPU executor's jax_blink_after call."""
    return (_jx.lowering_platforms(ctx) == ("cpu",) and _jx.manual_mesh(ctx) is not None
            and _backends.register("cpu"))


def orderable(aval) -> bool:
    """An array the jax_blink_after call can take (non-empty, of a plain dtype)."""
    shape = getattr(aval, "shape", None)
    return (shape is not None and all(isinstance(d, (int, np.integer)) for d in shape)
            and int(np.prod(shape)) > 0 and not jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended))


def wait_token(ctx, deps: list):
    """An int32 scalar that exists only once every value of ``deps`` ([(value, aval), ...]) does."""
    def token(*ds):
        t = jax.numpy.int32(0)
        for d in ds:
            t = _distributed.after(t, d)
        return t

    i32 = _jx.int32_scalar_aval()
    sub = ctx.replace(primitive=None, avals_in=[a for _, a in deps], avals_out=[i32])
    return mlir.lower_fun(token, multiple_results=False)(sub, *(v for v, _ in deps))[0]


def wait(ctx, value, aval, token):
    """``value``, computed only once ``token`` exists (a jax_blink_after call)."""
    sub = ctx.replace(primitive=None, avals_in=[aval, _jx.int32_scalar_aval()], avals_out=[aval])
    return mlir.lower_fun(_distributed.after, multiple_results=False)(sub, value, token)[0]


def join(ctx, args: Sequence, lower: Callable) -> Sequence:
    """Lower ``lower(*args)``, a loop, cond or nested jit holding jax_blink calls, as one link of
    its block's chain: each orderable operand waits for the block's previous call (unless it is
    computed from it already), and the block's next call waits for every orderable result (XLA
    may forward a loop's unchanged carry from its operand: no single result stands for the loop)."""
    last = CHAIN.last(ctx)
    if last:
        prev = [v for v, _ in last]
        waiting = [orderable(aval) and single(a) is a and not _depends_on([a], prev)
                   for a, aval in zip(args, ctx.avals_in)]
        if any(waiting):
            token = wait_token(ctx, last)
            args = [wait(ctx, a, aval, token) if w else a for a, aval, w in zip(args, ctx.avals_in, waiting)]
    outs = lower(*args)
    deps = [(single(o), aval) for o, aval in zip(outs, ctx.avals_out)
            if orderable(aval) and single(o) is not None]
    if deps:
        CHAIN.record(ctx, deps)
    return outs


def holds_jax_blink_call(*jaxprs) -> bool:
    """Whether any of ``jaxprs`` (at any depth) binds a jax_blink collective: an explicit call's
    custom call, or, while the switch is on, a ``lax`` collective that it lowers."""
    switched = _switched

    def is_call(eqn) -> bool:
        return (eqn.primitive in switched or (eqn.primitive is _jx.FFI_CALL_PRIMITIVE
                                             and eqn.params.get("target_name") in COLLECTIVE_TARGETS))

    return any(_jx.holds_equation(j, is_call) for j in jaxprs)


def _depends_on(values, targets) -> bool:
    """Whether every one of ``targets`` (MLIR values) is one of ``values`` or among what they are
    computed from, looking at :data:`_SEARCH_BUDGET` values up at most (False when it gives up:
    the caller then waits). Every one: a loop's results stand for the loop together only (XLA
    may forward an unchanged carry from the loop's operand)."""
    missing = set(targets)
    stack = [v for v in map(single, values) if v is not None]
    seen: set = set()
    while missing and stack and len(seen) < _SEARCH_BUDGET:
        v = stack.pop()
        if v not in seen:
            seen.add(v)
            missing.discard(v)
            stack.extend(_jx.operands_of_definition(v))
    return not missing


def _call_rule(replaced):
    """A jax_blink collective's custom call, after the block's previous call, recorded as the last."""
    def rule(ctx, *args, **params):
        if params.get("target_name") not in COLLECTIVE_TARGETS or not chains_on_cpu(ctx):
            return replaced(ctx, *args, **params)
        last = CHAIN.last(ctx)
        if last and not _depends_on(args, [v for v, _ in last]):
            i = next((k for k, (a, aval) in enumerate(zip(args, ctx.avals_in))
                      if orderable(aval) and single(a) is a), None)
            if i is not None:
                args = list(args)
                args[i] = wait(ctx, args[i], ctx.avals_in[i], wait_token(ctx, last))
        outs = replaced(ctx, *args, **params)
        if single(outs[0]) is not None and orderable(ctx.avals_out[0]):
            CHAIN.record(ctx, [(single(outs[0]), ctx.avals_out[0])])
        return outs

    rule.__name__ = "jax_blink_ordered_ffi_call_lowering"
    return rule


def _joining_rule(replaced, jaxprs_of):
    """``replaced`` (jax's rule of a loop, cond or nested jit), joining the block's chain where the
    equation's jaxprs hold jax_blink calls."""
    def rule(ctx, *args, **params):
        if not (chains_on_cpu(ctx) and holds_jax_blink_call(*jaxprs_of(params))):
            return replaced(ctx, *args, **params)
        return join(ctx, args, lambda *a: replaced(ctx, *a, **params))

    rule.__name__ = "jax_blink_ordered_lowering"
    return rule


def register() -> None:
    """Install the rules above on CPU, each around the rule it replaces (once per process)."""
    global _registered
    with _lock:
        if _registered:
            return
        rules = [(_jx.FFI_CALL_PRIMITIVE, _call_rule),
                 (_jx.WHILE_PRIMITIVE, lambda r: _joining_rule(r, lambda p: (p["cond_jaxpr"], p["body_jaxpr"]))),
                 (_jx.COND_PRIMITIVE, lambda r: _joining_rule(r, lambda p: tuple(p["branches"]))),
                 (_jx.JIT_PRIMITIVE, lambda r: _joining_rule(r, lambda p: (p["jaxpr"],))),
                 (_jx.CALL_PRIMITIVE, lambda r: _joining_rule(r, lambda p: (p["call_jaxpr"],)))]
        for prim, make in rules:
            entry = _jx.registered_rule(prim, "cpu") or _jx.generic_rule(prim)
            mlir.register_lowering(prim, make(_jx.rule_of(entry)), platform="cpu", inline=_jx.inline_of(entry))
        # Lowered in place, each rule sees the block the calls before it were emitted in.
        for prim in _jx.CALL_HOLDING_PRIMITIVES:
            _jx.set_uncacheable(prim, True)
        _registered = True
