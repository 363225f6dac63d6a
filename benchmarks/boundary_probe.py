"""What a gradient boundary costs XLA's fusions, with no communication: the training step of the
train tool with the all-reduce taken out, and the gradients passed through
``lax.optimization_barrier`` in several shapes. One device is enough (every mode is one device's
program; a barrier stays in XLA:GPU's program whatever the device count), so this runs on a
one-GPU machine.

Modes (each is the step of ``none`` with something at the gradients' place):

- ``none``: nothing (the gradients fuse into the update as XLA likes);
- ``flat``: each DDP bucket packed into one flat buffer behind a barrier (the train tool's
  ``none-barrier``: what psum's and the executor's operands cost the fusions);
- ``leaves``: each bucket's leaves as they are, one barrier per bucket, nothing packed (what a
  collective that took the leaves without packing would cost);
- ``leaf``: every leaf behind a barrier of its own;
- ``tree``: the whole tree behind one barrier;
- ``leaves-grads``: as ``leaves``, the buckets' gradients only (BatchNorm's statistics, values of
  the forward pass that travel in the same buckets, left out); ``leaves-last`` only the last
  bucket held, ``leaves-but-last`` every bucket but the last: which groups split the fusions;
  ``leaves-last-K`` (K of 2, 4, 16, 40) the last bucket only, cut into K groups of consecutive
  leaves, one barrier each: how small a group still splits them (one leaf per barrier, ``leaf``,
  does not);
- ``flat-then-tree``, ``leaves-then-tree``: ``flat`` or ``leaves``, then the whole tree behind one
  more barrier before the update (as a step would tie every bucket's result together after its
  last wait): whether the update's side of the boundary is what splits them;
- ``tree-packed``, ``tree-packed-barrier``: the tree's leaves in leaf order, cut into groups of at
  most the bucket cap as the switch merges ``lax.psum(tree)`` (:func:`jax_blink.switch.merge.merge_groups`),
  each group packed by :func:`jax_blink.lowering.packing.join` with ``bucket_packing="xla"`` or
  ``"barrier"``, held by one barrier (the stand-in for the call) and split back: the switch's
  merged calls without their communication, where XLA fused GPT-2 medium's bias and LayerNorm
  reductions into the packing (change 31 of the lab notes);
- ``flat-barrier``, ``call-flat-barrier``: ``flat`` and ``call-flat`` with each bucket packed as
  jax_blink packs the buckets of :func:`jax_blink.value_and_grad_overlapped` and of the switch by
  default (``bucket_packing="barrier"``: each leaf behind a barrier of its own, then XLA's
  concatenation): whether that packing still splits the fusions that ``flat`` splits;
- ``overlap-calls``, ``overlap-calls-nohold``: not the step of ``none`` but the explicit overlapped
  step (``value_and_grad_overlapped``, DDP's buckets started inside the backward pass), each
  start and done an identity custom call: its program without communication, with its holds
  (``hold="recent"``: the values made since the previous start pass through a barrier with each
  start) or with none held (``hold="none"``): which part of the starts splits the fusions that the overlapped
  step splits beyond psum's (change 32 of the lab notes); ``overlap-calls-weights`` holds the
  weights that only matrix products and convolutions read instead (``hold="weights"``); each
  with ``-last16`` is the same with the backward pass's last bucket in 16 starts
  (``last_bucket_pieces=16``: the train tool's ``*-last16`` modes). For these three it also prints where XLA's schedule
  put each start: the kernels before it, and the matrix products or convolutions after it (what
  a real start could run beside; a start sunk to the end of the step has none);
- ``call-flat``, ``call-leaves``, ``call-leaf``: the same three shapes with an identity custom call
  (``benchmarks/boundary_probe_ffi.cc``, built at the first use with nvcc or g++: each result
  aliases its operand, no copy, no kernel) in place of the barrier: a stand-in for a collective's
  start that takes a bucket packed (as jax_blink's does), its leaves as they are, or one leaf.

For each mode it prints the step's time (MEASURED: median of ``--runs`` rounds, the modes taking
turns, ``--chain`` steps in a row per round), and the kernels of the compiled program read from
its optimized HLO (the entry computation's fusions and library calls: COUNTED, not timed), with
the fusion kinds that differ most from ``none``'s.

    python benchmarks/boundary_probe.py --model resnet --size medium --batch 128
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import statistics
import sys
from pathlib import Path

import jax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_blink.lowering.mesh import platform as _platform
from jax_blink.switch.merge import consecutive_groups
from jax_blink.tools.arguments import UsageError, output_folder

#: The last bucket cut into this many groups of consecutive leaves (``leaves-last-K``).
LAST_BUCKET_CUTS = (2, 4, 16, 40)
MODES = ("none", "flat", "leaves", "leaf", "tree", "call-flat", "call-leaves", "call-leaf",
         "leaves-grads", "leaves-last", "leaves-but-last", "flat-then-tree", "leaves-then-tree",
         *(f"leaves-last-{k}" for k in LAST_BUCKET_CUTS), "tree-packed", "tree-packed-barrier",
         "flat-barrier", "call-flat-barrier", "overlap-calls", "overlap-calls-nohold", "overlap-calls-weights",
         "overlap-calls-last16", "overlap-calls-nohold-last16", "overlap-calls-weights-last16")
#: The modes that are not the step of ``none`` with a boundary but the explicit overlapped step
#: (``value_and_grad_overlapped``) with each start and done an identity custom call, and the train
#: tool's mode each one is (hold="recent", "none" or "weights").
OVERLAP_SHAPES = {"overlap-calls": "overlap", "overlap-calls-nohold": "overlap-none",
                  "overlap-calls-weights": "overlap-weights", "overlap-calls-last16": "overlap-last16",
                  "overlap-calls-nohold-last16": "overlap-none-last16",
                  "overlap-calls-weights-last16": "overlap-weights-last16"}
_TARGET = "jax_blink_boundary_probe_identity"
#: The same identity call under another name, for the overlap shapes' starts: where XLA placed them.
_START_TARGET = "jax_blink_boundary_probe_start"

#: Entry-computation opcodes that launch no kernel.
_NO_KERNEL = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "opt-barrier",
              "after-all", "partition-id", "replica-id"}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(")


def _build_identity(platform: str) -> Path:
    """The identity custom call's library for ``platform`` ("gpu" or "cpu"), built once per source."""
    import hashlib
    import subprocess
    import tempfile
    source = Path(__file__).with_name("boundary_probe_ffi.cc")
    digest = hashlib.sha256(source.read_bytes() + platform.encode()).hexdigest()[:12]
    so = Path(tempfile.gettempdir()) / f"jax_blink_boundary_probe_{platform}_{digest}.so"
    if so.exists():
        return so
    include = ["-I", jax.ffi.include_dir()]
    if platform == "gpu":
        cmd = ["nvcc", "-std=c++17", "-O2", "-shared", "-Xcompiler", "-fPIC", "-cudart", "static",
               "-DPROBE_CUDA", "-x", "cu", *include, str(source), "-o", str(so) + ".tmp"]
    else:
        cmd = ["g++", "-std=c++17", "-O2", "-shared", "-fPIC", "-w", *include, str(source), "-o", str(so) + ".tmp"]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    except FileNotFoundError:
        raise SystemExit(f"boundary_probe: the call-* modes build {source.name} with {cmd[0]}, which is not "
                         f"on PATH; install it or leave those modes out of --modes") from None
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"boundary_probe: building {source.name} failed:\n{e.stderr[-2000:]}") from None
    Path(str(so) + ".tmp").replace(so)
    return so


