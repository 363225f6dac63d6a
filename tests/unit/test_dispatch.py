"""The dispatch table (jax_blink.lowering.dispatch_table) for every collective: entries per collective, sizes as a
rank's operand bytes, derived from bench runs of that collective, and consulted by each
collective for itself."""
import json

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_blink
from jax_blink.lowering import dispatch_table as tuning
from jax_blink.tools import derive

DEVICES = jax.devices()
N = min(4, len(DEVICES))
K = 1 << 10


def _bench_json(path, collective, n, points, device_kind="cpu"):
    """A bench result file as the bench writes it: points are (size column, dtype, speedup)."""
    rows = [dict(size=s, dtype=d, n=n, speedup=t, slope_speedup=t, wrong=0) for s, d, t in points]
    path.write_text(json.dumps(dict(meta=dict(device_kind=device_kind, n=n, collective=collective), rows=rows)))
    return str(path)


def test_derive_reads_each_collective_and_counts_operand_bytes(tmp_path):
    # The bench's size column is all-gather's output (n x the operand): the table counts operands.
    ag = _bench_json(tmp_path / "allgather-a.json", "allgather", 4, [
        (4 * K, "float32", 0.5), (16 * K, "float32", 0.5), (64 * K, "float32", 2.0)])
    c = derive.derive([ag])
    assert c.collective == "allgather" and c.ranks == 4
    assert c.lax_ranges == ((0, 8 * K),)  # operands 1, 4, 16 KiB: lax below sqrt(4K * 16K)
    rs = _bench_json(tmp_path / "reducescatter-b.json", "reducescatter", 4, [
        (4 * K, "float32", 0.5), (16 * K, "float32", 0.5), (64 * K, "float32", 2.0)])
    assert derive.derive([rs]).lax_ranges == ((0, 32 * K),)  # the operand is the size column
    # The form the table holds, read back.
    assert eval(c.as_code(), {"Crossover": tuning.Crossover}) == c  # noqa: S307 (our own output)
    ar = derive.derive([_bench_json(tmp_path / "allreduce-c.json", "allreduce", 2, [(K, "float32", 0.5)])])
    assert "collective=" not in ar.as_code() and eval(ar.as_code(), {"Crossover": tuning.Crossover}) == ar  # noqa: S307


def test_prefer_lax_is_per_collective(monkeypatch):
    table = (tuning.Crossover("Some CPU", 4, ((0, 64 * K),), ("test",), "allgather"),
             tuning.Crossover("Some CPU", 4, ((1 << 20, None),), ("test",), "allreduce"))
    monkeypatch.setattr(tuning, "CROSSOVERS", table)
    assert tuning.prefer_lax("Some CPU", 4, 4 * K, collective="allgather")
    assert not tuning.prefer_lax("Some CPU", 4, 4 * K)  # all-reduce: the default collective
    assert tuning.prefer_lax("Some CPU", 4, 2 << 20, collective="allreduce")
    assert not tuning.prefer_lax("Some CPU", 4, 2 << 20, collective="allgather")
    assert not tuning.prefer_lax("Some CPU", 4, 4 * K, collective="broadcast")  # not measured
    assert tuning.entry("Some CPU", 4, "allgather") is table[0]
    with pytest.raises(ValueError, match="collective 'gather' is not one of the table's"):
        tuning.prefer_lax("Some CPU", 4, 4 * K, collective="gather")


