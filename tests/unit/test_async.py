"""The asynchronous all-reduce (jax_blink.all_reduce_start / all_reduce_done, the overlapped
buckets): on 8 CPU host devices it runs synchronously and must equal lax.psum bit for bit, keep the
call-order chain, and carry the done's ordering token into the compiled program; the GPU lowering
(jax_blink_start / jax_blink_done, aliases, token) is checked on its StableHLO text.

8 CPU host devices (tests/conftest.py).
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_blink
from jax_blink.api.buckets import BucketLayout, bucketed_all_reduce
from jax_blink.lowering import async_call
from jax_blink.options import override

DEVICES = jax.devices()
N = len(DEVICES)
pytestmark = pytest.mark.skipif(N < 8, reason="needs the 8 CPU host devices of tests/conftest.py")


def _mesh():
    return jax.make_mesh((N,), ("data",), devices=DEVICES)


def _grads(seed: int):
    """A gradient-shaped pytree of fresh random numbers, one per device, in 3+ buckets."""
    rng = np.random.default_rng(seed)
    shapes = {"a": (N, 300), "b": (N, 40, 30), "c": (N, 2000), "d": (N, 7)}
    return {k: _sharded(rng.standard_normal(s).astype(np.float32)) for k, s in shapes.items()}


def _sharded(a):
    return jax.device_put(jnp.asarray(a), NamedSharding(_mesh(), P("data")))


def _step(layout, overlap: bool, kind: str):
    mesh = _mesh()

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=P("data"), out_specs=P())
    def f(tree):
        tree = jax.tree.map(lambda v: v[0], tree)
        if kind == "psum":
            return jax.tree.map(lambda v: lax.psum(v, "data"), tree)
        return bucketed_all_reduce(tree, "data", layout=layout, overlap=overlap)

    return f


def _layout(tree):
    return BucketLayout.of(jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape[1:], v.dtype), tree),
                           bucket_bytes=4000, first_bucket_bytes=1000)


def test_overlapped_buckets_equal_psum_bitwise_on_integers():
    """int32 sums are exact in any order: the overlapped buckets must give psum's bits."""
    rng = np.random.default_rng(3)
    tree = {k: _sharded(rng.integers(-1000, 1000, v.shape).astype(np.int32)) for k, v in _grads(0).items()}
    layout = _layout(tree)
    assert len(layout.buckets) >= 3
    with override(dispatch="blink"):
        ours = _step(layout, True, "blink")(tree)
    ref = _step(layout, False, "psum")(tree)
    for k in tree:
        np.testing.assert_array_equal(np.asarray(ours[k]), np.asarray(ref[k]))
    assert not np.array_equal(np.asarray(ours["c"]), np.asarray(tree["c"])[0])


def test_overlapped_buckets_equal_the_synchronous_ones_bitwise():
    """float32: the same bits as the synchronous jax_blink buckets (the same executor and program),
    and psum's sum up to rounding (the trees add in another order than XLA's)."""
    tree = _grads(0)
    layout = _layout(tree)
    assert len(layout.buckets) >= 3
    with override(dispatch="blink"):
        ours = _step(layout, True, "blink")(tree)
        sync = _step(layout, False, "blink")(tree)
    ref = _step(layout, False, "psum")(tree)
    for k in tree:
        np.testing.assert_array_equal(np.asarray(ours[k]), np.asarray(sync[k]))
        np.testing.assert_allclose(np.asarray(ours[k]), np.asarray(ref[k]), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(ours["c"]), np.asarray(tree["c"])[0])


