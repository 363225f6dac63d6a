"""``python -m jax_blink env``: what a bug report needs to know about this machine and this build.

Versions (jax_blink, jax, jaxlib, Python, OS), the executors this build has and the GPU
architectures its CUDA executor holds, the GPUs with their compute capability, the driver and
CUDA versions, the links between the GPUs as NVML reports them, peer access between each pair,
and what jax_blink would run on the devices here. Every section says where its facts come from
and prints "unknown (why)" rather than failing: the report must work where something is broken.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform as _platform
import sys
from collections.abc import Callable

import jax
import numpy as np

import jax_blink
from jax_blink.lowering import backends
from jax_blink.lowering import dispatch_cache
from jax_blink.lowering.decision import LAX_NAME, TUNE_COMMAND, choice, dispatch, executor_problem, no_entry_message
from jax_blink.planning.topology import Topology

_SIZES = (4 << 10, 1 << 20, 64 << 20)  # bytes per rank shown in "what jax_blink would run"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _try(fn: Callable[[], object]) -> str:
    try:
        return str(fn())
    except Exception as e:  # noqa: BLE001 - a report line, never a crash
        return f"unknown ({type(e).__name__}: {e})"


def _versions() -> list[str]:
    jaxlib_version = _try(lambda: __import__("jaxlib").__version__)
    return [
        f"jax_blink      {jax_blink.__version__} ({os.path.dirname(jax_blink.__file__)})",
        f"jax            {jax.__version__}",
        f"jaxlib         {jaxlib_version}",
        f"python         {sys.version.split()[0]} ({sys.executable})",
        f"os             {_platform.platform()}",
        f"numpy          {np.__version__}",
        f"networkx       {_version('networkx')}",
        f"ortools        {_version('ortools')}",
        f"nvidia-ml-py   {_version('nvidia-ml-py')}",
    ]


def _executors() -> list[str]:
    have = backends.available()
    lines = [f"CPU executor   {'built' if have['cpu'] else 'MISSING (reinstall jax_blink)'}"]
    if not have["gpu"]:
        lines.append("CUDA executor  not built (no CUDA compiler was found when jax_blink was built; "
                     "install the CUDA toolkit or pip's nvidia-cuda-nvcc and reinstall)")
        return lines
    mod = backends.module("gpu")
    archs = getattr(mod, "built_architectures", None)
    built = _try(lambda: ", ".join(f"sm_{a}" for a in archs())) if archs else "unknown (an older build)"
    ptx = getattr(mod, "ptx_architecture", None)
    if ptx is not None:
        built += _try(lambda: f" + PTX of compute_{ptx()}")
    lines.append(f"CUDA executor  built for {built}; {_try(mod.version)}")
    if hasattr(mod, "device_problem"):
        try:
            for d in jax.devices("gpu"):
                problem = mod.device_problem(d.local_hardware_id)
                lines.append(f"GPU {d.local_hardware_id}: " + (problem or "the build runs on it"))
        except RuntimeError:
            pass  # no GPU visible to jax: the GPUs section says so
    return lines


def _gpus() -> tuple[list[str], list]:
    try:
        gpus = jax.devices("gpu")
    except RuntimeError as e:
        return [f"none visible to jax ({str(e).splitlines()[0]})"], []
    lines = []
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            driver = pynvml.nvmlSystemGetDriverVersion()
            cuda = pynvml.nvmlSystemGetCudaDriverVersion()
            lines.append(f"driver {driver}, CUDA driver API {cuda // 1000}.{cuda % 1000 // 10} (NVML)")
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
                mem = pynvml.nvmlDeviceGetMemoryInfo(h).total / 2**30
                bus = pynvml.nvmlDeviceGetPciInfo(h).busId
                bus = bus.decode() if isinstance(bus, bytes) else bus
                name = pynvml.nvmlDeviceGetName(h)
                name = name.decode() if isinstance(name, bytes) else name
                lines.append(f"GPU {i}: {name}, compute capability {major}.{minor}, {mem:.0f} GiB, PCI {bus}")
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:  # noqa: BLE001
        lines.append(f"NVML unavailable ({type(e).__name__}: {e}); jax sees: "
                     + ", ".join(d.device_kind for d in gpus))
    runtime = _try(lambda: jax.devices("gpu")[0].client.platform_version)
    lines.append(f"jax's CUDA runtime: {runtime}")
    return lines, gpus


def _peer_access(gpus: list) -> list[str]:
    mod = backends.module("gpu")
    if mod is None or len(gpus) < 2:
        return ["not applicable (fewer than 2 GPUs, or no CUDA executor)"]
    ids = [d.local_hardware_id for d in gpus]
    lines = []
    for a in ids:
        row = " ".join("-" if a == b else ("yes" if mod.can_access_peer(a, b) else "NO") for b in ids)
        lines.append(f"GPU {a} -> {row}")
    return lines


def _would_run(devices: list) -> list[str]:
    n = len(devices)
    platform = "gpu" if devices[0].platform in ("gpu", "cuda") else "cpu"
    kind = devices[0].device_kind
    if n < 2:
        return [f"1 {platform} device ({kind}): a collective needs 2 or more ranks; jax_blink's calls "
                f"return their operand as lax does (on one GPU the CUDA self-test runs the kernels with "
                f"ranks as streams: bash benchmarks/gpu_session.sh)"]
    problem = executor_problem(platform, "a collective", n)
    if problem is not None:
        return [f"{n} x {kind}: XLA's own collectives ({problem})"]
    lines = _entry_lines(kind, n) + [f"{n} x {kind}, float32, config.dispatch={jax_blink.config.dispatch!r}:"]
    for collective in ("allreduce", "allgather", "reducescatter"):
        for nbytes in _SIZES:
            d = dispatch(collective, n, nbytes, "float32", kind, warn=False)  # _entry_lines says it
            where = "jax_blink executor" if d.executor else LAX_NAME[collective]
            lines.append(f"  {collective:13s} {nbytes:>9d} bytes per rank: {where} ({d.reason})")
    return lines


def _entry_lines(kind: str, n: int) -> list[str]:
    """Which measured entry dispatch="auto" follows on this machine, per collective; where there is
    none, what runs meanwhile and the command that measures one."""
    lines = []
    picked = {c: choice(c, n, "float32", kind) for c in ("allreduce", "allgather", "reducescatter")}
    key = next(iter(picked.values())).machine
    lines.append(f"this machine's dispatch key: {key.describe(versions=True)}")
    for collective, c in picked.items():
        source = {"tuned": f"tuned entry in {dispatch_cache.cache_file()}",
                  "shipped": "shipped entry (jax_blink/lowering/dispatch_entries.json)",
                  "meanwhile": "NO entry for this machine: the meanwhile rule"}[c.source]
        lines.append(f"  {collective:13s} {source}, from {', '.join(c.entry.sources) or 'no measurement'}")
    if any(c.source == "meanwhile" for c in picked.values()):
        lines.append("  " + no_entry_message(key))
    elif not any(c.source == "tuned" for c in picked.values()):
        lines.append(f"  (`{TUNE_COMMAND}` measures this very machine, jax and NCCL versions included, into the cache)")
    return lines


def _links(devices: list) -> str:
    topo = Topology.discover(devices)
    if set(topo.kinds()) == {"host"}:
        return (f"{topo.n} CPU host devices of one process: every pair shares memory (a uniform mesh; "
                "the planner models each link at the same rate, so trees and rings tie here)")
    return topo.describe()


#: Variables that change what a run of jax_blink does or measures (the report's last section).
RELEVANT_PREFIXES = ("JAX_BLINK_", "XLA_FLAGS", "JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES", "NCCL_")


def relevant_environment(environ=None) -> dict[str, str]:
    """The variables of ``environ`` (default ``os.environ``) named by :data:`RELEVANT_PREFIXES`, sorted."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in sorted(environ.items()) if k.startswith(RELEVANT_PREFIXES)}


