"""The switch on GPUs (jax_blink/switch/rules.py lowering for "cuda"): unedited lax programs agree with
and without it, and the compiled program holds the custom call. Needs 2+ GPUs and the CUDA build."""
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
TARGET = "jax_blink_collective"


_CASES = {
    "psum": (lambda v: lax.psum(v, "x"), P()),
    "pmean": (lambda v: lax.pmean(v, "x"), P()),
    "pmax": (lambda v: lax.pmax(v, "x"), P()),
    "all_gather": (lambda v: lax.all_gather(v, "x", axis=1, tiled=True), P("x")),
    "psum_scatter": (lambda v: lax.psum_scatter(v, "x", scatter_dimension=1, tiled=True), P("x")),
    # The gradient of a replicated parameter: jax's transpose emits the psum (the gradient of a
    # pmean of a varying value, tried first, holds no collective at all, with or without the switch).
    "grad": (lambda v: jax.grad(lambda w: jnp.sum(jnp.sin(w * v) ** 2))(jnp.ones(v.shape[1:], v.dtype)), P()),
}


@pytest.mark.parametrize("name", sorted(_CASES))
def test_switch_on_gpus(name):
    gpus = _gpus()
    if len(gpus) < 2 or not jax_blink.backends()["gpu"]:
        pytest.skip("needs 2+ GPUs and the CUDA executor")
    n = len(gpus)
    mesh = jax.make_mesh((n,), ("x",), devices=gpus)
    x = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal((n, 4 * n, 33)), jnp.float32),
                       NamedSharding(mesh, P("x")))
    fn, out_spec = _CASES[name]
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=out_spec))
    want = np.asarray(f(x))
    with jax_blink.installed(), override(dispatch="blink"):
        compiled = f.lower(x).compile()
        got = np.asarray(compiled(x))
    assert TARGET in compiled.as_text()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
