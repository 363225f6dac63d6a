"""The collectives' results are replicated exactly where lax's are: under ``shard_map`` (with its
replication check on) ``out_specs=P()`` raises JAX's error for our call exactly where it does for
the lax expression the call replaces, and passes where lax's passes."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_blink

DEVICES = jax.devices()
N = min(4, len(DEVICES))
pytestmark = pytest.mark.skipif(N < 2, reason="needs 2+ devices")


@pytest.fixture(autouse=True)
def _always_the_executor(monkeypatch):
    """The executor's own call (no size dispatch to lax, which would make the test vacuous)."""
    monkeypatch.setattr(jax_blink.config, "dispatch", "blink")


def _root_mask(v):
    return jnp.where(lax.axis_index("x") == 0, v, jnp.zeros_like(v))


# (name, ours, lax's): each pair computes the same values.
CASES = [
    ("all_reduce", lambda v: jax_blink.all_reduce(v, "x"), lambda v: lax.psum(v, "x")),
    ("all_reduce max", lambda v: jax_blink.all_reduce(v, "x", op="max"), lambda v: lax.pmax(v, "x")),
    ("broadcast", lambda v: jax_blink.broadcast(v, "x"), lambda v: lax.psum(_root_mask(v), "x")),
    ("reduce", lambda v: jax_blink.reduce(v, "x"),
     lambda v: jnp.where(lax.axis_index("x") == 0, lax.psum(v, "x"), v)),
    ("all_gather", lambda v: jax_blink.all_gather(v, "x"), lambda v: lax.all_gather(v, "x")),
    ("all_gather tiled", lambda v: jax_blink.all_gather(v, "x", axis=1, tiled=True),
     lambda v: lax.all_gather(v, "x", axis=1, tiled=True)),
    ("reduce_scatter", lambda v: jax_blink.reduce_scatter(v, "x", scatter_dimension=1, tiled=True),
     lambda v: lax.psum_scatter(v, "x", scatter_dimension=1, tiled=True)),
    ("reduce_scatter untiled", lambda v: jax_blink.reduce_scatter(v.reshape(N, -1), "x"),
     lambda v: lax.psum_scatter(v.reshape(N, -1), "x")),
]


def _outcome(fn, x, mesh, out_specs):
    """The result, or the exception that shard_map raised for these out_specs."""
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=out_specs))
    try:
        return np.asarray(f(x)), None
    except Exception as e:  # noqa: BLE001 (compared with lax's below)
        return None, e


@pytest.mark.parametrize("name,ours,ref", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("out_specs", [P(), P("x")], ids=["replicated", "sharded"])
def test_out_specs_pass_and_fail_as_lax(name, ours, ref, out_specs):
    mesh = jax.make_mesh((N,), ("x",), devices=DEVICES[:N])
    host = np.random.default_rng(7).standard_normal((N * 2, 2 * N)).astype(np.float32)
    x = jax.device_put(jnp.asarray(host), NamedSharding(mesh, P("x")))
    want, lax_error = _outcome(ref, x, mesh, out_specs)
    got, our_error = _outcome(ours, x, mesh, out_specs)
    if lax_error is not None:
        assert our_error is not None, f"{name}: lax raised ({lax_error}) but jax_blink did not"
        assert type(our_error) is type(lax_error)
        # JAX's own replication error, word for word but for the function it names.
        unnamed = lambda e: re.sub(r"'[^']*'", "'f'", str(e).split("\n")[0])  # noqa: E731
        assert "out_specs" in unnamed(lax_error) and unnamed(our_error) == unnamed(lax_error)
    else:
        assert our_error is None, f"{name}: lax passed but jax_blink raised {our_error!r}"
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
