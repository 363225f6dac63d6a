"""The switch's overlap (jax_blink/switch/overlap.py): under ``jax_blink.installed()`` an unedited
data-parallel step's gradient all-reduces start in buckets inside the backward pass.

On 8 CPU host devices (tests/conftest.py) the starts run synchronously: the program must give the
unrewritten program's numbers (bit for bit where every sum is exact), keep one order of jax_blink
calls, and say what it did. The GPU form (side-stream starts, barriers, dones after the last
start) is checked on its StableHLO text, as tests/unit/test_async.py does for the explicit API.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.flatten_util import ravel_pytree
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_blink
from jax_blink.lowering import async_call
from jax_blink.options import override
from jax_blink.switch import overlap
# tests/ is on sys.path (pytest's prepend import mode): the switch tests' runner and clean-up
from test_async import overlap_lines
from test_switch_merge import _run, _switch_off_after_each_test  # noqa: F401 (an autouse fixture)

DEVICES = jax.devices()
N = len(DEVICES)
pytestmark = pytest.mark.skipif(N < 8, reason="needs the 8 CPU host devices of tests/conftest.py")


def _mesh():
    return jax.make_mesh((N,), ("data",), devices=DEVICES)


def _sharded(a):
    return jax.device_put(jnp.asarray(a), NamedSharding(_mesh(), P("data")))


def _params(rng, exact: bool, layers: int = 5, width: int = 16):
    draw = ((lambda s: rng.integers(-1, 2, s)) if exact else (lambda s: rng.standard_normal(s) / 4))
    return {"layers": [{"w": jnp.asarray(draw((width, width)), jnp.float32),
                        "b": jnp.asarray(draw((width,)), jnp.float32)} for _ in range(layers)],
            "head": jnp.asarray(draw((width, 3)), jnp.float32)}


def _loss(exact: bool):
    """A deep enough model that the backward pass has work between the gradients; with ``exact``,
    linear layers on small integers (every gradient and every sum of them exact in float32)."""
    act = (lambda h: h) if exact else jnp.tanh

    def loss(p, x):
        h = x
        for layer in p["layers"]:
            h = act(h @ layer["w"] + layer["b"])
        return jnp.sum(h @ p["head"])

    return loss


def _step(loss, *, pcast: bool, bucketed: bool = False, extra=None):
    """The step as users write it: gradients of this device's batch summed by lax.psum over
    "data" (``pcast``: of parameters made varying, so jax's own transposes are the psums; else
    ``lax.psum(grads)`` after the backward pass; ``bucketed``: one flat psum of all of them)."""
    mesh = _mesh()

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=pcast)
    def step(p, x):
        if pcast:
            grads = jax.grad(lambda q: loss(jax.tree.map(lambda v: lax.pcast(v, "data", to="varying"), q),
                                            x[0]))(p)
        else:
            grads = jax.grad(loss)(p, x[0])
            if bucketed:
                flat, unravel = ravel_pytree(grads)
                grads = unravel(lax.psum(flat, "data"))
            else:
                grads = lax.psum(grads, "data")
        out = jax.tree.map(lambda p_, g: p_ - 0.1 * g, p, grads)
        return out if extra is None else (out, extra(x[0]))

    return step


@pytest.mark.parametrize("form", ["psum_after_grad", "bucketed", "pcast"])
def test_overlapped_step_equals_the_unswitched_step_bitwise(form):
    """Small integers in float32: every sum is exact, so the switched step must give XLA's bits."""
    rng = np.random.default_rng(1)
    params = _params(rng, exact=True)
    x = _sharded(rng.integers(-2, 3, (N, 4, 16)).astype(np.float32))
    step = _step(_loss(True), pcast=form == "pcast", bucketed=form == "bucketed")
    with override(merge_bytes=2048):
        plain, switched, calls, report = _run(step, params, x)
    for w, g in zip(jax.tree.leaves(plain), jax.tree.leaves(switched)):
        assert w.dtype == g.dtype and w.shape == g.shape
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    started = [d for d in report if d.overlapped]
    if form == "bucketed":  # one flat psum of every gradient: nothing to start early, one call
        assert not started and calls == 1, report
        return
    assert len(started) >= 2 and all(d.runs_on == "jax_blink" for d in started), report
    assert calls == len(started) and sum(d.operands for d in started) == 11, report
    assert "started as they became ready" in str(started[0])


