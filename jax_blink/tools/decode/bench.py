"""Decode steps of each all-reduce variant: checked against ``lax.psum``'s, timed in turns.

For each tensor-parallel size (the first ``tp`` devices) and batch, every variant of
:mod:`jax_blink.tools.decode.model` is compiled once; that one compiled program is both checked and
timed:

- **checked**: from the same fresh cache, with the same teacher-forced tokens, each variant's
  greedy tokens and last-step logits are compared with ``psum``'s (:func:`compare`, the demand of
  :func:`demand`);
- **timed**: the variants take turns on one shared cache (donated, so updated in place), one call
  each per round, the order reversed every other round (:func:`jax_blink.tools.timing.interleaved_times`),
  medians. One call decodes ``steps`` tokens, so a step's time is the median call time / steps.

Derived per (tp, batch): tokens per second (batch x steps / call time), the speedup over psum's,
the all-reduce's share of the step ((t - t(none)) / t: ``none`` is the same step with the
all-reduces replaced by the identity) and the marginal cost of one all-reduce inside the step
((t(variant + K extra all-reduces per layer) - t(variant)) / (K x layers)). In the ``sequence``
layout the same keys (``allreduce_share``, ``allreduce_us_per_step``, ``marginal_us_per_allreduce``)
hold the all-gathers' and reduce-scatters' share, their time per step, and one extra all-gather
and reduce-scatter pair's marginal cost; the table names them so.
"""
from __future__ import annotations

import csv
import dataclasses
import datetime as _dt
import json
import os
import re
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_blink.tools.decode import model as _model
from jax_blink.tools.timing import Ready, interleaved_times, spread

#: A variant's logits may stray from psum's by this relative RMS where bitwise equality is not
#: demanded: about 12 bfloat16 ulps (2^-8 each), far below what a wrong sum gives (``none``, which
#: leaves out every other rank's share: about 1).
REL_RMS_TOLERANCE = 0.05
#: Compile options that make XLA round every bfloat16 value it is asked to (XLA:CPU otherwise
#: promotes a bfloat16 all-reduce to float32 and drops the rounding of the matmul before it, which
#: jax_blink's call, not an XLA all-reduce, cannot match bit for bit).
STRICT_BF16 = {"xla_allow_excess_precision": False}


def extra_name(variant: str) -> str:
    """The name of ``variant`` with the extra all-reduces per layer."""
    return f"{variant}+extra"


@dataclasses.dataclass
class Program:
    """One compiled variant: its name, base variant, extra all-reduces per layer, the executable and
    the all-reduces it holds (XLA all-reduces and jax_blink calls, counted per call site)."""

    name: str
    variant: str
    extra: int
    compiled: Callable
    xla_all_reduces: int
    jax_blink_calls: int


def compile_program(cfg: _model.Config, mesh, variant: str, steps: int, extra: int, args: tuple,
                    dispatch: str, compiler_options: dict | None, layout: str = "allreduce") -> Program:
    """Lower ``variant`` in ``layout`` under its context
    (:func:`jax_blink.tools.decode.model.lowering_context`) and compile it."""
    with _model.lowering_context(variant, dispatch):
        lowered = _model.decode_program(cfg, mesh, variant, steps, extra, layout).lower(*args)
        compiled = lowered.compile(compiler_options=compiler_options)
    text = compiled.as_text()
    return Program(extra_name(variant) if extra else variant, variant, extra, compiled,
                   len(re.findall(r"\ball-reduce(?:-start)?\(", text)),
                   len(re.findall(r'custom_call_target="jax_blink_collective', text)))


