"""The CUDA executor through JAX: the "jax_blink_collective" target called by hand (programs built
here, not planned) inside ``jax.shard_map`` over 2 GPUs, compared with ``lax.psum``; on one GPU,
one-rank calls (the identity) through both handlers, as the overhead probe chains them.

Skipped unless JAX sees a GPU and ``jax_blink._blink_cuda`` imports; the 2-GPU tests need 2. The
standalone ``tests/native/cuda_selftest.cu`` covers more (N ranks as streams of one GPU, poisoned
outputs, CUDA graphs, the benchmark).
"""
from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P
from conftest import gpu_devices as _gpus  # tests/conftest.py: the GPUs jax lists, or none

pytestmark = pytest.mark.gpu

try:
    from jax_blink import _blink_cuda
except ImportError:  # not built (no nvcc) or not importable here
    _blink_cuda = None

from jax_blink.planning import schedule as S


if len(_gpus()) < 1 or _blink_cuda is None:
    pytest.skip("needs a GPU and jax_blink._blink_cuda", allow_module_level=True)
two_gpus = pytest.mark.skipif(len(_gpus()) < 2, reason="needs >= 2 GPUs")

TARGET = "jax_blink_collective"
_ids = itertools.count(10**9)  # far from jax_blink.api.collectives' ids


@functools.cache
def _register():
    try:
        from jax_blink.lowering import backends as _backends
        if _backends.register("gpu"):
            return
    except Exception:
        pass
    for name, cap in _blink_cuda.registrations().items():
        jax.ffi.register_ffi_target(name, cap, platform="CUDA")


def _mesh():
    return Mesh(np.array(_gpus()[:2]), ("x",))


