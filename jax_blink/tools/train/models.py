"""Two models people train, in flax NNX: a ResNet-18- or ResNet-50-shaped image classifier and a
GPT-2-small- or medium-shaped language model (``--size medium``: ResNet-50, GPT-2 medium). Depth and width are arguments, so that a tiny one runs on CPU host devices;
the sizes ``tiny``, ``small`` and ``full`` (ResNet-18 on 224x224 ImageNet shapes, GPT-2 small's
124M parameters) are in :data:`SIZES`.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    blocks: int = 2          # basic blocks per stage (ResNet-18: 2, in 4 stages); depth 50 ignores it
    depth: int = 18          # 18: basic blocks; 50: ResNet-50's bottleneck blocks (3, 4, 6, 3 per stage)
    width: int = 64          # channels of the first stage (doubled at each of the next three)
    image_size: int = 224
    classes: int = 1000
    batch: int = 32          # images per device and step


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    layers: int = 12
    width: int = 768
    heads: int = 12
    vocab: int = 50257
    seq_len: int = 1024
    batch: int = 4           # sequences per device and step


#: --size presets; any field can be overridden from the command line.
SIZES = {
    "resnet": {
        "tiny": ResNetConfig(blocks=1, width=8, image_size=16, classes=10, batch=4),
        "small": ResNetConfig(blocks=2, width=32, image_size=32, classes=100, batch=16),
        "full": ResNetConfig(),
        "medium": ResNetConfig(depth=50),            # ResNet-50 (25.6M parameters), 224 px
    },
    "gpt2": {
        "tiny": GPT2Config(layers=2, width=32, heads=2, vocab=128, seq_len=16, batch=2),
        "small": GPT2Config(layers=4, width=256, heads=4, vocab=4096, seq_len=128, batch=4),
        "full": GPT2Config(),
        "medium": GPT2Config(layers=24, width=1024, heads=16, batch=2),  # GPT-2 medium (355M)
    },
}


# ---------------------------------------------------------------------------------------------
# ResNet-18 shape: a stem, 4 stages of basic blocks (3x3 conv, BN, ReLU, 3x3 conv, BN, + shortcut),
# global average pool, a linear classifier.

class BasicBlock(nnx.Module):
    def __init__(self, cin: int, cout: int, stride: int, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(cin, cout, (3, 3), strides=stride, use_bias=False, rngs=rngs)
        self.bn1 = nnx.BatchNorm(cout, momentum=0.9, rngs=rngs)
        self.conv2 = nnx.Conv(cout, cout, (3, 3), use_bias=False, rngs=rngs)
        self.bn2 = nnx.BatchNorm(cout, momentum=0.9, rngs=rngs)
        self.project = stride != 1 or cin != cout  # projection shortcut (ResNet's option B)
        if self.project:
            self.shortcut = nnx.Conv(cin, cout, (1, 1), strides=stride, use_bias=False, rngs=rngs)
            self.shortcut_bn = nnx.BatchNorm(cout, momentum=0.9, rngs=rngs)

    def __call__(self, x):
        y = nnx.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        s = self.shortcut_bn(self.shortcut(x)) if self.project else x
        return nnx.relu(y + s)


class Bottleneck(nnx.Module):
    """ResNet-50's block: 1x1 conv down to ``mid`` channels, 3x3 conv (the stride), 1x1 conv up to
    4 * mid, each with BatchNorm, plus the (projected) shortcut."""

    def __init__(self, cin: int, mid: int, stride: int, *, rngs: nnx.Rngs):
        cout = 4 * mid
        self.conv1 = nnx.Conv(cin, mid, (1, 1), use_bias=False, rngs=rngs)
        self.bn1 = nnx.BatchNorm(mid, momentum=0.9, rngs=rngs)
        self.conv2 = nnx.Conv(mid, mid, (3, 3), strides=stride, use_bias=False, rngs=rngs)
        self.bn2 = nnx.BatchNorm(mid, momentum=0.9, rngs=rngs)
        self.conv3 = nnx.Conv(mid, cout, (1, 1), use_bias=False, rngs=rngs)
        self.bn3 = nnx.BatchNorm(cout, momentum=0.9, rngs=rngs)
        self.project = stride != 1 or cin != cout
        if self.project:
            self.shortcut = nnx.Conv(cin, cout, (1, 1), strides=stride, use_bias=False, rngs=rngs)
            self.shortcut_bn = nnx.BatchNorm(cout, momentum=0.9, rngs=rngs)

    def __call__(self, x):
        y = nnx.relu(self.bn1(self.conv1(x)))
        y = nnx.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        s = self.shortcut_bn(self.shortcut(x)) if self.project else x
        return nnx.relu(y + s)


#: Bottleneck blocks per stage of ResNet-50.
RESNET50_STAGES = (3, 4, 6, 3)


class ResNet(nnx.Module):
    def __init__(self, cfg: ResNetConfig, *, rngs: nnx.Rngs):
        w = cfg.width
        # ImageNet stem (7x7 stride 2, max-pool) for large images; CIFAR's 3x3 for small ones.
        self.imagenet_stem = cfg.image_size >= 64
        k, s = ((7, 7), 2) if self.imagenet_stem else ((3, 3), 1)
        self.stem = nnx.Conv(3, w, k, strides=s, use_bias=False, rngs=rngs)
        self.stem_bn = nnx.BatchNorm(w, momentum=0.9, rngs=rngs)
        blocks, cin = [], w
        if cfg.depth not in (18, 50):
            raise ValueError(f"ResNet depth {cfg.depth} is not built here; 18 (basic blocks) or 50 (bottleneck)")
        for stage in range(4):
            if cfg.depth == 50:
                for b in range(RESNET50_STAGES[stage]):
                    blocks.append(Bottleneck(cin, w << stage, 2 if (stage > 0 and b == 0) else 1, rngs=rngs))
                    cin = 4 * (w << stage)
                continue
            cout = w << stage
            for b in range(cfg.blocks):
                blocks.append(BasicBlock(cin, cout, 2 if (stage > 0 and b == 0) else 1, rngs=rngs))
                cin = cout
        self.blocks = nnx.List(blocks)
        self.head = nnx.Linear(cin, cfg.classes, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.stem_bn(self.stem(x)))
        if self.imagenet_stem:
            x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(axis=(1, 2)))


def resnet_loss(model: ResNet, batch) -> jax.Array:
    images, labels = batch
    logits = model(images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


# ---------------------------------------------------------------------------------------------
# GPT-2 shape: token and position embeddings, pre-LayerNorm blocks (causal self-attention, 4x MLP
# with GELU), a final LayerNorm and an output layer tied to the token embedding.

class CausalSelfAttention(nnx.Module):
    def __init__(self, cfg: GPT2Config, *, rngs: nnx.Rngs):
        if cfg.width % cfg.heads:
            raise ValueError(f"width {cfg.width} is not a multiple of heads {cfg.heads}")
        self.heads = cfg.heads
        init = nnx.initializers.normal(0.02)
        self.qkv = nnx.Linear(cfg.width, 3 * cfg.width, kernel_init=init, rngs=rngs)
        # GPT-2 scales the residual projections by 1/sqrt(2 * layers).
        self.proj = nnx.Linear(cfg.width, cfg.width, rngs=rngs,
                               kernel_init=nnx.initializers.normal(0.02 / (2 * cfg.layers) ** 0.5))

    def __call__(self, x):
        b, t, c = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(b, t, 3, self.heads, c // self.heads), 3, axis=2)
        y = jax.nn.dot_product_attention(q[:, :, 0], k[:, :, 0], v[:, :, 0], is_causal=True)
        return self.proj(y.reshape(b, t, c))


class Block(nnx.Module):
    def __init__(self, cfg: GPT2Config, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.ln1 = nnx.LayerNorm(cfg.width, rngs=rngs)
        self.attn = CausalSelfAttention(cfg, rngs=rngs)
        self.ln2 = nnx.LayerNorm(cfg.width, rngs=rngs)
        self.fc = nnx.Linear(cfg.width, 4 * cfg.width, kernel_init=init, rngs=rngs)
        self.out = nnx.Linear(4 * cfg.width, cfg.width, rngs=rngs,
                              kernel_init=nnx.initializers.normal(0.02 / (2 * cfg.layers) ** 0.5))

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(nnx.gelu(self.fc(self.ln2(x)), approximate=True))


class GPT2(nnx.Module):
    def __init__(self, cfg: GPT2Config, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.wte = nnx.Embed(cfg.vocab, cfg.width, embedding_init=init, rngs=rngs)
        self.wpe = nnx.Embed(cfg.seq_len, cfg.width, embedding_init=nnx.initializers.normal(0.01), rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.layers)])
        self.ln_f = nnx.LayerNorm(cfg.width, rngs=rngs)

    def __call__(self, tokens):
        x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.wte.attend(self.ln_f(x))  # tied output layer, as GPT-2


def gpt2_loss(model: GPT2, batch) -> jax.Array:
    tokens = batch
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


MODELS = {"resnet": (ResNet, resnet_loss), "gpt2": (GPT2, gpt2_loss)}


def build(model: str, cfg, seed: int = 0):
    """(the model, its loss function ``loss(model, batch)``)."""
    cls, loss = MODELS[model]
    return cls(cfg, rngs=nnx.Rngs(seed)), loss


def optimizer(model: str, lr: float | None = None) -> optax.GradientTransformation:
    """What each is usually trained with: SGD with momentum and weight decay for the ResNet,
    AdamW for GPT-2."""
    if model == "resnet":
        return optax.chain(optax.add_decayed_weights(5e-4), optax.sgd(lr or 0.1, momentum=0.9))
    return optax.adamw(lr or 1e-3, b1=0.9, b2=0.95, weight_decay=0.1)
