"""Every device must run a program's jax_blink calls in one order: each call blocks until its peers
arrive, so two devices that start independent calls in different orders wait on each other until
the deadline (seen: notebook 03's GPT-2 value_and_grad step under the switch, ABORTED / "Ranks that
never joined this call"). XLA:CPU's compiler removes ``optimization_barrier``s, so the order must
be a data dependency the compiled program keeps: checked here on the optimized HLO.

8 CPU host devices (tests/conftest.py).
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_blink
from jax_blink.api.buckets import bucketed_all_reduce
from jax_blink.options import override

DEVICES = jax.devices()
N = len(DEVICES)
pytestmark = pytest.mark.skipif(N < 8, reason="needs the 8 CPU host devices of tests/conftest.py")

_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = .*?\b[\w-]+\((.*?)\)(?:, |$)")


def _collective_order(hlo: str) -> tuple[list[str], dict[str, set[str]]]:
    """The jax_blink calls of the compiled entry computation (by comm_id) and every instruction's
    transitive operands."""
    entry = hlo[hlo.index("\nENTRY "):]
    operands: dict[str, list[str]] = {}
    calls: list[tuple[int, str]] = []
    for line in entry.splitlines()[1:]:
        m = _INSTR.match(line)
        if not m:
            continue
        name = m.group(1)
        operands[name] = re.findall(r"%([\w.\-]+)", m.group(2))
        if re.search(r'custom_call_target="jax_blink_collective(?:_lite)?(?:_cb)?"', line):  # any binding, handler
            calls.append((int(re.search(r"comm_id = (\d+)", line).group(1)), name))
    ancestors: dict[str, set[str]] = {}

    def up(name: str) -> set[str]:
        if name not in ancestors:
            ancestors[name] = set()
            acc = set()
            for o in operands.get(name, []):
                acc |= {o} | up(o)
            ancestors[name] = acc
        return ancestors[name]

    import sys
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 100_000))
    return [n for _, n in sorted(calls)], {n: up(n) for _, n in calls}


def _assert_totally_ordered(hlo: str, expected_calls: int) -> None:
    order, ancestors = _collective_order(hlo)
    assert len(order) == expected_calls, order
    for prev, nxt in zip(order, order[1:]):
        assert prev in ancestors[nxt], (
            f"jax_blink call {nxt} does not depend on the call before it ({prev}) in the compiled "
            "program: XLA:CPU may run them in different orders on different devices")


def _rand(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


def test_switch_calls_of_a_gradient_step_stay_ordered_after_compilation():
    """value_and_grad of a pmean'd loss: the transposes' psums of every parameter's gradient are
    independent of each other; the switch must chain them so that the chain survives XLA."""
    mesh = jax.make_mesh((N,), ("data",))
    params = {f"w{i}": jnp.asarray(_rand(i, (16, 16)) / 4) for i in range(6)}
    x = jax.device_put(jnp.asarray(_rand(10, (N * 4, 16))), NamedSharding(mesh, P("data")))

    def loss_of(p, xb):
        h = xb
        for i in range(6):
            h = jnp.tanh(h @ p[f"w{i}"])
        return lax.pmean(jnp.mean(h ** 2), "data")

    step = jax.jit(jax.shard_map(lambda p, xb: jax.value_and_grad(loss_of)(p, xb), mesh=mesh,
                                 in_specs=(P(), P("data")), out_specs=(P(), P())))
    want = jax.tree.map(np.asarray, step(params, x))
    with jax_blink.installed(), override(dispatch="blink", timeout_s=5):
        compiled = step.lower(params, x).compile()
        got = [jax.tree.map(np.asarray, compiled(params, x)) for _ in range(3)]
    _assert_totally_ordered(compiled.as_text(), expected_calls=7)
    for g in got:
        jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6), g, want)


def test_bucketed_all_reduce_calls_stay_ordered_after_compilation():
    """bucketed_all_reduce's buckets run in bucket order on every device."""
    mesh = jax.make_mesh((N,), ("data",))
    tree = [jax.device_put(jnp.asarray(_rand(20 + i, (N, 256))), NamedSharding(mesh, P("data")))
            for i in range(4)]
    fn = jax.jit(jax.shard_map(lambda *t: tuple(bucketed_all_reduce(list(t), "data", bucket_bytes=1024)),
                               mesh=mesh, in_specs=(P("data"),) * 4, out_specs=(P(),) * 4))
    with override(dispatch="blink", timeout_s=5):
        compiled = fn.lower(*tree).compile()
        got = jax.tree.map(np.asarray, compiled(*tree))
    _assert_totally_ordered(compiled.as_text(), expected_calls=4)
    for t, g in zip(tree, got):
        np.testing.assert_allclose(g, np.asarray(t, np.float64).reshape(N, 1, 256).sum(0), rtol=1e-5, atol=1e-5)


