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
bandwidth. Without --config: the default kernel, the trees (two-shot off), 0, 8, 16 and 32 blocks
that only reduce (JAX_BLINK_TWOSHOT_REDUCERS), and 16 of them with pieces of 256 KiB and of 4 MiB.
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
    "default:",
    "trees:JAX_BLINK_TWOSHOT_MIN_BYTES=0",
    "reducers0:JAX_BLINK_TWOSHOT_REDUCERS=0",
    "reducers8:JAX_BLINK_TWOSHOT_REDUCERS=8",
    "reducers16:JAX_BLINK_TWOSHOT_REDUCERS=16",
    "reducers32:JAX_BLINK_TWOSHOT_REDUCERS=32",
    "reducers16-pieces256K:JAX_BLINK_TWOSHOT_REDUCERS=16,JAX_BLINK_TWOSHOT_PIECE_BYTES=256K",
    "reducers16-pieces4M:JAX_BLINK_TWOSHOT_REDUCERS=16,JAX_BLINK_TWOSHOT_PIECE_BYTES=4M",
)


def _fmt(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def table(rows: list[dict]) -> str:
    """Markdown: per size and configuration, ours and psum's time, psum / ours, our busbw, the check."""
    lines = ["| float32 per rank x ranks | configuration | kernel (new sites) | ours (us, measured) | psum (us, measured) "
             "| speedup (psum / ours) | ours busbw (GB/s) | spread ours / psum | largest rel. difference |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {_fmt(r['bytes_per_rank'])} x {r['n']} | {r['config']} | {r['kernels']} | {r['time_us']:.1f} "
                     f"| {r['psum_time_us']:.1f} | {r['speedup']:.3f} | {r['busbw']:.1f} "
                     f"| {100 * r['spread']:.0f}% / {100 * r['psum_spread']:.0f}% | {r['rel_diff']:.1e} |")
    return "\n".join(lines)


def _kernels(module, before: dict) -> dict:
    now = {}
    for c in module.comms():
        for mode, count in c["sites_by_mode"].items():
            now[mode] = now.get(mode, 0) + count
    return {m: c - before.get(m, 0) for m, c in now.items() if c - before.get(m, 0)}


def run(sizes: list[int], configs: list[tuple[str, dict]], k: int, runs: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jax_blink.lowering import backends
    from jax_blink.tools.timing import COLLECTIVES, chained, interleaved_times, spread

    devices = jax.devices()
    n = len(devices)
    if n < 3 or devices[0].platform != "gpu" or not backends.register("gpu"):
        raise SystemExit(f"twoshot_sweep.py: needs 3 or more GPUs and jax_blink's CUDA executor (here: {n} x "
                         f"{devices[0].platform})")
    module = backends.module("gpu")
    mesh = jax.make_mesh((n,), ("x",), devices=devices)
    coll = COLLECTIVES["allreduce"]
    psum_fn = chained(coll.chain(coll.ref), mesh, "x", k)
    rows = []
    rng = np.random.default_rng(0)
    for nbytes in sizes:
        count = nbytes // 4
        x = jax.device_put(jnp.asarray(rng.standard_normal(n * count, dtype=np.float32)),
                           NamedSharding(mesh, P("x")))
        ref = psum_fn(x)
        scale = float(jnp.max(jnp.abs(ref)))
        fns, meta = [], []
        for name, env in configs:
            fn = chained(coll.chain(coll.ours), mesh, "x", k, dispatch="blink")
            before = _kernels(module, {})
            with environment({"JAX_BLINK_TWOSHOT_MIN_BYTES": "1M", **env}):
                got = fn(x)  # the sites are set up here, with this configuration's variables
                got.block_until_ready()
            module.check()
            rel = float(jnp.max(jnp.abs(got - ref))) / scale
            del got
            fns.append(fn)
            meta.append((name, env, _kernels(module, before), rel))
        t0 = time.time()
        timed = interleaved_times([psum_fn] + fns, x, runs, 0.5)
        t_psum = statistics.median(timed[0]) / k
        for (name, env, kernels, rel), times in zip(meta, timed[1:]):
            t = statistics.median(times) / k
            rows.append(dict(bytes_per_rank=nbytes, n=n, config=name, env=env,
                             kernels=", ".join(f"{m} {c}" for m, c in sorted(kernels.items())),
                             time_us=t * 1e6, psum_time_us=t_psum * 1e6, speedup=t_psum / t,
                             busbw=nbytes * 2 * (n - 1) / n / t / 1e9, spread=spread(times),
                             psum_spread=spread(timed[0]), rel_diff=rel, runs=len(times)))
            print(f"{_fmt(nbytes)} x {n} {name}: {t * 1e6:.1f} us, psum {t_psum * 1e6:.1f} us, "
                  f"{t_psum / t:.3f}x, {rows[-1]['busbw']:.1f} GB/s busbw, kernels {rows[-1]['kernels']}, "
                  f"rel. difference {rel:.1e}", flush=True)
        print(f"# {_fmt(nbytes)}: {len(timed[0])} rounds in {time.time() - t0:.0f} s", flush=True)
        del x, ref
    return rows


def main(argv=None) -> int:
    return sweep_main(argv, description=__doc__.split("\n")[0], script="twoshot_sweep.py", run=run, table=table,
                      default_configs=DEFAULT_CONFIGS, default_sizes="64M,256M,1G", min_bytes=1 << 20,
                      sizes_note="sizes of at least 1M and a multiple of 16 bytes (the sweep switches the two-shot "
                                 "kernel on from 1M)", out_default="twoshot-sweep")


if __name__ == "__main__":
    sys.exit(main())
