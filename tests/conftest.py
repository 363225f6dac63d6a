"""Test set-up shared by every test file.

CPU tests run collectives over 8 host devices. XLA reads these variables once, when the first
JAX backend starts, so they are set here, before any test module imports jax.
"""
import os

_N_HOST_DEVICES = 8


def _add_xla_flag(flag: str) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    name = flag.split("=")[0]
    if name not in flags:
        os.environ["XLA_FLAGS"] = (flags + " " + flag).strip()


_add_xla_flag(f"--xla_force_host_platform_device_count={_N_HOST_DEVICES}")
# On a 2-core machine the CPU client's thread pool can be smaller than the device count, and
# multi-device programs queued back to back have deadlocked there (XLA's own psum too).
os.environ.setdefault("PJRT_NPROC", "16")

import jax  # noqa: E402  (after the flags above)
import pytest  # noqa: E402


def gpu_devices() -> list:
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def pytest_collection_modifyitems(config, items):
    if len(gpu_devices()) >= 1:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none found)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
