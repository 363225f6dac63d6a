"""The switch (jax_blink/switch/rules.py): unedited lax programs, run with and without it, must agree;
where jax_blink is meant to run, the compiled program holds its custom call and the executor ran.

8 CPU host devices (tests/conftest.py). ``dispatch="blink"`` except where a test is about the
dispatch table (on CPU host devices it sends every all-reduce of 4+ ranks to XLA).
"""
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_blink
from jax_blink.lowering import backends as _backends
from jax_blink.lowering import jax_internals as _jax_internals
from jax_blink.switch import rules as switch
from jax_blink.options import override

ROOT = Path(__file__).resolve().parents[2]
DEVICES = jax.devices()
N = len(DEVICES)
TARGET = "jax_blink_collective"
pytestmark = pytest.mark.skipif(N < 8, reason="needs the 8 CPU host devices of tests/conftest.py")


@pytest.fixture(autouse=True)
def _switch_off_after_each_test():
    yield
    jax_blink.uninstall()


def _comms() -> int:
    """Communicators the CPU executor has state for: grows when a new call site runs."""
    return _backends.module("cpu").num_comms()


def _mesh(shape=(N,), names=("x",)):
    return jax.make_mesh(shape, names, devices=DEVICES[: int(np.prod(shape))])


def _put(mesh, arr, spec):
    return jax.device_put(jnp.asarray(arr), NamedSharding(mesh, spec))


def _rand(seed, shape, dtype="float32"):
    rng = np.random.default_rng(seed)
    if np.issubdtype(np.dtype(dtype), np.integer):
        return rng.integers(-100, 100, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def _both(fn, *args):
    """``fn(*args)`` without the switch, then with it (dispatch=blink): both results, the optimized
    HLO under the switch, and how many executor communicators the switched run brought up."""
    plain = jax.tree.map(np.asarray, fn(*args))
    before = _comms()
    with jax_blink.installed(), override(dispatch="blink"):
        jax_blink.switch_report(clear=True)
        compiled = jax.jit(fn).lower(*args).compile()
        switched = jax.tree.map(np.asarray, compiled(*args))
    return plain, switched, compiled.as_text(), _comms() - before


def _assert_same(a, b, rtol=1e-5):
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=rtol, atol=rtol), a, b)


def _smap(fn, mesh, in_specs, out_specs, **kw):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kw))


# ---------------------------------------------------------------------------------------------
# The switch itself.

def test_jax_internals_are_where_the_switch_expects():
    """Fails loudly when a jax upgrade moves an internal that jax_blink/lowering/jax_internals.py uses."""
    names = {p.name for p in _jax_internals.PRIMITIVES.values()}
    assert names == {"psum", "psum_invariant", "pmax", "pmin", "all_gather", "all_gather_invariant",
                     "reduce_scatter"}
    for prim in _jax_internals.PRIMITIVES.values():
        entry = _jax_internals.generic_rule(prim)
        assert entry is not None and callable(_jax_internals.rule_of(entry)), prim
    from jax._src import sharding_impls
    from jax._src.interpreters import pxla
    assert hasattr(sharding_impls, "SPMDAxisContext") and callable(pxla.axis_groups)
    # What lax.psum binds is what the switch lowers (under shard_map's checks: psum_invariant).
    mesh = _mesh()
    jaxpr = jax.make_jaxpr(jax.shard_map(lambda v: lax.psum(v, "x"), mesh=mesh, in_specs=P("x"),
                                         out_specs=P()))(_put(mesh, jnp.ones((N, 2)), P("x")))
    assert "psum_invariant" in str(jaxpr)


