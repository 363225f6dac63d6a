"""``python -m jax_blink.tools.train``: data-parallel training of a ResNet-18 or GPT-2 shaped model on
synthetic data, with its gradients summed by ``lax.psum`` or by jax_blink, and what the
collectives cost.

    python -m jax_blink.tools.train --model resnet|gpt2 --collective psum|blink|switch --steps N --size tiny|small|full

prints the bucket layout, ``step <n> loss <value>`` for every step, then the step time of psum and
of jax_blink (the ``--collective`` mode, ``blink`` when that is psum) and the share of the step
spent in collectives: (t(step) - t(the same step with the all-reduce taken out)) / t(step), the
compiled steps timed in turns from the same state and batch (median of ``--timing-runs``), each
timed run ``--chain`` steps in a row, each step fed the previous one's state and dispatched without
waiting for it, as a training loop runs them (the host's dispatch of one step then hides behind the
GPUs' work on the one before, and what is timed is the GPUs' step).
The results go to ``--out`` (default ``jax_blink_results`` in the current folder, made if
missing; the run says where it wrote) as ``train-<model>-<size>-<device kind>-x<devices>-<date>.{json,txt}``.

Without a GPU the devices are CPU host devices (8 unless ``--host-devices`` or ``XLA_FLAGS`` says
otherwise). Bad flags end with one line naming the flag on stderr and exit status 2, before any work.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import re
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from jax_blink.tools.arguments import Parser, UsageError as _ToolUsageError, ensure_host_devices, output_folder
from jax_blink.tools.train.check import UPDATE_RTOL, check_against_psum
from jax_blink.tools.train.modes import (BASELINES, LAST_BUCKET_VARIANTS, PACKING_VARIANTS, LABELS, MODES,
                                          OVERLAP_HOLD, SITE_ENVIRONMENT, SWITCH_HOLD_VARIANTS, SWITCH_OVERLAP,
                                          TREE_MODES, overlapped_modes)

PROG = "python -m jax_blink.tools.train"
#: Where results go without --out: a folder of the current folder, named for what made it.
DEFAULT_OUT = "jax_blink_results"
COLLECTIVES = ("psum", "blink", "overlap", "switch")
SIZE_NAMES = ("tiny", "small", "full", "medium")
#: Flags that override a field of the size's config, and the models that have the field.
FIELDS = {"layers": ("gpt2",), "blocks": ("resnet",), "depth": ("resnet",), "width": ("resnet", "gpt2"), "heads": ("gpt2",),
          "vocab": ("gpt2",), "seq_len": ("gpt2",), "image_size": ("resnet",), "classes": ("resnet",),
          "batch": ("resnet", "gpt2")}


class UsageError(Exception):
    """Bad command-line input: one line on stderr, exit status 2."""


class _Parser(Parser):
    """The tools' parser (values may start with ``-``), its errors this tool's :class:`UsageError`."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")


def _positive_int(flag: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes a whole number, got {text!r}") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be >= 1, got {v}")
        return v
    return parse


def _positive_float(flag: str):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes a number, got {text!r}") from None
        if not v > 0 or v == float("inf"):
            raise argparse.ArgumentTypeError(f"{flag} must be a finite number > 0, got {text}")
        return v
    return parse


def _mode_list(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in MODES]
    if not names or unknown:
        what = f"no mode {', '.join(unknown)}" if unknown else f"no mode named in {text!r}"
        raise argparse.ArgumentTypeError(f"{what}; --modes takes a comma-separated list of modes ({', '.join(MODES)})")
    return names


