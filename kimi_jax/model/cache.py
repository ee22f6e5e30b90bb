"""Static decode cache: one pytree of fixed-shape arrays per layer, plus per-sequence lengths.

* KDA layer: the last ``W-1`` *pre-conv* q/k/v projection rows (short-conv tails) and the recurrent state
  ``[B, H, K, U]`` in float32 (float64 in a float64 cache: the compute dtype of its run). Independent of context
  length.
* MLA layer: the compressed latent ``c [B, S, R]`` (after kv_a_layernorm) and the shared unrotated key part
  ``kpe [B, S, O]``: 576 values per token for K3, the whole cost of a full-attention layer. K3.1 adds the DSA
  indexer keys ``ik [B, S, DI]`` (128 values per token), written and paged like the latent.
* GQA layer: keys (already rotated) ``[B, S, G, K]`` and values ``[B, S, G, U]`` (U = K).

Two storage options, chosen where the cache is built (every function below takes them):

* ``kv_cache="int8"``: each MLA / GQA field is a :class:`kernels_pallas.cache_quant.Int8Rows` (int8 codes and a
  float32 scale per row: per token for ``c`` and ``kpe``, per token and kv head for ``k`` and ``v``), quantized as
  rows are written; the attention kernels read the codes. K3: 576 + 8 bytes per MLA token instead of 1152 (bf16).
* ``kv_cache="int8-index"`` (K3.1 only): only the DSA indexer keys ``ik`` are int8 rows (one scale per token): they
  only rank keys for the top-k selection, while ``c`` and ``kpe`` stay in the model dtype (the attention reads them
  exactly). K3.1: 128 + 4 bytes of indexer key per MLA token instead of 256 (bf16). Every reader takes a field as it
  is (``cache_quant.dense`` / ``is_int8`` per field), so an entry may mix int8 and plain fields.
* ``kda_state=jnp.bfloat16``: the KDA state stored in bfloat16, widened to float32 for each update and rounded back
  when stored (half the bytes; the recurrence itself stays float32).

Paged form (:func:`paged_cache`, the serving engine's): KDA entries are per *slot* as above (``B`` = slots), while
the MLA and GQA entries hold one page pool per layer, ``c [n_pages, page_size, R]`` / ``k [n_pages, page_size, G,
K]``, shared by every slot through a page table the model receives with each call (``page_table``).

With scanned layers (:mod:`kimi_jax.model.layer_plan`) the entries of the scanned run are stacked like their parameters:
``Cache.stack[j]`` holds position ``j`` of the group for every repetition (leading dimension), and those layers'
``Cache.layers`` entries are None.

Verification (speculative decoding, :func:`for_verify`): a call over ``T`` drafted positions must not commit the KDA
state past the last accepted one. Its KDA entries carry a :class:`KDAVerify` record; the layer then leaves the state
and conv tails as they were and records its recurrence inputs, and
:func:`kimi_jax.model.attention.commit_verified` replays the accepted prefix from them (an exact rollback, without
one state per position).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kernels_pallas import cache_quant
from kernels_pallas.cache_quant import Int8Rows
from kimi_jax.model.config import ModelConfig
from kimi_jax.model.layer_plan import layer_plan


@struct.dataclass
class KDAVerify:
    """What a verify call fed one KDA layer's recurrence (padding and positions past its lengths inert: g = beta = 0).
    Dtypes as the layer hands them to the kernel, so that replaying a prefix repeats the decode steps exactly."""

    rows_q: jax.Array  # [B, T, P] activation dtype: this call's pre-conv rows (the next conv tails come from them)
    rows_k: jax.Array  # [B, T, P]
    rows_v: jax.Array  # [B, T, P]
    q: jax.Array  # [B, T, H, K] float32, L2-normalised
    k: jax.Array  # [B, T, H, K] float32, L2-normalised
    v: jax.Array  # [B, T, H, U] activation dtype
    g: jax.Array  # [B, T, H, K] float32 log decay
    beta: jax.Array  # [B, T, H] float32


@struct.dataclass
class KDACache:
    conv_q: jax.Array  # [B, W-1, P] activation dtype
    conv_k: jax.Array  # [B, W-1, P]
    conv_v: jax.Array  # [B, W-1, P]
    state: jax.Array  # [B, H, K, U] float32 (or bfloat16: kda_state)
    verify: KDAVerify | None = None  # a verify call's record (:func:`for_verify`); None otherwise


@struct.dataclass
class MLACache:
    c: jax.Array | Int8Rows  # [B, S, R]
    kpe: jax.Array | Int8Rows  # [B, S, O]
    ik: jax.Array | Int8Rows | None = None  # [B, S, DI] K3.1: the DSA indexer keys (after k_norm); None without one


@struct.dataclass
class KVCache:
    k: jax.Array | Int8Rows  # [B, S, G, K]
    v: jax.Array | Int8Rows  # [B, S, G, U]


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


def _state_dtype(kda_state, dtype=jnp.float32):
    """The KDA state's dtype in a cache of ``dtype``: ``kda_state``, or (None) the run's compute dtype, float32 but
    in a float64 cache."""
    try:
        dt = jnp.dtype(jnp.promote_types(dtype, jnp.float32) if kda_state is None else kda_state)
    except TypeError:
        dt = None
    if dt not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float64)):
        raise ValueError(f"kda_state={kda_state!r}: choose float32 (None), bfloat16 or (a float64 run) float64")
    if dt == jnp.float64 and not jax.config.read("jax_enable_x64"):
        raise ValueError(f"kda_state={kda_state!r} in a {jnp.dtype(dtype).name} cache: a float64 state needs "
                         "jax_enable_x64 (jax.config.update('jax_enable_x64', True)); else float32 (None) or bfloat16")
    return dt


def _layer_shapes(cfg: ModelConfig, kind: str, batch: int, max_len: int, dtype, kv_cache=None, kda_state=None):
    def rows(shape, index=False):  # index: the DSA indexer keys, int8 under "int8-index" too
        if kv_cache == "int8" or (index and kv_cache == "int8-index"):
            return Int8Rows.shapes(shape)
        return jax.ShapeDtypeStruct(shape, dtype)

    if kind == "kda":
        k = cfg.kda
        tail = jax.ShapeDtypeStruct((batch, k.conv_size - 1, k.proj), dtype)
        state = jax.ShapeDtypeStruct((batch, k.num_heads, k.head_dim, k.head_dim), _state_dtype(kda_state, dtype))
        return KDACache(tail, tail, tail, state)
    if kind == "mla":
        m = cfg.mla
        ik = None if m.indexer is None else rows((batch, max_len, m.indexer.head_dim), index=True)
        return MLACache(rows((batch, max_len, m.kv_lora_rank)), rows((batch, max_len, m.qk_rope_dim)), ik)
    g = cfg.gqa
    return KVCache(rows((batch, max_len, g.num_kv_heads, g.head_dim)), rows((batch, max_len, g.num_kv_heads, g.head_dim)))


def _options(cfg: ModelConfig, kv_cache, kda_state):
    cache_quant.check(kv_cache)
    if kv_cache == "int8-index" and cfg.indexer is None:
        raise ValueError(f"kv_cache='int8-index' stores K3.1's DSA indexer keys in int8, but this {cfg.family} model "
                         "has no indexer: use kv_cache='int8' (every cache field) or None")
    _state_dtype(kda_state)
    return dict(kv_cache=kv_cache, kda_state=kda_state)


def cache_shapes(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16, *, scan: bool = False,
                 kv_cache: str | None = None, kda_state=None) -> Cache:
    """The cache as ``ShapeDtypeStruct`` leaves: no memory. ``scan``: laid out for a model with scanned layers.
    ``kv_cache`` (None, ``"int8"`` or ``"int8-index"``) and ``kda_state`` (None = float32, float64 in a float64
    cache; or bfloat16): the storage options of the module docstring."""
    opts = _options(cfg, kv_cache, kda_state)
    plan = layer_plan(cfg, scan)
    dt = jnp.dtype(dtype)
    layers = tuple(None if i in plan.scanned else _layer_shapes(cfg, kind, batch, max_len, dt, **opts)
                   for i, kind in enumerate(cfg.attn_types))
    stacked = lambda s: jax.ShapeDtypeStruct((plan.count, *s.shape), s.dtype)  # noqa: E731
    stack = tuple(jax.tree.map(stacked, _layer_shapes(cfg, cfg.attn_types[plan.layer(j, 0)], batch, max_len, dt,
                                                      **opts))
                  for j in range(plan.period if plan.count else 0))
    return Cache(layers, jax.ShapeDtypeStruct((batch,), jnp.int32), stack)


def paged_cache_shapes(cfg: ModelConfig, slots: int, n_pages: int, page_size: int, dtype=jnp.bfloat16, *,
                       scan: bool = False, kv_cache: str | None = None, kda_state=None) -> Cache:
    """The paged cache as ``ShapeDtypeStruct`` leaves: per-slot KDA entries, ``[n_pages, page_size, ...]`` pools
    (int8 pools with ``kv_cache="int8"``: codes ``[n_pages, page_size, ...]``, scales ``[n_pages, page_size, ...,
    1]``; ``"int8-index"``: the indexer key pools alone)."""
    opts = _options(cfg, kv_cache, kda_state)
    plan = layer_plan(cfg, scan)
    dt = jnp.dtype(dtype)

    def entry(kind):
        if kind == "kda":
            return _layer_shapes(cfg, kind, slots, 0, dt, **opts)
        # [n_pages, page_size, ...]: a page as a "sequence"
        return _layer_shapes(cfg, kind, n_pages, page_size, dt, **opts)

    layers = tuple(None if i in plan.scanned else entry(kind) for i, kind in enumerate(cfg.attn_types))
    stacked = lambda s: jax.ShapeDtypeStruct((plan.count, *s.shape), s.dtype)  # noqa: E731
    stack = tuple(jax.tree.map(stacked, entry(cfg.attn_types[plan.layer(j, 0)]))
                  for j in range(plan.period if plan.count else 0))
    return Cache(layers, jax.ShapeDtypeStruct((slots,), jnp.int32), stack)


def paged_cache(cfg: ModelConfig, slots: int, n_pages: int, page_size: int, dtype=jnp.bfloat16, *,
                scan: bool = False, kv_cache: str | None = None, kda_state=None) -> Cache:
    """A zeroed paged cache (see the module docstring)."""
    shapes = paged_cache_shapes(cfg, slots, n_pages, page_size, dtype, scan=scan, kv_cache=kv_cache,
                                kda_state=kda_state)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16, sharding=None, *,
               scan: bool = False, kv_cache: str | None = None, kda_state=None) -> Cache:
    """A zeroed cache. ``sharding``: optional pytree of shardings matching :func:`cache_shapes`."""
    shapes = cache_shapes(cfg, batch, max_len, dtype, scan=scan, kv_cache=kv_cache, kda_state=kda_state)
    if sharding is None:
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), out_shardings=sharding)()


def _verify_record(entry: KDACache, T: int) -> KDAVerify:
    """A zeroed :class:`KDAVerify` of ``T`` positions for ``entry`` (its leading dimensions: batch, or repetitions
    and batch)."""
    lead, (P,) = entry.conv_q.shape[:-2], entry.conv_q.shape[-1:]
    H, K, U = entry.state.shape[-3:]
    rows = jnp.zeros((*lead, T, P), entry.conv_q.dtype)
    cd = jnp.promote_types(entry.conv_q.dtype, jnp.float32)  # the run's compute dtype
    return KDAVerify(rows, rows, rows, jnp.zeros((*lead, T, H, K), cd), jnp.zeros((*lead, T, H, K), cd),
                     jnp.zeros((*lead, T, H, U), entry.conv_v.dtype), jnp.zeros((*lead, T, H, K), cd),
                     jnp.zeros((*lead, T, H), cd))


def map_kda(cache: Cache, fn) -> Cache:
    """``cache`` with ``fn(entry)`` in place of every KDA entry (stacked ones too, their repetitions leading)."""
    f = lambda e: fn(e) if isinstance(e, KDACache) else e  # noqa: E731
    return Cache(tuple(None if e is None else f(e) for e in cache.layers), cache.lengths,
                 tuple(f(e) for e in cache.stack))


def for_verify(cache: Cache, T: int) -> Cache:
    """``cache`` ready for a verify call of ``T`` positions: every KDA entry carries a zeroed :class:`KDAVerify`
    (the model fills it instead of advancing the state; :func:`kimi_jax.model.attention.commit_verified` commits)."""
    return map_kda(cache, lambda e: e.replace(verify=_verify_record(e, T)))


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16, *, kv_cache: str | None = None,
                kda_state=None) -> dict:
    """Bytes of the cache by kind: {"kda_state", "kda_conv", "mla", "kv", "total"} (int8 rows: codes and scales)."""
    out = {"kda_state": 0, "kda_conv": 0, "mla": 0, "kv": 0}
    nbytes = lambda e: sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(e))  # noqa: E731
    for layer, _ in cache_shapes(cfg, batch, max_len, dtype, kv_cache=kv_cache, kda_state=kda_state).entries():
        if isinstance(layer, KDACache):
            out["kda_state"] += nbytes(layer.state)
            out["kda_conv"] += 3 * nbytes(layer.conv_q)
        elif isinstance(layer, MLACache):
            out["mla"] += nbytes(layer.c) + nbytes(layer.kpe) + nbytes(layer.ik)
        else:
            out["kv"] += nbytes(layer.k) + nbytes(layer.v)
    out["total"] = sum(out.values())
    return out
