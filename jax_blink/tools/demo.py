"""The main job, ``python -m jax_blink demo``: the Blink story told with the devices at hand.

1. The paper's result in the model: Blink's trees against NCCL-style rings on partial allocations
   of DGX-1V and DGX-1P machines (:mod:`jax_blink.tools.simulate`; modelled, not measured).
2. This machine's topology in the same model (on CPU host devices, a uniform mesh: trees equal
   rings there).
3. Every collective run by jax_blink's executor on the devices here and checked against ``lax``.
4. ``jax_blink.all_reduce`` timed against ``lax.psum`` at a few sizes (on GPUs 1 KiB to 256 MiB), in
   turns, in one run, under the dispatch in force: the path each size takes is read from the
   compiled program, and printed with the measurement ``dispatch="auto"`` followed (a shipped or
   tuned entry, or the meanwhile rule where this machine has none).

With one device there is no collective to run: the demo says what one device can and cannot show.
Every number printed says whether it is modelled or measured, on which devices, at which size.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import numpy as np

#: Sizes (bytes per rank) the demo times by default: where the CPU executor wins (<= 16K) and
#: where the dispatch table sends all-reduces to lax.psum (64K, 1M on 8 CPU host devices).
DEFAULT_SIZES = (1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20)
#: Sizes the demo times by default on GPUs: 1 KiB to 256 MiB, so that it shows where the executor
#: loses too (on 4 GPUs of a switch it won up to 4 MiB and lost from 16 MiB, issue 27).
GPU_SIZES = tuple(1 << s for s in range(10, 29, 2))


def default_sizes(platform: str) -> tuple[int, ...]:
    """The sizes the demo times when none are given: :data:`GPU_SIZES` on GPUs, else :data:`DEFAULT_SIZES`."""
    return GPU_SIZES if platform in ("gpu", "cuda") else DEFAULT_SIZES
#: Bytes per rank of the correctness checks.
CHECK_BYTES = 4 << 10
#: The size of the paper's comparison (500 MB per GPU), for the model's times.
PAPER_BYTES = 500_000_000
#: (machine, allocation, collective): partial allocations of the paper's machines, and one full one.
PAPER_CASES = (
    ("dgx1v", (0, 1, 4), "allreduce"),
    ("dgx1v", (1, 4, 5, 6, 7), "allreduce"),
    ("dgx1v", (0, 3, 4), "broadcast"),
    ("dgx1v", (0, 1, 2, 3, 4), "broadcast"),
    ("dgx1v", (0, 1, 2, 3, 4, 5, 6, 7), "allreduce"),
    ("dgx1p", (0, 1, 2, 3, 4), "allreduce"),
    ("dgx1p", (0, 1, 4, 5), "allreduce"),
)
_MACHINE = {"dgx1v": "DGX-1V", "dgx1p": "DGX-1P"}


def fmt_bytes(nbytes: int) -> str:
    """``nbytes`` in the size grammar where it is exact (64M, 512K), else the plain count."""
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return str(nbytes)


def executors_line(built: dict[str, bool], platform: str) -> str:
    """Which executors this install has, and which of them can run here."""
    cpu = "built" if built.get("cpu") else "NOT built (collectives fall back to lax)"
    if built.get("gpu"):
        gpu = ("built" if platform in ("gpu", "cuda") else
               "built (compiled where nvcc was found; no GPU here, so it does not run)")
    else:
        gpu = "not built (no nvcc at install time; on GPUs jax_blink falls back to lax)"
    return f"executors (jax_blink.backends() = {built}): CPU executor {cpu}; CUDA executor {gpu}"


def bytes_needed(nbytes: int, dtype: str, devices: Sequence) -> int:
    """Memory the demo takes for ``nbytes`` per rank: on CPU host devices all of it (they share the
    host's memory), on GPUs one device's share."""
    # input, our output, psum's output, the check's float32 copies on the host
    per_rank = 4 * nbytes + (3 * 4 * max(1, nbytes // np.dtype(_np_dtype(dtype)).itemsize)
                             if devices[0].platform == "cpu" else 0)
    return per_rank * (len(devices) if devices[0].platform == "cpu" else 1)


def _np_dtype(dtype: str):
    import jax.numpy as jnp

    return jnp.dtype(dtype)


# ------------------------------------------------------------------------------ 1. the paper
def paper_lines() -> list[str]:
    """The paper's comparison on a few allocations, through the model."""
    from jax_blink.planning import forms
    from jax_blink.planning.topology import Topology
    from jax_blink.tools.simulate import compare

    out = [f"1. The paper's result, reproduced in the model (MODELLED, not measured: link rates of the "
           "preset, alpha-beta model of jax_blink.tools.simulate, 500 MB = 5e8 bytes per GPU):",
           "   Blink's trees against NCCL-style rings on allocations of the paper's machines; algbw = GB/s "
           "per GPU (bytes of one GPU's buffer / time).",
           f"   {'machine':<7} {'GPUs':<16} {'collective':<10} {'trees':>14} {'NCCL-style rings':>22} "
           f"{'rate x':>7} {'time x':>7}   jax_blink's all-reduce form (time x)"]
    for preset, devs, coll in PAPER_CASES:
        sub = Topology.preset(preset).subset(list(devs))
        c = compare(sub, coll, PAPER_BYTES, root=None if coll == "allreduce" else devs[0])
        trees = f"{c['num_trees']} @ {c['tree_algbw']:.4g} GB/s"
        rings = f"{c['num_rings']} {c['ring_kind']} @ {c['ring_algbw']:.4g} GB/s"
        chosen = ""
        if coll == "allreduce":  # the planner runs the fastest form by the model, rings among them
            f = forms.choose(sub, PAPER_BYTES).form
            chosen = f"   {f.name} ({c['ring_time_us'] / f.time_us:.2f}x)"
        out.append(f"   {_MACHINE[preset]:<7} {','.join(map(str, devs)):<16} {coll:<10} {trees:>14} "
                   f"{rings:>22} {c['rate_speedup']:>6.2f}x {c['speedup']:>6.2f}x{chosen}")
    out += ["   rate x: trees' algbw / rings' algbw (large sizes); time x: ring time / tree time at 500 MB "
            "(each at its best chunk). Rings on 'pcie': the allocation's NVLinks hold no ring, NCCL takes PCIe.",
            "   jax_blink's all-reduce form: the one its planner runs there, the fastest by the same model of "
            "Blink's trees, shallower trees, reduce-scatter + all-gather and rings (never below rings).",
            "   The paper MEASURED on DGX-1V: broadcast up to 8x, all-reduce up to 6x, about 2x on average. "
            "Where every GPU is linked alike (all 8), trees and rings tie.",
            "   Every allocation of 3-8 GPUs: python benchmarks/paper_comparison.py (in a checkout); one: "
            "python -m jax_blink plan --topology dgx1v --devices 0,1,4"]
    return out


# ------------------------------------------------------------------------------ 2. this machine
def uniform_mesh(topo) -> bool:
    """Whether every pair of ``topo``'s devices is linked at one and the same rate (NVSwitch, host devices)."""
    g = topo.simple_graph()
    rates = {topo.capacity(a, b) for a, b in g.edges}
    return g.number_of_edges() == topo.n * (topo.n - 1) and len(rates) == 1


def likely_machine(device_kind: str) -> str:
    """The preset a single GPU of ``device_kind`` most likely belongs to (its multi-GPU board)."""
    k = device_kind.upper()
    if "V100" in k:
        return "dgx1v"
    if "P100" in k:
        return "dgx1p"
    return "nvswitch:8"  # A100/H100/H200/B200 SXM boards: 8 GPUs on NVSwitch


def machine_lines(topo, nbytes: int, what: str, calibrate: bool = False) -> list[str]:
    """Trees against rings on ``topo`` in the model, at large sizes and at ``nbytes`` per rank;
    with ``calibrate`` (GPUs of the kind the measurement was made on) also the model's rate at the
    efficiency such links were measured to reach (:func:`calibrated_line`)."""
    from jax_blink.planning.packing import plan as make_plan
    from jax_blink.tools.simulate import compare

    p = make_plan(topo, "allreduce")
    c = compare(topo, "allreduce", nbytes, plan=p)
    n_trees, n_rings = c["num_trees"], c["num_rings"]
    out = [f"2. {what} (MODELLED: link rates of {topo.name}, not measured):",
           f"   all-reduce on {topo.n} devices: {n_trees} tree{'s' if n_trees != 1 else ''} at "
           f"{c['tree_algbw']:.4g} GB/s algbw per rank; {n_rings} {c['ring_kind']} ring{'s' if n_rings != 1 else ''}"
           f" at {c['ring_algbw']:.4g} GB/s: {c['rate_speedup']:.2f}x at large sizes"]
    calibrated = calibrated_line(topo, c["tree_algbw"]) if calibrate else None
    if calibrated:
        out.append(calibrated)
    if uniform_mesh(topo):
        # Here the model's time at a size differs only by its per-hop latency: not Blink's point.
        out.append(f"   {topo.name} is a uniform mesh (every pair the same modelled rate): trees == rings "
                   "in rate here. Blink's gain needs links that differ or are missing (section 1).")
    else:
        out.append(f"   at {fmt_bytes(nbytes)} bytes per rank: trees {c['tree_time_us']:.1f} us, rings "
                   f"{c['ring_time_us']:.1f} us (modelled): {c['speedup']:.2f}x")
    return out


def calibrated_line(topo, nominal_algbw: float) -> str | None:
    """The model's all-reduce rate scaled by what such links were measured to reach
    (:func:`jax_blink.planning.topology.measured_efficiency`), with the measurement named; None
    where no measurement covers the links (PCIe, CPU host devices)."""
    from jax_blink.planning.topology import measured_efficiency

    found = measured_efficiency(topo)
    if found is None:
        return None
    eff, source = found
    return (f"   calibrated to what such links were measured to carry ({eff:.2f} of the nominal rate; {source}): "
            f"{nominal_algbw * eff:.4g} GB/s algbw per rank, {nominal_algbw * eff * 2 * (topo.n - 1) / topo.n:.4g} "
            "busbw (MODELLED)")


# ------------------------------------------------------------------------------ 3. checks
def check_lines(mesh, axis: str, dtype: str) -> tuple[list[str], bool]:
    """Every collective through the executor (dispatch=blink) against its lax reference."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jax_blink.options.settings import override
    from jax_blink.tools.timing import COLLECTIVES, TOLERANCE, runs_executor

    n = mesh.shape[axis]
    itemsize = jnp.dtype(dtype).itemsize
    count = max(n, CHECK_BYTES // itemsize // n * n)
    rng = np.random.default_rng(1)
    host = (rng.integers(-1000, 1000, n * count, dtype=np.int32) if jnp.issubdtype(dtype, jnp.integer)
            else rng.standard_normal(n * count, dtype=np.float32))
    x = jax.device_put(jnp.asarray(host, dtype), NamedSharding(mesh, P(axis)))
    tol = TOLERANCE.get(dtype, 0)
    devices = mesh.devices.reshape(-1)
    out = [f"3. The collectives run by jax_blink's executor on the {n} x {devices[0].device_kind} here and "
           f"CHECKED against lax ({fmt_bytes(count * itemsize)} bytes per rank of {dtype}; dispatch=blink so that "
           "each runs on the executor):"]
    names = {"allreduce": ("jax_blink.all_reduce", "lax.psum"), "broadcast": ("jax_blink.broadcast", "lax.psum, root's"),
             "reduce": ("jax_blink.reduce", "lax.psum on the root"),
             "allgather": ("jax_blink.all_gather", "lax.all_gather"),
             "reducescatter": ("jax_blink.reduce_scatter", "lax.psum_scatter")}
    ok = True
    spec = P(axis)
    for key, coll in COLLECTIVES.items():
        with override(dispatch="blink"):
            ours = jax.jit(jax.shard_map(lambda v, c=coll: c.ours(v, axis), mesh=mesh, in_specs=spec,
                                         out_specs=spec))
            on_executor = runs_executor(ours, x)
            a = np.asarray(ours(x).astype(jnp.float32)).reshape(n, -1)
        ref = jax.jit(jax.shard_map(lambda v, c=coll: c.ref(v, axis), mesh=mesh, in_specs=spec, out_specs=spec))
        b = np.asarray(ref(x).astype(jnp.float32)).reshape(n, -1)
        wrong = ~np.isclose(a, b, rtol=tol, atol=tol * n * 4)
        if coll.replicated:
            wrong |= a != a[:1]
        bad = int(wrong.sum())
        ok &= bad == 0 and on_executor
        ours_name, ref_name = names[key]
        where = "executor" if on_executor else "NOT on the executor (lax ran: see jax_blink.explain)"
        verdict = "agrees" if bad == 0 else f"DIFFERS in {bad} of {a.size} elements"
        out.append(f"   {ours_name:<24} vs {ref_name:<22} ran on the {where}; {verdict}"
                   f"{' (within ' + dtype + ' rounding)' if bad == 0 and tol else ''}")
    return out, ok


# ------------------------------------------------------------------------------ 4. timings
def timed_programs(mesh, axis: str, nbytes: int, dtype: str):
    """``(ours, ref, x)``: ``jax_blink.all_reduce`` and ``lax.psum`` as jitted shard_maps over
    ``axis`` and an operand of ``nbytes`` per rank. ``ours`` is traced under the options in force
    (the dispatch the user has), so it runs what a user's call would run."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_blink

    n = mesh.shape[axis]
    count = nbytes // jnp.dtype(dtype).itemsize
    spec = P(axis)
    ours = jax.jit(jax.shard_map(lambda v: jax_blink.all_reduce(v, axis), mesh=mesh, in_specs=spec, out_specs=spec))
    ref = jax.jit(jax.shard_map(lambda v: lax.psum(v, axis), mesh=mesh, in_specs=spec, out_specs=spec))
    rng = np.random.default_rng(0)
    host = (rng.integers(-1000, 1000, n * count, dtype=np.int32) if jnp.issubdtype(dtype, jnp.integer)
            else rng.standard_normal(n * count, dtype=np.float32))
    x = jax.device_put(jnp.asarray(host, dtype), NamedSharding(mesh, spec))
    ours.lower(x)  # traced now, under the options in force: later calls reuse this trace
    return ours, ref, x


def timing_lines(mesh, axis: str, sizes: Sequence[int], dtype: str, runs: int = 5,
                 min_seconds: float = 0.2) -> tuple[list[str], bool]:
    """``jax_blink.all_reduce`` (as the dispatch in force runs it) against ``lax.psum``, in turns.

    Each row names the path the dispatch decided and the path the compiled program holds; they
    must agree (returns False, and says so, where they do not)."""
    from jax_blink.lowering.decision import choice, dispatch
    from jax_blink.lowering.mesh import device_kind
    from jax_blink.options.settings import config
    from jax_blink.tools.timing import interleaved_times, runs_executor

    devices = mesh.devices.reshape(-1)
    n = len(devices)
    kind = device_kind()
    out = [f"4. jax_blink.all_reduce against lax.psum, TIMED here (measured: wall time per call of one jitted "
           f"shard_map on {n} x {devices[0].device_kind}, {dtype}, median of >= {runs} runs each, the two "
           f"taking turns; dispatch={config.dispatch}):",
           f"   {'bytes/rank':>10}  {'jax_blink.all_reduce runs':<40} {'jax_blink us':>12} {'lax.psum us':>12} "
           f"{'lax/jax_blink':>13}"]
    consistent = True
    wins: list[str] = []
    losses: list[str] = []
    to_lax: list[str] = []
    sources: set[str] = set()
    for nbytes in sizes:
        decided = dispatch("allreduce", n, nbytes, dtype, kind)
        # The measurement auto followed here: a tuned or shipped entry, or none (the meanwhile rule).
        source = {"tuned": "tuned entry", "shipped": "shipped entry",
                  "meanwhile": "no entry, meanwhile"}[choice("allreduce", n, dtype, kind).source]
        sources.add(source)
        ours, ref, x = timed_programs(mesh, axis, nbytes, dtype)
        compiled = runs_executor(ours, x)
        t_ours, t_ref = (statistics.median(t) for t in interleaved_times([ours, ref], x, runs, min_seconds))
        ratio = t_ref / t_ours
        if compiled:
            path = "the executor" + {"blink": " (dispatch=blink)", "auto": f" (auto: {source})"}.get(config.dispatch, "")
            (wins if ratio >= 1 else losses).append(f"{fmt_bytes(nbytes)} ({ratio:.2f}x)")
        else:
            why = {"lax": "dispatch=lax", "blink": "executor not ready"}.get(config.dispatch, f"auto: {source}")
            path = f"lax.psum ({why})"
            to_lax.append(fmt_bytes(nbytes))
        if compiled != decided.executor:
            consistent = False
            path += " MISMATCH: decided " + ("executor" if decided.executor else "lax")
        out.append(f"   {fmt_bytes(nbytes):>10}  {path:<40} {t_ours * 1e6:>12.1f} {t_ref * 1e6:>12.1f} "
                   f"{ratio:>12.2f}x")
    out.append("   'runs' is read from each compiled program (jax_blink's custom call present or not) and "
               "matches the dispatch decision" if consistent else
               "   MISMATCH: a compiled program does not run what the dispatch decided (a bug: please report it)")
    if wins:
        out.append(f"   measured here, the executor beat lax.psum at: {', '.join(wins)}")
    if losses:
        out.append(f"   measured here, lax.psum beat the executor at: {', '.join(losses)}")
    if to_lax:
        out.append(f"   at {', '.join(to_lax)} jax_blink.all_reduce compiled to lax.psum itself (same XLA "
                   "collective: the ratio is noise); JAX_BLINK_DISPATCH=blink times the executor there")
    if config.dispatch == "auto" and "no entry, meanwhile" in sources:
        out.append("   this machine has no measured dispatch entry: auto follows the meanwhile rule (jax-blink env "
                   "says it); `jax-blink tune` measures this machine")
    return out, consistent


# ------------------------------------------------------------------------------ the demo
def one_device_lines(device) -> list[str]:
    """What one device can and cannot show."""
    from jax_blink.planning.topology import Topology

    if device.platform == "cpu":
        return ["2.-4. One CPU device: a collective needs 2 or more devices (one device has nothing to move).",
                "   XLA_FLAGS already named a device count, so the demo kept it; for 8 CPU host devices run:",
                "   XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m jax_blink demo"]
    preset = likely_machine(device.device_kind)
    out = machine_lines(Topology.preset(preset), 64 << 20,
                        f"One {device.device_kind}: the board such a GPU usually sits in, {preset}",
                        calibrate=preset.startswith("nvswitch"))
    out += ["", "3.-4. What one GPU cannot show: a collective needs 2 or more devices (one device has nothing to "
            "move; jax_blink.all_reduce returns its input), so nothing is run or timed here.",
            "   The CUDA executor's kernels with ranks as streams of this one GPU, checked and timed: in a "
            "checkout, STEPS=\"build selftest\" bash benchmarks/gpu_session.sh",
            "   On 2+ GPUs this demo runs every collective against lax and times jax_blink.all_reduce "
            "against lax.psum."]
    return out


def run_demo(sizes: Sequence[int] | None = None, dtype: str = "float32", plot: str | None = None,
             *, runs: int = 5, min_seconds: float = 0.2, flags_note: str | None = None,
             say: Callable[[str], None] = print) -> int:
    """Tell the Blink story on the devices here (see the module's docstring).

    Args:
        sizes: bytes per rank to time ``jax_blink.all_reduce`` at, each a whole number of ``dtype``
            (None: :func:`default_sizes` of the platform, to 256 MiB on GPUs).
        dtype: element type of the checks and timings.
        plot: draw the plan of this machine's all-reduce to this picture file.
        runs: timed runs per size, at least (more until ``min_seconds``).
        min_seconds: each of ours and lax runs this long per size, at least.
        flags_note: what the command line did to ``XLA_FLAGS`` before JAX started, to print.
        say: where the lines go.

    Returns:
        0 when every check agrees and every timed path is the one decided, else 1.

    Raises:
        ValueError: a size that is not a positive whole number of ``dtype`` elements.
    """
    import jax
    import jax.numpy as jnp

    import jax_blink

    itemsize = np.dtype(jnp.dtype(dtype)).itemsize
    if sizes is None:
        sizes = default_sizes(jax.devices()[0].platform)
    for nbytes in sizes:
        if nbytes <= 0 or nbytes % itemsize:
            raise ValueError(f"size {nbytes} is not a positive whole number of {dtype} elements ({itemsize} bytes)")
    devices = jax.devices()
    n, platform = len(devices), devices[0].platform
    say("jax_blink demo: Blink's spanning trees against NCCL-style rings, and jax_blink against lax on the "
        "devices here. MODELLED = the model of jax_blink.tools.simulate; MEASURED = run on this machine.")
    say(executors_line(jax_blink.backends(), platform))
    where = "CPU host devices" if platform == "cpu" else f"{platform} devices"
    say(f"devices: {n} x {devices[0].device_kind} ({where}); jax {jax.__version__}"
        + (f"; {flags_note}" if flags_note and platform == "cpu" else ""))
    say("")
    for line in paper_lines():
        say(line)
    say("")
    if n < 2:
        for line in one_device_lines(devices[0]):
            say(line)
        if plot and platform != "cpu":
            from jax_blink.tools.draw import draw_plan
            draw_plan(jax_blink.plan(jax_blink.Topology.preset(likely_machine(devices[0].device_kind)),
                                     "allreduce"), path=plot)
            say(f"trees of the modelled board drawn to {plot}")
        return 0
    topo = jax_blink.Topology.discover(devices)
    what = (f"This machine: {n} CPU host devices" if platform == "cpu" else
            f"This machine's topology, {n} x {devices[0].device_kind} as probed")
    for line in machine_lines(topo, max(sizes), what, calibrate=platform != "cpu"):
        say(line)
    if plot:
        from jax_blink.tools.draw import draw_plan
        draw_plan(jax_blink.plan(topo, "allreduce"), path=plot)
        say(f"   trees drawn to {plot} (modelled rates)")
    say("")
    mesh = jax.make_mesh((n,), ("data",), devices=devices)
    lines, ok = check_lines(mesh, "data", dtype)
    for line in lines:
        say(line)
    say("")
    lines, consistent = timing_lines(mesh, "data", sizes, dtype, runs, min_seconds)
    for line in lines:
        say(line)
    if platform == "cpu":
        say("   (CPU host devices share this machine's cores and memory: these times show the executor's "
            "cost per call, not link bandwidth.)")
    return 0 if ok and consistent else 1
