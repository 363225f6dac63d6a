"""The command line and the files of the settings sweeps (twoshot_sweep.py, ce_sweep.py): sizes,
``--config NAME:VAR=VALUE,...`` settings, the chain and rounds; a Markdown table and its rows as
JSON in ``--out``; with ``--profile DIR`` one traced program per size and variant; exit 1 when a
result differed from psum's."""
from __future__ import annotations

import argparse
import json
import os
import time


def size_label(nbytes: int) -> str:
    """``67108864`` -> ``"64 MiB"``, ``65536`` -> ``"64 KiB"`` (the tables' size column)."""
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def parse_config(text: str) -> tuple[str, dict[str, str]]:
    """``NAME:VAR=VALUE,VAR=VALUE`` (an empty list: the defaults) -> (name, variables)."""
    name, sep, rest = text.partition(":")
    if not sep or not name:
        raise ValueError(f"--config {text!r}: write NAME:VAR=VALUE,... (e.g. pull:JAX_BLINK_TWOSHOT_MODE=pull)")
    env = {}
    for item in filter(None, rest.split(",")):
        var, eq, value = item.partition("=")
        if not eq or not var.startswith("JAX_BLINK_"):
            raise ValueError(f"--config {text!r}: {item!r} is not JAX_BLINK_NAME=VALUE")
        env[var] = value
    return name, env


def main(argv, *, description: str, script: str, run, table, default_configs, default_sizes: str,
         min_bytes: int, sizes_note: str, out_default: str) -> int:
    """Parse ``argv``, ``run(sizes, configs, chain, runs)`` -> rows, print and write ``table(rows)``."""
    from jax_blink.tools import arguments as cli

    def sizes_list(text: str) -> list[int]:
        sizes = [cli.byte_count(s) for s in text.split(",") if s.strip()]
        if not sizes or any(b < min_bytes or b % 16 for b in sizes):
            raise argparse.ArgumentTypeError(f"got {text!r}; takes {sizes_note}, comma-separated")
        return sizes

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--sizes", default=default_sizes, type=sizes_list, help="bytes per rank, comma-separated")
    ap.add_argument("--config", action="append", default=None, help="NAME:VAR=VALUE,... (repeatable)")
    ap.add_argument("--chain", type=cli.whole_number(1, 1000), default=20, help="chained calls per program")
    ap.add_argument("--runs", type=cli.whole_number(1, 1000), default=8,
                    help="rounds at least (more until 0.5 s per variant)")
    ap.add_argument("--out", default=out_default, help="folder for sweep.md and sweep.json")
    ap.add_argument("--profile", metavar="DIR", help="after the timing, trace one program of each size and variant "
                    "(jax.profiler) under DIR and print how its peer copies ran (jax_blink.tools.trace_copies)")
    args = ap.parse_args(argv)
    try:
        configs = [parse_config(c) for c in (args.config or default_configs)]
    except ValueError as e:
        ap.error(str(e))
    if args.profile:  # before minutes of timing, not after them
        try:
            os.makedirs(args.profile, exist_ok=True)
        except OSError as e:
            ap.error(f"--profile {args.profile!r}: cannot make that folder ({e.strerror})")
    rows = run(args.sizes, configs, args.chain, args.runs, profile=args.profile)
    import jax

    head = (f"# benchmarks/{script}, {len(jax.devices())} x {jax.devices()[0].device_kind}, jax {jax.__version__}, "
            f"{time.strftime('%Y-%m-%d')}, float32, {args.chain} chained calls, measured")
    text = head + "\n\n" + table(rows)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sweep.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0 if all(r["rel_diff"] < 1e-5 for r in rows) else 1


