"""``python -m jax_blink.tools.bench``: our collectives against XLA's, side by side, nccl-tests style.

For each size: K chained calls inside one jitted program (the output of one call feeds the next),
timed over several runs after a warm-up, ours and lax taking turns run by run (at least ``-r``
runs, more until each has run ``--min-time`` seconds: small sizes get hundreds); the median
divided by K is the time per call. ``algbw`` is
bytes / time and ``busbw`` is algbw * 2(n-1)/n for all-reduce (nccl-tests' definitions). Every size
is also checked: one call of ours against one of ``lax.psum`` on fresh random data, and ``#wrong``
counts the elements that differ by more than rounding (or that differ between ranks).
``spread%`` says how much the runs of one size disagree, ours / lax: (75th - 25th percentile) /
median of the program times, in percent (0 with fewer than 4 runs).

``--slope K2`` also times K2 chained calls and reports the marginal cost of a call,
(t(K2) - t(K)) / (K2 - K), for ours and lax: the program's fixed cost (dispatch, the devices'
launch skew, the final sync) is set apart, which matters when a call takes microseconds.

``--dispatch auto`` times what a user's call runs instead of the executor itself: ours is traced
under ``dispatch="auto"`` (this machine's tuned entry, the shipped table, or the meanwhile rule
where there is none) and a column names the path each size took (``executor`` or ``lax``, read
from the compiled program), so the table is checked the way users meet it. Such runs derive no
entry (``crossover`` refuses them).

``--tune-chunks`` also tunes the pipelining chunk per size (:func:`jax_blink.tools.autotune.tune_chunk`,
which stores it for ``JAX_BLINK_CHUNK_BYTES=auto``) and reports the time at the tuned chunk beside
the time at the fixed one.
"""
from __future__ import annotations

import argparse
import csv
import datetime as _dt
import json
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_blink.tools import arguments as _cli
from jax_blink.tools import autotune
from jax_blink.tools.timing import (COLLECTIVES, Collective, chained, check_against_lax as _check,  # noqa: F401
                                    interleaved_times,
                                    median_time, runs_executor, spread)
from jax_blink.lowering.machine import links_here, nccl_version
from jax_blink.options.settings import config, parse_byte_count
from jax_blink.planning.schedule import DEFAULT_CHUNK_BYTES

#: The dtypes the bench runs (those jax_blink's collectives take); the 64-bit ones need JAX's x64 mode.
DTYPES = ("float32", "bfloat16", "float16", "float64", "int32", "int64")
_X64_DTYPES = ("float64", "int64")
PROG = "python -m jax_blink.tools.bench"
#: What ``--dispatch`` takes: ``blink`` times the executor itself (what entries are derived from),
#: ``auto`` what ``dispatch="auto"`` runs on this machine.
DISPATCH_MODES = ("blink", "auto")


def run_machine(devices) -> dict:
    """What a bench file records of the machine, for the dispatch table's key
    (:class:`jax_blink.lowering.machine.MachineKey`): links, layout and NCCL version."""
    platform = "cpu" if devices[0].platform == "cpu" else "gpu"
    return dict(links=links_here(platform, len(devices)), layout="one process",
                nccl=None if platform == "cpu" else nccl_version())


def parse_size(text: str) -> int:
    """'1K', '64M', '1G' or a byte count -> bytes (the grammar of every JAX_BLINK_* byte count)."""
    return parse_byte_count(text.strip())


def sizes(begin: int, end: int, factor: int) -> list[int]:
    """``begin``, ``begin * factor``, ... up to ``end`` (bytes per rank)."""
    if begin < 1 or factor < 2:
        raise ValueError(f"sizes() needs begin >= 1 and factor >= 2, got begin={begin}, factor={factor}")
    out, s = [], begin
    while s <= end:
        out.append(s)
        s *= factor
    return out


def _staging_bytes() -> int | None:
    """The CUDA executor's largest staging allocation per rank (None without the CUDA module)."""
    try:
        from jax_blink import _blink_cuda
    except ImportError:
        return None
    return int(_blink_cuda.staging_bytes())


