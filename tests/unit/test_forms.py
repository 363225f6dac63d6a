"""The all-reduce forms (jax_blink/planning/forms.py): their programs, their modelled times, the
planner's choice, and the executor running each of them bitwise like lax on CPU host devices."""
import itertools
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_blink
from jax_blink.lowering import custom_call as C
from jax_blink.options import override, settings
from jax_blink.planning import forms, model, schedule
from jax_blink.planning.topology import Topology

DGX1V, DGX1P = Topology.preset("dgx1v"), Topology.preset("dgx1p")
SIZES = (64 << 10, 4 << 20, 500e6)
DTYPES = ("float32", "float64", "bfloat16", "float16", "int32", "int64")
OPS = ("sum", "max", "min")
NP_OP = {"sum": np.sum, "max": np.max, "min": np.min}


def _check_cover(segs, total):
    """Segments cover [0, total) exactly once, every one both phases, every tree spanning."""
    covered = np.zeros(total, np.int32)
    for s in segs:
        assert s.phases == schedule.PHASE_REDUCE | schedule.PHASE_BROADCAST
        assert s.parent[s.root] == -1 and s.parent.count(-1) == 1
        covered[s.offset:s.offset + s.length] += 1
    assert (covered == 1).all()


# ------------------------------------------------------------------------------ the model alone
def test_option_names_are_the_forms():
    assert settings.ALLREDUCE_FORMS == (forms.AUTO,) + forms.FORMS


@pytest.mark.parametrize("topo", [DGX1V, DGX1P], ids=["dgx1v", "dgx1p"])
@pytest.mark.parametrize("nbytes", SIZES)
def test_every_form_program_runs_in_the_reference(topo, nbytes):
    """Each form priced at the paper's sizes, scheduled over a small operand, run through the
    reference interpreter of the program: every rank gets the reduction, bitwise, for every op."""
    total = 4099  # not a multiple of anything: the last segments take the remainder
    names = set()
    for f in forms.forms_at(topo, nbytes):
        names.add(f.name)
        for itemsize, dt in ((4, np.float32), (8, np.int64)):
            segs = forms.segments(f, total, itemsize)
            _check_cover(segs, total)
            sched = schedule.make_schedule(8, total, itemsize, segs, chunk_bytes=f.chunk_bytes)
            assert schedule.decode(sched.program()) == sched
            rng = np.random.default_rng(int(nbytes) % 1000)
            xs = [rng.integers(-50, 50, total).astype(dt) for _ in range(8)]
            for op in OPS:
                want = NP_OP[op](np.stack(xs), axis=0)
                for out in schedule.run_reference(sched, xs, op):
                    np.testing.assert_array_equal(out, want)
    assert {"reduce_broadcast", "rings", "scatter_gather", "shallow_trees"} <= names


def test_ring_form_is_priced_exactly_as_the_baseline():
    """Where the NVLinks hold rings, the ring form's time is the NCCL baseline's, same formula,
    same rings: speedup exactly 1 when it is chosen, never above or below."""
    seen = 0
    for k in range(3, 9):
        for a in itertools.combinations(range(8), k):
            sub = DGX1V.subset(a)
            if not sub.is_connected() or model.rings(sub).kind != "nvlink":
                continue
            ring = {f.name: f for f in forms.forms_at(sub, 4 << 20)}["rings"]
            assert ring.time_us == pytest.approx(model.time_us(model.rings(sub), "allreduce", 4 << 20), rel=1e-12)
            seen += 1
            if seen >= 12:
                return
    pytest.fail("found fewer than 12 DGX-1V allocations with NVLink rings")


def test_no_ring_form_where_the_rings_leave_the_links():
    """{1, 4, 5, 6, 7} of a DGX-1V: the NVLinks hold no Hamiltonian ring; NCCL's baseline takes
    PCIe, which the NVLink-only topology does not have: no ring form, and forcing it says why."""
    sub = DGX1V.subset([1, 4, 5, 6, 7])
    assert model.rings(sub).kind == "pcie"
    assert "rings" not in {f.name for f in forms.forms_at(sub, 1 << 20)}
    with pytest.raises(ValueError, match=r"allreduce_form=.rings. does not run on .*\(the forms that do: "):
        forms.choose(sub, 1 << 20, "rings")


