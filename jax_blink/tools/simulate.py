"""The paper's comparison, reproduced: NCCL-style rings and an alpha-beta pipeline model.

The model itself is pure planning (:mod:`jax_blink.planning.model`: the planner weighs the
all-reduce forms with it, :mod:`jax_blink.planning.forms`); this module is its tools-side face, with
the names it always had, plus the multi-host cost model of :mod:`jax_blink.lowering.hierarchy`
(:func:`model_times_us`), which needs the lowering layer's network latency.
"""

from __future__ import annotations

import functools

from jax_blink.lowering.hierarchy import NET_ALPHA_US
from jax_blink.planning.model import (COLLECTIVES, MODEL, RingPlan, algbw, best_time, compare,
                                      ring_allreduce_us, rings, time_us)
from jax_blink.planning.topology import Topology

__all__ = ["RingPlan", "rings", "time_us", "best_time", "ring_allreduce_us", "compare", "algbw", "MODEL",
           "COLLECTIVES", "model_times_us"]


# The cost model of jax_blink.lowering.hierarchy: k hosts of 8 GPUs, three phases against a flat
# ring and hierarchical rings (a tool: the call path never imports it).
@functools.lru_cache(maxsize=None)
def _inside(inside):
    from jax_blink.planning.packing import plan as make_plan

    return make_plan(inside, "allreduce"), rings(inside)


def model_times_us(hosts: int, net_gbps: float, nbytes: float, inside=None) -> dict[str, float]:
    """Modelled time (us) of an all-reduce of ``nbytes`` per GPU over ``hosts`` hosts whose GPUs
    are linked as ``inside`` (a Topology; default the DGX-1V preset, 8 GPUs), each GPU with its
    own NIC of ``net_gbps`` GB/s per direction (latency :data:`NET_ALPHA_US`):

    * ``blink_3phase`` (what :func:`jax_blink.lowering.hierarchy.all_reduce` runs): Blink's all-reduce trees inside the host
      (their reduce half is the reduce-scatter, their broadcast half the all-gather:
      :func:`time_us`), plus a ring all-reduce among hosts of each GPU's piece
      (S / L) over its own NIC: ``2(H-1) * (alpha_net + S / (L * H * B))``.
    * ``nccl_hier_rings``: NCCL's hierarchical rings: a ring reduce-scatter inside the host
      (``(L-1) * (alpha + S / (L * R))``, R the host's total ring rate), the same inter-host ring
      of S / L per GPU, and a ring all-gather.
    * ``flat_ring``: NCCL's flat rings over all H * L GPUs, as many rings as the host has, each
      crossing the host boundary through one NIC: ``2(N-1) * (alpha_net + S / (N * B_rings))``
      with ``B_rings = rings * min(ring rate, B)``.

    Args:
        hosts: number of hosts (1: no network phase).
        net_gbps: each GPU's NIC, GB/s per direction.
        nbytes: bytes per GPU.
        inside: the GPUs of one host (default the DGX-1V preset).

    Returns:
        ``{"blink_3phase": us, "nccl_hier_rings": us, "flat_ring": us}`` (modelled).
    """
    topo = inside if inside is not None else Topology.preset("dgx1v")
    p, rp = _inside(topo)
    L, H, S = topo.n, hosts, float(nbytes)
    bpu = MODEL["bytes_per_us_per_gbps"]
    alpha_in = MODEL["alpha_us"]["nvlink"]
    inter = 2 * (H - 1) * (NET_ALPHA_US + (S / L) / (H * net_gbps * bpu)) if H > 1 else 0.0
    blink = time_us(p, "allreduce", S) + inter
    rs_ring = (L - 1) * (alpha_in + S / (L * rp.rate * bpu))
    hier = 2 * rs_ring + inter
    N = H * L
    b_rings = rp.num_rings * min(min(rp.rates), net_gbps) if H > 1 else rp.rate
    flat = 2 * (N - 1) * ((NET_ALPHA_US if H > 1 else alpha_in) + S / (N * b_rings * bpu))
    return {"blink_3phase": blink, "nccl_hier_rings": hier, "flat_ring": flat}