def timed_modes(collective: str, dispatch: str, model: str, hold: str = "recent",
                asked: Sequence[str] | None = None) -> list[str]:
    """The modes a run times, in the order they take turns: psum, ours (and the overlapped modes
    that ``hold`` names; for the switch, its variants), then the baselines (``none``,
    ``none-barrier``); ``asked`` keeps only those named (with psum and the baselines) and adds
    the variants it names (the switch's site variants, the tree's psum). UsageError for a mode
    the collective does not time."""
    ours = {"psum": "blink", "overlap": "blink"}.get(collective, collective)
    if ours == "blink":
        held = overlapped_modes(hold)
        variants = [m for m in OVERLAP_HOLD if m not in held]  # the other holds and variants: when asked
        modes = ["psum", "blink", *held, *variants, "psum-tree", *BASELINES]
    else:
        modes = ["psum", "switch"] + (["switch-auto"] if dispatch != "auto" else []) + (
            ["switch-sparse"] if model == "gpt2" else []) + ["switch-late", "switch-sync", *SWITCH_HOLD_VARIANTS,
                                                             *SITE_ENVIRONMENT,
                                                             *(m for m in (*PACKING_VARIANTS, *LAST_BUCKET_VARIANTS)
                                                               if m in SWITCH_OVERLAP),
                                                             *TREE_MODES, *BASELINES]
        modes = list(dict.fromkeys(modes))  # a mode both a site variant and a tree mode, once
    if asked is None:  # the variants are timed when asked for
        return [m for m in modes if m not in SITE_ENVIRONMENT and m not in TREE_MODES and m not in PACKING_VARIANTS
                and m not in LAST_BUCKET_VARIANTS and m not in SWITCH_HOLD_VARIANTS
                and (m not in OVERLAP_HOLD or m in overlapped_modes(hold))]
    wrong = [m for m in asked if m not in modes]
    if wrong:
        raise UsageError(f"--modes {','.join(asked)}: --collective {collective} does not time {', '.join(wrong)} "
                         f"(it times {', '.join(modes)})")
    return [m for m in modes if m in asked or m == "psum" or m in BASELINES]


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, choices=("resnet", "gpt2"))
    p.add_argument("--collective", default="blink", choices=COLLECTIVES,
                   help="what sums the gradients: lax.psum, jax_blink.all_reduce written into the step, "
                        "or the psum step under jax_blink's switch (default blink)")
    p.add_argument("--steps", type=_positive_int("--steps"), default=10)
    p.add_argument("--size", default="tiny", choices=SIZE_NAMES,
                   help="tiny (CPU), small, full (ResNet-18 on 224x224, GPT-2 small), medium (ResNet-50, GPT-2 medium); "
                        "default tiny")
    g = p.add_argument_group("model shape (override the size's values)")
    g.add_argument("--layers", type=_positive_int("--layers"), help="GPT-2 blocks")
    g.add_argument("--blocks", type=_positive_int("--blocks"), help="ResNet basic blocks per stage (ResNet-18: 2)")
    g.add_argument("--depth", type=int, choices=(18, 50), help="ResNet depth (18: basic blocks; 50: bottleneck)")
    g.add_argument("--width", type=_positive_int("--width"), help="GPT-2 embedding width; ResNet channels of stage 1")
    g.add_argument("--heads", type=_positive_int("--heads"), help="GPT-2 attention heads")
    g.add_argument("--vocab", type=_positive_int("--vocab"), help="GPT-2 vocabulary")
    g.add_argument("--seq-len", type=_positive_int("--seq-len"), help="GPT-2 tokens per sequence")
    g.add_argument("--image-size", type=_positive_int("--image-size"), help="ResNet image side")
    g.add_argument("--classes", type=_positive_int("--classes"), help="ResNet classes")
    g.add_argument("--batch", type=_positive_int("--batch"), help="examples per device and step")
    p.add_argument("--bucket-mb", type=_positive_float("--bucket-mb"), default=25.0,
                   help="gradient bucket cap in MiB (DDP's bucket_cap_mb; default 25)")
    p.add_argument("--first-bucket-mb", type=_positive_float("--first-bucket-mb"), default=1.0,
                   help="cap of the first bucket in MiB (DDP: 1)")
    p.add_argument("--large-leaf-alone", action="store_true",
                   help="a gradient leaf of at least the bucket cap gets a bucket of its own, the open "
                        "bucket closed before it (DDP adds it to the open bucket: GPT-2's tied embedding "
                        "then holds back the first block's gradients)")
    p.add_argument("--last-bucket-pieces", type=_positive_int("--last-bucket-pieces"), default=1,
                   help="the last bucket (the backward pass's last gradients) cut into this many buckets of "
                        "consecutive leaves (default 1, DDP's; on ResNet-50 a call holding that bucket whole "
                        "splits XLA's fusions of the residual additions with BatchNorm's reductions, but 16 "
                        "pieces made its step slower on 2 x H200); "
                        "under the switch its last bucket too (switch_last_bucket_pieces), the psum of the "
                        "tree's included. The modes switch-last16, switch-tree-last16 and overlap-last16 "
                        "take 16 whatever this says, to time the cut beside their base mode in one run")
    p.add_argument("--lr", type=_positive_float("--lr"), help="learning rate (default 0.1 SGD for resnet, 1e-3 AdamW for gpt2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--devices", type=_positive_int("--devices"),
                   help="devices on the data axis (default: all of the default backend)")
    p.add_argument("--host-devices", type=_positive_int("--host-devices"), default=8,
                   help="CPU host devices to ask XLA for when there is no GPU (default 8)")
    p.add_argument("--dispatch", default="blink", choices=("blink", "auto"),
                   help="jax_blink's dispatch while the step is traced: blink (default) always runs the "
                        "executor; auto sends sizes where psum was measured faster to psum")
    p.add_argument("--hold", default="recent", choices=("recent", "all", "none", "weights", "both"),
                   help="which values wait for each overlapped start (value_and_grad_overlapped's hold): "
                        "recent (default), all, none, weights, or both (times recent and all side by side); "
                        "--modes overlap,overlap-none,overlap-weights times recent against none and weights")
    p.add_argument("--timing-runs", type=int, default=10,
                   help="timed runs of each step for the step times (0: no timing; default 10)")
    p.add_argument("--chain", type=_positive_int("--chain"), default=4,
                   help="steps in a row per timed run, each fed the previous step's state without waiting "
                        "for it, as a training loop runs them; the time per step is the run's / chain "
                        "(default 4; 1 times each step alone, the host's dispatch included)")
    p.add_argument("--stream", type=_positive_int("--stream"),
                   help="experimental, GPU: run each bucket's jax_blink all-reduce as an asynchronous call "
                        "on XLA stream N (jax's compute_on gpu_stream:N), so that it may overlap compute "
                        "(docs/overlap.md)")
    p.add_argument("--modes", type=_mode_list, default=None, metavar="LIST",
                   help="comma-separated modes to time, of those --collective times (psum, none and "
                        "none-barrier are always timed: the ratios and the exposed time need them); with --collective switch "
                        "also switch-ce and switch-8blocks (the overlapped all-reduce on copy engines, or on "
                        "8 blocks, on GPUs), switch-tree and its variants switch-tree-8blocks, switch-tree-twoshot "
                        "(the two-shot kernel from 1 MiB) and switch-tree-sync (not overlapped), and the "
                        "*-kpack and *-fused modes (buckets packed by the copy kernel, or by XLA's concatenation with "
                        "the leaves' producers fused into it: bucket_packing=\"kernel\" or \"xla\"); with any, psum-tree (the gradients summed by one "
                        "lax.psum of the tree, no buckets, as a user writes it); default: every mode of "
                        "--collective but these variants")
    p.add_argument("--quick-compile", action="store_true",
                   help="compile the steps without XLA's backend optimisations (faster compiles, slower "
                        "steps: for tests, not for timings)")
    p.add_argument("--profile", default=None, metavar="DIR", type=lambda t: output_folder("--profile", t),
                   help="trace one step of each timed mode with jax.profiler into DIR and report the overlap "
                        "figure (share of jax_blink kernel time beside compute kernels; GPU traces), and "
                        "write DIR/kernels-<mode>-vs-none.txt: each mode's kernel time by kind on the "
                        "first GPU against the step without all-reduce")
    p.add_argument("--explain", action="store_true", help="print jax_blink.explain of each bucket's all-reduce")
    p.add_argument("--out", default=None, metavar="DIR", type=lambda t: output_folder("--out", t),
                   help=f"folder for the results: an existing folder, or a new one in an existing folder "
                        f"(default {DEFAULT_OUT} in the current folder)")
    p.add_argument("--no-write", action="store_true", help="write no result files")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    args = parser().parse_args(argv)
    for field, models in FIELDS.items():
        if getattr(args, field) is not None and args.model not in models:
            flag = "--" + field.replace("_", "-")
            raise UsageError(f"{flag} does not apply to --model {args.model} (it shapes {' and '.join(models)})")
    if args.hold != "recent" and args.collective == "switch":
        raise UsageError(f"--hold {args.hold} shapes the overlapped step, which --collective switch does not time "
                         "(use --collective blink, psum or overlap)")
    if args.modes is not None:
        timed_modes(args.collective, args.dispatch, args.model, args.hold, args.modes)  # UsageError if wrong
    if args.timing_runs < 0:
        raise UsageError(f"--timing-runs must be >= 0, got {args.timing_runs}")
    if args.first_bucket_mb > args.bucket_mb:
        raise UsageError(f"--first-bucket-mb ({args.first_bucket_mb}) must not exceed --bucket-mb ({args.bucket_mb})")
    if args.out is not None and args.no_write:
        raise UsageError("--out and --no-write contradict each other: give one of them")
    if args.out is None and not args.no_write:
        try:
            output_folder("--out", DEFAULT_OUT)  # the default must be writable here too, before any work
        except _ToolUsageError as e:
            raise UsageError(f"{e} (the default; give --out DIR or --no-write)") from None
    return args


