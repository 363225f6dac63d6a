"""The command line: ``python -m jax_blink plan|demo|crossover|run|bench|train`` and the tools.

Every bad value of every option is a usage error before any work starts: exit status 2, nothing on
stdout, one line on stderr naming the option, what it got and what it takes. Most cases run the
parsers in-process (fast); a few run the module end to end.
"""

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jax_blink.tools import bench
from jax_blink.tools import simulate
from jax_blink.__main__ import main
from jax_blink.planning.topology import Topology

ROOT = Path(__file__).resolve().parents[2]
MISSING_FOLDER = "/no-such-folder-jax-blink/t.png"


def _usage_error(capsys, rc, option, got=None):
    """Exit 2, no output, one line on stderr naming ``option`` (and the value it got)."""
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    assert out == "", "work started before the error"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0] and "Traceback" not in err, err
    assert option in lines[0], lines[0]
    if got is not None:
        assert got in lines[0], lines[0]
    return lines[0]


# (argv, the option the message names, the value it quotes, what it says the option takes)
MAIN_CASES = [
    (["plan", "--size", "-5"], "--size", "'-5'", "bytes per rank"),
    (["plan", "--size", "1X"], "--size", "'1X'", "512K"),
    (["plan", "--size", "0"], "--size", "'0'", "at least 1"),
    (["plan", "--size", "1e9"], "--size", "'1e9'", "bytes per rank"),
    (["plan", "--size", "64MiB"], "--size", "'64MiB'", "bytes per rank"),
    (["plan", "--plot", MISSING_FOLDER], "--plot", MISSING_FOLDER, "does not exist"),
    (["plan", "--plot", "trees.xyz"], "--plot", "trees.xyz", ".png"),
    (["plan", "--plot", "."], "--plot", "'.'", "not a folder"),
    (["plan", "--topology", "dgx9"], "--topology", "'dgx9'", "nvswitch:N"),
    (["plan", "--topology", "nvswitch:1"], "--topology", "'nvswitch:1'", "2 <= N"),
    (["plan", "--topology", "nvswitch:100000"], "--topology", "'nvswitch:100000'", "<= 128"),
    (["plan", "--topology", "dgx1v", "--devices", "0,x"], "--devices", "'0,x'", "0,1,4"),
    (["plan", "--topology", "dgx1v", "--devices", "-1"], "--devices", "'-1'", "0,1,4"),
    (["plan", "--topology", "dgx1v", "--devices", "0-99999999"], "--devices", "0-99999999", "range"),
    (["plan", "--topology", "dgx1v", "--devices", "3-1"], "--devices", "3-1", "range"),
    (["plan", "--topology", "dgx1v", "--devices", "0,0,1"], "--devices", "'0,0,1'", "twice"),
    (["plan", "--topology", "dgx1v", "--devices", "0,9"], "--devices", "0,9", "no device has id 9"),
    (["plan", "--devices", "0,4096"], "--devices", "0,4096", "no device has id 4096"),
    (["plan", "--collective", "gather"], "--collective", "'gather'", "choose from"),
    (["plan", "--method", "fast"], "--method", "'fast'", "choose from"),
    (["plan", "--root", "-1"], "--root", "'-1'", ">= 0"),
    (["plan", "--root", "x"], "--root", "'x'", "whole number"),
    (["plan", "--topology", "dgx1v", "--devices", "0,1,4", "--root", "5"], "--root", "5", "[0, 1, 4]"),
    (["plan", "--topology", "dgx2", "--pcie"], "--pcie", None, "DGX-1"),
    (["plan", "--pcie"], "--pcie", None, "DGX-1"),
    (["plan", "--topology", "dgx1v", "--devices", "0,5"], "--pcie", None, "not connected"),  # no NVLink
    (["plan", "--bogus"], "--bogus", None, "unrecognized"),
    (["demo", "--size", "1001"], "--size", "1001", "whole number of float32 elements"),
    (["demo", "--size", "2K", "--dtype", "bfloat16", "--size", "3"], "--size", "'3'", "bfloat16 elements"),
    (["demo", "--size", "-4"], "--size", "'-4'", "bytes per rank"),
    (["demo", "--size", "-4M"], "--size", "'-4M'", "bytes per rank"),  # was argparse's "expected one argument"
    (["demo", "--size", "1K,,4K"], "--size", "'1K,,4K'", "comma-separated"),
    (["plan", "--devices", ""], "--devices", "''", "leave the option out"),  # planned for every device
    (["plan", "--plot", str(ROOT / "pyproject.toml" / "x.png")], "--plot", "pyproject.toml", "is a file, not a folder"),
    (["run", str(ROOT / "examples")], "run", "examples", "is a folder"),  # said "no such file"
    (["run", "no-such-script.py"], "run", "no-such-script.py", "no such file"),
    (["run"], "run", None, "no script given"),
    (["run", "--bogus", "x.py"], "run", "'--bogus'", "--report"),
    (["bench", "-b", "-1K"], "-b/--begin", "'-1K'", "bytes per rank"),  # bench through python -m jax_blink
    (["bench", "-e", "-1K"], "-e/--end", "'-1K'", "bytes per rank"),
    (["train", "--model", "gpt2", "--out", "/proc/x"], "--out", "/proc/x", "cannot write into"),
    (["train", "--model", "gpt2", "--out", "/nonexistent-jax-blink/x"], "--out", "/nonexistent-jax-blink/x",
     "does not exist"),  # used to make the folders without a word
    (["train", "--model", "gpt2", "--out", "x", "--no-write"], "--out", None, "contradict"),
    (["train", "--model", "gpt2", "--steps", "-3"], "--steps", None, ">= 1"),
    (["demo", "--size", "4.5K"], "--size", "'4.5K'", "bytes per rank"),
    (["demo", "--size", "512G"], "--size", "512G", "needs about"),  # more memory than any machine here
    (["demo", "--dtype", "complex64"], "--dtype", "'complex64'", "choose from"),
    (["demo", "--plot", "demo.nope"], "--plot", "demo.nope", ".png"),
    (["demo", "--plot", MISSING_FOLDER], "--plot", MISSING_FOLDER, "does not exist"),
    (["crossover", "missing.json"], "JSON", "missing.json", "no such file"),
    (["crossover", "runs.txt"], "JSON", "runs.txt", ".json"),
    (["crossover"], "JSON", None, "required"),
    ([], "COMMAND", None, "required"),
    (["fly"], "COMMAND", "'fly'", "choose from"),
]


