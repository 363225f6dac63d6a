"""The data-parallel training step: parameters replicated, the batch split over a mesh axis
(``jax.shard_map``), each device's gradients summed over the axis in buckets (PyTorch DDP's
layout, :mod:`jax_blink.api.buckets`), the same optimizer update on every device.

The collective that sums a bucket is the only thing that changes between the modes:

- ``psum``: ``lax.psum`` (XLA's all-reduce);
- ``blink``: ``jax_blink.all_reduce``, written into the step;
- ``overlap``: ``jax_blink.value_and_grad_overlapped``: each bucket's all-reduce started inside
  the backward pass right after its gradients exist (the rest of the pass held behind the start),
  all awaited after the last start; on GPUs the all-reduces run on a side stream;
  ``overlap-all`` is the same with every live value held behind each start (``hold="all"``),
  ``overlap-none`` with none held, ``overlap-weights`` with the weights held that only the rest
  of the backward pass's matrix products and convolutions read (``hold="weights"``);
- ``switch``: the ``psum`` step function itself, unedited, lowered under ``jax_blink.installed()``
  (the switch routes its ``lax.psum`` to jax_blink and starts each bucket inside the backward
  pass: :mod:`jax_blink.switch.overlap`); ``switch-late`` the same with
  ``switch_late_last_wait=True`` (the other parameters' update beside the last bucket);
  ``switch-auto`` the same under ``dispatch="auto"`` (the dispatch table may give buckets to
  psum: what a user gets without setting anything); ``switch-sparse`` with
  ``switch_sparse_gradients=True`` (an embedding's gradient gathered:
  :mod:`jax_blink.switch.sparse`); ``switch-sync`` with ``switch_overlap=False`` (each bucket's call where the program wrote it,
  after the backward pass); ``switch-ce`` and ``switch-8blocks`` lowered as ``switch``, their call
  sites set up under another engine or grid of the CUDA executor's (:data:`SITE_ENVIRONMENT`);
  ``psum-tree`` sums the gradients as one ``lax.psum`` of the tree (no buckets: XLA combines the
  leaves' all-reduces itself), ``switch-tree`` is that step under the switch;
- ``none``: no collective (each device keeps its own gradients): the same step with the
  all-reduce taken out, to time what the collectives cost. Its parameters are wrong by design.
  ``none-barrier`` the same with each bucket passed through an ``optimization_barrier``, which XLA
  fuses around as it does around a collective: what the collective's boundary costs the fusions
  is then told apart from the communication (XLA:CPU drops the barrier).

BatchNorm's running statistics travel in the same buckets as the gradients and are averaged, so
every device keeps the same model (DDP instead broadcasts rank 0's buffers).
"""
from __future__ import annotations

import contextlib
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_blink.lowering import jax_internals as _jax_internals
from jax_blink.api import buckets as _buckets
from jax_blink.api.collectives import all_reduce
from jax_blink.api.overlapped_grad import value_and_grad_overlapped
from jax_blink.options.settings import override
from jax_blink.tools.scoped_env import environment
from jax_blink.tools.train import data as _data
from jax_blink.tools.train.models import MODELS, build, optimizer

from jax_blink.tools.train.modes import (BASELINES, LAST_BUCKET_VARIANTS, MODE_OPTIONS, MODES, OVERLAP_HOLD,
                                          SITE_ENVIRONMENT, SWITCH_DEFAULTS, SWITCH_OVERLAP, TREE_MODES)


def build_loss(model: str):
    return MODELS[model][1]


def switch_available() -> bool:
    import jax_blink
    return hasattr(jax_blink, "installed")


