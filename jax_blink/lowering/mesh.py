"""Trace-time context of a collective: its mesh axes, this rank's index, the group it belongs to,
the platform and kind of the devices being traced for."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_blink.lowering.jax_internals import is_vmap_batched

AxisName = str | tuple[str, ...]


def axes_of(axis_name: AxisName) -> tuple[str, ...]:
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if not axes or not all(isinstance(a, str) for a in axes):
        raise TypeError(f"axis_name must be a mesh axis name or a tuple of them, got {axis_name!r}")
    return axes


def axis_index(axes: tuple[str, ...]):
    """This rank's index along ``axes`` (row-major over a tuple of axes, as ``lax`` numbers them)."""
    return lax.axis_index(axes if len(axes) > 1 else axes[0])


def axis_size(axes: tuple[str, ...]) -> int:
    try:
        return int(lax.axis_size(axes if len(axes) > 1 else axes[0]))
    except NameError as e:
        raise NameError(
            f"jax_blink: unknown axis {axes if len(axes) > 1 else axes[0]!r}: call the collective "
            "inside jax.shard_map or jax.pmap over a mesh that has this axis") from e


def other_axes(axes: tuple[str, ...]) -> list[tuple[str, int]]:
    """Manual mesh axes besides ``axes``: each slice of them is an independent group."""
    try:
        mesh = jax.sharding.get_abstract_mesh()
        names, sizes = mesh.axis_names, mesh.axis_sizes
    except Exception:  # pmap, or no mesh in context
        return []
    manual = set(getattr(mesh, "manual_axes", names))
    return [(n, s) for n, s in zip(names, sizes) if n not in axes and n in manual and s > 1]


def group_index(axes: tuple[str, ...]):
    group = jnp.int32(0)
    for name, size in other_axes(axes):
        group = group * size + lax.axis_index(name).astype(jnp.int32)
    return group


def abstract_device():
    """The kind of device of the mesh being traced (None under pmap or outside a mesh)."""
    try:
        return jax.sharding.get_abstract_mesh().abstract_device
    except Exception:  # older jax, or no mesh in context
        return None


def platform() -> str:
    dev = abstract_device()
    p = dev.platform if dev is not None else jax.default_backend()
    return "gpu" if p in ("gpu", "cuda", "rocm") else p


def device_kind() -> str | None:
    dev = abstract_device()
    if dev is not None:
        return dev.device_kind
    devices = jax.devices()
    return devices[0].device_kind if devices else None


def lax_type(lax_expr, flat):
    """The type of ``lax_expr(flat)``, the ``lax`` expression a call computes: the custom call
    declares it, so that under ``shard_map`` its result is invariant along the axis exactly where
    lax's is (replicated: psum; varying: all_gather, psum_scatter, a reduce's non-roots) and
    ``out_specs`` are checked as for lax. Asked of jax (every version) rather than built by hand."""
    return jax.eval_shape(lax_expr, flat)


def on_mesh(axes: tuple[str, ...]) -> bool:
    """Whether every one of ``axes`` is a manual mesh axis (shard_map, pmap) rather than an axis
    bound by ``vmap``, which the executor has no devices for (``lax`` handles it by batching)."""
    try:
        mesh = jax.sharding.get_abstract_mesh()
        names, manual = tuple(mesh.axis_names), set(getattr(mesh, "manual_axes", mesh.axis_names))
    except Exception:  # older jax: no abstract mesh
        names, manual = (), set()
    if names:
        return all(a in manual for a in axes)
    # No mesh in context (pmap where jax does not run it as a shard_map, or vmap alone): an axis
    # that vmap binds gives a batched index.

    return not any(is_vmap_batched(lax.axis_index(a)) for a in axes)