def test_start_done_api_equals_psum_and_orders_the_done():
    rng = np.random.default_rng(1)
    x = _sharded(rng.standard_normal((N, 513)).astype(np.float32))
    y = _sharded(rng.standard_normal((N, 64)).astype(np.float32))
    mesh = _mesh()

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P("data"), P("data")), out_specs=(P(), P()))
    def f(a, b):
        h1 = jax_blink.all_reduce_start(a[0], "data")
        h2 = jax_blink.all_reduce_start(b[0] * 2.0, "data")
        return jax_blink.all_reduce_done(h1, after=h2), jax_blink.all_reduce_done(h2)

    with override(dispatch="blink"):
        s1, s2 = f(x, y)
        hlo = f.lower(x, y).compile().as_text()
    np.testing.assert_allclose(np.asarray(s1), np.asarray(jnp.sum(x, 0)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(s2), np.asarray(
        jax.jit(jax.shard_map(lambda b: lax.psum(b[0] * 2.0, "data"), mesh=mesh, in_specs=P("data"),
                              out_specs=P()))(y)), rtol=1e-5, atol=1e-5)
    # Two collectives, the second waits for the first (the chain), and the first's done waits for
    # the second's operand (its token): three jax_blink_after calls in the compiled program.
    assert len(re.findall(r'custom_call_target="jax_blink_collective', hlo)) == 2
    assert len(re.findall(r'custom_call_target="jax_blink_after"', hlo)) >= 2


def test_start_done_bad_input():
    with pytest.raises(TypeError, match="takes the handle"):
        jax_blink.all_reduce_done(jnp.zeros(3))
    mesh = _mesh()
    with pytest.raises(ValueError, match="op 'prod' is not supported"):
        jax.jit(jax.shard_map(lambda v: jax_blink.all_reduce_start(v, "data", op="prod").result,
                              mesh=mesh, in_specs=P("data"), out_specs=P("data")))(_sharded(np.ones(N, np.float32)))
    with pytest.raises(TypeError, match="full_grid must be True or False, got 'yes'"):
        jax.jit(jax.shard_map(lambda v: jax_blink.all_reduce_start(v, "data", full_grid="yes").result,
                              mesh=mesh, in_specs=P("data"), out_specs=P("data")))(_sharded(np.ones(N, np.float32)))
    with pytest.raises(TypeError, match="uint8 is not supported"):
        jax.jit(jax.shard_map(lambda v: jax_blink.all_reduce_start(v, "data").result,
                              mesh=mesh, in_specs=P("data"), out_specs=P("data")))(_sharded(np.ones(N, np.uint8)))


def test_gpu_lowering_has_aliases_and_token(monkeypatch):
    """The GPU form, lowered here as text (no GPU needed): each start returns the operand aliased
    (output 0 <- operand 0) and the result; each done takes (passed, result, token) with the result
    aliased (output 0 <- operand 1); every done's token is the last start's passed operand (DDP
    waits for its buckets at the end of the backward pass)."""
    monkeypatch.setattr(async_call, "runs_async", lambda platform: True)
    rng = np.random.default_rng(2)
    tree = {"w": _sharded(rng.standard_normal((N, 1000)).astype(np.float32)),
            "v": _sharded(rng.standard_normal((N, 600)).astype(np.float32)),
            "u": _sharded(rng.standard_normal((N, 300)).astype(np.float32))}
    layout = BucketLayout.of(jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape[1:], v.dtype), tree),
                             bucket_bytes=1000, first_bucket_bytes=1000)
    assert len(layout.buckets) == 3
    with override(dispatch="blink"):
        text = _step(layout, True, "blink").lower(tree).as_text()
    starts = re.findall(r"(%\S+):2 = stablehlo.custom_call @jax_blink_start\((%[^,]+), [^)]*\).*?"
                        r"output_operand_aliases = \[#stablehlo.output_operand_alias<output_tuple_indices = \[0\], "
                        r"operand_index = 0", text, re.S)
    dones = re.findall(r"stablehlo.custom_call @jax_blink_done\((%[^,]+), (%[^,]+), (%[^)]+)\).*?"
                       r"output_operand_aliases = \[#stablehlo.output_operand_alias<output_tuple_indices = \[\], "
                       r"operand_index = 1", text, re.S)
    assert len(starts) == 3 and len(dones) == 3, text
    names = [s[0] for s in starts]
    for k, (passed, result, token) in enumerate(dones):
        assert passed == f"{names[k]}#0" and result == f"{names[k]}#1"
        expected = f"{names[-1]}#0" if k + 1 < len(names) else passed  # every done after the last start
        assert token == expected, (k, token, expected)
    # Only the last bucket takes the executor's whole grid (nothing is left to overlap).
    assert text.count("full_grid = 1 : i32") == 1 and text.count("full_grid = 0 : i32") == 2, text