def test_choice_is_the_fastest_and_beats_rings_on_sampled_allocations():
    """The chosen form is the fastest ranked, ranked in time order, and on every DGX-1V and
    DGX-1P allocation of 3 and 4 GPUs at 64 KiB it is never slower than NCCL's rings (the full sweep
    over 3-8 GPUs at three sizes is benchmarks/paper_comparison.py)."""
    for topo in (DGX1V, DGX1P):
        for k in (3, 4):
            for a in itertools.combinations(range(8), k):
                sub = topo.subset(a)
                if not sub.is_connected():
                    continue
                ch = forms.choose(sub, 64 << 10)
                times = [f.time_us for f in ch.ranked]
                assert times == sorted(times) and ch.form.time_us == min(times)
                assert ch.margin() >= 1.0
                ring = model.time_us(model.rings(sub), "allreduce", 64 << 10)
                assert ch.form.time_us <= ring * (1 + 1e-12), (topo.name, a, ch.line())


def test_depth_and_pipeline_steps_count():
    """At a small size a chain of 8 (depth 7) is slower than a star (depth 1) of the same rate;
    at a large size both are bandwidth-bound and equal to within the pipeline fill."""
    n = 8
    chain = (0, tuple([-1] + list(range(n - 1))), 10.0)
    star = (0, tuple([-1] + [0] * (n - 1)), 10.0)
    topo = Topology.from_links({(u, v): 25.0 for u in range(n) for v in range(n) if u != v}, kind="nvlink")
    t_chain, _ = forms._tree_time(topo, [chain], 64 << 10)
    t_star, _ = forms._tree_time(topo, [star], 64 << 10)
    assert t_chain > 2 * t_star
    big_chain, _ = forms._tree_time(topo, [chain], 1e9)
    big_star, _ = forms._tree_time(topo, [star], 1e9)
    assert big_chain == pytest.approx(big_star, rel=0.02)


def test_middle_sizes_choose_fewer_or_shallower_than_the_packing():
    """All 8 GPUs of a DGX-1V at 64 KiB: the packing's 14 (tree, root) pieces are slower than a
    few shallow trees, and the chosen form says so."""
    ch = forms.choose(DGX1V, 64 << 10)
    packed = {f.name: f for f in ch.ranked}["reduce_broadcast"]
    assert ch.form.name != "reduce_broadcast" and ch.form.time_us < packed.time_us
    line = ch.line()
    assert line.startswith(f"all-reduce form: {ch.form.name} (chosen; modelled")
    assert f"the speed of the next, {ch.runner_up().name}" in line


def test_one_hop_only_on_gpu_cliques_within_the_kernel_limits():
    clique = DGX1V.subset([0, 1, 2, 3])  # every pair has an NVLink
    assert "one_hop" in {f.name for f in forms.forms_at(clique, 64 << 10)}
    assert "one_hop" not in {f.name for f in forms.forms_at(clique, forms.LL_MAX_BYTES + 16)}
    assert "one_hop" not in {f.name for f in forms.forms_at(DGX1V, 64 << 10)}  # 0 and 5 not linked
    assert "one_hop" not in {f.name for f in forms.forms_at(Topology.host(4), 64 << 10)}  # CPU: no LL
    pair = DGX1V.subset([0, 3])
    assert "one_hop" in {f.name for f in forms.forms_at(pair, forms.ONESHOT_MAX_BYTES)}  # one-shot, 2 GPUs


def test_unknown_form_and_one_device_are_refused():
    with pytest.raises(ValueError, match="unknown all-reduce form 'ringz'"):
        forms.choose(DGX1V, 1024, "ringz")
    with pytest.raises(ValueError, match="one device"):
        forms.choose(DGX1V.subset([0]), 1024)
    with pytest.raises(ValueError, match="allreduce_form must be one of"):
        jax_blink.config.allreduce_form = "ringz"


