"""What one more call costs inside a jitted program on one device: an XLA elementwise kernel, an FFI
no-op handler per binding (kernels/cuda/bench_probes.cc: full, lite, min, bare), and our collective
(a one-rank program: its kernel copies 1 KiB) through the full and the light binding, plain and
through the handler that XLA may capture in a command buffer.

The no-op handlers are a module of their own, built only when asked for:
``pip install --no-build-isolation -Ccmake.define.JAX_BLINK_BUILD_BENCH_PROBES=ON -e .``
(benchmarks/gpu_session.sh does, for its step overhead); without it their rows are left out.

Each row is a chain of K calls (the output of one feeds the next) in one jitted program, timed at
K1 and K2 calls with every program taking turns (bench.interleaved_times). Per row it prints the
time per call at K1 (what earlier notes quote: it carries the program's fixed cost / K1) and the
marginal cost of one more call, (t(K2) - t(K1)) / (K2 - K1), which the fixed cost does not reach;
the whole measurement is repeated ``--repeats`` times. Command buffers follow XLA_FLAGS: run it once
with XLA's defaults and once with ``XLA_FLAGS=--xla_gpu_enable_command_buffer=`` (none) to see both.

    python benchmarks/xla_call_overhead.py [--k1 20] [--k2 100] [--runs 30] [--repeats 3] [--out FILE]
"""
from __future__ import annotations

import argparse
import functools
import itertools
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_blink.lowering import backends as _backends
from jax_blink.planning import schedule
from jax_blink.tools.timing import interleaved_times

_IDS = itertools.count(10_000_000)  # every call site its own comm_id, as collectives.py gives


# The bindings measured (kernels/cuda/gpu_binding.h, kernels/cuda/bench_probes.cc): "full" every
# attribute on every call, "lite" the comm_id alone (the site registered at lowering), "min" the
# comm_id without the rank and group operands (a measuring stick only), "bare" one operand, one
# result, nothing else. binding -> the no-op handler's FFI target.
_NOOPS = {"bare": "jax_blink_noop_bare", "min": "jax_blink_noop_min", "lite": "jax_blink_noop_lite",
          "full": "jax_blink_noop"}


@functools.cache
def register_noops() -> frozenset[str]:
    """Register the no-op handlers of jax_blink._blink_cuda_probes with XLA (CUDA), once; the
    targets registered, none where the module was not built."""
    try:
        from jax_blink import _blink_cuda_probes
    except ImportError:
        return frozenset()
    handlers = _blink_cuda_probes.registrations()
    for target in _NOOPS.values():
        jax.ffi.register_ffi_target(target, handlers[target], platform="CUDA")
    return frozenset(_NOOPS.values())


def ffi_chain(target: str, k: int, x, program: np.ndarray, binding: str = "full"):
    """A jitted chain of ``k`` calls of ``target`` through ``binding`` (see _NOOPS). No-op targets
    alias their result to the operand (they write nothing). Light-binding calls of our collective
    register their site first, as collectives.py does at lowering."""
    noop = target in _NOOPS.values()
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype),
                            input_output_aliases={0: 0} if noop else None)

    def one(v):
        comm_id = next(_IDS)
        if binding == "bare":
            return call(v)
        if binding == "min":
            return call(v, comm_id=np.int64(comm_id))
        if binding == "lite":
            if not noop:
                _backends.register_call_site("gpu", comm_id, program, 0, 10_000, 0.0)
            return call(v, jnp.int32(0), jnp.int32(0), comm_id=np.int64(comm_id))
        return call(v, jnp.int32(0), jnp.int32(0), program=program, op=np.int32(0),
                    comm_id=np.int64(comm_id), timeout_ms=np.int64(10_000), host_share=np.float32(0))

    def body(v):
        for _ in range(k):
            v = one(v)
        return v
    return jax.jit(body)


def xla_chain(k: int):
    """A jitted chain of ``k`` tiny XLA elementwise kernels (optimization barriers keep them apart)."""
    def body(v):
        for _ in range(k):
            v = lax.optimization_barrier(v * 1.0001)
        return v
    return jax.jit(body)


