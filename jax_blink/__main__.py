"""Command line: ``python -m jax_blink plan ...`` (the main job), ``python -m jax_blink run
SCRIPT.py [ARGS...]`` (a program's lax collectives on jax_blink, unedited: jax_blink.switch).

    python -m jax_blink plan --topology dgx1v --devices 0,1,4 --collective allreduce --plot trees.png

prints the topology, the trees of the plan and their weights, the plan's rate against its cut
bound and against NCCL's rings (:mod:`jax_blink.simulate`), and the plan's own explanation; with
``--plot`` it draws the trees (:func:`jax_blink.draw.draw_plan`).

``--topology`` takes a preset (``dgx1v``, ``dgx1p``, ``dgx2``, ``nvswitch:N``) or ``discover``
(the default): the devices JAX sees. Without GPUs those are CPU host devices, a uniform mesh; this
module asks XLA for 8 of them when nothing else was asked before JAX starts.

Bad input (unknown preset, a device list that does not parse or names unknown devices, ...) ends
with one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

_N_HOST_DEVICES = 8
PROG = "python -m jax_blink"


class UsageError(Exception):
    """Bad command-line input: reported as one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + message + SystemExit
        raise UsageError(f"{message} (see {self.prog} --help)")


def _ensure_host_devices() -> None:
    """Ask XLA for several CPU host devices if JAX has not started yet and nobody asked already."""
    # `python -m jax_blink` has imported jax already (the package imports it), but XLA reads its
    # flags only when the first backend starts: that is what must not have happened yet.
    if "jax" in sys.modules:
        try:
            from jax._src import xla_bridge
            if xla_bridge.backends_are_initialized():
                return
        except (ImportError, AttributeError):
            return
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + f" --xla_force_host_platform_device_count={_N_HOST_DEVICES}").strip()
    os.environ.setdefault("PJRT_NPROC", "16")


def _parse_devices(text: str | None) -> list[int] | None:
    if text is None or text.strip() == "":
        return None
    out = []
    for part in text.split(","):
        part = part.strip()
        if "-" in part[1:]:  # a range like 0-3
            a, _, b = part.partition("-")
            try:
                lo, hi = int(a), int(b)
            except ValueError:
                raise UsageError(f"--devices: cannot read {part!r}; write ids like 0,1,4 or 0-3") from None
            if hi < lo:
                raise UsageError(f"--devices: empty range {part!r}")
            out.extend(range(lo, hi + 1))
            continue
        try:
            out.append(int(part))
        except ValueError:
            raise UsageError(f"--devices: cannot read {part!r}; write ids like 0,1,4 or 0-3") from None
    if any(d < 0 for d in out):
        raise UsageError(f"--devices: ids must be >= 0, got {text!r}")
    if len(set(out)) != len(out):
        raise UsageError(f"--devices: an id appears twice in {text!r}")
    return out


def _topology(name: str, devices: list[int] | None, pcie: bool):
    from .topology import Topology

    if name == "discover":
        if pcie:
            raise UsageError("--pcie applies to the dgx1v/dgx1p presets, not to discover")
        import jax

        all_devs = jax.devices()
        if devices is not None:
            by_id = {d.id: d for d in all_devs}
            missing = [i for i in devices if i not in by_id]
            if missing:
                raise UsageError(f"--devices: no jax device with id {missing}; "
                                 f"this machine has ids {sorted(by_id)}")
            all_devs = [by_id[i] for i in devices]
        return Topology.discover(all_devs)
    try:
        topo = Topology.preset(name, pcie=pcie)
    except ValueError as e:
        raise UsageError(f"--topology: {e}") from None
    if devices is not None:
        try:
            topo = topo.subset(devices)
        except ValueError as e:
            raise UsageError(f"--devices: {e}") from None
    return topo


def _format_tree(tree, weight: float, i: int) -> str:
    roots = [v for v in tree.nodes if tree.in_degree(v) == 0]
    root = roots[0] if roots else "?"
    # Breadth-first from the root so the edges read in order.
    import networkx as nx

    edges = list(nx.bfs_edges(tree, root)) if roots else list(tree.edges)
    return f"  tree {i}: root {root}, {weight:.4g} GB/s: " + ", ".join(f"{u}->{v}" for u, v in edges)


def _size(text: str) -> float:
    units = {"k": 1e3, "m": 1e6, "g": 1e9, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "b": 1}
    t = text.strip().lower()
    for u in sorted(units, key=len, reverse=True):
        if t.endswith(u) and t[: -len(u)].strip():
            try:
                return float(t[: -len(u)]) * units[u]
            except ValueError:
                break
    try:
        return float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read size {text!r}; e.g. 500M, 64KiB, 1e9") from None


