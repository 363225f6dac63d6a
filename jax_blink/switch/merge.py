"""One equation for a run of all-reduces: how the switch sends ``lax.psum(tree)`` as one call per dtype.

``lax.psum`` / ``pmax`` / ``pmin`` of a pytree bind one primitive per leaf: the body of a
``shard_map`` holds adjacent equations ``psum[axes=...] a``, ``psum[axes=...] b``, ... each of
which the switch would lower to a jax_blink call of its own. On a model of hundreds of small
leaves the per-call cost then dominates. Before jax lowers a shard_map body, the switch
(:mod:`jax_blink.switch`) replaces each run of such equations by one equation of
:data:`merged_all_reduce_p`, whose lowering rule concatenates the operands of one dtype, reduces
them by one call, and splits the result back (``switch._merged_rule``).

What counts as a run: adjacent equations of one primitive (``psum``, ``psum_invariant``, ``pmax``
or ``pmin``) with equal parameters (axes, ``axis_index_groups``), over named axes only (a
vmap-positional axis is reduced locally first: those stay one call each), none of which reads
another's result. Only adjacent equations are merged: the program's order of computation and
collectives is left as it was written (jax's transposes that place one psum per leaf between the
backward pass's computations keep them there). Runs are looked for in the shard_map body itself,
not inside nested ``jit``, ``scan``, ``while`` or ``cond`` bodies.

The rewrite happens at lowering time, after tracing, AD and vmap: the new equation's results are
the replaced equations' own variables, so result types are unchanged.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from jax.extend.core import Primitive

from jax_blink.lowering import jax_internals as _jx

#: The primitives whose runs are merged, by the switch's name for them.
MERGEABLE = {name: _jx.PRIMITIVES[name] for name in ("psum", "psum_invariant", "pmax", "pmin")}
_NAME_OF = {prim: name for name, prim in MERGEABLE.items()}

#: ``merged_all_reduce(*operands, name=, params=)``: the all-reduces ``name`` with ``params`` (a
#: tuple of (key, value) items) of several operands; exists only in jaxprs that the switch lowers.
merged_all_reduce_p = Primitive("jax_blink_merged_all_reduce")
merged_all_reduce_p.multiple_results = True


def _never_evaluated(*args, **params):
    raise NotImplementedError("jax_blink_merged_all_reduce exists only while the switch lowers a "
                              "program; it is never evaluated or traced")


merged_all_reduce_p.def_impl(_never_evaluated)
merged_all_reduce_p.def_abstract_eval(_never_evaluated)


def all_reduce_key(eqn):
    """What equations of one run share: (the switch's name for the primitive, its parameters as
    sorted items); None where the equation cannot join a run."""
    name = _NAME_OF.get(eqn.primitive)
    if name is None or len(eqn.invars) != 1:
        return None
    axes = eqn.params["axes"]
    if any(isinstance(a, int) for a in (axes if isinstance(axes, (tuple, list)) else (axes,))):
        return None
    try:
        params = tuple(sorted(eqn.params.items()))
        hash(params)
    except TypeError:  # an unhashable parameter: leave the equation as it is
        return None
    return name, params


def merge_all_reduces(jaxpr):
    """``jaxpr`` (a core.Jaxpr) with each run of two or more adjacent, independent all-reduce
    equations of equal parameters replaced by one :data:`merged_all_reduce_p` equation; the same
    object when there is none."""
    out, run, run_key, run_outs = [], [], None, set()
    changed = False

    def flush():
        nonlocal changed
        if len(run) >= 2:
            name, params = run_key
            effects = set().union(*(e.effects for e in run))
            out.append(_jx.new_eqn([e.invars[0] for e in run], [e.outvars[0] for e in run],
                                   merged_all_reduce_p, {"name": name, "params": params},
                                   effects, run[0]))
            changed = True
        else:
            out.extend(run)

    for eqn in jaxpr.eqns:
        key = all_reduce_key(eqn)
        reads_run = any(_jx.is_var(v) and v in run_outs for v in eqn.invars)
        if key is not None and key == run_key and not reads_run:
            run.append(eqn)
            run_outs.update(eqn.outvars)
            continue
        flush()
        run, run_key, run_outs = ([eqn], key, set(eqn.outvars)) if key is not None else ([], None, set())
        if key is None:
            out.append(eqn)
    flush()
    return _jx.replace_eqns(jaxpr, out) if changed else jaxpr


def operand_bytes(aval) -> int | None:
    """An operand's bytes per rank; None for a shape with symbolic dimensions."""
    if not all(isinstance(d, (int, np.integer)) for d in aval.shape):
        return None
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def merge_groups(avals, cap_bytes: int) -> list[list[int]]:
    """The operands (indices into ``avals``) that go in one call each, in the order of their first
    operand: operands of one dtype (and one set of varying axes, which a concatenation needs) in
    order, a new group where the next would take a group past ``cap_bytes`` (an operand larger than
    the cap is a group of its own; operands are never split). Empty operands and shapes with
    symbolic dimensions are groups of one (the switch's own rule says why they stay XLA's)."""
    groups: list[list[int]] = []
    open_group: dict[tuple, tuple[list[int], int]] = {}  # key -> (group being filled, its bytes)
    for i, aval in enumerate(avals):
        nbytes = operand_bytes(aval)
        if not nbytes:  # symbolic or empty
            groups.append([i])
            continue
        key = (np.dtype(aval.dtype), frozenset(getattr(aval, "vma", ()) or ()))
        group, filled = open_group.get(key, (None, 0))
        if group is None or filled + nbytes > cap_bytes:
            group, filled = [], 0
            groups.append(group)
        group.append(i)
        open_group[key] = (group, filled + nbytes)
    return groups


def consecutive_groups(items: Sequence, k: int) -> list[list]:
    """``items`` in at most ``k`` groups of consecutive items, as even in count as can be: one per
    item where there are fewer than ``k``, none empty (no group for no items). How a last bucket
    is cut into calls (``config.switch_last_bucket_pieces``, ``BucketLayout.of(last_bucket_pieces=)``)."""
    k = max(1, min(k, len(items)))
    bounds = [len(items) * i // k for i in range(k + 1)]
    return [list(items[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]


__all__ = ["MERGEABLE", "all_reduce_key", "consecutive_groups", "merge_all_reduces", "merge_groups",
           "merged_all_reduce_p", "operand_bytes"]
