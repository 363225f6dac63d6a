"""``jax-blink tune``: measure this machine and store its dispatch entries in the user's cache.

The bench's interleaved method (:func:`jax_blink.tools.bench.run`: ours forced to the executor
against ``lax``, per size, in turns) for all-reduce, all-gather and reduce-scatter in float32 and
bfloat16, over a quick size range by default (``--full`` for 1 KiB to 1 GiB); the crossover
ranges are derived with the rule of the shipped table (:func:`jax_blink.tools.derive.derive_all`)
and stored, keyed by this machine (device model, count, links, layout, jax and NCCL versions:
:class:`jax_blink.lowering.machine.MachineKey`), in ``dispatch.json`` of the cache folder
(:mod:`jax_blink.lowering.dispatch_cache`), the bench files beside it in ``bench/``. From then on
``dispatch="auto"`` follows these entries on this machine, before the shipped table.

    jax-blink tune                 # quick: 1K to 16M, about 3 minutes on 4 GPUs
    jax-blink tune --full          # 1K to 1G
    jax-blink tune --dry-run       # measure and print the entries, store nothing
    jax-blink tune --show          # the cache's entries, this machine's marked
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import os
import shutil
import sys
import tempfile

from jax_blink.tools import arguments as _cli

PROG = "jax-blink tune"
#: The collectives tuned by default: those a training step calls most.
DEFAULT_COLLECTIVES = ("allreduce", "allgather", "reducescatter")
DEFAULT_DTYPES = ("float32", "bfloat16")
QUICK_END = 16 << 20
FULL_END = 1 << 30


def _describe(c) -> str:
    from jax_blink.lowering.decision import LAX_NAME
    from jax_blink.lowering.dispatch_table import at_ranges

    which = f" in {c.dtype}" if c.dtype else ""
    if not c.lax_ranges:
        return f"{c.collective}{which}: the executor at every size"
    return f"{c.collective}{which}: {LAX_NAME[c.collective]} {at_ranges(c.lax_ranges)}, the executor elsewhere"


def show(folder: str | None, say=print) -> int:
    """``--show``: every entry of the cache, grouped by machine, this machine's marked."""
    import jax

    from jax_blink.lowering import dispatch_cache
    from jax_blink.lowering.machine import MachineKey, this_machine

    path = dispatch_cache.cache_file(folder)
    found = dispatch_cache.entries(folder)
    devices = jax.devices()
    here = this_machine(devices[0].device_kind, len(devices))
    say(f"# dispatch entries in {path}: {len(found)}" + ("" if found else f" (none yet: {PROG} measures this machine)"))
    say(f"# this machine: {here.describe(versions=True)}")
    machines: dict[MachineKey, list] = {}
    for c in found:
        machines.setdefault(MachineKey(c.device_kind, c.ranks, c.links, c.layout, c.jax, c.nccl), []).append(c)
    for key, entries in machines.items():
        mark = "  <- this machine" if dispatch_cache.matches(entries[0], here) else ""
        say(f"{key.describe(versions=True)}{mark}")
        for c in entries:
            say(f"  {_describe(c)} (from {', '.join(c.sources)})")
    return 0