def compare(ref: Sequence[np.ndarray], got: Sequence[np.ndarray]) -> dict:
    """How ``got`` (greedy tokens, last-step logits) differs from ``ref``: bitwise equality (NaN
    equal to NaN), the largest absolute difference of the logits and their relative RMS difference."""
    same = all(np.array_equal(a, b, equal_nan=True) for a, b in zip(ref, got))
    d = got[1].astype(np.float64) - ref[1].astype(np.float64)
    scale = float(np.sqrt(np.mean(ref[1].astype(np.float64) ** 2))) or 1.0
    return {"bitwise": bool(same), "max_abs": float(np.max(np.abs(d))) if d.size else 0.0,
            "rel_rms": float(np.sqrt(np.mean(d ** 2)) / scale) if d.size else 0.0,
            "tokens_equal": bool(np.array_equal(ref[0], got[0]))}


def demand(platform: str, tp: int, strict_bf16: bool, name: str) -> str:
    """What the check asks of program ``name`` against psum's: ``"bitwise"``, ``"tolerance"``
    (:data:`REL_RMS_TOLERANCE`) or ``"differs"`` (``none``: wrong by design, not checked).

    - jax_blink's executors sum bfloat16 in float32, in rank order, and round once. XLA:CPU's psum
      does the same once its matmul outputs are rounded to bfloat16 (compiled with
      :data:`STRICT_BF16`; otherwise it promotes the all-reduce to float32 and sums the unrounded
      matmul outputs). XLA:GPU's psum (NCCL's ring) rounds to bfloat16 after each hop: one rounding
      at 2 ranks, the same bits; n - 1 roundings at n ranks, so not the same bits beyond 2.
      Hence bitwise under :data:`STRICT_BF16` on CPU and at 2 ranks, the tolerance elsewhere.
    - ``switch`` lowers to the same custom calls as ``blink``: compared with ``blink`` bitwise as well
      (:func:`check_programs`).
    - ``+extra`` adds sums of rank 0's values and zeros, exact in any order: under
      :data:`STRICT_BF16` its base's demand; without it XLA may fuse differently around them and
      keep in float32 a value that the base program rounds, hence the tolerance.
    """
    base = name.split("+")[0]
    if name == "none":
        return "differs"
    if name == "psum":
        return "bitwise"
    if not strict_bf16:
        return "tolerance"
    if base == "psum" or platform == "cpu" or tp == 2:
        return "bitwise"
    return "tolerance"


def verdict(result: dict, wanted: str) -> str:
    """``ok`` if ``result`` (:func:`compare`) meets ``wanted`` (:func:`demand`), else ``FAILED``."""
    if wanted == "differs":
        return "ok (not checked: no collectives)"
    if wanted == "bitwise":
        return "ok (bitwise)" if result["bitwise"] else "FAILED (bitwise demanded)"
    if result["bitwise"]:
        return "ok (bitwise)"
    return (f"ok (rel. RMS {result['rel_rms']:.2e} <= {REL_RMS_TOLERANCE})"
            if result["rel_rms"] <= REL_RMS_TOLERANCE else
            f"FAILED (rel. RMS {result['rel_rms']:.2e} > {REL_RMS_TOLERANCE})")


def switch_verdict(against_psum: str, bitwise_vs_blink: bool, platform: str) -> str:
    """The switch's verdict, given its verdict against psum and whether it matched the explicit
    calls' program (``blink``) bit for bit: a mismatch fails on CPU; on GPUs it is named only.
    XLA:GPU autotunes each program's matrix products, and two programs that differ only in how
    their collectives are lowered may get GEMM kernels that round differently (4 x H200, tp 4,
    batch 64: the bits differed, and were equal with --xla_gpu_autotune_level=0); the switch is
    then held to the demand against psum, as every program is."""
    if bitwise_vs_blink:
        return against_psum
    if platform == "cpu":
        return "FAILED (switch differs from blink's program)"
    return f"{against_psum}; bits differ from blink's program (XLA autotunes each program's GEMMs)"


