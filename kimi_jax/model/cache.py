"""Static decode cache: one pytree of fixed-shape arrays per layer, plus per-sequence lengths.

* KDA layer: the last ``W-1`` *pre-conv* q/k/v projection rows (short-conv tails) and the recurrent state
  ``[B, H, K, U]`` in float32. Independent of context length.
* MLA layer: the compressed latent ``c [B, S, R]`` (after kv_a_layernorm) and the shared unrotated key part
  ``kpe [B, S, O]``: 576 values per token for K3, the whole cost of a full-attention layer.
* GQA layer: keys (already rotated) ``[B, S, G, K]`` and values ``[B, S, G, U]`` (U = K).

Paged form (:func:`paged_cache`, the serving engine's): KDA entries are per *slot* as above (``B`` = slots), while
the MLA and GQA entries hold one page pool per layer, ``c [n_pages, page_size, R]`` / ``k [n_pages, page_size, G,
K]``, shared by every slot through a page table the model receives with each call (``page_table``).

With scanned layers (:mod:`kimi_jax.model.layer_plan`) the entries of the scanned run are stacked like their parameters:
``Cache.stack[j]`` holds position ``j`` of the group for every repetition (leading dimension), and those layers'
``Cache.layers`` entries are None.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kimi_jax.model.config import ModelConfig
from kimi_jax.model.layer_plan import layer_plan


@struct.dataclass
class KDACache:
    conv_q: jax.Array  # [B, W-1, P] activation dtype
    conv_k: jax.Array  # [B, W-1, P]
    conv_v: jax.Array  # [B, W-1, P]
    state: jax.Array  # [B, H, K, U] float32


@struct.dataclass
class MLACache:
    c: jax.Array  # [B, S, R]
    kpe: jax.Array  # [B, S, O]


@struct.dataclass
class KVCache:
    k: jax.Array  # [B, S, G, K]
    v: jax.Array  # [B, S, G, U]


@struct.dataclass
class Cache:
    layers: tuple  # one of the above per layer (None for a scanned layer)
    lengths: jax.Array  # [B] int32: tokens already in the cache per sequence
    stack: tuple = ()  # scanned layers: one entry per position of the group, stacked over repetitions [count, ...]

    def entries(self):
        """``(entry, repetitions)`` for every entry: unrolled layers once, stacked group positions with their
        repetition count (their arrays carry it as a leading dimension)."""
        out = [(e, 1) for e in self.layers if e is not None]
        for e in self.stack:
            out.append((e, jax.tree.leaves(e)[0].shape[0]))
        return out

    @property
    def max_len(self) -> int:
        stacked = [(e, 1) for e in self.stack]  # a stacked entry's sequence axis comes after the repetitions
        for entry, lead in [(e, 0) for e in self.layers if e is not None] + stacked:
            if isinstance(entry, MLACache):
                return entry.c.shape[1 + lead]
            if isinstance(entry, KVCache):
                return entry.k.shape[1 + lead]
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


def cache_shapes(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16, *, scan: bool = False) -> Cache:
    """The cache as ``ShapeDtypeStruct`` leaves: no memory. ``scan``: laid out for a model with scanned layers."""
    plan = layer_plan(cfg, scan)
    dt = jnp.dtype(dtype)
    layers = tuple(None if i in plan.scanned else _layer_shapes(cfg, kind, batch, max_len, dt)
                   for i, kind in enumerate(cfg.attn_types))
    stacked = lambda s: jax.ShapeDtypeStruct((plan.count, *s.shape), s.dtype)  # noqa: E731
    stack = tuple(jax.tree.map(stacked, _layer_shapes(cfg, cfg.attn_types[plan.layer(j, 0)], batch, max_len, dt))
                  for j in range(plan.period if plan.count else 0))
    return Cache(layers, jax.ShapeDtypeStruct((batch,), jnp.int32), stack)


def paged_cache_shapes(cfg: ModelConfig, slots: int, n_pages: int, page_size: int, dtype=jnp.bfloat16, *,
                       scan: bool = False) -> Cache:
    """The paged cache as ``ShapeDtypeStruct`` leaves: per-slot KDA entries, ``[n_pages, page_size, ...]`` pools."""
    plan = layer_plan(cfg, scan)
    dt = jnp.dtype(dtype)

    def entry(kind):
        if kind == "kda":
            return _layer_shapes(cfg, kind, slots, 0, dt)
        return _layer_shapes(cfg, kind, n_pages, page_size, dt)  # [n_pages, page_size, ...]: a page as a "sequence"

    layers = tuple(None if i in plan.scanned else entry(kind) for i, kind in enumerate(cfg.attn_types))
    stacked = lambda s: jax.ShapeDtypeStruct((plan.count, *s.shape), s.dtype)  # noqa: E731
    stack = tuple(jax.tree.map(stacked, entry(cfg.attn_types[plan.layer(j, 0)]))
                  for j in range(plan.period if plan.count else 0))
    return Cache(layers, jax.ShapeDtypeStruct((slots,), jnp.int32), stack)


def paged_cache(cfg: ModelConfig, slots: int, n_pages: int, page_size: int, dtype=jnp.bfloat16, *,
                scan: bool = False) -> Cache:
    """A zeroed paged cache (see the module docstring)."""
    shapes = paged_cache_shapes(cfg, slots, n_pages, page_size, dtype, scan=scan)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16, sharding=None, *,
               scan: bool = False) -> Cache:
    """A zeroed cache. ``sharding``: optional pytree of shardings matching :func:`cache_shapes`."""
    shapes = cache_shapes(cfg, batch, max_len, dtype, scan=scan)
    if sharding is None:
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), out_shardings=sharding)()


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> dict:
    """Bytes of the cache by kind: {"kda_state", "kda_conv", "mla", "kv", "total"}."""
    out = {"kda_state": 0, "kda_conv": 0, "mla": 0, "kv": 0}
    for layer, _ in cache_shapes(cfg, batch, max_len, dtype).entries():
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
