"""``jax_blink.explain``: the trees, the all-reduce form, shares, chunks, executor and dispatch
decision of one call, in words."""
from __future__ import annotations


import jax.numpy as jnp
import numpy as np

from jax_blink.lowering import chunk_cache
from jax_blink.lowering import dispatch_table as tuning
from jax_blink.lowering import hierarchy as _hierarchy
from jax_blink.lowering.custom_call import allreduce_choice, build_program, chunk_bytes_for, host_engine
from jax_blink.lowering.mesh import device_kind as _device_kind, platform as _platform
from jax_blink.lowering.decision import LAX_NAME as _LAX_NAME
from jax_blink.options import AUTO, config, env_value, parse_byte_count
from jax_blink.planning import schedule as _schedule
from jax_blink.planning.forms import LL_MAX_BYTES, ONESHOT_MAX_BYTES, runs_ll_blocks
from jax_blink.planning.packing import hybrid_share, plan as _plan
from jax_blink.planning.topology import NVLINK_EFFICIENCY, Topology
from jax_blink.api.collectives import check_root


#: The CUDA executor's default size limits, for explain(): the one-hop kernels' as the planner
#: knows them (planning/forms.py), and the host channel's (kernels/cuda/executor.h:
#: kDefaultHostMinBytes; a test keeps all three equal to the header).
LL_BYTES, ONESHOT_BYTES, HOST_MIN_BYTES = LL_MAX_BYTES, ONESHOT_MAX_BYTES, 256 << 20
#: From this size per rank, all-reduces on 3 or more GPUs take the two-shot kernel
#: (kernels/cuda/executor.h: kDefaultTwoShotMinBytes; a test keeps it equal to the header).
TWOSHOT_MIN_BYTES = 16 << 20
_EXECUTOR_BYTES = {"JAX_BLINK_LL_BYTES": LL_BYTES, "JAX_BLINK_ONESHOT_BYTES": ONESHOT_BYTES,
                   "JAX_BLINK_HOST_MIN_BYTES": HOST_MIN_BYTES, "JAX_BLINK_TWOSHOT_MIN_BYTES": TWOSHOT_MIN_BYTES}


def _executor_bytes(name: str) -> int:
    """A size limit of the CUDA executor as it reads it: the variable, else its default (a value
    it does not understand fails its set-up, and a ValueError here)."""
    return env_value(name, parse_byte_count, "a byte count such as 8388608, 512K, 16M or 1G",
                     default=_EXECUTOR_BYTES[name])


def _host_min_bytes() -> int:
    return max(_executor_bytes("JAX_BLINK_HOST_MIN_BYTES"), 1)


def _gpu_kernel(n: int, nbytes: int, switch: bool = False) -> str:
    """Which kernel the CUDA executor runs for an all-reduce of ``nbytes`` per rank on ``n`` GPUs
    (``switch``: every pair linked alike, so the plan is one-hop stars, which the two-shot kernel
    takes from its size on)."""
    if nbytes <= _executor_bytes("JAX_BLINK_LL_BYTES") and n <= 8:
        return "one LL kernel (data and flag in one 8-byte store, one hop; JAX_BLINK_LL_BYTES)"
    if n == 2 and nbytes <= _executor_bytes("JAX_BLINK_ONESHOT_BYTES"):
        return "one one-shot kernel (every rank writes into the other's inbox, one hop; JAX_BLINK_ONESHOT_BYTES)"
    two_shot = _executor_bytes("JAX_BLINK_TWOSHOT_MIN_BYTES")
    if switch and n >= 3 and two_shot > 0 and nbytes >= two_shot:
        return ("one two-shot kernel (reduce-scatter then all-gather, every byte a remote write into the peers' "
                "outputs; JAX_BLINK_TWOSHOT_MIN_BYTES), not the trees below")
    return "the trees below"


def _topology_platform(topology: Topology) -> str:
    """``"cpu"`` for a mesh of CPU host devices (its links are of kind ``"host"``), ``"gpu"`` for
    any other (the presets, NVML discovery, NVLink/PCIe/switch graphs); a single device, which has
    no links: the platform of this process's devices."""
    kinds = set(topology.kinds())
    if not kinds:
        return _platform()
    return "cpu" if kinds == {"host"} else "gpu"