@pytest.mark.parametrize("argv, option, got, takes", MAIN_CASES, ids=[" ".join(c[0]) for c in MAIN_CASES])
def test_main_bad_input_is_a_usage_error(argv, option, got, takes, capsys):
    line = _usage_error(capsys, main(argv), option, got)
    assert takes in line, line


def _bench_cases(tmp: Path):
    a_file = tmp / "a-file"
    a_file.write_text("x")
    not_a_run = tmp / "notes.csv"
    not_a_run.write_text("a,b\n1,2\n")
    return [
        (["-f", "1"], "-f/--factor", "'1'", ">= 2"),  # used to loop forever, growing until killed
        (["-f", "x"], "-f/--factor", "'x'", "whole number"),
        (["-k", "0"], "-k/--chain", "'0'", "from 1 to 1000"),  # was a ZeroDivisionError
        (["-k", "100000"], "-k/--chain", "'100000'", "from 1 to 1000"),
        (["-b", "64K", "-e", "1K"], "-b/--begin", "64K", "<= -e/--end (1K)"),  # was a header and exit 0
        (["-b", "1X"], "-b/--begin", "'1X'", "such as 65536, 512K, 16M or 1G"),
        (["-b", "0"], "-b/--begin", "'0'", "at least 1"),
        (["-e=-1K"], "-e/--end", "'-1K'", "bytes per rank"),
        (["-e", "-1K"], "-e/--end", "'-1K'", "bytes per rank"),  # was argparse's "expected one argument"
        (["-b", "-1K"], "-b/--begin", "'-1K'", "bytes per rank"),
        (["-e", "512G", "-c", "allgather"], "-e/--end", None, "needs about"),  # cannot fit anywhere here
        (["-d", "complex64"], "-d/--dtype", "'complex64'", "float32, bfloat16"),  # was a traceback
        (["-d", "float32,,bfloat16"], "-d/--dtype", "'float32,,bfloat16'", "comma-separated"),
        (["-r", "0"], "-r/--runs", "'0'", "from 1"),
        (["--min-time", "-1"], "--min-time", "'-1'", ">= 0"),
        (["--min-time", "nan"], "--min-time", "'nan'", "finite"),
        (["--ceiling", "0"], "--ceiling", "'0'", "> 0"),
        (["--ceiling", "364"], "--ceiling", None, "give -o DIR"),  # nothing to draw it into
        (["--kind", "h200"], "--kind", None, "give -o DIR"),
        (["--ceiling", "inf"], "--ceiling", "'inf'", "finite"),
        (["-o", str(a_file)], "-o/--out", str(a_file), "folder"),
        (["-o", str(a_file / "sub")], "-o/--out", str(a_file / "sub"), "cannot be made"),
        (["-o", str(tmp / "missing" / "sub")], "-o/--out", "sub", "does not exist"),  # no tree of new folders
        (["--kind", "a/b"], "--kind", "'a/b'", "letters, digits"),
        (["--kind", ""], "--kind", "''", "letters, digits"),
        (["--slope", "10"], "--slope", "10", "longer than -k/--chain (20)"),
        (["--slope", "1"], "--slope", "'1'", "from 2"),
        (["-c", "psum"], "-c/--collective", "psum", "choose from allreduce"),
        (["--plot-only", str(tmp / "missing.csv")], "--plot-only", "missing.csv", "no such file"),
        (["--plot-only", str(a_file)], "--plot-only", "a-file", ".csv"),
        (["--plot-only", str(not_a_run)], "--plot-only", "notes.csv", "lacks the columns"),
        (["--plot-only", str(not_a_run), "-b", "4K"], "--plot-only", None, "-b/--begin"),
        (["--bogus"], "--bogus", None, "unrecognized"),
    ]


