"""Where XLA puts each ``jax_blink_start`` / ``jax_blink_done`` in a compiled GPU program of several
gradient buckets, and how long the step takes with them, with the synchronous call and with psum.

The GPT-2 step on 4 x H200 (2026-11-27, docs/overlap.md) ran every bucket's all-reduce while the
compute stream waited: each done seemed to run right after its own start, not after the next
bucket's start as its token operand asks. This program asks XLA directly: K layers of
``tanh(x @ W_k)``, their gradients in K buckets of one layer each (DDP's reverse order),
``bucketed_all_reduce(overlap=True)``, an SGD update; the optimized HLO (``--xla_dump_to``) lists
the entry computation in its schedule, and for each start and done this prints its position and
how many instructions XLA placed since the previous one.

    python benchmarks/overlap_schedule.py --layers 6 --width 2048 [--dump DIR]

On CPU host devices the pair runs synchronously (no start/done in the program): it says so.
Measured step times are medians of ``--runs`` steps, the modes taking turns.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import tempfile
import time


def schedule(dump_dir: str) -> list[str]:
    """The start/done lines of the first optimized module holding a jax_blink_start."""
    for path in sorted(glob.glob(os.path.join(dump_dir, "*after_optimizations.txt"))):
        text = open(path).read()
        if "jax_blink_start" not in text:
            continue
        entry = text[text.index("\nENTRY "):]
        entry = entry[:entry.index("\n}\n")]
        rows, since = [], 0
        for i, line in enumerate(l.strip() for l in entry.split("\n")[1:] if " = " in l):
            m = re.search(r'custom_call_target="(jax_blink_start|jax_blink_done)"', line)
            if not m:
                since += 1
                continue
            name = line.split(" = ")[0]
            operands = line.split("custom-call(", 1)[1].split(")", 1)[0]
            rows.append(f"{i:6d}  +{since:4d} instructions  {m.group(1):16s} {name:>16s}({operands[:120]})")
            since = 0
        return [f"module {os.path.basename(path)}"] + rows
    return []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=6, help="layers, one gradient bucket each (default 6)")
    ap.add_argument("--width", type=int, default=2048, help="each layer's W is width x width float32 (default 2048)")
    ap.add_argument("--rows", type=int, default=4096, help="rows of each device's batch (default 4096)")
    ap.add_argument("--runs", type=int, default=20, help="timed steps per mode (default 20)")
    ap.add_argument("--dump", default="", help="keep XLA's dump here (default: a temporary folder)")
    a = ap.parse_args(argv)
    if a.layers < 2 or a.width < 16 or a.rows < 1 or a.runs < 1:
        ap.error("need --layers >= 2 (several buckets), --width >= 16, --rows >= 1, --runs >= 1")
    dump = a.dump or tempfile.mkdtemp(prefix="overlap_dump_")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_dump_to={dump} --xla_dump_hlo_as_text").strip()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_blink
    from jax_blink.api import buckets

    jax_blink.config.dispatch = "blink"
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",))
    key = jax.random.key(0)
    ws = [jax.random.normal(k, (a.width, a.width), jnp.float32) / np.sqrt(a.width)
          for k in jax.random.split(key, a.layers)]
    x = jax.random.normal(jax.random.key(1), (n * a.rows, a.width), jnp.float32)
    ws = jax.device_put(ws, NamedSharding(mesh, P()))
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    layer_bytes = a.width * a.width * 4

    def loss(ws, xb):
        h = xb
        for w in ws:
            h = jnp.tanh(h @ w)
        return jnp.mean(h * h)

    def step(mode):
        def local(ws, xb):
            g = jax.grad(loss)(ws, xb)
            if mode == "psum":
                g = [lax.psum(v, "data") for v in g]
            elif mode in ("blink", "overlap"):
                g = buckets.bucketed_all_reduce(g, "data", bucket_bytes=layer_bytes, overlap=mode == "overlap")
            return [w - 0.01 * v for w, v in zip(ws, g)]
        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(),
                                     check_vma=False))

    modes = ("psum", "blink", "overlap", "none")
    compiled = {m: step(m).lower(ws, x).compile() for m in modes}
    times = {m: [] for m in modes}
    for r in range(a.runs + 2):
        for m in (modes if r % 2 == 0 else modes[::-1]):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled[m](ws, x))
            if r >= 2:
                times[m].append(time.perf_counter() - t0)
    print(f"# {n} x {jax.devices()[0].device_kind}, jax {jax.__version__}: {a.layers} layers of "
          f"{a.width} x {a.width} float32 ({layer_bytes / 2**20:.1f} MiB of gradient each, one bucket each), "
          f"{a.rows} rows per device; median step of {a.runs}, the modes taking turns (MEASURED)")
    none = float(np.median(times["none"]))
    for m in modes:
        t = float(np.median(times[m]))
        print(f"  {m:8s} {t * 1e3:9.3f} ms" + ("" if m == "none" else f"   exposed communication {1e3 * (t - none):7.3f} ms"))
    rows = schedule(dump)
    if not rows:
        print("# no jax_blink_start in any optimized program here: the pair ran synchronously "
              "(CPU host devices, or no executor for this platform)")
        return 0
    print("# the overlapped step's entry computation in XLA's schedule (position, instructions since the "
          "previous start/done, which, its operands):")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
