"""benchmarks/gpu_collectives_driver.py on 4 CPU host devices: numpy's reference
(``--reference host``, what the runs under compute-sanitizer use: no NCCL set-up) equals lax's
result for every case the driver makes, and a wrong result fails against either reference."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import collective_checks as cc  # noqa: E402
import jax_blink  # noqa: E402
import gpu_collectives_driver as driver  # noqa: E402

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu" or len(jax.devices()) < 4,
                                reason="runs on 4 CPU host devices")


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
def test_numpy_reference_equals_lax_for_every_case_of_the_driver(n, dtype):
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:n]), (cc.AXIS,))
    cases = driver.plan_programs(n, [4 << 10], [dtype], quick=False)[0]
    assert {c.what for c in cases} == set(cc.COLLECTIVES) and len(cases) == 9
    rng = np.random.default_rng(n * 10 + len(dtype))
    hosts = [cc.random_operand(rng, c, n) for c in cases]
    _, ref = cc.programs(mesh, cases)
    got_lax = ref(*[cc.put(mesh, h) for h in hosts])
    for c, h, lax_out in zip(cases, hosts, got_lax):
        want = c.host(h, n)
        lax_np = np.asarray(lax_out)
        assert want.shape == lax_np.shape and want.dtype == lax_np.dtype, c.label()
        if c.exact():
            np.testing.assert_array_equal(want, lax_np, err_msg=c.label())
        else:
            tol = cc.SUM_TOLERANCE[dtype] * max(1.0, float(np.abs(want.astype(np.float32)).max()))
            np.testing.assert_allclose(want.astype(np.float32), lax_np.astype(np.float32), atol=tol,
                                       err_msg=c.label())


@pytest.mark.parametrize("reference", ["lax", "host"])
def test_the_driver_fails_a_wrong_result_against_either_reference(tmp_path, monkeypatch, reference):
    real = cc.Case.ours

    def off_by_one(self, v):
        return real(self, v) + jnp.ones((), v.dtype)

    monkeypatch.setattr(cc.Case, "ours", off_by_one)
    out = tmp_path / "d.json"
    before = (jax_blink.config.dispatch, jax_blink.config.fallback)
    rc = driver.main(["--ranks", "3", "--sizes", "4K", "--dtypes", "float32", "--calls", "1",
                      "--reference", reference, "--out", str(out)])
    assert (jax_blink.config.dispatch, jax_blink.config.fallback) == before  # the run's options are undone
    r = json.loads(out.read_text())
    assert rc == 1 and not r["ok"] and r["reference"] == reference
    bad = r["rows"][0]["runs"][0]["failures"]
    assert len(bad) == 9 and all(any("max |ours - lax|" in p for p in f["problems"]) for f in bad), bad



def test_collectives_keeps_only_the_named_ones(tmp_path):
    out = tmp_path / "d.json"
    rc = driver.main(["--ranks", "3", "--sizes", "4K,64K", "--dtypes", "float32", "--calls", "1",
                      "--reference", "host", "--collectives", "reduce_scatter", "--out", str(out)])
    r = json.loads(out.read_text())
    assert rc == 0 and r["ok"]
    cases = [c for row in r["rows"] for c in row["cases"]]
    # the smallest size holds reduce_scatter tiled and untiled, the other size the tiled one
    assert len(cases) == 3 and all(c.startswith("reduce_scatter") for c in cases), cases
    with pytest.raises(SystemExit):
        driver.main(["--collectives", "reduce_scatter,psum"])
