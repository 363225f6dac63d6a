"""The asynchronous all-reduce on GPUs (kernels/cuda/async_ffi.cc): jax_blink_start launches on a
side stream, jax_blink_done makes XLA's stream wait. Needs a CUDA build with the handlers and 2+
GPUs; every GPU present is used (4 on the lead's machine)."""
from __future__ import annotations

import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_blink
from jax_blink.api.buckets import BucketLayout, bucketed_all_reduce
from jax_blink.lowering import async_call
from jax_blink.options import override
from conftest import gpu_devices as _gpus  # tests/conftest.py: the GPUs jax lists, or none

try:
    from jax_blink import _blink_cuda
except ImportError:
    _blink_cuda = None


GPUS = _gpus()
pytestmark = pytest.mark.skipif(
    _blink_cuda is None or len(GPUS) < 2 or "jax_blink_start" not in _blink_cuda.registrations(),
    reason="needs 2+ GPUs and a CUDA build with jax_blink_start / jax_blink_done")


def _mesh():
    return jax.make_mesh((len(GPUS),), ("data",), devices=GPUS)


def _sharded(a):
    return jax.device_put(jnp.asarray(a), NamedSharding(_mesh(), P("data")))


def _sum_step(layout, overlap, kind):
    @jax.jit
    @jax.shard_map(mesh=_mesh(), in_specs=P("data"), out_specs=P())
    def f(tree):
        tree = jax.tree.map(lambda v: v[0], tree)
        if kind == "psum":
            return jax.tree.map(lambda v: lax.psum(v, "data"), tree)
        return bucketed_all_reduce(tree, "data", layout=layout, overlap=overlap)
    return f


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_overlapped_buckets_on_gpus(dtype):
    n = len(GPUS)
    rng = np.random.default_rng(7)
    shapes = {"a": (n, 3000), "b": (n, 70, 300), "c": (n, 1 << 20), "d": (n, 5)}  # LL, one-shot, trees
    if dtype is np.int32:
        tree = {k: _sharded(rng.integers(-1000, 1000, s).astype(dtype)) for k, s in shapes.items()}
    else:
        tree = {k: _sharded(rng.standard_normal(s).astype(dtype)) for k, s in shapes.items()}
    layout = BucketLayout.of(jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape[1:], v.dtype), tree),
                             bucket_bytes=64 << 10, first_bucket_bytes=8 << 10)
    assert len(layout.buckets) >= 3
    assert async_call.runs_async("gpu")
    with override(dispatch="blink"):
        f = _sum_step(layout, True, "blink")
        text = f.lower(tree).compile().as_text()
        for _ in range(5):  # several calls: the FIFO, the side stream and the call counters cycle
            ours = f(tree)
        sync = _sum_step(layout, False, "blink")(tree)
    ref = _sum_step(layout, False, "psum")(tree)
    assert len(re.findall(r'custom_call_target="jax_blink_start"', text)) == len(layout.buckets)
    assert len(re.findall(r'custom_call_target="jax_blink_done"', text)) == len(layout.buckets)
    for k in tree:
        np.testing.assert_array_equal(np.asarray(ours[k]), np.asarray(sync[k]))  # same executor, same bits
        if dtype is np.int32:
            np.testing.assert_array_equal(np.asarray(ours[k]), np.asarray(ref[k]))
        else:
            np.testing.assert_allclose(np.asarray(ours[k]), np.asarray(ref[k]), rtol=1e-5, atol=1e-4)
    jax_blink.check()
    assert _blink_cuda.async_in_flight() == 0
    comms = [c for c in _blink_cuda.comms() if c["blocks"] == _blink_cuda.async_blocks()]
    assert comms, "the asynchronous sites have a communicator of the small grid"


@pytest.mark.parametrize("hold", ["recent", "none", "weights"])
def test_value_and_grad_overlapped_on_gpus(hold):
    """value_and_grad_overlapped with each hold on every GPU: six linear layers on small integers
    in float32 (every sum exact), so its summed gradients equal value_and_grad + psum bit for
    bit, again on reuse; its buckets are jax_blink_start / jax_blink_done pairs in the compiled
    program."""
    rng = np.random.default_rng(60)
    params = [{"w": jnp.asarray(rng.integers(-1, 2, (64, 64)), jnp.float32),
               "b": jnp.asarray(rng.integers(-1, 2, (64,)), jnp.float32)} for _ in range(6)]
    x = _sharded(rng.integers(-2, 3, (len(GPUS), 8, 64)).astype(np.float32))

    def loss(ps, v):
        for layer in ps:
            v = v @ layer["w"] + layer["b"]
        return jnp.sum(v)

    def step(kind):
        @jax.jit
        @jax.shard_map(mesh=_mesh(), in_specs=(P(), P("data")), out_specs=P())
        def f(ps, xs):
            mine = jax.tree.map(lambda a: lax.pcast(a, "data", to="varying"), ps)
            if kind == "psum":
                return lax.psum(jax.grad(loss)(mine, xs[0]), "data")
            return jax_blink.value_and_grad_overlapped(loss, "data", bucket_bytes=20 << 10, first_bucket_bytes=4 << 10,
                                                       hold=hold)(mine, xs[0])[1]
        return f

    want = step("psum")(params, x)
    with override(dispatch="blink"):
        f = step("overlap")
        text = f.lower(params, x).compile().as_text()
        got = [f(params, x) for _ in range(3)]
    assert len(re.findall(r'custom_call_target="jax_blink_start"', text)) >= 3, text[:2000]
    for g in got:
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    jax_blink.check()
    assert _blink_cuda.async_in_flight() == 0