def test_cold_forms_cost_little_over_the_plan_and_warm_calls_are_free():
    """A fresh topology (its own cache entries) of 8 GPUs: with its packing plan made, every form
    priced cold at a new size class takes well under a second (the shallow-tree search: a few
    dozen small LPs); the same call again is a cache look-up."""
    from jax_blink.planning import packing

    topo = Topology.from_links({e[:2]: DGX1V.capacity(*e[:2]) * 1.01 for e in DGX1V.simple_graph().edges},
                               kind="nvlink", name="dgx1v-1.01")
    packing.plan(topo, "allreduce")  # the packing itself is timed by benchmarks/plan_time.py
    t0 = time.perf_counter()
    ch = forms.choose(topo, 4 << 20)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(100):
        assert forms.choose(topo, 4 << 20) is ch
    warm = (time.perf_counter() - t0) / 100
    assert cold < 0.5, f"forms priced cold in {cold:.2f} s"
    assert warm < 1e-4, f"warm choose {warm * 1e6:.1f} us"


# ------------------------------------------------------------------------------ the executor
def _topology_for(n: int, form: str) -> Topology:
    """An n-rank topology on which ``form`` runs (DGX-1V GPUs 0..n-1 where it does)."""
    mesh = Topology.from_links({(u, v): 25.0 for u in range(n) for v in range(n) if u != v}, kind="nvlink",
                               name=f"nvlink-mesh:{n}")  # a GPU clique: the one-hop kernels' shape
    for topo in (DGX1V.subset(range(n)), DGX1P.subset(range(n)), Topology.host(n), mesh):
        if topo.is_connected() and (form == forms.AUTO or form in {f.name for f in forms.forms_at(topo, 1 << 10)}):
            return topo
    raise AssertionError(f"no test topology of {n} ranks runs {form}")


def _exact_inputs(n: int, count: int, seed: int) -> np.ndarray:
    # Small integers: every partial sum is exact in every dtype (bfloat16 included), so any
    # order of combining gives the same bits and lax can be matched bitwise.
    return np.random.default_rng(seed).integers(-8, 9, (n, count))


@pytest.fixture
def x64():
    old = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", old)


@pytest.mark.parametrize("n", range(2, 9))
@pytest.mark.parametrize("form", (forms.AUTO,) + forms.FORMS)
def test_each_form_matches_lax_bitwise(n, form, x64):
    """Every form forced (and the auto choice), 2-8 ranks, every dtype and op: bitwise equal to
    lax on exactly representable data, and bitwise equal to the program's reference on random
    float32 data (the executor ran that program)."""
    topo = _topology_for(n, form)
    mesh = Mesh(np.array(jax.devices("cpu")[:n]), ("x",))
    count = 1037
    data = {dt: _exact_inputs(n, count, n).astype(ml_dtypes.bfloat16 if dt == "bfloat16" else dt) for dt in DTYPES}
    args = [jax.device_put(jnp.asarray(data[dt]), NamedSharding(mesh, P("x"))) for dt in DTYPES]

    def ours(*vs):
        return tuple(jax_blink.all_reduce(v, "x", op=op, topology=topo) for v in vs for op in OPS)

    def ref(*vs):
        lax_op = {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}
        return tuple(lax_op[op](v, "x") for v in vs for op in OPS)

    spec = (P("x"),) * len(DTYPES)
    out_spec = (P("x"),) * (len(DTYPES) * len(OPS))
    with override(allreduce_form=form, dispatch="blink"):
        got = jax.jit(jax.shard_map(ours, mesh=mesh, in_specs=spec, out_specs=out_spec))(*args)
        prog = C.build_program(topo, "allreduce", None, count, 4, None, "exact")
    want = jax.jit(jax.shard_map(ref, mesh=mesh, in_specs=spec, out_specs=out_spec))(*args)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))

    # Random float32 data: the executor's bits are the program's reference bits.
    chosen = forms.choose(topo, count * 4, form)
    assert len(schedule.decode(prog).trees) == len(forms.segments(chosen.form, count, 4))
    xs = np.random.default_rng(7).standard_normal((n, count)).astype(np.float32)
    xa = jax.device_put(jnp.asarray(xs), NamedSharding(mesh, P("x")))
    with override(allreduce_form=form, dispatch="blink"):
        got = jax.jit(jax.shard_map(lambda v: jax_blink.all_reduce(v, "x", topology=topo), mesh=mesh,
                                    in_specs=P("x"), out_specs=P("x")))(xa)
    want = schedule.run_reference(schedule.decode(prog), list(xs), "sum")
    np.testing.assert_array_equal(np.asarray(got), np.stack(want))