def _host_bytes() -> int | None:
    """Pinned host memory of the CUDA executor's hybrid sites (the host channel), per rank: the
    largest over its communicators (None without the CUDA module; 0 from a module that predates
    the host channel)."""
    try:
        from jax_blink import _blink_cuda
    except ImportError:
        return None
    return max((int(c.get("host_bytes", 0)) for c in _blink_cuda.comms()), default=0)


def _time_or_error(fn, x, runs: int) -> float:
    try:
        return median_time(fn, x, runs)
    except Exception as e:  # noqa: BLE001 (a variant that cannot run is reported, not fatal)
        print(f"#   variant failed: {str(e).splitlines()[0][:200]}")
        return float("nan")


def _fmt_bytes(b: int) -> str:
    for unit, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if b >= scale and b % scale == 0:
            return f"{b // scale}{unit}"
    return str(b)


def _trial_log(res: autotune.MiadResult) -> str:
    """One comment line: each chunk tried with its algbw (GB/s), in order, and the one kept."""
    trials = " ".join(f"{_fmt_bytes(c)}:{t / 1e9:.3g}" for c, t in res.log)
    return f"#   miad chunk:GB/s {trials} -> {_fmt_bytes(res.chunk_bytes)}"


def run(begin: int, end: int, factor: int, dtypes: list[str], k: int, runs: int,
        out_dir: str | None, kind: str | None, command_buffers: bool = False,
        ceiling: float | None = None, collective: str = "allreduce", slope_k: int | None = None,
        tune_chunks: bool = False, min_seconds: float = 0.2, dispatch: str = "blink") -> list[dict]:
    if begin < 1 or end < begin or factor < 2 or k < 1 or runs < 1 or not min_seconds >= 0:
        raise ValueError(f"run() needs 1 <= begin <= end, factor >= 2, k >= 1, runs >= 1 and "
                         f"min_seconds >= 0; got begin={begin}, end={end}, factor={factor}, k={k}, "
                         f"runs={runs}, min_seconds={min_seconds}")
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; choose from {', '.join(COLLECTIVES)}")
    if dispatch not in DISPATCH_MODES:
        raise ValueError(f"dispatch {dispatch!r} is not one of {', '.join(DISPATCH_MODES)}")
    devices = jax.devices()
    n = len(devices)
    if n < 2:
        raise SystemExit("jax_blink.tools.bench needs at least 2 devices (on CPU: "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    mesh = jax.make_mesh((n,), ("x",), devices=devices)
    sharding = NamedSharding(mesh, P("x"))
    # The executor itself ("blink"), not the size dispatch of jax_blink.lowering.dispatch_table: that is
    # what an entry is derived from. With dispatch="auto": what a user's call runs, the table checked.
    coll = COLLECTIVES[collective]
    ours_fn = chained(coll.chain(coll.ours), mesh, "x", k, dispatch=dispatch)
    psum_fn = chained(coll.chain(coll.ref), mesh, "x", k)
    cb_fn = (chained(coll.chain(coll.ours), mesh, "x", k, command_buffers=True, dispatch="blink")
             if command_buffers else None)
    # The marginal cost of one more chained call, (t(K2) - t(K)) / (K2 - K): what a call costs once
    # the program's fixed cost (dispatch, the GPUs' launch skew, the final sync) is set apart.
    if slope_k is not None and slope_k <= k:
        raise SystemExit(f"--slope K2 must be larger than -k ({k}), got {slope_k}")
    ours2_fn = chained(coll.chain(coll.ours), mesh, "x", slope_k, dispatch=dispatch) if slope_k else None
    auto = dispatch == "auto"
    psum2_fn = chained(coll.chain(coll.ref), mesh, "x", slope_k) if slope_k else None
    rng = np.random.default_rng(0)
    rows = []
    stem = meta = None
    if out_dir:
        kind = kind or f"{devices[0].platform}-{n}x{devices[0].device_kind.replace(' ', '_')}"
        stem = os.path.join(out_dir, f"{collective}-{kind}-{_dt.date.today().isoformat()}"
                            + ("-auto" if auto else ""))
        os.makedirs(out_dir, exist_ok=True)
        meta = dict(device_kind=devices[0].device_kind, n=n, jax=jax.__version__, k=k, slope_k=slope_k, runs=runs,
                    min_seconds=min_seconds, collective=collective,
                    date=_dt.date.today().isoformat(), staging_bytes=None, host_bytes=None,
                    chunk_bytes=config.chunk_bytes, tune_chunks=tune_chunks, **run_machine(devices),
                    dispatch=dispatch, rows_planned=len(dtypes) * len(sizes(begin, end, factor)), complete=False)
        print(f"# {stem}.csv and .json are written after every row (\"complete\": false in the .json until "
              "the last), the plot at the end")
    if auto:
        print("# --dispatch auto: ours is jax_blink as dispatch=\"auto\" runs it; 'auto ran' names the path "
              "read from each size's compiled program (executor or lax)")
    print(f"# jax_blink.tools.bench: {collective}, ours vs lax (psum, all_gather, psum_scatter), {n} x {devices[0].device_kind}, jax "
          f"{jax.__version__}, {k} chained calls, median of {runs}+ runs (more until {min_seconds:g} s per variant), "
          f"ours and lax taking turns")
    print(f"# bytes/rank: each rank's operand (what -b/-e count); size: nccl-tests' size, the larger of a "
          f"rank's input and output ({'= bytes/rank' if coll.size_factor(n) == 1 else f'{coll.size_factor(n)} x bytes/rank, the gathered output'}"
          f"); algbw = size / time, busbw = algbw x {coll.bus_factor(n):.3g}")
    print(f"# {'bytes/rank':>10} {'size':>10} {'count':>11} {'dtype':>8} {'time(us)':>10} {'algbw':>8} {'busbw':>8} "
          f"{'lax(us)':>10} {'l.busbw':>8} {'speedup':>8} {'#wrong':>7} {'spread%':>9}"
          + (f" {'auto ran':>9}" if auto else "")
          + (f" {'cb(us)':>9}" if command_buffers else "")
          + (f" {'slope':>7} {'l.slope':>7} {'s.spdup':>7}" if slope_k else "")
          + (f" {'tuned(B)':>9} {'t.us':>10} {'t.spdup':>7}" if tune_chunks else ""))
    if tune_chunks:
        fixed = config.chunk_bytes or f"{_fmt_bytes(DEFAULT_CHUNK_BYTES)} (default)"
        print(f"# tuned(B): the chunk MIAD found best, t.us: time per call at it, t.spdup: lax / t.us "
              f"(time(us) is at chunk_bytes={fixed}); stored in {autotune.cache_path()}")
    for dtype in dtypes:
        for nbytes in sizes(begin, end, factor):
            count = max(1, nbytes // jnp.dtype(dtype).itemsize)
            if coll.divisible:
                count = max(n, count // n * n)
            if jnp.issubdtype(dtype, jnp.integer):  # small integers: sums stay exact, few zeros
                host = rng.integers(-1000, 1000, (n * count,), dtype=np.int32)
            else:
                host = rng.standard_normal((n * count,), dtype=np.float32)
            x = jax.device_put(jnp.asarray(host, dtype=dtype), sharding)
            wrong = _check(coll, mesh, "x", x)
            path = ("executor" if runs_executor(ours_fn, x) else "lax") if auto else "executor"
            # Ours and lax (and the K2-call programs) take turns, run by run: see interleaved_times.
            fns = [ours_fn, psum_fn] + ([ours2_fn, psum2_fn] if slope_k else [])
            timed = interleaved_times(fns, x, runs, min_seconds)
            times_ours, times_psum = timed[0], timed[1]
            t_ours = statistics.median(times_ours) / k
            t_psum = statistics.median(times_psum) / k
            t_cb = _time_or_error(cb_fn, x, runs) / k if cb_fn else float("nan")
            s_ours = s_psum = float("nan")
            if slope_k:
                d = slope_k - k
                s_ours = (statistics.median(timed[2]) - t_ours * k) / d
                s_psum = (statistics.median(timed[3]) - t_psum * k) / d
            tuned = autotune.tune_chunk(collective, x, mesh, "x", k=k, runs=runs) if tune_chunks else None
            size = count * jnp.dtype(dtype).itemsize * coll.size_factor(n)
            bus = coll.bus_factor(n)
            row = dict(size=size, count=count, dtype=dtype, n=n,
                       time_us=t_ours * 1e6, algbw=size / t_ours / 1e9, busbw=size / t_ours / 1e9 * bus,
                       lax_time_us=t_psum * 1e6, lax_algbw=size / t_psum / 1e9,
                       lax_busbw=size / t_psum / 1e9 * bus, speedup=t_psum / t_ours, wrong=wrong,
                       spread=spread(times_ours), lax_spread=spread(times_psum),
                       cb_time_us=t_cb * 1e6, slope_us=s_ours * 1e6, lax_slope_us=s_psum * 1e6,
                       slope_speedup=s_psum / s_ours if s_ours > 0 else float("nan"), runs=len(times_ours),
                       bytes_per_rank=count * jnp.dtype(dtype).itemsize, path=path)
            # Tuned: throughput is this row's size per second (autotune.tune_chunk), so size / it is
            # the time per call at the tuned chunk.
            t_tuned = size / tuned.throughput if tuned and tuned.throughput > 0 else float("nan")
            row.update(tuned_chunk=tuned.chunk_bytes if tuned else float("nan"),
                       tuned_time_us=t_tuned * 1e6, tuned_speedup=t_psum / t_tuned)
            rows.append(row)
            spreads = f"{100 * row['spread']:.0f}/{100 * row['lax_spread']:.0f}"
            print(f"  {row['bytes_per_rank']:>10} {size:>10} {count:>11} {dtype:>8} {row['time_us']:>10.1f} {row['algbw']:>8.2f} "
                  f"{row['busbw']:>8.2f} {row['lax_time_us']:>10.1f} {row['lax_busbw']:>8.2f} "
                  f"{row['speedup']:>8.2f} {wrong:>7} {spreads:>9}"
                  + (f" {path:>9}" if auto else "")
                  + (f" {row['cb_time_us']:>9.1f}" if cb_fn else "")
                  + (f" {row['slope_us']:>7.1f} {row['lax_slope_us']:>7.1f} {row['slope_speedup']:>7.2f}"
                     if slope_k else "")
                  + (f" {row['tuned_chunk']:>9} {row['tuned_time_us']:>10.1f} {row['tuned_speedup']:>7.2f}"
                     if tuned else ""), flush=True)
            if tuned:
                print(_trial_log(tuned), flush=True)
            if stem:  # a run stopped by its time limit keeps the rows it measured
                _write(stem, meta, rows)
    staging = _staging_bytes() if devices[0].platform == "gpu" else None
    host_bytes = _host_bytes() if devices[0].platform == "gpu" else None
    if staging is not None:
        print(f"# staging memory of the executor: {staging / 2**20:.1f} MiB per rank "
              f"(limit: min(1% of device memory, 256 MiB))")
    if host_bytes is not None:
        print(f"# pinned host memory of the executor (host channel): {host_bytes / 2**20:.1f} MiB per rank")
    if stem:
        meta.update(staging_bytes=staging, host_bytes=host_bytes, complete=True)
        _write(stem, meta, rows)
        plot(stem + ".csv", stem + ".png", ceiling)
        print(f"# wrote {stem}.csv, .json and .png")
    return rows


def _write(stem: str, meta: dict, rows: list[dict]) -> None:
    """The run's rows so far as ``stem``.csv and ``stem``.json (each replaced whole, through a
    temporary file, so that a run killed mid-write leaves the previous row's files)."""
    with open(stem + ".csv.tmp", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with open(stem + ".json.tmp", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    os.replace(stem + ".csv.tmp", stem + ".csv")
    os.replace(stem + ".json.tmp", stem + ".json")


def plot(csv_path: str, png_path: str, ceiling_gbps: float | None = None) -> None:
    """Bus bandwidth and time against size, ours and psum's, per dtype, from a bench CSV; the
    measured link ceiling (GB/s) drawn in when given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    fig, (ax_bw, ax_t) = plt.subplots(1, 2, figsize=(12, 4.5))
    for dtype in sorted({r["dtype"] for r in rows}):
        rs = [r for r in rows if r["dtype"] == dtype]
        size = [int(r["size"]) for r in rs]
        ref = "lax" if "lax_busbw" in rs[0] else "psum"  # files written before the rename say psum
        for key, label, style in (("busbw", "jax_blink", "-o"), (f"{ref}_busbw", "lax", "--s")):
            ax_bw.plot(size, [float(r[key]) for r in rs], style, label=f"{label} {dtype}", ms=3)
        for key, label, style in (("time_us", "jax_blink", "-o"), (f"{ref}_time_us", "lax", "--s")):
            ax_t.plot(size, [float(r[key]) for r in rs], style, label=f"{label} {dtype}", ms=3)
    if ceiling_gbps:
        ax_bw.axhline(ceiling_gbps, color="gray", lw=1, ls=":")
        ax_bw.text(min(int(r["size"]) for r in rows), ceiling_gbps * 1.02,
                   f"measured NVLink ceiling {ceiling_gbps:g} GB/s", fontsize=8, color="gray")
    for ax, ylabel in ((ax_bw, "bus bandwidth (GB/s)"), (ax_t, "time per call (us)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes per rank")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax_t.set_yscale("log")
    fig.suptitle(os.path.basename(csv_path))
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def _collectives_arg(text: str) -> list[str]:
    """'all' or comma-separated names -> the collectives to run, all-reduce first."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if "all" in names:
        names = list(COLLECTIVES)
    unknown = [t for t in names if t not in COLLECTIVES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown collective {', '.join(unknown) or repr(text)}; "
                                         f"choose from {', '.join(COLLECTIVES)} or all")
    return sorted(dict.fromkeys(names), key=list(COLLECTIVES).index)


def _dtypes_arg(text: str) -> list[str]:
    """Comma-separated dtype names -> the dtypes to run, each once, in the order given."""
    names = [t.strip() for t in text.split(",")]
    if not all(names) or any(t not in DTYPES for t in names):
        wrong = [t for t in names if t not in DTYPES]
        raise argparse.ArgumentTypeError(
            f"got {text!r}" + (f" (unknown: {', '.join(map(repr, wrong))})" if any(wrong) else "")
            + f"; takes comma-separated dtypes from {', '.join(DTYPES)}")
    return list(dict.fromkeys(names))


def _kind_arg(text: str) -> str:
    """A device kind for the file name: letters, digits and ``._+-`` (it becomes part of a path)."""
    if not text or not all(c.isascii() and (c.isalnum() or c in "._+-") for c in text):
        raise argparse.ArgumentTypeError(f"got {text!r}; takes a name for the result files made of "
                                         "letters, digits and ._+- (e.g. nvidia-h200-x2)")
    return text


_MAX_CHAIN = 1000  # a program of K chained calls holds K calls: compile time grows with K


def build_parser() -> argparse.ArgumentParser:
    ap = _cli.Parser(prog=PROG, description="jax_blink's collectives against XLA's (lax), side by side, "
                     "nccl-tests style: time, algbw and busbw per size, every result checked against lax. "
                     "Sizes are bytes per rank.",
                     epilog=f"example: {PROG} -b 1K -e 16M -d float32 -c all -o results")
    ap.add_argument("-b", "--begin", default=1 << 10, type=_cli.byte_count, metavar="BYTES",
                    help="smallest size, bytes per rank (65536, 512K, 16M, 1G; default 1K)")
    ap.add_argument("-e", "--end", default=4 << 20, type=_cli.byte_count, metavar="BYTES",
                    help="largest size, bytes per rank, >= --begin (default 4M)")
    ap.add_argument("-f", "--factor", type=_cli.whole_number(2), default=4,
                    help="each size is the previous one times this, >= 2 (default 4)")
    ap.add_argument("-d", "--dtype", default=["float32"], type=_dtypes_arg, metavar="DTYPES",
                    help=f"comma-separated dtypes from {', '.join(DTYPES)} (default float32; "
                         "float64 and int64 need JAX_ENABLE_X64=1)")
    ap.add_argument("-k", "--chain", type=_cli.whole_number(1, _MAX_CHAIN), default=20, metavar="K",
                    help=f"chained calls per program, 1 to {_MAX_CHAIN} (default 20)")
    ap.add_argument("-r", "--runs", type=_cli.whole_number(1, 1000), default=5,
                    help="timed runs per size, at least; 1 to 1000 (default 5)")
    ap.add_argument("--min-time", type=_cli.number(0, unit=" seconds"), default=0.2, metavar="S",
                    help="more runs (up to 200) until each variant has run S seconds per size (default 0.2)")
    ap.add_argument("-o", "--out", default=None, metavar="DIR",
                    type=lambda t: _cli.output_folder("-o/--out", t),
                    help="folder for the CSV/JSON table and its plot (made if missing)")
    ap.add_argument("--kind", default=None, type=_kind_arg,
                    help="device kind for the file names (default: platform-NxKIND)")
    ap.add_argument("--ceiling", type=_cli.number(0, above=True, unit=" GB/s"), default=None, metavar="GBPS",
                    help="measured link ceiling in GB/s, drawn into the plot (2 x H200: 364)")
    ap.add_argument("--plot-only", default=None, metavar="CSV",
                    type=lambda t: _cli.input_file("--plot-only", t, suffix=".csv"),
                    help="only draw the plot of an earlier run's CSV (beside it, .png); takes no "
                         "option of a run but --ceiling")
    ap.add_argument("-c", "--collective", default=["allreduce"], type=_collectives_arg, metavar="NAMES",
                    help="comma-separated collectives, or 'all' (all-reduce first, then "
                         f"{', '.join(c for c in COLLECTIVES if c != 'allreduce')}); default allreduce")
    ap.add_argument("--command-buffers", action="store_true",
                    help="also time the handler that XLA may capture in CUDA graphs (column cb; GPUs only)")
    ap.add_argument("--slope", type=_cli.whole_number(2, _MAX_CHAIN), default=None, metavar="K2",
                    help="also time K2 chained calls (K2 > K) and report the marginal time per call, "
                         "(t(K2) - t(K)) / (K2 - K), for ours and lax (columns slope, l.slope)")
    ap.add_argument("--dispatch", default="blink", choices=DISPATCH_MODES,
                    help="blink (default): time the executor itself, what dispatch entries are derived from; "
                         "auto: time what dispatch=\"auto\" runs here (this machine's entry, or the meanwhile "
                         "rule) and name the path per size (column 'auto ran')")
    ap.add_argument("--tune-chunks", action="store_true",
                    help="also tune the chunk per size (MIAD, jax_blink.tools.autotune; stored for "
                         "JAX_BLINK_CHUNK_BYTES=auto) and time ours at it (columns tuned_chunk, "
                         "tuned_time_us, tuned_speedup)")
    return ap


_RUN_OPTIONS = {"begin": "-b/--begin", "end": "-e/--end", "factor": "-f/--factor", "dtype": "-d/--dtype",
                "chain": "-k/--chain", "runs": "-r/--runs", "min_time": "--min-time", "out": "-o/--out",
                "kind": "--kind", "collective": "-c/--collective", "command_buffers": "--command-buffers",
                "slope": "--slope", "tune_chunks": "--tune-chunks", "dispatch": "--dispatch"}
_PLOT_COLUMNS = ("size", "dtype", "busbw", "time_us")


def _check_plot_only(a: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    given = [opt for dest, opt in _RUN_OPTIONS.items() if getattr(a, dest) != ap.get_default(dest)]
    if given:
        raise _cli.UsageError(f"argument --plot-only: draws an earlier run's CSV and takes no option of a "
                              f"run (got {', '.join(given)}); only --ceiling goes with it")
    with open(a.plot_only, newline="") as f:
        reader = csv.DictReader(f)
        columns, first = reader.fieldnames or [], next(reader, None)
    ref = "lax" if "lax_busbw" in columns else "psum"  # files written before the rename say psum
    missing = [c for c in _PLOT_COLUMNS + (f"{ref}_busbw", f"{ref}_time_us") if c not in columns]
    if missing or first is None:
        why = f"this one lacks the columns {', '.join(missing)}" if missing else "this one has no rows"
        raise _cli.bad("--plot-only", a.plot_only, f"takes a CSV written by {PROG} -o DIR ({why})")
    png = a.plot_only[:-4] + ".png"
    _cli.picture_path("--plot-only", png)


def _check_run(a: argparse.Namespace) -> None:
    """The checks that take several options, or the devices, before anything runs."""
    if a.begin > a.end:
        raise _cli.bad("-b/--begin", _fmt_bytes(a.begin), f"takes a size <= -e/--end ({_fmt_bytes(a.end)})")
    if a.out is None:  # options that only shape the files: without -o they would do nothing
        for option, value in (("--kind", a.kind), ("--ceiling", a.ceiling)):
            if value is not None:
                raise _cli.UsageError(f"argument {option}: goes into the files that -o/--out writes "
                                      f"(or, for --ceiling, the plot of --plot-only); give -o DIR too")
    if a.slope is not None and a.slope <= a.chain:
        raise _cli.bad("--slope", a.slope, f"takes a chain longer than -k/--chain ({a.chain})")
    wide = [d for d in a.dtype if d in _X64_DTYPES]
    if wide and not jax.config.jax_enable_x64:
        raise _cli.bad("-d/--dtype", ",".join(a.dtype),
                       f"{', '.join(wide)} needs JAX's 64-bit mode: run with JAX_ENABLE_X64=1 "
                       "(else JAX makes them 32-bit)")
    devices = jax.devices()
    if a.command_buffers and devices[0].platform != "gpu":
        raise _cli.UsageError(f"argument --command-buffers: CUDA graphs exist on GPUs only; these devices "
                              f"are {devices[0].platform}")
    # The largest size of the run must fit: ours, lax's, the check's copies of input and output.
    n, largest = len(devices), sizes(a.begin, a.end, a.factor)[-1]
    per_rank = max(
        count * jnp.dtype(d).itemsize * (4 + 4 * COLLECTIVES[c].size_factor(n))
        + (count * 4 * (1 + 4 * COLLECTIVES[c].size_factor(n)) if devices[0].platform == "cpu" else 0)
        for d in a.dtype for c in a.collective
        for count in [max(1, largest // jnp.dtype(d).itemsize)])
    needed = per_rank * n if devices[0].platform == "cpu" else per_rank
    _cli.check_fits("-e/--end", largest, devices, needed)
    rows = len(sizes(a.begin, a.end, a.factor)) * len(a.dtype) * len(a.collective)
    where = "all devices together (host memory)" if devices[0].platform == "cpu" else "per device"
    print(f"# this run: {rows} row(s) ({len(sizes(a.begin, a.end, a.factor))} sizes {_fmt_bytes(a.begin)} to "
          f"{_fmt_bytes(largest)} bytes per rank x {len(a.dtype)} dtype(s) x {len(a.collective)} collective(s)) "
          f"on {n} x {devices[0].device_kind}; about {_cli.format_bytes(needed)} of memory {where} at the largest size; "
          f"each row compiles ours and lax{' (twice with --slope)' if a.slope else ''} and runs each for at "
          f"least {a.min_time:g} s", flush=True)


def main(argv=None) -> int:
    """Run the bench from the command line; return the exit status (0 ok, 1 wrong results, 2 bad input)."""
    _cli.ensure_host_devices()  # on a machine without GPUs: 8 CPU host devices, as python -m jax_blink
    ap = build_parser()

    def body() -> int:
        a = ap.parse_args(argv)
        if a.plot_only:
            _check_plot_only(a, ap)
            plot(a.plot_only, a.plot_only[:-4] + ".png", a.ceiling)
            print(f"# drew {a.plot_only[:-4]}.png")
            return 0
        _check_run(a)
        wrong = 0
        for collective in a.collective:  # one table (and one set of files) per collective
            rows = run(a.begin, a.end, a.factor, a.dtype, a.chain,
                       a.runs, a.out, a.kind, a.command_buffers, a.ceiling, collective, a.slope,
                       a.tune_chunks, a.min_time, a.dispatch)
            wrong += sum(r["wrong"] for r in rows)
        return 1 if wrong else 0

    # Only the checks' errors are usage errors: a failure while measuring keeps its traceback.
    return _cli.run_main(PROG, body, usage_errors=(_cli.UsageError,))


if __name__ == "__main__":
    sys.exit(main())
