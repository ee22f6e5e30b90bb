"""The three token mixers: Kimi Delta Attention, gated NoPE MLA, and GQA with RoPE.

Each takes the normed layer input ``x_BTD``, a :class:`Step` (positions, padding, whether the cache holds a
prefix to attend to) and its layer's cache entry (or None), and returns ``(y_BTD, new_cache_entry)``.
Padding is always on the right; padded steps never enter the KDA state (g = 0, beta = 0 there) and are never
visible to valid queries in attention (they sit at later positions).

With a page table (``Step.pages``, the serving engine's paged cache) the MLA latent and the GQA keys / values of
the cache entry are page pools ``[n_pages, page_size, ...]`` shared by all sequences: rows are stored through the
table (padding rows dropped, so a shared page is never touched by a sequence that does not own it) and cached
attention reads through it (``kernels_pallas.paged_attention``).

Kimi K3.1's MLA layers carry a DSA indexer (:class:`Indexer`): each query attends only to the keys it selects
(``kernels_pallas.dsa``), and the cache entry keeps the indexer keys beside the latent, on the same slots / pages.

A cache entry's fields may be int8 rows (:class:`kernels_pallas.cache_quant.Int8Rows`, ``kv_cache="int8"`` in
:mod:`kimi_jax.model.cache`; ``"int8-index"``: the indexer keys alone, so one entry mixes int8 and plain fields): rows
are quantized as they are stored (per field) and the kernels read the codes. A bfloat16 KDA
state is widened to float32 for the update and rounded back when stored.

"float32" below is the run's ``compute_dtype`` (float64 in a float64 run, float32 otherwise).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

import kernels_pallas.attention as attn_kernels
import kernels_pallas.dsa as dsa_kernels
import kernels_pallas.kda as kda_kernels
import kernels_pallas.mla_decode as mla_kernels
import kernels_pallas.paged_attention as paged_kernels
import kernels_pallas.sparse_mla as sparse_mla_kernels
from kernels_pallas import cache_quant, matvec
from kimi_jax.model.cache import Cache, KDACache, KDAVerify, KVCache, MLACache, map_kda
from kimi_jax.model.config import GQAConfig, IndexerConfig, KDAConfig, MLAConfig
from kimi_jax.model.layers import F32, linear, linear_group, param, rms_norm
from kimi_jax.model.run import RunConfig


class Step(NamedTuple):
    positions: jax.Array  # [B, T] int32 absolute positions of this call's tokens
    valid: jax.Array  # [B, T] bool, False on right padding
    lengths: jax.Array  # [B] int32 valid tokens per sequence in this call
    prefix: bool  # static: the cache already holds earlier tokens of these sequences (decode / continuation)
    pages: jax.Array | None = None  # [B, pages_per_seq] int32 page table of a paged cache; None: static cache


def _store(cache_arr, new_BT, step: Step):
    """This call's rows into the cache entry: the static ``[B, S, ...]`` cache at their positions, or through the
    page table into the page pool ``[n_pages, page_size, ...]`` (padding rows and rows past the table dropped).
    An int8 entry gets the rows quantized (codes and scales stored alike)."""
    if isinstance(cache_arr, cache_quant.Int8Rows):
        rows = cache_quant.quantize(new_BT)
        return cache_quant.Int8Rows(_store(cache_arr.q, rows.q, step), _store(cache_arr.scale, rows.scale, step))
    if step.pages is None:
        return _write(cache_arr, new_BT, step.positions)
    n_pages, ps = cache_arr.shape[:2]
    pos = step.positions
    slot = jnp.minimum(pos // ps, step.pages.shape[1] - 1)
    page = jnp.take_along_axis(step.pages, slot, axis=1)
    page = jnp.where(step.valid & (pos // ps < step.pages.shape[1]), page, n_pages)  # n_pages: out of range, dropped
    rows = new_BT.reshape(-1, *new_BT.shape[2:]).astype(cache_arr.dtype)
    out = cache_arr.at[page.reshape(-1), (pos % ps).reshape(-1)].set(rows, mode="drop")
    return jax.lax.optimization_barrier(out)


def _write(cache_BS, new_BT, positions_BT):
    """Scatter this call's rows into a static cache at their positions (rows past the end are dropped)."""
    # one scatter per sequence (vmapped: the batch is a scatter batch dimension, so a mesh splits it locally)
    write = lambda c, new, pos: c.at[pos].set(new.astype(c.dtype), mode="drop")
    out = jax.vmap(write)(cache_BS, new_BT, positions_BT)
    # Written once, in place: without the barrier XLA:CPU fused a copy of the scatter into each consumer (the
    # loop carry and the attention read), copying the whole cache several times per decode step.
    return jax.lax.optimization_barrier(out)


