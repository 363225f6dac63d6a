"""The switch merges a pytree all-reduce (jax_blink/switch/merge.py): ``lax.psum`` / ``pmax`` / ``pmin`` of
a pytree bind one equation per leaf; under the switch, a run of them lowers as one jax_blink call per
dtype (at most ``jax_blink.config.merge_bytes`` each), with lax's values and result types.

8 CPU host devices (tests/conftest.py), ``dispatch="blink"`` (the CPU table sends 8-rank
all-reduces to XLA). Data are small integers (also in float32 / bfloat16 leaves): every partial
sum is exact, so the executor's sums must equal XLA's bit for bit whatever the order of addition.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_blink
from jax_blink.switch import merge
from jax_blink.options import override
from test_ordering import _assert_totally_ordered  # tests/ is on sys.path: pytest's prepend import mode

DEVICES = jax.devices()
N = len(DEVICES)
pytestmark = pytest.mark.skipif(N < 8, reason="needs the 8 CPU host devices of tests/conftest.py")
_CALL = re.compile(r'custom_call_target="jax_blink_collective(?:_lite)?(?:_cb)?"')


@pytest.fixture(autouse=True)
def _switch_off_after_each_test():
    yield
    jax_blink.uninstall()


def _mesh():
    return jax.make_mesh((N,), ("x",), devices=DEVICES)


def _tree(mesh, seed):
    """Leaves of mixed shapes: four float32, two int32, one bfloat16, one int8 (which the
    executors do not take). Small integers: sums over 8 ranks are exact in every dtype here."""
    rng = np.random.default_rng(seed)

    def leaf(shape, dtype, hi=50):
        return jax.device_put(jnp.asarray(rng.integers(-hi, hi, (N, *shape)).astype(dtype)),
                              NamedSharding(mesh, P("x")))

    return {"w1": leaf((3, 5), np.float32), "b1": leaf((5,), np.float32), "step": leaf((), np.int32),
            "w2": leaf((2, 2, 3), np.float32), "norm": leaf((7,), jnp.bfloat16, hi=8),
            "mask": leaf((4,), np.int8, hi=10), "count": leaf((2,), np.int32), "b2": leaf((1,), np.float32)}


def _run(fn, *args):
    """``fn(*args)`` without the switch, then with it: both results, the jax_blink calls in the
    compiled program under the switch (checked to run in one order: test_ordering.py), and the
    switch's decisions."""
    plain = fn(*args)
    with jax_blink.installed(), override(dispatch="blink"):
        jax_blink.switch_report(clear=True)
        compiled = fn.lower(*args).compile()
        switched = compiled(*args)
        report = jax_blink.switch_report()
    hlo = compiled.as_text()
    calls = len(_CALL.findall(hlo))
    _assert_totally_ordered(hlo, calls)
    return plain, switched, calls, report


def _assert_identical(want, got):
    """Same tree, dtypes, shapes and bits."""
    assert jax.tree.structure(want) == jax.tree.structure(got)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        assert (w.dtype, w.shape, w.weak_type) == (g.dtype, g.shape, g.weak_type)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("check_vma", [True, False])
def test_pytree_psum_pmax_pmin_are_one_call_per_dtype(check_vma):
    mesh = _mesh()
    tree = _tree(mesh, 1)
    fn = jax.jit(jax.shard_map(lambda t: (lax.psum(t, "x"), lax.pmax(t, "x"), lax.pmin(t, "x")),
                               mesh=mesh, in_specs=P("x"), out_specs=P(), check_vma=check_vma))
    plain, switched, calls, report = _run(fn, tree)
    _assert_identical(plain, switched)
    # Per collective: float32 (4 leaves), int32 (2), bfloat16 (1) on jax_blink; int8 on XLA.
    assert calls == 3 * 3
    for kind in ("psum_invariant" if check_vma else "psum", "pmax", "pmin"):
        mine = [d for d in report if d.primitive == kind]
        on = {(d.dtype, d.operands) for d in mine if d.runs_on == "jax_blink"}
        assert on == {("float32", 4), ("int32", 2), ("bfloat16", 1)}, mine
        (xla,) = [d for d in mine if d.runs_on == "xla"]
        assert xla.dtype == "int8" and "dtype int8" in xla.reason
    merged = next(d for d in report if d.operands == 4)
    assert merged.shape == (15 + 5 + 12 + 1,) and "one jax_blink executor call for 4 operands" in str(merged)


def test_merged_calls_against_numpy_on_random_floats():
    """Not only against XLA: random normal data, each leaf's sum against numpy in float64."""
    mesh = _mesh()
    rng = np.random.default_rng(2)
    host = [rng.standard_normal((N, *s)).astype(np.float32) for s in ((4, 3), (6,), (), (2, 5))]
    tree = [jax.device_put(jnp.asarray(h), NamedSharding(mesh, P("x"))) for h in host]
    fn = jax.jit(jax.shard_map(lambda t: lax.psum(t, "x"), mesh=mesh, in_specs=P("x"), out_specs=P()))
    _, switched, calls, _ = _run(fn, tree)
    assert calls == 1
    for h, got in zip(host, switched):
        np.testing.assert_allclose(np.asarray(got)[0], h.astype(np.float64).sum(0), rtol=1e-5, atol=1e-5)