_registered: set[str] = set()


def identity_call(values: list, target: str = _TARGET) -> list:
    """``values`` through one identity custom call (each result aliases its operand); ``target``:
    the call's name (``_TARGET``, or ``_START_TARGET`` for a start)."""
    import ctypes
    platform = _platform()
    if platform not in _registered:
        lib = ctypes.cdll.LoadLibrary(str(_build_identity(platform)))
        for name in (_TARGET, _START_TARGET):
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(lib.BoundaryProbeIdentity),
                                        platform="CUDA" if platform == "gpu" else "cpu")
        _registered.add(platform)
    call = jax.ffi.ffi_call(target, [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in values],
                            input_output_aliases={i: i for i in range(len(values))})
    return list(call(*values))


def boundary(mode: str, tree, layout):
    """``tree`` (``{"grads", "stats"}``) as the step of ``mode`` hands it to the update."""
    if mode == "none":
        return tree
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; one of {', '.join(MODES)}")
    if mode in OVERLAP_SHAPES:
        raise ValueError(f"{mode} is a step of its own, not a boundary in the step of none: make_steps builds it")
    if mode.endswith("-then-tree"):
        return lax.optimization_barrier(boundary(mode.removesuffix("-then-tree"), tree, layout))
    if mode.startswith("tree-packed"):
        return _tree_packed(tree, layout.bucket_bytes, "barrier" if mode.endswith("-barrier") else "xla")
    shape = mode.removeprefix("call-")
    hold = identity_call if mode.startswith("call-") else (lambda vs: list(lax.optimization_barrier(vs)))
    if shape == "flat":
        return layout.unpack([hold([b])[0] for b in layout.pack(tree)])
    if shape == "flat-barrier":  # packed as jax_blink's own buckets are by default (bucket_packing="barrier")
        from jax_blink.options import override
        platform = _platform()
        with override(bucket_packing="barrier"):
            return layout.unpack([hold([b])[0] for b in layout.pack(tree, platform)], platform)
    if shape == "tree":
        return lax.optimization_barrier(tree)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if shape == "leaf":
        leaves = [hold([v])[0] for v in leaves]
    else:  # leaves: one per bucket (or some buckets, or their gradients only)
        last = len(layout.buckets) - 1
        cuts = int(shape.rsplit("-", 1)[1]) if shape.startswith("leaves-last-") else 1
        for b, bucket in enumerate(layout.buckets):
            if (shape.startswith("leaves-last") and b != last) or (shape == "leaves-but-last" and b == last):
                continue
            slots = [s for s in bucket.slots if shape != "leaves-grads" or s.path.startswith("['grads']")]
            for group in consecutive_groups(slots, cuts):
                held = hold([leaves[s.leaf] for s in group])
                for s, v in zip(group, held):
                    leaves[s.leaf] = v
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _tree_packed(tree, cap_bytes: int, packing: str):
    """``tree`` as the switch's merged calls take it, packed with ``bucket_packing=packing``, each
    group's flat operand behind one barrier and split back (no communication)."""
    from jax_blink.lowering import packing as _packing
    from jax_blink.options import override
    from jax_blink.switch.merge import merge_groups
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    platform = _platform()
    with override(bucket_packing=packing):
        for group in merge_groups([jax.ShapeDtypeStruct(v.shape, v.dtype) for v in leaves], cap_bytes):
            flat = lax.optimization_barrier(_packing.join([leaves[i] for i in group], platform))
            for i, v in zip(group, _packing.split(flat, [leaves[i].shape for i in group], platform)):
                leaves[i] = v
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _entry_kernels(hlo_text: str):
    """The kernel-launching instructions of the optimized HLO's entry computation, in the order it
    is printed (its schedule): (name, opcode, line) each."""
    in_entry = False
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY"):
            in_entry = True
            continue
        if in_entry and line.startswith("}"):
            return
        m = _INSTRUCTION.match(line) if in_entry else None
        if m and m.group(2) not in _NO_KERNEL:
            yield m.group(1), m.group(2), line