def test_explicit_calls_of_one_program_stay_ordered_after_compilation():
    """jax_blink.all_reduce of each gradient leaf (independent calls, as a user writes them in
    place of lax.psum) in one process: ordered as the switch's calls are."""
    mesh = jax.make_mesh((N,), ("data",))
    params = {f"w{i}": jnp.asarray(_rand(30 + i, (16, 16)) / 4) for i in range(5)}
    x = jax.device_put(jnp.asarray(_rand(40, (N * 4, 16))), NamedSharding(mesh, P("data")))

    def loss_of(p, xb):
        h = xb
        for i in range(5):
            h = jnp.tanh(h @ p[f"w{i}"])
        return jnp.mean(h ** 2)

    def body(reduce, p, xb):
        loss, grads = jax.value_and_grad(loss_of)(p, xb)
        return reduce(loss) / N, jax.tree.map(lambda g: reduce(g) / N, grads)

    def step(reduce):
        return jax.jit(jax.shard_map(lambda p, xb: body(reduce, p, xb), mesh=mesh,
                                     in_specs=(P(), P("data")), out_specs=(P(), P())))

    want = jax.tree.map(np.asarray, step(lambda v: lax.psum(v, "data"))(params, x))
    with override(dispatch="blink", timeout_s=5):
        fn = step(lambda v: jax_blink.all_reduce(v, "data"))
        compiled = fn.lower(params, x).compile()
        got = [jax.tree.map(np.asarray, compiled(params, x)) for _ in range(3)]
    _assert_totally_ordered(compiled.as_text(), expected_calls=6)
    for g in got:
        jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6), g, want)


def test_a_nested_jit_holding_a_collective_joins_the_chain():
    """A collective inside a nested jax.jit lives in a function of its own (jnp.take's transpose
    in a GPT-2 gradient step): it is ordered against the calls around it."""
    mesh = jax.make_mesh((N,), ("data",))
    xs = [jax.device_put(jnp.asarray(_rand(50 + i, (N, 32))), NamedSharding(mesh, P("data")))
          for i in range(3)]
    inner = jax.jit(lambda v: lax.psum(v * 2, "data"))

    def body(a, b, c):
        return lax.psum(a, "data"), inner(b), lax.psum(c, "data")

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"),) * 3, out_specs=(P(),) * 3))
    want = jax.tree.map(np.asarray, fn(*xs))
    with jax_blink.installed(), override(dispatch="blink", timeout_s=5):
        compiled = fn.lower(*xs).compile()
        got = jax.tree.map(np.asarray, compiled(*xs))
    _assert_totally_ordered(compiled.as_text(), expected_calls=3)
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6), got, want)


# ---------------------------------------------------------------------------------------------
# Calls inside while / scan / fori_loop / cond against the calls around them (jax_blink/lowering/call_order.py).

def _computation(hlo: str, name: str | None = None) -> list[str]:
    """The instruction lines of the entry computation, or of the computation called ``name``."""
    head = re.compile(r"^ENTRY " if name is None else rf"^%?{re.escape(name)} ")
    lines = hlo.splitlines()
    start = next(i for i, line in enumerate(lines) if head.match(line))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("}"))
    return lines[start + 1:end]


