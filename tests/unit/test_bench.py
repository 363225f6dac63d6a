"""The benchmark tool runs every collective, checks it against lax and writes its table."""
import csv
import json
import statistics

import jax
import pytest

from jax_blink.tools import bench


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2+ devices")
@pytest.mark.parametrize("collective", sorted(bench.COLLECTIVES))
def test_bench_runs_checks_and_writes(tmp_path, collective):
    rc = bench.main(["-c", collective, "-b", "1K", "-e", "4K", "-f", "4", "-d", "float32",
                     "-k", "2", "-r", "1", "--min-time", "0", "-o", str(tmp_path), "--kind", "test"])
    assert rc == 0  # nonzero when any element was wrong
    (path,) = tmp_path.glob(f"{collective}-test-*.csv")
    rows = list(csv.DictReader(open(path)))
    assert [int(r["wrong"]) for r in rows] == [0, 0]
    assert all(float(r["time_us"]) > 0 and float(r["lax_time_us"]) > 0 for r in rows)
    assert all(float(r["spread"]) >= 0 and float(r["lax_spread"]) >= 0 for r in rows)
    assert all(int(r["runs"]) == 1 for r in rows)
    meta = json.loads(path.with_suffix(".json").read_text())["meta"]
    assert meta["collective"] == collective and meta["min_seconds"] == 0
    assert path.with_suffix(".png").stat().st_size > 0


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2+ devices")
def test_a_run_stopped_midway_keeps_its_rows_and_makes_no_entry(tmp_path, monkeypatch):
    """The files are written after every row: a run stopped at its third size (here by an error
    in the timing, as a time limit would stop it) leaves the two rows it measured, marked
    incomplete, and the crossover refuses to derive an entry from them."""
    from jax_blink.tools import derive

    real, calls = bench.interleaved_times, []

    def stop_at_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("the run's time limit")
        return real(*args, **kwargs)

    monkeypatch.setattr(bench, "interleaved_times", stop_at_third)
    with pytest.raises(KeyboardInterrupt):
        bench.run(1024, 16384, 4, ["float32"], k=2, runs=1, out_dir=str(tmp_path), kind="test", min_seconds=0)
    (path,) = tmp_path.glob("allreduce-test-*.json")
    doc = json.loads(path.read_text())
    assert doc["meta"]["complete"] is False and doc["meta"]["rows_planned"] == 3
    assert [r["bytes_per_rank"] for r in doc["rows"]] == [1024, 4096]
    assert len(list(csv.DictReader(open(path.with_suffix(".csv"))))) == 2
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob("*.png"))
    with pytest.raises(ValueError, match="stopped after 2 of its 3 rows"):
        derive.derive([path.name], root=str(tmp_path))
    monkeypatch.setattr(bench, "interleaved_times", real)  # a whole run: complete, and an entry
    bench.run(1024, 16384, 4, ["float32"], k=2, runs=1, out_dir=str(tmp_path), kind="test", min_seconds=0)
    assert json.loads(path.read_text())["meta"]["complete"] is True
    assert derive.derive([path.name], root=str(tmp_path)).ranks == jax.device_count()


def test_collectives_argument_runs_all_reduce_first():
    import argparse

    assert bench._collectives_arg("all")[0] == "allreduce"
    assert set(bench._collectives_arg("all")) == set(bench.COLLECTIVES)
    assert bench._collectives_arg("reduce,all") == bench._collectives_arg("all")
    assert bench._collectives_arg("reduce, allreduce,reduce") == ["allreduce", "reduce"]
    with pytest.raises(argparse.ArgumentTypeError, match="unknown collective gather"):
        bench._collectives_arg("allreduce,gather")
    assert bench.main(["-c", "psum"]) == 2  # a usage error (tests/unit/test_cli.py has the table)


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2+ devices")
def test_bench_all_writes_one_table_per_collective(tmp_path):
    rc = bench.main(["-c", "all", "-b", "1K", "-e", "1K", "-d", "float32", "-k", "2", "-r", "1",
                     "--min-time", "0", "-o", str(tmp_path), "--kind", "test"])
    assert rc == 0
    assert sorted(p.name.split("-")[0] for p in tmp_path.glob("*.csv")) == sorted(bench.COLLECTIVES)


