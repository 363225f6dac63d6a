"""A Llama-shaped decoder, tensor parallel over a ``"tp"`` mesh axis, as its users write it.

``jax.shard_map`` over ``"tp"``; per layer (Megatron's layout):

- attention: RMSNorm, the fused QKV projection column-parallel by heads (each rank holds its
  ``heads / tp`` query heads and ``kv_heads / tp`` key/value heads), RoPE, grouped-query attention
  over the rank's part of the KV cache, the output projection row-parallel, then an all-reduce of
  ``batch x hidden`` values and the residual add;
- MLP: RMSNorm, gate and up projections column-parallel (one fused matrix), SiLU, the down
  projection row-parallel, then an all-reduce and the residual add.

The KV cache is preallocated (``context`` positions, random values standing for a prefilled
prompt) and updated with ``lax.dynamic_update_slice`` at the current position; attention reads
the whole cache, masked to the positions up to the current one. The layers are one ``lax.scan``
over stacked weights (the cache rides in its carry, so each layer writes one position in place),
and one program decodes ``steps`` tokens (an outer ``lax.scan``) so that dispatch does not decide
the time. The embedding and the LM head are replicated (every rank computes the same greedy
token, with no collective), so the vocabulary of the 8B shape is reduced (see :data:`SIZES`).

What sums the row-parallel partial results is the only thing that changes between the variants
(:data:`VARIANTS`); ``extra`` adds K all-reduces per layer that leave the numbers unchanged (a
masked sum: rank 0's copy of the residual stream plus zeros) to measure one all-reduce's marginal
cost inside the step.

The ``sequence`` layout (:data:`LAYOUTS`; Megatron's sequence parallelism, over the batch's rows
in decoding) keeps each rank's ``batch / tp`` rows of the residual stream: the RMSNorms run on
them, an all-gather gives the column-parallel projections the whole batch, and a reduce-scatter
takes the row-parallel partial results back to the rank's rows, in place of each all-reduce; the
LM head reads the rows gathered once more per token (by ``lax.all_gather`` typed as replicated,
in every variant, since the head's result must be). ``extra`` then adds K all-gather and reduce-scatter
pairs per layer (the gathered stream masked to rank 0's copy, scattered back: exact).
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_blink.api.collectives import all_gather, all_reduce, reduce_scatter
from jax_blink.options.settings import override

AXIS = "tp"
#: The all-reduce variants: what sums a row-parallel layer's partial results.
#:
#: - ``psum``: ``lax.psum`` (XLA's all-reduce);
#: - ``blink``: ``jax_blink.all_reduce`` written into the model;
#: - ``switch``: the ``psum`` program unedited, lowered under ``jax_blink.installed()``;
#: - ``none``: the identity (wrong numbers, the same compute): the step without its all-reduces.
VARIANTS = ("psum", "blink", "switch", "none")
#: Where the residual stream lives: ``allreduce`` (whole on every rank, an all-reduce after each
#: row-parallel layer) or ``sequence`` (each rank's rows; all-gather and reduce-scatter instead).
LAYOUTS = ("allreduce", "sequence")


@dataclasses.dataclass(frozen=True)
class Config:
    """A decoder's shape.

    Attributes:
        hidden: model width.
        layers: transformer layers.
        heads: query heads.
        kv_heads: key/value heads (grouped-query attention: ``heads`` a multiple of it).
        mlp: MLP inner width.
        vocab: vocabulary (embedding and LM head, replicated on every rank).
        context: KV-cache positions.
        rope_theta: RoPE's base.
        norm_eps: RMSNorm's epsilon.
    """

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int
    context: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def parameters(self) -> int:
        """Weights of the model (every rank's shards counted once)."""
        h, hd = self.hidden, self.head_dim
        per_layer = h * (self.heads + 2 * self.kv_heads) * hd + self.heads * hd * h + 3 * h * self.mlp + 2 * h
        return self.layers * per_layer + 2 * self.vocab * h + h

    def check(self, tp: int) -> None:
        """Refuse a shape that ``tp`` ranks cannot split, naming the field and the fix."""
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} must be a multiple of heads {self.heads}")
        if self.head_dim % 2:
            raise ValueError(f"the head size hidden / heads = {self.head_dim} must be even (RoPE rotates pairs)")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} must be a multiple of kv_heads {self.kv_heads} (GQA)")
        for name in ("heads", "kv_heads", "mlp"):
            if getattr(self, name) % tp:
                raise ValueError(f"{name} {getattr(self, name)} cannot be split over tp = {tp} ranks: "
                                 f"choose a tp that divides it")


