"""The light binding of the CUDA executor (issue 17): a call carries its comm_id alone and the call
site's program, op, time budget and host share are registered once (``register_call_site``).

Registration checks need the CUDA module only (no GPU); the calls need one GPU (two for the
lowering through ``jax_blink.all_reduce``).
"""
from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_blink
from jax_blink.lowering import backends as _backends
from jax_blink.lowering import custom_call
from jax_blink.planning import schedule as S
from jax_blink.options import override
from conftest import gpu_devices as _gpus  # tests/conftest.py: the GPUs jax lists, or none

try:
    from jax_blink import _blink_cuda
except ImportError:  # not built (no nvcc) or not importable here
    _blink_cuda = None

needs_module = pytest.mark.skipif(_blink_cuda is None, reason="needs jax_blink._blink_cuda (a CUDA build)")
_ids = itertools.count(2 * 10**9)  # far from collectives.py's ids and test_cuda.py's


needs_gpu = pytest.mark.skipif(_blink_cuda is None or not _gpus(), reason="needs a GPU and jax_blink._blink_cuda")


@functools.cache
def _register() -> None:
    assert _backends.register("gpu")


def _one_rank_program(n: int) -> list[int]:
    return [int(w) for w in S.encode(S.Schedule(1, n, n, ()))]


@needs_module
def test_register_call_site_is_idempotent_and_refuses_a_changed_site():
    cid = next(_ids)
    prog = _one_rank_program(256)
    _blink_cuda.register_call_site(cid, prog, 0, 10_000, 0.0)
    _blink_cuda.register_call_site(cid, prog, 0, 10_000, 0.0)  # the same jaxpr lowered again
    with pytest.raises(ValueError, match=f"collective {cid}.*registered twice with a different program"):
        _blink_cuda.register_call_site(cid, _one_rank_program(257), 0, 10_000, 0.0)
    with pytest.raises(ValueError, match="registered twice"):
        _blink_cuda.register_call_site(cid, prog, 1, 10_000, 0.0)
    with pytest.raises(ValueError, match="op 3 is not supported"):
        _blink_cuda.register_call_site(next(_ids), prog, 3, 10_000, 0.0)
    with pytest.raises(ValueError, match="program is empty"):
        _blink_cuda.register_call_site(next(_ids), [], 0, 10_000, 0.0)


def test_full_binding_variable_is_checked(monkeypatch):
    monkeypatch.setenv("JAX_BLINK_FULL_BINDING", "maybe")
    with pytest.raises(ValueError, match="JAX_BLINK_FULL_BINDING='maybe' in the environment: not 0 or 1"):
        custom_call._light_binding("gpu")
    monkeypatch.setenv("JAX_BLINK_FULL_BINDING", "1")
    assert not custom_call._light_binding("gpu")
    monkeypatch.delenv("JAX_BLINK_FULL_BINDING")
    assert not custom_call._light_binding("cpu")  # the CPU executor keeps its binding
    assert custom_call._light_binding("gpu") == _backends.has_call_sites("gpu")


# The light handlers' one-rank chains: tests/gpu/test_cuda.py::test_one_rank_chain_is_the_identity
# runs them beside the full binding's.


@needs_gpu
@pytest.mark.gpu
def test_an_unregistered_call_site_is_refused_by_name():
    _register()
    x = jnp.asarray(np.random.default_rng(3).standard_normal(64), jnp.float32)
    cid = next(_ids)
    call = jax.ffi.ffi_call(_backends.TARGET_LITE, jax.ShapeDtypeStruct(x.shape, x.dtype))
    with pytest.raises(Exception, match=f"collective {cid}\\): this call site was not registered"):
        np.asarray(jax.jit(lambda v: call(v, jnp.int32(0), jnp.int32(0), comm_id=np.int64(cid)))(x))


def _two_gpu_all_reduce(full_binding: bool, monkeypatch, command_buffers=False):
    gpus = _gpus()
    if len(gpus) < 2:
        pytest.skip("needs >= 2 GPUs")
    if full_binding:
        monkeypatch.setenv("JAX_BLINK_FULL_BINDING", "1")
    mesh = jax.make_mesh((2,), ("x",), devices=gpus[:2])
    x = jax.device_put(jnp.asarray(np.random.default_rng(5).standard_normal((2, 1000)), jnp.float32),
                       NamedSharding(mesh, P("x")))
    with override(dispatch="blink", command_buffers=command_buffers):
        f = jax.jit(jax.shard_map(lambda v: jax_blink.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P()))
        text = f.lower(x).as_text()
        got = np.asarray(f(x), np.float64)
    want = np.asarray(x, np.float64).sum(axis=0, keepdims=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    return text


@needs_gpu
@pytest.mark.gpu
def test_all_reduce_lowers_to_the_light_binding_and_matches_the_sum(monkeypatch):
    text = _two_gpu_all_reduce(False, monkeypatch)
    assert "@jax_blink_collective_lite(" in text and "program" not in text.split("@jax_blink_collective_lite(")[1][:400]


@needs_gpu
@pytest.mark.gpu
def test_small_all_reduce_takes_the_capturable_light_binding_by_default(monkeypatch):
    """command_buffers="auto" (the default): a one-hop all-reduce (4000 B) lowers to the light
    handler that XLA may capture, and gives the sum."""
    text = _two_gpu_all_reduce(False, monkeypatch, command_buffers="auto")
    assert f"@{_backends.TARGET_LITE_CB}(" in text


@needs_gpu
@pytest.mark.gpu
def test_full_binding_on_request(monkeypatch):
    text = _two_gpu_all_reduce(True, monkeypatch)
    assert "@jax_blink_collective(" in text and "jax_blink_collective_lite" not in text


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("target", [_backends.TARGET_LITE, _backends.TARGET_LITE_CB])
def test_one_rank_copies_alternating_with_xla_kernels_keep_stream_order(target):
    """XLA's kernels (v * 2) and our one-rank copies alternate on one stream, plain and captured by
    XLA: each copy reads what the kernel before it wrote (exact, every bit)."""
    _register()
    n = 1000
    x = jnp.asarray(np.random.default_rng(7).standard_normal(n), jnp.float32)
    prog = _one_rank_program(n)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype))

    def chain(v):
        for _ in range(8):
            cid = next(_ids)
            _backends.register_call_site("gpu", cid, prog, 0, 10_000, 0.0)
            v = call(v * 2.0, jnp.int32(0), jnp.int32(0), comm_id=np.int64(cid))
        return v

    f = jax.jit(chain)
    for _ in range(3):  # set-up, then replays
        got = np.asarray(f(x))
        assert got.tobytes() == (np.asarray(x) * 256.0).tobytes(), target
    _blink_cuda.check()
