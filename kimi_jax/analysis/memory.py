"""Decode-cache memory: cache bytes vs context length from :func:`kimi_jax.model.cache.cache_bytes` (shapes only),
the ``nbytes`` of the arrays :func:`kimi_jax.model.cache.init_cache` really allocates, the context from which K3's
MLA latent cache outweighs its KDA state, and the all-MLA counterfactual of a model."""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax.model.cache import cache_bytes, init_cache
from kimi_jax.model.config import ModelConfig


def all_mla(cfg: ModelConfig) -> ModelConfig:
    """The same model with every layer full attention (MLA): the hypothetical K3 without linear attention."""
    if cfg.mla is None:
        raise ValueError(f"all_mla: {cfg.family} has no MLA config")
    return cfg.replace(attn_types=("mla",) * cfg.num_layers)


def cache_curve(cfg: ModelConfig, contexts: Sequence[int], *, batch: int = 1, dtype=jnp.bfloat16) -> dict:
    """Cache bytes vs context length from :func:`kimi_jax.model.cache.cache_bytes`: {kind: [len(contexts)] int64} with
    kinds kda_state, kda_conv, mla, kv, total."""
    rows = [cache_bytes(cfg, batch, int(n), dtype) for n in contexts]
    return {k: np.asarray([r[k] for r in rows], np.int64) for k in rows[0]}


def measured_cache_bytes(cfg: ModelConfig, context: int, *, batch: int = 1, dtype=jnp.bfloat16) -> int:
    """Allocate the cache with :func:`kimi_jax.model.cache.init_cache`, sum the ``nbytes`` of its arrays (the per-sequence
    ``lengths`` excluded, as in ``cache_bytes``), free it."""
    cache = init_cache(cfg, batch, int(context), dtype)
    jax.block_until_ready(cache)
    total = sum(a.nbytes for a in jax.tree.leaves(cache.layers))
    for a in jax.tree.leaves(cache):
        a.delete()
    return int(total)


def crossover_context(cfg: ModelConfig, *, batch: int = 1, dtype=jnp.bfloat16) -> int | None:
    """The context length (tokens) from which the MLA latent cache outweighs the KDA state; None if the model
    lacks either."""
    one = cache_bytes(cfg, batch, 1, dtype)
    per_token = one["mla"] + one["kv"]
    if not one["kda_state"] or not per_token:
        return None
    return math.ceil(one["kda_state"] / per_token)