def test_install_is_idempotent_and_uninstall_restores_jax_rules():
    from jax._src.interpreters import mlir as mlir_internal
    prims = [*_jax_internals.PRIMITIVES.values(), _jax_internals.JIT_PRIMITIVE]
    before = {(p, pl): _jax_internals.registered_rule(p, pl) for p in prims for pl in ("cpu", "cuda")}
    uncacheable = set(mlir_internal._uncacheable_primitives)
    jax_blink.install()
    jax_blink.install()
    assert jax_blink.is_installed()
    for prim in prims:
        ours = _jax_internals.registered_rule(prim, "cpu")
        assert ours is not None and "jax_blink" in _jax_internals.rule_of(ours).__name__, prim
    assert set(_jax_internals.PRIMITIVES.values()) <= mlir_internal._uncacheable_primitives
    jax_blink.uninstall()
    jax_blink.uninstall()
    assert not jax_blink.is_installed()
    after = {(p, pl): _jax_internals.registered_rule(p, pl) for p in prims for pl in ("cpu", "cuda")}
    assert after == before and mlir_internal._uncacheable_primitives == uncacheable


def test_installed_block_leaves_the_switch_as_it_found_it():
    with jax_blink.installed():
        assert jax_blink.is_installed()
        with jax_blink.installed():
            pass
        assert jax_blink.is_installed()  # the inner block did not turn it off
    assert not jax_blink.is_installed()
    jax_blink.install()
    with jax_blink.installed():
        pass
    assert jax_blink.is_installed()


def test_install_clears_jit_caches_so_compiled_programs_lower_again():
    """A function compiled before install() must not keep XLA's collective after it (nor ours
    after uninstall())."""
    mesh = _mesh()
    x = _put(mesh, _rand(0, (N, 33)), P("x"))
    f = _smap(lambda v: lax.psum(v, "x"), mesh, P("x"), P())
    compiles = []

    def listener(event, duration, **kw):
        if "backend_compile" in event:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        with override(dispatch="blink"):
            want = np.asarray(f(x))
            n0, c0 = len(compiles), _comms()
            np.asarray(f(x))
            assert len(compiles) == n0 and _comms() == c0  # cached, XLA's psum
            jax_blink.install()
            got = np.asarray(f(x))
            assert len(compiles) == n0 + 1, "install() must make f compile again"
            assert _comms() == c0 + 1, "the recompiled f must run the executor"
            jax_blink.uninstall()
            again = np.asarray(f(x))
            assert len(compiles) == n0 + 2 and _comms() == c0 + 1
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_array_equal(again, want)


def test_reference_taken_before_install_is_switched():
    psum = jax.lax.psum  # the program's own reference, taken before the switch exists
    mesh = _mesh()
    x = _put(mesh, _rand(1, (N, 10)), P("x"))
    plain, switched, hlo, comms = _both(_smap(lambda v: psum(v, "x"), mesh, P("x"), P()), x)
    _assert_same(plain, switched)
    assert TARGET in hlo and comms == 1


# ---------------------------------------------------------------------------------------------
# Each collective, as users write them, under shard_map and pmap.

_SMAP_CASES = {
    "psum": (lambda v: lax.psum(v, "x"), P()),
    "pmean": (lambda v: lax.pmean(v, "x"), P()),
    "pmax": (lambda v: lax.pmax(v, "x"), P()),
    "pmin": (lambda v: lax.pmin(v, "x"), P()),
    "all_gather": (lambda v: lax.all_gather(v, "x", axis=1), P("x")),
    "all_gather_tiled": (lambda v: lax.all_gather(v, "x", axis=1, tiled=True), P("x")),
    "all_gather_invariant": (lambda v: lax.all_gather(v, "x", axis=0, tiled=True, to="invarying"), P()),
    "psum_scatter": (lambda v: lax.psum_scatter(v, "x", scatter_dimension=1), P("x")),
    "psum_scatter_tiled": (lambda v: lax.psum_scatter(v, "x", scatter_dimension=2, tiled=True), P("x")),
}


@pytest.mark.parametrize("name,check_vma", [(n, c) for n in sorted(_SMAP_CASES) for c in (True, False)
                                            # to="invarying" is a type of shard_map's checks
                                            if c or n != "all_gather_invariant"])
