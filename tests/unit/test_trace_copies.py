"""How a profile's peer copies ran (jax_blink/tools/trace_copies.py) on synthetic traces: checked
against a brute-force count over a microsecond grid, on fresh random events."""
import numpy as np
import pytest

from jax_blink.tools import trace_copies


def _trace(rng, gpus: int = 2):
    events = [{"ph": "M", "name": "process_name", "pid": 100 + g, "args": {"name": f"/device:GPU:{g}"}}
              for g in range(gpus)]
    events.append({"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}})
    for pid in [100 + g for g in range(gpus)] + [1]:
        for _ in range(60):
            ts, dur = int(rng.integers(0, 2000)), int(rng.integers(1, 150))
            name = rng.choice(["MemcpyP2P", "MemcpyD2D", "void jax_blink::cuda::reduce_terms_kernel<float>(Args)",
                               "fusion_3", "MemcpyP2P"])
            events.append({"ph": "X", "pid": pid, "tid": int(rng.integers(0, 4)), "ts": ts, "dur": dur,
                           "name": str(name), "args": {"memcpy_details": f"kind_src:device size:{dur * 1000} dest:1"}})
    return {"traceEvents": events}


def _brute(trace, pid):
    at_once, red, seen = np.zeros(3000, int), np.zeros(3000, bool), np.zeros(3000, bool)
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or e["pid"] != pid:
            continue
        sl = slice(e["ts"], e["ts"] + e["dur"])
        seen[sl] = True
        if e["name"] == "MemcpyP2P":
            at_once[sl] += 1
        elif "reduce_terms_kernel" in e["name"]:
            red[sl] = True
    span = np.flatnonzero(seen)
    return (at_once > 0).sum(), at_once.sum(), red.sum(), span[-1] + 1 - span[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_summary_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    trace = _trace(rng)
    got = trace_copies.summarize(trace)["devices"]
    assert set(got) == {"/device:GPU:0", "/device:GPU:1"}  # the host's events are not a GPU's
    for g in range(2):
        d = got[f"/device:GPU:{g}"]
        busy, total, red, span = _brute(trace, 100 + g)
        assert d["copy_busy_us"] == busy and d["copy_sum_us"] == total and d["reduce_busy_us"] == red
        assert d["span_us"] == span and d["at_once"] == pytest.approx(total / busy)
        assert d["bytes"] == total * 1000 and d["gbps_busy"] == pytest.approx(total * 1000 / busy / 1e3)
        assert d["copies"] == sum(1 for e in trace["traceEvents"] if e.get("pid") == 100 + g and e.get("name") == "MemcpyP2P")
    text = trace_copies.describe({"devices": got})
    assert text.count("/device:GPU:") == 2 and "measured" in text and "at once on average" in text


def test_a_trace_without_peer_copies_says_so():
    trace = {"traceEvents": [{"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
                             {"ph": "X", "pid": 7, "ts": 0, "dur": 5, "name": "fusion_1"}]}
    summary = trace_copies.summarize(trace)
    assert summary == {"devices": {}} and "no peer copy" in trace_copies.describe(summary)