def test_grad_of_a_loss_with_many_leaves():
    """Forward psum of a tree and its transposes (a run of psums in the backward pass): merged,
    and the gradient equals lax's."""
    mesh = _mesh()
    rng = np.random.default_rng(3)
    params = {f"w{i}": jnp.asarray(rng.standard_normal((3, i + 1)).astype(np.float32)) for i in range(6)}
    x = jax.device_put(jnp.asarray(rng.standard_normal((N * 2, 3)).astype(np.float32)),
                       NamedSharding(mesh, P("x")))

    def loss(ps, x):
        def local(ps, v):
            hs = lax.psum({k: jnp.tanh(v @ w) for k, w in ps.items()}, "x")
            return sum(jnp.sum(h ** 2) for h in hs.values())
        return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("x")), out_specs=P(),
                             check_vma=False)(ps, x)

    fn = jax.jit(jax.value_and_grad(loss))
    plain, switched, calls, report = _run(fn, params, x)
    jax.tree.map(lambda w, g: np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5),
                 plain, switched)
    assert any(d.operands == 6 and d.runs_on == "jax_blink" for d in report), report
    assert calls < 12  # one per leaf would be 6 forward + 6 backward


def test_the_cap_splits_a_run_into_calls_in_order(monkeypatch):
    mesh = _mesh()
    tree = _tree(mesh, 4)
    fn = jax.jit(jax.shard_map(lambda t: lax.psum(t, "x"), mesh=mesh, in_specs=P("x"), out_specs=P()))
    # Bytes per rank, in tree order: float32 b1 20, b2 4, w1 60, w2 48; int32 count 8, step 4;
    # bfloat16 norm 14. A cap of 24 bytes: float32 b1+b2 | w1 | w2, int32 count+step, bfloat16 norm.
    monkeypatch.setattr(jax_blink.config, "merge_bytes", 24)
    plain, switched, calls, report = _run(fn, tree)
    _assert_identical(plain, switched)
    assert [(d.dtype, d.operands) for d in report if d.runs_on == "jax_blink"] == [
        ("float32", 2), ("int32", 2), ("bfloat16", 1), ("float32", 1), ("float32", 1)]
    assert calls == 5


def test_merging_off_is_one_call_per_leaf(monkeypatch):
    mesh = _mesh()
    tree = _tree(mesh, 5)
    fn = jax.jit(jax.shard_map(lambda t: lax.psum(t, "x"), mesh=mesh, in_specs=P("x"), out_specs=P()))
    monkeypatch.setattr(jax_blink.config, "merge_bytes", 0)
    plain, switched, calls, report = _run(fn, tree)
    _assert_identical(plain, switched)
    assert calls == 7 and all(d.operands == 1 for d in report)


def test_only_adjacent_independent_equal_all_reduces_merge():
    mesh = _mesh()

    def body(a, b):
        s = lax.psum(lax.psum(a, "x"), "x")            # adjacent, but the second reads the first
        t = lax.psum(a, "x")
        u = lax.psum(jnp.sin(b), "x")                  # an equation between: not adjacent to t's
        return s, t, u, *lax.pmax((a, b), "x"), *lax.psum((a, b), "x")

    x = jax.device_put(jnp.ones((N, 3)), NamedSharding(mesh, P("x")))
    jaxpr = jax.make_jaxpr(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P(),
                                         check_vma=False))(x, x).jaxpr
    (smap,) = [e for e in jaxpr.eqns if e.primitive.name == "shard_map"]
    body_jaxpr = smap.params["jaxpr"]
    merged = merge.merge_all_reduces(body_jaxpr)
    names = [e.primitive.name for e in merged.eqns]
    runs = [e for e in merged.eqns if e.primitive is merge.merged_all_reduce_p]
    # psum(a) | psum(that) + psum(a) (independent: merged) | sin | psum | pmax x2 (merged) | psum x2 (merged)
    assert [dict(e.params)["name"] for e in runs] == ["psum", "pmax", "psum"], names
    assert [len(e.invars) for e in runs] == [2, 2, 2], names
    assert len(merged.eqns) == len(body_jaxpr.eqns) - 3
    assert merge.merge_all_reduces(merged) is merged  # nothing left to merge: the same object


def test_merge_groups_by_dtype_and_cap():
    f32, i32 = jax.ShapeDtypeStruct((4,), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.int32)
    empty, big = jax.ShapeDtypeStruct((0,), jnp.float32), jax.ShapeDtypeStruct((100,), jnp.float32)
    avals = [f32, i32, f32, empty, big, f32, i32]
    assert merge.merge_groups(avals, 1 << 20) == [[0, 2, 4, 5], [1, 6], [3]]
    assert merge.merge_groups(avals, 32) == [[0, 2], [1, 6], [3], [4], [5]]
    assert merge.merge_groups(avals, 0) == [[0], [1], [2], [3], [4], [5], [6]]