def _graph(lines: list[str]) -> tuple[list[str], list[str], dict[str, set[str]]]:
    """(the jax_blink calls by comm_id, the while / conditional instructions, every instruction's
    transitive operands) of one computation's lines."""
    operands: dict[str, list[str]] = {}
    calls, loops = [], []
    for line in lines:
        m = _INSTR.match(line)
        if not m:
            continue
        operands[m.group(1)] = re.findall(r"%([\w.\-]+)", m.group(2))
        if re.search(r'custom_call_target="jax_blink_collective', line):
            calls.append((int(re.search(r"comm_id = (\d+)", line).group(1)), m.group(1)))
        if re.search(r"\b(while|conditional)\(", line):
            loops.append(m.group(1))
    ancestors: dict[str, set[str]] = {}

    def up(name: str) -> set[str]:
        if name not in ancestors:
            ancestors[name] = set()
            ancestors[name] = set().union(*({o} | up(o) for o in operands.get(name, [])))
        return ancestors[name]

    return [n for _, n in sorted(calls)], loops, {n: up(n) for n in operands}


def _inner_computations(hlo: str, loop: str) -> list[str]:
    """The body of a while instruction, or the branches of a conditional, named in its line."""
    line = next(line for line in _computation(hlo) if re.match(rf"^\s*(?:ROOT )?%{re.escape(loop)} = ", line))
    if m := re.search(r"body=%([\w.\-]+)", line):
        return [m.group(1)]
    if m := re.search(r"branch_computations=\{([^}]*)\}", line):
        return re.findall(r"%([\w.\-]+)", m.group(1))
    return re.findall(r"(?:true|false)_computation=%([\w.\-]+)", line)


def _control_flow_program(reduce, kind: str):
    """A call before, two inside (a scan, fori_loop or cond) and one after, all independent."""
    mesh = jax.make_mesh((N,), ("data",))

    def inner(c):  # two independent calls in the body, a varying carry
        return reduce(c) * 0.125 + reduce(c * 0.5) * 0.25 + c * 0.5

    def body(x, flag):
        before = reduce(x)
        if kind == "scan":
            looped, _ = lax.scan(lambda c, _: (inner(c), None), x * 2.0, None, length=3)
        elif kind == "fori_loop":
            looped = lax.fori_loop(0, 3, lambda i, c: inner(c), x * 2.0)
        else:
            looped = lax.cond(flag > 0, inner, lambda c: c - 1.0, x * 2.0)
        after = reduce(x * 3.0)
        return before + looped + after

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data")))


