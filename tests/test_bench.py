"""The benchmark tool runs every collective, checks it against lax and writes its table."""
import csv

import jax
import pytest

from jax_blink import bench


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2+ devices")
@pytest.mark.parametrize("collective", sorted(bench.COLLECTIVES))
def test_bench_runs_checks_and_writes(tmp_path, collective):
    rc = bench.main(["-c", collective, "-b", "1K", "-e", "4K", "-f", "4", "-d", "float32",
                     "-k", "2", "-r", "1", "-o", str(tmp_path), "--kind", "test"])
    assert rc == 0  # nonzero when any element was wrong
    (path,) = tmp_path.glob(f"{collective}-test-*.csv")
    rows = list(csv.DictReader(open(path)))
    assert [int(r["wrong"]) for r in rows] == [0, 0]
    assert all(float(r["time_us"]) > 0 and float(r["lax_time_us"]) > 0 for r in rows)
    assert path.with_suffix(".png").stat().st_size > 0


def test_parse_size():
    assert bench.parse_size("1K") == 1024
    assert bench.parse_size("64M") == 64 << 20
    assert bench.parse_size("1G") == 1 << 30
    assert bench.parse_size("4096") == 4096
