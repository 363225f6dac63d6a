"""What the compiled CUDA module holds, checked without a GPU: the handlers it registers (the
benchmark's no-op handlers live in a module of their own)."""
from __future__ import annotations

import pytest

try:
    from jax_blink import _blink_cuda
except ImportError:  # not built (no nvcc) or not importable here
    _blink_cuda = None

needs_module = pytest.mark.skipif(_blink_cuda is None, reason="needs jax_blink._blink_cuda (a CUDA build)")


@needs_module
def test_the_shipped_module_registers_the_collectives_only():
    for command_buffers in (False, True):
        targets = set(_blink_cuda.registrations(command_buffers=command_buffers))
        # the collectives, the asynchronous pair (kernels/cuda/async_ffi.cc) and the bucket
        # packing's pair (kernels/cuda/pack_ffi.cc)
        assert targets == {"jax_blink_collective", "jax_blink_collective_lite", "jax_blink_collective_ipc",
                           "jax_blink_start", "jax_blink_done", "jax_blink_pack", "jax_blink_unpack"}


def test_the_benchmark_probes_are_a_module_of_their_own():
    try:
        from jax_blink import _blink_cuda_probes
    except ImportError:
        pytest.skip("jax_blink._blink_cuda_probes not built (-Ccmake.define.JAX_BLINK_BUILD_BENCH_PROBES=ON)")
    assert set(_blink_cuda_probes.registrations()) == {"jax_blink_noop", "jax_blink_noop_lite",
                                                       "jax_blink_noop_min", "jax_blink_noop_bare"}


# ---------------------------------------------------------------------------------------------
# The GPU architectures of the build (CMakeLists.txt's JAX_BLINK_CUDA_ARCHS)

# What the default build ("all") must hold where the compiler supports it: the architectures of
# the GPUs users have, Turing (T4) to Blackwell (B200, RTX 5090).
_PROMISED = {75, 80, 86, 89, 90, 100, 120}


def _tool(name: str) -> str | None:
    """A CUDA tool from PATH, the toolkit, or CUDA's pip wheels (nvidia-cuda-cuobjdump: nvidia/cu13/bin)."""
    import glob
    import os
    import shutil
    import site

    found = shutil.which(name) or shutil.which(name, path="/usr/local/cuda/bin")
    if found:
        return found
    for root in site.getsitepackages():
        for candidate in sorted(glob.glob(os.path.join(root, "nvidia", "cu*", "bin", name))):
            if os.access(candidate, os.X_OK):
                return candidate
    return None


def _nvcc_codes() -> set[int]:
    import re
    import subprocess

    nvcc = _tool("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc (PATH, /usr/local/cuda/bin or pip's nvidia-cuda-nvcc) to ask which architectures it supports")
    out = subprocess.run([nvcc, "--list-gpu-code"], capture_output=True, text=True, timeout=60, check=True).stdout
    return {int(a) for a in re.findall(r"sm_(\d+)", out)}


@needs_module
def test_the_module_says_what_it_was_built_for():
    archs = _blink_cuda.built_architectures()
    assert archs == sorted(set(archs)) and archs and all(a >= 50 for a in archs)
    assert _blink_cuda.ptx_architecture() == archs[-1]  # PTX of the newest, for newer GPUs
    if _blink_cuda.architectures_requested() != "all":
        pytest.skip(f"built with JAX_BLINK_CUDA_ARCHS={_blink_cuda.architectures_requested()}: the default's "
                    "list is checked in a default build")
    codes = _nvcc_codes()  # the build's compiler, where the build found it the same way
    assert _PROMISED & codes <= set(archs), f"missing from the default build: {sorted((_PROMISED & codes) - set(archs))}"
    assert all(a >= 75 for a in archs) and set(archs) <= codes


@needs_module
def test_every_built_architecture_is_in_the_binary():
    import re
    import subprocess

    cuobjdump = _tool("cuobjdump")
    if cuobjdump is None:
        pytest.skip("no cuobjdump (the CUDA toolkit's, or pip install nvidia-cuda-cuobjdump)")
    so = _blink_cuda.__file__
    elf = subprocess.run([cuobjdump, "--list-elf", so], capture_output=True, text=True, timeout=120, check=True).stdout
    ptx = subprocess.run([cuobjdump, "--list-ptx", so], capture_output=True, text=True, timeout=120, check=True).stdout
    # A cubin per architecture for each file of kernels (executor.cu, ipc.cu), PTX of the newest.
    archs = _blink_cuda.built_architectures()
    cubins = {(name, int(a)) for name, a in re.findall(r"(\w+)\.sm_(\d+)\.cubin", elf)}
    assert cubins == {(name, a) for name in ("executor", "ipc") for a in archs}, elf
    ptxs = {(name, int(a)) for name, a in re.findall(r"(\w+)\.sm_(\d+)\.ptx", ptx)}
    assert ptxs == {("executor", _blink_cuda.ptx_architecture()), ("ipc", _blink_cuda.ptx_architecture())}, ptx


@needs_module
def test_device_problem_names_a_missing_gpu():
    problem = _blink_cuda.device_problem(10_000)  # no machine has this one; without a GPU: none at all
    assert problem is not None and "jax_blink" in problem
    assert "no CUDA device 10000" in problem or "no usable GPU" in problem


@pytest.mark.gpu
@needs_module
def test_the_kernels_load_on_every_gpu_here():
    import jax

    for ordinal in range(len(jax.local_devices(backend="gpu"))):
        assert _blink_cuda.device_problem(ordinal) is None
