"""The train tool's modes by name, and what each one sets: data only, so that the command line
is checked before flax and optax are imported (:mod:`jax_blink.tools.train.step` builds them)."""
from __future__ import annotations

#: The two steps every run times beside psum: without the all-reduce (``none``: XLA then fuses the
#: gradients' producers with the update), and without it but with each bucket behind an
#: optimization barrier (``none-barrier``: the fusions stop at the bucket as at a collective), so
#: that what the collective itself costs is told apart from what its boundary does to the fusions.
BASELINES = ("none", "none-barrier")
#: The switch's options every mode lowered under it starts from (the library's defaults, the overlap on).
SWITCH_DEFAULTS = {"switch_overlap": True, "switch_late_last_wait": False, "switch_sparse_gradients": False,
                   "switch_last_bucket_pieces": 1, "switch_hold": "recent"}
#: The modes lowered under the switch, and what each changes from :data:`SWITCH_DEFAULTS` (``dispatch``:
#: whatever the tool's ``--dispatch``; ``switch-auto`` is the switch as a user gets it).
SWITCH_OVERLAP = {"switch": {}, "switch-auto": {"dispatch": "auto"}, "switch-late": {"switch_late_last_wait": True},
                  "switch-sparse": {"switch_sparse_gradients": True}, "switch-sync": {"switch_overlap": False},
                  "switch-ce": {}, "switch-8blocks": {}, "switch-tree": {}, "switch-tree-twoshot": {},
                  "switch-tree-8blocks": {}, "switch-tree-sync": {"switch_overlap": False},
                  "switch-weights": {"switch_hold": "weights"}, "switch-tree-weights": {"switch_hold": "weights"},
                  "switch-none": {"switch_hold": "none"}}
#: Modes under the switch with its starts holding the weights (``switch_hold="weights"``) or
#: nothing (``"none"``; ``-last16``: with the last bucket in 16 calls), timed when asked for
#: (change 33 of the lab notes; ``switch-tree-weights``, a tree mode, is timed so too).
SWITCH_HOLD_VARIANTS = ("switch-weights", "switch-none", "switch-none-last16")
#: Modes whose first run sets up their call sites under these variables: the CUDA executor reads
#: the overlapped all-reduce's engine and grid once per call site, at its first start
#: (kernels/cuda/async_ffi.cc), so one process can time them beside the default. Elsewhere they
#: change nothing.
SITE_ENVIRONMENT = {"switch-ce": {"JAX_BLINK_ASYNC_ENGINE": "ce"}, "switch-8blocks": {"JAX_BLINK_ASYNC_BLOCKS": "8"},
                    "switch-tree-twoshot": {"JAX_BLINK_TWOSHOT_MIN_BYTES": "1M"},
                    "switch-tree-8blocks": {"JAX_BLINK_ASYNC_BLOCKS": "8"}}
#: Modes whose step sums the gradients as one ``lax.psum`` of the whole tree (a psum per leaf, as
#: a user writes it; XLA combines them into variadic all-reduces), not the DDP buckets' flat buffers;
#: ``switch-tree`` is that step under the switch (which merges the leaves' psums into calls of at
#: most the bucket cap itself).
TREE_MODES = ["psum-tree", "switch-tree", "switch-tree-twoshot", "switch-tree-8blocks", "switch-tree-sync",
              "switch-tree-weights"]
#: The overlapped modes and the ``hold`` of value_and_grad_overlapped each one runs.
OVERLAP_HOLD = {"overlap": "recent", "overlap-all": "all", "overlap-none": "none", "overlap-weights": "weights"}
#: jax_blink options that a mode outside the switch lowers under.
MODE_OPTIONS: dict[str, dict] = {}
#: Modes that are another mode with the executor's buckets packed another way than the default
#: (each leaf behind a barrier, then XLA's concatenation), timed when asked for: by its copy kernel
#: (``*-kpack``: ``bucket_packing="kernel"``) or by XLA's concatenation with the leaves' producers
#: free to fuse into it (``*-fused``: ``bucket_packing="xla"``; jax_blink/lowering/packing.py).
#: Each takes its base mode's entries in the tables above, with that option added.
#: Mode: (base mode, bucket_packing).
PACKING_VARIANTS = {"switch-kpack": ("switch", "kernel"), "switch-tree-kpack": ("switch-tree", "kernel"),
                    "overlap-kpack": ("overlap", "kernel"), "switch-fused": ("switch", "xla"),
                    "switch-tree-fused": ("switch-tree", "xla"), "overlap-fused": ("overlap", "xla")}