# -- Kimi Delta Attention ---------------------------------------------------------------------------------


def _l2norm(x):
    # FLA: x / sqrt(sum(x^2) + 1e-6), eps on the sum, float32.
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _short_conv(x_BTP, tail_BWP, w_PW, lengths_B, dtype=F32):
    """Depthwise causal conv (no bias) + SiLU over [tail, x] in ``dtype`` (the compute dtype); returns (out_BTP,
    new tail).

    ``w[:, W-1]`` multiplies the current token. The new tail holds the last W-1 *valid* pre-conv rows of
    each sequence, so right padding never leaks into the next call.
    """
    W = w_PW.shape[-1]
    T = x_BTP.shape[1]
    xx = jnp.concatenate([tail_BWP.astype(x_BTP.dtype), x_BTP], axis=1)  # [B, W-1+T, P]
    xf = xx.astype(dtype)
    w = w_PW.astype(dtype)
    u = sum(xf[:, j : j + T] * w[:, j] for j in range(W))
    idx = lengths_B[:, None] + jnp.arange(W - 1)[None]  # rows len..len+W-2 of xx = inputs len-W+1..len-1
    new_tail = jnp.take_along_axis(xx, idx[:, :, None], axis=1)
    return jax.nn.silu(u), new_tail


class KDA(nnx.Module):
    def __init__(self, cfg: KDAConfig, *, param_dtype, rngs):
        self.cfg = cfg
        P, D, H, K, W = cfg.proj, cfg.hidden, cfg.num_heads, cfg.head_dim, cfg.conv_size
        p = lambda shape, axes, **kw: param(rngs, shape, axes, kw.pop("dtype", param_dtype), **kw)
        self.q_proj = p((P, D), ("heads", "embed"))
        self.k_proj = p((P, D), ("heads", "embed"))
        self.v_proj = p((P, D), ("heads", "embed"))
        # Kept in float32 as released: conv kernels, decay parameters, output norm weight.
        self.q_conv1d = p((P, W), ("heads", None), dtype=F32, std=0.3)
        self.k_conv1d = p((P, W), ("heads", None), dtype=F32, std=0.3)
        self.v_conv1d = p((P, W), ("heads", None), dtype=F32, std=0.3)
        self.f_a_proj = p((K, D), (None, "embed"))
        self.f_b_proj = p((P, K), ("heads", None))
        self.A_log = p((H,), ("heads",), dtype=F32, init=lambda k, s: jnp.log(jax.random.uniform(k, s, F32, 1.0, 3.0)))
        self.dt_bias = p((P,), ("heads",), dtype=F32, init=lambda k, s: -1.5 + 0.5 * jax.random.normal(k, s, F32))
        self.b_proj = p((H, D), ("heads", "embed"))
        if cfg.full_rank_gate:
            self.g_proj = p((P, D), ("heads", "embed"))
        else:
            self.g_a_proj = p((K, D), (None, "embed"))
            self.g_b_proj = p((P, K), ("heads", None))
        self.o_norm = p((K,), (None,), dtype=F32, init="ones")
        self.o_proj = p((D, P), ("embed", "heads"))

    def __call__(self, x_BTD, step: Step, cache: KDACache | None, run: RunConfig):
        """With a :class:`KDAVerify` record in ``cache`` (a verify call, :func:`kimi_jax.model.cache.for_verify`) the
        state and conv tails are returned as they came and the record holds this call's recurrence inputs instead;
        :func:`commit_verified` advances them over the accepted positions."""
        c, cd = self.cfg, run.compute_dtype
        B, T, _ = x_BTD.shape
        verify = cache is not None and cache.verify is not None
        if verify and not step.prefix:
            raise ValueError("a verify call continues the cache: call the model with prefix=True")
        H, K = c.num_heads, c.head_dim
        heads = lambda a: a.reshape(B, T, H, K)
        zero_tail = jnp.zeros((B, c.conv_size - 1, c.proj), run.dtype)
        tails = (cache.conv_q, cache.conv_k, cache.conv_v) if (cache is not None and step.prefix) else (zero_tail,) * 3
        # every product of the layer input at once (one native call in CPU decode), then the low-rank second halves
        gate_w = (self.g_proj,) if c.full_rank_gate else (self.g_a_proj,)
        ws = (self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, *gate_w, self.b_proj)
        xq, xk, xv, f_a, gate, b = linear_group([(x_BTD, w[...]) for w in ws], run)
        if c.full_rank_gate:
            (f,) = linear_group([(f_a, self.f_b_proj[...])], run)
        else:
            f, gate = linear_group([(f_a, self.f_b_proj[...]), (gate, self.g_b_proj[...])], run)
        qkv, new_tails = [], []
        for out, conv, tail in zip((xq, xk, xv), (self.q_conv1d, self.k_conv1d, self.v_conv1d), tails):
            out, new_tail = _short_conv(out, tail, conv[...], step.lengths, cd)
            qkv.append(heads(out.astype(run.dtype)))
            new_tails.append(new_tail)
        q, k, v = qkv

        # Per-channel log decay g <= 0 (float32), two forms selected by the config.
        z = heads(f).astype(cd)
        z = z + self.dt_bias[...].astype(cd).reshape(H, K)
        a = jnp.exp(self.A_log[...].astype(cd))[:, None]  # [H, 1]
        if c.gate_lower_bound is not None:
            g = c.gate_lower_bound * jax.nn.sigmoid(a * z)  # K3: bounded in (lb, 0)
        else:
            g = -a * jax.nn.softplus(z)  # Kimi Linear
        beta = jax.nn.sigmoid(b.astype(cd))
        g = jnp.where(step.valid[..., None, None], g, 0.0)
        beta = jnp.where(step.valid[..., None], beta, 0.0)

        q, k = _l2norm(q.astype(cd)), _l2norm(k.astype(cd))
        # a verify call runs the decode kernel over its few positions, so that replaying them repeats decode steps
        decode = cache is not None and step.prefix and (T == 1 or verify)
        if not decode:
            # The reference's chunked path stores normalised q/k in the activation dtype (no-op in float32).
            q, k = q.astype(run.dtype).astype(cd), k.astype(run.dtype).astype(cd)
        state = cache.state.astype(cd) if (cache is not None and step.prefix) else None
        impl = dict(implementation=run.implementation, placement=run.placement)
        if decode:
            o, state = kda_kernels.kda_decode(q, k, v, g, beta, state, scale=K**-0.5, **impl)
        else:
            o, state = kda_kernels.kda_prefill(q, k, v, g, beta, state, scale=K**-0.5, chunk_size=run.kda_chunk,
                                               **impl)
        o = o.astype(run.dtype)

        # FusedRMSNormGated(activation="sigmoid"): per-head RMSNorm x f32 weight x sigmoid(gate), f32 math.
        o32 = o.astype(cd)
        o32 = o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + c.norm_eps)
        o32 = o32 * self.o_norm[...].astype(cd) * jax.nn.sigmoid(heads(gate).astype(cd))
        y = linear(o32.astype(run.dtype).reshape(B, T, c.proj), self.o_proj[...], run)
        new_cache = None if cache is None else KDACache(*new_tails, state.astype(cache.state.dtype))
        if verify:
            new_cache = cache.replace(verify=KDAVerify(xq, xk, xv, q, k, v, g, beta))
        return y, new_cache


