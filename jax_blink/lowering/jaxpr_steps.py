"""A traced program as a flat list of steps that can be run one by one, with code between them.

``jax.make_jaxpr`` gives a program whose nested ``jax.jit`` / ``closed_call`` calls hide their
equations; :func:`flatten` inlines them (that changes nothing but the freedom of XLA's schedule),
names every value by a key, and records where each value is made and last read. Both
:func:`jax_blink.api.buckets.gradient_order` (which gradient is made first) and
:func:`jax_blink.value_and_grad_overlapped` (start a bucket right after the step that completes
it) read the program this way, so they agree on "where".
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from jax_blink.lowering import jax_internals as _internals


@dataclasses.dataclass(frozen=True)
class Lit:
    """A constant operand (a jaxpr literal)."""

    value: Any


@dataclasses.dataclass(frozen=True)
class Step:
    """One equation: its operands (keys, or :class:`Lit`) and the keys of its results."""

    eqn: Any
    ins: tuple
    outs: tuple


@dataclasses.dataclass
class FlatProgram:
    """A closed jaxpr flattened (:func:`flatten`).

    Attributes:
        steps: The equations, nested calls inlined, in the program's order.
        consts: Key -> value of the program's constants and, once bound, its inputs.
        in_keys: The keys of the program's inputs.
        out_keys: The keys (or :class:`Lit`) of its outputs.
        made_at: Key -> the index of the step that makes it (absent: an input or a constant).
        last_use: Key -> the index of the last step that reads it (``len(steps)`` for outputs).
    """

    steps: list[Step]
    consts: dict[int, Any]
    in_keys: list[int]
    out_keys: list
    made_at: dict[int, int]
    last_use: dict[int, int]

    def made(self, key) -> int:
        """The step after which ``key`` exists (-1: from the start)."""
        return -1 if isinstance(key, Lit) else self.made_at.get(key, -1)


def flatten(closed) -> FlatProgram:
    """``closed`` (a ClosedJaxpr) as a :class:`FlatProgram`."""
    counter = itertools.count()
    consts: dict[int, Any] = {}
    env: dict[Any, Any] = {}
    for cv, c in zip(closed.jaxpr.constvars, closed.consts):
        env[cv] = k = next(counter)
        consts[k] = c
    in_keys = []
    for v in closed.jaxpr.invars:
        env[v] = k = next(counter)
        in_keys.append(k)
    steps: list[Step] = []
    _inline(closed.jaxpr, env, consts, steps, counter)
    out_keys = [_key(v, env) for v in closed.jaxpr.outvars]
    made_at = {k: i for i, s in enumerate(steps) for k in s.outs}
    last_use: dict[int, int] = {}
    for i, s in enumerate(steps):
        for k in s.ins:
            if not isinstance(k, Lit):
                last_use[k] = i
    for k in out_keys:
        if not isinstance(k, Lit):
            last_use[k] = len(steps)
    return FlatProgram(steps, consts, in_keys, out_keys, made_at, last_use)


def run_step(step: Step, read) -> list:
    """The results of one step, its operands read by ``read(key)``."""
    return _internals.bind_equation(step.eqn, [read(k) for k in step.ins])


def _key(atom, env):
    return env[atom] if _internals.is_var(atom) else Lit(_internals.literal_value(atom))


def _inline(jaxpr, env: dict, consts: dict, steps: list, counter) -> None:
    for eqn in jaxpr.eqns:
        ins = tuple(_key(v, env) for v in eqn.invars)
        inner = _internals.inlined_call_jaxpr(eqn)
        if inner is None:
            outs = tuple(next(counter) for _ in eqn.outvars)
            env.update(zip(eqn.outvars, outs))
            steps.append(Step(eqn, ins, outs))
            continue
        sub: dict[Any, Any] = {}
        for cv, c in zip(inner.jaxpr.constvars, inner.consts):
            sub[cv] = k = next(counter)
            consts[k] = c
        sub.update(zip(inner.jaxpr.invars, ins))
        _inline(inner.jaxpr, sub, consts, steps, counter)
        for ov, outer in zip(inner.jaxpr.outvars, eqn.outvars):
            env[outer] = _key(ov, sub)