def rows(elems: int, x) -> list[tuple[str, object]]:
    """(name, k -> jitted chain) for every row this executor can run."""
    program = schedule.encode(schedule.Schedule(1, elems, elems, ()))
    platform = "gpu" if jax.default_backend() == "gpu" else "cpu"
    have = _backends.module(platform).registrations()
    noops = register_noops() if platform == "gpu" else frozenset()
    out = [("XLA elementwise op", xla_chain)]
    for binding, target in _NOOPS.items():  # XLA's own price of an FFI call per binding, no work
        if target in noops:
            out.append((f"no-op FFI, {binding} binding",
                        lambda k, t=target, b=binding: ffi_chain(t, k, x, program, b)))
    out += [("jax_blink full, plain handler", lambda k: ffi_chain(_backends.TARGET, k, x, program)),
            ("jax_blink full, command-buffer handler", lambda k: ffi_chain(_backends.TARGET_CB, k, x, program))]
    if _backends.TARGET_LITE in have:
        out += [("jax_blink lite, plain handler",
                 lambda k: ffi_chain(_backends.TARGET_LITE, k, x, program, "lite")),
                ("jax_blink lite, command-buffer handler",
                 lambda k: ffi_chain(_backends.TARGET_LITE_CB, k, x, program, "lite"))]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k1", type=int, default=20)
    ap.add_argument("--k2", type=int, default=100)
    ap.add_argument("--runs", type=int, default=30, help="rounds per repeat (every program once per round)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--elems", type=int, default=256)
    ap.add_argument("--out", help="also write the table to this file")
    a = ap.parse_args()
    if a.k2 <= a.k1:
        ap.error("--k2 must be larger than --k1")
    platform = jax.default_backend()
    if not _backends.register("gpu" if platform == "gpu" else "cpu"):
        raise SystemExit(f"no jax_blink executor for {platform}")
    x = jnp.asarray(np.random.default_rng(0).standard_normal(a.elems), jnp.float32)
    if platform == "gpu" and not register_noops():
        print("# no jax_blink._blink_cuda_probes: the no-op rows are left out (build with "
              "-Ccmake.define.JAX_BLINK_BUILD_BENCH_PROBES=ON)")
    table = rows(a.elems, x)
    fns = []
    for name, make in table:
        for k in (a.k1, a.k2):
            fn = make(k)
            if name.startswith("jax_blink"):  # a one-rank all-reduce returns its operand
                got = np.asarray(fn(x))
                if not np.array_equal(got, np.asarray(x)):
                    raise SystemExit(f"{name}, {k} calls: wrong result")
            fns.append(fn)
    per_k1: dict[str, list[float]] = {n: [] for n, _ in table}
    marginal: dict[str, list[float]] = {n: [] for n, _ in table}
    for _ in range(a.repeats):
        times = interleaved_times(fns, x, a.runs)
        for i, (name, _) in enumerate(table):
            t1, t2 = statistics.median(times[2 * i]), statistics.median(times[2 * i + 1])
            per_k1[name].append(t1 / a.k1 * 1e6)
            marginal[name].append((t2 - t1) / (a.k2 - a.k1) * 1e6)
    ref = statistics.median(marginal["XLA elementwise op"])
    lines = [f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, "
             f"K1={a.k1}, K2={a.k2}, median of {a.runs} rounds per repeat, {a.repeats} repeats",
             f"# {'row':>38}  {'us/call at K1 (each repeat)':>30}  {'marginal us/call (each repeat)':>30}  "
             f"{'median':>7}  {'/ XLA op':>8}"]
    for name, _ in table:
        m = statistics.median(marginal[name])
        lines.append(f"{name:>40}  {' '.join(f'{v:6.2f}' for v in per_k1[name]):>30}  "
                     f"{' '.join(f'{v:6.2f}' for v in marginal[name]):>30}  {m:7.2f}  {m / ref:8.2f}")
    print("\n".join(lines))
    if a.out:
        with open(a.out, "a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
