"""Collectives whose ranks span several hosts: the paper's three phases.

An all-reduce over ranks on H hosts of L ranks each runs as

1. a reduce-scatter inside each host over jax_blink's trees (segment k reduced to local rank k),
2. an all-reduce of each piece among the hosts through XLA's own collective (``lax.psum`` over
   the host axis for a ``("host", "local")`` mesh: NCCL on GPUs, gloo on CPUs; for a single axis
   whose devices span hosts, ``lax.ppermute`` rounds between the ranks of one local index, summed
   in host order so that every host gets the same bits),
3. an all-gather inside each host over the trees.

Which ranks share a host comes from their devices' process indices and
:func:`jax_blink.distributed.host_of_process` (host names, or ``JAX_BLINK_PROCESSES_PER_HOST``).
The other collectives have no three-phase form here: across hosts they go to ``lax`` (with the
fall-back warning, or an error with ``JAX_BLINK_FALLBACK=raise``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import distributed

#: Latency of one hop between hosts in the cost model (us): an InfiniBand / RoCE NIC round.
NET_ALPHA_US = 5.0


@dataclass(frozen=True)
class HostLayout:
    """Where the n ranks of a collective live: H hosts of L ranks each (per group of the other
    mesh axes). ``host[g * n + r]`` and ``local[g * n + r]`` are rank r's host and its index among
    its host's ranks (ascending rank order); ``rank_of[h][l]`` is group 0's rank at (h, l);
    ``devices[h]`` the device ids of host h's ranks in group 0; ``host_axis`` names the mesh axis
    that enumerates the hosts when the collective runs over ``(host_axis, local_axis)`` exactly."""

    hosts: int
    local: int
    host: tuple[int, ...]
    local_index: tuple[int, ...]
    rank_of: tuple[tuple[int, ...], ...]
    devices: tuple[tuple, ...]
    processes: tuple[tuple[int, ...], ...]
    same_in_every_group: bool
    host_axis: str | None
    sub_process: tuple[int, ...]  # [(g * hosts + h) * local + l]: the executor's messages
    sub_device: tuple[int, ...]


def layout(axes: tuple[str, ...]) -> HostLayout | None:
    """The host layout of a collective over ``axes`` being traced; None when it does not span
    hosts (one process, one host, or devices unknown). Raises ValueError when hosts hold
    different numbers of its ranks."""
    if jax.process_count() == 1:
        return None
    devs = distributed.rank_devices(axes)
    if devs is None:
        return None
    groups, n = devs.shape
    host = np.empty(groups * n, np.int32)
    local = np.empty(groups * n, np.int32)
    sub_process, sub_device = [], []
    per_group = []
    for g in range(groups):
        hosts = [distributed.host_of_process(d.process_index) for d in devs[g]]
        order = list(dict.fromkeys(hosts))
        rank_of = [[r for r in range(n) if hosts[r] == h] for h in order]
        sizes = {len(rs) for rs in rank_of}
        if len(sizes) != 1:
            raise ValueError(f"jax_blink: the ranks of {axes} span hosts with different numbers of ranks "
                             f"({[len(rs) for rs in rank_of]}); the three-phase collectives need the same "
                             "number on every host")
        for h, rs in enumerate(rank_of):
            for li, r in enumerate(rs):
                host[g * n + r], local[g * n + r] = h, li
                sub_process.append(int(devs[g][r].process_index))
                sub_device.append(int(devs[g][r].id))
        per_group.append(rank_of)
    if len(per_group[0]) == 1:
        return None
    H, L = len(per_group[0]), len(per_group[0][0])
    same = all(pg == per_group[0] for pg in per_group)
    host_axis = None
    if len(axes) == 2 and same and all(per_group[0][h] == list(range(h * L, (h + 1) * L)) for h in range(H)):
        host_axis = axes[0]  # (host, local): the first axis enumerates the hosts
    rank_of0 = tuple(tuple(rs) for rs in per_group[0])
    return HostLayout(hosts=H, local=L, host=tuple(host.tolist()), local_index=tuple(local.tolist()),
                      rank_of=rank_of0,
                      devices=tuple(tuple(devs[0][r] for r in rs) for rs in rank_of0),
                      processes=tuple(tuple(int(devs[0][r].process_index) for r in rs) for rs in rank_of0),
                      same_in_every_group=same, host_axis=host_axis,
                      sub_process=tuple(sub_process), sub_device=tuple(sub_device))


@dataclass(frozen=True)
class SubGroup:
    """A collective over the ranks of one host: what the lowering needs instead of the axis's."""

    n: int
    rank: jax.Array
    group: jax.Array
    devices: tuple
    rank_process: np.ndarray  # [group * n + rank], for the executor's messages
    rank_device: np.ndarray