def _commit_kda(entry: KDACache, keep_B, run: RunConfig) -> KDACache:
    """A KDA entry after a verify call (leading dimensions ``[B]``) advanced over its first ``keep[b]`` positions
    only: the recurrence replayed from the kept state with the later positions made inert (g = beta = 0 leaves the
    state bit for bit), the conv tails the last W-1 pre-conv rows up to that position."""
    r = entry.verify
    T, K = r.q.shape[1], r.q.shape[-1]
    keep = jnp.arange(T)[None] < keep_B[:, None]  # [B, T]
    g = jnp.where(keep[..., None, None], r.g, 0.0)
    beta = jnp.where(keep[..., None], r.beta, 0.0)
    _, state = kda_kernels.kda_decode(r.q, r.k, r.v, g, beta, entry.state.astype(run.compute_dtype), scale=K**-0.5,
                                      implementation=run.implementation, placement=run.placement)
    tails = []
    for tail, rows in ((entry.conv_q, r.rows_q), (entry.conv_k, r.rows_k), (entry.conv_v, r.rows_v)):
        xx = jnp.concatenate([tail, rows.astype(tail.dtype)], axis=1)  # [B, W-1+T, P], as _short_conv's
        idx = keep_B[:, None] + jnp.arange(tail.shape[1])[None]
        tails.append(jnp.take_along_axis(xx, idx[:, :, None], axis=1))
    return KDACache(*tails, state.astype(entry.state.dtype))