def test_forced_form_that_cannot_run_is_refused_at_trace_time():
    n = 4
    mesh = Mesh(np.array(jax.devices("cpu")[:n]), ("x",))
    x = jax.device_put(jnp.ones((n, 16), jnp.float32), NamedSharding(mesh, P("x")))
    f = jax.jit(jax.shard_map(lambda v: jax_blink.all_reduce(v, "x", topology=Topology.host(n)), mesh=mesh,
                              in_specs=P("x"), out_specs=P("x")))
    with override(allreduce_form="one_hop", dispatch="blink"):
        with pytest.raises(ValueError, match="allreduce_form='one_hop' does not run on"):
            f(x)


def test_explain_names_the_form():
    text = jax_blink.explain(DGX1V, 4 << 20)
    line = next(ln for ln in text.splitlines() if ln.startswith("all-reduce form: "))
    ch = forms.choose(DGX1V, 4 << 20)
    assert line == ch.line()
    assert f"schedule: {len(forms.segments(ch.form, (4 << 20) // 4, 4))} tree segments" in text


def test_ring_form_on_an_nvswitch_mesh_reaches_the_baselines_rate():
    """NVSwitch, 8 GPUs: the baseline is one logical ring at the fabric rate; the ring form runs it
    as 7 link-disjoint directed Hamiltonian rings over the pairs, at the same rate and time."""
    topo = Topology.preset("nvswitch:8")
    ring = {f.name: f for f in forms.forms_at(topo, 500e6)}["rings"]
    assert len(ring.blocks) == 8 and len(ring.blocks[0]) == 7
    assert ring.time_us == pytest.approx(model.time_us(model.rings(topo), "allreduce", 500e6), rel=1e-9)
    host = {f.name: f for f in forms.forms_at(Topology.host(8), 500e6)}["rings"]
    assert len(host.blocks[0]) == 4  # CPU host devices: the coprime-stride rings, no chains of 7 each way


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


@pytest.mark.gpu
@pytest.mark.parametrize("form", forms.FORMS[:-1])  # one_hop: the executor's own kernels, tested apart
def test_each_form_on_gpus_matches_psum_bitwise(form):
    """On the GPUs of this machine (2 to 8), every tree/ring form forced, over a size past the
    one-hop kernels' limits (so the program's trees run), with the DGX-1V's links of as many GPUs
    as the plan's topology: bitwise equal to psum on exactly representable data."""
    gpus = _gpus()[:8]
    n = len(gpus)
    if n < 2:
        pytest.skip("needs 2 or more GPUs")
    topo = _topology_for(n, form)
    mesh = Mesh(np.array(gpus), ("x",))
    for dt in ("float32", "int32", "bfloat16"):
        count = (forms.ONESHOT_MAX_BYTES + (1 << 20)) // jnp.dtype(dt).itemsize  # 9 MiB per rank
        x = jax.device_put(jnp.asarray(_exact_inputs(n, count, 3)).astype(dt), NamedSharding(mesh, P("x")))
        with override(allreduce_form=form, dispatch="blink"):
            got = jax.jit(jax.shard_map(lambda v: jax_blink.all_reduce(v, "x", topology=topo), mesh=mesh,
                                        in_specs=P("x"), out_specs=P("x")))(x)
        want = jax.jit(jax.shard_map(lambda v: lax.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))(x)
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
