"""The two-shot all-reduce (kernels/cuda/two_shot.cuh) on 3 and 4 GPUs of one process, through
the "jax_blink_collective" target with a hand-built star program, against lax.psum / pmax.

Push mode (every rank's in != out) and pull mode (the operand aliased to the result, so a peer's
contribution may not land in `out`), ragged sizes (a tail of fewer than n 16-byte atoms), three
dtypes and two ops; each site must have taken the two-shot kernel (the communicators' counts),
and every rank must hold the same bits. Skipped with fewer than 3 GPUs.
"""
from __future__ import annotations

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


if len(_gpus()) < 3 or _blink_cuda is None:
    pytest.skip("needs 3 or more GPUs and jax_blink._blink_cuda", allow_module_level=True)

_ids = itertools.count(3 * 10**9)  # a range of its own: test_cuda.py 10**9, test_cuda_lite.py 2 * 10**9
_LAX = {0: lax.psum, 1: lax.pmax}


def _register():
    from jax_blink.lowering import backends

    backends.register("gpu")


def _program(n, total, itemsize):
    align = max(1, 16 // itemsize)
    segs, at = [], 0
    for r in range(n):  # one star per rank, as the planner gives a switch
        length = total - at if r == n - 1 else (total // n) // align * align
        segs.append(S.TreeSegment(r, 3, at, length, tuple(-1 if q == r else r for q in range(n))))
        at += length
    return S.make_schedule(n, total, itemsize, segs, chunk_bytes=512 * 1024).program()


def _twoshot_sites():
    return sum(c["sites_by_mode"].get("twoshot", 0) for c in _blink_cuda.comms())


def _run(n, n_per, dtype, op, alias, seed):
    mesh = Mesh(np.array(_gpus()[:n]), ("x",))
    program = _program(n, n_per, np.dtype(jnp.dtype(dtype)).itemsize)

    def ours(v):
        rank = lax.axis_index("x").astype(jnp.int32)
        out_type = jax.eval_shape(lambda u: lax.psum(u, "x"), v)
        call = jax.ffi.ffi_call("jax_blink_collective", out_type, has_side_effect=True,
                                input_output_aliases={0: 0} if alias else None)
        return call(v, rank, jnp.int32(0), program=program, op=np.int32(op), comm_id=np.int64(next(_ids)),
                    timeout_ms=np.int64(10_000), host_share=np.float32(0.0))

    rng = np.random.default_rng(seed)
    if np.dtype(jnp.dtype(dtype)).kind in "iu":
        x = jnp.asarray(rng.integers(-1000, 1000, size=n * n_per), dtype=dtype)
    else:
        x = jnp.asarray(rng.standard_normal(n * n_per), dtype=dtype)
    run = lambda f: np.asarray(jax.device_get(  # noqa: E731
        jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(x)))
    return run(ours), run(lambda v: _LAX[op](v, "x"))


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("dtype,n_per", [("float32", (1 << 20) + 5), ("bfloat16", 3 << 18), ("int32", 777_777)])
@pytest.mark.parametrize("op", [0, 1])
@pytest.mark.parametrize("alias", [False, True], ids=["push", "pull"])
def test_two_shot_matches_lax(n, dtype, n_per, op, alias, monkeypatch):
    if len(_gpus()) < n:
        pytest.skip(f"needs {n} GPUs")
    _register()
    monkeypatch.setenv("JAX_BLINK_TWOSHOT_MIN_BYTES", "64K")  # read at each site's set-up
    before = _twoshot_sites()
    got, want = _run(n, n_per, dtype, op, alias, seed=n * 100 + op * 10 + alias)
    _blink_cuda.check()
    assert _twoshot_sites() - before == n, "every rank's site should run the two-shot kernel"
    if op == 1 or dtype == "int32":
        np.testing.assert_array_equal(got, want)
    else:
        tol = 2e-2 if dtype == "bfloat16" else 1e-5
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)
    rows = got.reshape(n, n_per)
    for r in range(1, n):  # every rank holds the same bits
        assert rows[r].tobytes() == rows[0].tobytes()


def test_two_shot_stays_off_below_its_size(monkeypatch):
    _register()
    monkeypatch.setenv("JAX_BLINK_TWOSHOT_MIN_BYTES", "64M")
    before = _twoshot_sites()
    got, want = _run(3, 1 << 16, "float32", 0, False, seed=7)
    assert _twoshot_sites() == before
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("env", [{"JAX_BLINK_TWOSHOT_MODE": "pull"}, {"JAX_BLINK_TWOSHOT_PIECE_BYTES": "16K"},
                                 {"JAX_BLINK_TWOSHOT_PIECE_BYTES": "4M"},
                                 {"JAX_BLINK_TWOSHOT_MODE": "pull", "JAX_BLINK_TWOSHOT_PIECE_BYTES": "16K"},
                                 {"JAX_BLINK_TWOSHOT_REDUCERS": "0"}, {"JAX_BLINK_TWOSHOT_REDUCERS": "1"},
                                 {"JAX_BLINK_TWOSHOT_REDUCERS": "1000", "JAX_BLINK_TWOSHOT_PIECE_BYTES": "16K"},
                                 {"JAX_BLINK_TWOSHOT_MODE": "pull", "JAX_BLINK_TWOSHOT_REDUCERS": "0"},
                                 {"JAX_BLINK_TWOSHOT_ENGINE": "ce"},
                                 {"JAX_BLINK_TWOSHOT_ENGINE": "ce", "JAX_BLINK_CE_PIECE_BYTES": "64K"},
                                 {"JAX_BLINK_TWOSHOT_ENGINE": "ce", "JAX_BLINK_CE_SCATTER": "push",
                                  "JAX_BLINK_CE_PIECE_BYTES": "64K"},
                                 {"JAX_BLINK_TWOSHOT_PUSH": "spread"},
                                 {"JAX_BLINK_TWOSHOT_PUSH": "spread", "JAX_BLINK_TWOSHOT_PIECE_BYTES": "16K"}],
                         ids=["pull", "pieces16K", "pieces4M", "pull-pieces16K", "reducers0", "reducers1",
                              "reducers-most-pieces16K", "pull-reducers0", "copy-engines", "copy-engines-pieces64K",
                              "copy-engines-scatter-push-pieces64K",
                              "spread", "spread-pieces16K"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_shot_knobs_keep_the_result(env, dtype, monkeypatch):
    """JAX_BLINK_TWOSHOT_MODE=pull (remote reads in every call), the piece size, the reducing
    blocks (JAX_BLINK_TWOSHOT_REDUCERS: none, one, as many as allowed) and the copy engines
    (JAX_BLINK_TWOSHOT_ENGINE=ce, one or many pieces per chunk) change how the bytes move,
    never the result: every rank's bits equal the default kernel's (same terms, same
    order), within one rounding of the exact sum (numpy, float64: the kernel sums in float32 and
    rounds once; psum's bfloat16 ring rounds at every hop, so it is no reference at this size)."""
    n = min(4, len(_gpus()))
    _register()
    monkeypatch.setenv("JAX_BLINK_TWOSHOT_MIN_BYTES", "64K")
    n_per = (3 << 20) + 9 if dtype == "float32" else (5 << 19) + 3
    default, _ = _run(n, n_per, dtype, 0, False, seed=11)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    before = _twoshot_sites()
    got, _ = _run(n, n_per, dtype, 0, False, seed=11)
    _blink_cuda.check()
    assert _twoshot_sites() - before == n, "every rank's site should run the two-shot kernel"
    assert got.tobytes() == default.tobytes()
    rng = np.random.default_rng(11)  # _run's operand, again
    x = np.asarray(jnp.asarray(rng.standard_normal(n * n_per), dtype=dtype)).astype(np.float64)
    exact = np.tile(x.reshape(n, n_per).sum(axis=0), n)
    rtol = 2.0 ** -8 if dtype == "bfloat16" else 1e-6  # one rounding of the result (bfloat16: 8 bits)
    np.testing.assert_allclose(got.astype(np.float64), exact, rtol=rtol, atol=1e-5)


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("op", [0, 1])
@pytest.mark.parametrize("alias", [False, True], ids=["apart", "aliased"])
def test_two_shot_on_copy_engines_matches_lax(n, op, alias, monkeypatch):
    """JAX_BLINK_TWOSHOT_ENGINE=ce: the two-shot sites run the copy engines' form on XLA's stream,
    with the operand apart from or aliased to the result, three sites one after another on fresh
    data (the per-device copy streams, scratch and events are reused across them): equal to lax
    exactly (int32, a ragged size)."""
    if len(_gpus()) < n:
        pytest.skip(f"needs {n} GPUs")
    _register()
    monkeypatch.setenv("JAX_BLINK_TWOSHOT_MIN_BYTES", "64K")
    monkeypatch.setenv("JAX_BLINK_TWOSHOT_ENGINE", "ce")
    monkeypatch.setenv("JAX_BLINK_CE_PIECE_BYTES", "256K")
    for seed in range(3):
        got, want = _run(n, 777_777, "int32", op, alias, seed=1000 + seed)
        _blink_cuda.check()
        np.testing.assert_array_equal(got, want)
