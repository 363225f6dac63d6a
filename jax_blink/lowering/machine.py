"""Which machine this is, as the dispatch table keys its entries: device model, count, links,
layout of the ranks, and the jax and NCCL versions that a tuned entry was measured with.

An entry measured on one machine says nothing about another: 4 GPUs behind a switch lost where 2
GPUs of the same model won (issue 27), and ranks in several processes run another executor. So
the key names the links as discovery sees them (``"NV18 switch"``, ``"NV4 pairs"``, each pair's
NVLink count, ``"pcie"``, ``"host memory"`` for CPU host devices), and tuned entries also carry
the jax and NCCL versions, which change XLA's side of every comparison.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
from collections.abc import Sequence
from typing import Any

import jax

#: The links of CPU host devices of one process: every pair shares the host's memory.
HOST_LINKS = "host memory"
#: What a key says where a fact could not be found.
UNKNOWN = "unknown"
#: The pip distributions that bring the NCCL library XLA's GPU plugin loads, newest CUDA first.
_NCCL_DISTRIBUTIONS = ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")


@dataclasses.dataclass(frozen=True)
class MachineKey:
    """What a dispatch entry is for: ``ranks`` devices of ``device_kind`` linked as ``links``
    says (None: not known), whose ranks live as ``layout`` says, under ``jax`` and ``nccl``
    (versions; None where an entry does not depend on them)."""

    device_kind: str
    ranks: int
    links: str | None
    layout: str = "one process"
    jax: str | None = None
    nccl: str | None = None

    @property
    def platform(self) -> str:
        """``"cpu"`` for CPU host devices, else ``"gpu"``."""
        return "cpu" if self.device_kind == "cpu" else "gpu"

    def describe(self, versions: bool = False) -> str:
        """The key in words: ``4 x NVIDIA H200, NV18 switch, one process`` (and the versions)."""
        text = f"{self.ranks} x {self.device_kind}, {self.links or 'links unknown'}, {self.layout}"
        if versions:
            text += f", jax {self.jax or UNKNOWN}"
            text += "" if self.platform == "cpu" else f", NCCL {self.nccl or UNKNOWN + ' (no nvidia-nccl wheel)'}"
        return text


def nccl_version() -> str | None:
    """The NCCL version XLA's GPU plugin runs with, read from the ``nvidia-nccl-cu*`` wheel that
    jax's CUDA plugin installs (None when there is none: a system NCCL, or no GPU plugin). XLA
    itself does not report it, and loading ``libnccl`` here only to ask would load it twice."""
    for dist in _NCCL_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _gpu_links(devices: Sequence[Any]) -> str:
    """The NVLink wiring of ``devices`` (jax GPU devices) from NVML: ``"NV18 switch"`` where their
    NVLinks go into an NVSwitch (the count per GPU, the smallest), ``"NV4 pairs"`` where every
    pair has the same count of direct NVLinks, each pair's count (``"0-1:NV2,0-2:pcie"``) where
    they differ, ``"pcie"`` without NVLink. Raises where NVML cannot say."""
    import pynvml as nvml

    from jax_blink.planning.topology import _norm_bus_id, nvml_gpus, nvml_handles

    nvml.nvmlInit()
    try:
        gpus = nvml_gpus(nvml)  # every GPU, ours or not
        handles = nvml_handles(nvml, devices, gpus)
        rank_of = {_norm_bus_id(nvml.nvmlDeviceGetPciInfo(h).busId): r for r, h in enumerate(handles)}
        enabled = getattr(nvml, "NVML_FEATURE_ENABLED", 1)
        pairs: dict[tuple[int, int], int] = {}
        into_switch = []
        for a, h in enumerate(handles):
            switch = 0
            for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
                try:
                    if nvml.nvmlDeviceGetNvLinkState(h, link) != enabled:
                        continue
                    remote = _norm_bus_id(nvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId)
                except nvml.NVMLError:
                    continue
                if remote in rank_of:
                    b = rank_of[remote]
                    pairs[(min(a, b), max(a, b))] = pairs.get((min(a, b), max(a, b)), 0) + 1
                elif remote not in gpus:
                    switch += 1  # not a GPU: an NVSwitch
            into_switch.append(switch)
    finally:
        nvml.nvmlShutdown()
    n = len(handles)
    if n and min(into_switch) > 0:
        return f"NV{min(into_switch)} switch"
    # Each direct link is seen from both ends.
    counts = {(a, b): pairs.get((a, b), 0) // 2 for a in range(n) for b in range(a + 1, n)}
    if not any(counts.values()):
        return "pcie"
    if len(set(counts.values())) == 1:
        return f"NV{next(iter(counts.values()))} pairs"
    return ",".join(f"{a}-{b}:" + (f"NV{k}" if k else "pcie") for (a, b), k in sorted(counts.items()))


@functools.lru_cache(maxsize=None)
def links_here(platform: str, n: int) -> str | None:
    """The links among the first ``n`` devices of ``platform`` in this process (None: unknown,
    e.g. no such devices here, or NVML failed)."""
    if platform == "cpu":
        return HOST_LINKS
    try:
        devices = [d for d in jax.devices(platform) if d.process_index == jax.process_index()]
        if len(devices) < n and jax.process_count() == 1:
            return None
        return _gpu_links(devices[:n])
    except Exception:  # noqa: BLE001 - an unknown fact, never a failed call
        return None


def this_machine(device_kind: str, n: int, layout: str = "one process") -> MachineKey:
    """The key of a collective among ``n`` devices of ``device_kind`` here, with this process's
    jax and NCCL versions."""
    platform = "cpu" if device_kind == "cpu" else "gpu"
    return MachineKey(device_kind, n, links_here(platform, n), layout, jax.__version__,
                      None if platform == "cpu" else nccl_version())
