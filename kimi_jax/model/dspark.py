"""DSpark drafter: a small model that proposes a block of tokens from the target's hidden states (the released
``k3_dspark`` layout; ``docs/generation.md (DSpark drafters)`` says what is confirmed and what is assumed).

One drafting step for a sequence whose target cache holds positions ``0 .. p-1`` and whose last token ``a`` (the
anchor) is not yet in it:

* **Context.** The target's hidden states at the tapped layers (``target_layer_ids``, each the stream *after* that
  layer), concatenated, become ``context = context_norm(context_proj(taps))``. Each draft layer turns them into its
  own MLA latent cache entries (``kv_a_proj_with_mqa``: a ``kv_lora_rank`` latent after ``kv_a_layernorm`` and a
  ``qk_rope_head_dim`` key part with RoPE at the context positions). Written once per position, as the target's
  forwards produce the taps: :meth:`DSparkModel.write_context`.
* **Block.** ``[a, mask, .., mask]`` (``n`` slots) at positions ``p .. p+n-1``, embedded with the target's table,
  runs through the draft layers (pre-norm DeepSeek-V3 MLA with a q LoRA and RoPE, attending the context entries and
  the block itself, non-causally inside the block unless ``causal``; then a SwiGLU MLP), ``final_norm`` and the
  target's ``lm_head``: slot ``i`` gives the base logits of the token at ``p+i+1``.
* **Markov head.** Drafted left to right: ``logits_i = base_i + markov_w2 @ markov_w1[prev]``, ``prev`` the anchor
  then each drafted token; greedy (the verifier's rejection sampler treats a greedy draft as a point mass, which
  keeps sampled output exact in distribution).

The attention runs in the absorbed form (queries mapped into the latent space, scores against the cached latent),
float32 inside: over the context through the MLA attention op (:mod:`kernels_pallas.mla_decode`, which splits the
context positions over a mesh as it does the target's latent cache), over the block in plain jnp, the two merged by
their log-sum-exps. The weights' products follow the run dtype like the target's (:func:`kimi_jax.model.layers.
linear`). On a mesh (``run.parallel``, the target's) the weights are split by their logical axes as the target's MLA
and MLP weights are (heads, MLP width, vocabulary; the context projection's input over the tapped streams) and the
context cache by :data:`CACHE_AXES`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx, struct

from kernels_pallas import mla_decode
from kimi_jax.model.config import MLPConfig
from kimi_jax.model.layers import MLP, embed, linear, param, rms_norm
from kimi_jax.model.run import RunConfig

F32 = jnp.float32
MODEL_TYPE = "k3_dspark"
# the target streams a drafter can be fed: "prefix", each tapped layer's output (under Block AttnRes the within-block
# partial sum; vLLM's default), or "attn_res", the AttnRes mix the next layer's attention reads (lightseek's drafter)
STREAMS = ("prefix", "attn_res")
# the logical axes of a DraftCache's fields (kimi_jax.parallel.sharding.draft_cache_specs): rows as the target's
# sequences, positions as its MLA latent cache's
CACHE_AXES = {"c": (None, "batch", "mla_seq", None), "kpe": (None, "batch", "mla_seq", None)}


class DSparkConfigError(ValueError):
    """A drafter config that this implementation cannot run: names the key and what would be valid."""


@dataclasses.dataclass(frozen=True)
class DSparkConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    target_hidden_size: int
    mask_token_id: int
    markov_rank: int
    block_size: int = 7
    rms_norm_eps: float = 1e-5
    rope_theta: float = 50000.0
    hidden_act: str = "silu"
    causal: bool = False
    aux_hidden_stream: str = "prefix"

    @property
    def mlp(self) -> MLPConfig:
        return MLPConfig(self.hidden_size, self.intermediate_size, self.hidden_act)

    def check_target(self, target_cfg) -> None:
        """Refuse a drafter made for another target: vocabulary, hidden size, tapped layers."""
        if self.vocab_size != target_cfg.vocab_size:
            raise DSparkConfigError(f"drafter vocab_size {self.vocab_size} != the target's {target_cfg.vocab_size}")
        if self.target_hidden_size != target_cfg.hidden_size:
            raise DSparkConfigError(f"drafter target_hidden_size {self.target_hidden_size} != the target's hidden "
                                    f"size {target_cfg.hidden_size}")
        if self.hidden_size != target_cfg.hidden_size:
            raise DSparkConfigError(f"drafter hidden_size {self.hidden_size} != the target's {target_cfg.hidden_size} "
                                    "(the drafter shares the target's embedding and lm_head)")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target_cfg.num_layers]
        if bad:
            raise DSparkConfigError(f"drafter target_layer_ids {bad} are not layers of the target "
                                    f"(0 .. {target_cfg.num_layers - 1})")
        if not 0 <= self.mask_token_id < target_cfg.vocab_size:
            raise DSparkConfigError(f"drafter mask_token_id {self.mask_token_id} is not a token id of the target")


def _get(d: dict, *names, default=None):
    for n in names:
        if n in d and d[n] is not None:
            return d[n]
    return default


def config_from_dict(d: dict) -> DSparkConfig:
    """The frozen config of a ``k3_dspark`` ``config.json``; refuses what the format excludes (vLLM's
    ``K3DSparkConfig`` refuses the same) and what this implementation does not run, by key."""
    if d.get("model_type") != MODEL_TYPE:
        raise DSparkConfigError(f"model_type {d.get('model_type')!r}: a DSpark drafter config has model_type "
                                f"{MODEL_TYPE!r}")
    for key in ("mla_use_nope", "mla_use_output_gate", "mla_use_qk_norm", "dspark_bonus_anchor"):
        if d.get(key):
            raise DSparkConfigError(f"{key}=true: the k3_dspark format is a RoPE MLA without gate or q/k norm")
    if d.get("q_lora_rank") is None:
        raise DSparkConfigError("q_lora_rank is null: the k3_dspark format has a q LoRA")
    taps = tuple(int(i) for i in _get(d, "target_layer_ids", "dspark_target_layer_ids", default=()))
    if not taps:
        raise DSparkConfigError("target_layer_ids is missing or empty: which target layers feed the drafter")
    if d.get("num_target_layers", len(taps)) != len(taps):
        raise DSparkConfigError(f"num_target_layers {d['num_target_layers']} != len(target_layer_ids) {len(taps)}")
    vocab = int(d["vocab_size"])
    if d.get("draft_vocab_size", vocab) != vocab:
        raise DSparkConfigError(f"draft_vocab_size {d['draft_vocab_size']} != vocab_size {vocab}: reduced draft "
                                "vocabularies are not supported")
    if d.get("markov_head_type", "vanilla") != "vanilla":
        raise DSparkConfigError(f"markov_head_type {d['markov_head_type']!r}: only 'vanilla' is supported")
    stream = d.get("aux_hidden_stream", "prefix")
    if stream not in STREAMS:
        raise DSparkConfigError(f"aux_hidden_stream {stream!r}: supported {STREAMS}")
    act = d.get("hidden_act", "silu")
    if act not in ("silu", "situ"):
        raise DSparkConfigError(f"hidden_act {act!r}: supported 'silu' (SwiGLU) and 'situ'")
    mask = _get(d, "mask_token_id", "dspark_noise_token_id")
    if mask is None:
        raise DSparkConfigError("mask_token_id is missing: the block's placeholder token")
    causal = bool(d.get("causal", not d.get("non_causal_multi_token_decode", True)))
    try:
        return DSparkConfig(
            hidden_size=int(d["hidden_size"]), num_layers=int(d["num_hidden_layers"]),
            num_heads=int(d["num_attention_heads"]), q_lora_rank=int(d["q_lora_rank"]),
            kv_lora_rank=int(d["kv_lora_rank"]), qk_nope_head_dim=int(d["qk_nope_head_dim"]),
            qk_rope_head_dim=int(d["qk_rope_head_dim"]), v_head_dim=int(d["v_head_dim"]),
            intermediate_size=int(d["intermediate_size"]), vocab_size=vocab, target_layer_ids=taps,
            target_hidden_size=int(d.get("target_hidden_size", d["hidden_size"])), mask_token_id=int(mask),
            markov_rank=int(d["markov_rank"]),
            block_size=int(_get(d, "block_size", "dspark_block_size", "num_speculative_tokens", default=7)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)), rope_theta=float(d.get("rope_theta", 50000.0)),
            hidden_act=act, causal=causal, aux_hidden_stream=stream)
    except KeyError as e:
        raise DSparkConfigError(f"drafter config.json has no {e.args[0]!r}") from None


def abstract(cfg: DSparkConfig, dtype=None, run: RunConfig | None = None) -> DSparkModel:
    """The drafter of ``cfg`` with ``ShapeDtypeStruct`` leaves in ``dtype`` (default float32), its products in
    ``dtype`` too (``run``: how it runs otherwise, e.g. on the target's mesh): shapes and dtypes, no memory. Loading
    fills it; plans and deviceless compiles count and lower it."""
    dtype = jnp.dtype(dtype or F32)
    run = dataclasses.replace(run or RunConfig(), dtype=dtype)
    return nnx.eval_shape(lambda: DSparkModel(cfg, run=run, param_dtype=dtype))


def cache_shapes(cfg: DSparkConfig, batch: int, length: int, dtype) -> DraftCache:
    """The :class:`DraftCache` of ``ShapeDtypeStruct`` that :meth:`DSparkModel.empty_cache` makes for ``batch``
    sequences (or pages) of ``length`` positions in ``dtype``: ``c [layers, batch, length, kv_lora_rank]`` and
    ``kpe [layers, batch, length, qk_rope_head_dim]``."""
    lead = (cfg.num_layers, batch, length)
    return DraftCache(jax.ShapeDtypeStruct((*lead, cfg.kv_lora_rank), jnp.dtype(dtype)),
                      jax.ShapeDtypeStruct((*lead, cfg.qk_rope_head_dim), jnp.dtype(dtype)))


def cache_bytes(cfg: DSparkConfig, batch: int, length: int, dtype) -> int:
    """Bytes of the :class:`DraftCache` that :meth:`DSparkModel.empty_cache` makes for ``batch`` sequences of
    ``length`` positions in ``dtype``: ``c [layers, batch, length, kv_lora_rank]`` and
    ``kpe [layers, batch, length, qk_rope_head_dim]``."""
    return sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(cache_shapes(cfg, batch, length, dtype)))


@struct.dataclass
class DraftCache:
    """Every draft layer's latent context entries: ``c [layers, B, L, kv_lora_rank]`` (after ``kv_a_layernorm``)
    and ``kpe [layers, B, L, qk_rope_head_dim]`` (rotated). Positions past a sequence's target cache length are
    unread; the target's cache lengths say how far each row's context goes."""

    c: jax.Array
    kpe: jax.Array


def target_taps(target, out, layer_ids, stream: str = "prefix"):
    """The tapped streams of a target call (``return_hidden`` outputs ``out``) after each layer of ``layer_ids``,
    concatenated: each layer's output (``prefix``) or the AttnRes mix the next layer reads (``attn_res``,
    :meth:`~kimi_jax.model.decoder.KimiModel.consumer_stream`)."""
    if stream == "attn_res":
        return jnp.concatenate([target.consumer_stream(out, i) for i in layer_ids], axis=-1)
    return jnp.concatenate([out.hidden[i] for i in layer_ids], axis=-1)


def rope_interleaved(x, positions, theta: float):
    """RoPE on the last axis, pairs ``(x[2i], x[2i+1])`` rotated by ``pos * theta^(-2i/d)`` (non-NeoX), float32."""
    d = x.shape[-1]
    inv = theta ** (-jnp.arange(0, d, 2, dtype=F32) / d)
    ang = positions.astype(F32)[..., None] * inv  # [..., d/2]
    while ang.ndim < x.ndim:
        ang = ang[..., None, :]  # broadcast over heads
    x = x.astype(F32)
    a, b = x[..., 0::2], x[..., 1::2]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    return jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(x.shape)


class DSparkAttention(nnx.Module):
    def __init__(self, cfg: DSparkConfig, *, param_dtype, rngs):
        self.cfg = cfg
        D, H, r = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank
        p = lambda shape, axes, **kw: param(rngs, shape, axes, param_dtype, **kw)  # noqa: E731
        # the logical axes of the target's MLA (kimi_jax.model.attention.MLA)
        self.q_a_proj = p((cfg.q_lora_rank, D), (None, "embed"))
        self.q_a_layernorm = p((cfg.q_lora_rank,), (None,), init="ones")
        self.q_b_proj = p((H * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim), cfg.q_lora_rank), ("heads", None))
        self.kv_a_proj_with_mqa = p((r + cfg.qk_rope_head_dim, D), (None, "embed"))
        self.kv_a_layernorm = p((r,), (None,), init="ones")
        self.kv_b_proj = p((H * (cfg.qk_nope_head_dim + cfg.v_head_dim), r), ("heads", None))
        self.o_proj = p((D, H * cfg.v_head_dim), ("embed", "heads"))

    def latent(self, x, positions, run: RunConfig):
        """(``c [..., r]`` normalised latent, ``kpe [..., rope]`` rotated) of inputs ``x`` at ``positions``."""
        cfg = self.cfg
        kv = linear(x, self.kv_a_proj_with_mqa[...], run)
        c = rms_norm(kv[..., :cfg.kv_lora_rank], self.kv_a_layernorm[...], cfg.rms_norm_eps, run)
        return c, rope_interleaved(kv[..., cfg.kv_lora_rank:], positions, cfg.rope_theta)

    def __call__(self, x_BND, positions_BN, c_BLR, kpe_BLO, ctx_len_B, run: RunConfig):
        cfg = self.cfg
        B, N, _ = x_BND.shape
        H, dn, dv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        q = linear(rms_norm(linear(x_BND, self.q_a_proj[...], run), self.q_a_layernorm[...], cfg.rms_norm_eps, run),
                   self.q_b_proj[...], run).reshape(B, N, H, dn + cfg.qk_rope_head_dim).astype(F32)
        q_rope = rope_interleaved(q[..., dn:], positions_BN, cfg.rope_theta)
        w = self.kv_b_proj[...].astype(F32).reshape(H, dn + dv, cfg.kv_lora_rank)
        q_lat = jnp.einsum("bnhd,hdr->bnhr", q[..., :dn], w[:, :dn])
        scale = 1.0 / float(dn + cfg.qk_rope_head_dim) ** 0.5
        # the context: every slot sees the positions < ctx_len (a query at ctx_len - 1 in the op's causal mask)
        u_ctx, lse_ctx = mla_decode.mla_attention(
            q_lat, q_rope, c_BLR, kpe_BLO, jnp.broadcast_to(ctx_len_B[:, None] - 1, (B, N)), scale=scale,
            with_lse=True, implementation=run.implementation, placement=run.placement)
        # the block itself: every slot sees every slot (the ones up to its own when causal)
        c_blk, kpe_blk = self.latent(x_BND, positions_BN, run)
        c_blk = c_blk.astype(F32)
        scores = (jnp.einsum("bnhr,bmr->bnhm", q_lat, c_blk) + jnp.einsum("bnhd,bmd->bnhm", q_rope, kpe_blk)) * scale
        if cfg.causal:
            scores = jnp.where((jnp.arange(N)[None, :] <= jnp.arange(N)[:, None])[None, :, None], scores, -jnp.inf)
        lse_blk = jax.nn.logsumexp(scores, axis=-1)  # [B, N, H], finite: a slot sees itself
        u_blk = jnp.einsum("bnhm,bmr->bnhr", jnp.exp(scores - lse_blk[..., None]), c_blk)
        top = jnp.maximum(lse_ctx, lse_blk)
        w_ctx, w_blk = jnp.exp(lse_ctx - top)[..., None], jnp.exp(lse_blk - top)[..., None]
        o_lat = (u_ctx * w_ctx + u_blk * w_blk) / (w_ctx + w_blk)
        o = jnp.einsum("bnhr,hvr->bnhv", o_lat, w[:, dn:]).reshape(B, N, H * dv)
        return linear(o.astype(run.dtype), self.o_proj[...], run)


class DSparkLayer(nnx.Module):
    def __init__(self, cfg: DSparkConfig, *, param_dtype, rngs):
        self.eps = cfg.rms_norm_eps
        D = cfg.hidden_size
        self.input_layernorm = param(rngs, (D,), (None,), param_dtype, init="ones")
        self.post_attention_layernorm = param(rngs, (D,), (None,), param_dtype, init="ones")
        self.self_attn = DSparkAttention(cfg, param_dtype=param_dtype, rngs=rngs)
        self.mlp = MLP(cfg.mlp, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, h, positions, c, kpe, ctx_len, run: RunConfig):
        h = (h + self.self_attn(rms_norm(h, self.input_layernorm[...], self.eps, run), positions, c, kpe, ctx_len,
                                run)).astype(run.dtype)
        return (h + self.mlp(rms_norm(h, self.post_attention_layernorm[...], self.eps, run), run)).astype(run.dtype)


class MarkovHead(nnx.Module):
    def __init__(self, cfg: DSparkConfig, *, param_dtype, rngs):
        self.markov_w1 = param(rngs, (cfg.vocab_size, cfg.markov_rank), ("vocab", None), param_dtype)
        self.markov_w2 = param(rngs, (cfg.vocab_size, cfg.markov_rank), ("vocab", None), param_dtype)

    def __call__(self, prev, run: RunConfig):
        """The correction ``[..., V]`` given the previous tokens ``prev [...]``."""
        return linear(self.markov_w1[...][prev].astype(run.dtype), self.markov_w2[...], run).astype(F32)


class DSparkModel(nnx.Module):
    """The drafter's own weights; the embedding and the lm_head are the target's, given to each call."""

    def __init__(self, cfg: DSparkConfig, *, run: RunConfig | None = None, param_dtype=None,
                 rngs: nnx.Rngs | None = None):
        run = run or RunConfig()
        param_dtype = jnp.dtype(param_dtype or run.dtype)
        rngs = rngs or nnx.Rngs(0)
        self.cfg, self.run = cfg, run
        D = cfg.hidden_size
        self.context_proj = param(rngs, (D, len(cfg.target_layer_ids) * cfg.target_hidden_size), ("embed", "taps"),
                                  param_dtype)
        self.context_norm = param(rngs, (D,), (None,), param_dtype, init="ones")
        self.layers = nnx.List([DSparkLayer(cfg, param_dtype=param_dtype, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = param(rngs, (D,), (None,), param_dtype, init="ones")
        self.markov_head = MarkovHead(cfg, param_dtype=param_dtype, rngs=rngs)

    def empty_cache(self, batch: int, max_len: int, dtype=None, sharding: DraftCache | None = None) -> DraftCache:
        """A zero context cache (``sharding``: a DraftCache of shardings to make it in, e.g.
        :func:`kimi_jax.parallel.sharding.draft_cache_shardings`)."""
        shapes = cache_shapes(self.cfg, batch, max_len, dtype or self.run.dtype)
        zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)  # noqa: E731
        return zeros() if sharding is None else jax.jit(zeros, out_shardings=sharding)()

    def taps(self, target, out):
        """The context input ``[B, T, n_taps * target_hidden]`` from a ``target`` call's ``return_hidden`` outputs
        ``out`` (:func:`target_taps`)."""
        return target_taps(target, out, self.cfg.target_layer_ids, self.cfg.aux_hidden_stream)

    def context_entries(self, taps_BTX, start_B):
        """Every draft layer's context entries ``(c [layers, B, T, r], kpe [layers, B, T, rope])`` of the positions
        ``start ..`` from ``taps``."""
        run, cfg = self.run, self.cfg
        T = taps_BTX.shape[1]
        ctx = rms_norm(linear(taps_BTX, self.context_proj[...], run), self.context_norm[...], cfg.rms_norm_eps, run)
        pos = start_B[:, None] + jnp.arange(T)[None]
        latents = [layer.self_attn.latent(ctx, pos, run) for layer in self.layers]
        return jnp.stack([c for c, _ in latents]), jnp.stack([kpe for _, kpe in latents])

    def write_context(self, cache: DraftCache, taps_BTX, start_B, lengths_B) -> DraftCache:
        """``cache`` with the context entries of positions ``start .. start+lengths-1`` written from ``taps`` (rows
        ``0 .. lengths-1`` of each sequence; the rest dropped)."""
        T = taps_BTX.shape[1]
        c, kpe = self.context_entries(taps_BTX, start_B)
        L = cache.c.shape[2]
        dest = jnp.where(jnp.arange(T)[None] < lengths_B[:, None], start_B[:, None] + jnp.arange(T)[None], L)
        # one scatter per layer and sequence (both scatter batch dimensions, so a mesh splitting the rows or the
        # positions writes its shard locally, as the target's cache writes do); L: out of range, dropped
        write = jax.vmap(jax.vmap(lambda a, new, pos: a.at[pos].set(new.astype(a.dtype), mode="drop"),
                                  in_axes=(0, 0, 0)), in_axes=(0, 0, None))
        return DraftCache(write(cache.c, c, dest), write(cache.kpe, kpe, dest))

    # -- the paged form (the serving engine's): pools ``[layers, pages, page_size, ...]`` read through page tables

    def empty_pages(self, n_pages: int, page_size: int, dtype=None) -> DraftCache:
        """Context pools of ``n_pages`` pages of ``page_size`` positions (:meth:`write_pages`, :meth:`page_view`)."""
        return self.empty_cache(n_pages, page_size, dtype)

    def write_pages(self, pools: DraftCache, taps_BTX, page_table_BW, start_B, lengths_B) -> DraftCache:
        """:meth:`write_context` into page pools: position ``p`` of row ``b`` lives at offset ``p % page_size`` of
        page ``page_table[b, p // page_size]``."""
        T = taps_BTX.shape[1]
        n_pages, P = pools.c.shape[1], pools.c.shape[2]
        c, kpe = self.context_entries(taps_BTX, start_B)
        pos = start_B[:, None] + jnp.arange(T)[None]
        W = page_table_BW.shape[1]
        page = jnp.take_along_axis(page_table_BW, jnp.clip(pos // P, 0, W - 1), axis=1)
        page = jnp.where((jnp.arange(T)[None] < lengths_B[:, None]) & (pos < W * P), page, n_pages)  # dropped
        return DraftCache(pools.c.at[:, page, pos % P].set(c.astype(pools.c.dtype), mode="drop"),
                          pools.kpe.at[:, page, pos % P].set(kpe.astype(pools.kpe.dtype), mode="drop"))

    @staticmethod
    def page_view(pools: DraftCache, page_table_BW) -> DraftCache:
        """The rows' contexts ``[layers, B, W * page_size, ...]`` gathered from the pools (for :meth:`draft`)."""
        def view(a):
            g = a[:, page_table_BW]  # [layers, B, W, P, d]
            return g.reshape(g.shape[0], g.shape[1], g.shape[2] * g.shape[3], g.shape[4])
        return DraftCache(view(pools.c), view(pools.kpe))

    def base_logits(self, cache: DraftCache, embed_VD, head_VD, anchor_B, ctx_len_B, n: int):
        """The block's logits before the Markov head, ``[B, n, V]`` float32: slot ``i`` for the token at
        ``ctx_len + i + 1``."""
        run, cfg = self.run, self.cfg
        B = anchor_B.shape[0]
        ids = jnp.concatenate([anchor_B[:, None], jnp.full((B, n - 1), cfg.mask_token_id, anchor_B.dtype)], axis=1)
        h = embed(embed_VD, ids, run)
        positions = ctx_len_B[:, None] + jnp.arange(n)[None]
        for i, layer in enumerate(self.layers):
            h = layer(h, positions, cache.c[i], cache.kpe[i], ctx_len_B, run)
        h = rms_norm(h, self.final_norm[...], cfg.rms_norm_eps, run)
        return linear(h, head_VD, run).astype(F32)

    def draft(self, cache: DraftCache, embed_VD, head_VD, anchor_B, ctx_len_B, n: int):
        """Greedy drafts ``[B, n]`` int32: the base logits plus the Markov correction of the previous token, left to
        right from the anchor."""
        base = self.base_logits(cache, embed_VD, head_VD, anchor_B, ctx_len_B, n)
        prev, out = anchor_B, []
        for i in range(n):
            tok = jnp.argmax(base[:, i] + self.markov_head(prev, self.run), axis=-1).astype(jnp.int32)
            out.append(tok)
            prev = tok
        return jnp.stack(out, axis=1)