def _sub_group(lay: HostLayout, axes, n: int, group_index) -> SubGroup:
    rank = lax.axis_index(axes if len(axes) > 1 else axes[0]).astype(jnp.int32)
    idx = group_index * n + rank
    host = jnp.asarray(np.array(lay.host, np.int32))[idx]
    local = jnp.asarray(np.array(lay.local_index, np.int32))[idx]
    return SubGroup(n=lay.local, rank=local, group=group_index * lay.hosts + host,
                    devices=lay.devices[0], rank_process=np.array(lay.sub_process, np.int32),
                    rank_device=np.array(lay.sub_device, np.int32))


def _combine(op: str, a, b):
    return {"sum": jnp.add, "max": jnp.maximum, "min": jnp.minimum}[op](a, b)


def _across_hosts(piece, axes, lay: HostLayout, op: str, host):
    """Phase 2: all-reduce ``piece`` among the ranks of one local index on every host."""
    if lay.host_axis is not None:
        fn = {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}[op]
        return fn(piece, lay.host_axis)
    if not lay.same_in_every_group:
        raise NotImplementedError("the hosts' layout differs between groups of the other mesh axes")
    H = lay.hosts
    axis = axes if len(axes) > 1 else axes[0]
    received = [piece]
    for s in range(1, H):  # round s: host h sends its piece to host h + s
        perm = [(lay.rank_of[h][li], lay.rank_of[(h + s) % H][li]) for h in range(H) for li in range(lay.local)]
        received.append(lax.ppermute(piece, axis, perm))
    stacked = jnp.stack(received)  # [s] = the piece of host (host - s) mod H
    ordered = stacked[(host - jnp.arange(H)) % H]  # [j] = the piece of host j
    acc = ordered[0]
    for j in range(1, H):  # the same order on every host: the same bits
        acc = _combine(op, acc, ordered[j])
    return acc


def all_reduce(v, axes: tuple[str, ...], op: str, lay: HostLayout, call, group_index, replicated_type):
    """The three phases for one operand ``v`` (``call`` is the lowering's ``_collective_call``)."""
    n = math.prod(int(lax.axis_size(a)) for a in axes)
    shape, dtype = v.shape, v.dtype
    flat = v.reshape(-1)
    L = lay.local
    pad = (-flat.size) % L
    if pad:
        flat = jnp.concatenate([flat, jnp.zeros((pad,), dtype)])
    sub = _sub_group(lay, axes, n, group_index)
    # 1. reduce-scatter inside the host: local rank k ends with segment k reduced.
    reduced = call(flat, axes, "reducescatter", op=op, sub=sub)
    piece = lax.dynamic_slice_in_dim(reduced.reshape(L, -1), sub.rank, 1, axis=0)[0]
    # 2. all-reduce of each piece among the hosts (XLA's collective).
    idx = group_index * n + lax.axis_index(axes if len(axes) > 1 else axes[0]).astype(jnp.int32)
    host = jnp.asarray(np.array(lay.host, np.int32))[idx]
    piece = _across_hosts(piece, axes, lay, op, host)
    # 3. all-gather inside the host.
    buf = jnp.zeros((L, piece.size), dtype)
    buf = lax.dynamic_update_slice(buf, piece.reshape(1, -1), (sub.rank, 0)).reshape(-1)
    out = call(buf, axes, "allgather", sub=sub, result_type=replicated_type(buf))
    return out[: out.size - pad].reshape(shape)


# ---------------------------------------------------------------------------------------------
# explain(): the phases and the bytes each moves.

def explain_phases(inside, hosts: int, nbytes: int, *, method: str = "exact") -> str:
    """The three phases of an all-reduce of ``nbytes`` per rank over ``hosts`` hosts whose insides
    are ``inside`` (a Topology of one host's ranks): what each phase does and the bytes each rank
    sends in it."""
    from .treegen import plan as make_plan

    L = inside.n
    piece = -(-nbytes // L)
    p = make_plan(inside, "allreduce", method=method)
    inner = nbytes * (L - 1) / L
    cross = 2 * (hosts - 1) / hosts * piece
    lines = [
        f"three phases over {hosts} hosts x {L} ranks ({nbytes} bytes per rank):",
        f"  1. reduce-scatter inside each host over jax_blink's trees (the host's all-reduce plan: "
        f"{len(p.trees)} trees, {p.rate:.1f} GB/s on {inside.name}): {L} pieces of {piece} bytes, "
        f"{inner:.0f} bytes sent per rank",
        f"  2. all-reduce of each piece among the {hosts} hosts through XLA's collective "
        f"(NCCL / gloo): {cross:.0f} bytes sent per rank over the network (a ring's 2(H-1)/H x piece)",
        f"  3. all-gather inside each host over the trees: {inner:.0f} bytes sent per rank",
    ]
    return "\n".join(lines)