def test_parse_size():
    assert bench.parse_size("1K") == 1024
    assert bench.parse_size("64M") == 64 << 20
    assert bench.parse_size("1G") == 1 << 30
    assert bench.parse_size("4096") == 4096


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2+ devices")
def test_bench_tune_chunks_adds_tuned_columns(tmp_path, monkeypatch, capsys):
    from jax_blink.tools import autotune

    cache = tmp_path / "chunks.json"
    monkeypatch.setenv(autotune.CACHE_ENV, str(cache))
    autotune.reload()
    try:
        rc = bench.main(["-b", "4K", "-e", "16K", "-f", "4", "-d", "float32", "-k", "2", "-r", "1",
                         "-o", str(tmp_path), "--kind", "test", "--tune-chunks"])
    finally:
        autotune.reload()
    assert rc == 0
    (path,) = tmp_path.glob("allreduce-test-*.csv")
    rows = list(csv.DictReader(open(path)))
    assert len(rows) == 2
    for r in rows:
        assert float(r["time_us"]) > 0 and float(r["tuned_time_us"]) > 0
        assert int(r["tuned_chunk"]) >= 4096 and int(r["tuned_chunk"]) % 16 == 0
        assert float(r["tuned_speedup"]) == pytest.approx(float(r["lax_time_us"]) / float(r["tuned_time_us"]))
        assert r["cb_time_us"] == "nan"  # the other optional columns keep their meaning
    out = capsys.readouterr().out
    assert out.count("#   miad chunk:GB/s") == 2 and "tuned(B)" in out
    assert len(json.loads(cache.read_text())["entries"]) == 2


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2+ devices")
def test_bench_without_tune_chunks_has_nan_tuned_columns(capsys):
    rows = bench.run(4096, 4096, 4, ["float32"], 2, 1, None, None, min_seconds=0)
    assert all(r["tuned_chunk"] != r["tuned_chunk"] and r["tuned_time_us"] != r["tuned_time_us"]
               for r in rows)  # NaN, as cb_time_us without --command-buffers
    assert "miad" not in capsys.readouterr().out


def test_spread_is_the_interquartile_range_over_the_median():
    assert bench.spread([1.0, 1.0, 1.0]) == 0.0  # too few runs to say
    assert bench.spread([2.0] * 6) == 0.0
    times = [1.0, 2.0, 3.0, 4.0, 5.0]
    q = statistics.quantiles(times, n=4)
    assert bench.spread(times) == pytest.approx((q[2] - q[0]) / 3.0)
    assert bench.spread([1.0, 1.0, 1.0, 10.0, 10.0]) > 1.0  # runs that disagree show it


def test_host_bytes_is_the_largest_communicator_and_tolerates_an_older_module(monkeypatch):
    import sys
    import types

    import jax_blink

    fake = types.ModuleType("jax_blink._blink_cuda")
    fake.comms = lambda: [{"host_bytes": 3 << 20}, {"host_bytes": 5 << 20}, {}]  # {}: an older module
    monkeypatch.setitem(sys.modules, "jax_blink._blink_cuda", fake)
    monkeypatch.setattr(jax_blink, "_blink_cuda", fake, raising=False)
    assert bench._host_bytes() == 5 << 20
    fake.comms = lambda: []
    assert bench._host_bytes() == 0


class _FakeProgram:
    """Stands in for a jitted program: records its calls in a shared log, sleeps ``seconds``."""

    def __init__(self, name, log, seconds=0.0):
        self.name, self.log, self.seconds = name, log, seconds

    def __call__(self, x):
        import time

        self.log.append(self.name)
        time.sleep(self.seconds)
        return self

    def block_until_ready(self):
        return self


def test_interleaved_times_take_turns_and_run_small_programs_longer():
    log = []
    a, b = _FakeProgram("a", log), _FakeProgram("b", log)
    times = bench.interleaved_times([a, b], None, runs=3)
    assert [len(t) for t in times] == [3, 3]
    # two warm-up calls each, then a b | b a | a b: the order flips every round
    assert log == ["a", "a", "b", "b", "a", "b", "b", "a", "a", "b"]
    # min_seconds: more rounds until each has run that long in all, at most max_runs
    log.clear()
    slow = _FakeProgram("s", log, 0.002)
    times = bench.interleaved_times([slow], None, runs=2, min_seconds=0.02)
    # stops once reached (unless the 2 runs asked for already passed it: a slow machine's sleeps)
    assert sum(times[0]) >= 0.02 and (len(times[0]) == 2 or sum(times[0][:-1]) < 0.02)
    times = bench.interleaved_times([_FakeProgram("f", [], 0.001)], None, runs=2, min_seconds=10, max_runs=7)
    assert len(times[0]) == 7


def test_defaults_a_laptop_survives():
    """The defaults: 1K to 4M bytes per rank, float32 only (measured with the old and the new defaults:
    benchmarks/results/demo-cpu-8dev-2026-11-25.txt)."""
    a = bench.build_parser().parse_args([])
    assert (a.begin, a.end, a.dtype, a.collective) == (1 << 10, 4 << 20, ["float32"], ["allreduce"])


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2+ devices")
def test_columns_say_which_size_each_is(capsys):
    """All-gather's nccl-tests size is the gathered output, n x the bytes per rank that -b/-e
    count: the table shows both, and says what the run will take before it starts."""
    n = jax.device_count()
    assert bench.main(["-c", "allgather", "-b", "1K", "-e", "1K", "-k", "1", "-r", "1", "--min-time", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# this run: 1 row(s)") and "of memory" in out
    assert f"({n} x bytes/rank, the gathered output)" in out
    header = next(line for line in out.splitlines() if "bytes/rank" in line and "dtype" in line).split()
    row = next(line for line in out.splitlines() if line.startswith("  ")).split()
    assert header[1:3] == ["bytes/rank", "size"] and row[:2] == ["1024", str(1024 * n)]