def test_explain_lowering_says_how_many_operands_a_call_covers():
    mesh = _mesh()
    tree = _tree(mesh, 6)
    fn = jax.shard_map(lambda t: lax.psum(t, "x"), mesh=mesh, in_specs=P("x"), out_specs=P())
    with override(dispatch="blink"):
        text = jax_blink.explain_lowering(fn, tree)
    assert "float32[33], 8 ranks on cpu: one jax_blink executor call for 4 operands" in text, text
    assert "int8[1, 4] on cpu: XLA's own collective (dtype int8" in text, text


def test_install_replaces_and_uninstall_restores_the_shard_map_and_merged_rules():
    from jax_blink.lowering import jax_internals as jx
    assert jx.generic_rule(jx.SHARD_MAP_PRIMITIVE) is not None  # jax's rule, which the switch wraps
    prims = (jx.SHARD_MAP_PRIMITIVE, merge.merged_all_reduce_p)
    before = {(p, pl): jx.registered_rule(p, pl) for p in prims for pl in ("cpu", "cuda")}
    jax_blink.install()
    for p in prims:
        assert "jax_blink" in jx.rule_of(jx.registered_rule(p, "cpu")).__name__, p
    jax_blink.uninstall()
    assert {(p, pl): jx.registered_rule(p, pl) for p in prims for pl in ("cpu", "cuda")} == before


def test_the_dispatch_table_decides_on_the_merged_size():
    """CPU's table: 8 KiB per rank on 8 ranks runs on jax_blink, 32 KiB goes to XLA. Four 8 KiB
    leaves merge into 32 KiB: decided once, for the group, on XLA; each operand then lowers as jax's
    own all-reduce. Merging off, each leaf alone runs on jax_blink."""
    from jax_blink.lowering import dispatch_table as tuning
    assert not tuning.prefer_lax("cpu", N, 8 << 10) and tuning.prefer_lax("cpu", N, 32 << 10)
    mesh = _mesh()
    rng = np.random.default_rng(7)
    tree = [jax.device_put(jnp.asarray(rng.integers(-50, 50, (N, 2048)).astype(np.float32)),
                           NamedSharding(mesh, P("x"))) for _ in range(4)]
    fn = jax.jit(jax.shard_map(lambda t: lax.psum(t, "x"), mesh=mesh, in_specs=P("x"), out_specs=P()))
    plain = fn(tree)
    reports = {}
    for cap, calls_expected in ((jax_blink.config.merge_bytes, 0), (0, 4)):
        with jax_blink.installed(), override(dispatch="auto"):
            jax_blink.config.merge_bytes, saved = cap, jax_blink.config.merge_bytes
            try:
                jax_blink.switch_report(clear=True)
                compiled = fn.lower(tree).compile()
                switched = compiled(tree)
                reports[cap] = jax_blink.switch_report()
            finally:
                jax_blink.config.merge_bytes = saved
        _assert_identical(plain, switched)
        assert len(_CALL.findall(compiled.as_text())) == calls_expected
    (merged,) = reports[jax_blink.config.merge_bytes]
    assert merged.operands == 4 and merged.runs_on == "xla" and "dispatch=auto" in merged.reason
    assert "XLA's own collective for each of 4 operands" in str(merged)
    assert [(d.operands, d.runs_on) for d in reports[0]] == [(1, "jax_blink")] * 4


@pytest.mark.parametrize("packing", ["xla", "barrier"])
def test_barrier_packing_holds_each_merged_leaf_apart_from_its_producer(packing):
    """``bucket_packing="barrier"``: each operand of a merged call passes through an
    ``optimization_barrier`` of its own before the concatenation (so that XLA fuses none of the
    leaves' producers into it); ``"xla"`` has none. The sums stay lax's, bit for bit."""
    mesh = _mesh()
    tree = _tree(mesh, 7)
    fn = jax.jit(jax.shard_map(lambda t: lax.psum(jax.tree.map(lambda v: v * 3, t), "x"),
                               mesh=mesh, in_specs=P("x"), out_specs=P()))
    with override(bucket_packing=packing):
        plain, switched, calls, report = _run(fn, tree)
        with jax_blink.installed(), override(dispatch="blink"):
            text = fn.lower(tree).as_text()
    _assert_identical(plain, switched)
    assert calls == 3  # float32 (4 leaves), int32 (2), bfloat16 (1); int8 on XLA
    barriers = len(re.findall(r"stablehlo\.optimization_barrier", text))
    # One per operand of a merged call of several: the float32 group's 4 and the int32 group's 2.
    assert barriers == (4 + 2 if packing == "barrier" else 0), text