def _split_stars(n, total, itemsize, phases=3):
    align = max(1, 16 // itemsize)
    segs, at = [], 0
    for r in range(n):
        length = total - at if r == n - 1 else (total // n) // align * align
        parent = tuple(-1 if q == r else r for q in range(n))
        segs.append(S.TreeSegment(r, phases, at, length, parent))
        at += length
    return segs


def _program(n, total, itemsize, segments=None, chunk_bytes=64 * 1024):
    segs = _split_stars(n, total, itemsize) if segments is None else segments
    return S.make_schedule(n, total, itemsize, segs, chunk_bytes=chunk_bytes).program()


def _call(v, program, op=0, comm_id=None, timeout_ms=10_000, host_share=0.0):
    """One custom call on the flat per-device operand v (inside shard_map over axis "x").
    ``host_share``: the fraction of an all-reduce the executor may send through pinned host
    memory (used from JAX_BLINK_HOST_MIN_BYTES on; JAX_BLINK_HOST_SHARE overrides it)."""
    rank = lax.axis_index("x").astype(jnp.int32)
    out_type = jax.eval_shape(lambda u: lax.psum(u, "x"), v)  # psum's (replicated) result type
    call = jax.ffi.ffi_call(TARGET, out_type, has_side_effect=True)
    return call(v, rank, jnp.int32(0), program=program, op=np.int32(op),
                comm_id=np.int64(next(_ids) if comm_id is None else comm_id),
                timeout_ms=np.int64(timeout_ms), host_share=np.float32(host_share))


_LAX = {0: lax.psum, 1: lax.pmax, 2: lax.pmin}


def _run(fn, x):
    mesh = _mesh()
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    return np.asarray(jax.device_get(f(x)))


def _data(n_per, dtype, seed):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind in "iu":
        return jnp.asarray(rng.integers(-1000, 1000, size=2 * n_per), dtype=dtype)
    return jnp.asarray(rng.standard_normal(2 * n_per), dtype=dtype)


def _check(got, want, dtype, n_per):
    tol = {"bfloat16": 2e-2, "float16": 2e-3, "float32": 1e-5, "float64": 1e-12}.get(np.dtype(dtype).name, 0)
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)
    # Both ranks bitwise identical.
    assert got[:n_per].tobytes() == got[n_per:].tobytes()


# Which kernel an all-reduce site runs is decided at its set-up from these limits (read from the
# environment then): "tree" turns both one-shot kernels off, "ll" raises the LL limit to what the
# staging holds for 2 ranks, "oneshot" turns LL off.
_MODE_ENV = {
    "tree": {"JAX_BLINK_LL_BYTES": "0", "JAX_BLINK_ONESHOT_BYTES": "0"},
    "ll": {"JAX_BLINK_LL_BYTES": str(8 << 20)},
    "oneshot": {"JAX_BLINK_LL_BYTES": "0"},
}


def _sites_by_mode():
    total = {"tree": 0, "ll": 0, "oneshot": 0, "hybrid": 0, "twoshot": 0, "ll-blocks": 0}
    for c in _blink_cuda.comms():
        for m, k in c["sites_by_mode"].items():
            total[m] = total.get(m, 0) + k
    return total


@two_gpus
@pytest.mark.parametrize("mode", ["auto", "tree", "ll", "oneshot"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64", "int32", "int64"])
@pytest.mark.parametrize("n_per", [1, 1000, 4099, 1 << 18])
def test_allreduce_sum_matches_psum(dtype, n_per, mode, monkeypatch):
    _register()
    if dtype in ("float64", "int64") and not jax.config.jax_enable_x64:
        pytest.skip("needs jax_enable_x64")
    if mode != "auto" and dtype not in ("float32", "bfloat16", "int32"):
        pytest.skip("every kernel on three dtypes; the rest on the default choice")
    for k, v in _MODE_ENV.get(mode, {}).items():
        monkeypatch.setenv(k, v)
    itemsize = np.dtype(jnp.dtype(dtype)).itemsize
    program = _program(2, n_per, itemsize)
    x = _data(n_per, dtype, seed=n_per)
    before = _sites_by_mode()
    got = _run(lambda v: _call(v, program), x)
    after = _sites_by_mode()
    want = _run(lambda v: lax.psum(v, "x"), x)
    _check(got, want, dtype, n_per)
    _blink_cuda.check()
    if mode != "auto":  # 2 new sites (one per GPU), both in the mode asked for
        assert after[mode] - before[mode] == 2, (before, after)


@two_gpus
@pytest.mark.parametrize("share_from", ["env", "attribute"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_allreduce_hybrid_host_channel_matches_psum(dtype, share_from, monkeypatch):
    """Blink's hybrid transfer: a quarter of the elements go GPU -> pinned host memory -> GPU,
    the rest through the trees over NVLink; the sum must be psum's, on both ranks alike.

    The executor reads the environment when a call site is set up (the first call of a newly
    traced function), so it is set before that. The one-shot kernels are turned off: this size
    would take them otherwise."""
    _register()
    n_per = (1 << 20) + 5  # not a multiple of the 16-byte alignment: a ragged tail
    monkeypatch.setenv("JAX_BLINK_HOST_MIN_BYTES", "65536")
    for k, v in _MODE_ENV["tree"].items():
        monkeypatch.setenv(k, v)
    if share_from == "env":
        monkeypatch.setenv("JAX_BLINK_HOST_SHARE", "0.25")
        host_share = 0.0  # the environment overrides the attribute
    else:
        monkeypatch.delenv("JAX_BLINK_HOST_SHARE", raising=False)
        host_share = 0.25
    itemsize = np.dtype(jnp.dtype(dtype)).itemsize
    program = _program(2, n_per, itemsize)
    x = _data(n_per, dtype, seed=21)
    before = _sites_by_mode()
    got = _run(lambda v: _call(v, program, host_share=host_share), x)
    after = _sites_by_mode()
    want = _run(lambda v: lax.psum(v, "x"), x)
    _check(got, want, dtype, n_per)
    _blink_cuda.check()
    assert after["hybrid"] - before["hybrid"] == 2, (before, after)  # one site per GPU
    assert max(c.get("host_bytes", 0) for c in _blink_cuda.comms()) > 0


@two_gpus
@pytest.mark.parametrize("op", [1, 2])
def test_allreduce_max_min(op):
    _register()
    n_per = 12345
    program = _program(2, n_per, 4)
    x = _data(n_per, "float32", seed=op)
    got = _run(lambda v: _call(v, program, op=op), x)
    want = _run(lambda v: _LAX[op](v, "x"), x)
    np.testing.assert_array_equal(got, want)


@two_gpus
def test_single_tree_and_broadcast_only():
    _register()
    n_per = 50000
    # One tree rooted at rank 1 over the first 30000 elements, a broadcast-only tree from rank 0
    # over the rest.
    segs = [S.TreeSegment(1, 3, 0, 30000, (1, -1)), S.TreeSegment(0, 2, 30000, 20000, (-1, 0))]
    program = _program(2, n_per, 4, segments=segs, chunk_bytes=16 * 1024)
    x = _data(n_per, "float32", seed=3)
    got = _run(lambda v: _call(v, program), x)
    xs = np.asarray(x).reshape(2, n_per)
    want = np.concatenate([xs[0][:30000] + xs[1][:30000], xs[0][30000:]])
    np.testing.assert_allclose(got[:n_per], want, rtol=1e-6)
    assert got[:n_per].tobytes() == got[n_per:].tobytes()


@two_gpus
def test_two_collectives_in_one_program():
    _register()
    n_per = 1 << 16
    p = _program(2, n_per, 4)
    x = _data(n_per, "float32", seed=5)

    def fn(v):
        a = _call(v, p)
        b = _call(v * 2, p)
        return a + b

    got = _run(fn, x)
    want = _run(lambda v: lax.psum(v, "x") + lax.psum(v * 2, "x"), x)
    _check(got, want, "float32", n_per)


@two_gpus
def test_chained_calls_in_a_loop():
    _register()
    n_per = 4096
    p = _program(2, n_per, 4)
    cid = next(_ids)
    x = _data(n_per, "float32", seed=9)

    def fn(v):
        v = lax.psum(v, "x") * 0.5  # replicated start: then every call is exactly v -> 2 v
        return lax.fori_loop(0, 200, lambda i, u: _call(u, p, comm_id=cid) * 0.5, v)

    got = _run(fn, x)
    want = _run(lambda v: lax.psum(v, "x") * 0.5, x)
    np.testing.assert_array_equal(got, want)
    _blink_cuda.check()


@two_gpus
@pytest.mark.slow
def test_skipped_rank_times_out_then_reset():
    """Rank 1 skips the call under lax.cond: rank 0's kernel must time out (500 ms), the error
    must surface (the next call or check()), and reset() must bring the collective back."""
    _register()
    n_per = 1024
    p = _program(2, n_per, 4)
    cid = next(_ids)
    x = _data(n_per, "float32", seed=11)

    def skipping(v):
        rank = lax.axis_index("x")
        return lax.cond(rank == 0, lambda u: _call(u, p, comm_id=cid, timeout_ms=500), lambda u: u, v)

    def full(v):
        return _call(v, p, comm_id=cid, timeout_ms=500)

    mesh = _mesh()
    # check_vma=False: the two branches differ in replication (the call's result is psum-like).
    f = jax.jit(jax.shard_map(skipping, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
    # Both ranks meet once, so that the communicator exists (a rank missing at set-up is a host-side
    # error instead, tested by the CPU suite's rendezvous); then rank 1 skips a call.
    _run(full, x)
    jax.block_until_ready(f(x))  # the kernel times out on the device; nothing raises yet
    with pytest.raises(Exception, match="timed out|gave up"):
        _run(full, x)  # the next call on a failed GPU raises with the recorded message
        _blink_cuda.check()
    _blink_cuda.reset()
    _blink_cuda.check()
    got = _run(full, x)
    want = _run(lambda v: lax.psum(v, "x"), x)
    _check(got, want, "float32", n_per)


def test_module_api():
    _register()
    assert "CUDA executor" in _blink_cuda.version()
    # The one-shot inbox of a communicator: at most min(1% of device memory, 256 MiB) per rank.
    assert 0 <= _blink_cuda.staging_bytes() <= 256 << 20
    for c in _blink_cuda.comms():
        assert set(c["sites_by_mode"]) == {"tree", "ll", "oneshot", "hybrid", "twoshot", "ll-blocks"}
        assert sum(c["sites_by_mode"].values()) == c["num_sites"]
        assert c["host_bytes"] >= 0  # pinned host memory of its hybrid sites, per rank
    assert isinstance(_blink_cuda.comms(), list)
    # The targets the lowering registers (lowering/backends.py), so a new handler cannot leave this behind.
    from jax_blink.lowering import backends as b
    assert set(_blink_cuda.registrations()) == {b.TARGET, b.TARGET_IPC, b.TARGET_LITE, b.TARGET_START,
                                                b.TARGET_DONE, b.TARGET_PACK, b.TARGET_UNPACK}


# One GPU: a one-rank program is the identity for every collective; the executor runs it as a
# plain copy (one_rank_kernel; nothing at all when the result aliases the operand). Through every
# handler: the full binding (plain, command-buffer) and the light one (its call sites registered
# first, as jax_blink's lowering does).
_LITE = ("jax_blink_collective_lite", "jax_blink_collective_lite_cb")


@pytest.mark.parametrize("target", [TARGET, "jax_blink_collective_cb", *_LITE])
@pytest.mark.parametrize("alias", [False, True])
@pytest.mark.parametrize("dtype,n", [("float32", 256), ("bfloat16", 1001), ("int32", 77), ("float32", 300_003)])
def test_one_rank_chain_is_the_identity(target, alias, dtype, n):
    _register()
    from jax_blink.lowering import backends as _backends
    if target in _LITE:
        assert _backends.register("gpu")
    rng = np.random.default_rng(n)
    if jnp.dtype(dtype).kind in "iu":
        x = jnp.asarray(rng.integers(-10**6, 10**6, size=n), dtype=dtype)
    else:
        x = jnp.asarray(rng.standard_normal(n), dtype=dtype)
    program = S.encode(S.Schedule(1, n, n, ()))
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype),
                            input_output_aliases={0: 0} if alias else None)

    def chain(v):
        for _ in range(6):  # with XLA's command buffers, a chain this long is captured
            cid = next(_ids)
            if target in _LITE:
                _backends.register_call_site("gpu", cid, [int(w) for w in program], 0, 10_000, 0.0)
                v = call(v, jnp.int32(0), jnp.int32(0), comm_id=np.int64(cid))
            else:
                v = call(v, jnp.int32(0), jnp.int32(0), program=program, op=np.int32(0),
                         comm_id=np.int64(cid), timeout_ms=np.int64(10_000), host_share=np.float32(0))
        return v

    f = jax.jit(chain)
    for _ in range(3):  # the first run sets the sites up; the later ones replay
        got = np.asarray(f(x))
        assert got.tobytes() == np.asarray(x).tobytes(), (target, alias, dtype, n)
    _blink_cuda.check()