def kernels(hlo_text: str) -> collections.Counter:
    """Kernel-launching instructions of the optimized HLO's entry computation, by name stem
    (``loop_add_fusion.12`` counts as ``loop_add_fusion``; a library call by its opcode)."""
    return collections.Counter(re.sub(r"[.\d]+$", "", name) if op == "fusion" else op
                               for name, op, _ in _entry_kernels(hlo_text))


#: A kernel of the entry computation that is a matrix product or convolution (a library call or
#: a fusion around one): the compute a started all-reduce can run beside.
_PRODUCT = re.compile(r"cublas|cudnn|gemm|\bdot\b|convolution|conv\b")


def start_placement(hlo_text: str) -> list[tuple[int, int]]:
    """Where XLA's schedule put each start of an overlap shape: for each ``_START_TARGET`` call of
    the optimized HLO's entry computation (printed in schedule order), in order, the kernels
    before it and the matrix products or convolutions after it (what it can overlap with)."""
    kinds = ["start" if _START_TARGET in line
             else "product" if _PRODUCT.search(name) or (op == "custom-call" and _PRODUCT.search(line))
             else "kernel" for name, op, line in _entry_kernels(hlo_text)]
    return [(sum(1 for k in kinds[:i] if k != "start"), kinds[i:].count("product"))
            for i, k in enumerate(kinds) if k == "start"]


