"""The all-reduce on copy engines against the executor's kernel and psum, taking turns (GPUs).

    python benchmarks/ce_sweep.py [--sizes 16M,64M,256M,1G] [--config NAME:VAR=VALUE,...]... \
        [--chain 20] [--runs 8] [--out DIR]

One process, 2 or more GPUs, one float32 operand per size (fresh random data). Variants:
- ``psum``: XLA's all-reduce (NCCL);
- ``executor``: jax_blink's all-reduce, forced onto the executor (``dispatch="blink"``): the kernel
  that ``dispatch="auto"`` would run (two-shot on 3+ GPUs from 16 MiB, trees below, host channel
  on 2 GPUs);
- every ``--config``: ``all_reduce_done(all_reduce_start(x))`` back to back, its sites set up
  while the configuration's variables are set (``JAX_BLINK_ASYNC_ENGINE``,
  ``JAX_BLINK_CE_PIECE_BYTES``, ``JAX_BLINK_CE_GATHER``, ``JAX_BLINK_ASYNC_BLOCKS`` are read at a
  site's first call, so each configuration's sites keep their own). A copy-engine configuration
  reduces on ``JAX_BLINK_ASYNC_BLOCKS`` blocks (132 unless it sets them: an H100's or H200's SM
  count); any other start runs with ``full_grid=True`` (the executor's whole grid; a full-grid
  start always runs the kernel). Default: the copy engines with pieces of 4, 16 and 64 MiB, and the
  executor's kernel on the asynchronous lane (``sm``) for reference.

Every variant's first result is compared with psum's on the devices (largest difference relative
to psum's largest value; the copy engines add in rank order as the executor does, NCCL's ring in
its own). Then all run ``--chain`` chained calls per program, taking turns round by round
(jax_blink.tools.timing.interleaved_times). The table: per size and variant the measured time per
call (median of the rounds), psum / ours and the bus bandwidth (nccl-tests' 2 (n - 1) / n).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from collective_checks import environment  # noqa: E402  (benchmarks/ on the path first)
from sweep_cli import main as sweep_main, parse_config  # noqa: E402,F401  (parse_config: for callers and tests)

DEFAULT_CONFIGS = (
    "ce-4M:JAX_BLINK_ASYNC_ENGINE=ce,JAX_BLINK_CE_PIECE_BYTES=4M",
    "ce-16M:JAX_BLINK_ASYNC_ENGINE=ce,JAX_BLINK_CE_PIECE_BYTES=16M",
    "ce-64M:JAX_BLINK_ASYNC_ENGINE=ce,JAX_BLINK_CE_PIECE_BYTES=64M",
    "sm-async:JAX_BLINK_ASYNC_ENGINE=sm",
)


def _fmt(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def table(rows: list[dict]) -> str:
    """Markdown: per size and variant, its time and psum's, psum / ours, busbw, spread and the check."""
    lines = ["| float32 per rank x ranks | variant | time (us, measured) | psum (us, measured) | speedup (psum / this) "
             "| busbw (GB/s) | spread this / psum | largest rel. difference to psum |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {_fmt(r['bytes_per_rank'])} x {r['n']} | {r['variant']} | {r['time_us']:.1f} "
                     f"| {r['psum_time_us']:.1f} | {r['speedup']:.3f} | {r['busbw']:.1f} "
                     f"| {100 * r['spread']:.0f}% / {100 * r['psum_spread']:.0f}% | {r['rel_diff']:.1e} |")
    return "\n".join(lines)


def run(sizes: list[int], configs: list[tuple[str, dict]], k: int, runs: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_blink
    from jax_blink.lowering import backends
    from jax_blink.tools.timing import COLLECTIVES, chained, interleaved_times, spread

    devices = jax.devices()
    n = len(devices)
    if n < 2 or devices[0].platform != "gpu" or not backends.register("gpu"):
        raise SystemExit(f"ce_sweep.py: needs 2 or more GPUs and jax_blink's CUDA executor (here: {n} x "
                         f"{devices[0].platform})")
    mesh = jax.make_mesh((n,), ("x",), devices=devices)
    coll = COLLECTIVES["allreduce"]

    def start_done(full_grid):
        return lambda v, axis: jax_blink.all_reduce_done(jax_blink.all_reduce_start(v, axis, full_grid=full_grid))

    def on_copy_engines(env):
        return env.get("JAX_BLINK_ASYNC_ENGINE", "").lower() == "ce"

    psum_fn = chained(coll.chain(coll.ref), mesh, "x", k)
    rows = []
    rng = np.random.default_rng(0)
    for nbytes in sizes:
        count = nbytes // 4
        x = jax.device_put(jnp.asarray(rng.standard_normal(n * count, dtype=np.float32)),
                           NamedSharding(mesh, P("x")))
        ref = psum_fn(x)
        scale = float(jnp.max(jnp.abs(ref)))
        variants = [("executor", {}, chained(coll.chain(coll.ours), mesh, "x", k, dispatch="blink"))]
        variants += [(name, {"JAX_BLINK_ASYNC_BLOCKS": "132", **env} if on_copy_engines(env) else env,
                      chained(start_done(not on_copy_engines(env)), mesh, "x", k, dispatch="blink"))
                     for name, env in configs]
        fns, meta = [], []
        for name, env, fn in variants:
            with environment(env):
                got = fn(x)  # the sites are set up here, with this variant's variables
                got.block_until_ready()
            jax_blink.check()
            rel = float(jnp.max(jnp.abs(got - ref))) / scale
            del got
            fns.append(fn)
            meta.append((name, env, rel))
        t0 = time.time()
        timed = interleaved_times([psum_fn] + fns, x, runs, 0.5)
        jax_blink.check()
        t_psum = statistics.median(timed[0]) / k
        for (name, env, rel), times in zip(meta, timed[1:]):
            t = statistics.median(times) / k
            rows.append(dict(bytes_per_rank=nbytes, n=n, variant=name, env=env, time_us=t * 1e6,
                             psum_time_us=t_psum * 1e6, speedup=t_psum / t,
                             busbw=nbytes * 2 * (n - 1) / n / t / 1e9, psum_busbw=nbytes * 2 * (n - 1) / n / t_psum / 1e9,
                             spread=spread(times), psum_spread=spread(timed[0]), rel_diff=rel, runs=len(times)))
            print(f"{_fmt(nbytes)} x {n} {name}: {t * 1e6:.1f} us, psum {t_psum * 1e6:.1f} us, {t_psum / t:.3f}x, "
                  f"{rows[-1]['busbw']:.1f} GB/s busbw (psum {rows[-1]['psum_busbw']:.1f}), "
                  f"rel. difference {rel:.1e}", flush=True)
        print(f"# {_fmt(nbytes)}: {len(timed[0])} rounds in {time.time() - t0:.0f} s", flush=True)
        del x, ref
    return rows


def main(argv=None) -> int:
    return sweep_main(argv, description=__doc__.split("\n")[0], script="ce_sweep.py", run=run, table=table,
                      default_configs=DEFAULT_CONFIGS, default_sizes="16M,64M,256M,1G", min_bytes=1024,
                      sizes_note="sizes of at least 1K and a multiple of 16 bytes", out_default="ce-sweep")


if __name__ == "__main__":
    sys.exit(main())