def reducer(mode: str, axis: str, stream: int | None = None) -> Callable[[jax.Array], jax.Array]:
    """The sum over ``axis`` of one bucket, as ``mode`` computes it.

    ``stream`` (``blink`` only, experimental): lower each call inside
    ``compute_on2(compute_type="gpu_stream:<stream>")`` (named ``compute_on`` from jax 0.11), which
    XLA:GPU runs as an asynchronous call on that stream (``--xla_gpu_experimental_stream_annotation``),
    so that it may overlap the computation around it; XLA:CPU ignores the annotation (docs/overlap.md)."""
    if stream is not None and mode != "blink":
        raise ValueError(f"stream= applies to the blink mode only, not {mode!r}")
    if mode in ("psum", "psum-tree") or mode in SWITCH_OVERLAP:
        return lambda buf: lax.psum(buf, axis)
    if mode == "blink" and stream is not None:
        compute_on = _jax_internals.compute_on_call()
        if compute_on is None:
            raise NotImplementedError(
                f"stream= needs jax.experimental.compute_on.compute_on2 (compute_on from jax 0.11), which "
                f"jax {jax.__version__} does not have; run without a stream annotation")
        on_stream = compute_on(lambda buf: all_reduce(buf, axis), compute_type=f"gpu_stream:{stream}",
                               out_memory_spaces=jax.memory.Space.Device)
        return on_stream
    if mode == "blink":
        return lambda buf: all_reduce(buf, axis)
    if mode == "none":
        return lambda buf: buf
    if mode == "none-barrier":  # an identity XLA cannot fuse through, as it cannot through a collective
        return lambda buf: lax.optimization_barrier(buf)
    if mode in OVERLAP_HOLD:  # step_fn sums the buckets itself (start / done pairs)
        return lambda buf: all_reduce(buf, axis)
    raise ValueError(f"unknown collective mode {mode!r}; one of {MODES}")


@contextlib.contextmanager
def lowering_context(mode: str, dispatch: str = "blink", bucket_bytes: int | None = None,
                     last_bucket_pieces: int = 1):
    """What must be in force while a mode's step is traced and lowered: the dispatch option for
    jax_blink's calls (``blink`` runs the executor even where ``auto`` would pick psum: on CPU host
    devices it picks psum at 4 and 8 ranks; ``switch-auto`` always takes ``auto``), and the switch
    for ``switch`` (overlapping), ``switch-late`` (overlapping, the last bucket's wait late) and
    ``switch-sync`` (not), whose buckets (``merge_bytes``) take ``bucket_bytes`` where given (the
    step's own DDP cap) and whose last bucket is cut into ``last_bucket_pieces`` calls
    (``switch_last_bucket_pieces``, unless the mode sets its own)."""
    if mode in ("psum", "psum-tree", *BASELINES):
        yield
        return
    with override(dispatch=SWITCH_OVERLAP.get(mode, {}).get("dispatch", dispatch)):
        if mode in SWITCH_OVERLAP:
            if not switch_available():
                raise RuntimeError("--collective switch needs jax_blink.installed() (the switch of "
                                   "issue 15), which this jax_blink does not have")
            import jax_blink
            caps = {} if bucket_bytes is None else {"merge_bytes": bucket_bytes}
            options = {**SWITCH_DEFAULTS, "switch_last_bucket_pieces": last_bucket_pieces,
                       **{k: v for k, v in SWITCH_OVERLAP[mode].items() if k != "dispatch"}}
            with jax_blink.installed(), override(**options, **caps):
                yield
        else:
            with override(**MODE_OPTIONS.get(mode, {})):
                yield


