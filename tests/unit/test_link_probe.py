"""benchmarks/link_probe.py without a GPU: its table says what each number is, and it refuses bad
sizes and a machine without CuPy or GPUs with what it needs instead of a traceback."""
from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import link_probe  # noqa: E402


def test_table_says_what_each_number_is():
    rows = [dict(engine="ce", direction="pull", peers=3, how="3 stream(s)", time_us=2500.0, gbps=322.1, spread=0.02),
            dict(engine="sm", direction="push", peers=1, how="serial, 132 blocks", time_us=900.0, gbps=298.3, spread=0.0)]
    text = link_probe.table(rows, 4, "NVIDIA H200", 256 << 20)
    assert "4 x NVIDIA H200, 256 MiB per peer" in text and "measured" in text
    assert "per GPU (GB/s, k x bytes / time)" in text and "median time (us)" in text
    assert "| ce | pull | 3 | 3 stream(s) | 2500.0 | 322.1 | 2% |" in text
    assert "| sm | push | 1 | serial, 132 blocks | 900.0 | 298.3 | 0% |" in text


@pytest.mark.parametrize("args,says", [(["--bytes", "100"], "at least 4K"), (["--bytes", "1x"], "--bytes"),
                                       (["--runs", "0"], "--runs"), (["--engines", "dma"], "--engines"),
                                       (["--engines", ","], "--engines")])