def test_shard_map_collectives(name, check_vma):
    fn, out_spec = _SMAP_CASES[name]
    mesh = _mesh()
    x = _put(mesh, _rand(2, (N, N, 2 * N)), P("x"))
    plain, switched, hlo, comms = _both(_smap(fn, mesh, P("x"), out_spec, check_vma=check_vma), x)
    _assert_same(plain, switched)
    assert TARGET in hlo and comms == 1
    assert [d.runs_on for d in jax_blink.switch_report()] == ["jax_blink"]


_PMAP_CASES = {
    "psum": lambda v: lax.psum(v, "i"),
    "pmean": lambda v: lax.pmean(v, "i"),
    "pmax": lambda v: lax.pmax(v, "i"),
    "pmin": lambda v: lax.pmin(v, "i"),
    "all_gather": lambda v: lax.all_gather(v, "i"),
    "all_gather_tiled_axis1": lambda v: lax.all_gather(v, "i", axis=1, tiled=True),
    "psum_scatter": lambda v: lax.psum_scatter(v, "i"),
    "psum_scatter_tiled": lambda v: lax.psum_scatter(v, "i", scatter_dimension=1, tiled=True),
}


@pytest.mark.parametrize("name", sorted(_PMAP_CASES))
def test_pmap_collectives(name):
    x = _rand(3, (N, N, 3 * N))
    plain, switched, hlo, comms = _both(jax.pmap(_PMAP_CASES[name], axis_name="i"), x)
    _assert_same(plain, switched)
    assert TARGET in hlo and comms == 1


def test_integer_and_float64_operands():
    mesh = _mesh()
    for dtype in ("int32", "float64"):
        if dtype == "float64" and not jax.config.jax_enable_x64:
            continue
        x = _put(mesh, _rand(4, (N, 9), dtype), P("x"))
        plain, switched, hlo, _ = _both(_smap(lambda v: lax.psum(v, "x"), mesh, P("x"), P()), x)
        np.testing.assert_array_equal(plain, switched) if dtype == "int32" else _assert_same(plain, switched)
        assert TARGET in hlo


def test_equal_independent_collectives_each_have_their_own_call_site():
    """Equal collectives on independent data (FSDP's per-layer gathers; one jitted function called
    at several sites) may run at once on XLA:CPU: each needs its own communicator id, or the
    executor pairs one site's data on one rank with another site's on the next."""
    mesh = _mesh()
    ws = [_put(mesh, _rand(40 + i, (N * 4, 16)), P("x")) for i in range(4)]
    gather = jax.jit(lambda w: lax.all_gather(w, "x", tiled=True))

    def body(*ws):
        direct = [lax.all_gather(w, "x", tiled=True) for w in ws]  # equal equations
        nested = [gather(w * 2) for w in ws]                      # one function, four sites
        return tuple(direct + nested)

    fn = _smap(body, mesh, (P("x"),) * 4, (P(),) * 8, check_vma=False)
    plain, switched, hlo, comms = _both(fn, *ws)
    _assert_same(plain, switched)
    assert comms == 8
    for w, got in zip(ws, switched[:4]):
        np.testing.assert_array_equal(got, np.asarray(w))


def test_calls_of_one_block_wait_for_each_other_in_emission_order():
    """Independent calls of one block are chained (the rank operand of each waits for the previous
    call's result, through the executor's jax_blink_after call, which XLA keeps where it removes
    optimization barriers): XLA:CPU must not start them in a different order on different devices.
    tests/unit/test_ordering.py checks the chain in the compiled program."""
    mesh = _mesh((4, 2), ("x", "y"))
    x = _put(mesh, _rand(50, (4, 2, 6)), P("x", "y"))
    fn = _smap(lambda v: (lax.psum(v, "x"), lax.psum(v, "y"), lax.psum(v * 2, "x")),
               mesh, P("x", "y"), (P(None, "y"), P("x"), P(None, "y")))
    with jax_blink.installed(), override(dispatch="blink"):
        lowered = fn.lower(x)
        text, compiled = lowered.as_text(), lowered.compile().as_text()
        got = jax.tree.map(np.asarray, fn(x))
    assert text.count(f"@{TARGET}(") == 3 and text.count("@jax_blink_after(") == 2
    assert compiled.count('custom_call_target="jax_blink_after"') == 2
    _assert_same(got, jax.tree.map(np.asarray, fn(x)))


