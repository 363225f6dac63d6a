"""The tensor-parallel decoder (jax_blink/tools/decode/) on 8 CPU host devices: psum, jax_blink.all_reduce
and the psum program under the switch give the same bits (tokens, logits and KV cache) from fresh
random weights; the step without all-reduces does not; the benchmark's files on a tiny config."""
from __future__ import annotations

import csv
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_blink.tools.decode import bench, model
from jax_blink.tools.decode.__main__ import main

STEPS, BATCH = 3, 2


def _compile(cfg, mesh, variant, args, extra=0):
    with model.lowering_context(variant):
        return model.decode_program(cfg, mesh, variant, STEPS, extra).lower(*args).compile(
            compiler_options=dict(bench.STRICT_BF16, xla_backend_optimization_level=0))


def test_variants_equal_on_8_host_devices():
    seed = int(np.random.default_rng().integers(1 << 30))  # fresh weights, cache and tokens each run
    cfg = model.SIZES["tiny"]
    mesh = jax.make_mesh((8,), (model.AXIS,), devices=jax.devices()[:8])
    params = model.init_params(cfg, mesh, seed)
    rep = NamedSharding(mesh, P())
    rng = np.random.default_rng(seed)
    tokens = jax.device_put(jnp.asarray(rng.integers(0, cfg.vocab, BATCH), jnp.int32), rep)
    # Teacher-forced for two steps, then greedy: the last step feeds back its own argmax.
    forced = jax.device_put(jnp.asarray(np.r_[rng.integers(0, cfg.vocab, (STEPS - 1, BATCH)),
                                              -np.ones((1, BATCH))], jnp.int32), rep)
    pos = jax.device_put(jnp.int32(cfg.context // 2), rep)
    args = (params, *model.init_cache(cfg, mesh, BATCH, seed + 1), tokens, forced, pos)
    out = {}
    for variant in ("psum", "blink", "switch"):
        compiled = _compile(cfg, mesh, variant, args)
        text = compiled.as_text()
        calls = text.count('custom_call_target="jax_blink_collective')
        assert calls == (0 if variant == "psum" else 2), variant  # two sites in the layers' scan body
        cache = model.init_cache(cfg, mesh, BATCH, seed + 1)  # the call donates it: a fresh copy each
        out[variant] = [np.asarray(o.astype(jnp.float32)) for o in compiled(params, *cache, tokens, forced, pos)]
        if variant == "psum":  # other weights, the same program: the comparison below can fail
            cache = model.init_cache(cfg, mesh, BATCH, seed + 1)
            other = compiled(model.init_params(cfg, mesh, seed + 2), *cache, tokens, forced, pos)
            out["other weights"] = [np.asarray(o.astype(jnp.float32)) for o in other]
    ref = out["psum"]
    assert np.isfinite(ref[3]).all() and np.std(ref[3]) > 0.1  # real logits, not zeros
    for variant in ("blink", "switch"):
        for name, a, b in zip(("cache_k", "cache_v", "tokens", "logits"), out[variant], ref):
            np.testing.assert_array_equal(a, b, err_msg=f"{variant} {name} differs from psum's")
    assert not np.array_equal(out["other weights"][3], ref[3])
    assert bench.compare(ref[2:], out["other weights"][2:])["rel_rms"] > bench.REL_RMS_TOLERANCE


def test_sequence_layout_equals_the_all_reduce_layout_on_8_host_devices():
    """The sequence layout (each rank's rows of the residual stream; all-gathers and
    reduce-scatters instead of all-reduces) decodes the same bits as the all-reduce layout under
    psum, in every variant, from fresh random weights; jax_blink's calls replace the gathers and
    scatters (the last gather, typed as replicated for the LM head, stays lax's)."""
    seed = int(np.random.default_rng().integers(1 << 30))
    cfg = model.SIZES["tiny"]
    tp, batch = 4, 8
    mesh = jax.make_mesh((tp,), (model.AXIS,), devices=jax.devices()[:tp])
    params = model.init_params(cfg, mesh, seed)
    rep = NamedSharding(mesh, P())
    rng = np.random.default_rng(seed)
    tokens = jax.device_put(jnp.asarray(rng.integers(0, cfg.vocab, batch), jnp.int32), rep)
    forced = jax.device_put(jnp.asarray(rng.integers(0, cfg.vocab, (STEPS, batch)), jnp.int32), rep)
    pos = jax.device_put(jnp.int32(cfg.context // 2), rep)
    out = {}
    for layout, variant in (("allreduce", "psum"), ("sequence", "psum"), ("sequence", "blink"),
                            ("sequence", "switch")):
        args = (params, *model.init_cache(cfg, mesh, batch, seed + 1), tokens, forced, pos)
        with model.lowering_context(variant):
            compiled = model.decode_program(cfg, mesh, variant, STEPS, 1, layout).lower(*args).compile(
                compiler_options=dict(bench.STRICT_BF16, xla_backend_optimization_level=0))
        text = compiled.as_text()
        if (layout, variant) == ("sequence", "blink"):  # 3 gathers and 3 scatters per layer (1 extra pair)
            assert text.count('custom_call_target="jax_blink_collective') == 6
        out[layout, variant] = [np.asarray(o.astype(jnp.float32)) for o in compiled(*args)]
    ref = out["allreduce", "psum"]
    assert np.isfinite(ref[3]).all() and np.std(ref[3]) > 0.1
    for key, got in out.items():
        for name, a, b in zip(("cache_k", "cache_v", "tokens", "logits"), got, ref):
            np.testing.assert_array_equal(a, b, err_msg=f"{key} {name} differs from the all-reduce layout's")


def test_demand_and_verdict():
    assert bench.demand("cpu", 8, True, "blink") == "bitwise"
    assert bench.demand("gpu", 2, True, "switch") == "bitwise"
    assert bench.demand("gpu", 4, True, "blink") == "tolerance"  # NCCL rounds after each hop
    assert bench.demand("gpu", 4, True, "psum+extra") == "bitwise"
    assert bench.demand("cpu", 8, False, "blink") == "tolerance"
    r = {"bitwise": False, "rel_rms": 2 * bench.REL_RMS_TOLERANCE}
    assert bench.verdict(r, "tolerance").startswith("FAILED")
    assert bench.verdict(dict(r, rel_rms=0.0), "bitwise").startswith("FAILED")
    assert bench.verdict(dict(r, rel_rms=0.0), "tolerance").startswith("ok")


def test_bench_files_on_cpu(tmp_path, capsys):
    rc = main(["--size", "tiny", "--layers", "1", "--context", "8", "--tp", "2", "--batch", "1",
               "--steps", "1", "--variants", "psum,none", "--extra", "1", "--rounds", "2", "--min-time", "0",
               "--strict-bf16", "--quick-compile", "-o", str(tmp_path)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "checks against psum: all ok" in printed
    stem = next(tmp_path.glob("decode-tiny-cpu-tp2-*.json")).with_suffix("")
    record = json.loads(stem.with_suffix(".json").read_text())
    for key in ("device_kind", "date", "jax", "platform", "config", "measured"):
        assert key in record["meta"], key
    with open(stem.with_suffix(".csv")) as f:
        rows = {r["variant"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"psum", "none", "psum+extra"}
    psum = rows["psum"]
    t = float(psum["call_ms"])
    assert float(psum["tokens_per_s"]) == pytest.approx(1 / (t / 1e3))  # batch 1, 1 step per call
    assert float(psum["allreduce_share"]) == pytest.approx((t - float(rows["none"]["call_ms"])) / t)
    marginal = (float(rows["psum+extra"]["call_ms"]) - t) * 1e3 / 1  # 1 step, 1 extra, 1 layer
    assert float(psum["marginal_us_per_allreduce"]) == pytest.approx(marginal)
    assert psum["allreduce_bytes"] == str(1 * 128 * 2)
    assert stem.with_suffix(".png").stat().st_size > 0 and stem.with_suffix(".txt").read_text().startswith(
        "python -m jax_blink.tools.decode")


def test_bench_files_of_the_sequence_layout(tmp_path, capsys):
    rc = main(["--size", "tiny", "--layers", "1", "--context", "8", "--tp", "2", "--batch", "2", "--layout",
               "sequence", "--steps", "1", "--variants", "psum,blink,none", "--extra", "1", "--rounds", "2",
               "--min-time", "0", "--strict-bf16", "--quick-compile", "-o", str(tmp_path)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "sequence layout: all-gather 256 B per rank, 3 per step, and reduce-scatter 512 B per rank" in printed
    assert "AG+RS share" in printed and "checks against psum: all ok" in printed
    stem = next(tmp_path.glob("decode-tiny-cpu-tp2-sequence-*.json")).with_suffix("")
    assert json.loads(stem.with_suffix(".json").read_text())["meta"]["layout"] == "sequence"
    with open(stem.with_suffix(".csv")) as f:
        rows = {r["variant"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"psum", "blink", "none", "psum+extra", "blink+extra"}
    blink = rows["blink"]
    assert blink["layout"] == "sequence" and blink["allreduce_bytes"] == "" and blink["allreduces_per_step"] == "0"
    assert blink["allgather_bytes"] == str(1 * 128 * 2) and blink["reducescatter_bytes"] == str(2 * 128 * 2)
    assert blink["allgathers_per_step"] == "3" and blink["reducescatters_per_step"] == "2"


def test_bad_input_is_one_line(capsys):
    assert main(["--tp", "64", "--no-write"]) == 2
    assert main(["--variants", "blink", "--no-write"]) == 2
    assert main(["--size", "tiny", "--tp", "3", "--no-write"]) == 2  # 16 heads cannot split over 3
    assert main(["--layout", "sequence", "--tp", "4", "--batch", "1,4", "--no-write"]) == 2  # 1 row over 4 ranks
    assert main(["--layout", "rows", "--no-write"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 5 and all(line.startswith("python -m jax_blink.tools.decode: error:") for line in err)
    assert "--batch 1 is not a multiple of --tp 4" in err[3]


def test_the_switch_must_match_the_explicit_calls_bitwise_on_cpu_only():
    from jax_blink.tools.decode.bench import switch_verdict
    ok = "ok (rel. RMS 1.36e-02 <= 0.05)"
    assert switch_verdict(ok, True, "cpu") == ok and switch_verdict(ok, True, "gpu") == ok
    assert switch_verdict(ok, False, "cpu") == "FAILED (switch differs from blink's program)"
    gpu = switch_verdict(ok, False, "gpu")
    assert gpu.startswith(ok) and "bits differ from blink's program" in gpu
    assert switch_verdict("FAILED (rel. RMS 9.00e-02 > 0.05)", False, "gpu").startswith("FAILED")
