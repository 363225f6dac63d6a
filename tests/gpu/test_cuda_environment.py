"""The CUDA executor's environment variables: a value it does not understand is an error naming
the variable and what it takes, never a silent default. Needs the built module, not a GPU."""
from __future__ import annotations

import re

import pytest

try:
    from jax_blink import _blink_cuda
except ImportError:  # not built (no nvcc) or not importable here
    _blink_cuda = None

pytestmark = pytest.mark.skipif(_blink_cuda is None or not hasattr(_blink_cuda, "check_environment"),
                                reason="jax_blink._blink_cuda not built")

VARIABLES = ("JAX_BLINK_LL_BYTES", "JAX_BLINK_ONESHOT_BYTES", "JAX_BLINK_CUDA_BLOCKS", "JAX_BLINK_HOST_MIN_BYTES", "JAX_BLINK_HOST_MAX_BYTES",
             "JAX_BLINK_HOST_CHUNK_BYTES", "JAX_BLINK_HOST_BLOCKS", "JAX_BLINK_HOST_SHARE",
             "JAX_BLINK_HOST_ENGINE", "JAX_BLINK_TWOSHOT_MIN_BYTES", "JAX_BLINK_TWOSHOT_PIECE_BYTES",
             "JAX_BLINK_TWOSHOT_MODE")


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_byte_counts_take_binary_units():
    parse = _blink_cuda.parse_byte_count
    assert parse("8388608") == 8 << 20
    assert parse("512K") == 512 << 10 and parse("512k") == 512 << 10
    assert parse("16M") == 16 << 20 and parse("1G") == 1 << 30 and parse("0") == 0
    for text in ("", "-1", "+4", " 4", "4 ", "16MB", "1.5M", "0x10", "M", "99999999999999999999",
                 "9000000000G"):
        with pytest.raises(ValueError, match="not a byte count"):
            parse(text)


def test_good_values_pass(monkeypatch):
    _blink_cuda.check_environment()  # nothing set
    for name, value in [("JAX_BLINK_LL_BYTES", "256K"), ("JAX_BLINK_ONESHOT_BYTES", "16777216"),
                        ("JAX_BLINK_CUDA_BLOCKS", "0"),
                        ("JAX_BLINK_HOST_MIN_BYTES", "256M"), ("JAX_BLINK_HOST_MAX_BYTES", "1G"),
                        ("JAX_BLINK_HOST_CHUNK_BYTES", "16M"), ("JAX_BLINK_HOST_BLOCKS", "16"),
                        ("JAX_BLINK_HOST_SHARE", "0.09"), ("JAX_BLINK_HOST_ENGINE", "CE"),
                        ("JAX_BLINK_TWOSHOT_MIN_BYTES", "16M"), ("JAX_BLINK_TWOSHOT_PIECE_BYTES", "64K"),
                        ("JAX_BLINK_TWOSHOT_MODE", "Pull"), ("JAX_BLINK_TWOSHOT_REDUCERS", "0")]:
        monkeypatch.setenv(name, value)
    _blink_cuda.check_environment()
    monkeypatch.setenv("JAX_BLINK_HOST_ENGINE", "")  # empty counts as unset
    _blink_cuda.check_environment()


@pytest.mark.parametrize("name,value,takes", [
    ("JAX_BLINK_ONESHOT_BYTES", "16MB", "byte count"),
    ("JAX_BLINK_LL_BYTES", "-1", "byte count"),
    ("JAX_BLINK_HOST_CHUNK_BYTES", "lots", "byte count"),
    ("JAX_BLINK_CUDA_BLOCKS", "2K", "from 0 to 65536"),
    ("JAX_BLINK_CUDA_BLOCKS", "132.5", "from 0 to 65536"),
    ("JAX_BLINK_HOST_BLOCKS", "-3", "from 0 to 65536"),
    ("JAX_BLINK_HOST_SHARE", "9%", "fraction from 0 to 1"),
    ("JAX_BLINK_HOST_SHARE", "1.5", "fraction from 0 to 1"),
    ("JAX_BLINK_HOST_SHARE", "0x0.8p0", "fraction from 0 to 1"),
    ("JAX_BLINK_HOST_SHARE", " 0.5", "fraction from 0 to 1"),
    ("JAX_BLINK_HOST_BLOCKS", "+4", "from 0 to 65536"),
    ("JAX_BLINK_CUDA_BLOCKS", " 4", "from 0 to 65536"),
    ("JAX_BLINK_HOST_ENGINE", "copy", "sm .* or ce"),
    ("JAX_BLINK_TWOSHOT_MIN_BYTES", "big", "byte count"),
    ("JAX_BLINK_TWOSHOT_PIECE_BYTES", "1.5M", "byte count"),
    ("JAX_BLINK_TWOSHOT_MODE", "push", "auto .* or pull"),
    ("JAX_BLINK_TWOSHOT_REDUCERS", "-1", "from 0 to 65536"),
    ("JAX_BLINK_TWOSHOT_REDUCERS", "a few", "from 0 to 65536"),
    ("JAX_BLINK_TWOSHOT_ENGINE", "dma", "sm .* or ce"),
    ("JAX_BLINK_TWOSHOT_PUSH", "interleaved", "serial .* or spread"),
    ("JAX_BLINK_LOG_BUFFERS", "yes", "1 .* or 0"),
    ("JAX_BLINK_ASYNC_ENGINE", "dma", "sm .* or ce"),
    ("JAX_BLINK_CE_PIECE_BYTES", "lots", "byte count"),
    ("JAX_BLINK_CE_PIECE_BYTES", "8", "at least 16"),
    ("JAX_BLINK_CE_GATHER", "scatter", "pull .* or push"),
    ("JAX_BLINK_CE_SCATTER", "gather", "pull .* or push"),
])
def test_a_value_not_understood_is_named_with_what_it_takes(monkeypatch, name, value, takes):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=rf"{name}='{re.escape(value)}' is not understood: it takes .*{takes}"):
        _blink_cuda.check_environment()