def cmd_plan(args: argparse.Namespace) -> int:
    """The ``plan`` subcommand."""
    devices = _parse_devices(args.devices)
    topo = _topology(args.topology, devices, args.pcie)
    from .simulate import algbw, best_time, rings
    from .treegen import plan as make_plan

    if args.root is not None and args.root not in topo.devices:
        raise UsageError(f"--root {args.root} is not one of the devices {list(topo.devices)}")
    try:
        p = make_plan(topo, args.collective, args.root, method=args.method)
    except ValueError as e:
        raise UsageError(str(e)) from None

    print(topo.describe() if hasattr(topo, "describe") else repr(topo))
    print()
    root = getattr(p, "root", None)
    if root is None:
        roots = sorted(set(getattr(p, "roots", ()) or ()))
        where = f"roots {','.join(map(str, roots))}" if roots else "root chosen by the planner"
    else:
        where = f"root {root}"
    print(f"{args.collective} plan ({args.method}), {where}: {len(p.trees)} tree(s)")
    for i, (tree, w) in enumerate(p.trees):
        print(_format_tree(tree, w, i))
    if topo.n == 1:
        print("one device: nothing to move")
        return 0
    bound = float(p.bound)
    frac = f" ({100 * p.rate / bound:.1f}% of it)" if bound > 0 else ""
    print(f"rate {p.rate:.4g} GB/s; cut bound {bound:.4g} GB/s{frac}")

    rp = rings(topo)
    ra, ta = algbw(rp, args.collective), algbw(p, args.collective)
    print()
    print(f"NCCL-style rings: {rp.describe()}")
    unit = "algbw, GB/s of data per device" if args.collective == "allreduce" else "GB/s"
    print(f"trees {ta:.4g} vs rings {ra:.4g} ({unit}): {ta / ra:.2f}x" if ra > 0 else "")
    tt, tc = best_time(p, args.collective, args.size)
    rt, _ = best_time(rp, args.collective, args.size)
    if tt > 0:
        print(f"model at {args.size / 1e6:g} MB: trees {tt:.1f} us (chunk {int(tc or 0)} B), "
              f"rings {rt:.1f} us: {rt / tt:.2f}x")
    if hasattr(p, "explain"):
        print()
        print(p.explain())
    if args.plot:
        from .draw import draw_plan

        draw_plan(p, path=args.plot)
        print(f"\ntrees drawn to {args.plot}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args.size, args.dtype, args.plot)


def cmd_crossover(args: argparse.Namespace) -> int:
    from .tuning import derive

    c = derive(args.runs)
    print(f"# derived from {len(c.sources)} run(s) of {c.ranks} x {c.device_kind}; "
          "paste into jax_blink/tuning.py CROSSOVERS")
    print(f"Crossover({c.device_kind!r}, {c.ranks}, {c.lax_ranges!r}, (")
    for src in c.sources:
        print(f"    {src!r},")
    print("))")
    for lo, hi in c.lax_ranges:
        print(f"# lax.psum for {lo} <= bytes per rank" + (f" < {hi}" if hi is not None else ""))
    if not c.lax_ranges:
        print("# no size goes to lax.psum: the executor won or tied somewhere at every size")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Blink-style collectives for JAX: plans and demos.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    pp = sub.add_parser("plan", help="plan trees for a collective on a topology, compare with rings")
    pp.add_argument("--topology", default="discover",
                    help="dgx1v, dgx1p, dgx2, nvswitch:N or discover (default: the jax devices here)")
    pp.add_argument("--devices", default=None,
                    help="the allocation: device ids such as 0,1,4 or 0-3 (default: all)")
    pp.add_argument("--collective", default="allreduce", choices=["broadcast", "reduce", "allreduce"])
    pp.add_argument("--root", type=int, default=None, help="root device id (default: the planner's choice)")
    pp.add_argument("--method", default="exact", choices=["exact", "mwu"])
    pp.add_argument("--pcie", action="store_true", help="DGX-1 presets: add PCIe links where there is no NVLink")
    pp.add_argument("--size", type=_size, default=500e6, help="bytes per device for the model (default 500M)")
    pp.add_argument("--plot", default=None, metavar="PNG", help="draw the trees to this file")
    pp.set_defaults(func=cmd_plan)

    pd = sub.add_parser("demo", help="run jax_blink.all_reduce against lax.psum on the devices here")
    pd.add_argument("--size", type=int, default=1 << 20, help="elements per device (default 1048576)")
    pd.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "int32"])
    pd.add_argument("--plot", default=None, metavar="PNG", help="draw the all-reduce trees to this file")
    pd.set_defaults(func=cmd_demo)

    pc = sub.add_parser("crossover", help="derive the psum dispatch entry (jax_blink/tuning.py) from bench runs")
    pc.add_argument("runs", nargs="+", metavar="JSON",
                    help="all-reduce bench results (python -m jax_blink.bench -o DIR) of one machine")
    pc.set_defaults(func=cmd_crossover)

    # Handled by main() before parsing (its arguments belong to the script); listed for --help.
    sub.add_parser("run", help="run SCRIPT.py [ARGS...] as python would, its lax collectives on "
                               "jax_blink (jax_blink.install())")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (0 ok, 2 bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        # `run SCRIPT.py [ARGS...]`: the script as `python SCRIPT.py ARGS...` runs it, with the
        # switch on (jax_blink.switch). Its arguments are its own, its environment untouched, and
        # its exit status and exceptions pass through.
        from .switch import run_script
        return run_script(argv[1:])
    _ensure_host_devices()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return int(args.func(args) or 0)
    except (UsageError, ValueError) as e:  # the library says what is wrong with a ValueError
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head`
        sys.stdout = open(os.devnull, "w")
        return 0
    except SystemExit as e:  # --help
        return int(e.code or 0) if not isinstance(e.code, str) else 2


if __name__ == "__main__":
    sys.exit(main())