def test_start_done_api_on_gpus():
    n = len(GPUS)
    rng = np.random.default_rng(8)
    x = _sharded(rng.standard_normal((n, 4097)).astype(np.float32))

    @jax.jit
    @jax.shard_map(mesh=_mesh(), in_specs=P("data"), out_specs=(P(), P()))
    def f(v):
        h1 = jax_blink.all_reduce_start(v[0], "data")
        y = jnp.tanh(v[0]) @ jnp.ones((4097, 64), jnp.float32)  # compute between start and done
        h2 = jax_blink.all_reduce_start(y, "data")
        return jax_blink.all_reduce_done(h1, after=h2), jax_blink.all_reduce_done(h2)

    with override(dispatch="blink"):
        s1, s2 = f(x)
    np.testing.assert_allclose(np.asarray(s1), np.asarray(x).sum(0), rtol=1e-5, atol=1e-4)
    y = np.tanh(np.asarray(x)) @ np.ones((4097, 64), np.float32)
    np.testing.assert_allclose(np.asarray(s2), y.sum(0), rtol=1e-4, atol=1e-2)
    assert _blink_cuda.async_in_flight() == 0


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.int32])
def test_copy_engine_form_on_gpus(dtype, monkeypatch):
    """JAX_BLINK_ASYNC_ENGINE=ce: the copy engines move the bytes, a few blocks add them up; every
    bucket (sizes below n chunks of 16 bytes, ragged, over 1 MiB) equals psum (integers exactly, floats
    within roundings), on fresh random data after the outputs were poisoned by an earlier call."""
    monkeypatch.setenv("JAX_BLINK_ASYNC_ENGINE", "ce")
    n = len(GPUS)
    rng = np.random.default_rng(17)
    shapes = {"a": (n, 3001), "b": (n, 70, 301), "c": (n, (1 << 20) + 3), "d": (n, 5)}

    def fresh():
        if dtype is np.int32:
            return {k: _sharded(rng.integers(-1000, 1000, s).astype(dtype)) for k, s in shapes.items()}
        return {k: _sharded(jnp.asarray(rng.standard_normal(s), dtype)) for k, s in shapes.items()}

    poison = {k: _sharded(jnp.full(s, 7, dtype)) for k, s in shapes.items()}
    tree = fresh()
    layout = BucketLayout.of(jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape[1:], v.dtype), tree),
                             bucket_bytes=64 << 10, first_bucket_bytes=8 << 10)
    with override(dispatch="blink"):
        f = _sum_step(layout, True, "blink")
        f(poison)
        for _ in range(3):  # the host meetings and the events cycle over calls
            ours = f(tree)
    ref = _sum_step(layout, False, "psum")(tree)
    for k in tree:
        got, want = np.asarray(ours[k]).astype(np.float64), np.asarray(ref[k]).astype(np.float64)
        if dtype is np.int32:
            np.testing.assert_array_equal(got, want)
        else:
            exact = np.asarray(tree[k]).astype(np.float64).sum(0)
            rtol = 2.0 ** -7 * n if dtype is jnp.bfloat16 else 1e-5
            np.testing.assert_allclose(got, exact, rtol=rtol, atol=rtol * 4)
    jax_blink.check()
    assert _blink_cuda.async_in_flight() == 0


@pytest.mark.parametrize("piece,gather,full_grid,scatter", [("16K", "pull", False, "pull"), ("1M", "pull", False, "pull"),
                                                            ("16K", "push", False, "pull"), ("1M", "push", False, "pull"),
                                                            ("16K", "pull", True, "pull"), ("16K", "pull", False, "push"),
                                                            ("1M", "push", False, "push"), ("16K", "push", False, "push")])
