"""The two-shot all-reduce's knobs on 3+ GPUs of one process: every setting and psum taking turns.

    python benchmarks/twoshot_sweep.py [--sizes 64M,256M,1G] [--config NAME:VAR=VALUE,...]... \
        [--chain 20] [--runs 8] [--out DIR]

One process, one operand per size (float32, fresh random data). Each configuration is the
executor's all-reduce (forced, ``dispatch="blink"``) whose call sites are set up while its
variables are set (JAX_BLINK_TWOSHOT_PIECE_BYTES, JAX_BLINK_TWOSHOT_MODE,
JAX_BLINK_TWOSHOT_REDUCERS, JAX_BLINK_CUDA_BLOCKS, JAX_BLINK_TWOSHOT_MIN_BYTES: the executor reads
them at a site's set-up, so each configuration's sites keep their own); the two-shot kernel is on from 1 MiB unless a configuration says otherwise.
Every configuration's first result is checked against psum's on the devices (largest difference
relative to psum's largest value) and its kernel named from the executor's new sites. Then psum and
every configuration run ``--chain`` chained calls per program, taking turns round by round
(jax_blink.tools.timing.interleaved_times), so a drift of the machine falls on all alike. The table:
per size and configuration the measured time per call (median), the ratio psum / ours and our bus
bandwidth. Without --config: the default kernel, the trees (two-shot off), pushes spread over the
peers (JAX_BLINK_TWOSHOT_PUSH=spread), 0, 8, 16 and 32 blocks
that only reduce (JAX_BLINK_TWOSHOT_REDUCERS), and 16 of them with pieces of 256 KiB and of 4 MiB.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sweep_cli import against_psum, main as sweep_main, size_label  # noqa: E402  (benchmarks/ on the path first)

DEFAULT_CONFIGS = (
    "default:",
    "trees:JAX_BLINK_TWOSHOT_MIN_BYTES=0",
    "spread:JAX_BLINK_TWOSHOT_PUSH=spread",
    "reducers0:JAX_BLINK_TWOSHOT_REDUCERS=0",
    "reducers8:JAX_BLINK_TWOSHOT_REDUCERS=8",
    "reducers16:JAX_BLINK_TWOSHOT_REDUCERS=16",
    "reducers32:JAX_BLINK_TWOSHOT_REDUCERS=32",
    "reducers16-pieces256K:JAX_BLINK_TWOSHOT_REDUCERS=16,JAX_BLINK_TWOSHOT_PIECE_BYTES=256K",
    "reducers16-pieces4M:JAX_BLINK_TWOSHOT_REDUCERS=16,JAX_BLINK_TWOSHOT_PIECE_BYTES=4M",
)


def table(rows: list[dict]) -> str:
    """Markdown: per size and configuration, ours and psum's time, psum / ours, our busbw, the check."""
    lines = ["| float32 per rank x ranks | configuration | kernel (new sites) | ours (us, measured) | psum (us, measured) "
             "| speedup (psum / ours) | ours busbw (GB/s) | spread ours / psum | largest rel. difference |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {size_label(r['bytes_per_rank'])} x {r['n']} | {r['config']} | {r['kernels']} | {r['time_us']:.1f} "
                     f"| {r['psum_time_us']:.1f} | {r['speedup']:.3f} | {r['busbw']:.1f} "
                     f"| {100 * r['spread']:.0f}% / {100 * r['psum_spread']:.0f}% | {r['rel_diff']:.1e} |")
    return "\n".join(lines)


def _kernels(module, before: dict) -> dict:
    now = {}
    for c in module.comms():
        for mode, count in c["sites_by_mode"].items():
            now[mode] = now.get(mode, 0) + count
    return {m: c - before.get(m, 0) for m, c in now.items() if c - before.get(m, 0)}


def run(sizes: list[int], configs: list[tuple[str, dict]], k: int, runs: int, profile: str | None = None) -> list[dict]:
    import jax

    from jax_blink.lowering import backends
    from jax_blink.tools.timing import COLLECTIVES, chained

    devices = jax.devices()
    n = len(devices)
    if n < 3 or devices[0].platform != "gpu" or not backends.register("gpu"):
        raise SystemExit(f"twoshot_sweep.py: needs 3 or more GPUs and jax_blink's CUDA executor (here: {n} x "
                         f"{devices[0].platform})")
    module = backends.module("gpu")
    mesh = jax.make_mesh((n,), ("x",), devices=devices)
    coll = COLLECTIVES["allreduce"]

    def variants():  # the two-shot kernel on from 1 MiB unless a configuration says otherwise
        return [(name, {"JAX_BLINK_TWOSHOT_MIN_BYTES": "1M", **env},
                 chained(coll.chain(coll.ours), mesh, "x", k, dispatch="blink")) for name, env in configs]

    def observe():
        before = _kernels(module, {})
        return lambda: {"kernels": ", ".join(f"{m} {c}" for m, c in sorted(_kernels(module, before).items()))}

    return against_psum(mesh, sizes, k, runs, variants, observe=observe, profile=profile)


def main(argv=None) -> int:
    return sweep_main(argv, description=__doc__.split("\n")[0], script="twoshot_sweep.py", run=run, table=table,
                      default_configs=DEFAULT_CONFIGS, default_sizes="64M,256M,1G", min_bytes=1 << 20,
                      sizes_note="sizes of at least 1M and a multiple of 16 bytes (the sweep switches the two-shot "
                                 "kernel on from 1M)", out_default="twoshot-sweep")


if __name__ == "__main__":
    sys.exit(main())