def _executor_line(platform: str, collective: str, n: int, nbytes: int, switch: bool = False) -> str:
    """Which executor runs ``collective`` on ``n`` devices of ``platform``, and how."""
    if platform == "cpu":
        return (f"CPU executor: {nbytes} bytes per rank on {n} CPU host devices run through the trees "
                "below (a thread per device, meeting its peers in this process)")
    if collective == "allreduce":
        return f"CUDA executor: {nbytes} bytes per rank on {n} GPUs run as {_gpu_kernel(n, nbytes, switch)}"
    if collective in ("allgather", "reducescatter"):
        # A rank's block: an all-gather's operand, a reduce-scatter's operand over n.
        block = nbytes if collective == "allgather" else (nbytes // n if nbytes % n == 0 else 0)
        if runs_ll_blocks(n, block, _executor_bytes("JAX_BLINK_LL_BYTES")):
            return (f"CUDA executor: {nbytes} bytes per rank on {n} GPUs run as one LL kernel (every rank writes "
                    f"each peer only the {block}-byte block it needs, data and flag in one 8-byte store, one hop; "
                    "blocks up to JAX_BLINK_LL_BYTES), not the trees below")
    return f"CUDA executor: {nbytes} bytes per rank on {n} GPUs run through the trees below"


def _dispatch_line(kind: str | None, platform: str, collective: str, n: int, nbytes: int,
                   dtype: str | None = None) -> str:
    """What ``config.dispatch`` does with this call on ``n`` devices of ``kind`` (None: unknown)."""
    lax_name = _LAX_NAME[collective]
    if config.dispatch == "lax":
        return f"dispatch=lax: {lax_name} runs every call instead of the executor"
    if config.dispatch == "blink":
        return "dispatch=blink: the executor runs every call, whatever jax_blink/lowering/dispatch_table.py measured"
    if kind is None:
        devs, example = ("GPUs", "'NVIDIA H200'") if platform == "gpu" else ("CPU host devices", "'cpu'")
        return (f"dispatch=auto: the executor, unless jax_blink/lowering/dispatch_table.py measured {lax_name} faster on "
                f"these {devs}: name their kind with device_kind= (e.g. {example}) to see its entry")
    entry = tuning.entry(kind, n, collective, dtype=dtype)
    if entry is None:
        return f"dispatch=auto: the executor runs this call (jax_blink/lowering/dispatch_table.py has no entry for {n} x {kind})"
    which = f" in {entry.dtype}" if entry.dtype else ""
    if entry.prefers_lax(nbytes):
        return (f"dispatch=auto: {lax_name} runs this call instead: it was measured faster on {n} x {kind} "
                f"at this size{which} (jax_blink/lowering/dispatch_table.py, from {', '.join(entry.sources)})")
    return (f"dispatch=auto: the executor runs this call, as the entry for {n} x {kind} says at this "
            f"size{which} (jax_blink/lowering/dispatch_table.py, from {', '.join(entry.sources)})")


def explain(topology: Topology, nbytes: int, collective: str = "allreduce", *, root: int = 0,
            dtype="float32", method: str = "exact", device_kind: str | None = None,
            hosts: int = 1) -> str:
    """Say what a call would do, and why: its trees, their shares, chunks, executor and dispatch.

    The text holds the plan's own explanation (trees, weights, rate against the bounding cut),
    the chunks, the executor that runs it on that topology's devices (and on GPUs its kernel), the
    host channel where it takes part, and whether the dispatch table hands the call to ``lax``.

    Args:
        topology: The devices and links of the call's axis (e.g. ``Topology.preset("dgx1v")``).
        nbytes: Bytes of one rank's operand; a whole number of ``dtype`` elements.
        collective: ``"allreduce"``, ``"broadcast"``, ``"reduce"``, ``"allgather"`` or
            ``"reducescatter"``.
        root: The root rank of a broadcast or reduce.
        dtype: The operand's dtype (the dispatch table has entries per dtype).
        method: The tree-packing solver, ``"exact"`` or ``"mwu"``.
        device_kind: The kind of device whose dispatch entry and tuned chunk count (e.g.
            ``"NVIDIA H200"``, ``"cpu"``). Default: this process's devices' kind when the topology
            is of their platform, else none (a GPU preset explained on a machine without GPUs is
            not judged by this machine's CPU measurements).
        hosts: More than 1: ``topology`` is the inside of one of that many hosts, and an
            all-reduce, reduce-scatter or all-gather runs in phases inside and among the hosts
            (:mod:`jax_blink.lowering.hierarchy`).

    Returns:
        Several lines of text.

    Raises:
        ValueError: ``collective`` is unknown, ``nbytes`` is not a whole number of ``dtype``
            elements, or ``root`` is not a rank of the topology.

    Example::

        >>> topo = jax_blink.Topology.preset("dgx1v").subset([0, 1, 4])
        >>> print(jax_blink.explain(topo, nbytes=64 << 20))
    """
    if collective not in _LAX_NAME:
        raise ValueError(f"unknown collective {collective!r}; allowed: {', '.join(_LAX_NAME)}")
    if hosts > 1:
        return _explain_hosts(topology, nbytes, collective, hosts=hosts, dtype=dtype, method=method,
                              device_kind=device_kind)
    itemsize = np.dtype(jnp.dtype(dtype)).itemsize
    if nbytes % itemsize:
        raise ValueError(f"nbytes={nbytes} is not a whole number of {np.dtype(jnp.dtype(dtype)).name}")
    n = topology.n
    if collective in ("allgather", "reducescatter"):
        total = nbytes // itemsize * (n if collective == "allgather" else 1)
        lines = [f"{collective} of {nbytes} bytes per rank over {n} ranks: segment k goes through "
                 f"the {'broadcast' if collective == 'allgather' else 'reduce'} trees rooted at rank k"]
    else:
        p = _plan(topology, collective, topology.devices[check_root(root, n)]
                  if collective != "allreduce" else None, method=method)
        lines = [p.explain()]
        total = nbytes // itemsize
        host, share = hybrid_share(p, host_engine())
        if host > 0:
            min_bytes = _host_min_bytes()
            host_share = env_value("JAX_BLINK_HOST_SHARE", str, "a fraction in [0, 1] (the executor checks it)")
            lines.append(
                f"host channel (pinned memory over PCIe): {host:.1f} GB/s beside the trees' "
                f"{p.rate * NVLINK_EFFICIENCY:.1f} (their {p.rate:.1f} at NVLink's measured "
                f"efficiency); Blink's hybrid transfer sends {share:.1%} of the data through it. "
                f"The CUDA executor does so for all-reduces of at least JAX_BLINK_HOST_MIN_BYTES "
                f"({HOST_MIN_BYTES >> 20} MiB by default) on 2 GPUs; smaller ones take NVLink only. This one "
                f"({nbytes} bytes per rank, the limit now {min_bytes}): "
                + ("host channel and NVLink." if nbytes >= min_bytes else "NVLink only.")
                + (f" JAX_BLINK_HOST_SHARE={host_share} overrides the share." if host_share else ""))
    if collective == "allreduce" and n > 1:
        # Which form runs (jax_blink/planning/forms.py), by how much it beat the next, and why.
        lines.append(allreduce_choice(topology, total * itemsize, method).line())
    platform = _topology_platform(topology)
    kind = device_kind or (_device_kind() if platform == _platform() else None)
    lines.append(_executor_line(platform, collective, n, nbytes, switch=set(topology.kinds()) == {"switch"}))
    lines.append(_dispatch_line(kind, platform, collective, n, nbytes, np.dtype(jnp.dtype(dtype)).name))
    # No device kind: no tuned chunk either (the cache is keyed by it), the schedule's default.
    chunk = chunk_bytes_for(collective, n, total * itemsize, dtype, kind) \
        if kind is not None or config.chunk_bytes != AUTO else None
    prog = build_program(topology, collective,
                    None if collective == "allreduce" else root, total, itemsize,
                    chunk, method)
    sched = _schedule.decode(prog)
    if config.chunk_bytes == AUTO:
        lines.append(f"chunk_bytes=auto: {f'tuned chunk of {chunk} bytes' if chunk else 'nothing tuned'} "
                     f"for {kind or 'no device kind (pass device_kind=)'}, {n} ranks, {collective}, "
                     f"{jnp.dtype(dtype).name}, "
                     f"size class {chunk_cache.size_class(total * itemsize)}"
                     + ("" if chunk else " (the schedule's default)"))
    lines.append(f"schedule: {len(sched.trees)} tree segments, chunks of {sched.chunk_elems} "
                 f"elements ({sched.chunk_elems * itemsize} bytes)")
    for i, t in enumerate(sched.trees):
        chunks = -(-t.length // sched.chunk_elems)
        lines.append(f"  tree {i}: root rank {t.root}, depth {t.depth()}, elements "
                     f"[{t.offset}, {t.offset + t.length}) in {chunks} chunk(s)")
    return "\n".join(lines)


def _explain_hosts(topology: Topology, nbytes: int, collective: str, *, hosts: int, **kw) -> str:
    """explain() of a collective over ``hosts`` hosts whose insides are ``topology``: the three
    phases and their bytes, then the inside of a host as a one-host call explains it."""
    if not isinstance(hosts, int) or hosts < 1:
        raise ValueError(f"hosts must be a positive int, got {hosts!r}")
    if collective not in ("allreduce", "reducescatter", "allgather"):
        return (f"{collective} over {hosts} hosts: no three-phase form; lax runs it "
                "(jax_blink's collectives across hosts are all_reduce, reduce_scatter and all_gather)")
    method = kw.get("method", "exact")
    phases = _hierarchy.explain_phases(topology, hosts, nbytes, method=method, collective=collective)
    if collective == "reducescatter":
        return "\n".join([phases, f"inside each host, phase 1 is the reduce-scatter of {nbytes} bytes per rank:",
                          explain(topology, nbytes, "reducescatter", **kw)])
    if collective == "allgather":
        return "\n".join([phases, f"inside each host, phase 2 is the all-gather of {hosts * nbytes} bytes per rank:",
                          explain(topology, hosts * nbytes, "allgather", **kw)])
    piece = -(-nbytes // topology.n)
    return "\n".join([phases,
                      "inside each host, phases 1 and 3 are the reduce-scatter and all-gather of "
                      f"{nbytes} bytes per rank ({piece} bytes per piece):",
                      explain(topology, piece * topology.n, "reducescatter", **kw)])