def commit_verified(cache: Cache, start_B, keep_B, run: RunConfig) -> Cache:
    """The cache after a verify call from lengths ``start [B]``, holding only the first ``keep[b]`` of its positions
    (0: the sequence's cache as it was). KDA entries are advanced exactly over those (:func:`_commit_kda`); MLA /
    GQA rows past them stay written but unread (the lengths say where the sequence ends; the next call writes over
    them before it reads)."""

    def commit(e: KDACache) -> KDACache:
        lead = e.state.ndim - 3  # 1, or 2 for a stacked entry [repetitions, B, ...]: folded into one batch
        if lead == 1:
            return _commit_kda(e, keep_B, run)
        n = e.state.shape[0]
        flat = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), e)
        out = _commit_kda(flat, jnp.tile(keep_B, n), run)
        return jax.tree.map(lambda a: a.reshape(n, -1, *a.shape[1:]), out)

    return map_kda(cache, commit).replace(lengths=start_B + keep_B)


# -- gated NoPE MLA ---------------------------------------------------------------------------------------


class Index(NamedTuple):
    """One call's indexer projections (K3.1)."""

    q: jax.Array  # [B, T, HI, DI] indexer queries, from the q-LoRA latent
    w: jax.Array  # [B, T, HI] float32 (the compute dtype) head weights, score scale included
    k: jax.Array  # [B, T, DI] indexer keys after k_norm (cached)


