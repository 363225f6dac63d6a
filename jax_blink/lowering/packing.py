"""A bucket's leaves into the executor's flat operand and back (``config.bucket_packing``).

``"barrier"`` (the default) packs with XLA's concatenation, each leaf first passed through an
``optimization_barrier`` of its own, and cuts the result with slices, which XLA fuses into the
update that reads them. The barriers keep the leaves' producers out of the concatenation: without
them (``"xla"``) XLA fused the bias and LayerNorm gradients' reductions into GPT-2 medium's packing
under the switch, and those fusions ran 20 ms per step longer than the reductions alone (1.34x
psum's step on 2 and 4 x H200), while the barriers cost 0.1-0.17 ms on GPT-2 small and nothing on
ResNet-50 (``benchmarks/NOTES.md``, change 31). ``"kernel"`` (GPUs) packs with the
``jax_blink_pack`` custom call and unpacks with ``jax_blink_unpack`` (``kernels/cuda/pack_ffi.cc``):
one copy kernel each way, no concatenation or slices in XLA's program, measured 0.11-0.44 ms slower
than XLA's packing on 4 x H200 (change 29). CPU devices always take XLA's concatenation.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_blink.lowering import backends as _backends
from jax_blink.options import config

TARGET_PACK, TARGET_UNPACK = _backends.TARGET_PACK, _backends.TARGET_UNPACK


def uses_kernel(platform: str) -> bool:
    """Whether a bucket lowered now for ``platform`` is packed by the copy kernel."""
    return (config.bucket_packing == "kernel" and platform == "gpu"
            and _backends.has_target(platform, TARGET_PACK))


def _concatenated(xs):
    return jnp.concatenate([x.reshape(-1) for x in xs])


def _sliced(flat, shapes):
    sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    return [lax.slice(flat, (int(e - k),), (int(e),)).reshape(s)
            for k, e, s in zip(sizes, np.cumsum(sizes), shapes)]


def join(xs, platform: str | None = None):
    """The arrays ``xs`` (one dtype) as one flat array, their elements one after another.
    ``platform``: the executor's platform, whose ``bucket_packing`` applies; None: XLA's
    concatenation without barriers (a bucket that XLA's own all-reduce sums)."""
    if len(xs) == 1:
        return xs[0].reshape(-1)
    if platform is not None and uses_kernel(platform):
        flat_type = jax.eval_shape(_concatenated, xs)  # the concatenation's type (varying under shard_map)
        return jax.ffi.ffi_call(TARGET_PACK, flat_type)(*xs)
    if platform is not None and config.bucket_packing == "barrier":
        # A barrier per leaf, the form measured (change 31): no producer of a leaf can then be
        # fused into the concatenation, and no leaf waits for another before it.
        xs = [lax.optimization_barrier(x) for x in xs]
    return _concatenated(xs)


def split(flat, shapes, platform: str | None = None) -> list:
    """The inverse of :func:`join`: ``flat`` cut into arrays of ``shapes``."""
    shapes = [tuple(s) for s in shapes]
    if len(shapes) == 1:
        return [flat.reshape(shapes[0])]
    if platform is None or not uses_kernel(platform):
        return _sliced(flat, shapes)
    types = jax.eval_shape(lambda f: _sliced(f, shapes), flat)
    return list(jax.ffi.ffi_call(TARGET_UNPACK, types)(flat))
