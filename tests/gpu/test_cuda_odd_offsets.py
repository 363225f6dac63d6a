"""Collectives whose per-rank blocks start mid-vector (3 ranks' reduce-scatter and all-gather of
sizes that are no multiple of 16 bytes per block): the kernels' scalar head realigns every pointer
of a piece that shares one offset from 16 bytes (kernels/cuda/device_kernels.cuh, combine_range and
copy_range), and the results must match lax on fresh random data. Needs 3+ GPUs and the CUDA build."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_blink
from jax_blink.options import override
from conftest import gpu_devices as _gpus  # tests/conftest.py: the GPUs jax lists, or none

pytestmark = pytest.mark.gpu


# Elements per rank's block: 4-byte and 2-byte offsets from 16 bytes, tiny and past 1 MiB.
_BLOCKS = [1, 3, 7, 1_000_003, 262_145]


@pytest.mark.parametrize("what", ["reduce_scatter", "all_gather"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("block", _BLOCKS)
def test_three_ranks_blocks_off_16_bytes_match_lax(what, dtype, block):
    gpus = _gpus()
    if len(gpus) < 3 or not jax_blink.backends()["gpu"]:
        pytest.skip("needs 3+ GPUs and the CUDA executor")
    n = 3
    mesh = jax.make_mesh((n,), ("x",), devices=gpus[:n])
    rows = n * block if what == "reduce_scatter" else block  # a rank's operand
    data = np.random.default_rng(block).standard_normal((n * rows,)).astype(np.float32)
    x = jax.device_put(jnp.asarray(data, dtype), NamedSharding(mesh, P("x")))
    if what == "reduce_scatter":
        ours = lambda v: jax_blink.reduce_scatter(v, "x", tiled=True)  # noqa: E731
        want_fn = lambda v: lax.psum_scatter(v, "x", tiled=True)  # noqa: E731
    else:
        ours = lambda v: jax_blink.all_gather(v, "x", tiled=True)  # noqa: E731
        want_fn = lambda v: lax.all_gather(v, "x", tiled=True)  # noqa: E731
    spec = P("x")  # all-gather: every rank's whole result, side by side
    want = np.asarray(jax.jit(jax.shard_map(want_fn, mesh=mesh, in_specs=spec, out_specs=spec))(x)).astype(np.float64)
    with override(dispatch="blink"):
        f = jax.jit(jax.shard_map(ours, mesh=mesh, in_specs=spec, out_specs=spec))
        compiled = f.lower(x).compile()
    assert "jax_blink_collective" in compiled.as_text()
    got = np.asarray(compiled(x)).astype(np.float64)
    assert got.shape == want.shape
    if what == "all_gather":  # a copy: bit for bit
        np.testing.assert_array_equal(got, want)
    else:  # sums of 3 terms in another order: one rounding of the dtype apart
        tol = 2.0 ** -7 if dtype == "bfloat16" else 1e-6
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * 4)