class Indexer(nnx.Module):
    """K3.1's DSA indexer of one MLA layer (the assumptions: :class:`kimi_jax.model.config.IndexerConfig`)."""

    def __init__(self, cfg: IndexerConfig, *, param_dtype, rngs):
        self.cfg = cfg
        HI, DI = cfg.num_heads, cfg.head_dim
        p = lambda shape, axes, **kw: param(rngs, shape, axes, param_dtype, **kw)
        self.wq_b = p((HI * DI, cfg.q_lora_rank), (None, None))
        self.wk = p((DI, cfg.hidden), (None, "embed"))
        self.weights_proj = p((HI, cfg.hidden), (None, "embed"))
        self.k_norm = p((DI,), (None,), init="ones")
        self.k_norm_bias = p((DI,), (None,), init="zeros")  # zero when a checkpoint has no k_norm.bias

    def project(self, q_BTJ, k_BTK, w_BTH, run: RunConfig) -> Index:
        """From ``wq_b(qr)``, ``wk(x)`` and ``weights_proj(x)``: the queries by head, the LayerNorm-ed keys (float32
        statistics), the float32 weights."""
        c, cd = self.cfg, run.compute_dtype
        B, T = q_BTJ.shape[:2]
        k = k_BTK.astype(cd)
        k = k - jnp.mean(k, axis=-1, keepdims=True)
        k = k * jax.lax.rsqrt(jnp.mean(k * k, axis=-1, keepdims=True) + c.norm_eps)
        k = k * self.k_norm[...].astype(cd) + self.k_norm_bias[...].astype(cd)
        w = w_BTH.astype(cd) * c.score_scale
        return Index(q_BTJ.reshape(B, T, c.num_heads, c.head_dim), w, k.astype(run.dtype))


def _key_slots(c, step: Step | None) -> int:
    """How many key positions attention reads (static): this call's own ``c [B, T, R]`` (``step`` None), a static
    cache's ``S``, or the ``pages_per_seq * page_size`` a page table addresses."""
    c = jax.tree.leaves(c)[0]  # an int8 entry: its codes
    if step is None or step.pages is None:
        return c.shape[1]
    return step.pages.shape[1] * c.shape[1]


