"""The switch's row-sparse gradients (jax_blink/switch/sparse.py): an embedding lookup's gradient
gathered as tokens and rows after the overlap's wait, a tied embedding's dense part started early.

On 8 CPU host devices (tests/conftest.py) the starts run synchronously: the step must give the
unswitched step's numbers (bit for bit where every sum is exact, to rounding otherwise, and
against numpy's float64 sums), say what it did, and leave alone what it must not touch. The GPU
form (the gathers behind a barrier with the wait) is checked on its StableHLO text.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_blink
from jax_blink.lowering import async_call
from jax_blink.options import override
from jax_blink.switch import overlap, sparse
# tests/ is on sys.path (pytest's prepend import mode): the switch tests' runner and clean-up
from test_async import overlap_lines
from test_switch_merge import _run, _switch_off_after_each_test  # noqa: F401 (an autouse fixture)
from test_switch_overlap import _body, sgd_in_float64

DEVICES = jax.devices()
N = len(DEVICES)
pytestmark = pytest.mark.skipif(N < 8, reason="needs the 8 CPU host devices of tests/conftest.py")
VOCAB, WIDTH, BATCH, SEQ = 1024, 16, 2, 8


def _mesh():
    return jax.make_mesh((N,), ("data",), devices=DEVICES)


def _params(rng, exact: bool, layers: int = 4):
    draw = ((lambda s: rng.integers(-1, 2, s)) if exact else (lambda s: rng.standard_normal(s) / 4))
    return {"wte": jnp.asarray(draw((VOCAB, WIDTH)), jnp.float32),
            "layers": [jnp.asarray(draw((WIDTH, WIDTH)), jnp.float32) for _ in range(layers)]}


def _loss(exact: bool, tied: bool = True):
    """A language model's shape: an embedding lookup, layers, and (``tied``) the output layer
    that reuses the table; with ``exact``, linear layers on small integers (exact sums)."""
    act = (lambda h: h) if exact else jnp.tanh

    def loss(p, tokens):
        h = jnp.take(p["wte"], tokens, axis=0)
        for w in p["layers"]:
            h = act(h @ w)
        return jnp.sum(h @ p["wte"].T if tied else h)

    return loss


def _step(loss, bucketed: bool, check_vma: bool = True):
    """Gradients summed as users write it: one psum per leaf, or (``bucketed``) one psum of the
    leaves concatenated (the train tool's buckets), after the backward pass; without
    ``check_vma`` the psums are plain ``psum`` (else ``psum_invariant``) and the gathers plain
    ``all_gather``."""

    @jax.jit
    @jax.shard_map(mesh=_mesh(), in_specs=(P(), P("data")), out_specs=P(), check_vma=check_vma)
    def step(p, tokens):
        mine = jax.tree.map(lambda v: lax.pcast(v, "data", to="varying"), p) if check_vma else p
        grads = jax.grad(loss)(mine, tokens[0])
        if bucketed:
            leaves, tree = jax.tree.flatten(grads)
            flat = lax.psum(jnp.concatenate([g.reshape(-1) for g in reversed(leaves)]), "data")
            out, k = [], flat.size
            for g in leaves:
                out.append(flat[k - g.size:k].reshape(g.shape))
                k -= g.size
            grads = jax.tree.unflatten(tree, out)
        else:
            grads = lax.psum(grads, "data")
        return jax.tree.map(lambda q, g: q - 0.01 * g, p, grads)

    return step


def _tokens(rng):
    return jax.device_put(jnp.asarray(rng.integers(0, VOCAB, (N, BATCH, SEQ)), jnp.int32),
                          NamedSharding(_mesh(), P("data")))


@pytest.mark.parametrize("bucketed,check_vma", [(False, True), (True, True), (True, False)])
def test_exact_step_equals_the_unswitched_step_bitwise(bucketed, check_vma):
    """Small integers: every sum exact in float32, so gathering and scattering the lookup's rows
    must give the dense psum's bits, and the report says the gradient was gathered."""
    rng = np.random.default_rng(21)
    params, tokens = _params(rng, exact=True), _tokens(rng)
    with override(switch_sparse_gradients=True, merge_bytes=4096):
        plain, switched, calls, report = _run(_step(_loss(True), bucketed, check_vma), params, tokens)
    for w, g in zip(jax.tree.leaves(plain), jax.tree.leaves(switched)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    gathers = [d for d in report if d.primitive.startswith("all_gather")]
    assert len(gathers) == 2, report  # the tokens and the rows
    assert {d.primitive for d in gathers} == {"all_gather_invariant" if check_vma else "all_gather"}, report
    with override(switch_sparse_gradients=True, dispatch="blink", merge_bytes=4096):
        text = jax_blink.explain_lowering(_step(_loss(True), bucketed, check_vma), params, tokens)
    assert re.search(r"^overlap: .*; 1 row-sparse gradient\(s\) \(embedding lookups\) all-gathered after the wait$",
                     text, re.M), text


def test_random_step_against_numpy():
    """Fresh random floats: the switched step against numpy's float64 sum of the per-device
    gradients, and against the unswitched step to rounding."""
    rng = np.random.default_rng(22)
    params = _params(rng, exact=False)
    host_tokens = rng.integers(0, VOCAB, (N, BATCH, SEQ)).astype(np.int32)
    loss = _loss(False)
    with override(switch_sparse_gradients=True, merge_bytes=4096):
        plain, switched, _, report = _run(_step(loss, True), params, jax.device_put(
            jnp.asarray(host_tokens), NamedSharding(_mesh(), P("data"))))
    want = sgd_in_float64(loss, params, host_tokens, 0.01)
    for w, g, u in zip(jax.tree.leaves(want), jax.tree.leaves(switched), jax.tree.leaves(plain)):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(g), np.asarray(u), rtol=1e-5, atol=1e-6)
    assert any(d.primitive.startswith("all_gather") for d in report), report


def test_the_rewritten_body_starts_the_dense_part_first_and_gathers_after_the_wait():
    """The tied table's dense part (the output layer's, made first in the backward pass) is the
    first start, the other leaves' concatenation (as the program packed it) the second; the
    gathers read the lookup's tokens and rows through a barrier with a result of
    the wait, after it; the scatter-add of the gathered rows is summed with the dense part."""
    rng = np.random.default_rng(23)
    params, tokens = _params(rng, exact=False), _tokens(rng)
    body = _body(_step(_loss(False), True), params, tokens)
    split = sparse.split_row_sparse(body, {"data": N}, overlap.OVERLAPPABLE_PRIMITIVES)
    assert split.gradients == 1 and len(split.gathered) == 2
    rewrite = overlap.overlap_all_reduces(split.jaxpr, 1)
    # The table's dense part, then the 4 layers' gradients packed as the program packed them.
    assert rewrite.buckets == 2, rewrite.reason
    tied = sparse.gather_after_wait(rewrite.jaxpr, split.gathered, overlap.done_p)
    eqns = tied.eqns
    names = [e.primitive.name for e in eqns]
    starts = [i for i, n in enumerate(names) if n == "jax_blink_overlap_start"]
    (done,) = [i for i, n in enumerate(names) if n == "jax_blink_overlap_done"]
    gathers = [i for i, n in enumerate(names) if n == "all_gather_invariant"]
    (barrier,) = [i for i, n in enumerate(names) if n == "optimization_barrier"]
    assert eqns[starts[0]].invars[0].aval.shape == (VOCAB * WIDTH,)  # the table's dense part first
    assert done < barrier < gathers[0] < gathers[1] and len(gathers) == 2
    assert set(eqns[barrier].invars) >= {eqns[done].outvars[k] for k in np.cumsum((0, *eqns[done].params["buckets"][:-1]))}
    assert all(eqns[g].invars[0] in eqns[barrier].outvars for g in gathers)
    assert [eqns[g].outvars[0].aval.shape for g in gathers] == [(N * BATCH, SEQ, 1), (N * BATCH, SEQ, WIDTH)]
    scatter = names.index("scatter-add", gathers[1])
    assert [v for v in eqns[scatter].invars[1:]] == [eqns[g].outvars[0] for g in gathers]
    assert "psum_invariant" not in names and "scatter-add" not in names[:done]


def test_an_untied_lookup_is_gathered_too():
    """A lookup that is the table's whole gradient: no dense part, the gather alone."""
    rng = np.random.default_rng(24)
    params, tokens = _params(rng, exact=True), _tokens(rng)
    with override(switch_sparse_gradients=True, merge_bytes=1024):  # a bucket per layer: something to overlap
        plain, switched, calls, report = _run(_step(_loss(True, tied=False), False), params, tokens)
    for w, g in zip(jax.tree.leaves(plain), jax.tree.leaves(switched)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert sum(1 for d in report if d.primitive.startswith("all_gather")) == 2, report
    assert not any(d.primitive.startswith("psum") and d.shape == (VOCAB, WIDTH) for d in report), report


def test_left_dense_by_default_when_off_or_when_the_rows_are_not_fewer():
    """By default (measured no faster on GPUs: docs/switch.md), with switch_sparse_gradients=False,
    or with a table no larger than twice the gathered rows: the table's gradient is summed dense."""
    rng = np.random.default_rng(25)
    params, tokens = _params(rng, exact=True), _tokens(rng)
    step = _step(_loss(True), False)
    assert jax_blink.config.switch_sparse_gradients is False
    for options in ({}, {"switch_sparse_gradients": False}):
        with override(merge_bytes=4096, **options):
            _, switched, _, report = _run(step, params, tokens)
        assert not any(d.primitive.startswith("all_gather") for d in report), report
    body = _body(step, params, tokens)
    # Gathered, 8 devices' 16 rows of 16 floats and their tokens (8 x 1,088 bytes) must be at most
    # half the table (64 KiB): at 17 devices' worth per table row they are not.
    assert sparse.split_row_sparse(body, {"data": N}, overlap.OVERLAPPABLE_PRIMITIVES).gradients == 1
    assert sparse.split_row_sparse(body, {"data": 4 * VOCAB}, overlap.OVERLAPPABLE_PRIMITIVES).gradients == 0


def test_without_an_overlap_nothing_is_split():
    """One bucket (nothing to overlap): the split alone would move more bytes, so the body is
    lowered as the overlap leaves it (here: as written)."""
    rng = np.random.default_rng(26)
    params, tokens = _params(rng, exact=True, layers=1), _tokens(rng)
    with override(switch_sparse_gradients=True, merge_bytes=64 << 20):
        plain, switched, calls, report = _run(_step(_loss(True), True), params, tokens)
    assert not any(d.primitive.startswith("all_gather") for d in report), report
    for w, g in zip(jax.tree.leaves(plain), jax.tree.leaves(switched)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_gpu_lowering_gathers_behind_a_barrier_with_the_wait(monkeypatch):
    """The GPU form, lowered as text: the gathers (synchronous jax_blink calls, on the whole
    grid) come after every done, their operands passed through a barrier with a done's result."""
    monkeypatch.setattr(async_call, "runs_async", lambda platform: True)
    rng = np.random.default_rng(27)
    params, tokens = _params(rng, exact=False), _tokens(rng)
    with jax_blink.installed(), override(switch_sparse_gradients=True, dispatch="blink", merge_bytes=1024):
        text = _step(_loss(False), True).lower(params, tokens).as_text()
    starts, dones, barriers, _ = overlap_lines(text)
    lines = text.split("\n")
    gathers = [i for i, line in enumerate(lines) if "@jax_blink_collective(" in line]
    assert len(starts) == 2 and len(dones) == len(starts) and len(gathers) == 2, text
    assert max(dones) < min(gathers)
    # Each bucket's wait is a call of its own: the barrier holds a result of every one (directly,
    # or the piece of it that the done's lowering cut out).
    tie = [b for b in barriers if max(dones) < b < min(gathers)]
    assert len(tie) == 1, tie
    tied = set(re.findall(r"%[\w#]+", lines[tie[0]].split("=", 1)[1].split(":", 1)[0]))
    made_from = {}  # value -> the done it was cut from
    for i in range(min(dones), tie[0]):
        m = re.match(r"^\s*(%[\w]+)", lines[i])
        if m:
            if "@jax_blink_done(" in lines[i]:
                made_from[m.group(1)] = m.group(1)
            else:
                src = [made_from[v] for v in re.findall(r"%[\w]+", lines[i].split("=", 1)[1]) if v in made_from]
                if src:
                    made_from[m.group(1)] = src[0]
    assert {made_from[v] for v in tied if v in made_from} == set(made_from.values()) and len(set(made_from.values())) == len(dones)
