"""Never slower by default (issue 27): ``jax-blink tune`` end to end on CPU host devices into a
temporary cache, ``dispatch="auto"`` following the cached entry of this very machine, the meanwhile
rule and its warning on a machine without an entry, tables derived from bench files never picking
a losing path, ``crossover --update``, and the bench's ``--dispatch auto`` mode."""
import dataclasses
import json
import os
import re
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_blink
from jax_blink.lowering import decision, dispatch_cache, dispatch_table as table
from jax_blink.lowering.machine import HOST_LINKS, MachineKey, this_machine
from jax_blink.tools import bench, derive
from jax_blink.tools.cli import main as cli_main
from jax_blink.tools.tune import main as tune_main

ROOT = Path(__file__).resolve().parents[2]
N = jax.device_count()
needs_2 = pytest.mark.skipif(N < 2, reason="needs 2+ devices")
TINY = ["-b", "1K", "-e", "4K", "-f", "4", "-d", "float32", "-r", "1", "--min-time", "0"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty dispatch cache that auto reads (JAX_BLINK_DISPATCH_CACHE)."""
    folder = tmp_path / "cache"
    monkeypatch.setenv(dispatch_cache.CACHE_ENV, str(folder))
    return folder


def _lowered_runs_executor(nbytes_per_rank: int) -> bool:
    """Whether jax_blink.all_reduce of a fresh random operand compiles to the executor under auto."""
    mesh = jax.make_mesh((N,), ("x",))
    rng = np.random.default_rng(7)
    x = jax.device_put(rng.standard_normal((N, nbytes_per_rank // 4), np.float32), NamedSharding(mesh, P("x")))
    f = jax.shard_map(lambda v: jax_blink.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    with jax_blink.options.override(dispatch="auto"):
        return "jax_blink_collective" in jax.jit(f).lower(x).as_text()


@needs_2
def test_tune_measures_derives_and_stores_this_machine(cache, capsys):
    assert tune_main([*TINY, "-c", "allreduce,allgather"]) == 0
    out = capsys.readouterr().out
    assert "stored in" in out and str(cache) in out
    stored = dispatch_cache.entries()
    here = this_machine(jax.devices()[0].device_kind, N)
    assert {c.collective for c in stored} == {"allreduce", "allgather"}
    for c in stored:  # keyed by this machine, versions included, and derived from the file beside it
        assert dispatch_cache.matches(c, here) and c.jax == jax.__version__ and c.links == HOST_LINKS
        assert all((cache / src).is_file() for src in c.sources)
        again = derive.derive(c.sources, root=str(cache), dtype=c.dtype)
        assert dataclasses.replace(again, jax=c.jax, nccl=c.nccl) == c
    # --show lists them, this machine's marked
    assert tune_main(["--show"]) == 0
    shown = capsys.readouterr().out
    assert "<- this machine" in shown and "allgather" in shown and "allreduce" in shown


@needs_2
def test_dry_run_stores_nothing(cache, capsys):
    assert tune_main([*TINY, "-c", "allreduce", "--dry-run"]) == 0
    assert "dry run: nothing stored" in capsys.readouterr().out
    assert not cache.exists() or not (cache / dispatch_cache.FILE_NAME).exists()


@pytest.mark.parametrize("argv, says", [
    (["--full", "-e", "4K"], "give -e/--end or --full, not both"),
    (["-b", "8K", "-e", "4K"], "-b/--begin"),
    (["--show", "--full"], "measures nothing"),
    (["-d", "float8"], "-d/--dtype"),
    (["-c", "gather"], "unknown collective gather"),
    (["--min-time", "-1"], "--min-time"),
])
def test_bad_values_are_one_line_errors(argv, says, cache, capsys):
    assert tune_main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and says in err and len(err.strip().splitlines()) == 1, err


@needs_2
def test_auto_follows_the_cached_entry_of_this_machine_only(cache):
    here = this_machine(jax.devices()[0].device_kind, N)
    nbytes = 4 << 10
    assert _lowered_runs_executor(nbytes) == (not decision.choice("allreduce", N, "float32", here.device_kind)
                                               .entry.prefers_lax(nbytes))
    everywhere = table.Crossover(here.device_kind, N, ((0, None),), ("bench/test.json",), links=here.links,
                                 jax=here.jax, nccl=here.nccl)
    dispatch_cache.store([everywhere])
    assert decision.choice("allreduce", N, "float32", here.device_kind).source == "tuned"
    assert not _lowered_runs_executor(nbytes)  # the tuned entry sends this size to lax
    nowhere = dataclasses.replace(everywhere, lax_ranges=())
    dispatch_cache.store([nowhere])  # replaces it
    assert dispatch_cache.entries() == (nowhere,) and _lowered_runs_executor(nbytes)
    # An entry of another jax version (or links, or count) is not this machine's: ignored.
    (cache / dispatch_cache.FILE_NAME).unlink()
    dispatch_cache.store([dataclasses.replace(everywhere, jax="0.0.1")])
    assert decision.choice("allreduce", N, "float32", here.device_kind).source != "tuned"
    dispatch_cache.store([dataclasses.replace(everywhere, links="NV18 switch", jax=here.jax)])
    assert decision.choice("allreduce", N, "float32", here.device_kind).source != "tuned"


def test_an_unreadable_cache_is_ignored_with_a_warning(cache):
    cache.mkdir(parents=True)
    (cache / dispatch_cache.FILE_NAME).write_text("{")
    with pytest.warns(RuntimeWarning, match="ignoring the dispatch cache"):
        assert dispatch_cache.entries() == ()


def _rows(path: Path):
    doc = json.loads(path.read_text())
    n = int(doc["meta"]["n"])
    per_operand = n if os.path.basename(str(path)).startswith("allgather") else 1
    below = derive.lax_wins_below(doc["meta"]["device_kind"])
    return [(int(r["size"]) // per_operand, str(r.get("dtype", "")), derive._lax_won(r, below)) for r in doc["rows"]]


@pytest.mark.parametrize("entry", table.CROSSOVERS, ids=lambda c: f"{c.ranks}x{c.device_kind}-{c.collective}-"
                                                               f"{c.layout}-{c.dtype}")
def test_no_shipped_entry_picks_a_losing_path(entry):
    """For every size of every file an entry cites (its dtype's rows, or all): lax is chosen
    exactly where lax won in every run and dtype that measured that size, by the derive rule;
    nowhere else (so a size never goes to the side that lost everywhere)."""
    verdict: dict[int, bool] = {}
    for src in entry.sources:
        for size, dtype, lax_won in _rows(ROOT / src):
            if entry.dtype is None or dtype == entry.dtype:
                verdict[size] = verdict.get(size, True) and lax_won
    assert verdict
    for size, lax_won in verdict.items():
        assert entry.prefers_lax(size) == lax_won, (size, lax_won, entry)


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
@pytest.mark.parametrize("layout", table.LAYOUTS)
@pytest.mark.parametrize("collective", table.COLLECTIVES)
@pytest.mark.parametrize("dtype", [None, "float32", "bfloat16"])
def test_the_meanwhile_rule_never_runs_the_executor_where_a_measured_machine_lost(platform, layout,
                                                                                    collective, dtype):
    m = table.meanwhile(platform, collective, layout, dtype)
    measured = [c for c in table.CROSSOVERS if table.platform_of(c.device_kind) == platform
                and c.collective == collective]
    if any(c.layout == layout for c in measured):  # else the other layout's machines decide
        measured = [c for c in measured if c.layout == layout]
    if not measured:
        assert m.lax_ranges == ((0, None),) and not m.sources  # never measured there: lax everywhere
        return
    for c in measured:
        picked = table.entry(c.device_kind, c.ranks, collective, c.layout, dtype, c.links)
        for src in picked.sources:
            for size, _, _ in _rows(ROOT / src):
                if picked.prefers_lax(size):
                    assert m.prefers_lax(size), (size, picked)


def test_meanwhile_on_gpus_follows_issue_27():
    """4 x H200 on a switch lost from 16 MiB (issue 27), its all-gather from 32 MiB and its
    reduce-scatter at 256 MiB; IPC on 2 x H200 from 16 MiB and on 4 x H200 from 1 MiB: a GPU
    machine without an entry runs lax there, and every collective not measured on GPUs goes to lax."""
    ar = table.meanwhile("gpu", "allreduce")
    assert not ar.prefers_lax(4 << 20) and ar.prefers_lax(16 << 20) and ar.prefers_lax(1 << 30)
    ipc = table.meanwhile("gpu", "allreduce", "several processes")
    assert not ipc.prefers_lax(256 << 10) and ipc.prefers_lax(1 << 20) and ipc.prefers_lax(256 << 20)
    ag = table.meanwhile("gpu", "allgather")
    assert not ag.prefers_lax(4 << 20) and ag.prefers_lax(32 << 20)
    rs = table.meanwhile("gpu", "reducescatter")
    assert not rs.prefers_lax(32 << 20) and rs.prefers_lax(256 << 20)
    assert table.meanwhile("gpu", "broadcast").lax_ranges == ((0, None),)


def test_the_first_call_without_an_entry_warns_once(monkeypatch):
    kind = "cpu"
    monkeypatch.setattr(table, "CROSSOVERS", tuple(c for c in table.CROSSOVERS if c.ranks != 3))
    monkeypatch.setattr(decision, "_no_entry_warned", [False])
    monkeypatch.setattr(jax_blink.config, "dispatch", "auto")
    with pytest.warns(RuntimeWarning) as caught:
        d = decision.dispatch("allreduce", 3, 1 << 30, "float32", kind)
    (w,) = [w for w in caught if "no measured entry" in str(w.message)]
    text = str(w.message)
    assert "3 x cpu, host memory, one process" in text  # the machine's key
    assert "Meanwhile" in text and "jax-blink tune" in text and "all_reduce: lax.psum at" in text
    assert "once per process" in text
    assert not d.executor and "no entry for 3 x cpu" in d.reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        decision.dispatch("allgather", 3, 1 << 10, "float32", kind)  # said once: no second warning


def test_the_message_says_what_runs_meanwhile():
    key = MachineKey("NVIDIA B200", 4, "NV18 switch")  # no entry of any collective
    text = decision.no_entry_message(key)
    assert "no measured entry for this machine (4 x NVIDIA B200, NV18 switch, one process)" in text
    # The union of every GPU machine's lax sizes: from 8M (4 x H200 and 4 x H100) among them.
    assert re.search(r"all_reduce: lax\.psum [^;]*from 8M", text), text
    assert re.search(r"all_gather: lax\.all_gather from \d+(\.\d)?M", text), text  # measured on 4 x H200
    assert "at from" not in text and not re.search(r"\d{6,}", text), text  # sizes in words, not raw bytes
    assert "broadcast: lax.psum (of the root's value) at every size (never measured on a gpu machine)" in text
    assert decision.TUNE_COMMAND in text and dispatch_cache.FILE_NAME in text


def test_the_message_names_only_the_collectives_without_an_entry():
    """4 x H100 has shipped all-reduce, all-gather and reduce-scatter entries (2026-11-28) and none
    for broadcast and reduce: the message says so, and lists what runs meanwhile for those only."""
    text = decision.no_entry_message(MachineKey("NVIDIA H100 80GB HBM3", 4, "NV18 switch"))
    assert "no measured entry for broadcast, reduce on this machine" in text, text
    assert "(it has entries for all_reduce, all_gather, reduce_scatter)" in text, text
    assert "all_reduce: lax.psum" not in text and "all_gather: lax" not in text, text


def _bench_file(path: Path, collective, n, points, links=None, kind="cpu", dispatch=None):
    rows = [dict(size=s, dtype=d, n=n, speedup=t, wrong=0) for s, d, t in points]
    meta = dict(device_kind=kind, n=n, collective=collective, **({"links": links} if links else {}),
                **({"dispatch": dispatch} if dispatch else {}))
    path.write_text(json.dumps(dict(meta=meta, rows=rows)))
    return path.name


def test_crossover_update_writes_every_entry_of_the_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    K = 1 << 10
    a = _bench_file(tmp_path / "allreduce-x.json", "allreduce", 4,
                    [(K, "float32", 1.3), (16 * K, "float32", 0.5), (K, "bfloat16", 1.3), (16 * K, "bfloat16", 1.5)],
                    links="NV18 switch", kind="GPU Y")
    g = _bench_file(tmp_path / "allgather-x.json", "allgather", 4, [(4 * K, "float32", 0.5)], links="NV18 switch",
                    kind="GPU Y")
    out_table = tmp_path / "entries.json"
    assert cli_main(["crossover", "--update", a, g, "--table", str(out_table)]) == 0
    said = capsys.readouterr().out
    assert "wrote 3 entries" in said
    entries = table.read_entries(str(out_table))
    by = {(c.collective, c.dtype): c for c in entries}
    assert by[("allreduce", None)].lax_ranges == () and by[("allreduce", "float32")].lax_ranges == ((4 * K, None),)
    assert by[("allgather", None)].lax_ranges == ((0, None),) and all(c.links == "NV18 switch" for c in entries)
    for c in entries:  # each derives again from what it cites
        assert derive.derive(c.sources, root=str(tmp_path), dtype=c.dtype) == c
    # Again with a newer run of all-reduce: its entries replace the old ones, all-gather's stay.
    b = _bench_file(tmp_path / "allreduce-y.json", "allreduce", 4, [(K, "float32", 0.5)], links="NV18 switch",
                    kind="GPU Y")
    assert cli_main(["crossover", "--update", b, "--table", str(out_table)]) == 0
    entries = table.read_entries(str(out_table))
    assert {(c.collective, c.sources) for c in entries} == {("allreduce", (b,)), ("allgather", (g,))}
    assert cli_main(["crossover", "--update", b, "--dtype", "float32", "--table", str(out_table)]) == 2


def test_runs_of_the_auto_mode_derive_nothing(tmp_path):
    f = _bench_file(tmp_path / "allreduce-auto.json", "allreduce", 2, [(1024, "float32", 0.5)], dispatch="auto")
    with pytest.raises(ValueError, match="dispatch='auto'"):
        derive.derive([f], root=str(tmp_path))


@needs_2
def test_the_bench_times_what_auto_runs_and_names_the_path(tmp_path, monkeypatch, capsys):
    kind = jax.devices()[0].device_kind
    here = this_machine(kind, N)
    # An entry for this machine: lax from 2 KiB, the executor below.
    monkeypatch.setattr(table, "CROSSOVERS", (table.Crossover(kind, N, ((2048, None),), ("test",), links=here.links),))
    monkeypatch.setenv(dispatch_cache.CACHE_ENV, str(tmp_path / "empty-cache"))
    rows = bench.run(1024, 4096, 4, ["float32"], 2, 1, str(tmp_path), "t", min_seconds=0, dispatch="auto")
    assert [r["path"] for r in rows] == ["executor", "lax"]
    assert all(r["wrong"] == 0 and r["time_us"] > 0 for r in rows)
    out = capsys.readouterr().out
    assert "auto ran" in out
    (path,) = tmp_path.glob("allreduce-t-*-auto.json")
    meta = json.loads(path.read_text())["meta"]
    assert meta["dispatch"] == "auto" and meta["links"] == here.links and meta["layout"] == "one process"
    assert bench.main(["--dispatch", "lax"]) == 2  # auto or blink only


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1 << k for k in range(10, 31, 2)]),
                          st.sampled_from(["float32", "bfloat16"]),
                          st.floats(0.3, 2.0)), min_size=1, max_size=20))
def test_a_derived_entry_never_picks_a_losing_path(tmp_path_factory, points):
    """Property: for any bench rows, the derived entry sends a measured size to lax exactly where
    lax won every row of that size (by 5% or more), and the meanwhile union never runs the
    executor where that entry does not."""
    folder = tmp_path_factory.mktemp("prop")
    name = _bench_file(folder / "allreduce-p.json", "allreduce", 2, points)
    c = derive.derive([name], root=str(folder))
    for size in {s for s, _, _ in points}:
        lost = all(t < derive.LAX_WINS_BELOW for s, _, t in points if s == size)
        assert c.prefers_lax(size) == lost
    merged = table.merge_ranges(list(c.lax_ranges) + [(1 << 40, None)])
    assert all(any(lo <= s and (hi is None or s < hi) for lo, hi in merged)
               for s in {s for s, _, _ in points} if c.prefers_lax(s))