class MLA(nnx.Module):
    def __init__(self, cfg: MLAConfig, *, param_dtype, rngs):
        self.cfg = cfg
        D, H = cfg.hidden, cfg.num_heads
        p = lambda shape, axes, **kw: param(rngs, shape, axes, param_dtype, **kw)
        if cfg.q_lora_rank is None:
            self.q_proj = p((H * cfg.qk_dim, D), ("heads", "embed"))
        else:
            self.q_a_proj = p((cfg.q_lora_rank, D), (None, "embed"))
            self.q_a_layernorm = p((cfg.q_lora_rank,), (None,), init="ones")
            self.q_b_proj = p((H * cfg.qk_dim, cfg.q_lora_rank), ("heads", None))
        self.kv_a_proj_with_mqa = p((cfg.kv_lora_rank + cfg.qk_rope_dim, D), (None, "embed"))
        self.kv_a_layernorm = p((cfg.kv_lora_rank,), (None,), init="ones")
        self.kv_b_proj = p((H * (cfg.qk_nope_dim + cfg.v_dim), cfg.kv_lora_rank), ("heads", None))
        if cfg.output_gate:
            self.g_proj = p((H * cfg.v_dim, D), ("heads", "embed"))
        self.o_proj = p((D, H * cfg.v_dim), ("embed", "heads"))
        if cfg.indexer is not None:
            self.indexer = Indexer(cfg.indexer, param_dtype=param_dtype, rngs=rngs)

    def _projections(self, x_BTD, run: RunConfig):
        """(q [B, T, H, K+O], ckv [B, T, R+O], gate or None, Index or None): every product of the layer input at
        once, then the q-LoRA latent's (K3.1: the indexer's too)."""
        c = self.cfg
        B, T, _ = x_BTD.shape
        ix = c.indexer
        ws = (self.q_proj if c.q_lora_rank is None else self.q_a_proj, self.kv_a_proj_with_mqa,
              *((self.g_proj,) if c.output_gate else ()),
              *((self.indexer.wk, self.indexer.weights_proj) if ix is not None else ()))
        q, ckv, *rest = linear_group([(x_BTD, w[...]) for w in ws], run)
        gate = rest[0] if c.output_gate else None
        index_q = None
        if c.q_lora_rank is not None:
            qr = rms_norm(q, self.q_a_layernorm[...], c.lora_norm_eps, run)
            q, *index_q = linear_group([(qr, self.q_b_proj[...])]
                                       + ([(qr, self.indexer.wq_b[...])] if ix is not None else []), run)
        index = None if ix is None else self.indexer.project(index_q[0], rest[-2], rest[-1], run)
        return q.reshape(B, T, c.num_heads, c.qk_dim), ckv, gate, index

    def __call__(self, x_BTD, step: Step, cache: MLACache | None, run: RunConfig):
        c = self.cfg
        B, T, _ = x_BTD.shape
        H, K, U, R = c.num_heads, c.qk_nope_dim, c.v_dim, c.kv_lora_rank
        q, ckv, gate, index = self._projections(x_BTD, run)
        q_nope, q_pe = q[..., :K], q[..., K:]
        lat = rms_norm(ckv[..., :R], self.kv_a_layernorm[...], c.lora_norm_eps, run)  # [B, T, R]
        kpe = ckv[..., R:]  # [B, T, O]: NoPE, used as produced

        new_cache = None
        if cache is not None:
            if (index is None) != (cache.ik is None):
                raise ValueError("the MLA cache entry and the layer disagree on DSA indexer keys: build the cache "
                                 "from this model's config")
            new_cache = MLACache(_store(cache.c, lat, step), _store(cache.kpe, kpe, step),
                                 None if index is None else _store(cache.ik, index.k, step))
        w_kvb = self.kv_b_proj[...].reshape(H, K + U, R)
        cached = cache is not None and step.prefix
        if index is not None and _key_slots(new_cache.c if cached else lat, step if cached else None) <= c.indexer.topk:
            # No query can see more keys than top-k, so each selects all it sees: K3's dense causal MLA, exactly
            # (the short-context path vLLM also takes). The indexer keys are still cached, for later calls.
            index = None
        if cached or index is not None:
            # Absorbed form over the latent: q_lat = W_UK^T q_nope; o = W_UV u. Both products read the whole
            # kv_b (zero-padded q_nope; the unused nope outputs dropped): slicing W_UK / W_UV out of it would copy
            # them every decode step, which costs more than the extra multiply-adds.
            heads = dict(implementation=run.implementation, precision=run.precision, placement=run.placement)
            q_pad = jnp.pad(q_nope, [(0, 0)] * 3 + [(0, U)])
            q_lat = matvec.per_head(q_pad, w_kvb.astype(run.dtype), transpose_w=False, **heads)
            keys = (new_cache.c, new_cache.kpe, new_cache.ik) if cached else (lat, kpe, None)
            u = self._latent_attention(q_lat, q_pe, keys, index, step if cached else step._replace(pages=None), run)
            o = matvec.per_head(u, w_kvb.astype(run.compute_dtype), transpose_w=True, **heads)[..., K:]
        else:
            kv = linear(lat, self.kv_b_proj[...], run).reshape(B, T, H, K + U)
            # nope and rope parts scored separately (192 = 128 + 64 is not a power of two for Triton); the
            # shared kpe is never broadcast to heads. Fresh prefill: keys sit at 0..T-1, the kernels' default.
            o = attn_kernels.attention(q_nope, kv[..., :K], kv[..., K:], step.positions, scale=c.scale, q_pe=q_pe,
                                       k_pe=kpe, implementation=run.implementation, placement=run.placement)
        o = o.astype(run.dtype).reshape(B, T, H * U)
        if c.output_gate:
            o = (o * jax.nn.sigmoid(gate)).astype(run.dtype)
        return linear(o, self.o_proj[...], run), new_cache

    def _latent_attention(self, q_lat, q_pe, keys, index: Index | None, step: Step, run: RunConfig):
        """u ``[B, T, H, R]`` over ``keys`` = (latent, kpe, indexer keys or None: this call's own), through the
        page table when ``step`` has one; K3.1: over the keys the indexer selects only."""
        c, (lat, kpe, ik) = self.cfg, keys
        kernel = dict(scale=c.scale, implementation=run.implementation, placement=run.placement)
        if index is None:
            if step.pages is None:
                return mla_kernels.mla_attention(q_lat, q_pe, lat, kpe, step.positions, **kernel)
            return paged_kernels.paged_mla_attention(q_lat, q_pe, lat, kpe, step.pages, step.positions, **kernel)
        sel = dict(topk=c.indexer.topk, implementation=run.implementation, placement=run.placement)
        ik = index.k if ik is None else ik
        if step.pages is None:
            idx = dsa_kernels.select(index.q, index.w, ik, step.positions, **sel)
            return sparse_mla_kernels.sparse_mla_attention(q_lat, q_pe, lat, kpe, idx, **kernel)
        idx = dsa_kernels.paged_select(index.q, index.w, ik, step.pages, step.positions, **sel)
        return sparse_mla_kernels.paged_sparse_mla_attention(q_lat, q_pe, lat, kpe, step.pages, idx, **kernel)