# ---------------------------------------------------------------------------------------------
# AD, vmap, pytrees, groups, result types, errors.

@pytest.mark.parametrize("check_vma", [True, False])
def test_grad_of_shard_map_program(check_vma):
    """jax.grad's transposes (psum of cotangents, pvary's transpose) reach the switch too."""
    mesh = _mesh()
    x = _put(mesh, _rand(5, (N, 7)), P("x"))
    w = jnp.asarray(_rand(6, (7,)))

    def loss(w, x):
        def local(w, v):
            y = jnp.sin(v * w)
            return lax.pmean(jnp.sum(y ** 2), "x")
        return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("x")), out_specs=P(),
                             check_vma=check_vma)(w, x)

    g = jax.jit(jax.grad(loss))
    plain, switched, hlo, comms = _both(g, w, x)
    _assert_same(plain, switched)
    assert TARGET in hlo and comms >= 1


def test_jvp_and_jacfwd_through_psum():
    mesh = _mesh()
    x = _put(mesh, _rand(7, (N, 4)), P("x"))
    t = _put(mesh, _rand(8, (N, 4)), P("x"))
    f = jax.shard_map(lambda v: lax.psum(jnp.cos(v), "x"), mesh=mesh, in_specs=P("x"), out_specs=P())
    plain, switched, hlo, _ = _both(jax.jit(lambda a, b: jax.jvp(f, (a,), (b,))), x, t)
    _assert_same(plain, switched)
    assert TARGET in hlo
    small = _put(mesh, _rand(9, (N, 2)), P("x"))
    plain, switched, hlo, _ = _both(jax.jit(jax.jacfwd(f)), small)
    _assert_same(plain, switched)
    assert TARGET in hlo


def test_vmap_of_a_function_holding_collectives():
    mesh = _mesh()
    x = _put(mesh, _rand(10, (N, 3, 5)), P("x"))
    fn = jax.vmap(lambda v: (lax.psum(v, "x"), lax.all_gather(v, "x")))
    plain, switched, hlo, comms = _both(_smap(fn, mesh, P("x"), (P(), P(None, "x"))), x)
    _assert_same(plain, switched)
    assert TARGET in hlo and comms == 2


def test_collective_over_a_vmap_bound_axis_never_reaches_lowering():
    x = jnp.asarray(_rand(11, (N, 6)))
    fn = jax.jit(jax.vmap(lambda v: (lax.psum(v, "i"), lax.all_gather(v, "i"), lax.pmax(v, "i")),
                          axis_name="i"))
    plain, switched, hlo, comms = _both(fn, x)
    _assert_same(plain, switched)
    # vmap's batching rules turned them into local reductions: psum and pmax arrive as
    # reductions over a positional axis only, and stay XLA's (there is nothing to communicate).
    assert comms == 0 and TARGET not in hlo
    assert all(d.runs_on == "xla" and "vmap-bound" in d.reason for d in jax_blink.switch_report())


def test_vmap_axis_and_mesh_axis_in_one_psum():
    """psum over a vmap axis and a mesh axis: the vmap part arrives as a positional axis, reduced
    locally, the mesh part on the executor."""
    mesh = _mesh()
    x = _put(mesh, _rand(12, (N, 3, 4)), P("x"))
    fn = jax.vmap(lambda v: lax.psum(v, ("i", "x")), axis_name="i")
    plain, switched, hlo, _ = _both(_smap(fn, mesh, P("x"), P(), check_vma=False), x)
    _assert_same(plain, switched)
    assert TARGET in hlo
    (d,) = jax_blink.switch_report()
    assert d.runs_on == "jax_blink" and 0 in d.axes


