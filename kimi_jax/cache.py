"""Static decode cache: one pytree of fixed-shape arrays per layer, plus per-sequence lengths.

* KDA layer: the last ``W-1`` *pre-conv* q/k/v projection rows (short-conv tails) and the recurrent state
  ``[B, H, K, V]`` in float32. Independent of context length.
* MLA layer: the compressed latent ``c [B, S, R]`` (after kv_a_layernorm) and the shared unrotated key part
  ``kpe [B, S, O]``: 576 values per token for K3, the whole cost of a full-attention layer.
* GQA layer: keys (already rotated) and values ``[B, S, G, K]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kimi_jax.config import ModelConfig


@struct.dataclass
class KDACache:
    conv_q: jax.Array  # [B, W-1, P] activation dtype
    conv_k: jax.Array  # [B, W-1, P]
    conv_v: jax.Array  # [B, W-1, P]
    state: jax.Array  # [B, H, K, V] float32


@struct.dataclass
class MLACache:
    c: jax.Array  # [B, S, R]
    kpe: jax.Array  # [B, S, O]


@struct.dataclass
class KVCache:
    k: jax.Array  # [B, S, G, K]
    v: jax.Array  # [B, S, G, K]


@struct.dataclass
class Cache:
    layers: tuple  # one of the above per layer
    lengths: jax.Array  # [B] int32: tokens already in the cache per sequence

    @property
    def max_len(self) -> int:
        for layer in self.layers:
            if isinstance(layer, MLACache):
                return layer.c.shape[1]
            if isinstance(layer, KVCache):
                return layer.k.shape[1]
        return 1 << 31  # a pure-KDA model has no length limit

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]


def _layer_shapes(cfg: ModelConfig, kind: str, batch: int, max_len: int, dtype):
    if kind == "kda":
        k = cfg.kda
        tail = jax.ShapeDtypeStruct((batch, k.conv_size - 1, k.proj), dtype)
        return KDACache(tail, tail, tail, jax.ShapeDtypeStruct((batch, k.num_heads, k.head_dim, k.head_dim), jnp.float32))
    if kind == "mla":
        m = cfg.mla
        return MLACache(jax.ShapeDtypeStruct((batch, max_len, m.kv_lora_rank), dtype),
                        jax.ShapeDtypeStruct((batch, max_len, m.qk_rope_dim), dtype))
    g = cfg.gqa
    kv = jax.ShapeDtypeStruct((batch, max_len, g.num_kv_heads, g.head_dim), dtype)
    return KVCache(kv, kv)


def cache_shapes(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> Cache:
    """The cache as ``ShapeDtypeStruct`` leaves: no memory."""
    layers = tuple(_layer_shapes(cfg, kind, batch, max_len, jnp.dtype(dtype)) for kind in cfg.attn_types)
    return Cache(layers, jax.ShapeDtypeStruct((batch,), jnp.int32))


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16, sharding=None) -> Cache:
    """A zeroed cache. ``sharding``: optional pytree of shardings matching :func:`cache_shapes`."""
    shapes = cache_shapes(cfg, batch, max_len, dtype)
    if sharding is None:
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), out_shardings=sharding)()


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> dict:
    """Bytes of the cache by kind: {"kda_state", "kda_conv", "mla", "kv", "total"}."""
    out = {"kda_state": 0, "kda_conv": 0, "mla": 0, "kv": 0}
    for layer in cache_shapes(cfg, batch, max_len, dtype).layers:
        nbytes = lambda s: s.size * s.dtype.itemsize
        if isinstance(layer, KDACache):
            out["kda_state"] += nbytes(layer.state)
            out["kda_conv"] += 3 * nbytes(layer.conv_q)
        elif isinstance(layer, MLACache):
            out["mla"] += nbytes(layer.c) + nbytes(layer.kpe)
        else:
            out["kv"] += nbytes(layer.k) + nbytes(layer.v)
    out["total"] = sum(out.values())
    return out