def test_merging_off_starts_each_psum_in_a_bucket_of_its_own():
    """merge_bytes=0 (merging off): the overlap still starts the gradients early, one all-reduce per
    bucket, and the step keeps the unswitched bits."""
    rng = np.random.default_rng(13)
    params = _params(rng, exact=True)
    x = _sharded(rng.integers(-2, 3, (N, 4, 16)).astype(np.float32))
    step = _step(_loss(True), pcast=False, bucketed=False)
    rewrite = overlap.overlap_all_reduces(_body(step, params, x), 0)
    assert rewrite.buckets == rewrite.operands == 11, rewrite.reason
    with override(merge_bytes=0):
        plain, switched, calls, report = _run(step, params, x)
    for w, g in zip(jax.tree.leaves(plain), jax.tree.leaves(switched)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    started = [d for d in report if d.overlapped]
    assert len(started) == calls == 11 and all(d.operands == 1 for d in started), report


@pytest.mark.parametrize("cap", [4096, 1 << 20])
def test_the_last_bucket_cut_into_pieces(cap):
    """switch_last_bucket_pieces: the last bucket to be ready becomes that many buckets of
    consecutive all-reduces, each started on its own, the others as they were; the step keeps the
    unswitched bits. With a cap that holds every gradient (one bucket, nothing to overlap) the
    cut is what lets the starts overlap."""
    rng = np.random.default_rng(14)
    params = _params(rng, exact=True)
    x = _sharded(rng.integers(-2, 3, (N, 4, 16)).astype(np.float32))
    step = _step(_loss(True), pcast=False)
    body = _body(step, params, x)

    def counts(rewrite):  # operands per start, in start order
        return [e.params["count"] for e in rewrite.jaxpr.eqns if e.primitive.name == "jax_blink_overlap_start"]

    whole, cut = overlap.overlap_all_reduces(body, cap), overlap.overlap_all_reduces(body, cap, last_bucket_pieces=3)
    assert cut.operands == 11 and sum(counts(cut)) == 11, cut.reason
    if cap == 4096:
        assert counts(whole)[-1] >= 3, whole.reason  # a last bucket of several all-reduces to cut
        assert counts(cut)[:whole.buckets - 1] == counts(whole)[:-1]
        tail = counts(cut)[whole.buckets - 1:]
        assert len(tail) == 3 and sum(tail) == counts(whole)[-1] and max(tail) - min(tail) <= 1, tail
    else:
        assert whole.buckets == 0 and "nothing to overlap" in whole.reason, whole.reason
        assert counts(cut) == [3, 4, 4], counts(cut)  # 11 all-reduces, in readiness order
    assert overlap._first_unbound(cut.jaxpr) is None
    with override(merge_bytes=cap, switch_last_bucket_pieces=3):
        plain, switched, calls, report = _run(step, params, x)
    for w, g in zip(jax.tree.leaves(plain), jax.tree.leaves(switched)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    started = [d for d in report if d.overlapped]
    assert len(started) == calls == cut.buckets and sum(d.operands for d in started) == 11, report


def test_overlapped_step_against_numpy_on_random_floats():
    """Fresh random weights and data (tanh layers): each summed gradient against numpy's float64
    sum of the per-device gradients, and the switched step against the unswitched one."""
    rng = np.random.default_rng(2)
    params = _params(rng, exact=False)
    host_x = rng.standard_normal((N, 4, 16)).astype(np.float32)
    loss = _loss(False)
    step = _step(loss, pcast=True)
    with override(merge_bytes=4096):
        plain, switched, _, report = _run(step, params, _sharded(host_x))
    want = sgd_in_float64(loss, params, host_x, 0.1)
    for w, g, u in zip(jax.tree.leaves(want), jax.tree.leaves(switched), jax.tree.leaves(plain)):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(g), np.asarray(u), rtol=1e-5, atol=1e-6)
    assert any(d.overlapped for d in report)


def sgd_in_float64(loss, params, per_device_data, lr: float):
    """numpy's float64 reference for one SGD step on gradients summed over devices: ``params`` less
    ``lr`` times the sum of ``jax.grad(loss)`` on each device's data (``per_device_data[i]``)."""
    per_device = [jax.grad(loss)(params, per_device_data[i]) for i in range(len(per_device_data))]
    return jax.tree.map(lambda p, *gs: np.asarray(p, np.float64) - lr * np.sum(
        [np.asarray(g, np.float64) for g in gs], axis=0), params, *per_device)


def _body(step, *args):
    """The shard_map body of a jitted step (a core.Jaxpr)."""
    closed = jax.make_jaxpr(step)(*args)
    eqn = closed.jaxpr.eqns[0]
    inner = eqn.params["jaxpr"]  # the jit's body
    (sm,) = [e for e in getattr(inner, "jaxpr", inner).eqns if e.primitive.name == "shard_map"]
    return sm.params["jaxpr"]


@pytest.mark.parametrize("form", ["psum_after_grad", "bucketed", "pcast"])
def test_starts_land_inside_the_backward_pass(form):
    """The rewritten body: the starts come one by one between the backward pass's matrix products
    (hoisting a bucket's concatenation or psums that the program wrote after the pass), every start
    but the first holds values back, and one done after the last start gives the psums' results."""
    rng = np.random.default_rng(3)
    params = _params(rng, exact=False, layers=6)
    x = _sharded(rng.standard_normal((N, 4, 16)).astype(np.float32))
    body = _body(_step(_loss(False), pcast=form == "pcast", bucketed=form == "bucketed"), params, x)
    rewrite = overlap.overlap_all_reduces(body, 1 if form != "bucketed" else 1 << 20)
    names = [e.primitive.name for e in rewrite.jaxpr.eqns]
    if form == "bucketed":  # one flat psum: one start, nothing to hold or overlap before it
        assert rewrite.buckets == 0 and "nothing to overlap" in rewrite.reason, rewrite.reason
        return
    starts = [i for i, n in enumerate(names) if n == "jax_blink_overlap_start"]
    dones = [i for i, n in enumerate(names) if n == "jax_blink_overlap_done"]
    dots = [i for i, n in enumerate(names) if n == "dot_general"]
    assert rewrite.buckets == len(starts) == 13 and rewrite.operands == 13, rewrite.reason
    assert dones == [starts[-1] + 1]
    assert sum(1 for d in dots if starts[0] < d < starts[-1]) >= 5  # the backward pass runs between them
    assert "psum" not in names and "psum_invariant" not in names
    held = [len(rewrite.jaxpr.eqns[s].invars) - rewrite.jaxpr.eqns[s].params["count"] for s in starts]
    assert held[0] == 0 and all(h >= 1 for h in held[1:-1]), held
    assert rewrite.jaxpr.eqns[starts[-1]].params["last"] and not rewrite.jaxpr.eqns[starts[0]].params["last"]
    done = rewrite.jaxpr.eqns[dones[0]]
    assert done.invars[-1] is rewrite.jaxpr.eqns[starts[-1]].outvars[1]  # the token: the last start's operand
    assert len(done.outvars) == 13


def test_a_bucketed_psum_is_hoisted_with_its_concatenation():
    """The program packed its own buckets after the backward pass (as DDP-style code does): the
    concatenations move up to where their gradients exist, and their starts with them."""
    rng = np.random.default_rng(4)
    params = _params(rng, exact=False, layers=6)
    x = _sharded(rng.standard_normal((N, 4, 16)).astype(np.float32))
    mesh = _mesh()

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=False)
    def step(p, x):
        grads = jax.grad(_loss(False))(p, x[0])
        leaves, tree = jax.tree.flatten(grads)
        # two buckets of leaves in reverse order (the last layers' gradients come first)
        first, second = leaves[len(leaves) // 2:], leaves[:len(leaves) // 2]
        sums = [lax.psum(jnp.concatenate([g.reshape(-1) for g in b]), "data") for b in (first, second)]
        out, k = [], 0
        for b, s in zip((first, second), sums):
            for g in b:
                out.append(s[k:k + g.size].reshape(g.shape))
                k += g.size
            k = 0
        return jax.tree.unflatten(tree, out[len(first):] + out[:len(first)])

    body = _body(step, params, x)
    rewrite = overlap.overlap_all_reduces(body, 4096)  # each of the program's buckets, not both in one
    names = [e.primitive.name for e in rewrite.jaxpr.eqns]
    starts = [i for i, n in enumerate(names) if n == "jax_blink_overlap_start"]
    dots = [i for i, n in enumerate(names) if n == "dot_general"]
    assert len(starts) == 2, rewrite.reason
    assert any(starts[0] < d < starts[1] for d in dots)  # the second bucket's gradients come after
    assert "concatenate" not in names[starts[1]:]  # both packings hoisted before their starts
    with override(merge_bytes=4096):
        plain, switched, _, _ = _run(step, params, x)
    for w, g in zip(jax.tree.leaves(plain), jax.tree.leaves(switched)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_what_stays_where_the_program_wrote_it():
    """A psum read at once (the forward pass's) stays in place; another collective between the
    starts leaves the body as written (a synchronous call there could wait on a started one);
    switch_overlap=False turns it off."""
    rng = np.random.default_rng(5)
    params = _params(rng, exact=False)
    x = _sharded(rng.standard_normal((N, 4, 16)).astype(np.float32))
    mesh = _mesh()

    def loss_with_forward_psum(p, x):
        h = x
        for layer in p["layers"]:
            h = jnp.tanh(lax.psum(h @ layer["w"], "data") / N + layer["b"])
        return jnp.sum(h @ p["head"])

    body = _body(_step(loss_with_forward_psum, pcast=False), params, x)
    rewrite = overlap.overlap_all_reduces(body, 1 << 20)
    names = [e.primitive.name for e in rewrite.jaxpr.eqns]
    # The forward psums (and their transposes, read at once in the backward pass) stay; with them
    # between the gradients' starts, the body is left as written.
    assert rewrite.buckets == 0 and "another collective" in rewrite.reason, rewrite.reason
    assert names == [e.primitive.name for e in body.eqns]

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=False)
    def clipped(p, x):  # each leaf scaled by its largest entry over the devices, then summed
        grads = jax.grad(_loss(False))(p, x[0])
        return jax.tree.map(lambda g: lax.psum(g / lax.pmax(jnp.abs(g).max(), "data"), "data"), grads)

    rewrite = overlap.overlap_all_reduces(_body(clipped, params, x), 1024)
    assert rewrite.buckets == 0 and "another collective (pmax)" in rewrite.reason, rewrite.reason

    step = _step(_loss(False), pcast=True)
    with override(switch_overlap=False):
        _, _, _, report = _run(step, params, x)
    assert report and not any(d.overlapped for d in report)


def test_a_logged_loss_and_the_gradients_share_the_starts():
    """pmean of a loss computed after the update (a logged metric) stays where it is: it is in
    flight across no point of the backward pass; the gradients start as before, and the results
    equal the unswitched step's."""
    rng = np.random.default_rng(6)
    params = _params(rng, exact=True)
    x = _sharded(rng.integers(-2, 3, (N, 4, 16)).astype(np.float32))
    loss = _loss(True)
    step = _step(loss, pcast=False, extra=lambda xb: lax.pmean(loss(params, xb), "data"))
    with override(merge_bytes=1024):
        plain, switched, _, report = _run(step, params, x)
    for w, g in zip(jax.tree.leaves(plain), jax.tree.leaves(switched)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert sum(d.operands for d in report if d.overlapped) == 11, report
    assert [d.shape for d in report if not d.overlapped] == [()], report  # the loss, synchronous


def test_gpu_lowering_starts_on_the_side_stream_with_barriers(monkeypatch):
    """The GPU form, lowered here as text: one jax_blink_start per bucket (operand aliased, the last
    on the whole grid), a barrier after every start but the first, and one jax_blink_done per
    bucket after the last start, each taking the last start's operand as its token."""
    monkeypatch.setattr(async_call, "runs_async", lambda platform: True)
    rng = np.random.default_rng(7)
    params = _params(rng, exact=False, layers=6)
    x = _sharded(rng.standard_normal((N, 4, 16)).astype(np.float32))
    step = _step(_loss(False), pcast=True)
    with jax_blink.installed(), override(dispatch="blink", merge_bytes=2048):
        text = step.lower(params, x).as_text()
    starts, dones, barriers, dots = overlap_lines(text)
    assert len(starts) >= 3 and len(dones) == len(starts), text
    assert max(starts) < min(dones)
    assert any(starts[0] < d < starts[-1] for d in dots)
    assert sum(1 for s in starts[1:] if any(s < b < s + 40 for b in barriers)) >= len(starts) - 2, text
    assert text.count("full_grid = 1 : i32") == 1
    names = re.findall(r"(%\S+):2 = stablehlo.custom_call @jax_blink_start\(", text)
    tokens = re.findall(r"stablehlo.custom_call @jax_blink_done\(%[^,]+, %[^,]+, (%[^)]+)\)", text)
    assert tokens and all(t == f"{names[-1]}#0" for t in tokens), (names, tokens)


def test_lax_buckets_stay_xla_and_unheld(monkeypatch):
    """Where the dispatch table gives a bucket to lax, the start is XLA's all-reduce of the
    concatenation, with no barrier (XLA places its own collectives), and the numbers are psum's."""
    rng = np.random.default_rng(8)
    params = _params(rng, exact=True)
    x = _sharded(rng.integers(-2, 3, (N, 4, 16)).astype(np.float32))
    step = _step(_loss(True), pcast=True)
    plain = step(params, x)
    with jax_blink.installed(), override(dispatch="lax", merge_bytes=2048):
        jax_blink.switch_report(clear=True)
        text = step.lower(params, x).as_text()
        switched = step(params, x)
        report = jax_blink.switch_report()
    assert "optimization_barrier" not in text and "jax_blink" not in text
    assert report and all(d.runs_on == "xla" and d.overlapped for d in report), report
    for w, g in zip(jax.tree.leaves(plain), jax.tree.leaves(switched)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_explain_lowering_says_what_the_overlap_did():
    rng = np.random.default_rng(9)
    params = _params(rng, exact=False)
    x = _sharded(rng.standard_normal((N, 4, 16)).astype(np.float32))
    with override(dispatch="blink", merge_bytes=2048):
        text = jax_blink.explain_lowering(_step(_loss(False), pcast=True), params, x)
    lines = text.splitlines()
    assert any("started as they became ready" in line for line in lines), text
    assert re.search(r"^overlap: 11 psums in \d+ buckets started as their operands became ready$", text, re.M), text
    with override(dispatch="blink", merge_bytes=2048, switch_overlap=False):
        text = jax_blink.explain_lowering(_step(_loss(False), pcast=True), params, x)
    assert "overlap:" not in text and "started" not in text, text


def test_a_psum_of_a_psum_keeps_its_order():
    """A psum whose operand is packed from another psum's result: the packing is not hoisted above
    the wait that makes its operand, and the step still equals the unswitched one."""
    rng = np.random.default_rng(10)
    params = _params(rng, exact=True)
    x = _sharded(rng.integers(-2, 3, (N, 4, 16)).astype(np.float32))
    mesh = _mesh()

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=False)
    def step(p, x):
        grads = jax.grad(_loss(True))(p, x[0])
        summed = lax.psum(grads, "data")
        again = lax.psum(summed["head"].reshape(-1), "data")  # read late: in flight with the rest
        return summed, again

    rewrite = overlap.overlap_all_reduces(_body(step, params, x), 2048)
    assert overlap._first_unbound(rewrite.jaxpr) is None, rewrite.reason
    with override(merge_bytes=2048):
        plain, switched, _, _ = _run(step, params, x)
    for w, g in zip(jax.tree.leaves(plain), jax.tree.leaves(switched)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_a_late_last_wait_lets_the_other_updates_run_first():
    """switch_late_last_wait: the last bucket gets a wait of its own, after every update that does
    not read it (tied behind their results), and the updates that read it come after; the step
    still equals the unswitched one bit for bit."""
    rng = np.random.default_rng(12)
    params = _params(rng, exact=True)
    x = _sharded(rng.integers(-2, 3, (N, 4, 16)).astype(np.float32))
    step = _step(_loss(True), pcast=True)
    rewrite = overlap.overlap_all_reduces(_body(step, params, x), 2048, late_last_wait=True)
    eqns = rewrite.jaxpr.eqns
    dones = [i for i, e in enumerate(eqns) if e.primitive.name == "jax_blink_overlap_done"]
    starts = [i for i, e in enumerate(eqns) if e.primitive.name == "jax_blink_overlap_start"]
    assert len(dones) == 2 and dones[0] == starts[-1] + 1, rewrite.reason
    early, late = eqns[dones[0]], eqns[dones[1]]
    assert early.params["after"] == 0 and late.params["after"] >= 1
    assert len(early.params["ids"]) == len(starts) - 1 and len(late.params["ids"]) == 1
    summed_late = set(late.outvars)
    # Every update before the late wait reads none of its results; those after it read them (or
    # what is made from them).
    between = eqns[dones[0] + 1:dones[1]]
    assert between and not any(v in summed_late for e in between for v in e.invars if overlap._jx.is_var(v))
    made_after = set(summed_late)
    for e in eqns[dones[1] + 1:]:
        assert any(v in made_after for v in e.invars if overlap._jx.is_var(v)), e
        made_after.update(e.outvars)
    assert overlap._first_unbound(rewrite.jaxpr) is None
    with override(merge_bytes=2048, switch_late_last_wait=True):
        plain, switched, _, report = _run(step, params, x)
    for w, g in zip(jax.tree.leaves(plain), jax.tree.leaves(switched)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert sum(d.operands for d in report if d.overlapped) == 11


def test_the_late_wait_is_tied_behind_a_barrier_on_gpus(monkeypatch):
    monkeypatch.setattr(async_call, "runs_async", lambda platform: True)
    rng = np.random.default_rng(13)
    params = _params(rng, exact=False, layers=6)
    x = _sharded(rng.standard_normal((N, 4, 16)).astype(np.float32))
    step = _step(_loss(False), pcast=True)
    with jax_blink.installed(), override(dispatch="blink", merge_bytes=2048, switch_late_last_wait=True):
        text = step.lower(params, x).as_text()
    names = re.findall(r"(%\S+):2 = stablehlo.custom_call @jax_blink_start\(", text)
    tokens = re.findall(r"stablehlo.custom_call @jax_blink_done\(%[^,]+, %[^,]+, (%[^)]+)\)", text)
    assert len(tokens) == len(names) >= 3
    # Every early wait takes the last start's operand; the last bucket's, a barrier's first result.
    assert tokens[:-1] == [f"{names[-1]}#0"] * (len(names) - 1), tokens
    barrier = re.search(re.escape(tokens[-1].split("#")[0]) + r":\d+ = stablehlo.optimization_barrier "
                        + re.escape(f"{names[-1]}#0"), text)
    assert barrier, tokens[-1]


def test_a_pmean_of_gradients_jax_already_summed():
    """With shard_map's checks, jax's transposes sum the gradients of replicated parameters where
    the backward pass makes them, and a program that pmeans them again reduces their sums: those
    all-reduces read the first ones' results, so they move to just after the wait, and the step
    equals the unswitched one bit for bit (with biases too: the end of this test)."""
    rng = np.random.default_rng(14)
    params = {"layers": [jnp.asarray(rng.integers(-1, 2, (16, 16)), jnp.float32) for _ in range(5)],
              "head": jnp.asarray(rng.integers(-1, 2, (16, 3)), jnp.float32)}
    x = _sharded(rng.integers(-2, 3, (N, 4, 16)).astype(np.float32))
    mesh = _mesh()

    def loss(p, v):
        for w in p["layers"]:
            v = v @ w
        return jnp.sum(v @ p["head"])

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()))
    def step(p, x):
        value, grads = jax.value_and_grad(loss)(p, x[0])
        grads = lax.pmean(grads, "data")
        return jax.tree.map(lambda a, g: a - 0.5 * g, p, grads), lax.pmean(value, "data")

    rewrite = overlap.overlap_all_reduces(_body(step, params, x), 2048)
    assert rewrite.operands == 7, rewrite.reason  # 6 gradients and the loss; not the 6 pmeans
    names = [e.primitive.name for e in rewrite.jaxpr.eqns]
    done = names.index("jax_blink_overlap_done")
    assert names.count("psum_invariant") == 6 and names.index("psum_invariant") > done
    assert overlap._first_unbound(rewrite.jaxpr) is None
    with override(merge_bytes=2048):
        plain, switched, _, report = _run(step, params, x)
    for w, g in zip(jax.tree.leaves(plain), jax.tree.leaves(switched)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert sum(d.operands for d in report if d.overlapped) == 7

    # With biases: jax 0.10 reads each bias's sum at once (a reduction over a unit axis), which
    # leaves the body as written; jax 0.12 does not, and the body is rewritten. Either way the
    # step is the unswitched one's.
    loss = _loss(True)
    params = _params(rng, exact=True)
    rewrite = overlap.overlap_all_reduces(_body(step, params, x), 2048)
    assert rewrite.blocked or (rewrite.buckets and overlap._first_unbound(rewrite.jaxpr) is None), rewrite
    with override(merge_bytes=2048):
        plain, switched, _, _ = _run(step, params, x)
    for w, g in zip(jax.tree.leaves(plain), jax.tree.leaves(switched)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_read_as_weight_is_one_rule_for_both_program_forms():
    """A value is a weight when something reads it and only products, convolutions and the
    reversal or transposition feeding them do: unread, or read once elementwise, it is not."""
    assert overlap.read_as_weight({"dot_general"})
    assert overlap.read_as_weight({"conv_general_dilated", "rev"})
    assert not overlap.read_as_weight(set())
    assert not overlap.read_as_weight({"dot_general", "add"})
    assert not overlap.read_as_weight({"mul"})


def test_hold_weights_holds_only_what_products_alone_read():
    """switch_hold="weights": the body's weights are the parameters made varying (pvary) that only
    matrix products read (each layer's w and the head: not the biases, added elementwise, nor the
    inputs themselves, which the update also reads); each start but the first holds the weights
    still to be read after it, and no other value (as hold="recent" holds no weight; "none"
    holds nothing); the step keeps the unswitched bits."""
    rng = np.random.default_rng(31)
    params = _params(rng, exact=True, layers=6)
    x = _sharded(rng.integers(-2, 3, (N, 4, 16)).astype(np.float32))
    step = _step(_loss(True), pcast=True)
    body = _body(step, params, x)
    weights = overlap.weights(body)
    assert sorted(tuple(v.aval.shape) for v in weights) == [(16, 3)] + [(16, 16)] * 6, weights
    assert not set(weights) & set(body.invars)  # the inputs are read by the update too
    with pytest.raises(ValueError, match="hold must be one of"):
        overlap.overlap_all_reduces(body, 2048, hold="some")
    for hold in overlap.HOLDS:
        rewrite = overlap.overlap_all_reduces(body, 2048, hold=hold)
        starts = [e for e in rewrite.jaxpr.eqns if e.primitive is overlap.start_p]
        assert len(starts) >= 3, rewrite.reason
        held = [list(e.invars[e.params["count"]:]) for e in starts]
        if hold == "none":
            assert not any(held), held
            continue
        assert held[0] == [] and held[1], held
        if hold == "weights":  # the weights as they are, or as the previous start passed them on;
            # fewer and fewer as the layers' products are done
            assert [len(h) for h in held[1:]] == sorted((len(h) for h in held[1:]), reverse=True), held
            passed = {v for e in starts for v in e.outvars[2:]}
            assert all(v in set(weights) | passed for h in held for v in h)
            assert all(v.aval.shape in ((16, 16), (16, 3)) for h in held for v in h)
        else:
            assert not any(v in set(weights) for h in held for v in h)
    for hold in ("weights", "none"):
        with override(merge_bytes=2048, switch_hold=hold):
            plain, switched, calls, report = _run(step, params, x)
        for w, g in zip(jax.tree.leaves(plain), jax.tree.leaves(switched)):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        assert sum(d.operands for d in report if d.overlapped) == 13, report
