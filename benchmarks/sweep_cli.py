"""The command line and the files of the settings sweeps (twoshot_sweep.py, ce_sweep.py): sizes,
``--config NAME:VAR=VALUE,...`` settings, the chain and rounds; a Markdown table and its rows as
JSON in ``--out``; exit 1 when a result differed from psum's."""
from __future__ import annotations

import argparse
import json
import os
import time


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
    args = ap.parse_args(argv)
    try:
        configs = [parse_config(c) for c in (args.config or default_configs)]
    except ValueError as e:
        ap.error(str(e))
    rows = run(args.sizes, configs, args.chain, args.runs)
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
