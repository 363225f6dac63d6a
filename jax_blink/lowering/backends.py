"""The compiled executors: finding them and registering their FFI handlers with XLA, once."""
from __future__ import annotations

import functools
import importlib

import jax

TARGET = "jax_blink_collective"
#: The same collective through a handler that claims XLA's command-buffer trait, so that XLA may
#: capture it in a CUDA graph with its neighbours (``config.command_buffers``). On CPU it is the
#: plain handler under a second name.
TARGET_CB = "jax_blink_collective_cb"

#: CUDA: the collective through the light binding (operand, rank, group and the ``comm_id``
#: attribute alone); what the call site fixes is registered first (:func:`register_call_site`).
TARGET_LITE = "jax_blink_collective_lite"
#: The same through the handler that claims the command-buffer trait.
TARGET_LITE_CB = "jax_blink_collective_lite_cb"

#: The CPU executor for ranks in several processes of one machine (shared memory, kernels/cpu/shm.h).
TARGET_MP = "jax_blink_collective_mp"
#: GPU: every collective across processes through CUDA IPC (kernels/cuda/ipc.h).
TARGET_IPC = "jax_blink_collective_ipc"
#: The asynchronous all-reduce's pair (GPU, kernels/cuda/async_ffi.cc; lowering/async_call.py): the
#: start launches on a side stream, the done makes XLA's stream wait for it.
TARGET_START, TARGET_DONE = "jax_blink_start", "jax_blink_done"
#: CPU: out = x once a second operand exists; orders collectives across processes (distributed.py).
TARGET_AFTER = "jax_blink_after"
#: GPU: a bucket's leaves into one flat buffer and back, one copy kernel each (kernels/cuda/pack_ffi.cc).
TARGET_PACK, TARGET_UNPACK = "jax_blink_pack", "jax_blink_unpack"

# XLA's platform names for the handlers of each compiled module.
_MODULES = {"cpu": ("jax_blink._blink_cpu", "cpu"), "gpu": ("jax_blink._blink_cuda", "CUDA")}


@functools.cache
def module(platform: str):
    """The executor module for a JAX platform ("cpu" or "gpu"), or None if it was not built."""
    name, _ = _MODULES.get(platform, (None, None))
    if name is None:
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


@functools.cache
def register(platform: str) -> bool:
    """Register the handlers of ``platform``'s executor with XLA; False when there is none."""
    mod = module(platform)
    if mod is None:
        return False
    xla_platform = _MODULES[platform][1]
    plain = mod.registrations()
    try:
        graph = mod.registrations(command_buffers=True)
    except TypeError:  # this executor has one handler only
        graph = plain
    jax.ffi.register_ffi_target(TARGET, plain[TARGET], platform=xla_platform)
    jax.ffi.register_ffi_target(TARGET_CB, graph[TARGET], platform=xla_platform)
    if TARGET_LITE in plain:
        jax.ffi.register_ffi_target(TARGET_LITE, plain[TARGET_LITE], platform=xla_platform)
        jax.ffi.register_ffi_target(TARGET_LITE_CB, graph[TARGET_LITE], platform=xla_platform)
    for probe in (TARGET_MP, TARGET_AFTER, TARGET_IPC, TARGET_START, TARGET_DONE, TARGET_PACK, TARGET_UNPACK):
        if probe in plain:
            jax.ffi.register_ffi_target(probe, plain[probe], platform=xla_platform)
    return True


@functools.cache
def has_target(platform: str, target: str) -> bool:
    """Whether ``platform``'s executor has the handler ``target``, registered with XLA."""
    return register(platform) and target in module(platform).registrations()


def has_call_sites(platform: str) -> bool:
    """Whether ``platform``'s executor takes the light binding (:data:`TARGET_LITE`)."""
    mod = module(platform)
    return mod is not None and hasattr(mod, "register_call_site")


def register_call_site(platform: str, comm_id: int, program, op: int, timeout_ms: int, host_share: float) -> None:
    """Tell ``platform``'s executor what the call site ``comm_id`` fixes (its schedule program, op,
    time budget and host share), for calls through :data:`TARGET_LITE`; ValueError if ``comm_id``
    was registered with anything else."""
    module(platform).register_call_site(int(comm_id), [int(w) for w in program], int(op), int(timeout_ms),
                                        float(host_share))


def available() -> dict[str, bool]:
    """Which executors this installation has: ``{"cpu": bool, "gpu": bool}``."""
    return {p: module(p) is not None for p in _MODULES}


def check() -> None:
    """Raise the failure a GPU collective recorded since the last :func:`reset`, if any.

    Kernels cannot raise: a failure inside one (a time-out, a program that differs between ranks,
    a peer process that skipped a call or died) is recorded, and raised here and by the next call
    of that collective. Without a CUDA executor there is nothing to check.

    Raises:
        RuntimeError: A GPU collective recorded a failure; the message names the rank, the
            process and where it waited.
    """
    mod = module("gpu")
    if mod is not None and hasattr(mod, "check"):
        mod.check()


def reset() -> None:
    """Clear every executor's recorded failures and call counts, so collectives run again.

    After a failure on a GPU, that GPU's collectives keep failing until this is called. Call it
    only while no collective runs.

    Raises:
        RuntimeError: A collective is running.
    """
    for platform in _MODULES:
        mod = module(platform)
        if mod is not None and hasattr(mod, "reset"):
            mod.reset()


def check_environment() -> None:
    """Check the CUDA executor's ``JAX_BLINK_*`` variables as its set-up will read them.

    Needs no GPU; without a CUDA executor there is nothing to check.

    Raises:
        ValueError: A variable holds a value the executor does not take; the message names the
            variable and what it takes.
    """
    mod = module("gpu")
    if mod is not None and hasattr(mod, "check_environment"):
        mod.check_environment()