def test_pytree_of_several_dtypes_in_one_psum():
    mesh = _mesh()
    tree = {"a": _put(mesh, _rand(13, (N, 3)), P("x")),
            "b": (_put(mesh, _rand(14, (N, 2, 2), "int32"), P("x")),
                  _put(mesh, _rand(15, (N,), "float32"), P("x")))}
    fn = _smap(lambda t: lax.psum(t, "x"), mesh, (P("x"),), P())
    plain, switched, hlo, comms = _both(fn, tree)
    _assert_same(plain, switched)
    # One call per dtype: the two float32 leaves in one (tests/unit/test_switch_merge.py), int32 in another.
    assert hlo.count(TARGET) >= 2 and comms == 2


def test_axis_index_groups_run_on_the_executor():
    x = _rand(16, (N, 5))
    blocks = [[0, 1, 2, 3], [4, 5, 6, 7]]
    interleaved = [[0, 2, 4, 6], [1, 3, 5, 7]]
    for groups in (blocks, interleaved):
        fn = jax.pmap(lambda v: (lax.psum(v, "i", axis_index_groups=groups),
                                 lax.all_gather(v, "i", axis_index_groups=groups)), axis_name="i")
        plain, switched, hlo, comms = _both(fn, x)
        _assert_same(plain, switched)
        assert TARGET in hlo and comms == 2 * len(groups)  # a communicator per call and group
        for g in groups:  # against numpy, not only against XLA
            np.testing.assert_allclose(plain[0][g[0]], x[g].sum(0), rtol=1e-5)
            np.testing.assert_allclose(switched[0][g[-1]], x[g].sum(0), rtol=1e-5)


def test_two_dimensional_mesh_groups_and_axis_tuples():
    mesh = _mesh((4, 2), ("x", "y"))
    x = _put(mesh, _rand(17, (4, 2, 6)), P("x", "y"))
    fn = lambda v: (lax.psum(v, "x"), lax.psum(v, "y"), lax.psum(v, ("x", "y")),  # noqa: E731
                    lax.all_gather(v, "y", tiled=True, axis=2))
    plain, switched, hlo, comms = _both(
        _smap(fn, mesh, P("x", "y"), (P(None, "y"), P("x"), P(), P("x")), check_vma=False), x)
    _assert_same(plain, switched)
    # A communicator per call and group: 2 groups over x, 4 over y, 1 over both, 4 over y.
    assert hlo.count(TARGET) >= 4 and comms == 2 + 4 + 1 + 4