#: ``tiny``: for CPU tests (8 ranks split its 8 KV heads). ``8b``: Llama-3-8B's shapes (hidden
#: 4096, 32 layers, 32 heads / 8 KV heads, MLP 14336) with the vocabulary reduced from 128256 to
#: 32000 (Llama 2's), because the LM head is replicated here: at 128256 it would be 1 GiB per rank,
#: read at every step by every rank.
SIZES = {
    "tiny": Config(hidden=128, layers=2, heads=16, kv_heads=8, mlp=256, vocab=256, context=32),
    "8b": Config(hidden=4096, layers=32, heads=32, kv_heads=8, mlp=14336, vocab=32000, context=512),
}


def param_specs() -> dict[str, P]:
    """Each weight's PartitionSpec: per-rank blocks on axis 1 of the layers' weights (the rank's
    columns of a column-parallel matrix, its rows of a row-parallel one), the rest replicated."""
    split = P(None, AXIS)
    return {"embed": P(), "ln1": P(), "ln2": P(), "wqkv": split, "wo": split, "wgu": split, "wd": split,
            "ln_f": P(), "head": P()}


CACHE_SPEC = P(None, None, None, AXIS)  # [layers, batch, context, kv_heads, head_dim]: by KV head


def init_params(cfg: Config, mesh: Mesh, seed: int = 0) -> dict[str, jax.Array]:
    """Random bfloat16 weights, made on the devices already sharded (the 8B shape is 16 GB).

    Each matrix is normal with standard deviation 1 / sqrt(fan-in); the norms' scales 1 + N(0, 0.1^2).
    """
    tp = mesh.shape[AXIS]
    cfg.check(tp)
    h, hd, L = cfg.hidden, cfg.head_dim, cfg.layers
    q_l, kv_l, m_l = cfg.heads // tp, cfg.kv_heads // tp, cfg.mlp // tp
    shapes = {"embed": (cfg.vocab, h), "ln1": (L, h), "ln2": (L, h),
              "wqkv": (L, tp, h, (q_l + 2 * kv_l) * hd), "wo": (L, tp, q_l * hd, h),
              "wgu": (L, tp, h, 2 * m_l), "wd": (L, tp, m_l, h), "ln_f": (h,), "head": (h, cfg.vocab)}
    fan_in = {"embed": 1, "wqkv": h, "wo": cfg.heads * hd, "wgu": h, "wd": cfg.mlp, "head": h}
    specs = param_specs()

    def make():
        keys = dict(zip(shapes, jax.random.split(jax.random.key(seed), len(shapes))))
        out = {}
        for name, shape in shapes.items():
            z = jax.random.normal(keys[name], shape, jnp.float32)
            out[name] = (1.0 + 0.1 * z if name.startswith("ln") else z * fan_in[name] ** -0.5).astype(jnp.bfloat16)
        return out

    shardings = {k: NamedSharding(mesh, s) for k, s in specs.items()}
    return jax.jit(make, out_shardings=shardings)()


def init_cache(cfg: Config, mesh: Mesh, batch: int, seed: int = 1) -> tuple[jax.Array, jax.Array]:
    """The KV cache, K and V ``[layers, batch, context, kv_heads, head_dim]`` bfloat16, sharded by KV
    head, filled with N(0, 1) values (a prefilled prompt's stand-in)."""
    shape = (cfg.layers, batch, cfg.context, cfg.kv_heads, cfg.head_dim)
    sharding = NamedSharding(mesh, CACHE_SPEC)

    def make():
        kk, kv = jax.random.split(jax.random.key(seed))
        return (jax.random.normal(kk, shape, jnp.float32).astype(jnp.bfloat16),
                jax.random.normal(kv, shape, jnp.float32).astype(jnp.bfloat16))

    return jax.jit(make, out_shardings=(sharding, sharding))()


def _rmsnorm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * scale.astype(jnp.float32)).astype(x.dtype)


def _rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE of ``x [batch, heads, head_dim]`` at one position (``cos``, ``sin``: [head_dim/2])."""
    x32 = x.astype(jnp.float32)
    a, b = jnp.split(x32, 2, axis=-1)
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(x.dtype)


def reducer(variant: str) -> Callable[[jax.Array], jax.Array]:
    """The sum over ``"tp"`` of a row-parallel layer's partial result, as ``variant`` computes it."""
    if variant in ("psum", "switch"):
        return lambda y: lax.psum(y, AXIS)
    if variant == "blink":
        return lambda y: all_reduce(y, AXIS)
    if variant == "none":
        return lambda y: y
    raise ValueError(f"unknown variant {variant!r}; one of {', '.join(VARIANTS)}")


