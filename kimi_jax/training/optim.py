"""The optimizer: global-norm clipping, then AdamW (optax) on a linear-warmup + cosine learning rate.

Weight decay applies to matrices only (a parameter whose per-layer shape has two or more dimensions): norms,
AttnRes projections, decay parameters and biases are not pulled towards zero.
"""

from __future__ import annotations

import dataclasses

import jax
import optax


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """``steps``: the schedule's length (the cosine reaches ``lr * final_lr_frac`` there)."""

    lr: float = 1e-3
    steps: int = 1000
    warmup: int = 100
    final_lr_frac: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip: float = 1.0  # max global gradient norm; None or 0: no clipping


def schedule(c: OptimConfig):
    """Learning rate at step ``t``: ``lr * t / warmup`` during warmup, then cosine to ``lr * final_lr_frac``."""
    return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=c.lr, warmup_steps=c.warmup,
                                              decay_steps=max(c.steps, c.warmup + 1), end_value=c.lr * c.final_lr_frac)


def _key(k):
    return getattr(k, "key", getattr(k, "name", getattr(k, "idx", None)))


def decay_mask(params):
    """True for the leaves weight decay applies to: two or more dimensions per layer (a leaf under ``stack``, a
    scanned layer stack, carries a leading repetition dimension)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: x.ndim - int(bool(p) and _key(p[0]) == "stack") >= 2, params)


def optimizer(c: OptimConfig, mask=None) -> optax.GradientTransformation:
    """``clip_by_global_norm(c.clip)`` then ``adamw``; ``mask``: weight-decay mask (a pytree or a callable)."""
    adamw = optax.adamw(schedule(c), b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay,
                        mask=decay_mask if mask is None else mask)
    return optax.chain(optax.clip_by_global_norm(c.clip), adamw) if c.clip else adamw
