"""Smoke test of an installed jax_blink (a wheel in a fresh environment): which copy was imported,
the executors it holds, and the CPU executor's all-reduce against ``lax`` on 8 host devices.

Run it from outside the checkout, so that ``import jax_blink`` finds the installed copy:

    python tests/helpers/wheel_smoke.py --not-under CHECKOUT [--under VENV] [--cuda-module] [--gpu]

``--cuda-module``: the CUDA executor must import (it does without a GPU: it loads the driver at its
first use). ``--gpu``: GPU 0 must be able to run it (``device_problem(0)`` is None) and jax must
have GPUs. Exit status 0 when every check passed, 1 with the failed check's message otherwise.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# 8 CPU host devices for the collective; set before jax is imported (kept if the caller set XLA_FLAGS).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

N_DEVICES = 8


def _fail(message: str) -> None:
    print(f"FAILED: {message}")
    sys.exit(1)


def check_installed_copy(not_under: Path | None, under: Path | None):
    """Import jax_blink and check it is not the checkout's copy (and, with ``under``, is that
    environment's)."""
    import jax_blink

    where = Path(jax_blink.__file__).resolve().parent
    print(f"jax_blink {jax_blink.__version__} imported from {where} (jax {jax.__version__})")
    if not_under is not None and where.is_relative_to(not_under.resolve()):
        _fail(f"jax_blink was imported from the checkout ({where}), not the installed wheel: "
              "run from a folder outside the checkout")
    if under is not None and not where.is_relative_to(under.resolve()):
        _fail(f"jax_blink was imported from {where}, not from the environment {under}")
    return jax_blink


def check_cpu_all_reduce(jax_blink) -> None:
    """f32 sum and int32 max through the CPU executor on 8 host devices, against lax."""
    cpus = jax.devices("cpu")
    if len(cpus) < N_DEVICES:
        _fail(f"{len(cpus)} CPU devices, {N_DEVICES} needed: XLA_FLAGS={os.environ.get('XLA_FLAGS')!r} "
              "must hold --xla_force_host_platform_device_count=8")
    mesh = Mesh(np.array(cpus[:N_DEVICES]), ("data",))
    jax_blink.config.dispatch = "blink"  # the executor always, never lax's fall-back
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    cases = [("sum", rng.standard_normal(N_DEVICES * 1024).astype(np.float32), lax.psum),
             ("max", rng.integers(-2**30, 2**30, N_DEVICES * 1024).astype(np.int32), lax.pmax)]
    for op, data, reference in cases:
        def blink(x, op=op):
            return jax_blink.all_reduce(x, "data", op=op)

        def lax_op(x, reference=reference):
            return reference(x, "data")

        f = jax.jit(jax.shard_map(blink, mesh=mesh, in_specs=P("data"), out_specs=P()))
        g = jax.jit(jax.shard_map(lax_op, mesh=mesh, in_specs=P("data"), out_specs=P()))
        x = jax.device_put(data, NamedSharding(mesh, P("data")))
        if "jax_blink_collective" not in f.lower(x).as_text():
            _fail(f"all_reduce {op} did not lower to jax_blink's custom call")
        got, want = np.asarray(f(x)), np.asarray(g(x))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        print(f"CPU executor: all_reduce {op} of {data.dtype} ({data.size // N_DEVICES} per rank, "
              f"{N_DEVICES} host devices, seed {seed}) equals lax.p{op}")


def check_cuda(gpu: bool) -> None:
    """The CUDA executor imports; with ``gpu``, GPU 0 can run it."""
    try:
        from jax_blink import _blink_cuda
    except ImportError as e:
        _fail(f"the CUDA executor does not import: {e}")
    archs = ", ".join(f"sm_{a}" for a in _blink_cuda.built_architectures())
    print(f"CUDA executor: imports; built for {archs} + PTX of compute_{_blink_cuda.ptx_architecture()}")
    if gpu:
        import jax_blink

        if not jax_blink.backends().get("gpu"):
            _fail(f"jax_blink.backends() = {jax_blink.backends()}: no CUDA executor")
        problem = _blink_cuda.device_problem(0)
        if problem:
            _fail(f"GPU 0 cannot run the build: {problem}")
        print(f"CUDA executor: GPU 0 ({jax.devices('gpu')[0].device_kind}) runs the build")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--not-under", type=Path, help="fail if jax_blink is imported from this folder (the checkout)")
    parser.add_argument("--under", type=Path, help="fail unless jax_blink is imported from this folder (the venv)")
    parser.add_argument("--cuda-module", action="store_true", help="the CUDA executor must import")
    parser.add_argument("--gpu", action="store_true", help="GPU 0 must run the CUDA executor (implies --cuda-module)")
    args = parser.parse_args(argv)
    jax_blink = check_installed_copy(args.not_under, args.under)
    print(f"jax_blink.backends(): {jax_blink.backends()}")
    check_cpu_all_reduce(jax_blink)
    if args.cuda_module or args.gpu:
        check_cuda(args.gpu)
    print("wheel smoke test: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
