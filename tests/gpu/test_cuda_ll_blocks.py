"""The LL reduce-scatter and all-gather (kernels/cuda/ll_blocks.cuh, Mode::kLLBlocks): programs of
n blocks rooted at their owners, called by hand on 2 to 4 GPUs (out apart from in, so every byte
of the result is the kernel's), and through the public API (in place); compared with numpy in
float64 on fresh random data. Which kernel ran is read from the executor's site counts: blocks of
at most the LL limit take it (also blocks that start off 8 bytes: odd element counts), larger
ones the trees.

Needs 2+ GPUs and the CUDA build."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from conftest import gpu_devices as _gpus  # tests/conftest.py: the GPUs jax lists, or none

pytestmark = pytest.mark.gpu

try:
    from jax_blink import _blink_cuda
except ImportError:  # not built (no nvcc) or not importable here
    _blink_cuda = None

import jax_blink
from jax_blink.lowering import backends as _backends
from jax_blink.options import override
from jax_blink.planning import schedule as S

if len(_gpus()) < 2 or _blink_cuda is None:
    pytest.skip("needs 2+ GPUs and jax_blink._blink_cuda", allow_module_level=True)

_ids = itertools.count(4 * 10**9)  # a range of its own (tests/unit/test_gpu_helpers.py checks)
_RANKS = [n for n in (2, 3, 4) if n <= len(_gpus())]
_PHASES = {"reducescatter": 1, "allgather": 2}


def _program(n, blk, itemsize, what):
    star = lambda r: tuple(-1 if q == r else r for q in range(n))  # noqa: E731
    segs = [S.TreeSegment(r, _PHASES[what], r * blk, blk, star(r)) for r in range(n)]
    return S.make_schedule(n, n * blk, itemsize, segs, chunk_bytes=64 * 1024).program()


def _call(v, program, comm_id, in_place=False):
    rank = lax.axis_index("x").astype(jnp.int32)
    call = jax.ffi.ffi_call("jax_blink_collective", jax.ShapeDtypeStruct(v.shape, v.dtype), has_side_effect=True,
                            input_output_aliases={0: 0} if in_place else None)
    return call(v, rank, jnp.int32(0), program=program, op=np.int32(0), comm_id=np.int64(comm_id),
                timeout_ms=np.int64(10_000), host_share=np.float32(0.0))


def _ll_blocks_sites():
    return sum(c["sites_by_mode"].get("ll-blocks", 0) for c in _blink_cuda.comms())


def _data(n, per_rank, dtype, seed):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(-1000, 1000, size=(n, per_rank)).astype(dtype)
    return np.asarray(jnp.asarray(rng.standard_normal((n, per_rank)), dtype))  # values the dtype holds


def _by_hand(what, n, blk, dtype, seed, operands=None, in_place=False):
    """Every rank's result of one hand-made call: array (n, n * blk) of the dtype. ``operands``:
    what each rank passes (default: the returned data itself); ``in_place``: the result aliases it."""
    assert _backends.register("gpu")
    mesh = Mesh(np.array(_gpus()[:n]), ("x",))
    per_rank = n * blk
    host = _data(n, per_rank, dtype, seed)
    program = _program(n, blk, np.dtype(dtype).itemsize, what)
    cid = next(_ids)
    f = jax.jit(jax.shard_map(lambda v: _call(v, program, cid, in_place), mesh=mesh, in_specs=P("x"),
                              out_specs=P("x")))
    given = host if operands is None else operands(host)
    x = jax.device_put(jnp.asarray(given.reshape(-1)), NamedSharding(mesh, P("x")))
    return host, np.asarray(f(x)).reshape(n, per_rank)


def _check_by_hand(what, n, blk, host, got):
    for r in range(n):
        mine = slice(r * blk, (r + 1) * blk)
        if what == "reducescatter":  # block r of rank r: the sum of every rank's block r
            want = host[:, mine].astype(np.float64).sum(axis=0)
            tol = {"bfloat16": 2.0 ** -7, "float32": 1e-6}.get(host.dtype.name, 0)  # one rounding; ints exact
            np.testing.assert_allclose(got[r, mine].astype(np.float64), want, rtol=tol, atol=tol * n)
        else:  # every block s of every rank: rank s's block s, bit for bit
            want = np.concatenate([host[s, s * blk:(s + 1) * blk] for s in range(n)])
            assert got[r].tobytes() == want.tobytes(), f"rank {r}'s gathered blocks differ"


@pytest.mark.parametrize("n", _RANKS)
@pytest.mark.parametrize("what", ["reducescatter", "allgather"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
@pytest.mark.parametrize("blk", [1, 3, 4, 255, 1026, 16384])  # elements per block: odd ones start off 8 bytes
def test_ll_blocks_match_numpy(n, what, dtype, blk):
    before = _ll_blocks_sites()
    host, got = _by_hand(what, n, blk, jnp.dtype(dtype), seed=blk + n)
    assert _ll_blocks_sites() - before == n, "every rank's site should run the LL blocks kernel"
    _check_by_hand(what, n, blk, host, got)
    _blink_cuda.check()


@pytest.mark.parametrize("n", _RANKS)
@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_ll_all_gather_in_place_overwrites_the_other_blocks(n, dtype):
    """In place (the result aliases the operand, as jax_blink.all_gather calls it): each rank passes
    only its own block, every other block poisoned (NaN, or -7777 for int32); the kernel must
    write every peer's block over the poison."""
    blk = 1027

    def poisoned(host):
        out = host.copy()
        for r in range(n):
            for s in range(n):
                if s != r:
                    out[r, s * blk:(s + 1) * blk] = np.nan if out.dtype.kind == "f" else -7777
        return out

    before = _ll_blocks_sites()
    host, got = _by_hand("allgather", n, blk, np.dtype(dtype), seed=31 + n, operands=poisoned, in_place=True)
    assert _ll_blocks_sites() - before == n
    _check_by_hand("allgather", n, blk, host, got)
    _blink_cuda.check()