def test_gradient_order_follows_the_backward_pass():
    """A tied embedding first in leaf order reversed (its gradient is summed at the very end of the
    backward pass) goes last under gradient_order; an untied chain keeps DDP's reversed order; a
    bad order is refused with the fix named."""
    from jax_blink.api.buckets import gradient_order

    def loss(p, x):
        h = p["wte"][x]
        for w in p["blocks"]:
            h = jnp.tanh(h @ w)
        return jnp.sum(h @ p["wte"].T)

    rng = np.random.default_rng(5)
    p = {"blocks": [jnp.asarray(rng.standard_normal((4, 4)), jnp.float32) for _ in range(3)],
         "wte": jnp.asarray(rng.standard_normal((10, 4)), jnp.float32)}
    x = jax.ShapeDtypeStruct((2,), jnp.int32)
    order = gradient_order(jax.grad(loss), p, x)
    assert order == [2, 1, 0, 3]  # blocks[2], [1], [0], then wte
    assert gradient_order(jax.jit(jax.grad(loss)), p, x) == order  # inside a nested jit too
    layout = BucketLayout.of(p, 64, 64, order=order)
    assert [b.slots[0].path for b in layout.buckets] == ["['blocks'][2]", "['blocks'][1]", "['blocks'][0]", "['wte']"]
    assert "the order their gradients become ready" in layout.describe()
    assert "reverse order" in BucketLayout.of(p, 64, 64).describe()
    with pytest.raises(ValueError, match="each of the tree's 4 leaf indices once"):
        BucketLayout.of(p, 64, 64, order=[0, 1, 2])


def _mlp_loss(params, x):
    h = params["embed"][x]
    for w in params["blocks"]:
        h = jnp.tanh(h @ w)
    return jnp.mean((h @ params["embed"].T) ** 2), jnp.mean(h, axis=0)


def _mlp_params(seed):
    rng = np.random.default_rng(seed)
    return {"blocks": [jnp.asarray(rng.standard_normal((16, 16)) / 4, jnp.float32) for _ in range(4)],
            "embed": jnp.asarray(rng.standard_normal((50, 16)), jnp.float32)}


def _overlapped_step(params, xs, which, **kw):
    mesh = _mesh()

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=False)
    def f(params, xs):
        mine = params
        if which == "psum":
            (loss, aux), g = jax.value_and_grad(_mlp_loss, has_aux=True)(mine, xs[0])
            return lax.psum(loss, "data"), lax.psum(aux, "data"), jax.tree.map(lambda v: lax.psum(v, "data"), g)
        (loss, aux), g = jax_blink.value_and_grad_overlapped(_mlp_loss, "data", has_aux=True, reduce_aux=True,
                                                             **kw)(mine, xs[0])
        return lax.psum(loss, "data"), aux, g

    return f(params, xs)


@pytest.mark.parametrize("bucket_bytes, hold, alone", [(1000, "recent", False), (1000, "all", False),
                                                       (1000, "none", False), (1000, "weights", False),
                                                       (1 << 20, "recent", False),
                                                       (3000, "recent", True)])