def test_copy_engine_pieces(piece, gather, full_grid, scatter, monkeypatch):
    """The copy engines' chunks cut into pieces (16K: the most pieces, 16 per chunk, with a ragged
    last one; 1M: one piece per chunk here), the reduce-scatter and the all-gather each pulled or
    pushed; with full_grid the
    start runs the executor's kernel instead (the last bucket's engine): equal to
    psum exactly (int32), on fresh random data, after a call that wrote other values into the
    same program's outputs."""
    monkeypatch.setenv("JAX_BLINK_ASYNC_ENGINE", "ce")
    monkeypatch.setenv("JAX_BLINK_CE_PIECE_BYTES", piece)
    monkeypatch.setenv("JAX_BLINK_CE_GATHER", gather)
    monkeypatch.setenv("JAX_BLINK_CE_SCATTER", scatter)
    n = len(GPUS)
    rng = np.random.default_rng(23)

    @jax.jit
    @jax.shard_map(mesh=_mesh(), in_specs=P("data"), out_specs=P())
    def f(v):
        return jax_blink.all_reduce_done(jax_blink.all_reduce_start(v[0], "data", full_grid=full_grid))

    shape = (n, (1 << 20) + 13)
    with override(dispatch="blink"):
        f(_sharded(rng.integers(-9, 9, shape).astype(np.int32)))  # another result first, then fresh data
        for _ in range(2):
            x = rng.integers(-1000, 1000, shape).astype(np.int32)
            np.testing.assert_array_equal(np.asarray(f(_sharded(x))), x.sum(0))
    jax_blink.check()
    assert _blink_cuda.async_in_flight() == 0


@pytest.mark.parametrize("env,bad", [({"JAX_BLINK_ASYNC_ENGINE": "dma"}, "JAX_BLINK_ASYNC_ENGINE='dma'"),
                                     ({"JAX_BLINK_ASYNC_ENGINE": "ce", "JAX_BLINK_CE_PIECE_BYTES": "lots"},
                                      "JAX_BLINK_CE_PIECE_BYTES='lots'"),
                                     ({"JAX_BLINK_ASYNC_ENGINE": "ce", "JAX_BLINK_CE_GATHER": "scatter"},
                                      "JAX_BLINK_CE_GATHER='scatter'"),
                                     ({"JAX_BLINK_ASYNC_ENGINE": "ce", "JAX_BLINK_CE_SCATTER": "gather"},
                                      "JAX_BLINK_CE_SCATTER='gather'")])
def test_copy_engine_value_not_understood(env, bad, monkeypatch):
    """A value the copy engines' variables do not take fails the start, naming it."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    x = _sharded(np.ones((len(GPUS), 64), np.float32))

    @jax.jit
    @jax.shard_map(mesh=_mesh(), in_specs=P("data"), out_specs=P())
    def f(v):
        return jax_blink.all_reduce_done(jax_blink.all_reduce_start(v[0], "data"))

    with override(dispatch="blink"), pytest.raises(Exception, match=re.escape(bad) + " is not understood"):
        np.asarray(f(x))
    # The refused start left nothing behind that reset() would trip over (it crashed the suite's
    # process once: a group entry without a group).
    jax_blink.reset()
    for name in env:
        monkeypatch.delenv(name)
    with override(dispatch="blink"):
        np.testing.assert_array_equal(np.asarray(f(x)), np.full(64, len(GPUS), np.float32))


@pytest.mark.skipif(len(GPUS) < 3, reason="the refusal applies to 3+ ranks")
@pytest.mark.parametrize("blocks", ["8", "3"])
def test_a_small_asynchronous_grid_sums_right(blocks, monkeypatch):
    """JAX_BLINK_ASYNC_BLOCKS=8 faulted (an illegal address on every GPU) on 4 x H200 in
    ResNet-50's step: the two-shot kernel's plan, laid out for 2 flags per piece, was given the
    trees' units, more than that room on a small grid, and set-up wrote past its host buffer. A
    20 MiB bucket (the two-shot kernel on 3+ GPUs) on small grids equals psum, over several calls."""
    n = len(GPUS)
    rng = np.random.default_rng(9)
    # Reversed leaf order: c, then b (20 MiB) close the first bucket; a alone is the last bucket,
    # which runs on the whole grid.
    tree = {"a": _sharded(rng.integers(-1000, 1000, (n, 1000)).astype(np.int32)),
            "b": _sharded(rng.integers(-1000, 1000, (n, 5 << 20)).astype(np.int32)),
            "c": _sharded(rng.integers(-1000, 1000, (n, 1000)).astype(np.int32))}
    layout = BucketLayout.of(jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape[1:], v.dtype), tree),
                             bucket_bytes=1 << 20, first_bucket_bytes=1 << 20)
    assert [[s.path for s in b.slots] for b in layout.buckets] == [["['c']", "['b']"], ["['a']"]]
    monkeypatch.setenv("JAX_BLINK_ASYNC_BLOCKS", blocks)
    with override(dispatch="blink"):
        f = _sum_step(layout, True, "blink")
        for _ in range(5):
            ours = jax.block_until_ready(f(tree))
    ref = _sum_step(layout, False, "psum")(tree)
    for k in tree:
        np.testing.assert_array_equal(np.asarray(ours[k]), np.asarray(ref[k]))
    assert _blink_cuda.async_in_flight() == 0
