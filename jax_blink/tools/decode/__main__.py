"""``python -m jax_blink.tools.decode``: tensor-parallel decoding of a Llama-shaped model (random
bfloat16 weights) with its all-reduces done by ``lax.psum``, by ``jax_blink.all_reduce``, by psum
under the switch, and not at all; every variant checked against psum's and timed in turns.

    python -m jax_blink.tools.decode --size tiny|8b --tp 2,4 --batch 1,4,16,64 --steps 8 -o DIR
    python -m jax_blink.tools.decode --layout sequence --batch 4,16,64 ...   # all-gathers and reduce-scatters

prints one table per (tp, batch): time per decode step, tokens per second, speedup over psum, the
all-reduce's share of the step ((t - t(none)) / t), the all-reduce time per step, the marginal cost
of one all-reduce ((t(+K per layer) - t) / (K x layers)), and the check against psum; then writes
``decode-<size>-<device kind>-tp<sizes>-<date>.{csv,json,txt,png}`` under ``-o`` (default
``jax_blink_results`` in the current folder; ``-sequence`` before the date for that layout). A
tensor-parallel size of n uses the first n devices. ``--layout sequence`` keeps each rank's rows of
the residual stream and replaces each all-reduce by an all-gather before the column-parallel
projections and a reduce-scatter after the row-parallel ones (each batch a multiple of every tp). Exit status 1 if a check failed (the results are written first), 2 for bad input.

Without a GPU the devices are CPU host devices (8 unless ``--host-devices`` or ``XLA_FLAGS`` says
otherwise).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import sys
from collections.abc import Sequence
from pathlib import Path

from jax_blink.tools.arguments import Parser, UsageError, ensure_host_devices, number, output_folder, run_main, whole_number

PROG = "python -m jax_blink.tools.decode"
DEFAULT_OUT = "jax_blink_results"
VARIANTS = ("psum", "blink", "switch", "none")  # jax_blink.tools.decode.model.VARIANTS (no jax import here)


def _int_list(flag: str):
    def parse(text: str) -> list[int]:
        try:
            values = [int(t) for t in text.split(",") if t.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"got {text!r}; takes whole numbers >= 1 separated by commas") from None
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"got {text!r}; takes whole numbers >= 1 separated by commas")
        return values
    return parse


def _variants(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in VARIANTS]
    if bad or "psum" not in names:
        raise argparse.ArgumentTypeError(f"got {text!r}; takes some of {','.join(VARIANTS)}, psum among them "
                                         "(every check and speedup is against it)")
    return list(dict.fromkeys(names))


def parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="tiny", choices=("tiny", "8b"),
                   help="tiny (CPU tests) or 8b (Llama-3-8B shapes, vocabulary 32000); default tiny")
    p.add_argument("--layers", type=whole_number(1), help="override the size's layer count")
    p.add_argument("--vocab", type=whole_number(2), help="override the size's vocabulary")
    p.add_argument("--context", type=whole_number(1), help="override the size's KV-cache positions")
    p.add_argument("--tp", type=_int_list("--tp"), default=[2, 4],
                   help="tensor-parallel sizes, each the first n devices (default 2,4)")
    p.add_argument("--batch", type=_int_list("--batch"), default=[1, 4, 16, 64],
                   help="batch sizes (sequences decoded at once; default 1,4,16,64)")
    p.add_argument("--steps", type=whole_number(1), default=8,
                   help="decode steps (tokens) per timed call (default 8)")
    p.add_argument("--extra", type=whole_number(0), default=1,
                   help="extra all-reduces (sequence layout: all-gather and reduce-scatter pairs) per layer in "
                        "the marginal-cost variants (0: none; default 1)")
    p.add_argument("--layout", default="allreduce", choices=("allreduce", "sequence"),
                   help="allreduce (default: the residual stream whole on every rank) or sequence (each rank's "
                        "rows; all-gathers and reduce-scatters instead of all-reduces)")
    p.add_argument("--variants", type=_variants, default=list(VARIANTS),
                   help=f"which of {','.join(VARIANTS)} to run (default all)")
    p.add_argument("--rounds", type=whole_number(1), default=10,
                   help="timed rounds at least (each variant once per round; default 10)")
    p.add_argument("--min-time", type=number(0.0), default=0.2,
                   help="more rounds (up to 200) until each variant ran this many seconds (default 0.2)")
    p.add_argument("--dispatch", default="blink", choices=("blink", "auto"),
                   help="jax_blink's dispatch while tracing: blink (default) always runs the executor")
    p.add_argument("--strict-bf16", action="store_true",
                   help="compile with xla_allow_excess_precision=false, so that the checks can demand "
                        "bitwise equality where the sums allow it (timings then differ from defaults)")
    p.add_argument("--quick-compile", action="store_true",
                   help="compile without XLA's backend optimisations (faster compiles, slower steps: tests)")
    p.add_argument("--host-devices", type=whole_number(1), default=8,
                   help="CPU host devices to ask XLA for when there is no GPU (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--out", default=None, metavar="DIR", type=lambda t: output_folder("--out", t),
                   help=f"folder for the results (default {DEFAULT_OUT} in the current folder)")
    p.add_argument("--no-write", action="store_true", help="write no result files")
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    a = parser().parse_args(argv)
    if a.out is not None and a.no_write:
        raise UsageError("--out and --no-write contradict each other: give one of them")
    if a.out is None and not a.no_write:
        output_folder("--out", DEFAULT_OUT)  # the default must be writable too, before any work
    return a


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        a = parse_args(argv)
        note = ensure_host_devices(a.host_devices)
        import jax

        from jax_blink.tools.decode import bench, model

        cfg = model.SIZES[a.size]
        cfg = dataclasses.replace(cfg, **{k: getattr(a, k) for k in ("layers", "vocab", "context")
                                          if getattr(a, k) is not None})
        devices = jax.devices()
        for tp in a.tp:
            if tp > len(devices):
                raise UsageError(f"--tp {tp}: only {len(devices)} {devices[0].platform} devices here")
            if tp < 2:
                raise UsageError(f"--tp {tp}: tensor parallelism needs 2 or more devices")
            cfg.check(tp)  # ValueError: one line, exit 2
            uneven = [b for b in a.batch if a.layout == "sequence" and b % tp]
            if uneven:
                raise UsageError(f"--layout sequence splits each batch's rows over the tp ranks: --batch {uneven[0]} "
                                 f"is not a multiple of --tp {tp}")
        if a.steps > cfg.context:
            raise UsageError(f"--steps {a.steps} exceeds the cache's {cfg.context} positions: raise --context")
        lines: list[str] = []

        def say(text: str = "") -> None:
            print(text, flush=True)
            lines.append(text)

        kind = devices[0].device_kind
        say(f"{PROG} {' '.join(argv)}")
        say(f"devices: {len(devices)} x {kind} ({devices[0].platform}); jax {jax.__version__}"
            + (f"; {note}" if devices[0].platform == "cpu" else ""))
        say(f"model: {a.size} {cfg}, {cfg.parameters():,} parameters, bfloat16, random weights; "
            f"{a.steps} tokens per call; {a.layout} layout; dispatch={a.dispatch}"
            + ("; compiled with xla_allow_excess_precision=false" if a.strict_bf16 else ""))
        rows = []
        for tp in a.tp:
            rows += bench.measure(cfg, devices, tp, a.batch, steps=a.steps, variants=a.variants, extra=a.extra,
                                  runs=a.rounds, min_seconds=a.min_time, dispatch=a.dispatch,
                                  strict_bf16=a.strict_bf16,
                                  compiler_options={"xla_backend_optimization_level": 0} if a.quick_compile else None,
                                  seed=a.seed, say=say, layout=a.layout)
        failed = [f"tp={r['tp']} batch={r['batch']} {r['variant']}: {r['check']}" for r in rows
                  if r["check"].startswith("FAILED")]
        say("checks against psum: " + ("all ok" if not failed else "; ".join(failed)))
        if not a.no_write:
            meta = bench.metadata(cfg, a.size, devices, argv, steps=a.steps, extra=a.extra, rounds=a.rounds,
                                  min_time_s=a.min_time, dispatch=a.dispatch, strict_bf16=a.strict_bf16,
                                  quick_compile=a.quick_compile, layout=a.layout)
            layout = "-sequence" if a.layout == "sequence" else ""
            stem = (f"decode-{a.size}-{bench.slug(kind)}-tp{'-'.join(map(str, a.tp))}{layout}-"
                    f"{_dt.date.today().isoformat()}")
            paths = bench.write(Path(a.out or DEFAULT_OUT), stem, meta, rows, "\n".join(lines))
            print("wrote " + ", ".join(str(p.absolute()) for p in paths))
        return 1 if failed else 0

    return run_main(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