@pytest.mark.parametrize("kind", ["scan", "fori_loop", "cond"])
@pytest.mark.parametrize("calls", ["explicit", "switch"])
def test_a_loop_or_cond_holding_calls_joins_the_chain_of_the_calls_around_it(kind, calls):
    """The while / conditional instruction waits for the call before it, the call after it waits
    for its results, and the calls inside it stay ordered among themselves; the values are lax's."""
    mesh = jax.make_mesh((N,), ("data",))
    x = jax.device_put(jnp.asarray(_rand(60, (N, 64))), NamedSharding(mesh, P("data")))
    flag = jnp.float32(1.0)
    want = np.asarray(_control_flow_program(lambda v: lax.psum(v, "data"), kind)(x, flag))
    with override(dispatch="blink", timeout_s=5):
        if calls == "explicit":
            compiled = _control_flow_program(lambda v: jax_blink.all_reduce(v, "data"), kind).lower(x, flag).compile()
        else:
            with jax_blink.installed():
                compiled = _control_flow_program(lambda v: lax.psum(v, "data"), kind).lower(x, flag).compile()
        got = np.asarray(compiled(x, flag))
    hlo = compiled.as_text()
    outside, loops, ancestors = _graph(_computation(hlo))
    assert len(outside) == 2 and len(loops) == 1, (outside, loops)
    (before, after), (loop,) = outside, loops
    assert before in ancestors[loop], f"the {kind} does not wait for the call before it"
    assert loop in ancestors[after], f"the call after the {kind} does not wait for it"
    inside = [_graph(_computation(hlo, name)) for name in _inner_computations(hlo, loop)]
    body_calls, _, body_ancestors = max(inside, key=lambda g: len(g[0]))
    assert len(body_calls) == 2, body_calls
    assert body_calls[0] in body_ancestors[body_calls[1]], f"the calls inside the {kind} are not ordered"
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_copies_of_an_unrolled_scan_body_are_ordered():
    """scan(unroll=2) copies one traced body twice into the while's body: the trace-level chain
    never saw the second copy, the lowering orders it after the first."""
    mesh = jax.make_mesh((N,), ("data",))
    xs = jax.device_put(jnp.asarray(_rand(70, (N, 4, 32))), NamedSharding(mesh, P("data")))

    def body(block):  # each step's call reduces its own slice: nothing but the chain orders them
        _, ys = lax.scan(lambda c, xi: (c + 1.0, jax_blink.all_reduce(xi, "data")), jnp.float32(0),
                         block[0], unroll=2)
        return ys[None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    with override(dispatch="blink", timeout_s=5):
        compiled = fn.lower(xs).compile()
        got = np.asarray(compiled(xs))
    hlo = compiled.as_text()
    _, (loop,), _ = _graph(_computation(hlo))
    (inner,) = _inner_computations(hlo, loop)
    calls, _, ancestors = _graph(_computation(hlo, inner))
    assert len(calls) == 2 and calls[0] in ancestors[calls[1]], calls
    want = np.asarray(xs, np.float64).sum(0)
    np.testing.assert_allclose(got, np.broadcast_to(want, got.shape), rtol=1e-5, atol=1e-5)


def test_call_order_rules_are_in_force_on_cpu():
    """Fails loudly when a jax upgrade moves what jax_blink/lowering/call_order.py wraps: its rules are the
    CPU rules of while, cond, ffi_call, jit and call, and the primitives that hold calls are
    lowered in place (jax emits a cached lowering in a function of its own first)."""
    from jax._src.interpreters import mlir as mlir_internal
    from jax_blink.lowering import jax_internals as jx
    wrapped = [jx.WHILE_PRIMITIVE, jx.COND_PRIMITIVE, jx.FFI_CALL_PRIMITIVE, jx.JIT_PRIMITIVE, jx.CALL_PRIMITIVE]
    assert [p.name for p in wrapped[:4]] == ["while", "cond", "ffi_call", "jit"]
    for prim in wrapped:
        rule = jx.rule_of(jx.registered_rule(prim, "cpu"))
        assert rule.__name__ in ("jax_blink_ordered_lowering", "jax_blink_ordered_ffi_call_lowering",
                                 "jax_blink_jit_lowering"), (prim, rule)
    assert {p.name for p in jx.CALL_HOLDING_PRIMITIVES} >= {"scan", "custom_jvp_call", "custom_vmap_call",
                                                            "while", "cond", "ffi_call"}
    assert set(jx.CALL_HOLDING_PRIMITIVES) <= mlir_internal._uncacheable_primitives


def test_explicit_calls_in_a_checkpoint_and_a_nested_jit_join_the_chain():
    """Calls traced in a trace of their own (jax.checkpoint, a nested jax.jit) are ordered against
    the calls around them, which the trace-level chain cannot see."""
    mesh = jax.make_mesh((N,), ("data",))
    xs = [jax.device_put(jnp.asarray(_rand(80 + i, (N, 32))), NamedSharding(mesh, P("data"))) for i in range(4)]

    def program(reduce):
        inner = jax.jit(lambda v: reduce(v) * 2.0)

        def body(a, b, c, d):
            return reduce(a), jax.checkpoint(reduce)(b), inner(c), reduce(d)

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"),) * 4, out_specs=(P(),) * 4))

    want = jax.tree.map(np.asarray, program(lambda v: lax.psum(v, "data"))(*xs))
    with override(dispatch="blink", timeout_s=5):
        compiled = program(lambda v: jax_blink.all_reduce(v, "data")).lower(*xs).compile()
        got = jax.tree.map(np.asarray, compiled(*xs))
    _assert_totally_ordered(compiled.as_text(), expected_calls=4)
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6), got, want)
