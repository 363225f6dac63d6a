"""Run-time chunk tuning: the MIAD search on synthetic curves, the per-size-class cache, and
``config.chunk_bytes = "auto"`` reading it at trace time."""
import contextlib
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_blink
from jax_blink.tools import autotune
from jax_blink.lowering import chunk_cache
from jax_blink.planning.schedule import DEFAULT_CHUNK_BYTES


# --------------------------------------------------------------------------------------------
# miad, pure


def _unimodal(peak: float, left: float, right: float):
    """Strictly rising up to ``peak`` and strictly falling after it, in log space, with a different
    width on each side (so that the search path is not symmetric)."""
    def f(c):
        d = math.log2(c) - math.log2(peak)
        return -(d / left) ** 2 if d < 0 else -(d / right) ** 2
    return f


class _Counting:
    def __init__(self, f):
        self.f, self.calls = f, []

    def __call__(self, c):
        self.calls.append(c)
        return self.f(c)


def _check_invariants(res, calls, lo, hi, max_trials):
    assert len(calls) == len(set(calls)), f"measured twice: {calls}"
    assert [c for c, _ in res.log] == calls  # the log is every measurement, in order
    assert 1 <= len(res.log) <= max_trials
    assert all(c % 16 == 0 and lo <= c <= hi for c in calls), calls
    assert res.throughput == max(t for _, t in res.log)
    assert (res.chunk_bytes, res.throughput) in res.log


@settings(max_examples=200, deadline=None)
@given(lo_units=st.integers(1, 4096), span=st.floats(1, 2**18), peak_at=st.floats(0, 1),
       start_at=st.floats(0, 1), left=st.floats(0.05, 8), right=st.floats(0.05, 8),
       grow=st.sampled_from([2, 3, 1.5, 4]))
def test_miad_finds_the_peak_of_a_unimodal_curve(lo_units, span, peak_at, start_at, left, right, grow):
    lo = 16 * lo_units
    hi = 16 * max(lo_units, int(lo_units * span))
    peak = lo * (hi / lo) ** peak_at
    start = int(lo * (hi / lo) ** start_at)
    measure = _Counting(_unimodal(peak, left, right))
    res = autotune.miad(measure, start, lo=lo, hi=hi, grow=grow, max_trials=1000)
    _check_invariants(res, measure.calls, lo, hi, 1000)
    b = res.chunk_bytes
    # Within one multiplicative step of the peak (the increase stopped on either side of it), or
    # within one additive step (the decrease stopped on either side of it); 16 bytes of rounding.
    assert peak / grow - 16 <= b <= peak * grow + 16 or abs(b - peak) <= res.backoff + 16, (b, peak, res)


@settings(max_examples=100, deadline=None)
@given(start=st.integers(1, 1 << 26), max_trials=st.integers(1, 12),
       rising=st.booleans(), grow=st.sampled_from([2, 1.5]))
def test_miad_bounds_trials_and_monotone_curves(start, max_trials, rising, grow):
    lo, hi = 4096, 16 << 20
    measure = _Counting((lambda c: c) if rising else (lambda c: -c))
    res = autotune.miad(measure, start, lo=lo, hi=hi, grow=grow, max_trials=max_trials)
    _check_invariants(res, measure.calls, lo, hi, max_trials)
    # Rising throughout: ends at the upper bound, unless out of trials first (then it only grew).
    if rising and len(res.log) < max_trials:
        assert res.chunk_bytes == hi
    if rising:  # the best is the largest chunk tried; only the last trial (a step down) may be smaller
        chunks = [c for c, _ in res.log]
        assert res.chunk_bytes == max(chunks) and chunks[:-1] == sorted(chunks[:-1])
    if not rising and len(res.log) < max_trials:
        assert res.chunk_bytes == lo


def test_miad_start_is_clamped_and_aligned():
    res = autotune.miad(lambda c: -abs(c - 5000), 1 << 40, lo=1000, hi=100_000)
    assert res.log[0][0] == 100_000 // 16 * 16
    res = autotune.miad(lambda c: 1.0, 3, lo=1000, hi=100_000)  # flat: one step up, one down
    assert res.log[0][0] == 1008 and res.chunk_bytes == 1008 and len(res.log) == 2
    with pytest.raises(ValueError, match="16-byte"):
        autotune.miad(lambda c: 1.0, 100, lo=100, hi=110)
    with pytest.raises(ValueError, match="grow"):
        autotune.miad(lambda c: 1.0, 100, lo=16, hi=1 << 20, grow=1)