def test_bench_bad_input_is_a_usage_error(tmp_path, capsys):
    """One table, run in-process (the cases need a few scratch files)."""
    for argv, option, got, takes in _bench_cases(tmp_path):
        line = _usage_error(capsys, bench.main(argv), option, got)
        assert takes in line, (argv, line)


def test_train_out_is_checked_before_any_work(tmp_path, capsys):
    """--out naming a file, or a folder of a file: refused before training (it used to train first)."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for out in (a_file, a_file / "sub"):
        line = _usage_error(capsys, main(["train", "--model", "gpt2", "--out", str(out)]), "--out", str(out))
        assert "file" in line, line


def test_bench_64_bit_dtypes_need_x64(capsys):
    # Without x64 JAX makes float64 arrays float32: the rows would be mislabelled.
    was = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", False)
    try:
        line = _usage_error(capsys, bench.main(["-d", "float32,float64"]), "-d/--dtype", "float64")
    finally:
        jax.config.update("jax_enable_x64", was)
    assert "JAX_ENABLE_X64=1" in line


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="CUDA graphs exist on GPUs: the option applies")
def test_bench_command_buffers_are_refused_off_gpus(capsys):
    _usage_error(capsys, bench.main(["--command-buffers"]), "--command-buffers")


def test_bench_plot_only_draws_an_earlier_table(tmp_path, capsys):
    path = tmp_path / "allreduce-t.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["size", "dtype", "time_us", "busbw", "lax_time_us", "lax_busbw"])
        w.writeheader()
        w.writerows([dict(size=s, dtype="float32", time_us=s / 100, busbw=s / 1e4, lax_time_us=s / 90,
                          lax_busbw=s / 2e4) for s in (1024, 4096)])
    assert bench.main(["--plot-only", str(path), "--ceiling", "364"]) == 0
    assert path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_subprocess_bad_input_ends_at_once():
    """End to end: the cases that used to hang or print first, each as a new user runs it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cases = [(["-m", "jax_blink.tools.bench", "-f", "1"], "-f/--factor", {}),
             (["-m", "jax_blink", "plan", "--size", "-5"], "--size", {}),
             (["-m", "jax_blink.tools.train", "--model", "gpt2", "--out", "/proc/x"], "--out", {}),
             # read while the package imports: was an 18-line traceback
             (["-m", "jax_blink", "demo"], "JAX_BLINK_DISPATCH='fast'", {"JAX_BLINK_DISPATCH": "fast"}),
             (["-m", "jax_blink", "bench"], "JAX_BLINK_DISPATCH='fast'", {"JAX_BLINK_DISPATCH": "fast"})]
    procs = [(subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=dict(env, **more), cwd=ROOT), option) for argv, option, more in cases]
    for proc, option in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2 and out == "", (option, out, err)
        assert len(err.strip().splitlines()) == 1 and option in err and "Traceback" not in err, err


