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
        assert targets == {"jax_blink_collective", "jax_blink_collective_lite", "jax_blink_collective_ipc"}


def test_the_benchmark_probes_are_a_module_of_their_own():
    try:
        from jax_blink import _blink_cuda_probes
    except ImportError:
        pytest.skip("jax_blink._blink_cuda_probes not built (-Ccmake.define.JAX_BLINK_BUILD_BENCH_PROBES=ON)")
    assert set(_blink_cuda_probes.registrations()) == {"jax_blink_noop", "jax_blink_noop_lite",
                                                       "jax_blink_noop_min", "jax_blink_noop_bare"}
