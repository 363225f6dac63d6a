"""The public collectives through the real executor of the platform, against jax.lax.

On a machine without GPUs this is the CPU executor over 8 host devices (tests/conftest.py); on
the GPU machine the same tests run over the GPUs when there are 2 or more.
"""
import json
import os
import re
import threading

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_blink

DEVICES = jax.devices()
N = len(DEVICES)
pytestmark = pytest.mark.skipif(N < 2, reason="needs 2+ devices")



@pytest.fixture(autouse=True)
def _always_the_executor():
    """These tests are about the executor: no size dispatch to lax (jax_blink.lowering.dispatch_table)."""
    old = jax_blink.config.dispatch
    jax_blink.config.dispatch = "blink"
    yield
    jax_blink.config.dispatch = old


TOL = {"float32": 1e-5, "float64": 1e-12, "bfloat16": 2e-2, "float16": 2e-3, "int32": 0, "int64": 0}


def _mesh(*shape_names):
    shape = tuple(s for s, _ in shape_names)
    names = tuple(n for _, n in shape_names)
    return jax.make_mesh(shape, names, devices=DEVICES[: int(np.prod(shape))])


def _random(rng, shape, dtype):
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return rng.integers(-1000, 1000, shape).astype(dtype)
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def _put(mesh, arr, spec):
    return jax.device_put(jnp.asarray(arr), NamedSharding(mesh, spec))


def _smap(fn, mesh, in_specs, out_specs, **kw):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kw))


def _assert_close(got, want, dtype, n):
    tol = TOL[jnp.dtype(dtype).name]
    # Compare on the host in float64 (no jax float64 needed: x64 may be off).
    got = np.asarray(jnp.asarray(got).astype(jnp.float32) if jnp.dtype(dtype).itemsize == 2 else got,
                     dtype=np.float64)
    want = np.asarray(jnp.asarray(want).astype(jnp.float32) if jnp.dtype(dtype).itemsize == 2 else want,
                      dtype=np.float64)
    if tol == 0:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * n * 4)


def _assert_same_on_every_rank(stacked):
    a = np.asarray(stacked)
    a = a.reshape(a.shape[0], -1)
    for r in range(1, a.shape[0]):
        np.testing.assert_array_equal(a[r].view(np.uint8), a[0].view(np.uint8))


# --------------------------------------------------------------------------------------------
# all_reduce

@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.lists(st.integers(1, 9), min_size=0, max_size=3).map(tuple),
       dtype=st.sampled_from(["float32", "bfloat16", "float16", "int32", "float64", "int64"]),
       op=st.sampled_from(["sum", "max", "min"]), seed=st.integers(0, 2**31 - 1))
def test_all_reduce_matches_lax(shape, dtype, op, seed):
    if dtype in ("float64", "int64") and not jax.config.jax_enable_x64:
        dtype = {"float64": "float32", "int64": "int32"}[dtype]
    mesh = _mesh((N, "x"))
    x = _put(mesh, _random(np.random.default_rng(seed), (N,) + shape, dtype), P("x"))
    lax_fn = {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}[op]
    ours = _smap(lambda v: jax_blink.all_reduce(v, "x", op=op), mesh, P("x"), P("x"))(x)
    ref = _smap(lambda v: lax_fn(v, "x"), mesh, P("x"), P("x"))(x)
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    _assert_close(ours, ref, dtype, N)
    _assert_same_on_every_rank(ours)


@pytest.mark.parametrize("count", [1, 3, 17, 1000, 65_537, 1 << 20])
def test_all_reduce_sizes(count):
    mesh = _mesh((N, "x"))
    x = _put(mesh, _random(np.random.default_rng(count), (N, count), "float32"), P("x"))
    ours = _smap(lambda v: jax_blink.all_reduce(v, "x"), mesh, P("x"), P("x"))(x)
    want = np.asarray(x, np.float64).reshape(N, count).sum(0)
    np.testing.assert_allclose(np.asarray(ours)[0], want, rtol=1e-5, atol=1e-4)
    _assert_same_on_every_rank(ours)


def test_all_reduce_replicated_output_type_matches_psum():
    mesh = _mesh((N, "x"))
    x = _put(mesh, _random(np.random.default_rng(1), (N, 8), "float32"), P("x"))
    # out_specs=P() needs a result that is invariant along "x", exactly like psum's.
    out = _smap(lambda v: jax_blink.all_reduce(v, "x"), mesh, P("x"), P())(x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(x).sum(0, keepdims=True), rtol=1e-5)


def test_all_reduce_under_pmap():
    x = _random(np.random.default_rng(2), (N, 5, 3), "float32")
    ours = jax.pmap(lambda v: jax_blink.all_reduce(v, "i"), axis_name="i")(x)
    ref = jax.pmap(lambda v: lax.psum(v, "i"), axis_name="i")(x)
    _assert_close(ours, ref, "float32", N)


