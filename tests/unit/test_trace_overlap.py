"""The overlap figure of a profile (jax_blink/tools/trace_overlap.py) on synthetic traces: checked
against a brute-force count over a microsecond grid, on fresh random kernels."""
import gzip
import json

import numpy as np
import pytest

from jax_blink.tools import trace_overlap


def _trace(rng, gpus: int = 2):
    events = [{"ph": "M", "name": "process_name", "pid": 100 + g, "args": {"name": f"/device:GPU:{g}"}}
              for g in range(gpus)]
    events.append({"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}})
    for pid in [100 + g for g in range(gpus)] + [1]:
        for _ in range(40):
            ts, dur = int(rng.integers(0, 2000)), int(rng.integers(1, 120))
            name = rng.choice(["void jax_blink::cuda::collective_kernel<float, 0>(Params)", "ll_kernel",
                               "fusion_12", "cutlass_80_gemm", "MemcpyD2D", "loop_add_fusion",
                               "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"])
            events.append({"ph": "X", "pid": pid, "tid": int(rng.integers(0, 3)), "ts": ts, "dur": dur,
                           "name": str(name)})
    return {"traceEvents": events}


def _brute(trace, pid):
    ours, comp = np.zeros(3000, bool), np.zeros(3000, bool)
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or e["pid"] != pid:
            continue
        sl = slice(e["ts"], e["ts"] + e["dur"])
        if trace_overlap.OUR_KERNELS.search(e["name"]):
            ours[sl] = True
        elif not e["name"].startswith(("Memcpy", "nccl")):
            comp[sl] = True
    return ours.sum(), (ours & comp).sum(), comp.sum()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_overlap_matches_brute_force(seed, tmp_path):
    rng = np.random.default_rng(seed)
    trace = _trace(rng)
    path = tmp_path / "t.trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps(trace).encode()))
    s = trace_overlap.summarize(trace_overlap.load(path))
    assert set(s["devices"]) == {"/device:GPU:0", "/device:GPU:1"}  # the host process is left out
    tot_ours = tot_beside = tot_compute = 0
    for g in range(2):
        ours, beside, compute = _brute(trace, 100 + g)
        tot_compute += compute
        d = s["devices"][f"/device:GPU:{g}"]
        assert d["ours_us"] == pytest.approx(ours) and d["beside_us"] == pytest.approx(beside)
        tot_ours, tot_beside = tot_ours + ours, tot_beside + beside
    assert s["overlap"] == pytest.approx(tot_beside / tot_ours)
    assert 0.0 < s["overlap"] < 1.0
    # Compute: neither ours, nor copies, nor NCCL's kernels; the mean over the two GPUs.
    assert s["compute_us_per_gpu"] == pytest.approx(tot_compute / 2)
    assert "overlap" in trace_overlap.describe(s)


def test_serial_and_parallel_extremes():
    serial = {"traceEvents": [{"ph": "X", "pid": 0, "ts": 0, "dur": 10, "name": "fusion"},
                              {"ph": "X", "pid": 0, "ts": 10, "dur": 5, "name": "oneshot_kernel"}]}
    beside = {"traceEvents": [{"ph": "X", "pid": 0, "ts": 0, "dur": 10, "name": "fusion"},
                              {"ph": "X", "pid": 0, "ts": 2, "dur": 5, "name": "oneshot_kernel"}]}
    assert trace_overlap.summarize(serial)["overlap"] == 0.0
    assert trace_overlap.summarize(beside)["overlap"] == 1.0
    assert trace_overlap.summarize({"traceEvents": []})["overlap"] is None
    # The GPUs' span: first event of any GPU to the last one's end, whatever ran; none where no
    # process is named as a GPU (a CPU run's trace holds the host's Python frames).
    assert trace_overlap.summarize(serial)["span_us"] == 0.0
    assert "GPU span" not in trace_overlap.describe(trace_overlap.summarize(serial))
    named = {"traceEvents": [{"ph": "M", "name": "process_name", "pid": p, "args": {"name": n}}
                             for p, n in ((0, "/device:GPU:0"), (1, "/device:GPU:1"), (2, "/host:CPU"))]
             + [{"ph": "X", "pid": 0, "ts": 3, "dur": 10, "name": "fusion"},
                {"ph": "X", "pid": 1, "ts": 5, "dur": 12, "name": "oneshot_kernel"},
                {"ph": "X", "pid": 2, "ts": 0, "dur": 50, "name": "PjitFunction"}]}
    assert trace_overlap.summarize(named)["span_us"] == 14.0
    assert "GPU span 0.014 ms" in trace_overlap.describe(trace_overlap.summarize(named))
    with pytest.raises(ValueError, match="not a Chrome trace"):
        p = __import__("pathlib").Path(__import__("tempfile").mkdtemp()) / "x.json"
        p.write_text("{}")
        trace_overlap.load(p)


def test_timeline_png(tmp_path):
    pytest.importorskip("matplotlib")
    trace = _trace(np.random.default_rng(5))
    out = tmp_path / "timeline.png"
    trace_overlap.timeline_png(trace, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_copy_engine_form_counts_as_ours():
    """JAX_BLINK_ASYNC_ENGINE=ce: its peer copies (MemcpyP2P) and its reduction kernel are jax_blink's
    work; other copies are neither ours nor compute."""
    ev = [{"ph": "X", "pid": 0, "ts": 0, "dur": 100, "name": "fusion_3"},
          {"ph": "X", "pid": 0, "ts": 20, "dur": 30, "name": "MemcpyP2P"},
          {"ph": "X", "pid": 0, "ts": 90, "dur": 20,
           "name": "void jax_blink::cuda::(anonymous namespace)::reduce_terms_kernel<jax_blink::cuda::EF32>(ReduceTermsArgs)"},
          {"ph": "X", "pid": 0, "ts": 200, "dur": 50, "name": "MemcpyD2D"}]
    s = trace_overlap.summarize({"traceEvents": ev})
    d = s["devices"]["0"]
    assert d["ours_us"] == pytest.approx(50) and d["beside_us"] == pytest.approx(40)
    assert d["compute_us"] == pytest.approx(100) and d["our_kernels"] == 2


def test_kernel_table_by_kind_and_the_comparison():
    """Kernels group by their name less XLA's numbers, on the first GPU only; the comparison puts the
    kinds that changed most first, with their counts."""
    def x(pid, name, ts, dur):
        return {"ph": "X", "pid": pid, "name": name, "ts": ts, "dur": dur}
    meta = [{"ph": "M", "name": "process_name", "pid": p, "args": {"name": n}}
            for p, n in ((1, "/device:GPU:0"), (2, "/device:GPU:1"), (3, "/host:CPU"))]
    base = {"traceEvents": meta + [x(1, "loop_add_fusion_1", 0, 10), x(1, "gemm", 10, 100), x(2, "gemm", 0, 999),
                                   x(3, "gemm", 0, 999)]}
    slow = {"traceEvents": meta + [x(1, "loop_add_fusion_1", 0, 10), x(1, "loop_add_fusion.7", 10, 30),
                                   x(1, "gemm", 40, 100), x(1, "gemm", 140, 5), x(1, "input_reduce_fusion", 145, 1)]}
    assert trace_overlap.kernel_kind("input_add_reduce_fusion.3.1") == "input_add_reduce_fusion"
    assert trace_overlap.kernel_table(base) == {"loop_add_fusion": (1, 10.0), "gemm": (1, 100.0)}
    assert trace_overlap.kernel_table(base, "/device:GPU:1") == {"gemm": (1, 999.0)}
    text = trace_overlap.compare_tables(trace_overlap.kernel_table(slow), trace_overlap.kernel_table(base), top=2)
    lines = text.splitlines()
    assert "0.146 ms in all (0.110 ms in the base, +0.036 ms)" in lines[0]
    assert lines[1].split()[:2] == ["+0.030", "ms"] and lines[1].endswith("(+1)  loop_add_fusion")
    assert lines[2].split()[:2] == ["+0.005", "ms"] and lines[2].endswith("(+1)  gemm")
    assert len(lines) == 3