# ----------------------------------------------------------------------------------- good input
def test_plan_allreduce_dgx1v_subset(capsys):
    rc = main(["plan", "--topology", "dgx1v", "--devices", "0,1,4", "--collective", "allreduce"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "tree 0: root" in out
    assert "GB/s" in out and "cut bound" in out
    assert "rings" in out and "pcie" in out  # {0,1,4} has no NVLink ring
    assert re.search(r"trees [\d.]+ vs rings [\d.]+ GB/s algbw: [\d.]+x", out)


@pytest.mark.parametrize("topology, collective", [("discover", "allreduce"), ("dgx1v", "allreduce"),
                                                  ("dgx1v", "broadcast"), ("nvswitch:4", "reduce")])
def test_plan_rates_are_one_unit_algbw(topology, collective, capsys):
    """Every rate the plan command prints is algbw per rank, and the numbers are the model's."""
    from jax_blink.planning.packing import plan

    if topology == "discover" and jax.device_count() < 2:
        pytest.skip(f"one {jax.default_backend()} device here: a plan of one device moves nothing")
    topo = Topology.discover(jax.devices()) if topology == "discover" else Topology.preset(topology)
    argv = ["plan", "--collective", collective, "--topology", topology]
    root = None if collective == "allreduce" else 0
    assert main(argv + ([] if root is None else ["--root", "0"])) == 0
    out = capsys.readouterr().out
    trees = simulate.algbw(plan(topo, collective, root), collective)
    rings = simulate.algbw(simulate.rings(topo), collective)
    assert f"trees: {trees:.4g} GB/s algbw" in out
    assert f"= {rings:.4g} GB/s algbw" in out  # the rings line ends in the same unit
    assert f"trees {trees:.4g} vs rings {rings:.4g} GB/s algbw" in out
    if topo.name == "host:8":  # 8 CPU host devices (conftest): both reach 40, 70 GB/s of rings x 8/14
        assert "rings of 70 GB/s in all" in out and "70 x 8/14 = 40 GB/s algbw" in out
        assert "GPU" not in out


def test_plan_broadcast_root_and_plot(tmp_path, capsys):
    png = tmp_path / "trees.png"
    rc = main(["plan", "--topology", "dgx1v", "--collective", "broadcast", "--root", "0",
               "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "trees: 150 GB/s algbw" in out  # all 8 GPUs from 0: 6 links x 25 GB/s
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_discover_default(capsys):
    # No --topology: the jax devices here (8 CPU host devices under tests/conftest.py; the GPUs
    # on a GPU machine, which NVML describes).
    rc = main(["plan", "--collective", "allreduce"])
    out = capsys.readouterr().out
    assert rc == 0
    expected = "host" if jax.default_backend() == "cpu" else f"{jax.device_count()} devices"
    assert expected in out


def test_help_says_sizes_are_bytes_per_rank(capsys):
    def help_text(run, argv):
        assert run(argv) == 0
        return " ".join(capsys.readouterr().out.split())  # as one line, however argparse wraps it

    plan_help = help_text(main, ["plan", "--help"])
    assert "--collective" in plan_help and "--size BYTES bytes per rank for the time model" in plan_help
    assert "--size BYTES[,BYTES...] bytes per rank to time all_reduce at, each a whole number of elements" \
        in help_text(main, ["demo", "--help"])
    top = help_text(main, ["--help"])
    assert all(w in top for w in ("bench", "train", "run", "demo", "jax-blink"))
    run_help = help_text(main, ["run", "--help"])
    assert "--report when the script ends, print the switch's decisions" in run_help
    bench_help = help_text(bench.main, ["--help"])
    assert "--begin BYTES smallest size, bytes per rank" in bench_help
    assert "--end BYTES largest size, bytes per rank" in bench_help


def test_subprocess_module(tmp_path):
    png = tmp_path / "t.png"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MPLBACKEND", None)
    r = subprocess.run([sys.executable, "-m", "jax_blink", "plan", "--topology", "dgx1v",
                        "--devices", "0,1,2,3,4", "--collective", "allreduce", "--plot", str(png)],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "tree 0" in r.stdout and png.exists()


def test_single_device_and_mwu(capsys):
    assert main(["plan", "--topology", "dgx1v", "--devices", "0"]) == 0
    assert "nothing to move" in capsys.readouterr().out
    assert main(["plan", "--topology", "dgx1v", "--devices", "0,1,4", "--collective", "reduce",
                 "--root", "4", "--method", "mwu", "--size", "64M"]) == 0
    out = capsys.readouterr().out
    assert "reduce plan (mwu), root 4" in out and "model at 64M bytes per rank" in out


_ROW = re.compile(r"^ +(\S+)  (the executor(?: \([^)]*\))?|lax\.psum \([^)]*\))"
                  r"(?: MISMATCH.*?)? +([\d.]+) +([\d.]+) +([\d.]+)x$")


def _timing_rows(out: str) -> list[tuple[str, str]]:
    """(size, the path printed) for each row of the demo's timing table."""
    return [(m.group(1), m.group(2)) for m in map(_ROW.match, out.splitlines()) if m]


def test_demo_tells_the_story_with_every_number_labelled(tmp_path, capsys):
    png = tmp_path / "demo.png"
    assert main(["demo", "--size", "1K,64K", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "jax_blink.backends() = " in out and "CPU executor built" in out  # what the install built
    assert "1. The paper's result, reproduced in the model (MODELLED" in out
    assert re.search(r"DGX-1V +0,1,4 +allreduce .* pcie .* [\d.]+x +[\d.]+x", out)
    assert "The paper MEASURED on DGX-1V" in out
    if jax.device_count() == 1:  # one GPU (CPU runs get host devices from the conftest)
        assert "a collective needs 2 or more devices" in out and "inf" not in out
        return
    assert "2. " in out and "MODELLED" in out.split("2. ", 1)[1]
    checks = out.split("3. ", 1)[1].split("4. ", 1)[0]
    assert checks.count("ran on the executor; agrees") == 5, checks  # every collective, against lax
    assert "TIMED here (measured" in out and "float32" in out
    assert [size for size, _ in _timing_rows(out)] == ["1K", "64K"]
    assert "MISMATCH" not in out and "matches the dispatch decision" in out
    assert png.stat().st_size > 0
    if jax.default_backend() == "cpu":
        assert "8 x cpu (CPU host devices)" in out
        assert "host:8 is a uniform mesh" in out and "trees == rings" in out
        assert "rate inf" not in out


@pytest.mark.parametrize("dispatch", ["lax", "blink", "auto"])
def test_demo_times_the_path_it_prints(dispatch, capsys):
    """The decision the demo prints for a size is the program it times: the compiled program holds
    jax_blink's custom call exactly where a row says the executor, whichever way dispatch goes."""
    from jax_blink.lowering.dispatch_table import prefer_lax
    from jax_blink.options.settings import override
    from jax_blink.tools.demo import timed_programs, timing_lines
    from jax_blink.tools.timing import runs_executor

    if jax.device_count() < 2:
        pytest.skip("one device: the demo times nothing")
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",))
    sizes = [1 << 10, 64 << 10]
    with override(dispatch=dispatch):
        lines, consistent = timing_lines(mesh, "data", sizes, "float32", runs=1, min_seconds=0)
        compiled = [runs_executor(*timed_programs(mesh, "data", b, "float32")[::2]) for b in sizes]
    rows = _timing_rows("\n".join(lines))
    assert consistent and len(rows) == 2, lines
    said = [path.startswith("the executor") for _, path in rows]
    assert said == compiled, (lines, compiled)
    kind = jax.devices()[0].device_kind
    expected = {"lax": [False, False], "blink": [True, True],
                "auto": [not prefer_lax(kind, n, b, dtype="float32") for b in sizes]}[dispatch]
    assert said == expected, lines
    if dispatch == "lax":
        assert all(path == "lax.psum (dispatch=lax)" for _, path in rows)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_demo_size_takes_the_byte_grammar(dtype, capsys):
    if jax.device_count() < 2:
        pytest.skip(f"one {jax.default_backend()} device here: the demo has nothing to reduce across")
    assert main(["demo", "--size", "2K", "--dtype", dtype]) == 0  # results agree within the dtype's rounding
    out = capsys.readouterr().out
    assert f"TIMED here (measured: wall time per call of one jitted shard_map on {jax.device_count()} x" in out
    assert f", {dtype}, median" in out and [s for s, _ in _timing_rows(out)] == ["2K"]


def test_explain_describes_the_topology_devices_not_this_machine():
    """A GPU preset is explained for GPUs (CUDA executor, its own dispatch entry), a CPU host mesh
    for the CPU executor, whatever devices this process has."""
    import jax_blink

    gpu = jax_blink.explain(Topology.preset("nvswitch:4"), 1 << 20)
    assert "CUDA executor" in gpu and "on 4 GPUs" in gpu
    if jax.default_backend() == "cpu":  # this machine's CPU table must not decide for a GPU preset
        assert "x cpu" not in gpu and "device_kind=" in gpu
    cpu = jax_blink.explain(Topology.host(4), 1 << 20, device_kind="cpu")
    assert "CPU executor" in cpu and "CUDA" not in cpu and "GPU" not in cpu
    from jax_blink.lowering import dispatch_table as tuning  # the CPU table decides for CPU host devices, whichever way it goes

    said = "measured faster on 4 x cpu" if tuning.prefer_lax("cpu", 4, 1 << 20) else "the entry for 4 x cpu"
    assert tuning.entry("cpu", 4) is not None and said in cpu
    named = jax_blink.explain(Topology.preset("nvswitch:2"), 1 << 20, device_kind="NVIDIA H200")
    assert "entry for 2 x NVIDIA H200" in named


def test_crossover_prints_the_entry_that_tuning_holds(capsys, monkeypatch):
    """`crossover` on the runs an entry cites prints that entry, in the form tuning.py holds."""
    from jax_blink.lowering import dispatch_table as tuning

    monkeypatch.chdir(ROOT)
    for entry in tuning.CROSSOVERS:  # every collective's and machine's
        assert main(["crossover", *entry.sources, *(["--dtype", entry.dtype] if entry.dtype else [])]) == 0
        out = capsys.readouterr().out
        code = "\n".join(line for line in out.splitlines() if not line.startswith("#"))
        assert eval(code, {"Crossover": tuning.Crossover}) == (entry,)  # noqa: S307 (our own output)
        assert out.startswith(f"# {entry.collective}: derived from")
    bad = "benchmarks/results/plan_time-cpu-2026-11-22.txt"
    _usage_error(capsys, main(["crossover", bad]), "JSON", bad)


class _FakeDevice:
    """Stands in for a jax device of another platform (the GPU branches, checked without a GPU)."""

    def __init__(self, platform, limit=None, kind="fake"):
        self.platform, self._limit, self.device_kind = platform, limit, kind

    def memory_stats(self):
        return None if self._limit is None else {"bytes_limit": self._limit, "bytes_in_use": 0}


def test_memory_check_reads_a_gpu_limit_per_device():
    from jax_blink.tools import arguments as _cli

    gpus = [_FakeDevice("gpu", 80 << 30)] * 2
    assert _cli.available_memory(gpus) == (80 << 30, "memory of one device")
    _cli.check_fits("--size", 1 << 30, gpus, 79 << 30)  # fits: no error
    with pytest.raises(_cli.UsageError, match=r"argument --size: got '1G'; .*needs about 81G.* is 80G"):
        _cli.check_fits("--size", 1 << 30, gpus, 81 << 30)
    assert _cli.available_memory([_FakeDevice("gpu")]) == (None, "")  # no stats: nothing to check
    _cli.check_fits("--size", 1 << 30, [_FakeDevice("gpu")], 1 << 60)


def test_demo_names_the_executors_built():
    from jax_blink.tools.demo import bytes_needed, executors_line

    line = executors_line({"cpu": True, "gpu": True}, "cpu")
    assert "CPU executor built" in line and "no GPU here, so it does not run" in line
    assert "CUDA executor built" in executors_line({"cpu": True, "gpu": True}, "gpu")
    assert "not built" in executors_line({"cpu": True, "gpu": False}, "cpu")
    # GPUs: one device's share; CPU host devices share the host's memory: all of them
    assert bytes_needed(1 << 20, "float32", [_FakeDevice("gpu")] * 8) == 4 << 20
    assert bytes_needed(1 << 20, "float32", [_FakeDevice("cpu")] * 8) == 8 * (4 << 20) + 8 * 3 * (1 << 20)


@pytest.mark.parametrize("kind, board", [("NVIDIA H100 80GB HBM3", "nvswitch:8"), ("NVIDIA H200", "nvswitch:8"),
                                         ("Tesla V100-SXM2-16GB", "dgx1v")])
def test_demo_on_one_gpu_says_what_it_cannot_show(kind, board):
    """One GPU: the model for the board it likely sits in, and plainly no collective (no 'rate inf',
    no timing); the CUDA self-test named for the kernels with ranks as streams."""
    from jax_blink.tools.demo import one_device_lines

    text = "\n".join(one_device_lines(_FakeDevice("gpu", kind=kind)))
    assert f"One {kind}" in text and board in text and "MODELLED" in text
    assert "a collective needs 2 or more devices" in text and "benchmarks/gpu_session.sh" in text
    assert "inf" not in text and " us " not in text.split("3.-4.")[1]
    cpu = "\n".join(one_device_lines(_FakeDevice("cpu")))
    assert "xla_force_host_platform_device_count=8" in cpu


# ----------------------------------------------------------------------------------- rough edges of the API
def test_all_reduce_takes_bool_as_lax_psum_does():
    """lax.psum sums bools as int32; jax_blink.all_reduce the same, on the executor or through lax."""
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_blink
    from jax_blink.options.settings import override

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",))
    x = jax.device_put(np.arange(4 * n) % 3 == 0, NamedSharding(mesh, P("data")))

    def run(fn):
        return jax.jit(jax.shard_map(lambda v: fn(v, "data"), mesh=mesh, in_specs=P("data"), out_specs=P()))(x)

    ref = run(jax.lax.psum)
    for dispatch in ("blink", "auto", "lax"):
        with override(dispatch=dispatch):
            ours = run(jax_blink.all_reduce)
        assert ours.dtype == ref.dtype and np.array_equal(ours, ref), dispatch
    with override(dispatch="blink"):
        anyone = run(lambda v, a: jax_blink.all_reduce(v, a, op="max"))
    assert anyone.dtype == np.bool_ and np.array_equal(anyone, np.asarray(ref) > 0)


def test_all_gather_takes_to_where_lax_does():
    import inspect

    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_blink

    lax_to = inspect.signature(jax.lax.all_gather).parameters.get("to")
    ours_to = inspect.signature(jax_blink.all_gather).parameters.get("to")
    assert (ours_to is None) == (lax_to is None)
    if lax_to is None:
        return
    assert ours_to.default == lax_to.default
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",))
    x = jax.device_put(np.arange(2.0 * n, dtype=np.float32), NamedSharding(mesh, P("data")))
    for fn in (jax.lax.all_gather, jax_blink.all_gather):
        for to, out in (("varying", P("data")), ("invarying", P())):
            got = jax.jit(jax.shard_map(lambda v: fn(v, "data", tiled=True, to=to), mesh=mesh,
                                        in_specs=P("data"), out_specs=out))(x)
            assert np.array_equal(np.asarray(got)[: 2 * n], np.asarray(x)), (fn, to)


def test_explain_counts_one_tree():
    from jax_blink.planning.packing import plan

    p = plan(Topology.preset("dgx1v").subset([0, 3, 4]), "broadcast", 0)
    assert p.num_trees == 1
    assert ": 1 tree, rate" in p.explain() and "1 trees" not in p.explain() + repr(p)


def test_decode_forwards_to_the_decode_tool(capsys):
    """``jax-blink decode`` is ``python -m jax_blink.tools.decode``: its arguments reach that tool,
    whose errors name the option and what it takes."""
    from jax_blink.tools import cli

    assert cli.main(["decode", "--batch", "0"]) == 2
    assert "--batch: got '0'; takes whole numbers >= 1" in capsys.readouterr().err