def test_value_and_grad_overlapped_equals_psum(bucket_bytes, hold, alone):
    """The overlapped gradients (several buckets, a tied embedding, a nested jit inlined, aux
    summed) equal value_and_grad + psum on fresh random data; the loss is each device's own. At
    3000 bytes the embedding (3200) is the only leaf past the cap: with large_leaf_alone it is a
    bucket of its own, after block 0's."""
    params = _mlp_params(7)
    xs = _sharded(np.random.default_rng(8).integers(0, 50, (N, 6)).astype(np.int32))
    with override(dispatch="blink"):
        got = _overlapped_step(params, xs, "blink", bucket_bytes=bucket_bytes, first_bucket_bytes=bucket_bytes,
                               hold=hold, large_leaf_alone=alone)
    want = _overlapped_step(params, xs, "psum")
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("hold", ["recent", "all", "weights"])
def test_value_and_grad_overlapped_starts_inside_the_backward_pass(monkeypatch, hold):
    """On the GPU form (lowered as text here), each bucket's start comes before the backward pass
    of the layers below it (an optimization_barrier holds the rest of the program after it), and
    every done comes after the last start."""
    monkeypatch.setattr(async_call, "runs_async", lambda platform: True)
    params = _mlp_params(9)
    xs = _sharded(np.random.default_rng(3).integers(0, 50, (N, 6)).astype(np.int32))
    mesh = _mesh()

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=False)
    def f(params, xs):
        fn = jax.jit(lambda p, x: _mlp_loss(p, x)[0])  # a nested jit: inlined, starts land inside
        return jax_blink.value_and_grad_overlapped(fn, "data", bucket_bytes=1024, first_bucket_bytes=1024,
                                                   hold=hold)(params, xs[0])[1]

    with override(dispatch="blink"):
        text = f.lower(params, xs).as_text()
    lines = text.split("\n")
    starts, dones, barriers, dots = overlap_lines(text)
    assert len(starts) >= 4 and len(dones) == len(starts), text
    assert max(starts) < min(dones)
    # A barrier after every start but the last, and backward matrix products after the first start.
    assert sum(1 for s in starts[:-1] if any(s < b < s + 40 for b in barriers)) == len(starts) - 1
    assert any(starts[0] < d < starts[-1] for d in dots)
    # Each barrier passes the start's output and at least one value of the rest of the pass.
    assert all(_barrier_operands(lines[b]) >= 2 for b in barriers), text


def test_value_and_grad_overlapped_hold_none_holds_nothing(monkeypatch):
    """hold="none": the same starts and dones on the GPU form, every done after the last start,
    and no barrier that holds a start's output with the rest of the pass (the packing's barriers,
    one value each, stay)."""
    monkeypatch.setattr(async_call, "runs_async", lambda platform: True)
    params = _mlp_params(9)
    xs = _sharded(np.random.default_rng(3).integers(0, 50, (N, 6)).astype(np.int32))

    def lowered(hold):
        @jax.jit
        @jax.shard_map(mesh=_mesh(), in_specs=(P(), P("data")), out_specs=P(), check_vma=False)
        def f(params, xs):
            return jax_blink.value_and_grad_overlapped(lambda p, x: _mlp_loss(p, x)[0], "data", bucket_bytes=1024,
                                                       first_bucket_bytes=1024, hold=hold)(params, xs[0])[1]
        with override(dispatch="blink"):
            return f.lower(params, xs).as_text()

    texts = {hold: lowered(hold) for hold in ("recent", "none")}
    held = {}
    for hold, text in texts.items():
        lines = text.split("\n")
        starts, dones, barriers, _ = overlap_lines(text)
        assert len(starts) >= 4 and len(dones) == len(starts) and max(starts) < min(dones), hold
        held[hold] = sum(1 for b in barriers if _barrier_operands(lines[b]) >= 2)
    assert held["recent"] >= 3 and held["none"] == 0, held


def overlap_lines(text: str) -> tuple[list[int], list[int], list[int], list[int]]:
    """The line numbers of a lowered program's (StableHLO text) starts, dones, optimization
    barriers and matrix products: where the overlapped form put what."""
    lines = text.split("\n")
    return tuple([i for i, line in enumerate(lines) if mark in line]
                 for mark in ("@jax_blink_start(", "@jax_blink_done(", "optimization_barrier",
                              "stablehlo.dot_general"))


