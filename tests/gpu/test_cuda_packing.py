"""The bucket packing's copy kernel on GPUs (kernels/cuda/pack_ffi.cc, segments.cuh):
``jax_blink_pack`` lays leaves one after another as XLA's concatenation does, ``jax_blink_unpack``
gives them back bit for bit, whatever their sizes and alignments, and a bucketed all-reduce, the
overlapped form and the switch give the same sums with it as with XLA's packing."""
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
from jax_blink.lowering import packing
from jax_blink.options import override
from conftest import gpu_devices as _gpus

try:
    from jax_blink import _blink_cuda
except ImportError:
    _blink_cuda = None

GPUS = _gpus()
pytestmark = pytest.mark.skipif(
    _blink_cuda is None or not GPUS or "jax_blink_pack" not in _blink_cuda.registrations(),
    reason="needs a GPU and a CUDA build with jax_blink_pack / jax_blink_unpack")

# Lengths that leave the packed offsets off 16, 8, 4 and 2 bytes, a leaf of none, more leaves than
# one launch's table (96), and a leaf larger than one pass of the grid (264 blocks x 16 KiB).
SIZES = [3, 1, 0, 4099, 2, 7, 1 << 16, 5] + [11] * 100 + [(5 << 20) + 3]


def _leaves(dtype, rng):
    shapes = [(s,) if s % 2 else (2, s // 2) if s else (0, 4) for s in SIZES]
    if np.dtype(dtype).kind == "f":
        return [rng.standard_normal(sh).astype(dtype) for sh in shapes]
    return [rng.integers(-(1 << 20), 1 << 20, sh).astype(dtype) for sh in shapes]


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16, np.int32, np.int8])
def test_pack_is_concatenate_and_unpack_its_inverse(dtype):
    rng = np.random.default_rng(21)
    xs = [jax.device_put(h, GPUS[0]) for h in _leaves(dtype, rng)]
    host = [np.asarray(x) for x in xs]  # as the device holds them

    @jax.jit
    def f(*vs):
        with override(bucket_packing="kernel"):
            flat = packing.join(list(vs), "gpu")
            back = packing.split(flat * 1, [v.shape for v in vs], "gpu")  # *1: not the packed buffer itself
        return flat, back

    text = f.lower(*xs).compile().as_text()
    assert 'custom_call_target="jax_blink_pack"' in text and 'custom_call_target="jax_blink_unpack"' in text
    flat, back = f(*xs)
    want = np.concatenate([h.reshape(-1) for h in host])
    np.testing.assert_array_equal(np.asarray(flat), want)
    for b, h in zip(back, host):
        assert b.shape == h.shape and b.dtype == h.dtype
        np.testing.assert_array_equal(np.asarray(b), h)


def _mesh():
    return jax.make_mesh((len(GPUS),), ("data",), devices=GPUS)


@pytest.mark.skipif(len(GPUS) < 2, reason="needs 2+ GPUs")
@pytest.mark.parametrize("overlap", [False, True])
def test_bucketed_all_reduce_with_the_kernel_equals_xlas_packing(overlap):
    n = len(GPUS)
    rng = np.random.default_rng(22)
    shapes = {"a": (3000,), "b": (70, 301), "c": (1 << 20,), "d": (5,), "e": (3, 3, 7)}
    tree = {k: jax.device_put(jnp.asarray(rng.standard_normal((n, *s)).astype(np.float32)),
                              NamedSharding(_mesh(), P("data"))) for k, s in shapes.items()}
    layout = BucketLayout.of({k: jax.ShapeDtypeStruct(s, np.float32) for k, s in shapes.items()},
                             bucket_bytes=256 << 10, first_bucket_bytes=16 << 10)
    assert max(len(b.slots) for b in layout.buckets) > 1

    def run(packing_name):
        @jax.jit
        @jax.shard_map(mesh=_mesh(), in_specs=P("data"), out_specs=P())
        def f(t):
            return bucketed_all_reduce(jax.tree.map(lambda v: v[0], t), "data", layout=layout, overlap=overlap)
        with override(dispatch="blink", bucket_packing=packing_name):
            return f(tree), f.lower(tree).compile().as_text()

    ours, text = run("kernel")
    xla, _ = run("xla")
    assert len(re.findall(r'custom_call_target="jax_blink_pack"', text)) == sum(len(b.slots) > 1 for b in layout.buckets)
    for k in tree:
        np.testing.assert_array_equal(np.asarray(ours[k]), np.asarray(xla[k]))  # the same sums, bit for bit
        np.testing.assert_allclose(np.asarray(ours[k]), np.asarray(tree[k]).sum(0), rtol=1e-5, atol=1e-4)
    jax_blink.check()


@pytest.mark.skipif(len(GPUS) < 2, reason="needs 2+ GPUs")
def test_the_switch_packs_merged_psums_with_the_kernel():
    n = len(GPUS)
    rng = np.random.default_rng(23)
    shapes = [(1000,), (33, 17), (4096,), (3,)]
    xs = [jax.device_put(jnp.asarray(rng.standard_normal((n, *s)).astype(np.float32)),
                         NamedSharding(_mesh(), P("data"))) for s in shapes]

    @jax.jit
    @jax.shard_map(mesh=_mesh(), in_specs=P("data"), out_specs=P())
    def f(*vs):
        return lax.psum([v[0] for v in vs], "data")  # adjacent psums: one merged call

    with jax_blink.installed(), override(dispatch="blink", bucket_packing="kernel"):
        text = f.lower(*xs).compile().as_text()
        got = f(*xs)
    assert 'custom_call_target="jax_blink_pack"' in text
    for g, x in zip(got, xs):
        np.testing.assert_allclose(np.asarray(g), np.asarray(x).sum(0), rtol=1e-5, atol=1e-5)
    jax_blink.check()