def check_programs(programs: dict[str, Program], cfg, mesh, params, batch: int, steps: int, pos: int,
                   strict_bf16: bool, seed: int) -> dict[str, dict]:
    """Run each program once from the same fresh cache with the same teacher-forced tokens and
    compare it with psum's (and ``switch`` with ``blink`` bitwise, a failure on CPU; on GPUs, where
    XLA autotunes each program's matrix products, a difference is named in the verdict): per
    program, :func:`compare`'s result, ``demand`` and ``verdict``."""
    rep = NamedSharding(mesh, P())
    rng = np.random.default_rng(seed)
    tokens = jax.device_put(jnp.asarray(rng.integers(0, cfg.vocab, batch), jnp.int32), rep)
    forced = jax.device_put(jnp.asarray(rng.integers(0, cfg.vocab, (steps, batch)), jnp.int32), rep)
    start = jax.device_put(jnp.int32(pos), rep)
    outputs = {}
    for name, prog in programs.items():
        ck, cv = _model.init_cache(cfg, mesh, batch, seed=seed + 1)
        _, _, greedy, logits = prog.compiled(params, ck, cv, tokens, forced, start)
        outputs[name] = (np.asarray(greedy), np.asarray(logits))
    platform, tp = mesh.devices.flat[0].platform, mesh.shape[_model.AXIS]
    results = {}
    for name in programs:
        r = compare(outputs["psum"], outputs[name])
        r["demand"] = demand(platform, tp, strict_bf16, name)
        r["verdict"] = verdict(r, r["demand"])
        if name == "switch" and "blink" in outputs:
            r["bitwise_vs_blink"] = compare(outputs["blink"], outputs[name])["bitwise"]
            r["verdict"] = switch_verdict(r["verdict"], r["bitwise_vs_blink"], platform)
        results[name] = r
    return results


def time_programs(programs: dict[str, Program], cfg, mesh, params, batch: int, steps: int, pos: int,
                  runs: int, min_seconds: float) -> dict[str, list[float]]:
    """Wall times of one call (``steps`` greedy tokens) of each program, taking turns on one shared
    cache that each call donates and returns (so no call copies it)."""
    rep = NamedSharding(mesh, P())
    tokens = jax.device_put(jnp.arange(batch, dtype=jnp.int32) % cfg.vocab, rep)
    greedy = jax.device_put(-jnp.ones((steps, batch), jnp.int32), rep)
    start = jax.device_put(jnp.int32(pos), rep)
    state = {"cache": _model.init_cache(cfg, mesh, batch)}

    def runner(prog: Program):
        def run(_):
            ck, cv, toks, logits = prog.compiled(params, *state["cache"], tokens, greedy, start)
            state["cache"] = (ck, cv)
            return Ready((ck, cv, toks, logits))
        return run

    names = list(programs)
    times = interleaved_times([runner(programs[n]) for n in names], None, runs, min_seconds)
    return dict(zip(names, times))