def test_result_types_under_shard_map_checks_are_jax_own():
    mesh = _mesh()
    x = _put(mesh, jnp.ones((N, 4)), P("x"))
    fn = jax.shard_map(lambda v: (lax.psum(v, "x"), lax.all_gather(v, "x"),
                                  lax.all_gather(v, "x", to="invarying")),
                       mesh=mesh, in_specs=P("x"), out_specs=(P(), P("x"), P()))
    plain = jax.eval_shape(fn, x)
    with jax_blink.installed():
        switched = jax.eval_shape(fn, x)
        bad = jax.shard_map(lambda v: lax.all_gather(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P())
        with pytest.raises(ValueError, match="out_specs"):  # all_gather stays varying
            jax.jit(bad).lower(x)
    assert plain == switched


def test_jax_errors_for_bad_calls_are_unchanged():
    mesh = _mesh()
    x = _put(mesh, jnp.ones((N, 4)), P("x"))
    bad_calls = {
        "unbound": lambda v: lax.psum(v, "nope"),
        "scatter": lambda v: lax.psum_scatter(v, "x", tiled=False),  # dim 0 is 1, not N
    }
    for name, fn in bad_calls.items():
        errors = []
        for on in (False, True):
            with (jax_blink.installed() if on else override()):
                with pytest.raises(Exception) as e:
                    _smap(fn, mesh, P("x"), P("x"))(x)
                errors.append((type(e.value), str(e.value)))
        assert errors[0] == errors[1], name


# ---------------------------------------------------------------------------------------------
# What goes to XLA, and why.

@pytest.mark.parametrize("dtype", ["int8", "uint8", "complex64", "int16"])
def test_unsupported_dtypes_go_to_xla_with_the_reason(dtype):
    mesh = _mesh()
    x = _rand(18, (N, 6), "int32").astype(dtype)
    x = _put(mesh, x, P("x"))
    plain, switched, hlo, comms = _both(_smap(lambda v: lax.psum(v, "x"), mesh, P("x"), P()), x)
    np.testing.assert_array_equal(plain, switched)
    assert TARGET not in hlo and comms == 0
    (d,) = jax_blink.switch_report()
    assert d.runs_on == "xla" and f"dtype {dtype}" in d.reason


def test_bool_psum_is_jax_int32_psum_on_the_executor():
    # lax.psum casts bool to int32 before it binds: that int32 runs on the executor.
    mesh = _mesh()
    x = _put(mesh, _rand(19, (N, 6), "int32") > 0, P("x"))
    plain, switched, hlo, _ = _both(_smap(lambda v: lax.psum(v, "x"), mesh, P("x"), P()), x)
    np.testing.assert_array_equal(plain, switched)
    assert TARGET in hlo


def test_dispatch_table_sizes_go_to_xla():
    """On CPU host devices the table gives 8-rank all-reduces of 32-128 KiB per rank to XLA
    (measured: jax_blink/lowering/dispatch_table.py); 64 KiB here."""
    assert jax_blink.lowering.dispatch_table.prefer_lax("cpu", N, 64 << 10) and not jax_blink.lowering.dispatch_table.prefer_lax("cpu", N, 1 << 10)
    mesh = _mesh()
    x = _put(mesh, _rand(20, (N, 16384)), P("x"))
    f = _smap(lambda v: lax.psum(v, "x"), mesh, P("x"), P())
    with jax_blink.installed(), override(dispatch="auto"):
        jax_blink.switch_report(clear=True)
        hlo = f.lower(x).compile().as_text()
    (d,) = jax_blink.switch_report()
    assert d.runs_on == "xla" and "dispatch=auto" in d.reason and TARGET not in hlo


def test_platform_without_executor_goes_to_xla(monkeypatch):
    monkeypatch.setattr(_backends, "register", lambda platform: False)
    monkeypatch.setattr(jax_blink.config, "fallback", "silent")
    mesh = _mesh()
    x = _put(mesh, _rand(21, (N, 4)), P("x"))
    plain, switched, hlo, comms = _both(_smap(lambda v: lax.psum(v, "x"), mesh, P("x"), P()), x)
    _assert_same(plain, switched)
    assert TARGET not in hlo and comms == 0
    (d,) = jax_blink.switch_report()
    assert d.runs_on == "xla" and "no cpu executor" in d.reason


def test_export_and_cross_platform_lowering_go_to_xla():
    """A program serialized with jax.export, or lowered for GPUs this process does not have, must
    not hold a call that only this process's registrations can run."""
    mesh = _mesh()
    x = _put(mesh, _rand(30, (N, 4)), P("x"))
    f = _smap(lambda v: lax.psum(v, "x"), mesh, P("x"), P())
    with jax_blink.installed(), override(dispatch="blink"):
        jax_blink.switch_report(clear=True)
        exported = jax.export.export(f)(x)
        (d,) = jax_blink.switch_report(clear=True)
        assert d.runs_on == "xla" and "jax.export" in d.reason
        assert TARGET not in exported.mlir_module()
        np.testing.assert_allclose(np.asarray(exported.call(x)), np.asarray(x).sum(0, keepdims=True),
                                   rtol=1e-5)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="lowers for GPUs that this process lacks")
