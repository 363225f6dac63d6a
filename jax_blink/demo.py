"""The main job: plan on the devices this machine has, then run ``all_reduce`` against ``lax.psum``.

On a machine without GPUs the devices are CPU host devices (8 unless ``XLA_FLAGS`` says otherwise;
``python -m jax_blink`` sets that before JAX starts).
"""
from __future__ import annotations

import numpy as np


def run_demo(size: int = 1 << 20, dtype: str = "float32", plot: str | None = None) -> int:
    """Print the plan for all devices of the default backend, run one all-reduce of ``size``
    elements per device through jax_blink and through ``lax.psum``, compare and time both.
    Returns 0 when the results agree, 1 otherwise."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_blink

    from .bench import median_time
    from .options import override
    from .tuning import prefer_lax

    devices = jax.devices()
    n = len(devices)
    topo = jax_blink.Topology.discover(devices)
    print(f"devices: {n} x {devices[0].device_kind} ({devices[0].platform}); "
          f"executors built: {jax_blink.backends()}")
    print(topo.describe() if hasattr(topo, "describe") else repr(topo))
    if n < 2:
        print("one device: nothing to reduce across")
        return 0
    print(jax_blink.explain(topo, size * np.dtype(jnp.dtype(dtype)).itemsize, "allreduce", dtype=dtype))
    if plot:
        from .draw import draw_plan
        draw_plan(jax_blink.plan(topo, "allreduce"), path=plot)
        print(f"trees drawn to {plot}")

    mesh = jax.make_mesh((n,), ("data",), devices=devices)
    spec = P("data")
    ours = jax.jit(jax.shard_map(lambda v: jax_blink.all_reduce(v, "data"), mesh=mesh,
                                 in_specs=spec, out_specs=spec))
    ref = jax.jit(jax.shard_map(lambda v: lax.psum(v, "data"), mesh=mesh,
                                in_specs=spec, out_specs=spec))
    x = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal(n * size), dtype),
                       NamedSharding(mesh, spec))
    with override(dispatch="blink"):  # the executor itself, whatever the dispatch table says:
        ours(x).block_until_ready()     # options are read when jit traces, later calls reuse it

    timings = {name: median_time(fn, x, 10)
               for name, fn in (("jax_blink executor", ours), ("lax.psum", ref))}
    a = np.asarray(ours(x).astype(jnp.float32))
    b = np.asarray(ref(x).astype(jnp.float32))
    ok = np.allclose(a, b, rtol=1e-5 if dtype == "float32" else 2e-2, atol=1e-4 * n)
    for name, t in timings.items():
        print(f"{name:>22}: {t * 1e6:10.1f} us per call ({size} x {dtype} per device)")
    nbytes = size * np.dtype(jnp.dtype(dtype)).itemsize
    if prefer_lax(devices[0].device_kind, n, nbytes):
        print(f"jax_blink.all_reduce with the default dispatch runs lax.psum at this size: it was measured "
              f"faster on {n} x {devices[0].device_kind} (jax_blink/tuning.py; JAX_BLINK_DISPATCH=blink "
              f"keeps the executor)")
    print("results agree with lax.psum" if ok else "RESULTS DIFFER from lax.psum")
    return 0 if ok else 1