def against_psum(mesh, sizes: list[int], k: int, runs: int, variants, *, name_key: str = "config",
                 observe=None, profile: str | None = None) -> list[dict]:
    """Per size, on fresh float32 data (one operand per rank): psum's result, then every variant of
    ``variants()`` (``(name, env, fn)``, ``fn`` a chained program) run once while ``env`` is set,
    so that its call sites are set up with it, and compared with psum's (largest difference
    relative to psum's largest value); then psum and all variants taking turns
    (``jax_blink.tools.timing.interleaved_times``, 0.5 s per variant at least). ``observe()``,
    called before a variant's first run, returns a function whose dict, called after it, joins the
    variant's row (e.g. the kernels its sites took). With ``profile`` (a folder), after the timing
    each variant's program runs once more under ``jax.profiler.trace(profile/<size>/<name>)`` and
    its row gains ``profile``: the trace's path and :func:`jax_blink.tools.trace_copies.summarize`
    of it. One row per size and variant."""
    import statistics

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_blink
    from jax_blink.tools.timing import COLLECTIVES, chained, interleaved_times, spread
    from collective_checks import environment

    n = mesh.devices.size
    coll = COLLECTIVES["allreduce"]
    psum_fn = chained(coll.chain(coll.ref), mesh, mesh.axis_names[0], k)
    rows = []
    rng = np.random.default_rng(0)
    for nbytes in sizes:
        x = jax.device_put(jnp.asarray(rng.standard_normal(n * (nbytes // 4), dtype=np.float32)),
                           NamedSharding(mesh, P(mesh.axis_names[0])))
        ref = psum_fn(x)
        scale = float(jnp.max(jnp.abs(ref)))
        fns, meta = [], []
        for name, env, fn in variants():
            seen = observe() if observe else (lambda: {})
            with environment(env):
                got = fn(x)  # the sites are set up here, with this variant's variables
                got.block_until_ready()
            jax_blink.check()
            rel = float(jnp.max(jnp.abs(got - ref))) / scale
            del got
            fns.append(fn)
            meta.append((name, env, seen(), rel))
        t0 = time.time()
        timed = interleaved_times([psum_fn] + fns, x, runs, 0.5)
        jax_blink.check()
        t_psum = statistics.median(timed[0]) / k
        bus = nbytes * 2 * (n - 1) / n / 1e9
        for (name, env, extra, rel), fn, times in zip(meta, fns, timed[1:]):
            t = statistics.median(times) / k
            rows.append({"bytes_per_rank": nbytes, "n": n, name_key: name, "env": env, **extra, "time_us": t * 1e6,
                         "psum_time_us": t_psum * 1e6, "speedup": t_psum / t, "busbw": bus / t,
                         "psum_busbw": bus / t_psum, "spread": spread(times), "psum_spread": spread(timed[0]),
                         "rel_diff": rel, "runs": len(times)})
            if profile:
                rows[-1]["profile"] = _profiled(fn, x, os.path.join(profile, size_label(nbytes).replace(" ", ""), name))
            said = "".join(f", {key} {value}" for key, value in extra.items())
            print(f"{size_label(nbytes)} x {n} {name}: {t * 1e6:.1f} us, psum {t_psum * 1e6:.1f} us, "
                  f"{t_psum / t:.3f}x, {bus / t:.1f} GB/s busbw (psum {bus / t_psum:.1f}){said}, "
                  f"rel. difference {rel:.1e}", flush=True)
        print(f"# {size_label(nbytes)}: {len(timed[0])} rounds in {time.time() - t0:.0f} s", flush=True)
        del x, ref
    return rows


def _profiled(fn, x, folder: str) -> dict:
    """One run of ``fn(x)`` under ``jax.profiler.trace(folder)``: the trace's path and how its peer
    copies ran (printed too); ``{"trace": None}`` where the profiler wrote no trace."""
    from pathlib import Path

    import jax
    from jax_blink.tools import trace_copies, trace_overlap

    with jax.profiler.trace(folder):
        fn(x).block_until_ready()
    traces = sorted(Path(folder).rglob("*.trace.json.gz"))
    if not traces:
        print(f"# profile: no trace file under {folder}", flush=True)
        return {"trace": None}
    summary = trace_copies.summarize(trace_overlap.load(traces[-1]))
    print(f"# profile {folder} ({traces[-1].name}):\n" + trace_copies.describe(summary), flush=True)
    return {"trace": str(traces[-1]), **summary}
