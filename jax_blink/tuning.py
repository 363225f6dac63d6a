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


# benchmarks/results/allreduce-nvidia-h200-x2-2026-11-22-v0.3.csv (executor 0.3.0, one-shot kernels
# up to 8 MiB): float32 and bfloat16, 1 KiB-1 GiB, 20 chained calls, median of 7, and the marginal
# cost of a call between 20 and 100 chained calls (--slope 100). By the marginal cost the executor
# was faster at 21 of 22 points (1.03x-3.0x; f32 1 KiB 0.85x); by the 20-call totals it was faster
# at 17 of 22, and the 5 others (0.69x-0.95x, all <= 1 MiB) are points that flip between runs
# (results/allreduce-nvidia-h200-x2-2026-11-22-v0.3-slope.csv had other ones below 1). So no
# size goes to psum on this machine any more. (Executor 0.2.0 lost below 16 MiB: the entry then
# said min_bytes=16 MiB.)
CROSSOVERS: tuple[Crossover, ...] = (
    Crossover("NVIDIA H200", 2, 0, None,
              "benchmarks/results/allreduce-nvidia-h200-x2-2026-11-22-v0.3.csv"),
)


def prefer_lax(device_kind: str | None, ranks: int, nbytes: int) -> bool:
    """True when ``lax.psum`` was measured faster than the executor for this call."""
    for c in CROSSOVERS:
        if c.device_kind == device_kind and c.ranks == ranks:
            return nbytes < c.min_bytes or (c.max_bytes is not None and nbytes > c.max_bytes)
    return False
