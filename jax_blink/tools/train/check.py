"""The train tool's result check: each timed mode's training against psum's, before any is timed
(a step time is a claim only for a step that computes what psum's does)."""
from __future__ import annotations

from collections.abc import Sequence

from jax_blink.tools.train.modes import BASELINES

#: How far a mode's parameter change may be from psum's and still pass the result check: the norm of
#: the difference over the norm of psum's change. Rounding moves it by far less (GPT-2's AdamW turns
#: a few near-zero gradients' signs; ResNet's convolutions are not bitwise reproducible and moved its
#: second loss by 0.3% between processes on 2 x H200); a wrong sum or garbage moves it by far more.
UPDATE_RTOL = 0.5


def check_against_psum(dp, modes: Sequence[str], steps: int, done: dict | None = None) -> dict[str, dict]:
    """Each mode of ``modes`` that sums the gradients (not psum, not the baselines), trained
    ``steps`` steps from the initial state on psum's batches, against psum's run: the largest
    relative difference of its losses, the relative difference of its parameter change
    (``|p - p_psum| / |p_psum - p0|``, 2-norms over every parameter), whether everything is
    finite, and whether it passes (finite, the change within :data:`UPDATE_RTOL`). A coarse check
    by design: training is not bitwise reproducible on GPUs, so it catches garbage, a bucket lost,
    doubled or summed over the wrong devices, not the last bits (the GPU tests check those).
    ``done``: {mode: (state, losses)} of runs already made by ``dp.run(mode, steps)``, not run again."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    done = dict(done or {})

    def run(mode):
        if mode not in done:
            done[mode] = dp.run(mode, steps)
        return done[mode]

    def norm(a, b):  # |a - b| over every leaf, summed on the devices: one transfer
        return float(sum(jnp.sum(jnp.square((x - y).astype(jnp.float32)))
                         for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))) ** 0.5

    ref_state, ref_losses = run("psum")
    ref_change = norm(ref_state["params"], dp.state0["params"])
    found = {}
    for m in modes:
        if m == "psum" or m in BASELINES:
            continue
        state, losses = run(m)
        finite = bool(np.all(np.isfinite(losses))) and bool(
            jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(state["params"])])))
        diff = norm(state["params"], ref_state["params"])
        update_rel = diff / ref_change if ref_change > 0 else (0.0 if diff == 0 else float("inf"))
        loss_rel = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, ref_losses))
        found[m] = {"loss_rel_diff": loss_rel, "update_rel_diff": update_rel, "finite": finite,
                    "passed": finite and update_rel <= UPDATE_RTOL}
    return found