def measure(cfg: _model.Config, devices: Sequence, tp: int, batches: Sequence[int], *, steps: int,
            variants: Sequence[str], extra: int, runs: int, min_seconds: float, dispatch: str,
            strict_bf16: bool, compiler_options: dict | None = None, seed: int = 0,
            say: Callable[[str], None] = print, layout: str = "allreduce") -> list[dict]:
    """The rows of one tensor-parallel size in one layout (:data:`jax_blink.tools.decode.model.LAYOUTS`):
    per batch and program, its times, check and derived numbers (see the module's docstring)."""
    if "psum" not in variants:
        raise ValueError("the variants must include psum: every check and speedup is against it")
    uneven = [b for b in batches if layout == "sequence" and b % tp]
    if uneven:
        raise ValueError(f"the sequence layout splits each batch's rows over tp={tp}: batch {uneven[0]} is not a "
                         f"multiple of {tp}")
    mesh = jax.make_mesh((tp,), (_model.AXIS,), devices=list(devices[:tp]))
    params = _model.init_params(cfg, mesh, seed)
    options = dict(compiler_options or {}, **(STRICT_BF16 if strict_bf16 else {}))
    pos = cfg.context - steps  # attention reads the whole cache whatever the position
    if pos < 0:
        raise ValueError(f"--steps {steps} exceeds the cache's {cfg.context} positions: raise --context")
    kind, platform = devices[0].device_kind, devices[0].platform
    rows = []
    for batch in batches:
        rep = NamedSharding(mesh, P())
        cache = jax.ShapeDtypeStruct((cfg.layers, batch, cfg.context, cfg.kv_heads, cfg.head_dim), jnp.bfloat16,
                                     sharding=NamedSharding(mesh, _model.CACHE_SPEC))
        args = (params, cache, cache, jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rep),
                jax.ShapeDtypeStruct((steps, batch), jnp.int32, sharding=rep),
                jax.ShapeDtypeStruct((), jnp.int32, sharding=rep))
        programs: dict[str, Program] = {}
        for v in variants:
            programs[v] = compile_program(cfg, mesh, v, steps, 0, args, dispatch, options, layout)
        if extra:
            for v in variants:
                if v in ("psum", "blink"):
                    programs[extra_name(v)] = compile_program(cfg, mesh, v, steps, extra, args, dispatch, options,
                                                              layout)
        checks = check_programs(programs, cfg, mesh, params, batch, steps, pos, strict_bf16, seed + 7)
        times = time_programs(programs, cfg, mesh, params, batch, steps, pos, runs, min_seconds)
        med = {n: statistics.median(t) for n, t in times.items()}
        sequence = layout == "sequence"
        for name, prog in programs.items():
            t = med[name]
            row = {"device_kind": kind, "platform": platform, "tp": tp, "batch": batch, "layout": layout,
                   "variant": name,
                   "extra_per_layer": prog.extra, "steps_per_call": steps, "runs": len(times[name]),
                   "call_ms": t * 1e3, "step_us": t / steps * 1e6, "tokens_per_s": batch * steps / t,
                   "spread": spread(times[name]), "speedup_vs_psum": med["psum"] / t,
                   "allreduce_bytes": None if sequence else batch * cfg.hidden * 2,
                   "allreduces_per_step": 0 if sequence else (2 + prog.extra) * cfg.layers,
                   # sequence: per layer 2 + extra all-gathers of the rank's rows and as many
                   # reduce-scatters of the whole batch's partial result, and one gather per token
                   "allgather_bytes": batch // tp * cfg.hidden * 2 if sequence else None,
                   "reducescatter_bytes": batch * cfg.hidden * 2 if sequence else None,
                   "allgathers_per_step": (2 + prog.extra) * cfg.layers + 1 if sequence else 0,
                   "reducescatters_per_step": (2 + prog.extra) * cfg.layers if sequence else 0,
                   "xla_all_reduce_sites": prog.xla_all_reduces, "jax_blink_sites": prog.jax_blink_calls,
                   "allreduce_share": None, "allreduce_us_per_step": None, "marginal_us_per_allreduce": None,
                   "check": checks[name]["verdict"], "rel_rms_vs_psum": checks[name]["rel_rms"],
                   "max_abs_vs_psum": checks[name]["max_abs"], "bitwise_vs_psum": checks[name]["bitwise"]}
            if "none" in med and prog.extra == 0 and name != "none":
                row["allreduce_share"] = (t - med["none"]) / t
                row["allreduce_us_per_step"] = (t - med["none"]) / steps * 1e6
            if extra and extra_name(name) in med:
                row["marginal_us_per_allreduce"] = (med[extra_name(name)] - t) / (steps * extra * cfg.layers) * 1e6
            rows.append(row)
        say(table(rows[-len(programs):], tp, batch, kind, cfg))
    return rows


