"""Every collective, dtype and kernel path on 2, 3 and 4 devices of one process, checked against lax:
short enough to run under compute-sanitizer (benchmarks/gpu_sanitizers.sh).

    python benchmarks/gpu_collectives_driver.py [--quick] [--ranks 2,3,4] [--sizes 4K,1M,16M,64M]
        [--dtypes float32,bfloat16,int32] [--calls 2] [--timeout-s 30] [--reference lax|host]
        [--out driver.json]

For each rank count n (the first n devices) and each (dtype, size): one jitted program holding
all five collectives (all_reduce sum, max and min at the smallest size; broadcast and reduce
rooted at the last rank; all_gather and reduce_scatter tiled, untiled at the smallest size) on
fresh random data, run ``--calls`` times (each time on new data; the first call sets the call
sites up, the later ones replay them), each run checked against an independent lax program on
the same data (psum, pmax, pmin, all_gather, psum_scatter, a masked psum), on the devices: the
largest difference, NaNs that only one side has, and the ranks' bits where every rank must hold
the same result. Before each run, memory of the size of the results is filled with 0xFF and
freed (``--no-poison`` turns it off), so that an element the executor leaves unwritten reads
back as NaN. The executor picks its kernel by size: on GPUs the sizes 4 KiB (LL), 1 MiB
(one-shot on 2 GPUs, trees on more), 16 MiB (trees) and 64 MiB (trees, or the large-message path
where one exists) reach each path; per program the GPU executor's new call sites by kernel
(``sites_by_mode``) are printed, so the log says which paths ran. On 2 GPUs one more program runs
an all_reduce through the host channel (JAX_BLINK_HOST_MIN_BYTES and JAX_BLINK_HOST_SHARE set
while its site is set up).

``--quick`` (under compute-sanitizer, which slows kernels 10-100x): float32 at every size,
bfloat16 at the smallest and the largest, int32 at one size; one call of each program after the
first. Runs on CPU host devices too (the CPU executor; no kernel paths to report).

Prints one line per program and a summary line; ``--out`` writes every result as JSON. Exits 0
when every check passed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import collective_checks as cc  # noqa: E402  (benchmarks/ on the path first)

DEFAULT_SIZES = "4K,1M,16M,64M"
DEFAULT_DTYPES = "float32,bfloat16,int32"


def _parse_sizes(text: str) -> list[int]:
    from jax_blink.options.settings import parse_byte_count

    return [parse_byte_count(s.strip()) for s in text.split(",") if s.strip()]


def plan_programs(n: int, sizes: list[int], dtypes: list[str], quick: bool) -> list[list[cc.Case]]:
    """The programs for n ranks: one list of cases per (dtype, size). ``quick`` keeps float32 at
    every size, bfloat16 at the smallest and largest, int32 at the second size."""
    out = []
    smallest = min(sizes)
    for dtype in dtypes:
        for size in sizes:
            if quick and dtype == "bfloat16" and size not in (min(sizes), max(sizes)):
                continue
            if quick and dtype not in ("float32", "bfloat16") and size != sorted(sizes)[min(1, len(sizes) - 1)]:
                continue
            cases = [cc.Case("all_reduce", dtype, size),
                     cc.Case("broadcast", dtype, size, root=n - 1),
                     cc.Case("reduce", dtype, size, root=n - 1),
                     cc.Case("all_gather", dtype, size),
                     cc.Case("reduce_scatter", dtype, size)]
            if size == smallest:
                cases += [cc.Case("all_reduce", dtype, size, op="max"), cc.Case("all_reduce", dtype, size, op="min"),
                          cc.Case("all_gather", dtype, size, tiled=False),
                          cc.Case("reduce_scatter", dtype, size, tiled=False)]
            out.append(cases)
    return out


def _gpu_module():
    from jax_blink.lowering import backends

    return backends.module("gpu") if backends.register("gpu") else None


def _sites_by_mode(mod) -> dict[str, int]:
    total: dict[str, int] = {}
    if mod is None:
        return total
    for c in mod.comms():
        for m, k in c.get("sites_by_mode", {}).items():
            total[m] = total.get(m, 0) + int(k)
    return total


def run_program(mesh, cases, rng, calls: int, poison: bool, gpu_mod, env: dict | None = None,
                reference: str = "lax") -> dict:
    """Compile ours and lax's program for ``cases``, run ours ``calls`` times on fresh data, each
    checked against lax on the same data (``reference="host"``: against numpy's result of the
    same data, put on the devices; no collective of XLA's runs). ``env``: variables set while the
    call sites are set up (the first call), restored after."""
    import jax

    import jax_blink

    n = mesh.devices.size
    label = f"n={n} {cases[0].dtype} {cc.human_bytes(cases[0].nbytes)}"
    row = {"program": label, "n": n, "dtype": cases[0].dtype, "nbytes": cases[0].nbytes,
           "cases": [c.label() for c in cases], "runs": [], "ok": True}
    t0 = time.perf_counter()
    result_bytes = max(c.nbytes for c in cases) * len(cases)
    try:
        ours, ref = cc.programs(mesh, cases)
        hosts = [cc.random_operand(rng, c, n) for c in cases]
        args = [cc.put(mesh, h) for h in hosts]
        compiled = ours.lower(*args).compile()
        # the executor's custom call must be in the optimized program (no quiet lax)
        row["custom_call_in_program"] = "jax_blink_collective" in compiled.as_text()
        if not row["custom_call_in_program"]:
            raise RuntimeError("no jax_blink_collective custom call in the optimized program")
        before = _sites_by_mode(gpu_mod)
        for k in range(calls):
            if k:
                hosts = [cc.random_operand(rng, c, n) for c in cases]
                args = [cc.put(mesh, h) for h in hosts]
            if poison:
                cc.poison_device_memory(list(mesh.devices.flat), result_bytes)
            with cc.environment(env if k == 0 else None):  # read at the sites' set-up, in the first call
                got = jax.block_until_ready(compiled(*args))
            jax_blink.check()
            if k == 0:
                after = _sites_by_mode(gpu_mod)
                if gpu_mod is not None:
                    row["new_sites_by_mode"] = {m: after.get(m, 0) - before.get(m, 0) for m in after
                                            if after.get(m, 0) != before.get(m, 0)}
            if reference == "host":
                want = [cc.put(mesh, c.host(h, n)) for c, h in zip(cases, hosts)]
            else:
                want = jax.block_until_ready(ref(*args))
            checks = cc.compare(mesh, cases, got, want)
            bad = [c for c in checks if not c["ok"]]
            row["runs"].append({"call": k + 1, "failures": bad})
            row["ok"] = row["ok"] and not bad
            del got, want
    except Exception as e:  # noqa: BLE001  a failed call: record it, clear the executors, go on
        row["ok"] = False
        row["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
        try:
            jax_blink.reset()
        except Exception as e2:  # noqa: BLE001
            row["reset_error"] = str(e2)[:500]
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/gpu_collectives_driver.py",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer dtype/size pairs, 2 calls each (under a sanitizer)")
    ap.add_argument("--ranks", default=None, help="rank counts, e.g. 2,3,4 (default: 2 up to min(4, devices))")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help=f"bytes per rank (default {DEFAULT_SIZES})")
    ap.add_argument("--dtypes", default=DEFAULT_DTYPES, help=f"(default {DEFAULT_DTYPES})")
    ap.add_argument("--calls", type=int, default=None, help="runs of each program (default 3, --quick 2)")
    ap.add_argument("--timeout-s", type=float, default=None,
                    help="jax_blink.config.timeout_s (default: JAX_BLINK_TIMEOUT_S or 10; raise it under a sanitizer)")
    ap.add_argument("--no-poison", action="store_true", help="do not fill freed memory with 0xFF before each run")
    ap.add_argument("--no-host-channel", action="store_true", help="skip the 2-device host-channel program")
    ap.add_argument("--reference", choices=("lax", "host"), default="lax",
                    help="what each result is checked against: lax's collectives on the devices (default), "
                         "or numpy's result on the host, put on the devices: no NCCL set-up, which under "
                         "compute-sanitizer took 40 s and more")
    ap.add_argument("--collectives", default=None,
                    help=f"keep only these of {','.join(cc.COLLECTIVES)} in every program (default all: "
                         "one at a time narrows a sanitizer's finding to a kernel)")
    ap.add_argument("--seed", type=int, default=31)
    ap.add_argument("--out", metavar="JSON", help="write every result here")
    args = ap.parse_args(argv)
    try:
        sizes = _parse_sizes(args.sizes)
    except ValueError as e:
        ap.error(f"--sizes: {e}")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    keep = [c.strip() for c in args.collectives.split(",") if c.strip()] if args.collectives else None
    if keep is not None and (not keep or set(keep) - set(cc.COLLECTIVES)):
        ap.error(f"--collectives: {args.collectives!r} names none or others than {','.join(cc.COLLECTIVES)}")
    args.keep = keep
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        ap.error(f"no folder to write {args.out!r} in")

    import jax

    import jax_blink

    bad_dtypes = [d for d in dtypes if d not in jax_blink.SUPPORTED_DTYPES]
    if bad_dtypes:
        ap.error(f"--dtypes: {bad_dtypes} not supported; supported: {', '.join(jax_blink.SUPPORTED_DTYPES)}")
    devices = jax.devices()
    if len(devices) < 2:
        ap.error(f"needs 2 or more devices; jax sees {len(devices)} ({devices[0].platform}): run it on GPUs, or on "
                 "CPU host devices with XLA_FLAGS=--xla_force_host_platform_device_count=4")
    ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else list(range(2, min(4, len(devices)) + 1))
    if not ranks or min(ranks) < 2 or max(ranks) > len(devices):
        ap.error(f"--ranks must lie in 2..{len(devices)} (the devices jax sees), got {args.ranks or 'none'}")
    calls = args.calls or (2 if args.quick else 3)
    from jax_blink.options.settings import override

    fields = {"dispatch": "blink", "fallback": "raise"}  # every size through the executor, never quietly to lax
    if args.timeout_s is not None:
        fields["timeout_s"] = args.timeout_s
    with override(**fields):  # this run's options, not the caller's after it (main() runs in tests too)
        return _drive(args, devices, ranks, sizes, dtypes, calls)


def _drive(args, devices, ranks, sizes, dtypes, calls) -> int:
    """Every program of the run, printed and checked; ``--out`` written. Exits as :func:`main`."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import jax_blink

    platform = devices[0].platform
    gpu_mod = _gpu_module() if platform == "gpu" else None
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    rows = []
    print(f"# {platform} x{len(devices)} ({devices[0].device_kind}), jax {jax.__version__}, ranks {ranks}, "
          f"sizes {[cc.human_bytes(s) for s in sizes]} per rank, dtypes {dtypes}, {calls} calls per program, "
          f"timeout_s {jax_blink.config.timeout_s:g}, poison {'off' if args.no_poison else 'on'}", flush=True)
    for n in ranks:
        mesh = Mesh(np.array(devices[:n]), (cc.AXIS,))
        todo = [(cases, None) for cases in plan_programs(n, sizes, dtypes, args.quick)]
        if args.keep is not None:
            todo = [([c for c in cases if c.what in args.keep], env) for cases, env in todo]
            todo = [(cases, env) for cases, env in todo if cases]
        if n == 2 and platform == "gpu" and not args.no_host_channel and (args.keep is None or "all_reduce" in args.keep):
            todo.append(([cc.Case("all_reduce", "float32", max(sizes))],
                         {"JAX_BLINK_HOST_MIN_BYTES": "1M", "JAX_BLINK_HOST_SHARE": "0.1"}))
        for cases, env in todo:
            row = run_program(mesh, cases, rng, calls, not args.no_poison, gpu_mod, env, args.reference)
            if env:
                row["program"] += " (host channel)"
                row["env"] = env
            rows.append(row)
            fails = sum(len(r["failures"]) for r in row["runs"])
            modes = row.get("new_sites_by_mode")
            print(f"{row['program']}: {len(cases)} collectives x {len(row['runs'])} calls, "
                  f"{'ok' if row['ok'] else 'FAILED'}" + (f", {fails} wrong" if fails else "")
                  + (f", kernels (new sites per mode) {modes}" if modes is not None else "")
                  + f", {row['seconds']} s" + (f"\n  error: {row['error'][:600]}" if "error" in row else ""),
                  flush=True)
            for r in row["runs"]:
                for f in r["failures"][:5]:
                    print(f"  call {r['call']}: {f['case']}: {'; '.join(f['problems'])}")
    failed = [r["program"] for r in rows if not r["ok"]]
    checks = sum(len(r["cases"]) * len(r["runs"]) for r in rows)
    summary = {"ok": not failed, "platform": platform, "device_kind": devices[0].device_kind,
               "jax": jax.__version__, "ranks": ranks, "programs": len(rows), "checks": checks,
               "failed_programs": failed, "reference": args.reference, "seconds": round(time.perf_counter() - t0, 1),
               "date": time.strftime("%Y-%m-%d"), "rows": rows}
    print(f"driver: {len(rows)} programs, {checks} collective calls checked against "
          f"{'numpy (host)' if args.reference == 'host' else 'lax'}, "
          f"{len(failed)} programs failed, {summary['seconds']} s ({platform}, {devices[0].device_kind})", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