def test_lowering_for_devices_this_process_lacks_goes_to_xla():
    mesh = _mesh()
    x = _put(mesh, _rand(31, (N, 4)), P("x"))
    f = _smap(lambda v: lax.psum(v, "x"), mesh, P("x"), P())
    with jax_blink.installed(), override(dispatch="blink"):
        jax_blink.switch_report(clear=True)
        text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
        (d,) = jax_blink.switch_report(clear=True)
    assert d.runs_on == "xla" and "0 gpu device(s)" in d.reason and TARGET not in text


def test_axis_of_one_device_goes_to_xla():
    mesh = _mesh((1, N), ("one", "x"))
    x = _put(mesh, _rand(22, (1, N, 3)), P("one", "x"))
    fn = _smap(lambda v: lax.psum(v, "one"), mesh, P("one", "x"), P(None, "x"), check_vma=False)
    plain, switched, hlo, comms = _both(fn, x)
    _assert_same(plain, switched)
    assert all(d.runs_on == "xla" for d in jax_blink.switch_report())


def test_explain_lowering_says_where_each_call_runs():
    mesh = _mesh()
    x = _put(mesh, _rand(23, (N, 4)), P("x"))
    f = jax.shard_map(lambda v: (lax.psum(v, "x"), lax.psum(v.astype(jnp.complex64), "x")),
                      mesh=mesh, in_specs=P("x"), out_specs=P())
    with override(dispatch="blink"):
        text = jax_blink.explain_lowering(f, x)
    lines = text.splitlines()
    assert len(lines) == 2
    assert "jax_blink executor" in lines[0] and "float32" in lines[0]
    assert "XLA's own collective" in lines[1] and "dtype complex64" in lines[1]
    assert not jax_blink.is_installed()


# ---------------------------------------------------------------------------------------------
# Libraries that emit the collectives themselves.

def test_flax_batchnorm_and_optax_step_under_pmap():
    """flax's BatchNorm(axis_name=...) calls lax.pmean inside flax; the step's gradients are
    averaged with pmean and applied by optax."""
    nn = pytest.importorskip("flax.linen", reason="flax is not installed (pip install flax)")
    optax = pytest.importorskip("optax", reason="optax is not installed (pip install optax)")

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(8)(x)
            x = nn.BatchNorm(use_running_average=False, axis_name="batch")(x)
            return nn.Dense(1)(nn.relu(x))

    net, opt = Net(), optax.adam(1e-2)
    xs = jnp.asarray(_rand(24, (N, 4, 3)))
    ys = jnp.asarray(_rand(25, (N, 4, 1)))
    variables = net.init(jax.random.key(0), xs[0])
    params, stats = variables["params"], variables["batch_stats"]

    def step(params, opt_state, x, y):
        def loss(p):
            out, upd = net.apply({"params": p, "batch_stats": stats}, x, mutable=["batch_stats"])
            return jnp.mean((out - y) ** 2), upd
        (l, upd), g = jax.value_and_grad(loss, has_aux=True)(params)
        g = lax.pmean(g, "batch")
        updates, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, lax.pmean(l, "batch"), upd

    rep = lambda t: jax.tree.map(lambda a: jnp.broadcast_to(a, (N,) + a.shape), t)  # noqa: E731
    p_step = jax.pmap(step, axis_name="batch")
    args = (rep(params), rep(opt.init(params)), xs, ys)
    plain, switched, hlo, comms = _both(p_step, *args)
    _assert_same(plain, switched, rtol=1e-4)
    assert TARGET in hlo and comms > 2  # BatchNorm's mean and variance, the gradients, the loss


# ---------------------------------------------------------------------------------------------
# Explicit jax_blink.* calls: forward and reverse mode, vmap.

