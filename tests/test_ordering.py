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
from jax_blink.buckets import bucketed_all_reduce
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