def test_layouts_are_kept_apart(tmp_path, monkeypatch):
    """Ranks in several processes run another executor (shared memory, CUDA IPC) with its own
    costs: its runs derive their own entry, never mixed with one-process runs."""
    one = _bench_json(tmp_path / "allreduce-one.json", "allreduce", 2, [(K, "float32", 2.0), (K * K, "float32", 2.0)])
    doc = json.loads(open(one).read())
    doc["meta"]["layout"] = "several processes"
    doc["rows"][1]["speedup"] = doc["rows"][1]["slope_speedup"] = 0.5
    several = tmp_path / "allreduce-several.json"
    several.write_text(json.dumps(doc))
    c = derive.derive([str(several)])
    assert c.layout == "several processes" and c.lax_ranges == ((32 * K, None),)
    assert eval(c.as_code(), {"Crossover": tuning.Crossover}) == c  # noqa: S307 (our own output)
    with pytest.raises(ValueError, match="different layouts"):
        derive.derive([one, str(several)])
    monkeypatch.setattr(tuning, "CROSSOVERS", (c,))
    assert tuning.prefer_lax("cpu", 2, K * K, layout="several processes")
    assert not tuning.prefer_lax("cpu", 2, K * K)  # one process: not measured, the executor
    with pytest.raises(ValueError, match="layout 'mpi' is not one of"):
        tuning.prefer_lax("cpu", 2, K, layout="mpi")


def test_every_table_entry_names_a_collective_and_each_is_measured():
    assert {c.collective for c in tuning.CROSSOVERS} <= set(tuning.COLLECTIVES)
    assert {c.layout for c in tuning.CROSSOVERS} <= set(tuning.LAYOUTS)
    keys = [(c.device_kind, c.ranks, c.collective, c.layout, c.dtype) for c in tuning.CROSSOVERS]
    assert len(keys) == len(set(keys)), "one entry per machine, collective, layout and dtype"
    general = {k[:4] for k in keys if k[4] is None}
    assert {k[:4] for k in keys} <= general, "a dtype's entry refines an entry for every dtype"
    cpu = {(c.ranks, c.collective) for c in tuning.CROSSOVERS if c.device_kind == "cpu"}
    assert cpu == {(n, coll) for n in (2, 4, 8) for coll in tuning.COLLECTIVES}


CALLS = {
    "allreduce": lambda v: jax_blink.all_reduce(v, "x"),
    "broadcast": lambda v: jax_blink.broadcast(v, "x"),
    "reduce": lambda v: jax_blink.reduce(v, "x"),
    "allgather": lambda v: jax_blink.all_gather(v, "x", tiled=True),
    "reducescatter": lambda v: jax_blink.reduce_scatter(v, "x", tiled=True),
}