def test_miad_with_noise_and_failures_does_not_crash():
    rng = np.random.default_rng(0)
    f = _unimodal(1 << 20, 2, 2)
    for i in range(30):
        measure = _Counting(lambda c: f(c) + rng.normal(0, 0.5) if rng.random() > 0.2 else float("nan"))
        res = autotune.miad(measure, int(rng.integers(16, 1 << 24)), lo=4096, hi=16 << 20)
        assert len(res.log) <= 12 and len(set(measure.calls)) == len(measure.calls)
        assert 4096 <= res.chunk_bytes <= 16 << 20
        finite = [t for _, t in res.log if t == t]
        assert res.throughput == max(finite) if finite else math.isnan(res.throughput)


def test_miad_additive_decrease_uses_the_given_backoff():
    # Peak at 40K, start at 64K: the first doubling loses, then 64K - 8K steps down to 40K.
    measure = _Counting(lambda c: -abs(c - 40 * 1024))
    res = autotune.miad(measure, 64 * 1024, lo=4096, hi=1 << 20, backoff=8 * 1024, max_trials=20)
    assert [c // 1024 for c, _ in res.log] == [64, 128, 56, 48, 40, 32]
    assert res.chunk_bytes == 40 * 1024 and res.backoff == 8 * 1024


# --------------------------------------------------------------------------------------------
# The cache


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "chunks.json"
    monkeypatch.setenv(chunk_cache.CACHE_ENV, str(path))
    chunk_cache.reload()
    yield path
    chunk_cache.reload()


def test_cache_round_trip_through_the_file(cache):
    assert chunk_cache.lookup("cpu", 4, "allreduce", "float32", 4096) is None
    chunk_cache.store("cpu", 4, "allreduce", jnp.float32, 4096, 8192)
    chunk_cache.store("cpu", 4, "allgather", "bfloat16", 1 << 20, 65536)
    assert chunk_cache.lookup("cpu", 4, "allreduce", "float32", 4096) == 8192
    assert chunk_cache.lookup("cpu", 4, "allreduce", "float32", 8191) == 8192  # same size class
    assert chunk_cache.lookup("cpu", 4, "allreduce", "float32", 8192) is None  # the next class
    assert chunk_cache.lookup("cpu", 2, "allreduce", "float32", 4096) is None
    assert chunk_cache.lookup("gpu", 4, "allreduce", "float32", 4096) is None
    assert chunk_cache.lookup("cpu", 4, "allreduce", "bfloat16", 4096) is None
    doc = json.loads(cache.read_text())
    assert len(doc["entries"]) == 2
    assert not list(cache.parent.glob(".chunks-*"))  # the temporary file was renamed, not left
    chunk_cache.reload()  # from the file alone
    assert chunk_cache.lookup("cpu", 4, "allgather", "bfloat16", (1 << 20) + 5) == 65536
    # Another process's entry in the file survives our next store.
    doc["entries"].append(dict(device_kind="x", nranks=2, collective="reduce", dtype="float32",
                               size_class=3, chunk_bytes=32))
    cache.write_text(json.dumps(doc))
    chunk_cache.store("cpu", 4, "allreduce", "float32", 4096, 16384)
    assert chunk_cache.lookup("x", 2, "reduce", "float32", 4) == 32
    assert chunk_cache.lookup("cpu", 4, "allreduce", "float32", 4096) == 16384


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"entries": 5}',
                                  '{"entries": [{"device_kind": "cpu"}, 7]}'])
def test_corrupt_cache_is_empty(cache, text):
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(text)
    with pytest.warns(RuntimeWarning) if text.startswith("{not") else contextlib.nullcontext():
        assert chunk_cache.lookup("cpu", 4, "allreduce", "float32", 4096) is None
        chunk_cache.store("cpu", 4, "allreduce", "float32", 4096, 4096)  # and it can be overwritten
    chunk_cache.reload()
    assert chunk_cache.lookup("cpu", 4, "allreduce", "float32", 4096) == 4096


# --------------------------------------------------------------------------------------------
# "auto" at trace time, and tune_chunk on the real executor

DEVICES = jax.devices()
needs_devices = pytest.mark.skipif(len(DEVICES) < 2, reason="needs 2+ devices")