def _barrier_operands(line: str) -> int:
    """How many values one StableHLO optimization_barrier line passes through."""
    return len(re.findall(r"%[\w#]+", line.split("=", 1)[1].split(":", 1)[0]))


def test_value_and_grad_overlapped_recent_holds_only_backward_values(monkeypatch):
    """hold="recent" passes through each barrier only values made since the previous start in the
    backward pass, never the forward pass's values, which hold="all" passes through every barrier
    (GPT-2 on GPUs: XLA then materialises them instead of fusing them into their readers)."""
    from jax_blink.api import overlapped_grad
    from jax_blink.lowering import jaxpr_steps
    monkeypatch.setattr(async_call, "runs_async", lambda platform: True)
    seen = []
    real = overlapped_grad._held

    def spy(program, values, i, hold, since, backward, weights):
        keys = real(program, values, i, hold, since, backward, weights)
        seen.append((hold, i, since, backward, keys, program))
        return keys

    monkeypatch.setattr(overlapped_grad, "_held", spy)
    params = _mlp_params(21)
    xs = _sharded(np.random.default_rng(22).integers(0, 50, (N, 6)).astype(np.int32))
    for hold in ("recent", "all"):
        mesh = _mesh()

        @jax.jit
        @jax.shard_map(mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=False)
        def f(params, xs):
            return jax_blink.value_and_grad_overlapped(_mlp_loss, "data", has_aux=True, reduce_aux=True,
                                                       bucket_bytes=1024, first_bucket_bytes=1024,
                                                       hold=hold)(params, xs[0])[1]

        with override(dispatch="blink"):
            f.lower(params, xs)
    recent = [s for s in seen if s[0] == "recent"]
    everything = [s for s in seen if s[0] == "all"]
    assert len(recent) == len(everything) >= 4
    program = recent[0][5]
    for (_, i, since, backward, keys, _), (_, _, _, _, all_keys, _) in zip(recent, everything):
        if i < backward:  # the aux statistics' start, in the forward pass: nothing held back
            assert keys == [] and all_keys
            continue
        assert keys and set(keys) < set(all_keys)
        assert all(since < program.made(k) <= i for k in keys), (i, since)
        assert any(program.made(k) < backward for k in all_keys)  # the forward pass's values too


def test_value_and_grad_overlapped_weights_holds_only_the_products_weights(monkeypatch):
    """hold="weights" passes through each barrier only the function's arguments that matrix
    products alone read (the blocks' weights: not the scale, read elementwise, nor the embedding,
    gathered) and that a later step reads, none before the backward pass; the rest of the
    backward pass's products read them through the barrier, so they wait for the start."""
    from jax_blink.api import overlapped_grad
    monkeypatch.setattr(async_call, "runs_async", lambda platform: True)
    seen = []
    real = overlapped_grad._held

    def spy(program, values, i, hold, since, backward, weights):
        keys = real(program, values, i, hold, since, backward, weights)
        seen.append((i, backward, keys, program))
        return keys

    def loss(p, x):
        h = p["embed"][x]
        for w in p["blocks"]:
            h = jnp.tanh(h @ w) * p["scale"]
        return jnp.mean((h @ p["embed"].T) ** 2)

    monkeypatch.setattr(overlapped_grad, "_held", spy)
    params = {**_mlp_params(23), "scale": jnp.asarray(np.random.default_rng(25).uniform(0.5, 1.5, 16), jnp.float32)}
    xs = _sharded(np.random.default_rng(24).integers(0, 50, (N, 6)).astype(np.int32))

    def step(which):
        @jax.jit
        @jax.shard_map(mesh=_mesh(), in_specs=(P(), P("data")), out_specs=P(), check_vma=False)
        def f(params, xs):
            if which == "psum":
                return jax.tree.map(lambda g: lax.psum(g, "data"), jax.grad(loss)(params, xs[0]))
            return jax_blink.value_and_grad_overlapped(loss, "data", bucket_bytes=1024, first_bucket_bytes=1024,
                                                       hold="weights")(params, xs[0])[1]
        return f

    with override(dispatch="blink"):
        text = step("weights").lower(params, xs).as_text()
    assert len(seen) >= 4
    program = seen[0][3]
    blocks = set(program.in_keys[:4])  # the leaves in order: blocks 0-3, embed, scale, then x
    held_in_backward = 0
    for i, backward, keys, _ in seen:
        if i < backward:
            assert keys == []
            continue
        assert set(keys) <= blocks and all(program.last_use[k] > i for k in keys)
        held_in_backward += bool(keys)
    assert held_in_backward >= 2  # the weights of the blocks below, still to be read
    lines = text.split("\n")
    _, _, barriers, _ = overlap_lines(text)
    assert sum(1 for b in barriers if _barrier_operands(lines[b]) >= 2) == held_in_backward
    monkeypatch.undo()  # the CPU form, run: psum's numbers
    with override(dispatch="blink"):
        got = step("weights")(params, xs)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(step("psum")(params, xs))):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=1e-6)


