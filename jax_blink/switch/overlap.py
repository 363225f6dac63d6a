"""The switch's overlap: a program's gradient all-reduces started inside its backward pass.

An unedited data-parallel step sums its gradients either with ``lax.psum(grads)`` after
``jax.grad`` (one equation per leaf, or one per bucket the program packed itself, after the whole
backward pass) or through the transposes that ``jax.grad`` places itself (``psum_invariant`` of
each leaf of parameters made varying, where that gradient is made). Lowered one by one, each runs
where it stands and, on a GPU, on XLA's compute stream: nothing overlaps. Before jax lowers a
``shard_map`` body, :func:`overlap_all_reduces` rewrites it the way
:func:`jax_blink.value_and_grad_overlapped` builds a step by hand:

* **Which all-reduces**: ``psum`` / ``psum_invariant`` of one variable over named axes that are in
  flight together across one point of the body (their operands exist before it, nothing reads
  their results until after it), the point with the most bytes in flight: the gradients. One read
  at once (an activation's all-reduce in the forward pass) or made after the update (a loss
  averaged for logging) stays where it is.
* **Hoisting**: the packing equations whose results only feed those all-reduces (a bucket's
  reshapes and concatenation, a transpose) move up to where their operands exist; the backward
  pass's compute keeps the program's order.
* **Buckets**: the chosen all-reduces, in the order their operands become ready, packed per kind,
  dtype and varying axes into buckets of at most ``merge_bytes`` (DDP's 25 MiB), each a
  :data:`start_p` equation right after the step that completes it. Every start but the first also
  passes the values made since the previous start through itself (an ``optimization_barrier`` in
  its lowering): XLA can then neither run the rest of the backward pass before the start nor sink
  the start to the end (docs/overlap.md says why both happened without it). With
  ``hold="weights"`` (``jax_blink.config.switch_hold``) it passes the body's weights instead: the
  inputs (or their ``pvary``) that only matrix products and convolutions read, which are buffers
  already; with ``hold="none"``, nothing (XLA then places the starts itself). Any hold orders the
  bucket's producers before the rest of the pass, which splits XLA's fusions that join them
  (``benchmarks/NOTES.md``, change 33).
* **Waits**: one :data:`done_p` equation right after the last start takes every bucket (and the last
  start's operand as its token) and gives the original all-reduces' results; what reads one of
  them before the last start (another all-reduce of it) moves to just after the wait. With
  ``jax_blink.config.switch_late_last_wait`` (off by default: measured slower on GPUs) the last
  bucket gets a wait of its own, tied behind everything that does not read its results (the
  optimizer's update of the other buckets' parameters), which then runs beside its kernel.

The lowering of both (``jax_blink.switch.rules``) decides per bucket, as for any call: the executor's
start on a side stream (GPU, one process), the synchronous call (CPU, several processes: the same
bits as the program unrewritten), or XLA's own all-reduce (the dispatch table's ``lax`` sizes).

Left as written, and said so in :func:`overlap_all_reduces`' reason: a body with another
collective between the first start and the last (a synchronous jax_blink call there could wait
for SMs that a peer's started kernel holds), or with nothing to overlap (no matrix product,
convolution or nested call between the first bucket's start and the last's).
Only the body's own equations are looked at: a nested ``jit``, ``scan`` or ``remat`` runs whole.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools

import numpy as np
from jax.extend.core import Primitive

from jax_blink.lowering import jax_internals as _jx
from jax_blink.switch import merge as _merge

#: The all-reduces the rewrite may start early, by the switch's name for them.
OVERLAPPABLE = {name: _jx.PRIMITIVES[name] for name in ("psum", "psum_invariant")}
#: The same, by primitive.
OVERLAPPABLE_PRIMITIVES = {prim: name for name, prim in OVERLAPPABLE.items()}

#: ``start(*operands, *held, bucket=, name=, params=, count=, last=)`` -> ``(result, passed,
#: *held)``: one bucket's all-reduce of ``count`` operands (flat, concatenated) started, and the
#: values ``held`` passed through with it. Exists only in jaxprs that the switch lowers.
start_p = Primitive("jax_blink_overlap_start")
start_p.multiple_results = True
#: ``done(result_1, passed_1, ..., result_B, passed_B, token, *after, ids=, buckets=, after=)`` ->
#: the waited buckets' all-reduces' results, in bucket order (``ids``: the starts' ``bucket``
#: parameters, ``buckets``: how many results each holds, ``after``: how many values the wait is
#: tied behind besides the token).
done_p = Primitive("jax_blink_overlap_done")
done_p.multiple_results = True

_bucket_ids = itertools.count()

#: The equations that a weight held with ``hold="weights"`` may be read by, anywhere in the
#: program: matrix products and convolutions, and the reversal and transposition that feed them
#: a weight (jax's transpose of a convolution reverses its kernel).
WEIGHT_READERS = frozenset({"dot_general", "conv_general_dilated", "rev", "transpose"})


def read_as_weight(readers: set) -> bool:
    """Whether a value whose readers are the primitives named ``readers`` is a weight: something
    reads it and every reader is one of :data:`WEIGHT_READERS` (the one rule of
    ``hold="weights"``, for the switch's jaxpr and the explicit API's flat program alike)."""
    return bool(readers) and readers <= WEIGHT_READERS


#: What the starts may hold back.
HOLDS = ("recent", "weights", "none")
#: Equations that hand a body's input on unchanged (a parameter made varying for its gradient).
_PASS_ON = frozenset({"pvary", "pcast"})


def _never_evaluated(*args, **params):
    raise NotImplementedError("jax_blink's overlapped all-reduce exists only while the switch lowers a "
                              "program; it is never evaluated or traced")


for _p in (start_p, done_p):
    _p.def_impl(_never_evaluated)
    _p.def_abstract_eval(_never_evaluated)


@dataclasses.dataclass(frozen=True)
class Rewrite:
    """What :func:`overlap_all_reduces` did with one body.

    Attributes:
        jaxpr: The body, rewritten or the same object.
        buckets: How many starts it holds (0: left as written).
        operands: How many all-reduce equations the starts cover.
        reason: Why it was left as written, or what was done.
        blocked: Gradients could have started early, but another collective stood between them.
    """

    jaxpr: object
    buckets: int
    operands: int
    reason: str
    blocked: bool = False


def _key(eqn):
    """(name, parameters) of an all-reduce that may start early; None for any other equation."""
    name = OVERLAPPABLE_PRIMITIVES.get(eqn.primitive)
    if name is None or len(eqn.invars) != 1 or not _jx.is_var(eqn.invars[0]):
        return None
    if _merge.operand_bytes(eqn.invars[0].aval) is None:  # symbolic dimensions: left to XLA
        return None
    key = _merge.all_reduce_key(eqn)
    return key if key is not None and key[0] == name else None


def _holds_collective(eqn) -> bool:
    """Whether an equation is, or holds at any depth, a collective the switch lowers."""
    return eqn.primitive in _jx.PRIMITIVES.values() or any(map(_jx.holds_collective, _jx.nested_jaxprs(eqn)))


def _is_heavy(eqn) -> bool:
    """Whether an equation is compute worth running beside a collective: a matrix product, a
    convolution, or a nested call (a jit, a remat, a loop)."""
    return (eqn.primitive.name in ("dot_general", "conv_general_dilated", "ragged_dot")
            or bool(_jx.nested_jaxprs(eqn)))


def overlap_all_reduces(jaxpr, cap_bytes: int, late_last_wait: bool = False,
                        last_bucket_pieces: int = 1, hold: str = "recent") -> Rewrite:
    """``jaxpr`` (a shard_map body, a core.Jaxpr) with its gradient all-reduces started early (the
    module's docstring); ``cap_bytes``: most bytes per rank in one bucket (0, merging turned off:
    one all-reduce per bucket); ``late_last_wait``:
    wait for the last bucket only after everything that does not read it (:func:`_late_wait`);
    ``last_bucket_pieces``: the last bucket to be ready cut into that many buckets of consecutive
    all-reduces, in readiness order (at most one per all-reduce); ``hold``: what each start holds
    back, of :data:`HOLDS` (the module's docstring)."""
    if hold not in HOLDS:
        raise ValueError(f"overlap_all_reduces: hold must be one of {HOLDS}, got {hold!r}")
    eqns = list(jaxpr.eqns)
    n = len(eqns)
    made_by = _jx.producers(eqns)
    readers = collections.defaultdict(list, _jx.readers(eqns))
    returned = {v for v in jaxpr.outvars if _jx.is_var(v)}

    candidates = {i for i, e in enumerate(eqns) if _key(e) is not None}
    if not candidates:
        return Rewrite(jaxpr, 0, 0, "no psum to start early")

    def first_read(v) -> int:  # another all-reduce of it can wait until after the wait (deferred)
        return min((r for r in readers[v] if r not in candidates), default=n)

    summed = {eqns[i].outvars[0] for i in candidates}  # a feeder never reads these: they come late
    chosen = candidates
    for _ in range(4):  # the choice moves the feeders, which move the readiness: until it settles
        feeders = _feeders(eqns, chosen, readers, returned, summed)
        ready = _readiness(eqns, chosen | feeders, made_by, summed)
        again = _in_flight(candidates, ready, lambda i: first_read(eqns[i].outvars[0]), eqns)
        if again == chosen:
            break
        chosen = again
    last = max((ready[i] for i in chosen), default=-1)
    if not chosen or any(first_read(eqns[i].outvars[0]) <= last for i in chosen):
        return Rewrite(jaxpr, 0, 0, "every psum's result is read before the others could start")
    # What reads a chosen result before the last start (another all-reduce of it, and what that
    # makes) moves to just after the wait.
    deferred = _readers_of(eqns, {eqns[i].outvars[0] for i in chosen}, chosen | feeders, made_by)
    early = {i for i in deferred if i <= last}
    if any(eqns[i].effects for i in early):
        return Rewrite(jaxpr, 0, 0, "an equation with effects reads a summed value before the last start")
    first = min(ready[i] for i in chosen)
    window = [i for i in range(n)
              if i not in chosen and i not in early and (i in feeders or first < i <= last)]
    blocking = [eqns[i].primitive.name for i in window if _holds_collective(eqns[i])]
    if blocking:
        return Rewrite(jaxpr, 0, 0, f"another collective ({blocking[0]}) would run between the starts",
                       blocked=True)

    buckets = _by_readiness(_buckets(eqns, sorted(chosen, key=lambda i: (ready[i], i)), cap_bytes), ready)
    if last_bucket_pieces > 1:  # one call holding the last bucket whole splits XLA's fusions (change 32)
        buckets = _by_readiness(buckets[:-1] + _merge.consecutive_groups(buckets[-1], last_bucket_pieces), ready)
    bucket_ready = [max(ready[i] for i in b) for b in buckets]
    if not any(bucket_ready[0] < i <= last and i not in feeders and i not in early and _is_heavy(eqns[i])
               for i in range(n)):
        return Rewrite(jaxpr, 0, 0, "nothing to overlap: no matrix product, convolution or nested call "
                                    "between the first bucket's start and the last's")
    # The new order: each item (sort key, kind, payload); kinds: 0 an equation in place, 1 a hoisted
    # feeder, 2 a start, 3 the done, 4 a deferred reader of a sum. A feeder's key is the step after
    # which its operands exist.
    items = [((last, 4, i) if i in early else (i, 0, i), "eqn", i)
             for i in range(n) if i not in chosen and i not in feeders]
    items += [((ready[i], 1, i), "eqn", i) for i in feeders]
    items += [((r, 2, b), "start", b) for b, r in enumerate(bucket_ready)]
    late = _late_wait(eqns, jaxpr, chosen, feeders, buckets, last, made_by) if late_last_wait else None
    if late is None:
        items.append(((last, 3, 0), "done", (tuple(range(len(buckets))), ())))
    else:
        dependent, after = late
        items = [((n + 1 + i, 0, i), k, i) if k == "eqn" and i in dependent else (t, k, i)
                 for t, k, i in items]
        items.append(((last, 3, 0), "done", (tuple(range(len(buckets) - 1)), ())))
        items.append(((n, 4, 0), "done", ((len(buckets) - 1,), tuple(after))))
    items.sort(key=lambda t: t[0])
    rewritten = _emit(jaxpr, eqns, items, buckets, hold)
    unbound = _first_unbound(rewritten)
    if unbound is not None:  # a safety net: a program the rewrite got wrong is left as written
        return Rewrite(jaxpr, 0, 0, f"left as written: the rewrite would read {unbound} before making it")
    return Rewrite(rewritten, len(buckets), len(chosen),
                   f"{len(chosen)} psums in {len(buckets)} buckets started as their operands became ready")


def _readers_of(eqns, values, skip, made_by) -> set[int]:
    """The equations (but ``skip``) that read one of ``values``, or what such an equation makes."""
    found: set[int] = set()
    for i, e in enumerate(eqns):
        if i not in skip and any(_jx.is_var(v) and (v in values or made_by.get(v) in found) for v in e.invars):
            found.add(i)
    return found


def _late_wait(eqns, jaxpr, chosen, feeders, buckets, last, made_by):
    """Where the last bucket's wait goes when it comes late: after every equation that does not
    read its results (the optimizer's update of the other buckets' parameters), which then runs
    beside the last bucket's kernel; the equations that read them, and what they make, after it.
    Returns (the equations that must wait, the values the wait is tied behind), or None where
    there is nothing to run beside it or an equation with effects would change places."""
    if len(buckets) < 2:
        return None
    dependent = _readers_of(eqns, {eqns[i].outvars[0] for i in buckets[-1]}, chosen | feeders, made_by)
    independent = [i for i in range(last + 1, len(eqns))
                   if i not in chosen and i not in feeders and i not in dependent]
    if not independent or any(eqns[i].effects for i in range(last + 1, len(eqns)) if i not in chosen):
        return None
    readers_of_dependent = {v for i in dependent for v in eqns[i].invars if _jx.is_var(v)}
    returned = {v for v in jaxpr.outvars if _jx.is_var(v)}
    after = [v for i in independent for v in eqns[i].outvars
             if (v in readers_of_dependent or v in returned) and _jx.is_plain_array(v.aval)]
    return (dependent, after) if after else None


def _first_unbound(jaxpr):
    """The first variable that ``jaxpr`` reads before any equation (or input) makes it; None."""
    bound = {*jaxpr.invars, *jaxpr.constvars}
    for e in jaxpr.eqns:
        for v in e.invars:
            if _jx.is_var(v) and v not in bound:
                return v
        bound.update(e.outvars)
    return next((v for v in jaxpr.outvars if _jx.is_var(v) and v not in bound), None)


#: Equations that only move bytes (a bucket's packing): hoisted with the all-reduce they feed. The
#: backward pass's compute stays where it is, in the program's order.
_PACKING = frozenset({"reshape", "concatenate", "convert_element_type", "squeeze", "expand_dims",
                      "broadcast_in_dim", "transpose", "slice", "copy", "copy_p", "pvary"})


def _in_flight(candidates, ready, first_read, eqns) -> set[int]:
    """The all-reduces to start early: those in flight across one point of the body (ready at or
    before it, first read after it), the point that puts the most bytes in flight. A forward pass's
    all-reduce, read at once, is in flight across no point of the backward pass; a trailing one
    (a loss averaged after the update) across no point before it."""
    best, best_bytes = set(), 0
    for t in sorted({ready[i] for i in candidates}):
        across = {i for i in candidates if ready[i] <= t < first_read(i)}
        size = sum(_merge.operand_bytes(eqns[i].invars[0].aval) for i in across)
        if (size, len(across)) > (best_bytes, len(best)):
            best, best_bytes = across, size
    return best


def _feeders(eqns, chosen, readers, returned, summed) -> set[int]:
    """The packing equations whose every result is read only by chosen all-reduces or other
    feeders, and which read no all-reduce's result (one pass from the end: readers come after the
    equations they read)."""
    feeders: set[int] = set()
    for j in range(len(eqns) - 1, -1, -1):
        e = eqns[j]
        if j in chosen or e.effects or not e.outvars or e.primitive.name not in _PACKING:
            continue
        if any(_jx.is_var(v) and v in summed for v in e.invars):
            continue
        outs = e.outvars
        if any(v in returned for v in outs):
            continue
        reads = [r for v in outs for r in readers.get(v, ())]
        if reads and all(r in chosen or r in feeders for r in reads):
            feeders.add(j)
    return feeders


def _readiness(eqns, moved, made_by, summed) -> dict[int, int]:
    """Equation -> the step after which it can run: its own place, or for one that moves (a feeder,
    a chosen all-reduce) the latest step that makes one of its operands (-1: the body's inputs).
    An all-reduce of another's result (``summed``) keeps its place: that result exists only after
    the wait, which comes after every start."""
    ready: dict[int, int] = {}
    for j, e in enumerate(eqns):
        if j not in moved or any(_jx.is_var(v) and v in summed for v in e.invars):
            ready[j] = j
            continue
        ready[j] = max((ready[made_by[v]] for v in e.invars if _jx.is_var(v) and v in made_by), default=-1)
    return ready


def _by_readiness(buckets: list[list[int]], ready: dict[int, int]) -> list[list[int]]:
    """``buckets`` in the order they become ready (the step that makes a bucket's last operand);
    buckets ready at one step keep their order."""
    return sorted(buckets, key=lambda b: max(ready[i] for i in b))


def _buckets(eqns, ordered: list[int], cap_bytes: int) -> list[list[int]]:
    """The chosen equations (in readiness order) in buckets: per (kind, parameters), then per dtype
    and varying axes at most ``cap_bytes`` (:func:`jax_blink.switch.merge.merge_groups`)."""
    by_key: dict = collections.defaultdict(list)
    for i in ordered:
        by_key[_key(eqns[i])].append(i)
    out = []
    for members in by_key.values():
        avals = [eqns[i].invars[0].aval for i in members]
        out += [[members[k] for k in group] for group in _merge.merge_groups(avals, cap_bytes)]
    return out


def weights(jaxpr) -> list:
    """A body's weights, in the order they appear: its inputs, or the ``pvary`` of one, that some
    equation reads and that only :data:`WEIGHT_READERS` read (not returned by the body)."""
    passed = [v for v in jaxpr.invars if _jx.is_var(v)]
    known = set(passed)
    readers: dict = collections.defaultdict(set)
    for e in jaxpr.eqns:
        for v in e.invars:
            if _jx.is_var(v):
                readers[v].add(e.primitive.name)
        if e.primitive.name in _PASS_ON and e.invars and all(_jx.is_var(v) and v in known for v in e.invars):
            passed += [v for v in e.outvars if v not in known]
            known.update(e.outvars)
    returned = {v for v in jaxpr.outvars if _jx.is_var(v)}
    return [v for v in passed if read_as_weight(readers[v]) and v not in returned
            and _jx.is_plain_array(v.aval)]


def _emit(jaxpr, eqns, items, buckets, hold: str = "recent"):
    """The body in the order of ``items``, with the starts, their held values (``hold``) and the done."""
    held_weights = weights(jaxpr) if hold == "weights" else []
    position = {}  # original variable -> the index in ``items`` of what makes it
    last_use: dict = {}
    for p, (_, kind, payload) in enumerate(items):
        if kind == "eqn":
            position.update((v, p) for v in eqns[payload].outvars)
            reads = eqns[payload].invars
        elif kind == "start":
            reads = [eqns[i].invars[0] for i in buckets[payload]]
        else:
            reads = list(payload[1])  # the values a late wait is tied behind
        for v in reads:
            if _jx.is_var(v):
                last_use[v] = p
    for v in jaxpr.outvars:
        if _jx.is_var(v):
            last_use[v] = len(items)
    rename: dict = {}
    out: list = []
    started: list = []  # (result, passed) per bucket, in start order
    starts_at: list[int] = []
    ids: list[int] = []

    def read(v):
        return rename.get(v, v) if _jx.is_var(v) else v

    for p, (_, kind, payload) in enumerate(items):
        if kind == "eqn":
            e = eqns[payload]
            out.append(e.replace(invars=[read(v) for v in e.invars]) if any(
                _jx.is_var(v) and v in rename for v in e.invars) else e)
            continue
        if kind == "start":
            members = [eqns[i] for i in buckets[payload]]
            if hold == "none":
                held = []
            elif hold == "weights":
                held = _held_weights(held_weights, position, last_use, p, starts_at)
            else:
                held = _held(position, last_use, p, starts_at)
            operands = [read(e.invars[0]) for e in members]
            flat_in = members[0].invars[0].aval.update(shape=(sum(_size(e.invars[0].aval) for e in members),))
            flat_out = members[0].outvars[0].aval.update(shape=flat_in.shape)
            result, passed = _jx.new_var(flat_out), _jx.new_var(flat_in)
            tied = [_jx.new_var(v.aval) for v in held]
            name, params = _key(members[0])
            ids.append(next(_bucket_ids))
            out.append(_jx.new_eqn([*operands, *(read(v) for v in held)], [result, passed, *tied], start_p,
                                   {"bucket": ids[-1], "name": name, "params": params,
                                    "count": len(members), "last": payload == len(buckets) - 1},
                                   set(), members[-1]))
            rename.update(zip(held, tied))
            started.append((result, passed))
            starts_at.append(p)
            continue
        waited, after = payload
        members = [eqns[i] for b in waited for i in buckets[b]]
        operands = [v for b in waited for v in started[b]] + [started[-1][1], *(read(v) for v in after)]
        out.append(_jx.new_eqn(operands, [e.outvars[0] for e in members], done_p,
                               {"ids": tuple(ids[b] for b in waited),
                                "buckets": tuple(len(buckets[b]) for b in waited), "after": len(after)},
                               set(), members[-1]))
    outvars = [read(v) for v in jaxpr.outvars]
    return _jx.replace_eqns(jaxpr, out, outvars=outvars)


def _size(aval) -> int:
    return int(np.prod(aval.shape, dtype=np.int64))


def _held(position, last_use, p, starts_at) -> list:
    """The values that wait for the start at item ``p``: made by the body since the previous start
    (else since the first) and read after it; none for the first start."""
    if not starts_at:
        return []
    live = [v for v, made in position.items()
            if made < p and last_use.get(v, -1) > p and _jx.is_plain_array(v.aval)]
    recent = [v for v in live if position[v] > starts_at[-1]]
    return recent or [v for v in live if position[v] > starts_at[0]]


def _held_weights(held_weights, position, last_use, p, starts_at) -> list:
    """The weights that wait for the start at item ``p``: those made before it and read after it;
    none for the first start (as :func:`_held`)."""
    if not starts_at:
        return []
    return [v for v in held_weights if position.get(v, -1) < p and last_use.get(v, -1) > p]


__all__ = ["HOLDS", "OVERLAPPABLE", "OVERLAPPABLE_PRIMITIVES", "Rewrite", "WEIGHT_READERS", "done_p",
           "overlap_all_reduces", "read_as_weight", "start_p", "weights"]
