"""What XLA spends per custom call on one device, with and without command buffers.

Chains K calls of our target with a one-rank program (the kernel only copies 1 KiB: its own time
is a few microseconds) inside one jitted program, next to K chained tiny XLA ops (kept apart by
optimization barriers), and prints the time per call of each. The difference to the kernel's own
time in the CUDA self-test is XLA's launch path: the floor of any custom-call collective.

    python benchmarks/xla_call_overhead.py [--k 20] [--runs 20]
"""
from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_blink import _backends, schedule
from jax_blink.bench import median_time as _timeit


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--elems", type=int, default=256)
    a = ap.parse_args()
    platform = jax.default_backend()
    if not _backends.register("gpu" if platform == "gpu" else "cpu"):
        raise SystemExit(f"no jax_blink executor for {platform}")
    program = schedule.encode(schedule.Schedule(1, a.elems, a.elems, ()))
    x = jnp.asarray(np.random.default_rng(0).standard_normal(a.elems), jnp.float32)

    ids = itertools.count(10_000_000)  # every call site its own comm_id, as collectives.py gives

    def chain(target, side_effect: bool = False, bare: bool = False):
        """K chained calls of `target`: our binding (operand, rank, group, the attributes) or the
        bare one (one operand, one result). No-op targets alias their result to the operand."""
        noop = target in (_backends.TARGET_NOOP, _backends.TARGET_NOOP_BARE)
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype), has_side_effect=side_effect,
                                input_output_aliases={0: 0} if noop else None)

        def body(v):
            for _ in range(a.k):
                v = call(v) if bare else call(
                    v, jnp.int32(0), jnp.int32(0), program=program, op=np.int32(0),
                    comm_id=np.int64(next(ids)), timeout_ms=np.int64(10_000), host_share=np.float32(0))
            return v
        return jax.jit(body)

    def xla_ops(v):
        for _ in range(a.k):
            v = lax.optimization_barrier(v * 1.0001)
        return v

    rows = [("XLA elementwise op", jax.jit(xla_ops)),
            ("jax_blink custom call (plain)", chain(_backends.TARGET)),
            ("jax_blink custom call, side effect", chain(_backends.TARGET, True)),
            ("jax_blink custom call (command buffer)", chain(_backends.TARGET_CB))]
    have = _backends.module("gpu" if platform == "gpu" else "cpu").registrations()
    if _backends.TARGET_NOOP in have:  # XLA's own price of an FFI call: our binding, no work
        rows += [("no-op FFI call, same binding", chain(_backends.TARGET_NOOP, True)),
                 ("no-op, same binding, no side effect", chain(_backends.TARGET_NOOP))]
    if _backends.TARGET_NOOP_BARE in have:
        rows += [("no-op, bare binding", chain(_backends.TARGET_NOOP_BARE, True, bare=True)),
                 ("no-op, bare binding, no side effect", chain(_backends.TARGET_NOOP_BARE, bare=True))]
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, {a.k} chained calls, median of {a.runs}")
    for name, fn in rows:
        try:
            t = _timeit(fn, x, a.runs) / a.k
            print(f"{name:>42}: {t * 1e6:8.2f} us per call")
        except Exception as e:  # noqa: BLE001
            print(f"{name:>42}: failed: {str(e).splitlines()[0][:160]}")


if __name__ == "__main__":
    main()
