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


def _switched(step, *args, **options):
    """``step`` compiled under the switch (the executor forced, buckets of at most 32 KiB unless
    ``options`` say otherwise, and ``options``), its result on ``args`` and the switch's report."""
    with jax_blink.installed(), override(**{"dispatch": "blink", "merge_bytes": 32 << 10, **options}):
        jax_blink.switch_report(clear=True)
        compiled = step.lower(*args).compile()
        got = compiled(*args)
        report = jax_blink.switch_report()
    return compiled, got, report


def _integer_step(count: int, seed: int, pcast: bool = False):
    """An unedited data-parallel step over ``count`` GPUs (skipped without them): six 64 x 64 linear
    layers on small integers in float32, so that every sum is exact; the gradients summed by
    ``lax.psum`` after the backward pass, or (``pcast``) by jax's own transposes of parameters
    made varying. Returns the jitted step, the parameters and the sharded batch."""
    gpus = _gpus()
    if len(gpus) < count or not jax_blink.backends()["gpu"]:
        pytest.skip(f"needs {count}+ GPUs and the CUDA executor")
    mesh = jax.make_mesh((count,), ("x",), devices=gpus[:count])
    rng = np.random.default_rng(seed)
    params = [{"w": jnp.asarray(rng.integers(-1, 2, (64, 64)), jnp.float32),
               "b": jnp.asarray(rng.integers(-1, 2, (64,)), jnp.float32)} for _ in range(6)]
    x = jax.device_put(jnp.asarray(rng.integers(-2, 3, (count, 8, 64)), jnp.float32), NamedSharding(mesh, P("x")))

    def loss(ps, v):
        for layer in ps:
            v = v @ layer["w"] + layer["b"]
        return jnp.sum(v)

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P(), P("x")), out_specs=P(), check_vma=pcast)
    def step(ps, xs):
        if pcast:
            grads = jax.grad(lambda q: loss(jax.tree.map(lambda a: lax.pcast(a, "x", to="varying"), q), xs[0]))(ps)
        else:
            grads = lax.psum(jax.grad(loss)(ps, xs[0]), "x")
        return jax.tree.map(lambda p, g: p - g, ps, grads)

    return step, params, x


def _assert_bitwise(want, got):
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("count", [2, 3, 4])
@pytest.mark.parametrize("pcast", [False, True])
def test_switch_overlaps_a_training_steps_gradients(count, pcast):
    """An unedited data-parallel step (``lax.psum`` of the gradients, or jax's own transposes of
    parameters made varying) under the switch: its buckets start on the side stream inside the
    backward pass (jax_blink_start / jax_blink_done in the compiled program) and the step gives
    the unswitched step's numbers, bit for bit."""
    step, params, x = _integer_step(count, seed=count, pcast=pcast)
    want = step(params, x)
    compiled, got, report = _switched(step, params, x)
    text = compiled.as_text()
    assert text.count('custom_call_target="jax_blink_start"') >= 2, text[:2000]
    assert sum(d.operands for d in report if d.overlapped and d.runs_on == "jax_blink") == 12, report
    _assert_bitwise(want, got)
    for _ in range(3):  # again: the side stream's FIFO and the communicators are reused
        again = compiled(params, x)
    _assert_bitwise(want, again)


@pytest.mark.parametrize("count", [2, 4])
def test_switch_cuts_its_last_bucket_on_gpus(count):
    """switch_last_bucket_pieces=4: the last bucket to start becomes several starts on the side
    stream (more jax_blink_start calls than with the bucket whole), every gradient still summed
    once, and the step gives the unswitched step's bits, again on reuse."""
    step, params, x = _integer_step(count, seed=40 + count)
    want = step(params, x)
    starts = {}
    for pieces in (1, 4):
        # One bucket of every gradient (96 KiB): whole, nothing to overlap; cut, four starts.
        compiled, got, report = _switched(step, params, x, merge_bytes=1 << 20, switch_last_bucket_pieces=pieces)
        starts[pieces] = compiled.as_text().count('custom_call_target="jax_blink_start"')
        if pieces > 1:
            assert sum(d.operands for d in report if d.overlapped and d.runs_on == "jax_blink") == 12, report
        _assert_bitwise(want, got)
        _assert_bitwise(want, compiled(params, x))
    assert starts[1] == 0 and starts[4] == 4, starts


@pytest.mark.parametrize("count", [2, 4])
@pytest.mark.parametrize("hold", ["weights", "none"])
def test_switch_holds_on_gpus(count, hold):
    """switch_hold="weights" or "none" on a step of parameters made varying: the buckets start on
    the side stream as with the default hold, and the step gives the unswitched step's bits,
    again on reuse."""
    step, params, x = _integer_step(count, seed=50 + count, pcast=True)
    want = step(params, x)
    compiled, got, report = _switched(step, params, x, switch_hold=hold)
    assert compiled.as_text().count('custom_call_target="jax_blink_start"') >= 2
    assert sum(d.operands for d in report if d.overlapped and d.runs_on == "jax_blink") == 12, report
    _assert_bitwise(want, got)
    _assert_bitwise(want, compiled(params, x))


@pytest.mark.parametrize("count", [2, 3, 4])
def test_switch_gathers_a_tied_embeddings_gradient(count):
    """A language model's step (an embedding lookup and the output layer that reuses its table),
    unedited, under the switch: the table's dense part starts on the side stream with the other
    buckets, the lookup's tokens and rows are gathered after the waits (two synchronous calls),
    and the step gives the unswitched step's bits (small integers in float32: exact sums)."""
    gpus = _gpus()
    if len(gpus) < count or not jax_blink.backends()["gpu"]:
        pytest.skip(f"needs {count}+ GPUs and the CUDA executor")
    mesh = jax.make_mesh((count,), ("x",), devices=gpus[:count])
    rng = np.random.default_rng(10 + count)
    vocab, width = 4096, 64
    params = {"wte": jnp.asarray(rng.integers(-1, 2, (vocab, width)), jnp.float32),
              "layers": [jnp.asarray(rng.integers(-1, 2, (width, width)), jnp.float32) for _ in range(4)]}
    tokens = jax.device_put(jnp.asarray(rng.integers(0, vocab, (count, 4, 32)), jnp.int32),
                            NamedSharding(mesh, P("x")))

    def loss(p, t):
        h = jnp.take(p["wte"], t, axis=0)
        for w in p["layers"]:
            h = h @ w
        return jnp.sum(h @ p["wte"].T)

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P(), P("x")), out_specs=P())
    def step(p, t):
        grads = jax.grad(lambda q: loss(jax.tree.map(lambda a: lax.pcast(a, "x", to="varying"), q), t[0]))(p)
        return jax.tree.map(lambda a, g: a - g, p, grads)

    want = step(params, tokens)
    compiled, got, report = _switched(step, params, tokens, switch_sparse_gradients=True)
    text = compiled.as_text()
    assert text.count('custom_call_target="jax_blink_start"') >= 2, text[:2000]
    assert sum(1 for d in report if d.primitive.startswith("all_gather") and d.runs_on == "jax_blink") == 2, report
    for _ in range(3):  # again: the side stream's FIFO and the communicators are reused
        got = compiled(params, tokens)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
