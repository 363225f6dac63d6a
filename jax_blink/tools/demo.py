"""The main job: plan on the devices this machine has, then run ``all_reduce`` against ``lax.psum``.

On a machine without GPUs the devices are CPU host devices (8 unless ``XLA_FLAGS`` says otherwise;
``python -m jax_blink`` sets that before JAX starts) and the CPU executor runs the trees; on GPUs
the CUDA executor does.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _executor_line(devices: Sequence, built: dict[str, bool]) -> str:
    """Which executor runs on ``devices``, and whether this build has it."""
    platform = devices[0].platform
    if platform == "cpu":
        what, key = "the CPU executor (threads of this process meeting at a rendezvous)", "cpu"
    elif platform in ("gpu", "cuda"):
        what, key = "the CUDA executor (kernels over NVLink peer access)", "gpu"
    else:
        return f"no jax_blink executor for {platform} devices: jax_blink falls back to lax"
    state = "built" if built.get(key) else "not built: jax_blink falls back to lax"
    return f"executor for them: {what}, {state}"


def bytes_needed(nbytes: int, dtype: str, devices: Sequence) -> int:
    """Memory the demo takes for ``nbytes`` per rank: on CPU host devices all of it (they share the
    host's memory), on GPUs one device's share."""
    import jax.numpy as jnp

    count = nbytes // np.dtype(jnp.dtype(dtype)).itemsize
    # input, our output, psum's output, the timed programs' outputs; on the host three float32 copies
    per_rank = 5 * nbytes + (3 * 4 * count if devices[0].platform == "cpu" else 0)
    return per_rank * (len(devices) if devices[0].platform == "cpu" else 1)


def run_demo(nbytes: int = 4 << 20, dtype: str = "float32", plot: str | None = None) -> int:
    """Print the plan for all devices of the default backend, run one all-reduce of ``nbytes``
    bytes per rank (a whole number of ``dtype`` elements) through jax_blink and through
    ``lax.psum``, compare and time both. Returns 0 when the results agree, 1 otherwise."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_blink

    from jax_blink.tools.timing import TOLERANCE, median_time
    from jax_blink.options.settings import override
    from jax_blink.lowering.dispatch_table import prefer_lax

    itemsize = np.dtype(jnp.dtype(dtype)).itemsize
    if nbytes <= 0 or nbytes % itemsize:
        raise ValueError(f"nbytes={nbytes} is not a positive whole number of {dtype} elements ({itemsize} bytes)")
    count = nbytes // itemsize
    devices = jax.devices()
    n = len(devices)
    kind = devices[0].device_kind
    topo = jax_blink.Topology.discover(devices)
    print(f"devices: {n} x {kind} ({devices[0].platform}); "
          f"{_executor_line(devices, jax_blink.backends())}")
    print(topo.describe())
    if n < 2:
        print("one device: nothing to reduce across")
        return 0
    print(jax_blink.explain(topo, nbytes, "allreduce", dtype=dtype, device_kind=kind))
    if plot:
        from jax_blink.tools.draw import draw_plan
        draw_plan(jax_blink.plan(topo, "allreduce"), path=plot)
        print(f"trees drawn to {plot}")

    mesh = jax.make_mesh((n,), ("data",), devices=devices)
    spec = P("data")
    ours = jax.jit(jax.shard_map(lambda v: jax_blink.all_reduce(v, "data"), mesh=mesh,
                                 in_specs=spec, out_specs=spec))
    ref = jax.jit(jax.shard_map(lambda v: lax.psum(v, "data"), mesh=mesh,
                                in_specs=spec, out_specs=spec))
    rng = np.random.default_rng(0)
    host = (rng.integers(-1000, 1000, n * count, dtype=np.int32) if jnp.issubdtype(dtype, jnp.integer)
            else rng.standard_normal(n * count, dtype=np.float32))
    x = jax.device_put(jnp.asarray(host, dtype), NamedSharding(mesh, spec))
    del host
    with override(dispatch="blink"):  # the executor itself, whatever the dispatch table says:
        ours(x).block_until_ready()     # options are read when jit traces, later calls reuse it

    timings = {name: median_time(fn, x, 10)
               for name, fn in (("jax_blink executor", ours), ("lax.psum", ref))}
    a = np.asarray(ours(x).astype(jnp.float32))
    b = np.asarray(ref(x).astype(jnp.float32))
    tol = TOLERANCE.get(dtype, 0)  # the bench's rule: rounding of n summands in this dtype; integers exact
    ok = np.allclose(a, b, rtol=tol, atol=tol * n * 4)
    for name, t in timings.items():
        print(f"{name:>22}: {t * 1e6:10.1f} us per call ({nbytes} bytes = {count} x {dtype} per rank)")
    if prefer_lax(kind, n, nbytes):
        print(f"(the executor was timed with JAX_BLINK_DISPATCH=blink: at this size the default dispatch "
              f"runs lax.psum, measured faster on {n} x {kind})")
    print("results agree with lax.psum" if ok else "RESULTS DIFFER from lax.psum")
    return 0 if ok else 1
