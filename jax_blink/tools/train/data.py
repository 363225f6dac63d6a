"""Synthetic data that a model can learn, made from a seed (no download).

Images: each class has a fixed random template; an image is its class's template plus noise, so
the classifier's loss falls. Tokens: sequences of a fixed random Markov chain in which every token
has a few likely successors, so the language model's loss falls toward the chain's entropy.
"""
from __future__ import annotations

import numpy as np

from jax_blink.tools.train.models import GPT2Config, ResNetConfig

SUCCESSORS = 4  # likely next tokens per token in the Markov chain


def image_batches(cfg: ResNetConfig, global_batch: int, count: int, seed: int = 0):
    """``count`` batches of (images float32 [B, H, W, 3], labels int32 [B])."""
    rng = np.random.default_rng(seed)
    templates = rng.standard_normal((cfg.classes, cfg.image_size, cfg.image_size, 3), dtype=np.float32)
    out = []
    for _ in range(count):
        labels = rng.integers(0, cfg.classes, global_batch).astype(np.int32)
        noise = rng.standard_normal((global_batch, cfg.image_size, cfg.image_size, 3), dtype=np.float32)
        out.append((templates[labels] + 2.0 * noise, labels))
    return out


def token_batches(cfg: GPT2Config, global_batch: int, count: int, seed: int = 0):
    """``count`` batches of int32 [B, seq_len + 1] tokens (inputs and their next-token targets)."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, cfg.vocab, (cfg.vocab, SUCCESSORS))
    probs = rng.dirichlet(np.ones(SUCCESSORS), cfg.vocab)
    cum = probs.cumsum(axis=1)
    out = []
    for _ in range(count):
        tokens = np.empty((global_batch, cfg.seq_len + 1), np.int64)
        tokens[:, 0] = rng.integers(0, cfg.vocab, global_batch)
        for t in range(1, cfg.seq_len + 1):
            prev = tokens[:, t - 1]
            pick = (rng.random(global_batch)[:, None] > cum[prev]).sum(axis=1)
            tokens[:, t] = successors[prev, np.minimum(pick, SUCCESSORS - 1)]
        out.append(tokens.astype(np.int32))
    return out


def batches(model: str, cfg, global_batch: int, count: int, seed: int = 0):
    return (image_batches if model == "resnet" else token_batches)(cfg, global_batch, count, seed)