def test_value_and_grad_overlapped_refuses_gradients_jax_already_summed():
    """Inside shard_map(check_vma=True), parameters left invariant get gradients that jax's own
    transpose sums (a psum_invariant per leaf): summing them again would give N times psum's. The
    call names the leaves and the fix; with the parameters made varying it gives psum's numbers."""
    rng = np.random.default_rng(41)
    params = {"b": jnp.asarray(rng.normal(size=16), jnp.float32),
              "w": jnp.asarray(rng.normal(size=(16, 16)), jnp.float32)}
    xs = _sharded(rng.normal(size=(N, 3, 16)).astype(np.float32))

    def loss(p, x):
        return jnp.mean(jnp.tanh(x @ p["w"] + p["b"]) ** 2)

    def step(which):
        @jax.jit
        @jax.shard_map(mesh=_mesh(), in_specs=(P(), P("data")), out_specs=P())
        def f(params, xs):
            mine = lax.pcast(params, "data", to="varying")
            if which == "psum":
                return lax.psum(jax.grad(loss)(mine, xs[0]), "data")
            return jax_blink.value_and_grad_overlapped(loss, "data")(params if which == "invariant" else mine,
                                                                    xs[0])[1]
        return f

    with pytest.raises(ValueError, match=r"already summed the gradient of 2 parameter leaf\(s\) over 'data' "
                                         r"\(\['b'\], \['w'\]\).*lax.pcast\(params, 'data', to='varying'\)"):
        step("invariant")(params, xs)
    want = step("psum")(params, xs)
    with override(dispatch="blink"):
        got = step("varying")(params, xs)
    for k in params:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=2e-5, atol=1e-6)


def test_value_and_grad_overlapped_rejects_bad_options():
    with pytest.raises(ValueError, match="hold must be one of"):
        jax_blink.value_and_grad_overlapped(_mlp_loss, "data", hold="some")
    with pytest.raises(TypeError, match="large_leaf_alone must be True or False"):
        jax_blink.value_and_grad_overlapped(_mlp_loss, "data", large_leaf_alone=1)


