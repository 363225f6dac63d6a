"""A bounded soak: mixed jax_blink collectives, sizes, dtypes and call orders on every visible
device, every result checked against lax, memory sampled before and after.

    python benchmarks/gpu_soak.py --duration 60 [--devices 4] [--min-bytes 1K] [--max-bytes 256M]
        [--orders 6] [--seed 0] [--out soak.json]

``--orders`` call orders (jitted programs of 1-4 collectives each: all_reduce with sum, max or
min, broadcast and reduce at a random root, all_gather and reduce_scatter tiled or not, in
float32, bfloat16 or int32, drawn from a seeded RNG) run over one mesh of ``--devices`` devices
(default all). Each iteration picks an order and a size per rank (log-uniform between
``--min-bytes`` and ``--max-bytes``, powers of two and 3/4 of them; default 1 KiB-256 MiB on GPUs,
1 KiB-256 KiB on CPU host devices), draws fresh random operands on the devices (a new key per
iteration), runs our program and an independent lax program on them
(benchmarks/collective_checks.py) and compares them on the devices. A wrong value or an
exception counts as an error (after an exception ``jax_blink.reset()`` clears the executors and
the soak goes on).

Two phases: the first 40% of the duration compiles new (order, size) programs as it meets them;
the rest only reruns programs already compiled, so that memory measured across it is the
steady state: compiled programs and call sites legitimately add memory, a leak keeps adding it.
Memory is sampled at the start, when the steady phase begins ("before") and at the end
("after", once every result is freed): per device XLA's ``memory_stats()`` (bytes in use, peak)
and, on GPUs, NVML's bytes used on the GPU and by this process (what XLA's pool does not count:
our executor's own allocations, the CUDA context),
the executors' own memory (the CUDA executor's communicators: staging and control device memory,
pinned host memory of the host channel; the CPU executor's communicator count) and the process's
resident and locked memory from /proc/self/status (VmRSS, VmHWM, VmLck, VmPin: a proxy for
pinned memory, which CUDA does not always count there).

Prints calls run, errors and memory before and after; ``--out`` writes it all as JSON. Exits 0
when no error occurred, 1 otherwise. The duration bounds starting new iterations (the first one
always runs); a bounded wall time needs ``timeout`` around it as well.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import collective_checks as cc  # noqa: E402  (benchmarks/ on the path first)

DTYPES = ("float32", "bfloat16", "int32")
#: Share of the duration that may compile new programs; the rest reruns them (steady state).
COMPILE_SHARE = 0.4
#: NVML samples taken at even times through the steady phase: a leak climbs through them, a
#: one-time allocation (a lazily made buffer of CUDA's or XLA's) steps once.
STEADY_SAMPLES = 10


def draw_orders(rng, count: int, n: int) -> list[list[cc.Case]]:
    """``count`` call orders of 1-4 collectives with random options and dtypes (sizes set later:
    ``nbytes`` here is a placeholder of 1)."""
    orders = []
    for _ in range(count):
        order = []
        for _ in range(int(rng.integers(1, 5))):
            what = str(rng.choice(cc.COLLECTIVES))
            order.append(cc.Case(what, str(rng.choice(DTYPES)), 1,
                                 op=str(rng.choice(("sum", "max", "min"))) if what == "all_reduce" else "sum",
                                 root=int(rng.integers(0, n)), tiled=bool(rng.integers(0, 2))))
        orders.append(order)
    return orders


def draw_size(rng, lo: int, hi: int) -> int:
    """Bytes per rank, log-uniform: 2^k or 3/4 of it, within [lo, hi]."""
    k = int(rng.integers(lo.bit_length() - 1, hi.bit_length()))
    size = (1 << k) * (3 if rng.integers(0, 2) else 4) // 4
    return max(lo, min(hi, size))


def _proc_status() -> dict:
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM", "VmLck", "VmPin"):
                    out[key + "_kib"] = int(rest.split()[0])
    except OSError:  # not Linux
        pass
    return out


def _nvml_memory(devices) -> list[dict]:
    """Per GPU from NVML: the bytes used on the whole GPU (``nvml_used_bytes``: every allocation,
    XLA's pool and ours alike) and by this process where NVML can tell (``nvml_process_bytes``; a
    container may hide processes); [] where NVML cannot be read."""
    try:
        import pynvml as nvml

        from jax_blink.planning.topology import nvml_handles

        nvml.nvmlInit()
    except Exception:  # noqa: BLE001  no NVML here: the sample has XLA's numbers only
        return []
    try:
        out = []
        for h in nvml_handles(nvml, devices):
            row = {"nvml_used_bytes": int(nvml.nvmlDeviceGetMemoryInfo(h).used)}
            try:
                mine = [p.usedGpuMemory for p in nvml.nvmlDeviceGetComputeRunningProcesses(h)
                        if p.pid == os.getpid() and p.usedGpuMemory is not None]
            except nvml.NVMLError:
                mine = []
            if mine:
                row["nvml_process_bytes"] = int(sum(mine))
            out.append(row)
        return out
    except Exception:  # noqa: BLE001
        return []
    finally:
        nvml.nvmlShutdown()


def sample(devices) -> dict:
    """Device, executor and process memory now (numbers in bytes unless a key says KiB)."""
    from jax_blink.lowering import backends

    per_device = []
    for d in devices:
        try:
            st = d.memory_stats() or {}
        except Exception:  # noqa: BLE001  a backend without memory stats
            st = {}
        per_device.append({k: int(st[k]) for k in ("bytes_in_use", "peak_bytes_in_use", "num_allocs")
                           if k in st})
    platform = devices[0].platform
    if platform == "gpu":
        for d, nv in zip(per_device, _nvml_memory(devices)):
            d.update(nv)
    executor: dict = {}
    if platform == "gpu" and backends.register("gpu"):
        comms = backends.module("gpu").comms()
        executor = {"communicators": len(comms), "sites": sum(c["num_sites"] for c in comms),
                    "staging_bytes": sum(c["staging_bytes"] for c in comms),
                    "control_bytes": sum(c["control_bytes"] for c in comms),
                    "pinned_host_bytes": sum(c["host_bytes"] for c in comms)}
    elif platform == "cpu" and backends.register("cpu"):
        mod = backends.module("cpu")
        if hasattr(mod, "num_comms"):
            executor = {"communicators": int(mod.num_comms())}
    return {"t": round(time.time(), 2), "devices": per_device, "executor": executor, "process": _proc_status()}


def growth(before: dict, after: dict) -> dict:
    """after - before, per number that both samples have (device numbers summed over devices)."""
    def flat(s):
        out = {}
        for d in s["devices"]:
            for k, v in d.items():
                if k != "peak_bytes_in_use":  # a peak only grows; it says nothing of a leak
                    out["device_" + k] = out.get("device_" + k, 0) + v
        out.update({"executor_" + k: v for k, v in s["executor"].items()})
        out.update({"process_" + k: v for k, v in s["process"].items()})
        return out
    b, a = flat(before), flat(after)
    return {k: a[k] - b[k] for k in a if k in b}


class Soak:
    """The programs (compiled lazily, kept) and the counters of one soak."""

    def __init__(self, mesh, orders, seed: int):
        import jax

        self.mesh, self.orders, self.n = mesh, orders, mesh.devices.size
        self.programs: dict = {}
        self.key = jax.random.key(seed)
        self.iterations = self.calls = 0
        self.errors: list[dict] = []
        self.by_collective: dict[str, int] = {}
        self.sizes: list[int] = []

    def _program(self, order_index: int, nbytes: int):
        import dataclasses

        import jax
        import jax.numpy as jnp
        from jax import lax
        from jax.sharding import PartitionSpec as P

        key = (order_index, nbytes)
        if key not in self.programs:
            cases = [dataclasses.replace(c, nbytes=nbytes) for c in self.orders[order_index]]
            n = self.n

            def operands(k):  # fresh random data on every rank's device, per iteration
                k = jax.random.fold_in(k, lax.axis_index(cc.AXIS))
                out = []
                for i, c in enumerate(cases):
                    ki = jax.random.fold_in(k, i)
                    shape = c.shape(n)
                    if c.dtype == "int32":
                        out.append(jax.random.randint(ki, shape, -1000, 1000, jnp.int32))
                    else:
                        out.append(jax.random.uniform(ki, shape, jnp.float32, -1.0, 1.0).astype(c.dtype))
                return tuple(out)

            spec = (P(cc.AXIS),) * len(cases)
            gen = jax.jit(jax.shard_map(operands, mesh=self.mesh, in_specs=P(), out_specs=spec, check_vma=False))
            ours, ref = cc.programs(self.mesh, cases)
            self.programs[key] = (cases, gen, ours, ref)
        return self.programs[key]

    def iterate(self, order_index: int, nbytes: int) -> None:
        import jax

        import jax_blink

        cases, gen, ours, ref = self._program(order_index, nbytes)
        self.key, sub = jax.random.split(self.key)
        label = f"order {order_index} [{', '.join(c.label().split('/')[0] for c in cases)}] {cc.human_bytes(nbytes)}"
        try:
            ops = gen(sub)
            got = jax.block_until_ready(ours(*ops))
            jax_blink.check()  # a GPU kernel's failure is recorded, not raised: raise it here
            want = ref(*ops)
            bad = [r for r in cc.compare(self.mesh, cases, got, want) if not r["ok"]]
            if bad:
                self.errors.append({"iteration": self.iterations, "program": label, "wrong": bad[:4]})
        except Exception as e:  # noqa: BLE001  count it, clear the executors, go on
            self.errors.append({"iteration": self.iterations, "program": label,
                                "exception": f"{type(e).__name__}: {str(e)[:1500]}"})
            try:
                jax_blink.reset()
            except Exception as e2:  # noqa: BLE001
                self.errors[-1]["reset"] = str(e2)[:300]
        self.iterations += 1
        self.calls += len(cases)
        self.sizes.append(nbytes)
        for c in cases:
            self.by_collective[c.what] = self.by_collective.get(c.what, 0) + 1


def run(duration: float, devices=None, min_bytes: int = 1 << 10, max_bytes: int | None = None,
        orders: int = 6, seed: int = 0, timeout_s: float | None = None) -> dict:
    """Run the soak for ``duration`` seconds on ``devices`` (default all); returns the report."""
    import jax

    from jax_blink.options.settings import override

    devices = list(devices or jax.devices())
    if len(devices) < 2:
        raise ValueError(f"the soak needs 2 or more devices, jax sees {len(devices)}")
    platform = devices[0].platform
    max_bytes = max_bytes or ((256 << 20) if platform == "gpu" else (256 << 10))
    if not 16 <= min_bytes <= max_bytes:
        raise ValueError(f"need 16 <= min_bytes <= max_bytes, got {min_bytes} and {max_bytes}")
    fields = {"dispatch": "blink", "fallback": "raise"}  # every size through the executor, never quietly to lax
    if timeout_s is not None:
        fields["timeout_s"] = timeout_s
    with override(**fields):  # this run's options, not the caller's after it
        return _soak(duration, devices, platform, min_bytes, max_bytes, orders, seed)


def _soak(duration, devices, platform, min_bytes, max_bytes, orders, seed) -> dict:
    import jax
    import numpy as np
    from jax.sharding import Mesh

    rng = np.random.default_rng(seed)
    mesh = Mesh(np.array(devices), (cc.AXIS,))
    soak = Soak(mesh, draw_orders(rng, orders, len(devices)), seed)
    t0 = time.monotonic()
    start = sample(devices)
    before = None
    steady_iterations = steady_calls = 0
    trace, next_trace = [], None  # NVML in the steady phase: (seconds, calls, bytes used per GPU)
    steady_s = (1 - COMPILE_SHARE) * duration
    while True:
        elapsed = time.monotonic() - t0
        if soak.iterations and elapsed >= duration:
            break
        compiling = elapsed < COMPILE_SHARE * duration or not soak.programs
        if not compiling and before is None:
            gc.collect()
            before = sample(devices)
            next_trace = elapsed
        if platform == "gpu" and next_trace is not None and elapsed >= next_trace:
            used = [d.get("nvml_used_bytes") for d in _nvml_memory(devices)]
            if used and None not in used:
                trace.append({"s": round(elapsed, 2), "steady_calls": steady_calls, "nvml_used_bytes": used})
            next_trace += steady_s / STEADY_SAMPLES
        if compiling:
            # The first program at the largest size, so that the top of the range always runs
            # (a 60 s draw on 4 x H200 reached only 64 of 256 MiB); the others drawn.
            order = int(rng.integers(0, len(soak.orders)))
            size = max_bytes if not soak.programs else draw_size(rng, min_bytes, max_bytes)
        else:
            keys = sorted(soak.programs)
            order, size = keys[int(rng.integers(0, len(keys)))]
        calls = soak.calls
        soak.iterate(order, size)
        if before is not None:
            steady_iterations += 1
            steady_calls += soak.calls - calls
    gc.collect()
    after = sample(devices)
    if before is None:  # the whole duration went to compiling: no steady phase
        before = start
    return {
        "ok": not soak.errors, "platform": platform, "device_kind": devices[0].device_kind,
        "devices": len(devices), "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
        "duration_s": duration, "seconds": round(time.monotonic() - t0, 2), "seed": seed,
        "sizes_bytes": [min_bytes, max_bytes], "iterations": soak.iterations, "calls": soak.calls,
        "calls_by_collective": soak.by_collective, "programs_compiled": len(soak.programs),
        "orders": [[c.label().split("/")[0] + "/" + c.dtype for c in o] for o in soak.orders],
        "distinct_sizes": len(set(soak.sizes)), "largest_bytes": max(soak.sizes),
        "steady": {"iterations": steady_iterations, "calls": steady_calls},
        "errors": len(soak.errors), "error_details": soak.errors[:20],
        "memory": {"start": start, "before": before, "after": after,
                   "growth_steady": growth(before, after), "growth_total": growth(start, after),
                   "steady_trace": trace},
    }


def _mib(v: int) -> str:
    return f"{v / (1 << 20):.1f} MiB"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/gpu_soak.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, required=True, help="seconds of new iterations (bounded run)")
    ap.add_argument("--devices", type=int, default=None, help="use the first N devices (default all)")
    ap.add_argument("--min-bytes", default="1K")
    ap.add_argument("--max-bytes", default=None, help="default 256M on GPUs, 256K on CPU host devices")
    ap.add_argument("--orders", type=int, default=6, help="call orders (jitted programs of 1-4 collectives)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=None, help="jax_blink.config.timeout_s")
    ap.add_argument("--out", metavar="JSON")
    args = ap.parse_args(argv)
    from jax_blink.options.settings import parse_byte_count

    try:
        lo = parse_byte_count(args.min_bytes)
        hi = parse_byte_count(args.max_bytes) if args.max_bytes else None
    except ValueError as e:
        ap.error(str(e))
    if args.duration <= 0:
        ap.error(f"--duration must be > 0 seconds, got {args.duration:g}")
    if args.orders < 1:
        ap.error("--orders must be 1 or more")
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        ap.error(f"no folder to write {args.out!r} in")
    import jax

    devices = jax.devices()
    if args.devices is not None:
        if not 2 <= args.devices <= len(devices):
            ap.error(f"--devices must lie in 2..{len(devices)} (the devices jax sees), got {args.devices}")
        devices = devices[:args.devices]
    try:
        r = run(args.duration, devices, lo, hi, args.orders, args.seed, args.timeout_s)
    except ValueError as e:
        ap.error(str(e))
    m = r["memory"]
    dev = lambda s: sum(d.get("bytes_in_use", 0) for d in s["devices"])  # noqa: E731
    print(f"soak: {r['platform']} x{r['devices']} ({r['device_kind']}), {r['seconds']} s (duration {args.duration:g} s): "
          f"{r['iterations']} iterations, {r['calls']} collective calls checked against lax "
          f"({r['steady']['calls']} in the steady phase), {r['programs_compiled']} programs, "
          f"{r['distinct_sizes']} sizes up to {cc.human_bytes(r['largest_bytes'])} per rank; errors: {r['errors']}")
    print(f"  calls by collective: {r['calls_by_collective']}")
    print(f"  device memory in use (all devices, XLA): start {_mib(dev(m['start']))}, before {_mib(dev(m['before']))}, "
          f"after {_mib(dev(m['after']))}")
    for key, what in (("nvml_used_bytes", "used on the GPUs (all devices, NVML: every allocation)"),
                      ("nvml_process_bytes", "used by this process (all devices, NVML)")):
        if all(d.get(key) is not None for s in (m["start"], m["before"], m["after"]) for d in s["devices"]):
            total = lambda s: sum(d[key] for d in s["devices"])  # noqa: E731
            print(f"  device memory {what}: start {_mib(total(m['start']))}, before {_mib(total(m['before']))}, "
                  f"after {_mib(total(m['after']))}")
    for name in ("before", "after"):
        s = m[name]
        print(f"  {name}: executor {s['executor']}; process {s['process']}")
    if m.get("steady_trace"):
        t = m["steady_trace"]
        base = t[0]["nvml_used_bytes"]
        print(f"  device memory used on each GPU (NVML) through the steady phase, MiB above its first sample, "
              f"at {len(t)} samples (seconds, steady calls): "
              + "; ".join(f"{x['s']:g} s, {x['steady_calls']}: "
                          + "/".join(f"{(u - b) / 2**20:+.0f}" for u, b in zip(x["nvml_used_bytes"], base))
                          for x in t))
    print(f"  growth in the steady phase (after - before): {m['growth_steady']}")
    for e in r["error_details"][:5]:
        print(f"  error: {json.dumps(e)[:500]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(r, f, indent=1)
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