@pytest.mark.skipif(N % 2, reason="needs an even device count")
def test_all_reduce_on_one_axis_of_a_2d_mesh():
    mesh = _mesh((2, "a"), (N // 2, "b"))
    x = _put(mesh, _random(np.random.default_rng(3), (2, N // 2 * 4, 6), "float32"), P("a", "b"))
    for axis in ("a", "b"):
        ours = _smap(lambda v: jax_blink.all_reduce(v, axis), mesh, P("a", "b"), P("a", "b"))(x)
        ref = _smap(lambda v: lax.psum(v, axis), mesh, P("a", "b"), P("a", "b"))(x)
        _assert_close(ours, ref, "float32", N)
    # A tuple of axes reduces over both, like lax.psum.
    ours = _smap(lambda v: jax_blink.all_reduce(v, ("a", "b")), mesh, P("a", "b"), P("a", "b"))(x)
    ref = _smap(lambda v: lax.psum(v, ("a", "b")), mesh, P("a", "b"), P("a", "b"))(x)
    _assert_close(ours, ref, "float32", N)


def test_two_independent_collectives_in_one_program():
    mesh = _mesh((N, "x"))
    rng = np.random.default_rng(4)
    x = _put(mesh, _random(rng, (N, 100), "float32"), P("x"))
    y = _put(mesh, _random(rng, (N, 33), "bfloat16"), P("x"))

    def body(a, b):
        return jax_blink.all_reduce(a, "x"), jax_blink.all_reduce(b, "x", op="max")

    oa, ob = _smap(body, mesh, (P("x"), P("x")), (P("x"), P("x")))(x, y)
    _assert_close(oa, _smap(lambda v: lax.psum(v, "x"), mesh, P("x"), P("x"))(x), "float32", N)
    _assert_close(ob, _smap(lambda v: lax.pmax(v, "x"), mesh, P("x"), P("x"))(y), "bfloat16", N)


def test_many_calls_in_a_loop():
    mesh = _mesh((N, "x"))
    x = _put(mesh, _random(np.random.default_rng(5), (N, 16), "float32"), P("x"))

    def body(v):
        # 1000 calls; the 1/N keeps the values bounded, so the result must equal the mean.
        return lax.fori_loop(0, 1000, lambda i, a: jax_blink.all_reduce(a, "x") / N, v)

    # check_vma=False: the loop carries a varying input into an invariant result (as with psum).
    out = _smap(body, mesh, P("x"), P("x"), check_vma=False)(x)
    want = np.asarray(x).mean(0)
    np.testing.assert_allclose(np.asarray(out)[0], want, rtol=1e-4, atol=1e-5)


def test_gradient_equals_psum_gradient():
    mesh = _mesh((N, "x"))
    x = _put(mesh, _random(np.random.default_rng(6), (N, 7), "float32"), P("x"))

    def grads(ar):
        return _smap(jax.grad(lambda v: jnp.sum(jnp.sin(ar(v, "x")) * v)), mesh, P("x"), P("x"))(x)

    _assert_close(grads(jax_blink.all_reduce), grads(lax.psum), "float32", N)


def test_explicit_dgx1v_topology_through_the_executor():
    # Trees planned for a partial DGX-1V allocation (not one-hop stars) run on host devices.
    topo = jax_blink.Topology.preset("dgx1v").subset([0, 1, 2, 3, 4, 5, 6, 7][:N])
    mesh = _mesh((N, "x"))
    x = _put(mesh, _random(np.random.default_rng(7), (N, 4099), "float32"), P("x"))
    for coll in ("allreduce",):
        ours = _smap(lambda v: jax_blink.all_reduce(v, "x", topology=topo), mesh, P("x"), P("x"))(x)
        _assert_close(ours, np.broadcast_to(np.asarray(x).sum(0), (N, 4099)), "float32", N)
        _assert_same_on_every_rank(ours)


# --------------------------------------------------------------------------------------------
# broadcast, reduce, all_gather, reduce_scatter

@pytest.mark.parametrize("root", [0, N - 1])
def test_broadcast_and_reduce(root):
    mesh = _mesh((N, "x"))
    x = _put(mesh, _random(np.random.default_rng(8 + root), (N, 3, 11), "float32"), P("x"))
    host = np.asarray(x)
    bc = np.asarray(_smap(lambda v: jax_blink.broadcast(v, "x", root=root), mesh, P("x"), P("x"))(x))
    for r in range(N):
        np.testing.assert_array_equal(bc[r], host[root])
    red = np.asarray(_smap(lambda v: jax_blink.reduce(v, "x", root=root), mesh, P("x"), P("x"))(x))
    np.testing.assert_allclose(red[root], host.sum(0), rtol=1e-5, atol=1e-5)
    for r in range(N):
        if r != root:
            np.testing.assert_array_equal(red[r], host[r])


@pytest.mark.parametrize("axis,tiled", [(0, False), (1, False), (0, True), (1, True)])
def test_all_gather_matches_lax(axis, tiled):
    mesh = _mesh((N, "x"))
    x = _put(mesh, _random(np.random.default_rng(9), (N * 2, 5), "int32"), P("x"))
    ours = _smap(lambda v: jax_blink.all_gather(v, "x", axis=axis, tiled=tiled), mesh, P("x"), P("x"))(x)
    ref = _smap(lambda v: lax.all_gather(v, "x", axis=axis, tiled=tiled), mesh, P("x"), P("x"))(x)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))


@pytest.mark.parametrize("dim,tiled", [(0, False), (1, True)])
def test_reduce_scatter_matches_lax(dim, tiled):
    mesh = _mesh((N, "x"))
    shape = (N, N, 3) if not tiled else (N, 2 * N, 3)
    x = _put(mesh, _random(np.random.default_rng(10), (N * shape[0],) + shape[1:], "float32"), P("x"))
    f = lambda v: jax_blink.reduce_scatter(v, "x", scatter_dimension=dim, tiled=tiled)  # noqa: E731
    g = lambda v: lax.psum_scatter(v, "x", scatter_dimension=dim, tiled=tiled)  # noqa: E731
    _assert_close(_smap(f, mesh, P("x"), P("x"))(x), _smap(g, mesh, P("x"), P("x"))(x), "float32", N)


@pytest.mark.skipif(N != 8, reason="the DGX-1V preset has 8 devices")
@pytest.mark.parametrize("collective", ["allgather", "reducescatter"])
def test_gather_and_scatter_through_the_planners_trees(collective):
    """On host devices all-gather and reduce-scatter take one star per segment; given a topology
    of other links (the DGX-1V: n-1 trees per segment, some several hops deep) the executor runs
    the planner's trees, and the results are the same."""
    from jax_blink.lowering import custom_call as C

    topo = jax_blink.Topology.preset("dgx1v")
    assert not C._shared_memory(topo) and C._shared_memory(jax_blink.Topology.host(N))
    trees = C.build_program(topo, collective, None, N * 64, 4, None, "exact")[2]
    assert trees > N  # several trees per segment: the trees path, not the stars
    mesh = _mesh((N, "x"))
    x = _put(mesh, _random(np.random.default_rng(23), (N * 3, N * 16), "float32"), P("x"))
    if collective == "allgather":
        f = lambda v: jax_blink.all_gather(v, "x", axis=1, tiled=True, topology=topo)  # noqa: E731
        g = lambda v: lax.all_gather(v, "x", axis=1, tiled=True)  # noqa: E731
    else:
        f = lambda v: jax_blink.reduce_scatter(v, "x", scatter_dimension=1, tiled=True, topology=topo)  # noqa: E731
        g = lambda v: lax.psum_scatter(v, "x", scatter_dimension=1, tiled=True)  # noqa: E731
    _assert_close(_smap(f, mesh, P("x"), P("x"))(x), _smap(g, mesh, P("x"), P("x"))(x), "float32", N)


# --------------------------------------------------------------------------------------------
# Bad input: clear errors at trace time.

def test_bad_input_errors():
    mesh = _mesh((N, "x"))
    x = _put(mesh, np.ones((N, 4), np.float32), P("x"))
    c = _put(mesh, np.ones((N, 4), np.complex64), P("x"))  # bool is summed as int32, as lax.psum sums it

    def run(fn, arg=x):
        return _smap(fn, mesh, P("x"), P("x"))(arg)

    with pytest.raises(TypeError, match="dtype complex64 is not supported"):
        run(lambda v: jax_blink.all_reduce(v, "x"), c)
    with pytest.raises(ValueError, match="op 'prod' is not supported"):
        run(lambda v: jax_blink.all_reduce(v, "x", op="prod"))
    with pytest.raises(NameError, match="unknown axis 'y'"):
        run(lambda v: jax_blink.all_reduce(v, "y"))
    with pytest.raises(ValueError, match="root must be a rank"):
        run(lambda v: jax_blink.broadcast(v, "x", root=N))
    with pytest.raises(ValueError, match="has 3 devices"):
        run(lambda v: jax_blink.all_reduce(v, "x", topology=jax_blink.Topology.host(3)))
    with pytest.raises(ValueError, match="must be equal to the axis size"):
        run(lambda v: jax_blink.reduce_scatter(v, "x"))


# --------------------------------------------------------------------------------------------
# Faults: a rank that does not take part ends in an error, not a hang.

def test_a_rank_that_skips_the_collective_times_out():
    if jax.default_backend() != "cpu":
        pytest.skip("the GPU version of this test lives in test_cuda.py")
    mesh = _mesh((N, "x"))
    x = _put(mesh, np.arange(N * 4, dtype=np.float32).reshape(N, 4) + 1, P("x"))
    old = jax_blink.config.timeout_s
    jax_blink.config.timeout_s = 1.0
    try:
        def body(v):
            skip = lax.axis_index("x") == N - 1
            return lax.cond(skip, lambda a: a, lambda a: jax_blink.all_reduce(a, "x"), v)

        f = _smap(body, mesh, P("x"), P("x"), check_vma=False)
        result = {}

        def target():
            try:
                f(x).block_until_ready()
                result["error"] = None
            except Exception as e:  # noqa: BLE001 (we check the message below)
                result["error"] = e

        t = threading.Thread(target=target, daemon=True)
        t.start()
        t.join(60)
        assert not t.is_alive(), "the mismatched collective hung instead of timing out"
        err = result["error"]
        assert err is not None, "a rank skipped the collective and no error was raised"
        msg = str(err)
        assert "waited" in msg and "tree" in msg and "chunk" in msg, msg
    finally:
        jax_blink.config.timeout_s = old
    # The executor recovers: the next well-formed call works.
    out = _smap(lambda v: jax_blink.all_reduce(v, "x"), mesh, P("x"), P("x"))(x)
    np.testing.assert_allclose(np.asarray(out)[0], np.asarray(x).sum(0))


def test_input_is_not_overwritten():
    mesh = _mesh((N, "x"))
    host = _random(np.random.default_rng(11), (N, 257), "float32")
    x = _put(mesh, host, P("x"))
    _smap(lambda v: jax_blink.all_reduce(v, "x"), mesh, P("x"), P("x"))(x).block_until_ready()
    np.testing.assert_array_equal(np.asarray(x), host)


def test_explain_names_trees_and_chunks():
    text = jax_blink.explain(jax_blink.Topology.preset("dgx1v").subset([0, 1, 4]), 1 << 20)
    assert "tree 0" in text and "chunk" in text and "bound" in text


def test_explain_names_the_two_shot_kernel_on_a_switch_only(monkeypatch):
    """3+ GPUs behind a switch take the two-shot kernel from JAX_BLINK_TWOSHOT_MIN_BYTES (16 MiB);
    a DGX-1V (its trees keep to the fast links) and smaller sizes keep the trees."""
    monkeypatch.delenv("JAX_BLINK_TWOSHOT_MIN_BYTES", raising=False)
    quad = jax_blink.Topology.preset("nvswitch:4")
    assert "run as one two-shot kernel" in jax_blink.explain(quad, 64 << 20)
    assert "run as the trees" in jax_blink.explain(quad, 4 << 20)
    assert "run as the trees" in jax_blink.explain(jax_blink.Topology.preset("dgx1v").subset([0, 1, 2, 3]), 64 << 20)
    monkeypatch.setenv("JAX_BLINK_TWOSHOT_MIN_BYTES", "0")  # off
    assert "run as the trees" in jax_blink.explain(quad, 64 << 20)


def test_explain_names_the_ll_blocks_kernel(monkeypatch):
    """Reduce-scatters and all-gathers whose blocks the LL blocks kernel takes (at most
    JAX_BLINK_LL_BYTES each) say so; the rest run the trees."""
    monkeypatch.delenv("JAX_BLINK_LL_BYTES", raising=False)
    quad = jax_blink.Topology.preset("nvswitch:4")
    ag = jax_blink.explain(quad, 4096, "allgather")  # a rank's operand is its block
    assert "run as one LL kernel" in ag and "4096-byte block" in ag
    rs = jax_blink.explain(quad, 4096, "reducescatter")  # a rank's operand holds 4 blocks
    assert "run as one LL kernel" in rs and "1024-byte block" in rs
    assert "through the trees" in jax_blink.explain(quad, 1 << 20, "allgather")
    assert "12-byte block" in jax_blink.explain(quad, 4 * 12, "reducescatter")  # the last line cut short
    monkeypatch.setenv("JAX_BLINK_LL_BYTES", "1K")
    assert "through the trees" in jax_blink.explain(quad, 4096, "allgather")


def test_explain_names_the_gpu_kernel_and_the_dispatch(monkeypatch):
    from jax_blink.lowering import dispatch_table as tuning

    pair = jax_blink.Topology.preset("nvswitch:2")
    for nbytes, kernel in ((4096, "one LL kernel"), (4 << 20, "one one-shot kernel"), (64 << 20, "the trees")):
        assert f"run as {kernel}" in jax_blink.explain(pair, nbytes)
    monkeypatch.setenv("JAX_BLINK_ONESHOT_BYTES", "2M")  # read as the executor reads it
    assert "run as the trees" in jax_blink.explain(pair, 4 << 20)
    monkeypatch.setenv("JAX_BLINK_ONESHOT_BYTES", "2MB")
    with pytest.raises(ValueError, match="JAX_BLINK_ONESHOT_BYTES='2MB' in the environment: not a byte count"):
        jax_blink.explain(pair, 4 << 20)
    monkeypatch.delenv("JAX_BLINK_ONESHOT_BYTES")
    # The dispatch, from the measured table (a made-up entry for this machine kind).
    entry = tuning.Crossover("GPU X", 2, ((1 << 20, None),), ("test",))
    monkeypatch.setattr(tuning, "CROSSOVERS", (entry,))
    monkeypatch.setattr(jax_blink.config, "dispatch", "auto")
    assert "lax.psum runs this call instead" in jax_blink.explain(pair, 4 << 20, device_kind="GPU X")
    assert "lax.psum" not in jax_blink.explain(pair, 4096, device_kind="GPU X")
    monkeypatch.setattr(jax_blink.config, "dispatch", "lax")
    assert "dispatch=lax" in jax_blink.explain(pair, 4096, device_kind="GPU X")


def test_executor_size_defaults_match_the_cuda_header():
    from jax_blink.api import explain as E

    header = open(os.path.join(os.path.dirname(__file__), "..", "..", "kernels", "cuda", "executor.h")).read()

    def value(name):
        m = re.search(rf"constexpr int64_t {name} = (?:int64_t{{(\d+)}}|(\d+)) << (\d+);", header)
        assert m, name
        return int(m.group(1) or m.group(2)) << int(m.group(3))

    assert value("kDefaultLLMaxBytes") == E.LL_BYTES
    assert value("kDefaultOneShotMaxBytes") == E.ONESHOT_BYTES
    assert value("kDefaultHostMinBytes") == E.HOST_MIN_BYTES
    assert value("kDefaultTwoShotMinBytes") == E.TWOSHOT_MIN_BYTES


def test_host_share_reaches_the_call_from_the_plan(monkeypatch):
    """The hybrid transfer's share travels in the call's ``host_share`` attribute: the plan's
    (treegen.hybrid_share) for a GPU all-reduce over a topology with host links, else 0."""
    from jax_blink.lowering import custom_call as C
    from jax_blink.lowering.mesh import platform as current_platform
    from jax_blink.planning.packing import hybrid_share

    # Every call carries the attribute: 0 on CPU host devices (no second channel); on GPUs the
    # plan's share for the devices here (the executor applies it from JAX_BLINK_HOST_MIN_BYTES).
    mesh = _mesh((2, "x"))
    x = _put(mesh, _random(np.random.default_rng(12), (2, 40), "float32"), P("x"))
    text = _smap(lambda v: jax_blink.all_reduce(v, "x"), mesh, P("x"), P("x")).lower(x).as_text()
    platform = current_platform()
    here = C._host_share(platform, C.topology_for(2, platform, None), "allreduce", None, "exact")
    assert platform != "cpu" or here == 0.0
    shares = re.findall(r"host_share\s*=\s*([-+0-9.eE]+)", text)
    calls = [line.strip()[:300] for line in text.splitlines() if "jax_blink" in line]
    assert shares and all(float(s) == pytest.approx(here, abs=1e-6) for s in shares), calls or text[-2000:]

    sw = jax_blink.Topology.preset("nvswitch:2")
    links = [(u, v, d["capacity"], d["kind"]) for u, v, d in sw.graph.edges(data=True)]
    pair = jax_blink.Topology(sw.devices, links, "h200", host_links={0: 63.0, 1: 63.0})
    monkeypatch.delenv("JAX_BLINK_HOST_ENGINE", raising=False)
    want = hybrid_share(jax_blink.plan(pair, "allreduce"))[1]
    assert 0.065 < want < 0.08  # 28 / (364 + 28): the SM host channel, the default
    assert C._host_share("gpu", pair, "allreduce", None, "exact") == pytest.approx(want)
    assert C._host_share("cpu", pair, "allreduce", None, "exact") == 0.0
    assert C._host_share("gpu", pair, "broadcast", 0, "exact") == 0.0
    assert C._host_share("gpu", sw, "allreduce", None, "exact") == 0.0  # no host links
    # The engine (JAX_BLINK_HOST_ENGINE, read as the executor reads it) sets the host rate.
    assert C.host_engine() == "sm"
    monkeypatch.setenv("JAX_BLINK_HOST_ENGINE", "ce")
    assert C.host_engine() == "ce"
    assert C._host_share("gpu", pair, "allreduce", None, "exact") == pytest.approx(
        hybrid_share(jax_blink.plan(pair, "allreduce"), "ce")[1])
    monkeypatch.setattr(jax_blink.config, "command_buffers", "auto")  # only small calls: engine kept
    assert C.host_engine() == "ce"
    monkeypatch.setattr(jax_blink.config, "command_buffers", True)  # that handler keeps the SMs
    assert C.host_engine() == "sm"
    monkeypatch.setenv("JAX_BLINK_HOST_ENGINE", "bogus")  # unknown: an error naming it, not the default
    monkeypatch.setattr(jax_blink.config, "command_buffers", False)
    with pytest.raises(ValueError, match="JAX_BLINK_HOST_ENGINE='bogus' in the environment: .*takes ce or sm"):
        C.host_engine()
    monkeypatch.setenv("JAX_BLINK_HOST_ENGINE", "SM")
    assert C.host_engine() == "sm"
    # Cached: a later trace never plans again for it.
    monkeypatch.setattr(C, "_plan", lambda *a, **k: pytest.fail("planned again"))
    assert C._host_share("gpu", pair, "allreduce", None, "exact") == pytest.approx(want)


def test_bf16_accumulates_in_float32():
    # 8 ranks of 1 + tiny: a bf16 running sum would lose the tiny parts, float32 keeps them.
    mesh = _mesh((N, "x"))
    host = np.full((N, 64), 1.0, np.float32)
    host[:, :] += np.linspace(0, 0.004, 64, dtype=np.float32)
    x = _put(mesh, host.astype(ml_dtypes.bfloat16), P("x"))
    ours = _smap(lambda v: jax_blink.all_reduce(v, "x"), mesh, P("x"), P("x"))(x)
    want = np.asarray(x).astype(np.float64).sum(0)
    np.testing.assert_allclose(np.asarray(ours).astype(np.float64)[0], want, rtol=8e-3)


def test_dispatch_picks_lax_or_the_executor():
    from jax_blink.lowering import dispatch_table as tuning

    mesh = _mesh((N, "x"))
    x = _put(mesh, np.ones((N, 8), np.float32), P("x"))

    def lowered():  # a new function each time: options are read when jit traces, and jit caches
        f = jax.shard_map(lambda v: jax_blink.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        return jax.jit(f).lower(x).as_text()

    old = jax_blink.config.dispatch
    try:
        jax_blink.config.dispatch = "lax"
        assert "jax_blink_collective" not in lowered()
        jax_blink.config.dispatch = "blink"
        assert "jax_blink_collective" in lowered()
    finally:
        jax_blink.config.dispatch = old
    # The measured table: on 2 H200s (executor 0.4) every size goes to the executor.
    assert not tuning.prefer_lax("NVIDIA H200", 2, 1024)
    assert not tuning.prefer_lax("NVIDIA H200", 2, 64 << 20)
    assert not tuning.prefer_lax("some other GPU", 2, 4096)
    # The rule itself, on an entry with two windows.
    entry = tuning.Crossover("Some GPU", 4, ((0, 1 << 20), (1 << 30, None)), ("test",))
    monkey = (entry,) + tuning.CROSSOVERS
    old_table, tuning.CROSSOVERS = tuning.CROSSOVERS, monkey
    try:
        assert tuning.prefer_lax("Some GPU", 4, 4096)
        assert not tuning.prefer_lax("Some GPU", 4, 1 << 20)
        assert tuning.prefer_lax("Some GPU", 4, 2 << 30)
        assert not tuning.prefer_lax("Some GPU", 2, 4096)  # another rank count: not listed
    finally:
        tuning.CROSSOVERS = old_table


def _bench_json(path, kind, n, points):
    """A bench result file: points are (size, dtype, speedup, slope_speedup or None)."""
    rows = [dict(size=s, dtype=d, n=n, speedup=t, **({} if sl is None else {"slope_speedup": sl}))
            for s, d, t, sl in points]
    path.write_text(json.dumps(dict(meta=dict(device_kind=kind, n=n), rows=rows)))
    return str(path)


def test_crossover_entries_derive_from_the_runs_they_cite():
    """Every dispatch entry is what derive.derive makes of the bench files it cites: the table
    cannot drift from its evidence, and the files must be in the repository."""
    from jax_blink.lowering import dispatch_table as tuning
    from jax_blink.tools import derive

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    assert tuning.CROSSOVERS
    for entry in tuning.CROSSOVERS:
        assert derive.derive(entry.sources, root=root, dtype=entry.dtype) == entry


def test_derive_sends_a_size_to_psum_only_where_it_won_every_run(tmp_path):
    from jax_blink.lowering import dispatch_table as tuning
    from jax_blink.tools import derive

    K = 1 << 10
    a = _bench_json(tmp_path / "allreduce-a.json", "GPU X", 2, [
        (1 * K, "float32", 0.8, 0.9),     # psum won by both measures
        (4 * K, "float32", 0.8, 1.3),     # the measures disagree: ours
        (16 * K, "float32", 0.9, None),   # no slope in this run: the 20-call time decides
        (16 * K, "bfloat16", 0.94, 0.7),
        (64 * K, "float32", 0.7, 0.7),
        (256 * K, "float32", 1.2, 1.1),
        (1024 * K, "float32", 0.9, 0.9)])
    c = derive.derive([a])
    assert c.device_kind == "GPU X" and c.ranks == 2 and c.sources == (a,)
    assert c.lax_ranges == ((0, 2 * K), (8 * K, 128 * K), (512 * K, None))
    assert c.prefers_lax(0) and c.prefers_lax(2 * K - 1) and not c.prefers_lax(2 * K)
    assert c.prefers_lax(100 * K) and not c.prefers_lax(300 * K) and c.prefers_lax(1 << 40)
    # A second run where ours won at 64 KiB: that size goes back to the executor.
    b = _bench_json(tmp_path / "allreduce-b.json", "GPU X", 2, [
        (s * K, "float32", 1.1 if s == 64 else 0.5, None) for s in (1, 4, 16, 64, 256, 1024)])
    assert derive.derive([a, b]).lax_ranges == ((0, 2 * K), (8 * K, 32 * K), (512 * K, None))
    # Runs that measured different sizes: each size is decided by the runs that measured it.
    d = _bench_json(tmp_path / "allreduce-d.json", "GPU X", 2, [
        (1024 * K, "float32", 0.5, 0.5), (4096 * K, "float32", 1.5, 1.5), (16384 * K, "float32", 1.5, 1.5)])
    assert derive.derive([a, d]).lax_ranges == ((0, 2 * K), (8 * K, 128 * K), (512 * K, 2048 * K))
    # One dtype that lost is enough to keep a size on the executor.
    c2 = _bench_json(tmp_path / "allreduce-c.json", "GPU X", 2, [
        (1 * K, "float32", 0.5, 0.5), (1 * K, "bfloat16", 1.01, 0.5), (4 * K, "float32", 1.5, 1.5)])
    assert derive.derive([c2]).lax_ranges == ()


def test_derive_rejects_mixed_or_foreign_files(tmp_path):
    from jax_blink.lowering import dispatch_table as tuning
    from jax_blink.tools import derive

    a = _bench_json(tmp_path / "allreduce-a.json", "GPU X", 2, [(1024, "float32", 0.5, None)])
    b = _bench_json(tmp_path / "allreduce-b.json", "GPU X", 4, [(1024, "float32", 0.5, None)])
    with pytest.raises(ValueError, match="different machines"):
        derive.derive([a, b])
    c = _bench_json(tmp_path / "broadcast-c.json", "GPU X", 2, [(1024, "float32", 0.5, None)])
    assert derive.derive([c]).collective == "broadcast"  # by its name: no collective in its meta
    with pytest.raises(ValueError, match="different collectives"):
        derive.derive([a, c])
    h = _bench_json(tmp_path / "alltoall-h.json", "GPU X", 2, [(1024, "float32", 0.5, None)])
    with pytest.raises(ValueError, match="a bench run of 'alltoall', not of a collective the table holds"):
        derive.derive([h])
    with pytest.raises(ValueError, match="not a readable bench result"):
        derive.derive([str(tmp_path / "allreduce-missing.json")])
    (tmp_path / "allreduce-bad.json").write_text("{")
    with pytest.raises(ValueError, match="not a readable bench result"):
        derive.derive([str(tmp_path / "allreduce-bad.json")])
    with pytest.raises(ValueError, match="at least one"):
        derive.derive([])
    e = _bench_json(tmp_path / "allreduce-e.json", "GPU X", 2, [(1024, "float32", None, None)])
    with pytest.raises(ValueError, match="not a readable bench result"):
        derive.derive([e])  # a row without a speedup
    (tmp_path / "allreduce-f.json").write_text(json.dumps(dict(
        meta=dict(device_kind="GPU X", n=2), rows=[dict(size=1024, dtype="float32", speedup=0.5, wrong=3)])))
    with pytest.raises(ValueError, match="had 3 wrong elements"):
        derive.derive([str(tmp_path / "allreduce-f.json")])
    (tmp_path / "allreduce-g.json").write_text(json.dumps(dict(
        meta=dict(device_kind="GPU X", n=2, collective="gather"), rows=[])))
    with pytest.raises(ValueError, match=r"a bench run of 'gather'"):  # the meta decides, not the name
        derive.derive([str(tmp_path / "allreduce-g.json")])


@pytest.mark.parametrize("why", ["no executor", "several processes"])
def test_where_the_executor_cannot_run_it_falls_back_to_lax_or_raises(monkeypatch, why):
    """No executor built for the platform, or a job of several processes without a jax.distributed
    client: lax, with a warning that says why, or an error with fallback=raise."""
    from jax_blink.lowering import backends, decision

    if why == "no executor":
        monkeypatch.setattr(backends, "register", lambda platform: False)
        reason = "no .* executor in this build"
    else:
        # Several processes meet through shared memory, named by a key from the job's
        # jax.distributed store (tests/multiprocess/test_multiprocess.py): without a client, lax.
        monkeypatch.setattr(jax, "process_count", lambda: 2)
        reason = "runs 2 processes but has no jax.distributed client"
    monkeypatch.setattr(decision, "_warned", set())
    mesh = _mesh((N, "x"))
    x = _put(mesh, _random(np.random.default_rng(12), (N, 5), "float32"), P("x"))

    def run():  # a new function each time: jit caches traces
        return _smap(lambda v: jax_blink.all_reduce(v, "x"), mesh, P("x"), P("x"))(x)

    with pytest.warns(RuntimeWarning, match=f"{reason}.* falls back to XLA's own collective"):
        out = run()
    np.testing.assert_allclose(np.asarray(out)[0], np.asarray(x).sum(0), rtol=1e-5)
    monkeypatch.setattr(jax_blink.config, "fallback", "raise")
    with pytest.raises(RuntimeError, match=reason):
        run()


@pytest.mark.parametrize("name", ["all_reduce", "broadcast", "all_gather", "reduce_scatter"])
def test_vmap_matches_lax(name):
    mesh = _mesh((N, "x"))
    x = _put(mesh, _random(np.random.default_rng(13), (N * 3, N, 2), "float32"), P("x"))
    ours = {"all_reduce": lambda v: jax_blink.all_reduce(v, "x"),
            "broadcast": lambda v: jax_blink.broadcast(v, "x", root=1),
            "all_gather": lambda v: jax_blink.all_gather(v, "x", axis=1),
            "reduce_scatter": lambda v: jax_blink.reduce_scatter(v, "x")}[name]
    ref = {"all_reduce": lambda v: lax.psum(v, "x"),
           "broadcast": lambda v: lax.psum(jnp.where(lax.axis_index("x") == 1, v, 0), "x"),
           "all_gather": lambda v: lax.all_gather(v, "x", axis=1),
           "reduce_scatter": lambda v: lax.psum_scatter(v, "x")}[name]
    got = _smap(jax.vmap(ours), mesh, P("x"), P("x"))(x)
    want = _smap(jax.vmap(ref), mesh, P("x"), P("x"))(x)
    _assert_close(got, want, "float32", N)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1),
       collective=st.sampled_from(["allreduce", "broadcast", "reduce", "allgather", "reducescatter"]))
def test_random_topologies_through_the_executor(seed, collective):
    """Plans over random connected link graphs (deep, uneven trees) run by the executor (all-gather
    and reduce-scatter through each segment's trees: on host devices they take one star each)."""
    import networkx as nx

    rng = np.random.default_rng(seed)
    graph = nx.connected_watts_strogatz_graph(N, 2 if N < 4 else 3, 0.5, seed=int(seed % 2**31))
    links = {(u, v): float(rng.choice([10.0, 20.0, 25.0, 50.0])) for u, v in graph.edges}
    topo = jax_blink.Topology.from_links(links)
    root = int(rng.integers(0, N))
    mesh = _mesh((N, "x"))
    x = _put(mesh, _random(rng, (N, N * (100 + int(rng.integers(0, 10)))), "float32"), P("x"))
    host = np.asarray(x, np.float64)
    k = host.shape[1] // N
    if collective == "allreduce":
        fn = lambda v: jax_blink.all_reduce(v, "x", topology=topo)  # noqa: E731
        want = np.broadcast_to(host.sum(0), host.shape)
    elif collective == "broadcast":
        fn = lambda v: jax_blink.broadcast(v, "x", root=root, topology=topo)  # noqa: E731
        want = np.broadcast_to(host[root], host.shape)
    elif collective == "reduce":
        fn = lambda v: jax_blink.reduce(v, "x", root=root, topology=topo)  # noqa: E731
        want = host.copy()
        want[root] = host.sum(0)
    elif collective == "allgather":
        fn = lambda v: jax_blink.all_gather(v, "x", tiled=True, topology=topo)  # noqa: E731
        want = np.tile(host, (N, 1))
    else:
        fn = lambda v: jax_blink.reduce_scatter(v, "x", scatter_dimension=1, tiled=True, topology=topo)  # noqa: E731
        want = host.sum(0).reshape(N, k)
    got = _smap(fn, mesh, P("x"), P("x"))(x)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-4)
    if collective in ("allreduce", "broadcast"):
        _assert_same_on_every_rank(got)


def test_calls_are_pure_yet_never_merged_and_an_unused_one_is_dropped():
    """The custom call carries no side-effect mark (benchmarks/NOTES.md change 5). What that relies
    on, checked in the optimized program: two calls on the same operand stay two (each site has its
    own comm_id), a call whose result is unused is removed, and results still match psum."""
    mesh = _mesh((N, "x"))
    x = _put(mesh, _random(np.random.default_rng(21), (N, 24), "float32"), P("x"))

    def twice(v):
        return jax_blink.all_reduce(v, "x"), jax_blink.all_reduce(v, "x", op="sum")

    f = _smap(twice, mesh, P("x"), (P("x"), P("x")))
    hlo = f.lower(x).compile().as_text()
    # the GPU executor's light binding lowers to jax_blink_collective_lite (NOTES.md change 8)
    assert len(re.findall(r'custom_call_target="jax_blink_collective(?:_lite)?"', hlo)) == 2, hlo[-3000:]
    a, b = f(x)
    want = _smap(lambda v: lax.psum(v, "x"), mesh, P("x"), P("x"))(x)
    _assert_close(a, want, "float32", N)
    _assert_close(b, want, "float32", N)

    def unused(v):
        jax_blink.all_reduce(v, "x")
        return v * 2

    g = _smap(unused, mesh, P("x"), P("x"))
    assert "jax_blink_collective" not in g.lower(x).compile().as_text()
    np.testing.assert_array_equal(np.asarray(g(x)), np.asarray(x) * 2)


def test_captured_handler_choice(monkeypatch):
    """command_buffers="auto" (the default) gives the capturable handler to the one-hop calls of GPUs
    (all-reduces of <= 512 KiB per rank, reduce-scatters and all-gathers of blocks <= 512 KiB,
    <= 8 ranks) and to nothing else; True and False are absolute."""
    from jax_blink.lowering import custom_call as C
    from jax_blink.planning.forms import LL_MAX_BYTES, LL_MAX_RANKS
    monkeypatch.setattr(jax_blink.config, "command_buffers", "auto")
    assert C.captured_handler("gpu", "allreduce", 4, 16 << 10)
    assert C.captured_handler("gpu", "allreduce", LL_MAX_RANKS, LL_MAX_BYTES)
    assert not C.captured_handler("gpu", "allreduce", 4, LL_MAX_BYTES + 1)
    assert not C.captured_handler("gpu", "allreduce", LL_MAX_RANKS + 1, 1024)
    # reduce-scatter and all-gather: nbytes is the call's whole operand, n blocks
    for what in ("allgather", "reducescatter"):
        assert C.captured_handler("gpu", what, 4, 4 * 1024)
        assert C.captured_handler("gpu", what, LL_MAX_RANKS, LL_MAX_RANKS * LL_MAX_BYTES)
        assert not C.captured_handler("gpu", what, 4, 4 * (LL_MAX_BYTES + 8))
        assert C.captured_handler("gpu", what, 4, 4 * 12)  # 12-byte blocks: the last line cut short
        assert not C.captured_handler("gpu", what, 4, 6)  # no whole blocks
        assert not C.captured_handler("gpu", what, LL_MAX_RANKS + 1, (LL_MAX_RANKS + 1) * 1024)
        assert not C.captured_handler("cpu", what, 4, 4 * 1024)
    assert not C.captured_handler("gpu", "broadcast", 4, 1024)
    assert not C.captured_handler("cpu", "allreduce", 4, 1024)
    monkeypatch.setattr(jax_blink.config, "command_buffers", True)
    assert C.captured_handler("gpu", "allgather", 4, 1 << 30)
    monkeypatch.setattr(jax_blink.config, "command_buffers", False)
    assert not C.captured_handler("gpu", "allreduce", 2, 1024)


def test_reset_starts_a_new_epoch_of_comm_ids():
    # Processes that lowered different numbers of call sites before a failure pair their new
    # sites again after each calls reset() (tests/multiprocess/test_faults_harness.py: "setup").
    from jax_blink.lowering import custom_call

    shift = custom_call.COMM_EPOCH_SHIFT
    before = custom_call._next_comm_id()
    jax_blink.reset()
    first, second = custom_call._next_comm_id(), custom_call._next_comm_id()
    assert first >> shift == (before >> shift) + 1 and first & ((1 << shift) - 1) == 1
    assert second == first + 1