def test_bad_arguments_are_refused(args, says):
    r = subprocess.run([sys.executable, str(BENCHMARKS / "link_probe.py"), *args], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed here")
def test_without_cupy_it_says_what_it_needs():
    r = subprocess.run([sys.executable, str(BENCHMARKS / "link_probe.py")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "needs CuPy" in r.stderr and "Traceback" not in r.stderr


class _FakeCupy:
    """Just enough of CuPy for link_probe.run on the host: arrays are numpy arrays whose
    ``data.ptr`` is their address, a peer copy or a kernel is a memmove, every event 1 ms apart."""

    def __init__(self, n: int, broken: str = ""):
        import ctypes
        import types

        import numpy as np

        class Arr(np.ndarray):
            @property
            def data(self):
                return types.SimpleNamespace(ptr=self.ctypes.data)

            def get(self):
                return np.asarray(self)

        def wrap(a):
            return np.asarray(a).view(Arr)

        def move(dst, src, nbytes):
            ctypes.memmove(int(dst), int(src), int(nbytes))

        def function(name):
            def launch(grid, block, args, stream=None):
                if name == broken:
                    return  # writes nothing: the probe's check must say so
                if name == "tma_push":
                    src, dsts, k, nbytes, _ = args
                    for d in range(int(k)):
                        move(dsts[d], src.ctypes.data, nbytes)
                else:
                    dsts, srcs, k, nvec, _ = args
                    for d in range(int(k)):
                        move(dsts[d], srcs[d], int(nvec) * 16)
            return launch

        class Event:
            clock = 0.0

            def record(self, stream=None):
                Event.clock += 1.0
                self.t = Event.clock

        self.float32, self.uint64 = np.float32, np.uint64
        self.int32, self.int64 = np.int32, np.int64
        self.full = lambda shape, value, dtype: wrap(np.full(shape, value, dtype))
        self.zeros = lambda shape, dtype: wrap(np.zeros(shape, dtype))
        self.array = lambda values, dtype: wrap(np.array(values, dtype))
        self.unique = lambda a: wrap(np.unique(a))
        self.RawModule = lambda code, options=(): types.SimpleNamespace(get_function=function)
        pinned = {}

        def host_alloc(nbytes, flags):
            buf = ctypes.create_string_buffer(nbytes)
            pinned[ctypes.addressof(buf)] = buf
            return ctypes.addressof(buf)

        def memcpy(dst, src, nbytes, kind, stream):
            if {1: "h2d", 2: "d2h"}[kind] != broken:
                move(dst, src, nbytes)

        self.pinned = pinned
        runtime = types.SimpleNamespace(
            hostAlloc=host_alloc, freeHost=lambda ptr: pinned.pop(ptr), memcpyAsync=memcpy,
            getDeviceCount=lambda: n, CUDARuntimeError=RuntimeError,
            getDeviceProperties=lambda g: {"name": b"Fake GPU", "multiProcessorCount": 4},
            deviceEnablePeerAccess=lambda p: None, deviceSynchronize=lambda: None,
            memcpyPeerAsync=lambda dst, ddev, src, sdev, nbytes, stream: move(dst, src, nbytes))
        self.cuda = types.SimpleNamespace(runtime=runtime, Device=lambda g: contextlib.nullcontext(), Event=Event,
                                          Stream=lambda non_blocking=True: types.SimpleNamespace(ptr=0),
                                          get_elapsed_time=lambda e0, e1: e1.t - e0.t)


def test_run_moves_and_checks_every_pattern_with_a_fake_cupy(monkeypatch):
    """run() on the host through a stand-in for CuPy: every engine's patterns become rows, and
    each pattern's bytes are checked (they land here because a copy is a memmove)."""
    monkeypatch.setitem(sys.modules, "cupy", _FakeCupy(3))
    rows, n, kind = link_probe.run(64 << 10, 2, ["ce", "sm", "tma"])
    assert n == 3 and kind == "Fake GPU"
    engines = [r["engine"] for r in rows]
    # ce: pull and push, k = 1 (one stream) and 2 (one or two streams); sm: push and pull, 2 grids,
    # k = 1 serial and 2 serial / spread; tma: k = 1, k = 2 serial / spread
    assert engines.count("ce") == 6 and engines.count("sm") == 12 and engines.count("tma") == 3
    assert all(r["runs"] == 2 and r["gbps"] > 0 for r in rows)


def test_mix_splits_each_peers_bytes_between_the_engines(monkeypatch):
    """The mix engine: k = 1 and n - 1 peers, each at 0-100% on copy engines (the rest by the
    kernel), every byte checked; a kernel that writes nothing is named at its first pattern."""
    monkeypatch.setitem(sys.modules, "cupy", _FakeCupy(3))
    rows, n, _ = link_probe.run(64 << 10, 2, ["mix"])
    hows = [(r["engine"], r["peers"], r["how"].split(" on copy")[0]) for r in rows]
    assert hows == [("ce+sm", k, share) for k in (1, 2) for share in ("0%", "25%", "50%", "75%", "100%")]
    assert all(r["gbps"] > 0 and r["direction"] == "push" for r in rows)
    assert link_probe._ce_bytes(64 << 10, 0.25) == 16 << 10 and link_probe._ce_bytes(100, 0.5) % 16 == 0
    monkeypatch.setitem(sys.modules, "cupy", _FakeCupy(3, broken="push_peers"))
    with pytest.raises(SystemExit, match=r"ce\+sm push k=1 0% on copy engines .*: GPU 0's slot for GPU 2 holds \[0.0\]"):
        link_probe.run(64 << 10, 1, ["mix"])


@pytest.mark.parametrize("broken,engine", [("tma_push", "tma"), ("pull_peers", "sm"), ("push_peers", "sm")])
def test_an_engine_whose_bytes_do_not_land_is_named(monkeypatch, broken, engine):
    monkeypatch.setitem(sys.modules, "cupy", _FakeCupy(3, broken=broken))
    with pytest.raises(SystemExit, match=f"{engine} (push|pull) k=1 .*: GPU 0's slot for GPU [12] holds \\[0.0\\]"):
        link_probe.run(64 << 10, 1, ["sm", "tma"])


def test_host_copies_beside_the_peers_are_timed_and_checked(monkeypatch):
    """The host engine: each direction and both, with 1 .. n GPUs at once, then both beside pushes
    to every peer (a row for each kind of copy); the pinned buffers are freed at the end."""
    fake = _FakeCupy(3)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    rows, n, _ = link_probe.run(64 << 10, 2, ["host"])
    hows = [(r["engine"], r["direction"], r["peers"], r["how"]) for r in rows]
    for gpus in (1, 2, 3):
        assert ("host", "d2h", 1, f"{gpus} GPU(s) at once") in hows
        assert ("host", "h2d", 1, f"{gpus} GPU(s) at once") in hows
        assert ("host", "d2h", 1, f"{gpus} GPU(s) at once, both ways") in hows
    assert ("host", "h2d", 1, "3 GPU(s) at once, both ways, beside pushes to 2 peers") in hows
    assert ("ce", "push", 2, "3 GPU(s) at once, beside host copies both ways") in hows
    assert ("ce", "push", 2, "3 GPU(s) at once, no host copies, timed like the row beside them") in hows
    assert len(rows) == 3 * 4 + 1 + 3 and all(r["gbps"] > 0 for r in rows)
    assert not fake.pinned
    # A GPU's pushes to its 2 peers, each on its own stream, are timed from the first one's start to
    # the last one's end (the fake clock ticks 1 ms per event: start, end, start, end), not as the
    # longest single stream (1 ms), which would miss pushes that run one after another.
    time = {(r["engine"], r["how"]): r["time_us"] for r in rows}
    assert time[("ce", "3 GPU(s) at once, no host copies, timed like the row beside them")] == pytest.approx(3000)
    assert time[("host", "1 GPU(s) at once")] == pytest.approx(1000)


@pytest.mark.parametrize("broken,says", [("d2h", "GPU 0's pinned copy holds \\[0.0\\], not only 1"),
                                         ("h2d", "GPU 0's copy from the host does not hold only 100")])
def test_a_host_copy_that_does_not_land_is_named(monkeypatch, broken, says):
    monkeypatch.setitem(sys.modules, "cupy", _FakeCupy(2, broken=broken))
    with pytest.raises(SystemExit, match=says):
        link_probe.run(64 << 10, 1, ["host"])