@contextlib.contextmanager
def calls_for_starts():
    """While ``value_and_grad_overlapped`` is traced: each bucket's start and done an identity
    custom call (the start's operand through it; the done of a bucket also takes the last start's
    operand, as the real done's token); the holds stay the step's own. The explicit step's program
    on one device, without communication."""
    from jax_blink.api import buckets as _b
    from jax_blink.api.overlap import AllReduceHandle

    def start_in_order(buf, started, axis_name, *, full_grid, **kwargs):
        (passed,) = identity_call([buf], _START_TARGET)
        started.append(AllReduceHandle(passed, passed, "probe", tuple(buf.shape)))
        return started[-1]

    def done_after_last(handles, last):
        return [identity_call([h.result] + ([last.passed] if h is not last else []))[0] for h in handles]

    saved = _b.start_in_order, _b.done_after_last
    _b.start_in_order, _b.done_after_last = start_in_order, done_after_last
    try:
        yield
    finally:
        _b.start_in_order, _b.done_after_last = saved


def make_steps(dp, modes):
    """{mode: compiled step} for ``dp`` (a :class:`~jax_blink.tools.train.step.DataParallel`): its
    step without all-reduce, with the gradients held as ``mode`` holds them (for
    :data:`OVERLAP_SHAPES`, the explicit overlapped step with identity calls for its collectives)."""
    steps = {}
    for m in modes:
        if m in OVERLAP_SHAPES:  # the train tool's overlap (hold="recent"), overlap-none or overlap-weights
            with calls_for_starts():
                steps[m] = dp.step_fn(OVERLAP_SHAPES[m]).lower(dp.state0, dp.batches[0]).compile()
        else:
            steps[m] = dp.step_fn("none", combine=lambda tree, m=m: boundary(m, tree, dp.layout)) \
                .lower(dp.state0, dp.batches[0]).compile()
    return steps


def _folder(option: str):
    """An argparse type: a folder to write into (jax_blink.tools.arguments.output_folder), checked
    before anything compiles."""
    def check(text: str) -> Path:
        try:
            return Path(output_folder(option, text))
        except UsageError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"argument {option}: ")) from None
    return check


def _json_file(text: str) -> Path:
    """An argparse type: a file to write, not a folder, in a folder that exists or can be made."""
    p = Path(text)
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"got {text!r}, a folder; give a file name")
    try:
        _folder("--out")(str(p.absolute().parent))
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"got {text!r}, whose folder cannot hold it: {e}") from None
    return p