# -- GQA + RoPE -------------------------------------------------------------------------------------------


def rope_frequencies(cfg: GQAConfig):
    """Inverse frequencies [K/2] (float32), with Llama-3 scaling when configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=F32) / d))
    if cfg.rope_scaling is not None:
        _, factor, low, high, orig = cfg.rope_scaling
        wavelen = 2 * jnp.pi / inv
        low_wl, high_wl = orig / low, orig / high
        smooth = (orig / wavelen - low) / (high - low)
        scaled = jnp.where(wavelen > low_wl, inv / factor, inv)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        inv = jnp.where((wavelen >= high_wl) & (wavelen <= low_wl), mid, scaled)
    return inv


def apply_rope(x_BTHK, positions_BT, inv_freq):
    """HF Llama convention (rotate halves); cos/sin in float32, result in x's dtype."""
    freqs = positions_BT.astype(F32)[..., None] * inv_freq  # [B, T, K/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb).astype(x_BTHK.dtype), jnp.sin(emb).astype(x_BTHK.dtype)
    h = x_BTHK.shape[-1] // 2
    rot = jnp.concatenate([-x_BTHK[..., h:], x_BTHK[..., :h]], axis=-1)
    return x_BTHK * cos + rot * sin


class GQA(nnx.Module):
    def __init__(self, cfg: GQAConfig, *, param_dtype, rngs):
        self.cfg = cfg
        D, H, G, K = cfg.hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        p = lambda shape, axes: param(rngs, shape, axes, param_dtype)
        self.q_proj = p((H * K, D), ("heads", "embed"))
        self.k_proj = p((G * K, D), ("kv_heads", "embed"))
        self.v_proj = p((G * K, D), ("kv_heads", "embed"))
        self.o_proj = p((D, H * K), ("embed", "heads"))

    def __call__(self, x_BTD, step: Step, cache: KVCache | None, run: RunConfig):
        c = self.cfg
        B, T, _ = x_BTD.shape
        inv = rope_frequencies(c)
        q, k, v = linear_group([(x_BTD, w[...]) for w in (self.q_proj, self.k_proj, self.v_proj)], run)
        q = apply_rope(q.reshape(B, T, c.num_heads, c.head_dim), step.positions, inv)
        k = apply_rope(k.reshape(B, T, c.num_kv_heads, c.head_dim), step.positions, inv)
        v = v.reshape(B, T, c.num_kv_heads, c.head_dim)
        new_cache = None
        if cache is not None:
            new_cache = KVCache(_store(cache.k, k, step), _store(cache.v, v, step))
        kernel = dict(scale=c.head_dim**-0.5, implementation=run.implementation, placement=run.placement)
        if cache is not None and step.prefix and step.pages is not None:
            o = paged_kernels.paged_attention(q, new_cache.k, new_cache.v, step.pages, step.positions, **kernel)
        elif cache is not None and step.prefix:
            o = attn_kernels.attention(q, new_cache.k, new_cache.v, step.positions, **kernel)
        else:
            # fresh prefill: keys sit at positions 0..T-1, the kernels' default (lets them skip masked blocks)
            o = attn_kernels.attention(q, k, v, step.positions, **kernel)
        o = o.astype(run.dtype).reshape(B, T, c.num_heads * c.head_dim)
        return linear(o, self.o_proj[...], run), new_cache
