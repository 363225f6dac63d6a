"""Collectives whose ranks span several hosts: the paper's three phases.

An all-reduce over ranks on H hosts of L ranks each runs as

1. a reduce-scatter inside each host over jax_blink's trees (segment k reduced to local rank k),
2. an all-reduce of each piece among the hosts through XLA's own collective (``lax.psum`` over
   the host axis for a ``("host", "local")`` mesh: NCCL on GPUs, gloo on CPUs; for a single axis
   whose devices span hosts, ``lax.ppermute`` rounds between the ranks of one local index, summed
   in host order so that every host gets the same bits),
3. an all-gather inside each host over the trees.

A reduce-scatter is phases 1 and 2 with a reduce-scatter among the hosts in phase 2 (its blocks
ordered so that local rank l reduces those of the ranks at local index l of every host); an
all-gather is an all-gather among the hosts (each rank's operand crosses the network once per
other host) and then inside each host (the rows put back in rank order).

Which ranks share a host comes from their devices' process indices and
:func:`jax_blink.lowering.processes.host_of_process` (host names, or ``JAX_BLINK_PROCESSES_PER_HOST``).
Broadcast and reduce have no three-phase form here: across hosts they go to ``lax`` (with the
fall-back warning, or an error with ``JAX_BLINK_FALLBACK=raise``), as do the cases
:func:`problem` names; hosts of one rank each leave the executor nothing to do (``lax``, no
warning).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_blink.lowering import processes as distributed

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


def problem(lay: HostLayout, platform: str) -> str | None:
    """Why the three phases cannot run for ranks laid out as ``lay`` on ``platform`` (None: they
    can)."""
    if not lay.same_in_every_group:
        return ("the hosts' arrangement of its ranks differs between groups of the other mesh axes "
                "(use a mesh whose devices are laid out alike in every group, e.g. (\"host\", \"local\", ...))")
    if platform == "gpu" and not distributed.one_process_per_group(np.array(lay.sub_process, np.int32), lay.local):
        return ("its ranks on one host live in several processes (one process per GPU), and on GPUs the "
                "inside phases (a reduce-scatter and an all-gather) run among the GPUs of one process only: "
                "run one process per host")
    return None


def _combine(op: str, a, b):
    return {"sum": jnp.add, "max": jnp.maximum, "min": jnp.minimum}[op](a, b)


def _host_of_rank(lay: HostLayout, axes, n: int, group_index):
    idx = group_index * n + lax.axis_index(axes if len(axes) > 1 else axes[0]).astype(jnp.int32)
    return jnp.asarray(np.array(lay.host, np.int32))[idx]


def _from_every_host(outgoing, axes, lay: HostLayout, host):
    """``lax.ppermute`` rounds among the ranks of one local index (a single axis whose devices span
    hosts, where no mesh axis names the hosts): in round s each rank sends ``outgoing(s)`` to its
    peer on host ``host + s``. Returns ``[j]`` = what host j's peer sent this rank (``outgoing(0)``
    for its own host), in host order."""
    H = lay.hosts
    axis = axes if len(axes) > 1 else axes[0]
    received = [outgoing(0)]
    for s in range(1, H):  # round s: host h sends to host h + s
        perm = [(lay.rank_of[h][li], lay.rank_of[(h + s) % H][li]) for h in range(H) for li in range(lay.local)]
        received.append(lax.ppermute(outgoing(s), axis, perm))
    stacked = jnp.stack(received)  # [s] = from host (host - s) mod H
    return stacked[(host - jnp.arange(H)) % H]


def _across_hosts(piece, axes, lay: HostLayout, op: str, host):
    """Phase 2: all-reduce ``piece`` among the ranks of one local index on every host."""
    if lay.host_axis is not None:
        fn = {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}[op]
        return fn(piece, lay.host_axis)
    if not lay.same_in_every_group:
        raise NotImplementedError("the hosts' layout differs between groups of the other mesh axes")
    ordered = _from_every_host(lambda s: piece, axes, lay, host)
    acc = ordered[0]
    for j in range(1, lay.hosts):  # the same order on every host: the same bits
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
    host = _host_of_rank(lay, axes, n, group_index)
    piece = _across_hosts(piece, axes, lay, op, host)
    # 3. all-gather inside the host.
    buf = jnp.zeros((L, piece.size), dtype)
    buf = lax.dynamic_update_slice(buf, piece.reshape(1, -1), (sub.rank, 0)).reshape(-1)
    out = call(buf, axes, "allgather", sub=sub, result_type=replicated_type(buf))
    return out[: out.size - pad].reshape(shape)


def reduce_scatter(blocks, axes: tuple[str, ...], lay: HostLayout, call, group_index):
    """``lax.psum_scatter``'s block for this rank: ``blocks`` is its operand as ``[n, m]`` (row r
    goes to rank r); returns ``[m]``, row ``axis_index`` of the sum over every rank."""
    n, m = blocks.shape
    H, L = lay.hosts, lay.local
    sub = _sub_group(lay, axes, n, group_index)
    # 1. reduce-scatter inside the host, segment l holding the rows of the ranks at local index l
    # of every host in host order: local rank l ends with the host's sums of those H rows.
    by_local = np.array([lay.rank_of[h][li] for li in range(L) for h in range(H)])
    flat = blocks[by_local].reshape(-1)
    reduced = call(flat, axes, "reducescatter", op="sum", sub=sub, in_place=True)
    mine = lax.dynamic_slice_in_dim(reduced.reshape(L, H, m), sub.rank, 1, axis=0)[0]  # [H, m]
    # 2. reduce-scatter among the hosts: host h keeps row h, its own rank's (XLA's collective).
    if lay.host_axis is not None:  # rank_of[h][l] = h * L + l: host h is index h of the host axis
        return lax.psum_scatter(mine, lay.host_axis, scatter_dimension=0, tiled=False)
    host = _host_of_rank(lay, axes, n, group_index)
    ordered = _from_every_host(lambda s: mine[(host + s) % H], axes, lay, host)
    acc = ordered[0]
    for j in range(1, H):  # summed in host order, as phase 2 of all_reduce
        acc = acc + ordered[j]
    return acc


def all_gather(row, axes: tuple[str, ...], lay: HostLayout, call, group_index, result_type):
    """``lax.all_gather`` of this rank's ``row`` (``[m]``) as ``[n, m]`` in rank order: first among
    the hosts (each operand crosses the network once per other host, not once per rank of a host),
    then inside the host over the executor."""
    n = lay.hosts * lay.local
    H, L, m = lay.hosts, lay.local, row.size
    sub = _sub_group(lay, axes, n, group_index)
    # 1. among the hosts: [h] = the row of the rank at this local index on host h (XLA's collective).
    if lay.host_axis is not None:
        rows = lax.all_gather(row, lay.host_axis)
    else:
        rows = _from_every_host(lambda s: row, axes, lay, _host_of_rank(lay, axes, n, group_index))
    # 2. inside the host: local rank l's segment holds its H rows (the executor reads only a rank's
    # own segment, so L copies serve, as in the one-host all_gather).
    buf = jnp.broadcast_to(rows.reshape(1, -1), (L, H * m)).reshape(-1)
    out = call(buf, axes, "allgather", sub=sub, result_type=result_type, in_place=True)
    # out[l, h] is rank rank_of[h][l]'s row: put the rows back in rank order.
    position = np.empty(n, np.int64)
    for h in range(H):
        for li in range(L):
            position[lay.rank_of[h][li]] = li * H + h
    return out.reshape(L * H, m)[position]


# ---------------------------------------------------------------------------------------------
# explain(): the phases and the bytes each moves.

def explain_phases(inside, hosts: int, nbytes: int, *, method: str = "exact",
                   collective: str = "allreduce") -> str:
    """The phases of ``collective`` (``"allreduce"``, ``"reducescatter"`` or ``"allgather"``) of
    ``nbytes`` per rank (its operand) over ``hosts`` hosts whose insides are ``inside`` (a Topology
    of one host's ranks): what each phase does and the bytes each rank sends in it."""
    from jax_blink.planning.packing import plan as make_plan

    L = inside.n
    N = hosts * L
    if collective == "reducescatter":
        piece = nbytes // L  # the H blocks of a local index
        return "\n".join([
            f"two phases over {hosts} hosts x {L} ranks ({nbytes} bytes per rank in, {nbytes // N} out):",
            f"  1. reduce-scatter inside each host over jax_blink's trees (segment k through the reduce "
            f"trees rooted at local rank k): {L} pieces of {piece} bytes ({hosts} blocks each, those of "
            f"the ranks at one local index on every host), {nbytes * (L - 1) / L:.0f} bytes sent per rank",
            f"  2. reduce-scatter of each piece among the {hosts} hosts through XLA's collective "
            f"(NCCL / gloo): {(hosts - 1) / hosts * piece:.0f} bytes sent per rank over the network "
            "(a ring's (H-1)/H x piece)",
        ])
    if collective == "allgather":
        return "\n".join([
            f"two phases over {hosts} hosts x {L} ranks ({nbytes} bytes per rank in, {N * nbytes} out):",
            f"  1. all-gather among the {hosts} hosts through XLA's collective (NCCL / gloo), between "
            f"the ranks of one local index: {(hosts - 1) * nbytes} bytes sent per rank over the network "
            "(its operand once per other host; inside first would send L times that)",
            f"  2. all-gather inside each host over jax_blink's trees (segment k through the broadcast "
            f"trees rooted at local rank k): {L} segments of {hosts * nbytes} bytes, "
            f"{(L - 1) * hosts * nbytes} bytes sent per rank",
        ])
    if collective != "allreduce":
        raise ValueError(f"{collective} has no three-phase form (allreduce, reducescatter and allgather have)")
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
