"""benchmarks/peer_alloc_probe.py without a GPU: bad arguments and a machine without CuPy end in a
usage error that names the problem, not a traceback."""
from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "peer_alloc_probe.py"


@pytest.mark.parametrize("args,says", [(["--reader", "1", "--owner", "1"], "must differ (both 1)"),
                                       (["--bytes", "1.5Q"], "--bytes"), (["--bytes", "100"], "at least 4K"),
                                       (["--tries", "0"], "--tries"), (["--case", "early"], "--case"),
                                       (["--wait-s", "0"], "--wait-s"),
                                       ([], "needs CuPy")])
def test_refuses_with_what_it_needs(args, says):
    r = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert says in r.stderr and "Traceback" not in r.stderr, r.stderr


class _FakeCuPy:
    """A stand-in for CuPy on the host: device buffers are numbers in a table, the pinned box is
    real host memory, and a kernel's sums are taken when its result is read (as a kernel that
    waits for the host would end only then)."""

    def __init__(self, reuse: bool):
        import ctypes
        import types

        import numpy as np

        self.uint64 = np.uint64
        fake = self
        self.filled, self.live, self.freed, self.next, self.reuse = {}, set(), [], 0x7F0000000000, reuse
        self._pinned = {}

        class CUDARuntimeError(RuntimeError):
            pass

        def malloc(n):
            if fake.reuse and fake.freed:
                ptr = fake.freed.pop()
            else:
                ptr, fake.next = fake.next, fake.next + n
            fake.live.add(ptr)
            return ptr

        def free(ptr):
            fake.live.discard(ptr)
            fake.filled.pop(ptr, None)
            fake.freed.append(ptr)

        def memset(ptr, value, n):
            fake.filled[ptr] = (value, n)

        def host_alloc(n, flags):
            buf = ctypes.create_string_buffer(n)
            fake._pinned[ctypes.addressof(buf)] = buf
            return ctypes.addressof(buf)

        rt = types.SimpleNamespace(
            CUDARuntimeError=CUDARuntimeError, getDeviceCount=lambda: 4, deviceCanAccessPeer=lambda a, b: 1,
            deviceEnablePeerAccess=lambda b: None, malloc=malloc, free=free, memset=memset,
            deviceSynchronize=lambda: None, hostAlloc=host_alloc,
            freeHost=lambda p: fake._pinned.pop(p))

        self.cuda = types.SimpleNamespace(runtime=rt, Device=lambda g: contextlib.nullcontext())

        def word_sum(ptr, words):
            value, n = fake.filled.get(int(ptr), (0, 0))
            assert int(ptr) in fake.live and n >= 4 * words, "a read of a buffer that is not live and filled"
            return words * int.from_bytes(bytes([value]) * 4, "little")

        class Array:
            def __init__(self, n):
                self.v, self.pending = [0] * n, []

            def get(self):
                for fn in self.pending:
                    fn(self)
                self.pending = []
                return list(self.v)

        def kernel(src, name):
            def launch(grid, block, args):
                if name == "sum_words":
                    ptr, words, out = args
                    out.pending.append(lambda a: a.v.__setitem__(0, a.v[0] + word_sum(ptr, int(words))))
                else:
                    box_ptr, control, words, wait_ns, out = args
                    box = (ctypes.c_uint64 * 4).from_address(int(box_ptr))

                    def finish(a):
                        a.v[1] += word_sum(control, int(words))
                        if box[0] == 1:
                            a.v[0] += word_sum(box[1], int(words))
                        else:
                            box[2] = 1
                    out.pending.append(finish)
            return launch

        self.RawKernel = kernel
        self.zeros = lambda n, dtype=None: Array(n)


@pytest.mark.parametrize("reuse", [True, False])
def test_both_cases_run_and_check_their_sums_with_a_stand_in_for_cupy(monkeypatch, capsys, reuse):
    import importlib.util

    spec = importlib.util.spec_from_file_location("peer_alloc_probe", SCRIPT)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    fake = _FakeCuPy(reuse)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(probe.time, "sleep", lambda s: None)
    assert probe.main(["--bytes", "64K"]) == 0
    out = capsys.readouterr().out
    assert out.count(": right") == (4 if reuse else 3) and "WRONG" not in out, out
    assert "late: late (allocated while the reader's kernel waited)" in out
    if not reuse:
        assert "moved: moved (the address the reader freed): not run (the owner did not get" in out
    assert not fake.live and not fake._pinned  # every buffer freed, the pinned box too


def test_a_stopped_kernel_is_reported_with_both_addresses_and_fails(monkeypatch, capsys):
    """Under memcheck the late read is reported and the kernel stopped: the probe must say so,
    name both buffers' addresses before the sums (which never come), and exit 1, not a traceback."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("peer_alloc_probe", SCRIPT)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    fake = _FakeCuPy(reuse=False)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(probe.time, "sleep", lambda s: None)
    err = fake.cuda.runtime.CUDARuntimeError

    def stopped(self):
        raise err("cudaErrorLaunchFailure: unspecified launch failure")
    monkeypatch.setattr(type(fake.zeros(1)), "get", stopped)
    assert probe.main(["--case", "late", "--bytes", "64K"]) == 1
    out = capsys.readouterr().out
    assert "late: control buffer at 0x" in out and "late: late buffer at 0x" in out
    assert out.count("the reader's kernel failed (cudaErrorLaunchFailure") == 2 and ": right" not in out, out
