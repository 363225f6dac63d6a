"""Cases of jax_blink collectives checked against lax on device, shared by the GPU drivers.

benchmarks/gpu_collectives_driver.py (every collective, dtype and size on 2-4 GPUs, under
compute-sanitizer) and benchmarks/gpu_soak.py (mixed calls for a duration) build their programs
from these pieces:

- :class:`Case`: one call (collective, keyword arguments, dtype, bytes), its jax_blink expression
  and an independent lax expression (``psum``, ``pmax``, ``pmin``, ``all_gather``, ``psum_scatter``,
  a masked ``psum`` for broadcast, ``psum`` kept on the root for reduce);
- :func:`programs`: one jitted ``shard_map`` program of several cases for ours and one for lax;
- :func:`environment`: variables set only inside a block (the executor reads some at a call
  site's set-up, so a site keeps what was set when it first ran);
- :func:`compare`: per rank, on that rank's device (no collective), the largest difference from
  lax, NaNs that only one side has and two position-weighted sums of the result's bits, so that
  outputs of 64 MiB per rank are checked without copying them to the host; ranks whose results
  must be equal (all_reduce, broadcast, all_gather) must have equal sums.

A case's ``nbytes`` is the larger buffer per rank: the operand (all_reduce, broadcast, reduce,
reduce_scatter) or the result (all_gather: the operand is nbytes / n), as nccl-tests counts.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_blink
from jax_blink.tools.scoped_env import environment  # noqa: F401  (its callers use cc.environment)

AXIS = "x"


COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter")
#: Collectives whose result is the same on every rank (checked bit for bit between ranks).
REPLICATED = ("all_reduce", "broadcast", "all_gather")
#: Tolerance on |ours - lax| relative to max |lax| (sums: the two add in different orders).
SUM_TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3}


@dataclasses.dataclass(frozen=True)
class Case:
    """One collective call of a program.

    Attributes:
        what: One of :data:`COLLECTIVES`.
        dtype: A dtype name jax_blink takes (float32, bfloat16, int32...).
        nbytes: Bytes of the larger buffer per rank (see the module's docstring).
        op: all_reduce's op (sum, max, min); reduce always sums.
        root: broadcast's and reduce's root.
        tiled: all_gather's and reduce_scatter's layout.
    """

    what: str
    dtype: str
    nbytes: int
    op: str = "sum"
    root: int = 0
    tiled: bool = True

    def count(self, n: int) -> int:
        """Elements of the operand per rank: a multiple of n (reduce_scatter and all_gather split
        by rank), at least n."""
        itemsize = np.dtype(jnp.dtype(self.dtype)).itemsize
        total = max(n, self.nbytes // itemsize // n * n)
        return total // n if self.what == "all_gather" else total

    def shape(self, n: int) -> tuple[int, ...]:
        """The operand's shape per rank (untiled reduce_scatter: dimension 0 of size n)."""
        c = self.count(n)
        return (n, c // n) if self.what == "reduce_scatter" and not self.tiled else (c,)

    def exact(self) -> bool:
        """Whether ours must equal lax exactly (no sum in floating point)."""
        integer = np.issubdtype(np.dtype(jnp.dtype(self.dtype)), np.integer)
        return integer or self.what in ("broadcast", "all_gather") or (
            self.what == "all_reduce" and self.op != "sum")

    def label(self) -> str:
        extra = {"all_reduce": self.op, "broadcast": f"root={self.root}", "reduce": f"root={self.root}",
                 "all_gather": "tiled" if self.tiled else "stacked",
                 "reduce_scatter": "tiled" if self.tiled else "blocks"}[self.what]
        return f"{self.what}({extra})/{self.dtype}/{human_bytes(self.nbytes)}"

    def ours(self, v):
        if self.what == "all_reduce":
            return jax_blink.all_reduce(v, AXIS, op=self.op)
        if self.what == "broadcast":
            return jax_blink.broadcast(v, AXIS, root=self.root)
        if self.what == "reduce":
            return jax_blink.reduce(v, AXIS, root=self.root)
        if self.what == "all_gather":
            return jax_blink.all_gather(v, AXIS, tiled=self.tiled)
        return jax_blink.reduce_scatter(v, AXIS, tiled=self.tiled)

    def lax(self, v):
        if self.what == "all_reduce":
            return {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}[self.op](v, AXIS)
        if self.what == "broadcast":
            return lax.psum(jnp.where(lax.axis_index(AXIS) == self.root, v, jnp.zeros_like(v)), AXIS)
        if self.what == "reduce":
            return jnp.where(lax.axis_index(AXIS) == self.root, lax.psum(v, AXIS), v)
        if self.what == "all_gather":
            return lax.all_gather(v, AXIS, tiled=self.tiled)
        return lax.psum_scatter(v, AXIS, tiled=self.tiled)


    def host(self, x: np.ndarray, n: int) -> np.ndarray:
        """The expected result of :meth:`lax` for the stacked operand ``x`` (as
        :func:`random_operand` makes it), computed with numpy (sums in float64 or int64), laid out
        as the programs' results are (every rank's result stacked on axis 0). A reference that
        needs no collective, so no NCCL set-up: what a run under compute-sanitizer wants."""
        shape = self.shape(n)
        parts = x.reshape((n,) + shape)
        wide = parts.astype(np.int64 if np.issubdtype(parts.dtype, np.integer) else np.float64)
        if self.what == "all_reduce":
            r = {"sum": np.sum, "max": np.max, "min": np.min}[self.op](wide, axis=0)
            out = np.stack([r] * n)
        elif self.what == "broadcast":
            out = np.stack([wide[self.root]] * n)
        elif self.what == "reduce":
            out = wide.copy()
            out[self.root] = wide.sum(axis=0)
        elif self.what == "all_gather":
            each = wide.reshape((n * shape[0],) + shape[1:]) if self.tiled else wide
            out = np.stack([each] * n)
        else:  # reduce_scatter: rank r keeps block r of the sum (tiled: of dimension 0; blocks: row r)
            out = wide.sum(axis=0)
        # every rank's result stacked on axis 0 (reduce_scatter's blocks already are, in rank order)
        out = out.reshape(-1) if self.what == "reduce_scatter" else out.reshape((-1,) + out.shape[2:])
        dt = np.dtype(jnp.dtype(self.dtype))
        return out.astype(dt) if np.issubdtype(dt, np.integer) else out.astype(np.float32).astype(dt)


def human_bytes(n: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B"


def random_operand(rng: np.random.Generator, case: Case, n: int) -> np.ndarray:
    """Fresh random data for every rank, stacked: shape (n * shape[0], ...). Uniform in [-1, 1)
    (floats; float32 drawn directly, which is fast enough for 64 MiB per rank) or integers in
    [-1000, 1000)."""
    shape = case.shape(n)
    full = (n * shape[0],) + shape[1:]
    dt = np.dtype(jnp.dtype(case.dtype))
    if np.issubdtype(dt, np.integer):
        return rng.integers(-1000, 1000, size=full, dtype=dt)
    return (rng.random(full, dtype=np.float32) * 2 - 1).astype(dt)


def put(mesh: Mesh, host: np.ndarray):
    """``host`` split over the mesh axis, each process building its own shards (works in jobs of
    several processes, where device_put would check the value through XLA's collectives)."""
    return jax.make_array_from_callback(host.shape, NamedSharding(mesh, P(AXIS)), lambda idx: host[idx])


def programs(mesh: Mesh, cases: list[Case]):
    """(ours, reference): two jitted programs over ``mesh`` taking one operand per case and
    returning one result per case, every operand and result split over the axis."""
    def body(which):
        def f(*vs):
            return tuple(getattr(c, which)(v) for c, v in zip(cases, vs))
        spec = (P(AXIS),) * len(cases)
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
    return body("ours"), body("lax")


def _bits(a):
    """The result's bits as uint32 (16-bit types widened), for the position-weighted sums."""
    if a.dtype.itemsize == 2:
        return lax.bitcast_convert_type(a, jnp.uint16).astype(jnp.uint32)
    if a.dtype.itemsize == 4:
        return lax.bitcast_convert_type(a, jnp.uint32)
    return lax.bitcast_convert_type(a.astype(jnp.float32), jnp.uint32)


def _stats_row(a, b):
    """[max |a - b|, max |b|, NaNs in one but not the other, bit sum, weighted bit sum] of one
    rank's result ``a`` and lax's ``b`` (float32; the sums as float32 of their uint32 halves)."""
    af, bf = a.astype(jnp.float32).ravel(), b.astype(jnp.float32).ravel()
    nan_a, nan_b = jnp.isnan(af), jnp.isnan(bf)
    diff = jnp.where(nan_a | nan_b, 0.0, jnp.abs(af - bf))
    bits = _bits(a).ravel()
    weights = (jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761)) | jnp.uint32(1)
    s1, s2 = jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * weights, dtype=jnp.uint32)
    halves = [(s >> 16).astype(jnp.float32) for s in (s1, s2)] + [(s & 0xFFFF).astype(jnp.float32) for s in (s1, s2)]
    return jnp.stack([jnp.max(diff, initial=0.0), jnp.max(jnp.where(nan_b, 0.0, jnp.abs(bf)), initial=0.0),
                      jnp.sum(nan_a != nan_b).astype(jnp.float32), *halves])


@functools.lru_cache(maxsize=64)
def _stats_program(mesh: Mesh, k: int):
    def f(ours, ref):
        return jnp.stack([_stats_row(a, b) for a, b in zip(ours, ref)])[None]
    spec = (P(AXIS),) * k
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec, spec), out_specs=P(AXIS), check_vma=False))


