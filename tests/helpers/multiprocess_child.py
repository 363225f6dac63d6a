"""One process of a multi-process CPU job (started by tests/multiprocess/test_multiprocess.py, or by hand).

    python tests/helpers/multiprocess_child.py SCENARIO PROCESS_ID NUM_PROCESSES PORT LOCAL_DEVICES

Scenarios:
  collectives  every collective, op, several dtypes and shapes over an axis spanning the processes,
               against lax, ranks bitwise identical, the custom call in the optimized HLO; then,
               with MP_PER_HOST=k, every k processes a "host": the three-phase all_reduce,
               reduce_scatter and all_gather over that axis, over ("host", "local") and over
               one axis whose ranks alternate between the hosts.
  skip         one good call, then the last process skips the second call of the same collective.
  die          one good call, then the last process exits before a new collective.

Prints one line "RESULT {json}" and exits 0 when every check it made passed (for the fault
scenarios: the surviving processes end with an error naming the faulty process, in time).
"""
from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    scenario, pid, nproc, port, local = sys.argv[1], *map(int, sys.argv[2:6])
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={local}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("PJRT_NPROC", "16")  # as tests/conftest.py: a thread per host device
    os.environ["JAX_BLINK_FALLBACK"] = "raise"  # a quiet fall-back to lax cannot pass
    os.environ["JAX_BLINK_DISPATCH"] = "blink"  # no size is sent to lax
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
                               initialization_timeout=60)
    out = SCENARIOS[scenario](pid, nproc, local)
    print("RESULT " + json.dumps(out), flush=True)
    ok = out.get("ok", False)
    if scenario != "collectives":
        # A job with a faulty process cannot shut down in order (jax's shutdown barrier would wait
        # for the dead one): clean up what jax_blink owns, then leave.
        import jax_blink.lowering.processes

        jax_blink.lowering.processes.cleanup()
        sys.stdout.flush()
        os._exit(0 if ok else 1)
    jax.distributed.shutdown()
    return 0 if ok else 1