def main(argv=None) -> int:
    from jax_blink.tools.timing import Ready, interleaved_times
    from jax_blink.tools.train.__main__ import UsageError, model_config, parser as train_parser
    from jax_blink.tools.train.step import DataParallel

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("resnet", "gpt2"), default="resnet")
    p.add_argument("--size", default="tiny", choices=("tiny", "small", "full", "medium"))
    p.add_argument("--batch", type=int, default=None, help="per device (default: the size's)")
    p.add_argument("--modes", default=",".join(MODES[:5]), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--runs", type=int, default=10, help="timed rounds; 0: compile and count kernels only")
    p.add_argument("--chain", type=int, default=4)
    p.add_argument("--devices", type=int, default=1, help="the mesh's size (default 1)")
    p.add_argument("--out", type=_json_file, default=None, help="write a JSON of the results here")
    p.add_argument("--profile", type=_folder("--profile"), default=None,
                   help="trace one step of each mode (jax.profiler) into this folder")
    p.add_argument("--hlo", type=_folder("--hlo"), default=None, help="write each mode's optimized HLO into this folder")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        p.error(f"--modes: unknown {bad or 'empty'}; choose from {', '.join(MODES)}")
    if args.devices < 1 or args.devices > len(jax.devices()):
        p.error(f"--devices {args.devices}: give 1 to {len(jax.devices())} (the devices of this process)")
    if args.runs < 0 or args.chain < 1:
        p.error("--runs must be at least 0 and --chain at least 1")
    if args.runs == 0 and args.profile:
        p.error("--profile traces the timed steps: give --runs 1 or more")

    train_argv = ["--model", args.model, "--size", args.size]
    if args.batch is not None:
        train_argv += ["--batch", str(args.batch)]
    try:  # the train tool's own checks of the model's shape
        cfg = model_config(train_parser().parse_args(train_argv))
    except UsageError as e:
        p.error(str(e).split(" (see ")[0])
    mesh = jax.make_mesh((args.devices,), ("data",), devices=jax.devices()[:args.devices])
    dp = DataParallel(args.model, cfg, mesh)
    steps = make_steps(dp, modes)
    counts = {m: kernels(c.as_text()) for m, c in steps.items()}
    placement = {m: start_placement(c.as_text()) for m, c in steps.items() if m in OVERLAP_SHAPES}
    if args.hlo:
        args.hlo.mkdir(parents=True, exist_ok=True)
        for m, c in steps.items():
            (args.hlo / f"{args.model}-{args.size}-{m}.hlo.txt").write_text(c.as_text())

    batch = dp.batches[0]

    def chain_of(c):
        def run(s):
            for _ in range(args.chain):
                s, loss = c(s, batch)
            return Ready((s, loss))
        return run

    times = (interleaved_times([chain_of(steps[m]) for m in modes], dp.state0, args.runs) if args.runs
             else [[float("nan")] for _ in modes])
    if args.profile:
        for m in modes:
            jax.block_until_ready(steps[m](dp.state0, batch))
            with jax.profiler.trace(str(args.profile / m)):
                jax.block_until_ready(steps[m](dp.state0, batch))
    med = {m: statistics.median(ts) / args.chain * 1e3 for m, ts in zip(modes, times)}
    kind = f"{len(mesh.devices.flat)} x {jax.devices()[0].device_kind}"
    timed = (f"step time MEASURED (median of {args.runs} rounds of {args.chain} steps in a row, modes taking "
             f"turns)" if args.runs else "not timed (--runs 0)")
    print(f"{args.model} {args.size} (batch {cfg.batch} per device), {kind}, jax {jax.__version__}; "
          f"{len(dp.layout.buckets)} buckets; {timed}; kernels COUNTED in the optimized HLO")
    base = counts.get("none")
    width = max(len(m) for m in modes)
    for m in modes:
        extra = "" if "none" not in med or not args.runs else f"  ({med[m] - med['none']:+.3f} ms over none)"
        when = f"{med[m]:9.3f} ms{extra}" if args.runs else "not timed"
        print(f"  {m:{width}s} {when}  kernels {sum(counts[m].values())}")
        if base is not None and m != "none":
            diff = {k: counts[m][k] - base[k] for k in set(counts[m]) | set(base)}
            top = sorted((k for k in diff if diff[k]), key=lambda k: -abs(diff[k]))[:6]
            if top:
                print(f"  {'':{width}s} vs none: " + ", ".join(f"{k} {diff[k]:+d}" for k in top))
        if m in placement:
            print(f"  {'':{width}s} starts (COUNTED in the schedule): kernels before each "
                  f"{[b for b, _ in placement[m]]} of {sum(counts[m].values())}; matrix products or "
                  f"convolutions after each {[a for _, a in placement[m]]}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"model": args.model, "size": args.size, "batch": cfg.batch,
                                        "devices": kind, "jax": jax.__version__, "chain": args.chain,
                                        "runs": args.runs, "step_ms": med if args.runs else None,
                                        "kernels": {m: dict(c) for m, c in counts.items()},
                                        "start_placement": {m: [{"kernels_before": b, "products_after": a}
                                                                for b, a in pl] for m, pl in placement.items()},
                                        "times_s": {m: ts for m, ts in zip(modes, times)} if args.runs else None},
                                       indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
