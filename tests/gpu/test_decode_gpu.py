"""The tensor-parallel decoder (jax_blink/tools/decode/) on GPUs: the benchmark's smallest case (tiny shape,
tp = 2, batch 1) runs every variant, and jax_blink's variants agree with psum's: bitwise at 2 GPUs
(compiled with xla_allow_excess_precision=false; NCCL's 2-rank sum and jax_blink's float32 sum both
round once), within the tolerance at 4 (NCCL rounds to bfloat16 after each hop of its ring).
Needs 2+ GPUs and the CUDA executor."""
from __future__ import annotations

import json

import pytest

import jax_blink
from jax_blink.tools.decode.__main__ import main
from conftest import gpu_devices as _gpus  # tests/conftest.py: the GPUs jax lists, or none

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("tp", [2, 4])
def test_smallest_case_agrees(tp, tmp_path, capsys):
    gpus = _gpus()
    if len(gpus) < tp or not jax_blink.backends()["gpu"]:
        pytest.skip(f"needs {tp}+ GPUs and the CUDA executor")
    rc = main(["--size", "tiny", "--tp", str(tp), "--batch", "1", "--steps", "4", "--rounds", "3",
               "--min-time", "0", "--strict-bf16", "-o", str(tmp_path)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    record = json.loads(next(tmp_path.glob("decode-tiny-*.json")).read_text())
    rows = {r["variant"]: r for r in record["rows"]}
    assert set(rows) == {"psum", "blink", "switch", "none", "psum+extra", "blink+extra"}
    assert rows["psum"]["xla_all_reduce_sites"] >= 2 and rows["psum"]["jax_blink_sites"] == 0
    for v in ("blink", "switch", "blink+extra"):
        assert rows[v]["jax_blink_sites"] >= 2 and rows[v]["xla_all_reduce_sites"] == 0, v  # the executor ran it
        assert rows[v]["check"].startswith("ok"), (v, rows[v]["check"])
        if tp == 2:
            assert rows[v]["bitwise_vs_psum"], v
    assert rows["psum"]["tokens_per_s"] > 0 and rows["none"]["step_us"] > 0