def compare(mesh: Mesh, cases: list[Case], ours, ref) -> list[dict]:
    """Per case: ``ok`` and, where not, why. Computed on each rank's device, gathered as a few
    numbers per rank and case (this process's ranks: in a job of several processes each checks
    its own)."""
    stats = _stats_program(mesh, len(cases))(tuple(ours), tuple(ref))
    rows = np.concatenate([np.asarray(s.data) for s in stats.addressable_shards])  # (ranks here, k, 7)
    out = []
    for i, c in enumerate(cases):
        r = rows[:, i, :]
        diff, scale, nan_mismatch = float(r[:, 0].max()), float(r[:, 1].max()), int(r[:, 2].sum())
        tol = 0.0 if c.exact() else SUM_TOLERANCE.get(c.dtype, 1e-5) * max(1.0, scale)
        problems = []
        if nan_mismatch:
            problems.append(f"{nan_mismatch} NaNs where lax has none or the reverse (an unwritten, "
                            "poisoned element?)")
        if not diff <= tol:
            problems.append(f"max |ours - lax| = {diff:.3g} > {tol:.3g}")
        if c.what in REPLICATED and len({tuple(x) for x in r[:, 3:].tolist()}) > 1:
            problems.append("ranks' results differ (bit sums)")
        out.append({"case": c.label(), "ok": not problems, "max_abs_diff": diff,
                    "problems": problems})
    return out


def poison_device_memory(devices, nbytes: int) -> None:
    """Best effort: fill ``nbytes`` per device with NaN-pattern bytes (0xFF) and free it, so that
    XLA's allocator hands that memory to the next results: an element a collective fails to write
    then reads back as NaN (floats) or -1 (int32) instead of a stale correct value."""
    if nbytes <= 0:
        return
    bufs = []
    for d in devices:  # made on the device: no host copy of the pattern
        with jax.default_device(d):
            bufs.append(jnp.full((nbytes,), 0xFF, jnp.uint8))
    jax.block_until_ready(bufs)
    for b in bufs:
        b.delete()