def gather_scatter(variant: str, tp: int) -> tuple[Callable, Callable]:
    """The ``sequence`` layout's all-gather of the rank's rows (along dimension 0) and
    reduce-scatter of a row-parallel partial result back to them, as ``variant`` computes them
    (``none``: the rank's rows repeated, and its own rows of the unsummed result)."""
    if variant in ("psum", "switch"):
        return (lambda x: lax.all_gather(x, AXIS, tiled=True),
                lambda y: lax.psum_scatter(y, AXIS, scatter_dimension=0, tiled=True))
    if variant == "blink":
        return (lambda x: all_gather(x, AXIS, tiled=True),
                lambda y: reduce_scatter(y, AXIS, scatter_dimension=0, tiled=True))
    if variant == "none":
        return (lambda x: jnp.concatenate([x] * tp, axis=0),
                lambda y: lax.dynamic_slice_in_dim(y, lax.axis_index(AXIS) * (y.shape[0] // tp), y.shape[0] // tp))
    raise ValueError(f"unknown variant {variant!r}; one of {', '.join(VARIANTS)}")


def decode_fn(cfg: Config, variant: str, steps: int, extra: int = 0, layout: str = "allreduce",
              tp: int = 1) -> Callable:
    """The per-rank body: ``(params, cache_k, cache_v, tokens, forced, pos) -> (cache_k, cache_v,
    greedy tokens [steps, batch], logits of the last step [batch, vocab] float32)``.

    Step t reads the token fed to it, writes its K and V at ``pos + t`` and takes the greedy
    (argmax) token; the next step is fed ``forced[t]`` where that is >= 0 (teacher forcing: the
    checks feed the same tokens to every variant, so that a rounding difference cannot change the
    path), else the greedy token (real decoding: the benchmark passes -1).

    Args:
        cfg: the shape.
        variant: one of :data:`VARIANTS`.
        steps: tokens decoded by one call.
        extra: all-reduces added per layer that leave the numbers unchanged, each a sum over
            ``"tp"`` of the residual stream masked to rank 0 (rank 0's copy plus zeros: exact in any
            order and accumulation): the step pays for ``extra`` more all-reduces of
            ``batch x hidden`` per layer, on its critical path (``sequence``: all-gather and
            reduce-scatter pairs).
        layout: one of :data:`LAYOUTS`.
        tp: the tensor-parallel size (``sequence``: ``batch`` must be a multiple of it).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; one of {', '.join(LAYOUTS)}")
    sequence = layout == "sequence"
    reduce = reducer(variant)
    gather, scatter = gather_scatter(variant, tp) if sequence else (None, None)
    hd, eps = cfg.head_dim, cfg.norm_eps
    inv_freq = cfg.rope_theta ** (-jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)

    def body(params, cache_k, cache_v, tokens, forced, pos):
        L, batch, context, kv_l, _ = cache_k.shape
        q_l = params["wo"].shape[2] // hd
        group = q_l // kv_l
        positions = jnp.arange(context)

        def layer(carry, w):
            x, ck, cv, p, cos, sin = carry
            l = w["index"]
            h = _rmsnorm(x, w["ln1"], eps)
            if sequence:  # the rank's rows, normalised; the projections take the whole batch
                h = gather(h)
            qkv = h @ w["wqkv"][0]
            q = _rope(qkv[:, : q_l * hd].reshape(batch, q_l, hd), cos, sin)
            k = _rope(qkv[:, q_l * hd: (q_l + kv_l) * hd].reshape(batch, kv_l, hd), cos, sin)
            v = qkv[:, (q_l + kv_l) * hd:].reshape(batch, kv_l, hd)
            ck = lax.dynamic_update_slice(ck, k[None, :, None], (l, 0, p, 0, 0))
            cv = lax.dynamic_update_slice(cv, v[None, :, None], (l, 0, p, 0, 0))
            keys = lax.dynamic_index_in_dim(ck, l, 0, keepdims=False)  # [batch, context, kv_l, hd]
            values = lax.dynamic_index_in_dim(cv, l, 0, keepdims=False)
            s = jnp.einsum("bkgd,bskd->bkgs", q.reshape(batch, kv_l, group, hd), keys,
                           preferred_element_type=jnp.float32) * hd ** -0.5
            s = jnp.where(positions <= p, s, -jnp.inf)
            a = jax.nn.softmax(s, axis=-1).astype(x.dtype)
            o = jnp.einsum("bkgs,bskd->bkgd", a, values).reshape(batch, q_l * hd)
            if sequence:
                x = x + scatter(o @ w["wo"][0])  # row-parallel output projection, to the rank's rows
                h = gather(_rmsnorm(x, w["ln2"], eps))
                gate, up = jnp.split(h @ w["wgu"][0], 2, axis=-1)
                x = x + scatter((jax.nn.silu(gate) * up) @ w["wd"][0])
                for _ in range(extra):
                    whole = gather(x)
                    x = scatter(jnp.where(lax.axis_index(AXIS) == 0, whole, jnp.zeros_like(whole)))
                return (x, ck, cv, p, cos, sin), None
            x = x + reduce(o @ w["wo"][0])  # row-parallel output projection, then the all-reduce
            h = _rmsnorm(x, w["ln2"], eps)
            gate, up = jnp.split(h @ w["wgu"][0], 2, axis=-1)
            x = x + reduce((jax.nn.silu(gate) * up) @ w["wd"][0])  # row-parallel down projection
            for _ in range(extra):
                x = reduce(jnp.where(lax.axis_index(AXIS) == 0, x, jnp.zeros_like(x)))
            return (x, ck, cv, p, cos, sin), None

        layers = {k: params[k] for k in ("ln1", "ln2", "wqkv", "wo", "wgu", "wd")}
        layers["index"] = jnp.arange(L)

        def token_step(carry, t):
            ck, cv, tok, _ = carry
            p = pos + t
            angle = p.astype(jnp.float32) * inv_freq
            x = params["embed"][tok]
            if sequence:  # the rank's rows of the residual stream
                x = lax.dynamic_slice_in_dim(x, lax.axis_index(AXIS) * (batch // tp), batch // tp)
            (x, ck, cv, *_), _ = lax.scan(layer, (x, ck, cv, p, jnp.cos(angle), jnp.sin(angle)), layers)
            if sequence:  # the whole batch for the replicated LM head, typed as replicated (lax's own)
                x = gather(x) if variant == "none" else lax.all_gather(x, AXIS, tiled=True, to="invarying")
            logits = (_rmsnorm(x, params["ln_f"], eps) @ params["head"]).astype(jnp.float32)
            greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            nxt = jnp.where(forced[t] >= 0, forced[t], greedy)
            return (ck, cv, nxt, logits), greedy

        logits0 = jnp.zeros((batch, params["head"].shape[1]), jnp.float32)
        (cache_k, cache_v, _, logits), greedy = lax.scan(
            token_step, (cache_k, cache_v, tokens, logits0), jnp.arange(steps))
        return cache_k, cache_v, greedy, logits

    return body


def decode_program(cfg: Config, mesh: Mesh, variant: str, steps: int, extra: int = 0,
                   layout: str = "allreduce") -> Callable:
    """The jitted ``shard_map`` of :func:`decode_fn` over ``mesh``'s ``"tp"`` axis, the cache donated
    (updated in place, call after call). Not yet traced: see :func:`lowering_context`."""
    specs = param_specs()
    # `none` leaves each rank's residual stream its own: shard_map may not check replication.
    check = variant != "none"
    fn = jax.shard_map(decode_fn(cfg, variant, steps, extra, layout, mesh.shape[AXIS]), mesh=mesh,
                       in_specs=(specs, CACHE_SPEC, CACHE_SPEC, P(), P(), P()),
                       out_specs=(CACHE_SPEC, CACHE_SPEC, P(), P()), check_vma=check)
    return jax.jit(fn, donate_argnums=(1, 2))


@contextlib.contextmanager
def lowering_context(variant: str, dispatch: str = "blink"):
    """What must be in force while a variant's program is traced and lowered: jax_blink's dispatch
    option (``blink``: the executor at every size, even where ``auto`` would pick psum) and, for
    ``switch``, the switch itself."""
    if variant in ("psum", "none"):
        yield
        return
    with override(dispatch=dispatch):
        if variant == "switch":
            import jax_blink  # the package's switch (layer 3), as a user turns it on
            with jax_blink.installed():
                yield
        else:
            yield