class DataParallel:
    """A model, its optimizer, synthetic data, and the step of each mode over ``mesh[axis]``."""

    def __init__(self, model: str, cfg, mesh: jax.sharding.Mesh, axis: str = "data", *,
                 bucket_bytes: int = _buckets.DEFAULT_BUCKET_BYTES,
                 first_bucket_bytes: int | None = _buckets.DEFAULT_FIRST_BUCKET_BYTES,
                 seed: int = 0, lr: float | None = None, data_batches: int = 4,
                 dispatch: str = "blink", compiler_options: dict | None = None,
                 stream: int | None = None, large_leaf_alone: bool = False, last_bucket_pieces: int = 1):
        self.model_name, self.cfg, self.mesh, self.axis = model, cfg, mesh, axis
        self.n = mesh.shape[axis]
        self.dispatch = dispatch
        self.stream = stream  # the blink mode's experimental stream annotation (reducer())
        self.compiler_options = compiler_options  # for the steps' compiles (tests: less optimisation)
        self.tx = optimizer(model, lr)
        self.loss_fn = build_loss(model)

        def init():
            # Parameters are differentiated; BatchNorm's statistics are carried; nothing else is
            # expected (nnx.split refuses state that neither filter takes).
            _, params, stats = nnx.split(build(model, cfg, seed)[0], nnx.Param, nnx.BatchStat)
            return {"params": params, "stats": stats, "opt": self.tx.init(params)}

        # Built inside one jitted program, compiled without optimisation: it runs once, and XLA:CPU
        # spent 70 s optimising the random initialisers of the tiny ResNet on a loaded 2-core
        # machine (4.5 s at level 0); eager initialisation compiles one program per initialiser.
        self.graphdef = nnx.split(nnx.eval_shape(lambda: build(model, cfg, seed)[0]),
                                  nnx.Param, nnx.BatchStat)[0]
        self.state0 = jax.jit(init, out_shardings=NamedSharding(mesh, P())).lower().compile(
            compiler_options={"xla_backend_optimization_level": 0})()
        sharded = NamedSharding(mesh, P(axis))
        self.batches = [jax.device_put(b, sharded)
                        for b in _data.batches(model, cfg, cfg.batch * self.n, data_batches, seed)]
        # Buckets in the order the backward pass makes the gradients (GPT-2's tied embedding, first
        # in leaf order reversed, is summed last), as DDP rebuilds its buckets after one iteration.
        self._order = self._gradient_order()
        self.layout = self._layout(last_bucket_pieces, bucket_bytes, first_bucket_bytes, large_leaf_alone)
        self._layouts: dict[int, _buckets.BucketLayout] = {}  # layout_of's, by last-bucket pieces
        self._compiled: dict[str, object] = {}
        self._sites_set_up: set[str] = set()  # modes of SITE_ENVIRONMENT that have run once

    def _layout(self, last_bucket_pieces: int, bucket_bytes: int, first_bucket_bytes: int | None,
                large_leaf_alone: bool) -> _buckets.BucketLayout:
        return _buckets.BucketLayout.of(
            {"grads": self.state0["params"], "stats": self.state0["stats"]}, bucket_bytes,
            first_bucket_bytes, order=self._order, large_leaf_alone=large_leaf_alone,
            last_bucket_pieces=last_bucket_pieces)

    def layout_of(self, mode: str) -> _buckets.BucketLayout:
        """The buckets ``mode`` sums: :attr:`layout`, or for a mode of :data:`LAST_BUCKET_VARIANTS`
        the same with the last bucket cut into that mode's pieces."""
        if mode not in LAST_BUCKET_VARIANTS:
            return self.layout
        pieces = LAST_BUCKET_VARIANTS[mode][1]
        if pieces not in self._layouts:
            base = self.layout
            self._layouts[pieces] = self._layout(pieces, base.bucket_bytes, base.first_bucket_bytes,
                                                 base.large_leaf_alone)
        return self._layouts[pieces]

    def _gradient_order(self) -> list[int]:
        """The leaves of ``{"grads", "stats"}`` in the order one device's step computes them
        (:func:`jax_blink.api.buckets.gradient_order`; the statistics come from the forward pass)."""
        graphdef, loss_fn = self.graphdef, self.loss_fn

        def grads_of(params, stats, batch):
            def loss_of(p):
                model = nnx.merge(graphdef, p, stats, copy=True)
                return loss_fn(model, batch), nnx.state(model, nnx.BatchStat)

            (_, new_stats), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
            return {"grads": grads, "stats": new_stats}

        local = jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0] // self.n,) + a.shape[1:], a.dtype),
                             self.batches[0])
        return _buckets.gradient_order(grads_of, self.state0["params"], self.state0["stats"], local)

    @property
    def param_count(self) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.state0["params"]))

    def step_fn(self, mode: str, combine: Callable | None = None):
        """The jitted data-parallel step ``(state, batch) -> (state, per-device losses)`` of
        ``mode`` (not yet traced: see :func:`lowering_context`). ``combine`` (with ``mode="none"``
        only): what the step does to ``{"grads", "stats"}`` instead of leaving them to the update
        as they are (benchmarks/boundary_probe.py holds them in several shapes)."""
        if combine is not None and mode != "none":
            raise ValueError(f"combine= replaces the step's sum of the gradients only in mode 'none', not {mode!r}")
        reduce_bucket = reducer(mode, self.axis, self.stream if mode == "blink" else None)
        graphdef, loss_fn, tx, layout, axis, n = (self.graphdef, self.loss_fn, self.tx, self.layout_of(mode),
                                                  self.axis, self.n)
        # `none` leaves each device's parameters its own: shard_map may not check replication.
        check = mode not in BASELINES

        def local_step(state, batch):
            params = state["params"]
            # Differentiate with respect to this device's copy: its gradient is local (with the
            # parameters left invariant, jax's transpose would insert an all-reduce of its own,
            # one per leaf, before ours).
            mine = jax.tree.map(lambda p: lax.pcast(p, axis, to="varying"), params) if check else params

            def loss_of(p):
                # copy: BatchNorm updates its statistics in place, inside this trace.
                model = nnx.merge(graphdef, p, state["stats"], copy=True)
                loss = loss_fn(model, batch)
                return loss, nnx.state(model, nnx.BatchStat)

            if mode in OVERLAP_HOLD:  # each bucket started inside the backward pass (DDP's overlap)
                (loss, stats), grads = value_and_grad_overlapped(
                    loss_of, axis, has_aux=True, reduce_aux=True, bucket_bytes=layout.bucket_bytes,
                    first_bucket_bytes=layout.first_bucket_bytes, hold=OVERLAP_HOLD[mode],
                    large_leaf_alone=layout.large_leaf_alone, last_bucket_pieces=layout.last_bucket_pieces)(mine)
                summed = {"grads": grads, "stats": stats}
            elif mode in TREE_MODES:  # one psum of the tree, as a user writes it: no buckets of ours
                (loss, stats), grads = jax.value_and_grad(loss_of, has_aux=True)(mine)
                summed = lax.psum({"grads": grads, "stats": stats}, axis)
            else:
                (loss, stats), grads = jax.value_and_grad(loss_of, has_aux=True)(mine)
                if combine is not None:
                    summed = combine({"grads": grads, "stats": stats})
                else:  # jax_blink's calls go in bucket order (buckets.bucketed); XLA orders its own.
                    summed = _buckets.bucketed({"grads": grads, "stats": stats}, reduce_bucket, layout,
                                               ordered=mode == "blink")
            grads, stats = jax.tree.map(lambda v: v / n, (summed["grads"], summed["stats"]))
            updates, opt = tx.update(grads, state["opt"], params)
            return ({"params": optax.apply_updates(params, updates), "stats": stats, "opt": opt},
                    loss.reshape(1))

        return jax.jit(jax.shard_map(local_step, mesh=self.mesh, in_specs=(P(), P(axis)),
                                     out_specs=(P(), P(axis)), check_vma=check))

    def compiled(self, mode: str):
        """The compiled step of ``mode`` (lowered under the mode's context, cached)."""
        if mode not in self._compiled:
            with lowering_context(mode, self.dispatch, self.layout.bucket_bytes, self.layout.last_bucket_pieces):
                self._compiled[mode] = self.step_fn(mode).lower(self.state0, self.batches[0]).compile(
                    compiler_options=self.compiler_options)
        return self._compiled[mode]

    def callable(self, mode: str) -> Callable:
        """The compiled step of ``mode``; for a mode of :data:`SITE_ENVIRONMENT`, its first call
        runs under that mode's variables, to its end (the executor sets its sites up as the
        program runs), and puts the environment back."""
        step = self.compiled(mode)
        env = SITE_ENVIRONMENT.get(mode)
        if not env or mode in self._sites_set_up:
            return step

        def first_call(*args):
            if mode in self._sites_set_up:
                return step(*args)
            with environment(env):
                out = jax.block_until_ready(step(*args))
            self._sites_set_up.add(mode)
            return out

        return first_call

    def run(self, mode: str, steps: int, on_step: Callable[[int, float], None] | None = None):
        """``steps`` steps from the initial state: (final state, mean loss of each step)."""
        step = self.callable(mode)
        state, losses = self.state0, []
        for i in range(steps):
            state, per_device = step(state, self.batches[i % len(self.batches)])
            losses.append(float(jnp.mean(per_device)))
            if on_step is not None:
                on_step(i, losses[-1])
        return state, losses

    def collectives_in(self, mode: str) -> dict[str, int]:
        """How many all-reduces and jax_blink custom calls the compiled step of ``mode`` has."""
        text = self.compiled(mode).as_text()
        return {"all-reduce": len(re.findall(r"\ball-reduce(?:-start)?\(", text)),
                "jax_blink": len(re.findall(r'custom_call_target="jax_blink_(?:collective|start)', text))}
