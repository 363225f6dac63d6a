"""When jax_blink's executor is the faster choice, from measurements (not guesses).

``all_reduce`` hands a call to ``lax.psum`` where XLA's own collective was measured faster on the
same kind of machine (``python -m jax_blink.bench``, files under ``benchmarks/results/``). Each entry
names the run it comes from; a machine that is not listed always uses the executor.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Crossover:
    """On ``ranks`` devices of ``device_kind``, the executor wins for operands of at least
    ``min_bytes`` bytes per rank (and up to ``max_bytes``, when given)."""

    device_kind: str
    ranks: int
    min_bytes: int
    max_bytes: int | None
    source: str


# benchmarks/results/allreduce-nvidia-h200-x2-2026-11-22.csv (executor 0.2.0): float32 and bfloat16,
# 20 chained calls, median of 5. Below 16 MiB XLA's psum was faster (the executor pays ~30 us per
# call through XLA's custom-call path); at 16 MiB they tie (1.01x f32, 1.16x bf16); from 64 MiB to
# 1 GiB the executor was faster (1.05x-1.16x).
CROSSOVERS: tuple[Crossover, ...] = (
    Crossover("NVIDIA H200", 2, 16 << 20, None,
              "benchmarks/results/allreduce-nvidia-h200-x2-2026-11-22.csv"),
)


def prefer_lax(device_kind: str | None, ranks: int, nbytes: int) -> bool:
    """True when ``lax.psum`` was measured faster than the executor for this call."""
    for c in CROSSOVERS:
        if c.device_kind == device_kind and c.ranks == ranks:
            return nbytes < c.min_bytes or (c.max_bytes is not None and nbytes > c.max_bytes)
    return False