def tune(begin: int, end: int, factor: int, dtypes: list[str], collectives: list[str], runs: int,
         min_seconds: float, folder: str | None, dry_run: bool, say=print) -> list:
    """Measure this machine, derive its entries and (unless ``dry_run``) store them in the cache
    folder ``folder`` (None: :func:`jax_blink.lowering.dispatch_cache.cache_dir`). Returns the
    entries derived."""
    import jax

    from jax_blink.lowering import dispatch_cache
    from jax_blink.lowering.machine import this_machine
    from jax_blink.tools import bench, derive

    devices = jax.devices()
    key = this_machine(devices[0].device_kind, len(devices))
    cache = dispatch_cache.cache_dir(folder)
    say(f"# {PROG}: {key.describe(versions=True)}; {', '.join(collectives)} in {', '.join(dtypes)}, "
        f"{bench._fmt_bytes(begin)} to {bench._fmt_bytes(end)} bytes per rank (x{factor}); "
        + ("dry run: nothing is stored" if dry_run else f"entries go to {dispatch_cache.cache_file(folder)}"))
    stamp = _dt.datetime.now().strftime("%H%M%S")
    tag = "".join(ch if ch.isalnum() or ch in "._+-" else "_" for ch in
                  f"tune-{key.ranks}x{key.device_kind}-jax{key.jax}-{stamp}")
    work = tempfile.mkdtemp(prefix="jax_blink_tune_")
    try:
        for collective in collectives:
            bench.run(begin, end, factor, dtypes, 20, runs, work, tag, collective=collective,
                      min_seconds=min_seconds)
        names = sorted(f for f in os.listdir(work) if f.endswith(".json"))
        root = work if dry_run else cache
        if not dry_run:
            os.makedirs(os.path.join(cache, dispatch_cache.BENCH_FOLDER), exist_ok=True)
            for name in names:  # the evidence beside the entries (the CSV and plot too)
                for ext in (".json", ".csv", ".png"):
                    src = os.path.join(work, name[:-5] + ext)
                    if os.path.exists(src):
                        shutil.copy2(src, os.path.join(cache, dispatch_cache.BENCH_FOLDER, name[:-5] + ext))
        sources = [os.path.join(dispatch_cache.BENCH_FOLDER, n) if not dry_run else n for n in names]
        entries = [dataclasses.replace(c, jax=key.jax, nccl=key.nccl) for c in derive.derive_all(sources, root)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    say(f"# derived {len(entries)} entr{'y' if len(entries) == 1 else 'ies'} (lax only where it won every dtype "
        f"by {100 * (1 - derive.lax_wins_below(key.device_kind)):.0f}% or more; a dtype's own entry where its rows differ):")
    for c in entries:
        say(f"  {_describe(c)}")
    if dry_run:
        say("# dry run: nothing stored")
        return entries
    path, replaced = dispatch_cache.store(entries, folder)
    say(f"# stored in {path}" + (f", in place of {len(replaced)} older entr{'y' if len(replaced) == 1 else 'ies'}"
                                  if replaced else "") + f"; bench files in {os.path.join(cache, dispatch_cache.BENCH_FOLDER)}")
    default = dispatch_cache.cache_dir()
    if cache != default:
        say(f"# dispatch=\"auto\" reads {default}: set JAX_BLINK_DISPATCH_CACHE={cache} for it to read these")
    else:
        say(f"# dispatch=\"auto\" follows these entries on this machine from now on ({PROG} --show lists them)")
    return entries


def build_parser() -> argparse.ArgumentParser:
    from jax_blink.tools import bench

    ap = _cli.Parser(prog=PROG, description="Measure this machine (jax_blink's executor against lax, in turns, "
                     "per size) and store its dispatch entries in the user's cache, which dispatch=\"auto\" "
                     "follows from then on. Sizes are bytes per rank.",
                     epilog=f"examples: {PROG}  |  {PROG} --full  |  {PROG} --dry-run  |  {PROG} --show")
    ap.add_argument("-b", "--begin", default=1 << 10, type=_cli.byte_count, metavar="BYTES",
                    help="smallest size, bytes per rank (default 1K)")
    ap.add_argument("-e", "--end", default=None, type=_cli.byte_count, metavar="BYTES",
                    help=f"largest size, bytes per rank (default {bench._fmt_bytes(QUICK_END)}; --full: 1G)")
    ap.add_argument("--full", action="store_true", help="sizes up to 1G (longer: large sizes run for seconds)")
    ap.add_argument("-f", "--factor", type=_cli.whole_number(2), default=4,
                    help="each size is the previous one times this, >= 2 (default 4)")
    ap.add_argument("-d", "--dtype", default=list(DEFAULT_DTYPES), type=bench._dtypes_arg, metavar="DTYPES",
                    help=f"comma-separated dtypes (default {','.join(DEFAULT_DTYPES)})")
    ap.add_argument("-c", "--collective", default=list(DEFAULT_COLLECTIVES), type=bench._collectives_arg,
                    metavar="NAMES", help=f"comma-separated collectives or 'all' (default {','.join(DEFAULT_COLLECTIVES)})")
    ap.add_argument("-r", "--runs", type=_cli.whole_number(1, 1000), default=5,
                    help="timed runs per size, at least (default 5)")
    ap.add_argument("--min-time", type=_cli.number(0, unit=" seconds"), default=0.2, metavar="S",
                    help="more runs until each variant has run S seconds per size (default 0.2)")
    ap.add_argument("--cache", default=None, metavar="DIR", type=lambda t: _cli.output_folder("--cache", t),
                    help="the cache folder (default $JAX_BLINK_DISPATCH_CACHE, else $XDG_CACHE_HOME/jax_blink, "
                         "else ~/.cache/jax_blink)")
    ap.add_argument("--dry-run", action="store_true", help="measure and print the entries; store nothing")
    ap.add_argument("--show", action="store_true", help="list the cache's entries (this machine's marked); "
                                                        "measures nothing")
    return ap


def main(argv=None) -> int:
    """Run ``jax-blink tune``; the exit status (0 ok, 1 wrong results in a run, 2 bad input)."""
    _cli.ensure_host_devices()
    ap = build_parser()

    def body() -> int:
        import jax

        from jax_blink.tools import bench

        a = ap.parse_args(argv)
        if a.show:
            given = [o for o, v in (("--full", a.full), ("--dry-run", a.dry_run), ("-e/--end", a.end is not None))
                     if v]
            if given:
                raise _cli.UsageError(f"argument --show: lists the cache and measures nothing (got {', '.join(given)})")
            return show(a.cache)
        if a.full and a.end is not None:
            raise _cli.UsageError("argument --full: sets the largest size to 1G; give -e/--end or --full, not both")
        a.end = FULL_END if a.full else (a.end if a.end is not None else QUICK_END)
        if len(jax.devices()) < 2:
            raise _cli.UsageError(f"{PROG} needs at least 2 devices; this process sees {len(jax.devices())} "
                                  f"{jax.devices()[0].platform} device")
        check = argparse.Namespace(begin=a.begin, end=a.end, factor=a.factor, dtype=a.dtype, collective=a.collective,
                                   out=".", kind=None, ceiling=None, slope=None, chain=20,
                                   command_buffers=False, min_time=a.min_time)
        bench._check_run(check)
        try:
            tune(a.begin, a.end, a.factor, a.dtype, a.collective, a.runs, a.min_time, a.cache, a.dry_run)
        except ValueError as e:  # a run with wrong results derives nothing
            print(f"{PROG}: {e}", file=sys.stderr)
            return 1
        return 0

    return _cli.run_main(PROG, body, usage_errors=(_cli.UsageError,))


if __name__ == "__main__":
    sys.exit(main())