@pytest.mark.parametrize("what", ["reducescatter", "allgather"])
def test_blocks_above_the_ll_limit_run_the_trees(what, monkeypatch):
    n = _RANKS[-1]
    monkeypatch.setenv("JAX_BLINK_LL_BYTES", "1K")  # read at each site's set-up
    for blk, dtype in [(257, "float32"), (1024, "bfloat16")]:
        before = _ll_blocks_sites()
        host, got = _by_hand(what, n, blk, jnp.dtype(dtype), seed=blk)
        assert _ll_blocks_sites() == before, f"{blk} x {dtype} should have run the trees"
        _check_by_hand(what, n, blk, host, got)
    _blink_cuda.check()


def test_ll_shapes_interleaved_on_one_communicator_match_lax():
    """All-reduce, reduce-scatter and all-gather of LL sizes in turn, 8 rounds in one program: the
    three kernels share the communicator's inbox and call counter (the argument in ll_blocks.cuh)."""
    n = _RANKS[-1]
    mesh = jax.make_mesh((n,), ("x",), devices=_gpus()[:n])
    x = jax.device_put(jnp.asarray(_data(n, n * 512, np.float32, 7)).reshape(-1),
                       NamedSharding(mesh, P("x")))

    def rounds(v, ar, rs, ag):
        for _ in range(8):
            v = ag(rs(ar(v) * 0.25) * 0.5, "x")
        return v

    ours = lambda v: rounds(v, lambda u: jax_blink.all_reduce(u, "x"),  # noqa: E731
                            lambda u: jax_blink.reduce_scatter(u, "x", tiled=True),
                            lambda u, a: jax_blink.all_gather(u, a, tiled=True))
    ref = lambda v: rounds(v, lambda u: lax.psum(u, "x"),  # noqa: E731
                           lambda u: lax.psum_scatter(u, "x", tiled=True),
                           lambda u, a: lax.all_gather(u, a, tiled=True))
    spec = P("x")
    want = np.asarray(jax.jit(jax.shard_map(ref, mesh=mesh, in_specs=spec, out_specs=spec))(x))
    before = _ll_blocks_sites()
    with override(dispatch="blink"):
        got = np.asarray(jax.jit(jax.shard_map(ours, mesh=mesh, in_specs=spec, out_specs=spec))(x))
    assert _ll_blocks_sites() - before >= 2 * n, "the reduce-scatter and all-gather sites should run LL"
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    _blink_cuda.check()