def test_value_and_grad_overlapped_leaves_lax_buckets_to_xla(monkeypatch):
    """Buckets the dispatch gives to lax (here every one: dispatch="lax") are XLA's own all-reduces
    with no optimization_barrier after them (XLA's scheduler places and overlaps those; the
    barriers cost GPT-2's step 2.6% on 4 x H200), and the gradients still equal value_and_grad +
    psum on fresh random data. The same program under dispatch="blink" keeps its barriers."""
    monkeypatch.setattr(async_call, "runs_async", lambda platform: True)
    params = _mlp_params(13)
    xs = _sharded(np.random.default_rng(14).integers(0, 50, (N, 6)).astype(np.int32))
    mesh = _mesh()

    def step():  # a new jit per dispatch: jax's trace cache does not see jax_blink's options
        @jax.jit
        @jax.shard_map(mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=False)
        def f(params, xs):
            return jax_blink.value_and_grad_overlapped(lambda p, x: _mlp_loss(p, x)[0], "data", bucket_bytes=1024,
                                                       first_bucket_bytes=1024)(params, xs[0])[1]
        return f

    with override(dispatch="lax"):
        f = step()
        text = f.lower(params, xs).as_text()
        got = f(params, xs)
    # no barrier, no jax_blink collective (on CPU host devices the starts still chain in one order)
    assert "optimization_barrier" not in text and "jax_blink_collective" not in text, text
    assert text.count("stablehlo.all_reduce") >= 4, text
    with override(dispatch="blink"):
        assert "optimization_barrier" in step().lower(params, xs).as_text()
    want = _overlapped_step(params, xs, "psum")[2]
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=1e-6)


def test_value_and_grad_overlapped_equals_psum_bitwise_on_exact_sums():
    """Gradients whose sums are exact in any order (small integers in float32): the overlapped
    form gives psum's bits, in several buckets."""
    rng = np.random.default_rng(11)
    params = {"w": jnp.asarray(rng.integers(-3, 4, (12, 5)), jnp.float32),
              "v": jnp.asarray(rng.integers(-3, 4, (7,)), jnp.float32)}
    xs = _sharded(rng.integers(-4, 5, (N, 3, 12)).astype(np.float32))

    def loss(p, x):
        return jnp.sum(x @ p["w"]) + jnp.sum(x[0, :7] * p["v"])

    mesh = _mesh()

    def run(which):
        @jax.jit
        @jax.shard_map(mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=False)
        def f(p, x):
            if which == "psum":
                return jax.tree.map(lambda g: lax.psum(g, "data"), jax.grad(loss)(p, x[0]))
            return jax_blink.value_and_grad_overlapped(loss, "data", bucket_bytes=16, first_bucket_bytes=16)(
                p, x[0])[1]
        return f(params, xs), f.lower(params, xs).as_text()

    with override(dispatch="blink"):
        got, text = run("blink")
    assert text.count("@jax_blink_collective") >= 2  # the executor, in several buckets (not lax)
    want, _ = run("psum")
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.array_equal(np.asarray(g), np.asarray(w))


def test_value_and_grad_overlapped_cuts_its_last_bucket():
    """``last_bucket_pieces``: the last bucket's leaves in that many calls (psum's bits still), and
    a bad value refused naming the argument."""
    rng = np.random.default_rng(12)
    params = {k: jnp.asarray(rng.integers(-3, 4, (6,)), jnp.float32) for k in "abcde"}
    xs = _sharded(rng.integers(-4, 5, (N, 6)).astype(np.float32))

    def loss(p, x):
        return sum(jnp.sum(jnp.tanh(x * p[k]) * (i + 1)) for i, k in enumerate("abcde"))

    mesh = _mesh()

    def run(pieces):
        f = jax.jit(jax.shard_map(
            lambda p, x: jax_blink.value_and_grad_overlapped(
                loss, "data", bucket_bytes=1 << 20, first_bucket_bytes=16, last_bucket_pieces=pieces)(p, x[0])[1],
            mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=False))
        return f(params, xs), f.lower(params, xs).as_text().count("@jax_blink_collective")

    with override(dispatch="blink"):
        whole, calls_whole = run(1)
        cut, calls_cut = run(3)
    assert (calls_whole, calls_cut) == (2, 4)  # the first bucket (one leaf), then 4 leaves in 1 or 3 calls
    for g, w in zip(jax.tree.leaves(cut), jax.tree.leaves(whole)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="last_bucket_pieces"):
        jax_blink.value_and_grad_overlapped(loss, "data", last_bucket_pieces=0)
    with pytest.raises(TypeError, match="last_bucket_pieces"):
        jax_blink.value_and_grad_overlapped(loss, "data", last_bucket_pieces=2.5)