def _global(mesh, spec, make):
    """A global array whose shard i is make(i) (each process builds its own shards)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding

    sharding = NamedSharding(mesh, spec)
    shape = (mesh.devices.size,) + make(0).shape[1:]
    return jax.make_array_from_callback(shape, sharding, lambda idx: np.concatenate(
        [make(i) for i in range(*idx[0].indices(shape[0]))]))


def _gather(x):
    from jax.experimental import multihost_utils
    import numpy as np

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


LEAN = {"all_reduce/sum/float32/(3, 5)", "all_reduce/max/float32/(3, 5)", "all_reduce/sum/int32/(7,)",
        "all_gather/float32/(3, 5)", "all_gather_tiled/int32/(7,)", "reduce_scatter/float32",
        "reduce_scatter_tiled/int32"}


def collectives(pid: int, nproc: int, local: int) -> dict:
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, PartitionSpec as P

    import jax_blink
    import jax_blink.lowering.processes
    from jax_blink.lowering import backends as _backends

    n = jax.device_count()
    checks = []
    failures = []
    walls = {}

    def check(name, ok, detail=""):
        checks.append(name)
        if not ok:
            failures.append(f"{name}: {detail}")

    rng = np.random.default_rng(1234)  # the same data in every process: each builds its shards
    dtypes = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "int32": np.int32, "float64": np.float64}
    shapes = [(7,), (3, 5), (1031,)]
    data = {}
    for dname, dt in dtypes.items():
        for shape in shapes:
            if dname == "int32":
                v = rng.integers(-1000, 1000, size=(n,) + shape).astype(dt)
            else:
                v = rng.standard_normal((n,) + shape).astype(dt)
            data[(dname, shape)] = v

    def per_rank(fn):
        return lambda v: fn(v[0])[None]

    def run_axis(mesh, axis, spec, target=_backends.TARGET_MP, hosts=False, label=None, lean=False):
        """Every collective over ``axis`` (a name or a tuple) of ``mesh``: blink and lax side by
        side (``hosts``: the ranks span hosts: all_reduce, reduce_scatter, all_gather); checks
        are named by ``label`` (default: the axis); ``lean``: a few cases of each collective
        (each case compiles its phases: the job's time goes there)."""
        label = label or str(axis)
        start = time.perf_counter()
        cases = []  # (name, blink fn, lax fn, key, replicated)
        # Across hosts fewer cases (each compiles three phases): one shape per dtype for all_reduce
        # and all_gather, (1031,) for reduce_scatter.
        few = {("float32", (3, 5)), ("bfloat16", (1031,)), ("int32", (7,)), ("float64", (3, 5))}
        for (dname, shape), _ in data.items():
            if hosts and (dname, shape) not in few and (shape != (1031,) or dname not in ("float32", "int32")):
                continue
            for op, lfn in (("sum", lax.psum), ("max", lax.pmax), ("min", lax.pmin)):
                if (op != "sum" and shape != (3, 5)) or (hosts and (dname, shape) not in few):
                    continue
                cases.append((f"all_reduce/{op}/{dname}/{shape}",
                              lambda v, op=op: jax_blink.all_reduce(v, axis, op=op),
                              lambda v, lfn=lfn: lfn(v, axis), (dname, shape), True))
            if shape == (3, 5) and not hosts:
                root = n - 1
                cases.append((f"broadcast/{dname}", lambda v: jax_blink.broadcast(v, axis, root=root),
                              lambda v: lax.psum(jnp.where(lax.axis_index(axis) == root, v, jnp.zeros_like(v)), axis),
                              (dname, shape), True))
                cases.append((f"reduce/{dname}", lambda v: jax_blink.reduce(v, axis, root=1),
                              lambda v: jnp.where(lax.axis_index(axis) == 1, lax.psum(v, axis), v),
                              (dname, shape), False))
                cases.append((f"all_gather/{dname}", lambda v: jax_blink.all_gather(v, axis),
                              lambda v: lax.all_gather(v, axis), (dname, shape), True))
                cases.append((f"all_gather_tiled/{dname}", lambda v: jax_blink.all_gather(v, axis, axis=1, tiled=True),
                              lambda v: lax.all_gather(v, axis, axis=1, tiled=True), (dname, shape), True))
            if shape == (1031,) and dname in ("float32", "int32") and not hosts:
                def rs_in(v):
                    return jnp.tile(v[:5], (n, 1))  # dimension 0 of size n
                cases.append((f"reduce_scatter/{dname}", lambda v: jax_blink.reduce_scatter(rs_in(v), axis),
                              lambda v: lax.psum_scatter(rs_in(v), axis), (dname, shape), False))
            if hosts:  # across hosts: every block distinct, so that a wrong piece order shows
                if (dname, shape) in few:
                    cases.append((f"all_gather/{dname}/{shape}", lambda v: jax_blink.all_gather(v, axis),
                                  lambda v: lax.all_gather(v, axis), (dname, shape), True))
                if (dname, shape) in (("float32", (3, 5)), ("int32", (7,))):
                    a = len(shape) - 1
                    cases.append((f"all_gather_tiled/{dname}/{shape}",
                                  lambda v, a=a: jax_blink.all_gather(v, axis, axis=a, tiled=True),
                                  lambda v, a=a: lax.all_gather(v, axis, axis=a, tiled=True), (dname, shape), True))
                if shape == (1031,) and dname in ("float32", "int32", "bfloat16"):
                    def rs_blocks(v):  # dimension 0 of size n, n different blocks
                        return v[:5 * n].reshape(n, 5)

                    def rs_tiled(v):  # dimension 1 of size 3n: blocks of 3 columns
                        return v[:6 * n].reshape(2, 3 * n)
                    cases.append((f"reduce_scatter/{dname}", lambda v: jax_blink.reduce_scatter(rs_blocks(v), axis),
                                  lambda v: lax.psum_scatter(rs_blocks(v), axis), (dname, shape), False))
                    cases.append((f"reduce_scatter_tiled/{dname}",
                                  lambda v: jax_blink.reduce_scatter(rs_tiled(v), axis, scatter_dimension=1, tiled=True),
                                  lambda v: lax.psum_scatter(rs_tiled(v), axis, scatter_dimension=1, tiled=True),
                                  (dname, shape), False))
        if lean:
            cases = [c for c in cases if c[0] in LEAN]
        keys = sorted({c[3] for c in cases}, key=str)

        def program(which):
            def body(*vs):
                by_key = dict(zip(keys, vs))
                return tuple(c[which](by_key[c[3]][0])[None] for c in cases)
            return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(keys),
                                         out_specs=(spec,) * len(cases), check_vma=False))

        # Two programs: XLA's CPU runtime may order independent XLA collectives and custom calls
        # differently on different devices, and ranks blocked in different ones wait for ever.
        blink, reference = program(1), program(2)
        args = [_global(mesh, spec, lambda i, k=k: data[k][i:i + 1]) for k in keys]
        hlo = blink.lower(*args).compile().as_text()
        check(f"{label}: custom call in optimized HLO", target in hlo, f"{target} not found in the compiled program")
        if hosts:  # the phases between hosts are XLA's own collectives
            between = ("all-reduce", "reduce-scatter", "all-gather") if isinstance(axis, tuple) else ("collective-permute",)
            check(f"{label}: XLA collectives between hosts in the HLO", all(op in hlo for op in between),
                  f"not all of {between} in the program")
        t0 = time.perf_counter()
        got_all = jax.block_until_ready(blink(*args))
        elapsed = time.perf_counter() - t0
        got_all = [_gather(o) for o in got_all]
        want_all = [_gather(o) for o in reference(*args)]
        for i, (name, _, _, key, replicated) in enumerate(cases):
            got, want = got_all[i], want_all[i]
            name = f"{label}: {name}"
            if got.shape != want.shape or got.dtype != want.dtype:
                check(name, False, f"shape/dtype {got.shape} {got.dtype} vs lax {want.shape} {want.dtype}")
                continue
            exact = key[0] == "int32" or "max" in name or "min" in name or "gather" in name or "broadcast" in name
            if exact:
                ok = np.array_equal(got.view(np.uint8), want.view(np.uint8))
            else:
                tol = 3e-2 if key[0] == "bfloat16" else 1e-5
                ok = np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)
            check(name, ok, f"differs from lax: max abs diff "
                  f"{np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)))}")
            if replicated:
                same = all(np.array_equal(got[r].view(np.uint8), got[0].view(np.uint8)) for r in range(n))
                check(name + " ranks bitwise identical", same, "ranks disagree")
        walls[label] = round(time.perf_counter() - start, 2)  # compiling both programs included
        return elapsed

    mesh = Mesh(np.array(jax.devices()), ("x",))
    times = {"x": run_axis(mesh, "x", P("x"))}  # one host: the flat collectives over shared memory
    per_host = int(os.environ.get("MP_PER_HOST", "0"))
    if per_host:  # then every `per_host` processes a "host": three phases for all_reduce
        jax_blink.lowering.processes.set_processes_per_host(per_host)
        hosts = nproc // per_host
        target = _backends.TARGET_MP if per_host > 1 else _backends.TARGET  # one process per host: in-process
        # One axis in jax.devices() order (host-major): a few cases; the interleaved one below runs
        # them all on the same path (ppermute rounds between the hosts).
        times["x over hosts"] = run_axis(mesh, "x", P("x"), target, hosts=True, label="x over hosts", lean=True)
        mesh2 = Mesh(np.array(jax.devices()).reshape(hosts, -1), ("host", "local"))
        times["host,local"] = run_axis(mesh2, ("host", "local"), P(("host", "local")), target, hosts=True)
        # One axis whose ranks alternate between the hosts (rank order is not host-major): the
        # pieces' order must still be lax's. The concrete mesh in context tells jax_blink the order.
        by_host = {}
        for d in jax.devices():
            by_host.setdefault(d.process_index // per_host, []).append(d)
        interleaved = Mesh(np.array([d for ds in zip(*by_host.values()) for d in ds]), ("x",))
        with jax.set_mesh(interleaved):
            times["x interleaved"] = run_axis(interleaved, "x", P("x"), target, hosts=True, label="x interleaved")
        try:
            jax.jit(jax.shard_map(lambda v: jax_blink.broadcast(v, "x"), mesh=mesh, in_specs=P("x"),
                                  out_specs=P("x"), check_vma=False)).lower(
                _global(mesh, P("x"), lambda i: np.ones((1, 3), np.float32)))
            check("broadcast across hosts raises with fallback=raise", False, "it lowered")
        except RuntimeError as e:
            check("broadcast across hosts raises with fallback=raise", "no three-phase form" in str(e), str(e))
    mod = _backends.module("cpu")
    check("no segment left linked after set-up", list(mod.shm_linked()) == [], str(mod.shm_linked()))
    return {"ok": not failures, "process": pid, "checks": len(checks), "failures": failures[:20],
            "seconds": times, "wall_seconds": walls}


def _fault(pid: int, nproc: int, local: int, mode: str) -> dict:
    import jax
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    import jax_blink

    mesh = Mesh(np.array(jax.devices()), ("x",))
    n = jax.device_count()
    victim = nproc - 1

    def make():
        return jax.jit(jax.shard_map(lambda v: jax_blink.all_reduce(v, "x"), mesh=mesh,
                                     in_specs=P("x"), out_specs=P("x"), check_vma=False))

    x = _global(mesh, P("x"), lambda i: np.full((1, 64), i + 1.0, np.float32))
    first = make()
    got = _gather(first(x))
    ok_first = bool(np.all(got == n * (n + 1) / 2))
    second = first if mode == "skip" else make()  # skip: the same call site; die: a new one (set-up)
    if pid == victim:
        if mode == "die":
            os._exit(3)  # a crash: no clean-up of any kind
        time.sleep(float(os.environ.get("JAX_BLINK_TIMEOUT_S", "3")) + 3)  # skip the call, stay alive
        return {"ok": ok_first, "process": pid, "skipped": True}
    t0 = time.perf_counter()
    try:
        second(x).block_until_ready()
        return {"ok": False, "process": pid, "error": "the call returned although a process skipped it"}
    except Exception as e:  # noqa: BLE001
        msg = str(e)
        elapsed = time.perf_counter() - t0
        named = f"process {victim}" in msg
        return {"ok": ok_first and named, "process": pid, "seconds": elapsed, "error": msg[-1500:],
                "named": named}


SCENARIOS = {
    "collectives": collectives,
    "skip": lambda p, n, l: _fault(p, n, l, "skip"),
    "die": lambda p, n, l: _fault(p, n, l, "die"),
}

if __name__ == "__main__":
    sys.exit(main())