for _mode, (_base, _packing) in PACKING_VARIANTS.items():
    if _base in SWITCH_OVERLAP:
        SWITCH_OVERLAP[_mode] = {**SWITCH_OVERLAP[_base], "bucket_packing": _packing}
    else:
        MODE_OPTIONS[_mode] = {**MODE_OPTIONS.get(_base, {}), "bucket_packing": _packing}
    if _base in OVERLAP_HOLD:
        OVERLAP_HOLD[_mode] = OVERLAP_HOLD[_base]
    if _base in TREE_MODES:
        TREE_MODES.append(_mode)
TREE_MODES = tuple(TREE_MODES)
del _mode, _base, _packing
#: Modes that are another mode with the backward pass's last bucket cut into this many calls of
#: consecutive leaves, timed when asked for, beside the base mode in one run: on ResNet-50 a call
#: holding that bucket whole splits XLA's fusions of the residual additions with BatchNorm's
#: reductions (on one GPU; on 2 x H200 the cut made the step slower: lab notes, change 32). The
#: tool's buckets are cut in its layout (``BucketLayout.of(last_bucket_pieces=)``), and under the
#: switch its last bucket too
#: (``switch_last_bucket_pieces``: the switch re-buckets the step's psums, and would merge the
#: layout's pieces back into one call). Mode: (base mode, pieces).
LAST_BUCKET_VARIANTS = {"switch-last16": ("switch", 16), "switch-tree-last16": ("switch-tree", 16),
                        "overlap-last16": ("overlap", 16), "overlap-none-last16": ("overlap-none", 16),
                        "overlap-weights-last16": ("overlap-weights", 16), "switch-none-last16": ("switch-none", 16)}
for _mode, (_base, _pieces) in LAST_BUCKET_VARIANTS.items():
    if _base in SWITCH_OVERLAP:
        SWITCH_OVERLAP[_mode] = {**SWITCH_OVERLAP[_base], "switch_last_bucket_pieces": _pieces}
    if _base in OVERLAP_HOLD:
        OVERLAP_HOLD[_mode] = OVERLAP_HOLD[_base]
    if _base in TREE_MODES:
        TREE_MODES += (_mode,)
del _mode, _base, _pieces
#: Every mode and what the tool's table calls it.
LABELS = {"psum": "psum (XLA all-reduce)", "blink": "jax_blink.all_reduce",
          "overlap": "jax_blink overlapped", "overlap-all": "jax_blink overlapped (hold all)",
          "overlap-none": "jax_blink overlapped (hold none)",
          "overlap-weights": "jax_blink overlapped (hold weights)",
          "switch": "psum under the switch (overlapped)", "switch-auto": "psum under the switch, dispatch=auto",
          "switch-late": "psum under the switch, late last wait",
          "switch-sparse": "psum under the switch, switch_sparse_gradients=True",
          "switch-sync": "psum under the switch, switch_overlap=False",
          "switch-tree-sync": "psum of the tree under the switch, switch_overlap=False",
          "switch-weights": "psum under the switch, switch_hold=weights",
          "switch-tree-weights": "psum of the tree under the switch, switch_hold=weights",
          "switch-none": "psum under the switch, switch_hold=none",
          **{m: f"psum{' of the tree' if m in TREE_MODES else ''} under the switch, "
                f"{' '.join(f'{k}={v}' for k, v in env.items())} (its sites)"
             for m, env in SITE_ENVIRONMENT.items()},
          "psum-tree": "psum of the gradient tree (no buckets)", "switch-tree": "psum of the tree under the switch",
          "none": "no all-reduce", "none-barrier": "no all-reduce, buckets behind a barrier"}
_PACKED_BY = {"kernel": "packed by the copy kernel", "xla": "XLA's packing fused with the leaves' producers"}
LABELS.update({m: f"{LABELS[base]}, {_PACKED_BY[packing]}" for m, (base, packing) in PACKING_VARIANTS.items()})
LABELS.update({m: f"{LABELS[base]}, the last bucket in {pieces} calls"
               for m, (base, pieces) in LAST_BUCKET_VARIANTS.items()})
MODES = tuple(LABELS)


def overlapped_modes(hold: str) -> list[str]:
    """The overlapped modes that the tool's ``--hold`` (recent, all, none, weights, or both: recent
    and all) names."""
    holds = ("recent", "all") if hold == "both" else (hold,)
    return [m for m, h in OVERLAP_HOLD.items()
            if h in holds and m not in PACKING_VARIANTS and m not in LAST_BUCKET_VARIANTS]
