"""jax_blink.lowering.machine._gpu_links on a stand-in for NVML: the wiring word of the dispatch
key (an NVSwitch, direct pairs, PCIe), found through jax_blink.planning.topology.nvml_handles."""
from __future__ import annotations

import sys
import types

import pytest

from jax_blink.lowering import machine


def _fake_nvml(links: dict[int, list[str]], gpus: int):
    """NVML of ``gpus`` GPUs at buses 0000:0<i+1>:00.0; ``links[i]``: the remote bus of each active
    NVLink of GPU i (a GPU's bus, or another device's: an NVSwitch)."""
    class NVMLError(Exception):
        pass

    def remote(h, link):
        if link >= len(links.get(h, [])):
            raise NVMLError("no such link")
        return types.SimpleNamespace(busId=links[h][link].encode())

    return types.SimpleNamespace(
        NVMLError=NVMLError, NVML_FEATURE_ENABLED=1, NVML_NVLINK_MAX_LINKS=18,
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: gpus,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetPciInfo=lambda h: types.SimpleNamespace(busId=f"00000000:0{h + 1}:00.0".encode()),
        nvmlDeviceGetNvLinkState=lambda h, link: 1 if link < len(links.get(h, [])) else 0,
        nvmlDeviceGetNvLinkRemotePciInfo=remote)


def _devices(n):
    return [types.SimpleNamespace(id=i, platform="gpu", pci_bus_id=f"0000:0{i + 1}:00.0", local_hardware_id=i)
            for i in range(n)]


def _bus(i):
    return f"00000000:0{i + 1}:00.0"


@pytest.mark.parametrize("links,gpus,n,want", [
    ({i: ["00000000:c0:00.0"] * 18 for i in range(4)}, 4, 4, "NV18 switch"),
    ({0: [_bus(1)] * 4, 1: [_bus(0)] * 4}, 2, 2, "NV4 pairs"),
    ({}, 2, 2, "pcie"),
    # links to a GPU that is not ours are no switch: ours are joined by PCIe only
    ({0: [_bus(2)] * 2, 1: [_bus(2)] * 2, 2: [_bus(0)] * 2 + [_bus(1)] * 2}, 3, 2, "pcie"),
    ({0: [_bus(1)] * 2, 1: [_bus(0)] * 2}, 3, 3, "0-1:NV2,0-2:pcie,1-2:pcie"),
])
def test_the_wiring_word(monkeypatch, links, gpus, n, want):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(links, gpus))
    assert machine._gpu_links(_devices(n)) == want