@pytest.mark.skipif(N < 2, reason="needs 2+ devices")
@pytest.mark.parametrize("collective", sorted(CALLS))
def test_each_collective_consults_the_table_for_itself(monkeypatch, collective):
    """auto dispatch: a call goes to lax exactly where its own collective's entry says so, by the
    bytes of its operand (an entry of another collective changes nothing)."""
    mesh = jax.make_mesh((N,), ("x",), devices=DEVICES[:N])
    kind = DEVICES[0].device_kind
    x = jax.device_put(np.ones((N * N, 4), np.float32), NamedSharding(mesh, P("x")))
    nbytes = N * 4 * 4  # a rank's operand

    def lowered():  # a new function each time: the table is read when jit traces
        f = jax.shard_map(CALLS[collective], mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        return jax.jit(f).lower(x).as_text()

    monkeypatch.setattr(jax_blink.config, "dispatch", "auto")
    others = tuple(tuning.Crossover(kind, N, ((0, None),), ("test",), c) for c in CALLS if c != collective)
    below = tuning.Crossover(kind, N, ((0, nbytes),), ("test",), collective)
    monkeypatch.setattr(tuning, "CROSSOVERS", others + (below,))
    assert "jax_blink_collective" in lowered()  # its entry ends just below this operand
    above = tuning.Crossover(kind, N, ((nbytes, 2 * nbytes),), ("test",), collective)
    monkeypatch.setattr(tuning, "CROSSOVERS", others + (above,))
    assert "jax_blink_collective" not in lowered()


def test_the_layout_of_a_call_picks_its_entry(monkeypatch):
    """In a job of several processes, a call whose ranks span processes reads the table's
    "several processes" entry (another executor); one whose ranks share a process, the usual one."""
    from jax_blink.lowering import decision
    from jax_blink.lowering import processes as distributed

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    spans = {"rank_process": np.array([0, 1], np.int32)}
    local = {"rank_process": np.array([0, 0], np.int32)}
    monkeypatch.setattr(distributed, "lowering_attrs", lambda axes, n, tables=None: spans)
    assert decision.layout(("x",), 2) == "several processes"
    assert decision.layout(None, 2) == "one process"  # the phases' inside calls: one process
    monkeypatch.setattr(distributed, "lowering_attrs", lambda axes, n, tables=None: local)
    assert decision.layout(("x",), 2) == "one process"

    kind = DEVICES[0].device_kind
    table = (tuning.Crossover(kind, 2, ((0, None),), ("test",), layout="several processes"),
             tuning.Crossover(kind, 2, (), ("test",)))
    monkeypatch.setattr(tuning, "CROSSOVERS", table)
    monkeypatch.setattr(jax_blink.config, "dispatch", "auto")
    x = np.ones(8, np.float32)
    assert not decision.use_lax("allreduce", 2, x, ("x",))  # ranks in one process
    monkeypatch.setattr(distributed, "lowering_attrs", lambda axes, n, tables=None: spans)
    assert decision.use_lax("allreduce", 2, x, ("x",))


def test_an_entry_per_dtype_refines_the_entry_for_every_dtype(tmp_path, monkeypatch):
    """A dtype's rows alone can derive an entry of its own (lax where lax won in that dtype); a call
    in that dtype reads it, other dtypes the entry for every dtype."""
    run = _bench_json(tmp_path / "allreduce-d.json", "allreduce", 2, [
        (K, "float32", 0.5), (K, "bfloat16", 2.0), (K * K, "float32", 0.5), (K * K, "bfloat16", 0.5)])
    every = derive.derive([run])
    f32 = derive.derive([run], dtype="float32")
    assert every.lax_ranges == ((32 * K, None),) and every.dtype is None
    assert f32.lax_ranges == ((0, None),) and f32.dtype == "float32"
    assert eval(f32.as_code(), {"Crossover": tuning.Crossover}) == f32  # noqa: S307 (our own output)
    with pytest.raises(ValueError, match="measured no size in float16"):
        derive.derive([run], dtype="float16")
    monkeypatch.setattr(tuning, "CROSSOVERS", (every, f32))
    assert tuning.prefer_lax("cpu", 2, K, dtype="float32")
    assert not tuning.prefer_lax("cpu", 2, K, dtype="bfloat16")  # the entry for every dtype
    assert not tuning.prefer_lax("cpu", 2, K, dtype="int32")
    assert tuning.prefer_lax("cpu", 2, K * K, dtype="int32")


def test_a_near_tie_is_left_to_the_executor(tmp_path):
    """lax wins a size only where ours took at least 5% longer (derive.LAX_WINS_BELOW): closer is
    within the runs' spread."""
    run = _bench_json(tmp_path / "allreduce-t.json", "allreduce", 2, [
        (K, "float32", 0.96), (4 * K, "float32", 0.94), (16 * K, "float32", 0.99)])
    assert derive.LAX_WINS_BELOW == 0.95
    assert derive.derive([run]).lax_ranges == ((2 * K, 8 * K),)


def test_on_gpus_a_slower_executor_is_never_kept(tmp_path):
    """GPU runs: lax wins a size where ours took 1% longer or more (derive.LAX_WINS_BELOW_GPU):
    `auto` must not keep a path measured slower (issue 27), and GPU medians move by a few percent."""
    run = _bench_json(tmp_path / "allreduce-g.json", "allreduce", 4, [
        (K, "float32", 1.30), (4 * K, "float32", 0.96), (16 * K, "float32", 0.995), (64 * K, "float32", 0.97)],
        device_kind="NVIDIA H200")
    assert derive.LAX_WINS_BELOW_GPU == 0.99
    assert derive.derive([run]).lax_ranges == ((2 * K, 8 * K), (32 * K, None))