def test_bucket_packing_barrier_holds_each_leaf_of_an_overlapped_bucket_apart():
    """``bucket_packing="barrier"``: the overlapped form's bucket of several leaves passes each leaf
    through a barrier of its own before the concatenation (one more ``optimization_barrier`` per
    leaf than XLA's packing), and the sums stay the same, bit for bit."""
    n = min(4, len(jax.devices()))
    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    rng = np.random.default_rng(11)
    host = {"a": rng.standard_normal((n, 300)).astype(np.float32), "b": rng.standard_normal((n, 7, 9)).astype(np.float32),
            "c": rng.standard_normal((n, 5)).astype(np.float32)}
    tree = {k: jax.device_put(v, NamedSharding(mesh, P("data"))) for k, v in host.items()}
    layout = BucketLayout.of({k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for k, v in host.items()}, bucket_bytes=1 << 20)
    assert len(layout.buckets) == 1  # one bucket of the three leaves

    def body(t):
        return bucketed_all_reduce(jax.tree.map(lambda v: v[0], t), "data", layout=layout, overlap=True)

    barriers, outs = {}, {}
    for name in ("xla", "barrier"):
        # A function of its own per option: the packing is chosen while tracing, and jit keeps a trace.
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P()))
        with override(bucket_packing=name, dispatch="blink"):
            barriers[name] = len(re.findall(r"stablehlo\.optimization_barrier", f.lower(tree).as_text()))
            outs[name] = f(tree)
    assert barriers["barrier"] == barriers["xla"] + 3, barriers
    for k in tree:
        np.testing.assert_array_equal(np.asarray(outs["barrier"][k]), np.asarray(outs["xla"][k]))
        np.testing.assert_allclose(np.asarray(outs["barrier"][k]), host[k].sum(0), rtol=1e-5, atol=1e-5)


def test_bucket_packing_kernel_leaves_cpu_programs_as_they_were():
    """``bucket_packing="kernel"`` packs with the copy kernel on GPUs only: on CPU host devices the
    overlapped form lowers to the same program (XLA's concatenation and slices) and the same sums."""
    import re
    import jax_blink
    from jax import lax
    from jax.sharding import PartitionSpec as P
    from jax_blink.api.buckets import BucketLayout, bucketed_all_reduce
    from jax_blink.lowering import packing
    from jax_blink.options import override

    assert not packing.uses_kernel("cpu")
    n = min(4, len(jax.devices()))
    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    rng = np.random.default_rng(5)
    host = {"a": rng.standard_normal((n, 300)).astype(np.float32), "b": rng.standard_normal((n, 7, 9)).astype(np.float32)}
    tree = {k: jax.device_put(v, NamedSharding(mesh, P("data"))) for k, v in host.items()}
    layout = BucketLayout.of({k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for k, v in host.items()}, bucket_bytes=1 << 20)

    def body(t):
        return bucketed_all_reduce(jax.tree.map(lambda v: v[0], t), "data", layout=layout, overlap=True)

    texts, outs = {}, {}
    for name in ("xla", "kernel"):
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P()))  # a trace per option
        with override(bucket_packing=name, dispatch="blink"):
            texts[name] = f.lower(tree).as_text()
            outs[name] = f(tree)
    assert "jax_blink_pack" not in texts["kernel"] and "concatenate" in texts["kernel"]
    def plain(text):  # source locations and the call's communicator id (one per trace) aside
        return re.sub(r"comm_id = \d+", "comm_id = N", re.sub(r"loc\(.*?\)", "", text))
    assert plain(texts["kernel"]) == plain(texts["xla"])
    for k in tree:
        np.testing.assert_array_equal(np.asarray(outs["kernel"][k]), np.asarray(outs["xla"][k]))
        np.testing.assert_allclose(np.asarray(outs["kernel"][k]), host[k].sum(0), rtol=1e-5, atol=1e-5)
    jax_blink.check()