def test_explicit_calls_jvp_jacfwd_grad_vmap():
    mesh = _mesh()
    x = _put(mesh, _rand(26, (N, N)), P("x"))
    t = _put(mesh, _rand(27, (N, N)), P("x"))
    pairs = {"all_reduce": (jax_blink.all_reduce, lax.psum),
             "all_gather": (lambda v, a: jax_blink.all_gather(v, a, axis=1, tiled=True),
                            lambda v, a: lax.all_gather(v, a, axis=1, tiled=True)),
             "reduce_scatter": (lambda v, a: jax_blink.reduce_scatter(v, a, scatter_dimension=1, tiled=True),
                                lambda v, a: lax.psum_scatter(v, a, scatter_dimension=1, tiled=True))}
    with override(dispatch="blink"):
        for name, (ours, ref) in pairs.items():
            def run(coll, transform):
                inner = lambda v: jnp.sin(coll(jnp.cos(v), "x"))  # noqa: E731
                return transform(jax.shard_map(inner, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                               check_vma=False))
            transforms = [
                ("jvp", lambda f: jax.jit(lambda a, b: jax.jvp(f, (a,), (b,))), (x, t)),
                ("grad", lambda f: jax.jit(jax.grad(lambda a: jnp.sum(f(a) ** 2))), (x,)),
                ("vmap", lambda f: jax.jit(jax.vmap(f)), (jnp.stack([x, t]),))]
            if name == "all_reduce":  # jacfwd is jvp under vmap: once is enough
                transforms.append(("jacfwd", lambda f: jax.jit(jax.jacfwd(f)), (x[:, :2],)))
            for label, transform, args in transforms:
                compiled = run(ours, transform).lower(*args).compile()
                got = compiled(*args)
                want = run(ref, transform)(*args)
                _assert_same(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want), rtol=1e-4)
                assert TARGET in compiled.as_text(), (name, label)


def test_explicit_pmax_is_not_differentiable_as_lax_pmax_is_not():
    mesh = _mesh()
    x = _put(mesh, _rand(28, (N, 3)), P("x"))
    errors = []
    for coll in (lambda v: jax_blink.all_reduce(v, "x", op="max"), lambda v: lax.pmax(v, "x")):
        f = jax.shard_map(coll, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
        with override(dispatch="blink"), pytest.raises(Exception) as e:
            jax.jvp(f, (x,), (x,))
        errors.append(type(e.value))
    assert errors[0] == errors[1]


def test_explicit_call_over_a_vmap_bound_axis_is_lax():
    x = jnp.asarray(_rand(29, (N, 5)))
    got = jax.vmap(lambda v: jax_blink.all_reduce(v, "i"), axis_name="i")(x)
    np.testing.assert_allclose(np.asarray(got), np.broadcast_to(np.asarray(x).sum(0), x.shape), rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# python -m jax_blink run SCRIPT.py [ARGS...]

_SCRIPT = """
import os, sys
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax, jax.numpy as jnp, numpy as np
import jax_blink
from jax import lax
jax_blink.config.dispatch = "blink"
print("name", __name__, "argv", sys.argv[1:], "installed", jax_blink.is_installed())
x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
out = jax.pmap(lambda v: lax.psum(v, "i"), axis_name="i")(x)
assert np.allclose(np.asarray(out)[5], x.sum(0))
print("ran on", [d.runs_on for d in jax_blink.switch_report()])
if sys.argv[1] == "raise":
    raise KeyError("from the script")
sys.exit(int(sys.argv[1]))
"""


def _run_cli(tmp_path, *args):
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    env = {k: v for k, v in __import__("os").environ.items()}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    return subprocess.run([sys.executable, "-m", "jax_blink", "run", str(script), *args],
                          capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)


def test_cli_run_runs_the_script_as_python_would(tmp_path):
    r = _run_cli(tmp_path, "3", "--flag")
    assert r.returncode == 3, r.stderr
    assert "name __main__ argv ['3', '--flag'] installed True" in r.stdout
    assert "ran on ['jax_blink']" in r.stdout
    r = _run_cli(tmp_path, "raise")
    assert r.returncode == 1
    assert "KeyError: 'from the script'" in r.stderr and "Traceback" in r.stderr
    r = subprocess.run([sys.executable, "-m", "jax_blink", "run", str(tmp_path / "missing.py")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "missing.py" in r.stderr
