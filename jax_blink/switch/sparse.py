"""The switch's row-sparse gradients: an embedding lookup's gradient all-gathered, not summed dense.

The gradient of ``table[tokens]`` (``jnp.take``, an ``nnx.Embed`` / ``flax.linen.Embed`` lookup)
is a scatter-add of the lookup's cotangent rows into a table of zeros: dense in the program, but
only ``tokens.size`` rows of it are not zero. Summed over ``n`` devices by ``psum``, it moves the
whole table; gathered, each device receives the ``n`` devices' indices and rows and scatters them
itself, as Horovod treats TensorFlow's ``IndexedSlices``. For GPT-2 small on 4 GPUs that is 48 MiB
gathered instead of 147 MiB summed. And the gradient comes last in the backward pass: where the
embedding is tied (the output layer reuses the table, as GPT-2's does), the output layer's part
of the same gradient exists at the start of the backward pass. Split, ``psum(dense + scatter)``
becomes ``psum(dense) + scatter(all_gather(tokens), all_gather(rows))``: the dense part's
all-reduce starts early and runs beside the backward pass (:mod:`jax_blink.switch.overlap`), and
what is left at the step's end is the gather.

:func:`split_row_sparse` finds, in a ``shard_map`` body, the all-reduces (``psum`` /
``psum_invariant`` of one operand, or of a bucket the program concatenated from reshaped leaves)
of which a leaf is such a scatter, or a sum with one, and rewrites each into: one all-reduce of
the other leaves, packed as the program packed them (re-packing them per leaf, the first form
measured, added starts at the end of the backward pass and ended it later); one of each such
leaf's dense part; the gathers and scatters; and the slices, sums and concatenation that give the
original result.
It is used only together with the overlap, where ``jax_blink.config.switch_sparse_gradients`` is
set (off by default: on GPT-2 small the step was level on 4 x H200 and 0.9% slower on 2, because
the dense part, run beside the start of the backward pass, delays the buckets behind it; NOTES,
change 28); with nothing overlapped the dense part would still be summed whole. :func:`gather_after_wait` then
ties the gathers behind the overlap's wait: a synchronous collective must not run while started
kernels still hold SMs (docs/overlap.md, "Hazard: mixing").

What counts as the scatter: ``scatter-add`` of a ``broadcast_in_dim`` of the literal 0, in the
body or alone (with that broadcast and a ``pvary``) in a nested ``jit``; its indices' first
dimension is a scatter dimension of the updates (no window, no batching dimensions), so gathering
indices and updates along it keeps each row with its index; the gathered bytes are at most half
the table's. Indices out of range stay out of range (the scatter's mode drops or clips them as
before). Floating-point sums come out in another order than ``psum``'s of the dense sum: equal up
to rounding, not bit for bit (integer sums are equal).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jax_blink.lowering import jax_internals as _jx
from jax_blink.switch import merge as _merge

#: How many times smaller than the dense table the gathered indices and rows must be.
MIN_SAVING = 2


@dataclasses.dataclass(frozen=True)
class _Scatter:
    """A scatter-add into zeros: its indices and updates (as the body names them), and the
    equations to build its copy on gathered operands."""

    indices: object
    updates: object
    zeros: object    # the broadcast_in_dim equation of the zeros
    scatter: object  # the scatter-add equation


@dataclasses.dataclass(frozen=True)
class Split:
    """What :func:`split_row_sparse` did.

    Attributes:
        jaxpr: The body, rewritten or the same object.
        gradients: How many row-sparse leaves are now gathered.
        gathered: The variables the gathers make (to tie them behind the wait).
    """

    jaxpr: object
    gradients: int
    gathered: frozenset


def _is_zeros(eqn) -> bool:
    return (eqn.primitive.name == "broadcast_in_dim" and len(eqn.invars) == 1
            and not _jx.is_var(eqn.invars[0]) and np.all(np.asarray(_jx.literal_value(eqn.invars[0])) == 0))


def _gatherable(scatter) -> bool:
    """Whether gathering a scatter-add's indices and updates along their first dimension keeps
    each row with its index: that dimension is a scatter (not window, not batching) dimension."""
    dn = scatter.params.get("dimension_numbers")
    idx, upd = scatter.invars[1].aval, scatter.invars[2].aval
    if dn is None or len(idx.shape) < 2 or not upd.shape or idx.shape[0] != upd.shape[0]:
        return False
    if 0 in tuple(dn.update_window_dims):
        return False
    return not tuple(getattr(dn, "operand_batching_dims", ())) and not tuple(getattr(dn, "scatter_indices_batching_dims", ()))


def _scatter_into_zeros(eqns, made_by, i) -> _Scatter | None:
    """The scatter-add into zeros that equation ``i`` makes (in the body, or as the whole of a
    nested jit), or None."""
    eqn = eqns[i]
    if eqn.primitive.name == "scatter-add":
        zeros_at = made_by.get(eqn.invars[0]) if _jx.is_var(eqn.invars[0]) else None
        zeros = eqns[zeros_at] if zeros_at is not None else None
        if zeros is not None and zeros.primitive.name == "pvary":  # made varying, as jax's transpose does
            zeros_at = made_by.get(zeros.invars[0]) if _jx.is_var(zeros.invars[0]) else None
            zeros = eqns[zeros_at] if zeros_at is not None else None
        if zeros is None or not _is_zeros(zeros) or not _gatherable(eqn):
            return None
        return _Scatter(eqn.invars[1], eqn.invars[2], zeros, eqn)
    inner = _jx.inlined_call_jaxpr(eqn)
    if inner is None:
        return None
    body = getattr(inner, "jaxpr", inner)
    if getattr(inner, "consts", ()) or body.constvars or len(body.outvars) != 1 or len(eqn.invars) != len(body.invars):
        return None
    names = [e.primitive.name for e in body.eqns]
    if names not in (["broadcast_in_dim", "scatter-add"], ["broadcast_in_dim", "pvary", "scatter-add"]):
        return None
    zeros, scatter = body.eqns[0], body.eqns[-1]
    if not _is_zeros(zeros) or scatter.outvars[0] is not body.outvars[0] or not _gatherable(scatter):
        return None
    chain = body.eqns[1].outvars[0] if len(body.eqns) == 3 else zeros.outvars[0]
    if scatter.invars[0] is not chain or len(body.eqns) == 3 and body.eqns[1].invars[0] is not zeros.outvars[0]:
        return None
    outer = dict(zip(body.invars, eqn.invars))
    idx, upd = scatter.invars[1], scatter.invars[2]
    if idx not in outer or upd not in outer:
        return None
    return _Scatter(outer[idx], outer[upd], zeros, scatter)


@dataclasses.dataclass
class _Part:
    """One leaf of an all-reduce's operand: the variable the operand holds (``part``), the reshape
    that made it from the leaf (or None), the row-sparse term and the dense rest of the leaf."""

    part: object
    reshape: object = None
    sparse: _Scatter | None = None
    dense: object = None
    removed: tuple = ()


def split_row_sparse(jaxpr, axis_sizes: dict, all_reduces: dict) -> Split:
    """``jaxpr`` (a shard_map body) with each all-reduce in ``all_reduces`` (primitive -> the
    switch's name: ``psum``, ``psum_invariant``) whose operand holds a row-sparse leaf rewritten
    as the module says; ``axis_sizes``: the mesh's axis sizes by name."""
    eqns = list(jaxpr.eqns)
    made_by = _jx.producers(eqns)
    readers = _jx.readers(eqns)
    returned = [v for v in jaxpr.outvars if _jx.is_var(v)]

    def only_read_once(v) -> bool:  # by one equation, or returned once and read by none
        return len(readers.get(v, ())) + returned.count(v) == 1

    replaced: dict[int, list] = {}
    removed: set[int] = set()
    gathered: set = set()
    count = 0
    for p, eqn in enumerate(eqns):
        name = all_reduces.get(eqn.primitive)
        if name is None or len(eqn.invars) != 1 or not _jx.is_var(eqn.invars[0]) or eqn.params.get("axis_index_groups"):
            continue
        axes = eqn.params["axes"]
        axes = axes if isinstance(axes, (tuple, list)) else (axes,)
        if any(a not in axis_sizes for a in axes):
            continue
        n = int(np.prod([axis_sizes[a] for a in axes]))
        parts = _parts(eqns, made_by, eqn.invars[0], only_read_once)
        found = [_sparse_leaf(eqns, made_by, part, only_read_once, n) for part in parts]
        if not any(f.sparse for f in found):
            continue
        replaced[p], made = _rewrite(eqns, eqn, found, name, axes, n, made_by)
        gathered |= made
        count += sum(1 for f in found if f.sparse)
        for f in found:
            removed.update(f.removed)
        if len(parts) > 1:
            removed.add(made_by[eqn.invars[0]])
    if not count:
        return Split(jaxpr, 0, frozenset())
    out = []
    for i, e in enumerate(eqns):
        if i in replaced:
            out += replaced[i]
        elif i not in removed:
            out.append(e)
    return Split(_jx.replace_eqns(jaxpr, out), count, frozenset(gathered))


def _parts(eqns, made_by, operand, only_read_once) -> list[_Part]:
    """The leaves of an all-reduce's operand: each operand of the concatenation that made it (read
    by that all-reduce alone), or the operand itself."""
    at = made_by.get(operand)
    cat = eqns[at] if at is not None else None
    if (cat is None or cat.primitive.name != "concatenate" or cat.params.get("dimension") != 0
            or not only_read_once(operand) or not all(_jx.is_var(v) for v in cat.invars)):
        return [_Part(operand)]
    return [_Part(v) for v in cat.invars]


def _sparse_leaf(eqns, made_by, part: _Part, only_read_once, n: int) -> _Part:
    """``part`` with its row-sparse term and dense rest where it has them."""
    leaf, reshape, chain = part.part, None, []
    at = made_by.get(leaf)
    if at is not None and eqns[at].primitive.name == "reshape" and only_read_once(leaf) and _jx.is_var(eqns[at].invars[0]):
        reshape, chain = eqns[at], [at]
        leaf = reshape.invars[0]
    at = made_by.get(leaf)
    if at is None or not only_read_once(leaf):
        return part
    dense, term_at, term = None, at, None
    if eqns[at].primitive.name == "add_any":
        for k, other in ((0, 1), (1, 0)):
            v = eqns[at].invars[k]
            if _jx.is_var(v) and v in made_by and only_read_once(v):
                term = _scatter_into_zeros(eqns, made_by, made_by[v])
                if term is not None:
                    term_at, dense = made_by[v], eqns[at].invars[other]
                    chain.append(at)
                    break
    else:
        term = _scatter_into_zeros(eqns, made_by, at)
    if term is None:
        return part
    sizes = [_merge.operand_bytes(v.aval) for v in (term.indices, term.updates, term.scatter.outvars[0])]
    if None in sizes or n * (sizes[0] + sizes[1]) * MIN_SAVING > sizes[2]:  # symbolic, or too many rows
        return part
    return _Part(part.part, reshape, term, dense, (*chain, term_at))


def _rewrite(eqns, psum, parts: list[_Part], name: str, axes: tuple, n: int, made_by):
    """The equations in place of ``psum``: one all-reduce of the other leaves (packed as before), one
    of each row-sparse leaf's dense rest, the gathers and scatters of the row-sparse terms, their
    sums and the concatenation; and the gathers' results."""
    out, gathered = [], set()
    like = psum
    result_aval = psum.outvars[0].aval  # every new value is as invariant as the all-reduce's result

    def emit(prim, params, invars, aval, effects=frozenset()):
        var = _jx.new_var(aval)
        out.append(_jx.new_eqn(list(invars), [var], prim, params, set(effects), like))
        return var

    gather_prim = _jx.PRIMITIVES["all_gather_invariant" if name == "psum_invariant" else "all_gather"]
    results = [None] * len(parts)
    # The other leaves stay one all-reduce, as the program packed them (the overlap starts it when
    # the last of them exists); its result is cut back into the leaves' places.
    plain = [k for k, part in enumerate(parts) if part.sparse is None]
    cat = eqns[made_by[psum.invars[0]]] if len(parts) > 1 else None  # the program's concatenation
    if plain:
        sizes = [int(np.prod(parts[k].part.aval.shape, dtype=np.int64)) for k in plain]
        operand = parts[plain[0]].part
        if len(plain) > 1:
            operand = emit(cat.primitive, cat.params, [parts[k].part for k in plain],
                           psum.invars[0].aval.update(shape=(sum(sizes),)), cat.effects)
        summed = emit(psum.primitive, psum.params, [operand], result_aval.update(shape=operand.aval.shape),
                      psum.effects)
        if len(plain) == 1:
            results[plain[0]] = summed
        else:
            at = 0
            for k, size in zip(plain, sizes):
                results[k] = emit(_jx.SLICE, {"start_indices": (at,), "limit_indices": (at + size,), "strides": None},
                                  [summed], result_aval.update(shape=(size,)))
                at += size
    for k, part in enumerate(parts):
        if part.sparse is None:
            continue
        dense = None
        if part.dense is not None:
            dense = part.dense
            if part.reshape is not None:
                dense = emit(part.reshape.primitive, part.reshape.params, [dense],
                             part.dense.aval.update(shape=part.part.aval.shape), part.reshape.effects)
            dense = emit(psum.primitive, psum.params, [dense], result_aval.update(shape=part.part.aval.shape),
                         psum.effects)
        term = part.sparse
        params = {"all_gather_dimension": 0, "axis_name": tuple(axes), "axis_size": n, "tiled": True}
        if name != "psum_invariant":
            params["axis_index_groups"] = None
        moved = []
        for v in (term.indices, term.updates):
            shape = (v.aval.shape[0] * n, *v.aval.shape[1:])
            g = emit(gather_prim, params, [v], result_aval.update(shape=shape, dtype=v.aval.dtype), psum.effects)
            gathered.add(g)
            moved.append(g)
        table = term.scatter.outvars[0].aval
        zeros = emit(term.zeros.primitive, term.zeros.params, term.zeros.invars,
                     result_aval.update(shape=table.shape, dtype=table.dtype))
        summed = emit(term.scatter.primitive, term.scatter.params, [zeros, *moved],
                      result_aval.update(shape=table.shape, dtype=table.dtype))
        if part.reshape is not None:
            summed = emit(part.reshape.primitive, part.reshape.params, [summed],
                          result_aval.update(shape=part.part.aval.shape))
        if dense is not None:
            summed = emit(_jx.ADD_ANY, {}, [dense, summed],
                          result_aval.update(shape=part.part.aval.shape))
        results[k] = summed
    if len(parts) == 1:
        last = out[-1]
        out[-1] = last.replace(outvars=[psum.outvars[0]])
    else:
        out.append(_jx.new_eqn(results, [psum.outvars[0]], cat.primitive, cat.params, set(cat.effects), like))
    return out, gathered


def gather_after_wait(jaxpr, gathered: frozenset, done):
    """``jaxpr`` with the operands of the gathers that make ``gathered`` passed, with one result of
    each bucket that a ``done`` equation waits for (each bucket's wait is a call of its own in the
    lowering), through one ``optimization_barrier`` just before the first gather: XLA then runs
    the gathers only after every started all-reduce has ended. None where a gather comes before a
    wait (the body is then not the one :func:`split_row_sparse` and the overlap made)."""
    eqns = list(jaxpr.eqns)
    waits = [i for i, e in enumerate(eqns) if e.primitive is done]
    gathers = [i for i, e in enumerate(eqns) if any(v in gathered for v in e.outvars)]
    if not waits or not gathers or gathers[0] < waits[-1]:
        return None
    first = gathers[0]
    operands = list(dict.fromkeys(v for i in gathers for v in eqns[i].invars if _jx.is_var(v)))
    tokens = []
    for w in waits:  # the first result of each bucket: the done's results are the buckets' in order
        at = 0
        for count in eqns[w].params["buckets"]:
            tokens.append(eqns[w].outvars[at])
            at += count
    passed = [_jx.new_var(v.aval) for v in operands]
    barrier = _jx.new_eqn([*operands, *tokens], [*passed, *(_jx.new_var(t.aval) for t in tokens)],
                          _jx.OPTIMIZATION_BARRIER, {}, set(), eqns[first])
    rename = dict(zip(operands, passed))
    out = eqns[:first] + [barrier]
    for i in range(first, len(eqns)):
        e = eqns[i]
        out.append(e.replace(invars=[rename.get(v, v) if _jx.is_var(v) else v for v in e.invars]) if i in gathers else e)
    return _jx.replace_eqns(jaxpr, out)


__all__ = ["MIN_SAVING", "Split", "gather_after_wait", "split_row_sparse"]
