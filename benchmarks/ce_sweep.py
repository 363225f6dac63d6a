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
  ``JAX_BLINK_CE_PIECE_BYTES``, ``JAX_BLINK_CE_SCATTER``, ``JAX_BLINK_CE_GATHER``, ``JAX_BLINK_ASYNC_BLOCKS`` are read at a
  site's first call, so each configuration's sites keep their own). A copy-engine configuration
  reduces on ``JAX_BLINK_ASYNC_BLOCKS`` blocks (unless it sets them: the GPU's SM count, 132 on an
  H100 or H200); any other start runs with ``full_grid=True`` (the executor's whole grid; a full-grid
  start always runs the kernel). Default: the copy engines with pieces of 4, 16 and 64 MiB, pieces
  of 16 MiB with the reduce-scatter pushed (and with the all-gather pushed too), and the
  executor's kernel on the asynchronous lane (``sm``) for reference.

Every variant's first result is compared with psum's on the devices (largest difference relative
to psum's largest value; the copy engines add in rank order as the executor does, NCCL's ring in
its own). Then all run ``--chain`` chained calls per program, taking turns round by round
(jax_blink.tools.timing.interleaved_times). The table: per size and variant the measured time per
call (median of the rounds), psum / ours and the bus bandwidth (nccl-tests' 2 (n - 1) / n).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sweep_cli import against_psum, main as sweep_main, size_label  # noqa: E402  (benchmarks/ on the path first)

DEFAULT_CONFIGS = (
    "ce-4M:JAX_BLINK_ASYNC_ENGINE=ce,JAX_BLINK_CE_PIECE_BYTES=4M",
    "ce-16M:JAX_BLINK_ASYNC_ENGINE=ce,JAX_BLINK_CE_PIECE_BYTES=16M",
    "ce-64M:JAX_BLINK_ASYNC_ENGINE=ce,JAX_BLINK_CE_PIECE_BYTES=64M",
    "ce-push-16M:JAX_BLINK_ASYNC_ENGINE=ce,JAX_BLINK_CE_PIECE_BYTES=16M,JAX_BLINK_CE_SCATTER=push",
    "ce-push-push-16M:JAX_BLINK_ASYNC_ENGINE=ce,JAX_BLINK_CE_PIECE_BYTES=16M,JAX_BLINK_CE_SCATTER=push,JAX_BLINK_CE_GATHER=push",
    "sm-async:JAX_BLINK_ASYNC_ENGINE=sm",
)


def table(rows: list[dict]) -> str:
    """Markdown: per size and variant, its time and psum's, psum / ours, busbw, spread and the check."""
    lines = ["| float32 per rank x ranks | variant | time (us, measured) | psum (us, measured) | speedup (psum / this) "
             "| busbw (GB/s) | spread this / psum | largest rel. difference to psum |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {size_label(r['bytes_per_rank'])} x {r['n']} | {r['variant']} | {r['time_us']:.1f} "
                     f"| {r['psum_time_us']:.1f} | {r['speedup']:.3f} | {r['busbw']:.1f} "
                     f"| {100 * r['spread']:.0f}% / {100 * r['psum_spread']:.0f}% | {r['rel_diff']:.1e} |")
    return "\n".join(lines)


def run(sizes: list[int], configs: list[tuple[str, dict]], k: int, runs: int, profile: str | None = None) -> list[dict]:
    import jax

    import jax_blink
    from jax_blink.lowering import backends
    from jax_blink.tools.timing import COLLECTIVES, chained

    devices = jax.devices()
    n = len(devices)
    if n < 2 or devices[0].platform != "gpu" or not backends.register("gpu"):
        raise SystemExit(f"ce_sweep.py: needs 2 or more GPUs and jax_blink's CUDA executor (here: {n} x "
                         f"{devices[0].platform})")
    mesh = jax.make_mesh((n,), ("x",), devices=devices)
    sms = str(getattr(devices[0], "core_count", 132))  # a copy-engine setting's reduction grid: every SM
    coll = COLLECTIVES["allreduce"]

    def start_done(full_grid):
        return lambda v, axis: jax_blink.all_reduce_done(jax_blink.all_reduce_start(v, axis, full_grid=full_grid))

    def on_copy_engines(env):
        return env.get("JAX_BLINK_ASYNC_ENGINE", "").lower() == "ce"

    def variants():
        return [("executor", {}, chained(coll.chain(coll.ours), mesh, "x", k, dispatch="blink"))] + [
            (name, {"JAX_BLINK_ASYNC_BLOCKS": sms, **env} if on_copy_engines(env) else env,
             chained(start_done(not on_copy_engines(env)), mesh, "x", k, dispatch="blink"))
            for name, env in configs]

    return against_psum(mesh, sizes, k, runs, variants, name_key="variant", profile=profile)


def main(argv=None) -> int:
    return sweep_main(argv, description=__doc__.split("\n")[0], script="ce_sweep.py", run=run, table=table,
                      default_configs=DEFAULT_CONFIGS, default_sizes="16M,64M,256M,1G", min_bytes=1024,
                      sizes_note="sizes of at least 1K and a multiple of 16 bytes", out_default="ce-sweep")


if __name__ == "__main__":
    sys.exit(main())