def model_config(args: argparse.Namespace):
    from jax_blink.tools.train.models import SIZES
    overrides = {f: getattr(args, f) for f in FIELDS if getattr(args, f) is not None}
    cfg = dataclasses.replace(SIZES[args.model][args.size], **overrides)
    if args.model == "gpt2" and cfg.width % cfg.heads:
        raise UsageError(f"--width {cfg.width} must be a multiple of --heads {cfg.heads}")
    return cfg


def _ensure_host_devices(count: int) -> str:
    """Ask XLA for ``count`` CPU host devices unless its backends started or XLA_FLAGS names a
    count (:func:`jax_blink.tools.arguments.ensure_host_devices`); returns what was done, in words."""
    return ensure_host_devices(count)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def time_steps(dp, modes: Sequence[str], state, runs: int, chain: int = 1) -> dict[str, list[float]]:
    """Wall time per step of each mode from ``state`` on the first batch, the modes taking turns
    (:func:`jax_blink.tools.timing.interleaved_times`): each run is ``chain`` steps in a row, each
    fed the previous one's state without waiting for it, timed to the last one's end, / ``chain``."""
    from jax_blink.tools.timing import Ready, interleaved_times
    batch = dp.batches[0]

    def steps(s, c):
        for _ in range(chain):
            s, loss = c(s, batch)
        return Ready((s, loss))

    fns = [lambda s, c=dp.callable(m): steps(s, c) for m in modes]
    return {m: [t / chain for t in ts] for m, ts in zip(modes, interleaved_times(fns, state, runs))}


