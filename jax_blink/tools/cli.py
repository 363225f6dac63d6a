"""Command line (``python -m jax_blink`` or the ``jax-blink`` script): ``demo`` (the main job: the
paper's result in the model, every collective checked against lax and all_reduce timed against
lax.psum on the devices here, :mod:`jax_blink.tools.demo`), ``plan``, ``crossover``, ``run
SCRIPT.py [ARGS...]`` (a program's lax collectives on jax_blink, unedited: jax_blink.switch), and
``bench`` / ``train`` / ``decode``, which forward to ``python -m jax_blink.tools.bench`` /
``.tools.train`` / ``.tools.decode``, and
``tune`` (:mod:`jax_blink.tools.tune`: this machine's dispatch entries into the user's cache).

    python -m jax_blink plan --topology dgx1v --devices 0,1,4 --collective allreduce --plot trees.png

prints the topology, the trees of the plan and their weights, the plan's rate against its cut
bound and against NCCL's rings (:mod:`jax_blink.tools.simulate`), all as algbw (GB/s per rank), and the
plan's own explanation; with ``--plot`` it draws the trees (:func:`jax_blink.tools.draw.draw_plan`).

``--topology`` takes a preset (``dgx1v``, ``dgx1p``, ``dgx2``, ``nvswitch:N``) or ``discover``
(the default): the devices JAX sees. Without GPUs those are CPU host devices, a uniform mesh; this
module asks XLA for 8 of them when nothing else was asked before JAX starts. Every size option
takes bytes per rank in one grammar: 65536, 512K, 16M, 1G.

Every option is checked before any work starts: a bad value ends with one line on stderr that
names the option, what it got and what it takes, and exit status 2 (:mod:`jax_blink.tools.arguments`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from jax_blink.tools.arguments import Parser, UsageError, bad, byte_count, ensure_host_devices, picture_path, run_main
from jax_blink.tools.arguments import BYTE_COUNT, check_fits, input_file, whole_number
from jax_blink.tools.demo import DEFAULT_SIZES, GPU_SIZES, default_sizes

PROG = "python -m jax_blink"
_MAX_DEVICES = 128  # nvswitch:128 plans in about 50 s on one core; more would run for many minutes
_DGX1 = ("dgx1v", "dgx1p")


def _topology_arg(text: str) -> str:
    """--topology: a preset name or ``discover``, checked before any work (nvswitch:N, 2 <= N <= 128)."""
    key = text.strip().lower()
    if key in ("discover", "dgx2") + _DGX1:
        return key
    if key.startswith("nvswitch:"):
        n = key.partition(":")[2]
        if n.isdigit() and 2 <= int(n) <= _MAX_DEVICES:
            return key
    raise argparse.ArgumentTypeError(f"got {text!r}; takes dgx1v, dgx1p, dgx2, nvswitch:N "
                                     f"(2 <= N <= {_MAX_DEVICES}) or discover")


def _parse_devices(text: str | None) -> list[int] | None:
    """--devices: ids such as 0,1,4 or 0-3 (ranges inclusive), each once; None: all devices."""
    takes = "takes device ids such as 0,1,4 or 0-3, each id once"
    if text is None:
        return None
    if not text.strip():  # an empty list is a mistake (leave --devices out for every device)
        raise bad("--devices", text, f"{takes}; leave the option out for every device")
    out = []
    for part in text.split(","):
        part = part.strip()
        lo, dash, hi = part.partition("-")
        if not (lo.isdigit() and (not dash or hi.isdigit())):  # also refuses negative ids
            raise bad("--devices", text, takes)
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first or last - first >= _MAX_DEVICES:
            raise bad("--devices", text, f"{takes}; {part!r} is not a range of 1 to {_MAX_DEVICES} ids")
        out.extend(range(first, last + 1))
    if len(set(out)) != len(out):
        raise bad("--devices", text, f"{takes} (an id appears twice)")
    if len(out) > _MAX_DEVICES:
        raise bad("--devices", text, f"{takes}, at most {_MAX_DEVICES} of them")
    return out


def _topology(name: str, devices: list[int] | None, pcie: bool):
    from jax_blink.planning.topology import Topology

    if pcie and name not in _DGX1:
        raise UsageError(f"argument --pcie: applies to the DGX-1 presets ({', '.join(_DGX1)}), "
                         f"not to --topology {name}")
    if name == "discover":
        import jax

        all_devs = jax.devices()
        if devices is not None:
            by_id = {d.id: d for d in all_devs}
            missing = [i for i in devices if i not in by_id]
            if missing:
                raise bad("--devices", ",".join(map(str, devices)),
                          f"takes ids of the devices here, {sorted(by_id)}; no device has id "
                          f"{', '.join(map(str, missing))}")
            all_devs = [by_id[i] for i in devices]
        return Topology.discover(all_devs)
    topo = Topology.preset(name, pcie=pcie)
    if devices is not None:
        unknown = [d for d in devices if d not in topo.devices]
        if unknown:
            raise bad("--devices", ",".join(map(str, devices)),
                      f"takes ids of {name}'s devices, {list(topo.devices)}; no device has id "
                      f"{', '.join(map(str, unknown))}")
        topo = topo.subset(devices)
    return topo


def _format_tree(tree, weight: float, i: int) -> str:
    roots = [v for v in tree.nodes if tree.in_degree(v) == 0]
    root = roots[0] if roots else "?"
    # Breadth-first from the root so the edges read in order.
    import networkx as nx

    edges = list(nx.bfs_edges(tree, root)) if roots else list(tree.edges)
    return f"  tree {i}: root {root}, {weight:.4g} GB/s: " + ", ".join(f"{u}->{v}" for u, v in edges)


def _bytes(nbytes: int) -> str:
    """``nbytes`` as the size grammar writes it where it can (64M, 512K), else the plain count."""
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return str(nbytes)


# What the plan command prints as a rate: every GB/s figure in it is this unit.
_ALGBW = "algbw: GB/s per rank, the bytes of one rank's buffer / time (nccl-tests' definition)"


def cmd_plan(args: argparse.Namespace) -> int:
    """The ``plan`` subcommand."""
    topo = _topology(args.topology, args.devices, args.pcie)
    from jax_blink.tools.simulate import algbw, best_time, rings
    from jax_blink.planning.packing import plan as make_plan

    if args.root is not None and args.root not in topo.devices:
        raise bad("--root", args.root, f"takes one of the devices {list(topo.devices)}")
    try:
        p = make_plan(topo, args.collective, args.root, method=args.method)
    except ValueError as e:  # e.g. an allocation whose links hold no tree
        hint = " On the command line: add --pcie." if args.topology in _DGX1 and not args.pcie else ""
        raise UsageError(f"{e}{hint}") from None
    if args.plot:  # the picture is part of the work: drawn before anything is printed
        from jax_blink.tools.draw import draw_plan

        draw_plan(p, path=args.plot)

    print(topo.describe())
    print()
    root = getattr(p, "root", None)
    if root is None:
        roots = sorted(set(getattr(p, "roots", ()) or ()))
        where = f"roots {','.join(map(str, roots))}" if roots else "root chosen by the planner"
    else:
        where = f"root {root}"
    print(f"{args.collective} plan ({args.method}), {where}: {len(p.trees)} tree(s), "
          "each with its share of the algbw (every rate here is MODELLED from the topology's link rates)")
    for i, (tree, w) in enumerate(p.trees):
        print(_format_tree(tree, w, i))
    if topo.n == 1:
        print("one device: nothing to move")
    else:
        bound = float(p.bound)
        frac = f" ({100 * p.rate / bound:.1f}% of it)" if bound > 0 else ""
        print(f"trees: {p.rate:.4g} GB/s algbw (the sum of the tree weights); cut bound {bound:.4g} GB/s{frac}")
        rp = rings(topo)
        ra, ta = algbw(rp, args.collective), algbw(p, args.collective)
        print()
        n = topo.n
        how = (f"rings of {rp.rate:g} GB/s in all, and an all-reduce sends 2(n-1)/n of the data around "
               f"them: {rp.rate:g} x {n}/{2 * (n - 1)} = {ra:.4g} GB/s algbw" if args.collective == "allreduce"
               else f"rings of {ra:.4g} GB/s in all = {ra:.4g} GB/s algbw")
        print(f"NCCL-style rings: {rp.num_rings} {rp.kind} ring(s) on {rp.topology.name}"
              + (f" ({rp.note})" if rp.note else "") + f"; {how}")
        for r, b in zip(rp.rings, rp.rates):
            print(f"  {' -> '.join(map(str, r))} -> {r[0]}: {b:g} GB/s")
        print(f"trees {ta:.4g} vs rings {ra:.4g} GB/s algbw: {ta / ra:.2f}x" if ra > 0 else "")
        from jax_blink.tools.demo import uniform_mesh
        if uniform_mesh(topo):
            print(f"{topo.name} is a uniform mesh (every pair the same modelled rate): trees == rings in rate "
                  "here; Blink's gain needs links that differ or are missing (try --topology dgx1v --devices 0,1,4)")
        print(f"({_ALGBW}; in the model, at large sizes)")
        tt, tc = best_time(p, args.collective, args.size)
        rt, _ = best_time(rp, args.collective, args.size)
        if tt > 0:
            print(f"model at {_bytes(args.size)} bytes per rank: trees {tt:.1f} us "
                  f"(chunk {_bytes(int(tc or 0))}), rings {rt:.1f} us: {rt / tt:.2f}x")
    print()
    print(p.explain())
    if args.plot:
        print(f"\ntrees drawn to {args.plot}")
    return 0


def _sizes_arg(text: str) -> list[int]:
    """--size: one or more byte counts, comma-separated."""
    parts = [t for t in text.split(",")]
    if not all(t.strip() for t in parts):
        raise argparse.ArgumentTypeError(f"got {text!r}; takes comma-separated sizes, each {BYTE_COUNT}")
    return list(dict.fromkeys(byte_count(t) for t in parts))


def cmd_demo(args: argparse.Namespace) -> int:
    import jax
    import numpy as np

    from jax_blink.tools.demo import run_demo, bytes_needed

    itemsize = np.dtype(jax.numpy.dtype(args.dtype)).itemsize
    devices = jax.devices()
    args.size = args.size or list(default_sizes(devices[0].platform))
    for size in args.size:
        if size % itemsize:
            raise bad("--size", _bytes(size), f"takes a whole number of {args.dtype} elements "
                                              f"({itemsize} bytes each) per rank")
    check_fits("--size", max(args.size), devices, bytes_needed(max(args.size), args.dtype, devices))
    return run_demo(args.size, args.dtype, args.plot, flags_note=args.flags_note)


def cmd_crossover(args: argparse.Namespace) -> int:
    from jax_blink.lowering.decision import LAX_NAME as _LAX_NAME
    from jax_blink.tools.derive import derive

    if args.update:
        return _update_table(args)

    c = derive(args.runs, dtype=args.dtype)  # an unreadable or unfit file: a ValueError naming it (exit 2)
    lax_name = _LAX_NAME.get(c.collective, "lax")
    print(f"# {c.collective}: derived from {len(c.sources)} run(s) of {c.ranks} x {c.device_kind}; "
          "--update writes the runs' entries into jax_blink/lowering/dispatch_entries.json")
    print(c.as_code() + ",")
    for lo, hi in c.lax_ranges:
        print(f"# {lax_name} for {lo} <= bytes of a rank's operand" + (f" < {hi}" if hi is not None else ""))
    if not c.lax_ranges:
        print(f"# no size goes to {lax_name}: the executor won or tied somewhere at every size")
    return 0


def _update_table(args: argparse.Namespace) -> int:
    """``crossover --update RUN.json ...``: the runs' entries into the shipped table's file."""
    from jax_blink.lowering import dispatch_table
    from jax_blink.lowering.decision import LAX_NAME as _LAX_NAME
    from jax_blink.tools.derive import update

    if args.dtype is not None:
        raise UsageError("argument --dtype: --update derives every dtype's entries itself; leave --dtype out")
    root = os.getcwd()
    outside = [p for p in args.runs if os.path.isabs(p) or os.path.normpath(p).startswith("..")]
    if outside:
        raise bad("JSON", outside[0], "takes a path relative to the repository root (run from the checkout), so "
                                      "that the entries cite files the repository holds")
    new, replaced = update(args.runs, path=args.table or dispatch_table.SHIPPED_FILE, root=root)
    where = args.table or os.path.relpath(dispatch_table.SHIPPED_FILE)
    print(f"# wrote {len(new)} entr{'y' if len(new) == 1 else 'ies'} into {where}"
          + (f", in place of {len(replaced)}" if replaced else ""))
    for c in new:
        which = f" in {c.dtype}" if c.dtype else ""
        print(f"  {c.ranks} x {c.device_kind} ({c.links or 'links not recorded'}, {c.layout}), {c.collective}{which}: "
              f"{_LAX_NAME[c.collective]} {dispatch_table.at_ranges(c.lax_ranges)}")
    return 0


_EXAMPLES = f"""examples:
  {PROG} demo                      (the main job: the paper in the model, the collectives checked and timed here)
  {PROG} plan --topology dgx1v --devices 0,1,4 --plot trees.png
  {PROG} run --report train.py     (train.py's lax collectives on jax_blink, unedited)
  {PROG} bench -c all -b 1K -e 1M  (= python -m jax_blink.tools.bench)
  {PROG} tune                      (measure this machine: dispatch="auto" follows its entries from then on)
  {PROG} train --model gpt2        (= python -m jax_blink.tools.train)
  {PROG} decode --size 8b --tp 4   (= python -m jax_blink.tools.decode: tensor-parallel decoding)
  {PROG} COMMAND --help            (every size is bytes per rank: 65536, 512K, 16M, 1G)
The jax-blink command (installed with the package) is the same as {PROG}.
Without a GPU every command asks XLA for 8 CPU host devices before JAX starts (XLA_FLAGS), unless
XLA_FLAGS already names a device count."""

RUN_HELP = f"""usage: {PROG} run [--report] [--] SCRIPT.py [ARGS...]

Run SCRIPT.py with ARGS as `python SCRIPT.py ARGS...` would, with the switch on
(jax_blink.install()): its lax collectives (psum, all_gather, psum_scatter, ...) run on
jax_blink's executor where jax_blink's dispatch says so, with no edit to the script. The
script's sys.argv, exit status and exceptions are its own.

options (before SCRIPT.py; everything after it is the script's):
  -h, --help   this text
  --report     when the script ends, print the switch's decisions to stderr: each collective
               lowered, and whether it ran on jax_blink or on XLA's own, and why
  --           ends the options (for a script whose name starts with -)

Without a GPU, XLA is asked for 8 CPU host devices before JAX starts (unless XLA_FLAGS already
names a device count), and a line on stderr says so."""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog=PROG, description="Blink-style collectives for JAX: plans and demos.",
                    formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_EXAMPLES)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True

    pp = sub.add_parser("plan", help="plan trees for a collective on a topology, compare with rings")
    pp.add_argument("--topology", default="discover", type=_topology_arg,
                    help=f"dgx1v, dgx1p, dgx2, nvswitch:N (2 <= N <= {_MAX_DEVICES}) or discover "
                         "(default: the jax devices here; CPU host devices on a machine without GPUs)")
    pp.add_argument("--devices", default=None, type=_parse_devices,
                    help="the allocation: device ids such as 0,1,4 or 0-3 (default: all)")
    pp.add_argument("--collective", default="allreduce", choices=["broadcast", "reduce", "allreduce"],
                    help="the collective to plan (default allreduce)")
    pp.add_argument("--root", type=whole_number(0), default=None,
                    help="root device id (default: the planner's choice)")
    pp.add_argument("--method", default="exact", choices=["exact", "mwu"],
                    help="exact: LP and integer program (OR-Tools); mwu: the paper's fast approximation")
    pp.add_argument("--pcie", action="store_true",
                    help="dgx1v/dgx1p: add PCIe links where there is no NVLink")
    pp.add_argument("--size", type=byte_count, default=500 << 20, metavar="BYTES",
                    help="bytes per rank for the time model: 65536, 512K, 16M, 1G (default 500M)")
    pp.add_argument("--plot", default=None, metavar="PNG", type=lambda t: picture_path("--plot", t),
                    help="draw the trees to this picture file (.png, .pdf, .svg, ...)")
    pp.set_defaults(func=cmd_plan)

    pd = sub.add_parser("demo", help="the main job: Blink's trees vs rings in the model, every collective "
                                     "checked against lax and all_reduce timed against lax.psum here")
    pd.add_argument("--size", type=_sizes_arg, default=None, metavar="BYTES[,BYTES...]",
                    help="bytes per rank to time all_reduce at, each a whole number of elements: 65536, "
                         f"512K, 16M, 1G (default on GPUs {_bytes(GPU_SIZES[0])} to {_bytes(GPU_SIZES[-1])} by 4x, "
                         f"else {','.join(_bytes(b) for b in DEFAULT_SIZES)})")
    pd.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "int32"],
                    help="element type (default float32)")
    pd.add_argument("--plot", default=None, metavar="PNG", type=lambda t: picture_path("--plot", t),
                    help="draw the all-reduce trees to this picture file (.png, .pdf, .svg, ...)")
    pd.set_defaults(func=cmd_demo)

    pc = sub.add_parser("crossover", help="derive a dispatch entry (jax_blink/lowering/dispatch_table.py) from bench runs")
    pc.add_argument("runs", nargs="+", metavar="JSON", type=lambda t: input_file("JSON", t, suffix=".json"),
                    help="bench results of one collective on one machine (python -m jax_blink.tools.bench -o DIR "
                         "writes them)")
    pc.add_argument("--update", action="store_true",
                    help="derive every machine's and collective's entries from the runs (each dtype's own where "
                         "its rows differ) and write them into the shipped table, "
                         "jax_blink/lowering/dispatch_entries.json, in place of the entries of the same machines")
    pc.add_argument("--dtype", default=None, metavar="DTYPE",
                    help="derive the entry for this element type from its rows alone (default: one entry for "
                         "every dtype the runs measured, lax only where lax won in each)")
    pc.add_argument("--table", default=None, metavar="JSON", help=argparse.SUPPRESS)  # tests: another file
    pc.set_defaults(func=cmd_crossover)

    # Handled by main() before parsing (their arguments belong to the script or the tool); listed for --help.
    sub.add_parser("run", help="run SCRIPT.py [ARGS...] as python would, its lax collectives on "
                               "jax_blink (jax_blink.install()); run --help says more")
    sub.add_parser("bench", help="our collectives against lax's, timed and checked, nccl-tests style "
                                 "(python -m jax_blink.tools.bench; bench --help)")
    sub.add_parser("tune", help="measure this machine and store its dispatch entries in the user's cache, "
                                "which dispatch=\"auto\" follows from then on (tune --help)")
    sub.add_parser("train", help="data-parallel ResNet/GPT-2 training, psum against jax_blink "
                                 "(python -m jax_blink.tools.train; train --help)")
    sub.add_parser("decode", help="tensor-parallel decoding of a Llama-shaped model, psum against jax_blink "
                                  "(python -m jax_blink.tools.decode; decode --help)")
    pe = sub.add_parser("env", help="what a bug report needs: versions, executors and their GPU architectures, "
                                    "GPUs, driver, links, peer access, what jax_blink would run here")
    pe.set_defaults(func=cmd_env)
    return parser


def cmd_env(args) -> int:
    """``env``: the environment report (jax_blink/tools/env_report.py), to paste into a bug report."""
    import jax

    from jax_blink.tools import env_report
    if args.flags_note and jax.devices()[0].platform == "cpu":
        print(f"(no GPU: {args.flags_note})")
    print(env_report.report())
    return 0


def _script_frames(tb, script: str):
    """The traceback from the script's first frame on (the frames of this tool and runpy dropped),
    as `python SCRIPT.py` shows it."""
    start = tb
    while start is not None and os.path.abspath(start.tb_frame.f_code.co_filename) != script:
        start = start.tb_next
    return start or tb


def cmd_run(argv: list[str]) -> int:
    """``run [--report] [--] SCRIPT.py [ARGS...]``: the script as python runs it, with the switch on."""
    report = False
    while argv and argv[0].startswith("-"):
        opt = argv.pop(0)
        if opt == "--":
            break
        if opt in ("-h", "--help"):
            print(RUN_HELP)
            return 0
        if opt != "--report":
            raise UsageError(f"run: unknown option {opt!r}; run takes --report and -- before SCRIPT.py "
                             f"(see {PROG} run --help)")
        report = True
    if not argv:
        raise UsageError(f"run: no script given; usage: {PROG} run [--report] [--] SCRIPT.py [ARGS...]")
    path = argv[0]
    if os.path.isdir(path):
        raise UsageError(f"run: {path!r} is a folder; run takes a Python script file (SCRIPT.py)")
    if not os.path.isfile(path):
        raise UsageError(f"run: can't open file {path!r}: no such file")
    note = ensure_host_devices()
    if note.startswith("this tool set"):
        print(f"{PROG} run: {note} (on a machine with GPUs it changes nothing)", file=sys.stderr)
    import runpy
    import traceback

    import jax_blink

    script = os.path.abspath(path)
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` puts its folder first
    if report:
        import atexit

        atexit.register(_print_report)
    jax_blink.install()
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 (shown as python shows it, then exit 1)
        sys.stdout.flush()
        lines = traceback.format_exception(type(e), e, _script_frames(e.__traceback__, script))
        print("".join(lines), end="", file=sys.stderr)
        return 130 if isinstance(e, KeyboardInterrupt) else 1
    return 0


def _print_report() -> None:
    import jax_blink

    decisions = jax_blink.switch_report()
    on = sum(d.runs_on == "jax_blink" for d in decisions)
    lines = [f"jax_blink switch: {len(decisions)} collective(s) lowered, {on} on jax_blink, "
             f"{len(decisions) - on} on XLA"] + [f"  {d}" for d in decisions]
    print("\n".join(lines), file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (0 ok, 1 demo results differ, 2 bad input; run: the script's)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        # `run SCRIPT.py [ARGS...]`: the script as `python SCRIPT.py ARGS...` runs it, with the
        # switch on (jax_blink.switch). Its arguments are its own, and its exit status and
        # exceptions pass through.
        return run_main(PROG, lambda: cmd_run(argv[1:]), usage_errors=(UsageError,))
    if argv[:1] == ["bench"]:
        from jax_blink.tools import bench
        return bench.main(argv[1:])
    if argv[:1] == ["tune"]:
        from jax_blink.tools import tune
        return tune.main(argv[1:])
    if argv[:1] == ["train"]:
        from jax_blink.tools.train.__main__ import main as train_main
        return train_main(argv[1:])
    if argv[:1] == ["decode"]:
        from jax_blink.tools.decode.__main__ import main as decode_main
        return decode_main(argv[1:])
    flags_note = ensure_host_devices()
    parser = build_parser()

    def body() -> int:
        args = parser.parse_args(argv)
        args.flags_note = flags_note
        return args.func(args)

    return run_main(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