@pytest.fixture
def config(monkeypatch):
    monkeypatch.setattr(jax_blink.config, "dispatch", "blink")
    monkeypatch.setattr(jax_blink.config, "chunk_bytes", "auto")
    return jax_blink.config


def _lowered_chunks(fn, mesh, x) -> list[int]:
    """The chunk (program header word 3, in elements) of every jax_blink call in the lowered program."""
    body = jax.shard_map(lambda v: fn(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    text = jax.jit(body).lower(x).as_text()
    out = []
    for m in re.findall(r'program = dense<([^>]*)>', text):
        if m.startswith('"0x'):  # MLIR prints larger arrays as little-endian hex
            out.append(int(np.frombuffer(bytes.fromhex(m[3:-1]), "<i4")[3]))
        else:
            out.append(int(m.strip("[]").split(",")[3]))
    return out


@needs_devices
def test_auto_uses_the_tuned_chunk_else_the_default(cache, config):
    n = min(4, len(DEVICES))
    mesh = jax.make_mesh((n,), ("x",), devices=DEVICES[:n])
    x = jax.device_put(jnp.zeros((n * 64 * 1024,), jnp.float32), NamedSharding(mesh, P("x")))
    per_rank = 64 * 1024 * 4  # 256 KiB: below the default chunk, so the default is the operand
    allreduce = lambda v, a: jax_blink.all_reduce(v, a)  # noqa: E731
    (default,) = _lowered_chunks(allreduce, mesh, x)
    config.chunk_bytes = None
    assert _lowered_chunks(allreduce, mesh, x) == [default]
    config.chunk_bytes = "auto"
    chunk_cache.store("cpu-not-this", n, "allreduce", "float32", per_rank, 4096)  # another device kind
    chunk_cache.store(DEVICES[0].device_kind, n, "allreduce", "float32", per_rank // 2, 4096)  # class
    assert _lowered_chunks(allreduce, mesh, x) == [default]
    chunk_cache.store(DEVICES[0].device_kind, n, "allreduce", "float32", per_rank, 4096)
    assert _lowered_chunks(allreduce, mesh, x) == [4096 // 4]
    assert default != 4096 // 4
    # explain() says the same, for the device kind it is given.
    text = jax_blink.explain(jax_blink.Topology.host(n), per_rank, device_kind=DEVICES[0].device_kind)
    assert "chunks of 1024 elements (4096 bytes)" in text and "tuned chunk of 4096" in text
    text = jax_blink.explain(jax_blink.Topology.host(n), per_rank, device_kind="other")
    assert "nothing tuned" in text and "(4096 bytes)" not in text


@needs_devices
@pytest.mark.parametrize("collective,n", [("allreduce", 2), ("allgather", 4)])
def test_tune_chunk_measures_stores_and_auto_reads_it(cache, config, collective, n):
    n = min(n, len(DEVICES))
    mesh = jax.make_mesh((n,), ("x",), devices=DEVICES[:n])
    count = 2048  # 8 KiB per rank
    x = jax.device_put(jnp.ones((n * count,), jnp.float32), NamedSharding(mesh, P("x")))
    res = autotune.tune_chunk(collective, x, mesh, "x", k=2, runs=1, lo=1024)
    program_bytes = count * 4 * (n if collective == "allgather" else 1)
    assert 1024 <= res.chunk_bytes <= program_bytes and res.chunk_bytes % 16 == 0
    assert res.log and all(t > 0 for _, t in res.log) and len(res.log) <= 12
    assert res.log[0][0] == min(DEFAULT_CHUNK_BYTES, program_bytes)  # starts at the default
    assert cache.exists()
    assert chunk_cache.lookup(DEVICES[0].device_kind, n, collective, "float32", program_bytes) == res.chunk_bytes
    # "auto" at trace time finds that entry (the key tune_chunk stores is the one a call looks up).
    fn = {"allreduce": lambda v, a: jax_blink.all_reduce(v, a),
          "allgather": lambda v, a: jax_blink.all_gather(v, a, tiled=True)[: v.shape[0]]}[collective]
    chunks = _lowered_chunks(fn, mesh, x)
    assert chunks and all(c * 4 <= res.chunk_bytes for c in chunks)
    config.chunk_bytes = res.chunk_bytes
    assert _lowered_chunks(fn, mesh, x) == chunks