def table(rows: list[dict], tp: int, batch: int, kind: str, cfg: _model.Config) -> str:
    """The rows of one (tp, batch) as text, every number named."""
    r0 = rows[0]
    if r0.get("layout") == "sequence":
        what = (f"sequence layout: all-gather {r0['allgather_bytes']} B per rank, {r0['allgathers_per_step']} per step, "
                f"and reduce-scatter {r0['reducescatter_bytes']} B per rank, {r0['reducescatters_per_step']} per step")
        c, one = "AG+RS", "AG+RS"  # the comm's share and time; one extra all-gather and reduce-scatter pair
    else:
        what = f"all-reduce {r0['allreduce_bytes']} B per rank, {2 * cfg.layers} per step"
        c, one = "AR", "AR"
    lines = [f"tp={tp} batch={batch} ({tp} x {kind}, measured; bfloat16; {what}; medians of {r0['runs']} calls "
             f"of {r0['steps_per_call']} steps taken in turns)",
             f"  {'variant':>13} {'step (us)':>10} {'tokens/s':>10} {'vs psum':>8} {'spread':>7} "
             f"{c + ' share':>11} {c + ' us/step':>13} {'1 ' + one + ' (us)':>12}  check"]
    for r in rows:
        share = "" if r["allreduce_share"] is None else f"{r['allreduce_share']:.1%}"
        per = "" if r["allreduce_us_per_step"] is None else f"{r['allreduce_us_per_step']:.1f}"
        marg = "" if r["marginal_us_per_allreduce"] is None else f"{r['marginal_us_per_allreduce']:.2f}"
        lines.append(f"  {r['variant']:>13} {r['step_us']:10.1f} {r['tokens_per_s']:10.1f} "
                     f"{r['speedup_vs_psum']:7.3f}x {r['spread']:7.1%} {share:>11} {per:>13} {marg:>12}  {r['check']}")
    return "\n".join(lines)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def metadata(cfg: _model.Config, size: str, devices: Sequence, argv: Sequence[str], **extra) -> dict:
    """The run's facts for the JSON file: device kind, date, versions, shape, options."""
    import jax_blink
    from jax_blink.options import config
    return {"tool": "python -m jax_blink.tools.decode", "argv": list(argv), "size": size,
            "config": dataclasses.asdict(cfg), "parameters": cfg.parameters(), "dtype": "bfloat16",
            "device_kind": devices[0].device_kind, "platform": devices[0].platform, "devices_seen": len(devices),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "jax": jax.__version__,
            "jax_blink": jax_blink.__version__, "command_buffers": config.command_buffers,
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "rel_rms_tolerance": REL_RMS_TOLERANCE,
            "measured": True, **extra}


def write(out: Path, stem: str, meta: dict, rows: list[dict], text: str) -> list[Path]:
    """Write ``stem``.csv, .json (meta + rows), .txt (the printed tables) and .png under ``out``."""
    out.mkdir(exist_ok=True)
    paths = [out / f"{stem}.{ext}" for ext in ("csv", "json", "txt", "png")]
    with open(paths[0], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    paths[1].write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    paths[2].write_text(text + "\n")
    plot(rows, meta, paths[3])
    return paths


def plot(rows: list[dict], meta: dict, path: Path) -> None:
    """Tokens per second against batch per (variant, tp), and each jax_blink variant's speedup over psum."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"psum": "o-", "blink": "s-", "switch": "^--", "none": "x:"}
    for tp in sorted({r["tp"] for r in rows}):
        for v, style in styles.items():
            pts = sorted((r["batch"], r["tokens_per_s"], r["speedup_vs_psum"]) for r in rows
                         if r["tp"] == tp and r["variant"] == v)
            if not pts:
                continue
            xs = [p[0] for p in pts]
            a.plot(xs, [p[1] for p in pts], style, label=f"{v}, tp={tp}")
            if v in ("blink", "switch"):
                b.plot(xs, [p[2] for p in pts], style, label=f"{v}, tp={tp}")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (sequences)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    a.set_yscale("log")
    a.set_ylabel("tokens per second (measured)")
    b.axhline(1.0, color="grey", lw=0.8)
    b.set_ylabel("speedup over psum (tokens/s ratio)")
    layout = "" if meta.get("layout", "allreduce") == "allreduce" else f", {meta['layout']} layout"
    fig.suptitle(f"decode{layout}, {meta['size']} bfloat16, {meta['device_kind']} ({meta['platform']}), "
                 f"{meta['date'][:10]}, jax {meta['jax']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