def report() -> str:
    """The whole report, as text."""
    sections = [("Versions", _versions()), ("Executors in this build", _executors())]
    gpu_lines, gpus = _gpus()
    sections.append(("GPUs", gpu_lines))
    devices = gpus or jax.devices()
    topo = _try(lambda: _links(devices))
    sections.append((f"Links between the {len(devices)} {devices[0].platform} device(s) (NVML on GPUs; "
                     "CPU host devices share memory)", topo.splitlines()))
    sections.append(("Peer access (CUDA, row -> column)", _peer_access(gpus)))
    sections.append(("What jax_blink would run here", _would_run(devices)))
    env = [f"{k}={v}" for k, v in relevant_environment().items()]
    try:  # what the CUDA executor's set-up would refuse, said here before any collective runs
        backends.check_environment()
    except ValueError as e:
        env.append(f"NOT UNDERSTOOD: {e}")
    sections.append(("Environment", env or ["(no JAX_BLINK_*, XLA_FLAGS, JAX_PLATFORMS, CUDA_VISIBLE_DEVICES, NCCL_*)"]))
    out = []
    for title, lines in sections:
        out.append(f"== {title}")
        out += [f"  {line}" for line in lines]
    return "\n".join(out)


def main() -> int:
    print(report())
    return 0