def profile_modes(dp, modes: Sequence[str], state, folder: Path, say) -> dict:
    """One traced step of each mode (jax.profiler, after a warm-up step), and the overlap figure of
    its trace (:mod:`jax_blink.tools.trace_overlap`): the share of jax_blink's kernel time that
    ran beside other kernels on the same GPU. Returns {mode: summary}."""
    import jax
    from jax_blink.tools import trace_overlap
    batch = dp.batches[0]
    found, tables = {}, {}
    for m in modes:
        step = dp.callable(m)
        jax.block_until_ready(step(state, batch))
        where = folder / m
        with jax.profiler.trace(str(where)):
            jax.block_until_ready(step(state, batch))
        traces = sorted(where.rglob("*.trace.json.gz"))
        if not traces:
            say(f"  profile {m}: no trace file under {where}")
            continue
        trace = trace_overlap.load(traces[-1])
        summary = trace_overlap.summarize(trace)
        found[m] = {"trace": str(traces[-1]), **summary}
        tables[m] = trace_overlap.kernel_table(trace)
        say(f"  profile {m} (measured, one step, {traces[-1].name}): {trace_overlap.describe(summary)}")
    # Which kernels a mode runs longer than the step without all-reduce: small text files that
    # tell the same kernels slowed from other fusions, where the traces are too large to keep.
    if "none" in tables:
        for m, table in tables.items():
            if m != "none":
                path = folder / f"kernels-{m}-vs-none.txt"
                path.write_text(f"{m} against none, one profiled step each: the first GPU's kernels "
                                "(every event where the trace names no GPU)\n"
                                + trace_overlap.compare_tables(table, tables["none"]) + "\n")
                found[m]["kernels_vs_none"] = str(path)
        say(f"  kernel time by kind against the step without all-reduce: {folder}/kernels-<mode>-vs-none.txt")
    return found


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        cfg = model_config(args)
    except (UsageError, _ToolUsageError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)
    flags_note = _ensure_host_devices(args.host_devices)
    try:
        from jax_blink.tools.train.step import DataParallel, switch_available
    except ImportError as e:  # flax / optax missing
        print(f"{PROG}: {e}; install the train extra: pip install -e \".[train]\"", file=sys.stderr)
        return 2
    if args.collective == "switch" and not switch_available():
        print(f"{PROG}: --collective switch needs jax_blink.installed() (the switch, issue 15), which "
              "this jax_blink does not have; use --collective blink", file=sys.stderr)
        return 2
    import jax
    import numpy as np

    from jax_blink.tools.env_report import relevant_environment

    devices = jax.devices()
    n = args.devices or len(devices)
    if n > len(devices):
        print(f"{PROG}: --devices {n}: only {len(devices)} {devices[0].platform} devices", file=sys.stderr)
        return 2
    if args.stream is not None and devices[0].platform not in ("gpu", "cuda"):
        print(f"{PROG}: --stream {args.stream}: stream annotations are an XLA:GPU feature; this run is on "
              f"{devices[0].platform} devices", file=sys.stderr)
        return 2
    if args.stream is not None:
        from jax_blink.lowering import jax_internals as _jax_internals
        if _jax_internals.compute_on_call() is None:
            print(f"{PROG}: --stream {args.stream}: needs jax.experimental.compute_on.compute_on2 (compute_on "
                  f"from jax 0.11), which jax {jax.__version__} does not have", file=sys.stderr)
            return 2
    if args.stream is not None and args.collective != "blink":
        print(f"{PROG}: --stream applies to --collective blink (the switch lowers inside jax's own rules)",
              file=sys.stderr)
        return 2
    mesh = jax.make_mesh((n,), ("data",), devices=devices[:n])
    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    kind = devices[0].device_kind
    say(f"{PROG} {' '.join(argv if argv is not None else sys.argv[1:])}")
    say(f"devices: {n} x {kind} ({devices[0].platform}); jax {jax.__version__}"
        + (f"; {flags_note}" if flags_note and devices[0].platform == "cpu" else ""))
    run_env = relevant_environment()
    if run_env:  # e.g. JAX_BLINK_ASYNC_ENGINE=ce (what the overlapped mode ran on), CUDA_VISIBLE_DEVICES
        say("environment: " + " ".join(f"{k}={v}" for k, v in run_env.items()))
    dp = DataParallel(args.model, cfg, mesh, bucket_bytes=int(args.bucket_mb * (1 << 20)),
                      first_bucket_bytes=int(args.first_bucket_mb * (1 << 20)), seed=args.seed,
                      lr=args.lr, dispatch=args.dispatch,
                      compiler_options={"xla_backend_optimization_level": 0} if args.quick_compile else None,
                      stream=args.stream, large_leaf_alone=args.large_leaf_alone,
                      last_bucket_pieces=args.last_bucket_pieces)
    say(f"model: {args.model} {args.size} {cfg}, {dp.param_count:,} parameters")
    say(f"gradient buckets: {dp.layout.describe()}")
    for mode in (m for m in (args.modes or ()) if m in LAST_BUCKET_VARIANTS and m not in TREE_MODES):
        say(f"gradient buckets of {mode}: {dp.layout_of(mode).describe().splitlines()[0]}")
    if args.explain and n > 1:
        from jax_blink.lowering.custom_call import default_topology
        from jax_blink.options.settings import override
        with override(dispatch=args.dispatch):  # as the step is traced
            say(dp.layout.explain(default_topology(n, "gpu" if devices[0].platform in ("gpu", "cuda") else devices[0].platform)))
    if n == 1:
        say("one device: every all-reduce is the identity (nothing to sum across); jax_blink returns its input")
    # The first of the overlapped modes that --hold names trains.
    first = overlapped_modes(args.hold)[0] if args.collective == "overlap" else args.collective
    state, losses = dp.run(first, args.steps, lambda i, loss: say(f"step {i} loss {loss:.6f}"))
    if not all(np.isfinite(losses)):
        say("loss is not finite")
        return 1

    record = {"argv": list(argv if argv is not None else sys.argv[1:]), "model": args.model, "size": args.size,
              "config": dataclasses.asdict(cfg), "parameters": dp.param_count, "collective": args.collective,
              "dispatch": args.dispatch, "hold": args.hold, "quick_compile": args.quick_compile, "stream": args.stream, "devices": n, "device_kind": kind, "platform": devices[0].platform,
              "jax": jax.__version__, "environment": run_env, "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
              "buckets": [{"bytes": b.nbytes, "dtype": b.dtype.name, "leaves": len(b.slots)} for b in dp.layout.buckets],
              "losses": losses}
    failed = []
    if args.timing_runs:
        modes = timed_modes(args.collective, args.dispatch, args.model, args.hold, args.modes)
        # Every timed mode's result against psum's, before any is timed: a claim needs both.
        record["check"] = check = check_against_psum(dp, modes, args.steps, done={first: (state, losses)})
        if check:
            say(f"results against psum's, {args.steps} step(s) from the same state on the same batches (measured; "
                "parameter change: |p - p_psum| / |p_psum - p0|, must be <= "
                f"{UPDATE_RTOL:g}; losses: largest relative difference, for information):")
            for m, c in check.items():
                say(f"  {m}: {'ok' if c['passed'] else 'MISMATCH'}, parameter change within {c['update_rel_diff']:.1e}, "
                    f"losses within {c['loss_rel_diff']:.1e}" + ("" if c["finite"] else ", NOT FINITE"))
        failed = [m for m, c in check.items() if not c["passed"]]
        if failed:
            say(f"error: {', '.join(failed)} did not train as psum does (the parameters' change more than "
                f"{UPDATE_RTOL:g} of psum's away from it, or not finite); the times below are of a wrong program")
        times = time_steps(dp, modes, state, args.timing_runs, args.chain)
        med = {m: statistics.median(t) for m, t in times.items()}
        how = (f"runs of {args.chain} steps in a row, each dispatched without waiting for the one before"
               if args.chain > 1 else "runs of one step, the host's dispatch included")
        say(f"time per step, median of {args.timing_runs} {how}, the modes taking turns ({n} x {kind}; "
            "collective share = (t - t(no all-reduce)) / t, the same step with the all-reduce taken out; "
            "beyond the barrier baseline = t - t(no all-reduce, buckets behind a barrier)):")
        record["timing"] = {"runs": args.timing_runs, "chain": args.chain,
                            "method": "step with the all-reduce removed (none); the same with each bucket behind an "
                                      "optimization barrier (none-barrier)", "modes": {}}
        labels = {**LABELS, "overlap": LABELS["overlap"] + (" (hold recent)" if args.hold == "both" else "")}
        width = max(len(labels[m]) for m in modes)
        for m in modes:
            share = (med[m] - med["none"]) / med[m]
            counted = dp.collectives_in(m)
            label = labels[m]
            if m == "none":
                tail = ""
            elif m == "none-barrier" and devices[0].platform == "cpu":
                tail, share = (f"  {(med[m] - med['none']) * 1e3:+.3f} ms over no all-reduce (measured; XLA:CPU removes "
                               "optimization barriers, so this is the same program and the difference is noise)"), None
            elif m == "none-barrier":
                tail, share = (f"  {(med[m] - med['none']) * 1e3:+.3f} ms over no all-reduce (measured: what stopping "
                               "XLA's fusions at each bucket costs, with no communication)"), None
            elif n == 1 or counted["all-reduce"] + counted["jax_blink"] == 0:
                # One device: every all-reduce sums one value and moves nothing; a "share" would be
                # the noise between runs of programs that do the same work.
                tail, share = "  no collective in this program (one device: nothing to sum across)", None
            else:
                tail = (f"  collectives {share:6.1%} (exposed communication, measured: "
                        f"{(med[m] - med['none']) * 1e3:.3f} ms; beyond the barrier baseline "
                        f"{(med[m] - med['none-barrier']) * 1e3:.3f} ms)")
            say(f"  {label:>{width}}: {med[m] * 1e3:9.3f} ms{tail}  [{counted['all-reduce']} XLA all-reduce(s), "
                f"{counted['jax_blink']} jax_blink call(s) in the program]")
            record["timing"]["modes"][m] = {"median_s": med[m], "times_s": times[m], "collective_share": share,
                                            "exposed_s": med[m] - med["none"],
                                            "beyond_barrier_s": med[m] - med["none-barrier"],
                                            "xla_all_reduces": counted["all-reduce"],
                                            "jax_blink_calls": counted["jax_blink"]}
    if args.profile and args.timing_runs:
        record["profile"] = profile_modes(dp, modes, state, Path(args.profile), say)
        spans = {m: p["span_us"] for m, p in record["profile"].items() if p.get("span_us")}
        if "none" in spans and len(spans) > 1:
            say("  GPU span of one profiled step less the step without the all-reduce's (measured, "
                "one step each): " + ", ".join(f"{m} {(spans[m] - spans['none']) / 1e3:.3f} ms"
                                                for m in spans if m != "none"))
        busy = {m: p["compute_us_per_gpu"] for m, p in record["profile"].items() if p.get("compute_us_per_gpu")}
        if busy:  # what runs longer beside the collective: the same kernels slowed, or other fusions
            say("  compute kernels busy per GPU (measured, one profiled step, mean over the GPUs; jax_blink's and "
                "NCCL's kernels not counted): " + ", ".join(f"{m} {us / 1e3:.3f} ms" for m, us in busy.items()))
        if "none" in spans and "timing" in record and spans["none"] / 1e6 < 0.8 * med["none"]:
            # The GPUs wait for the host's launches: the timed steps then measure the host, not the
            # all-reduce, and no collective can hide anything.
            say(f"  note: host-bound: the step without all-reduce spans {spans['none'] / 1e3:.3f} ms on the GPUs "
                f"(first kernel to last) of its {med['none'] * 1e3:.3f} ms timed step; the step times "
                "measure the host's dispatch more than the collectives (a larger --batch gives the GPUs more work)")
    if not args.no_write:
        out = Path(args.out or DEFAULT_OUT)
        made = not out.exists()
        out.mkdir(exist_ok=True)  # its parent exists: checked before the run
        if made:
            print(f"made the folder {out.absolute()}" + ("" if args.out else " (the default --out)"))
        stem = (f"train-{args.model}-{args.size}-{args.collective}-{slug(kind)}-x{n}-"
                f"{_dt.date.today().isoformat()}")
        (out / f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
        (out / f"{stem}.txt").write_text("\n".join(lines) + "\n")
        print(f"wrote {(out / stem).absolute()}.json and .txt")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
