"""The model: embeddings, a stack of decoder layers (KDA / MLA / GQA mixer + dense MLP / MoE), final norm, lm_head.

Residual stream, two forms:
  * plain (Kimi Linear, Llama): ``h += mixer(norm(h)); h += ffn(norm(h))``;
  * Block Attention Residuals (K3): each sublayer reads a softmax mix over depth sources -- the sealed block
    sums ``B`` plus the running partial sum ``P`` -- and a new block is sealed every ``attn_res_block_size``
    layers. What a layer returns (and the per-layer hidden states report) is ``P``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from kimi_jax.attention import GQA, KDA, MLA, Step
from kimi_jax.cache import Cache
from kimi_jax.config import ModelConfig
from kimi_jax.layers import MLP, AttnRes, RunConfig, linear, param, rms_norm
from kimi_jax.moe import MoE


@struct.dataclass
class ModelOutput:
    logits: jax.Array  # [B, T, V] float32 (or [B, 1, V] with last_only)
    cache: Cache | None = None
    hidden: tuple | None = None  # per layer [B, T, D]: the layer's output (P under AttnRes)
    router: tuple | None = None  # per MoE layer: (idx [B, T, X] int32, weights [B, T, X] float32)
    attn_res_weights: tuple | None = None  # per AttnRes mix: [n_sources, B, T] float32


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, index: int, *, param_dtype, rngs):
        self.index = index
        self.attn_kind, self.ffn_kind = cfg.attn_types[index], cfg.ffn_types[index]
        self.eps = cfg.norm_eps
        D = cfg.hidden_size
        self.input_layernorm = param(rngs, (D,), ("embed",), param_dtype, init="ones")
        self.post_attention_layernorm = param(rngs, (D,), ("embed",), param_dtype, init="ones")
        if cfg.attn_res:
            self.self_attention_res = AttnRes(D, cfg.norm_eps, param_dtype=param_dtype, rngs=rngs)
            self.mlp_res = AttnRes(D, cfg.norm_eps, param_dtype=param_dtype, rngs=rngs)
        mixer = {"kda": (KDA, cfg.kda), "mla": (MLA, cfg.mla), "gqa": (GQA, cfg.gqa)}[self.attn_kind]
        self.self_attn = mixer[0](mixer[1], param_dtype=param_dtype, rngs=rngs)
        if self.ffn_kind == "moe":
            self.mlp = MoE(cfg.moe, param_dtype=param_dtype, rngs=rngs)
        else:
            self.mlp = MLP(cfg.mlp, param_dtype=param_dtype, rngs=rngs)

    def _ffn(self, x, run):
        if self.ffn_kind == "moe":
            return self.mlp(x, run)
        return self.mlp(x, run), None

    def __call__(self, h, step: Step, cache, run: RunConfig):
        """Plain residual layer. Returns (h, cache, router)."""
        y, cache = self.self_attn(rms_norm(h, self.input_layernorm[...], self.eps, run), step, cache, run)
        h = (h + y).astype(run.dtype)
        z, router = self._ffn(rms_norm(h, self.post_attention_layernorm[...], self.eps, run), run)
        return (h + z).astype(run.dtype), cache, router

    def attn_res_call(self, partial, blocks: list, seal: bool, step: Step, cache, run: RunConfig, weights: list):
        """AttnRes layer (K3_SPEC §4.2). Returns (partial, blocks, cache, router)."""
        x = partial
        if blocks:
            a, alpha = self.self_attention_res([*blocks, x], run, return_weights=True)
            weights.append(alpha)
        else:
            a = x
        if seal:  # push the raw layer input, restart the partial sum
            blocks = [*blocks, x]
            partial = None
        y, cache = self.self_attn(rms_norm(a, self.input_layernorm[...], self.eps, run), step, cache, run)
        partial = y if partial is None else (partial + y).astype(run.dtype)
        m, alpha = self.mlp_res([*blocks, partial], run, return_weights=True)
        weights.append(alpha)
        z, router = self._ffn(rms_norm(m, self.post_attention_layernorm[...], self.eps, run), run)
        return (partial + z).astype(run.dtype), blocks, cache, router


class KimiModel(nnx.Module):
    """One Flax NNX model for Kimi K3, Kimi Linear and dense GQA checkpoints.

    ``model(ids_BT)`` -> :class:`ModelOutput` with float32 logits ``[B, T, V]``. With a :class:`Cache`, the call
    also reads and writes the static cache (prefill with ``prefix=False``; decode or continued prefill with
    ``prefix=True``, positions starting at ``cache.lengths``).
    """

    def __init__(self, cfg: ModelConfig, *, run: RunConfig | None = None, param_dtype=None, rngs: nnx.Rngs | None = None):
        run = run or RunConfig()
        param_dtype = jnp.dtype(param_dtype or run.dtype)
        rngs = rngs or nnx.Rngs(0)
        self.cfg, self.run = cfg, run
        D, V = cfg.hidden_size, cfg.vocab_size
        self.embed_tokens = param(rngs, (V, D), ("vocab", "embed"), param_dtype, std=0.3)
        self.layers = nnx.List([DecoderLayer(cfg, i, param_dtype=param_dtype, rngs=rngs) for i in range(cfg.num_layers)])
        self.norm = param(rngs, (D,), ("embed",), param_dtype, init="ones")
        if cfg.attn_res:
            self.output_attn_res = AttnRes(D, cfg.norm_eps, param_dtype=param_dtype, rngs=rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = param(rngs, (V, D), ("vocab", "embed"), param_dtype, std=0.1)

    def __call__(self, ids_BT, *, cache: Cache | None = None, lengths=None, prefix: bool = False,
                 last_only: bool = False, return_hidden: bool = False, return_router: bool = False,
                 return_attn_res: bool = False) -> ModelOutput:
        cfg, run = self.cfg, self.run
        B, T = ids_BT.shape
        lengths = jnp.full((B,), T, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
        start = cache.lengths if (cache is not None and prefix) else jnp.zeros((B,), jnp.int32)
        positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
        step = Step(positions, jnp.arange(T)[None] < lengths[:, None], lengths, prefix)

        h = self.embed_tokens[...][ids_BT].astype(run.dtype)
        new_layers, hidden, router, weights = [], [], [], []
        blocks: list = []
        for i, layer in enumerate(self.layers):
            layer_cache = None if cache is None else cache.layers[i]
            if cfg.attn_res:
                h, blocks, layer_cache, r = layer.attn_res_call(
                    h, blocks, i % cfg.attn_res_block_size == 0, step, layer_cache, run, weights)
            else:
                h, layer_cache, r = layer(h, step, layer_cache, run)
            new_layers.append(layer_cache)
            if return_hidden:
                hidden.append(h)
            if r is not None and return_router:
                router.append(r)
        if cfg.attn_res:
            h, alpha = self.output_attn_res([*blocks, h], run, return_weights=True)
            weights.append(alpha)
        if last_only:
            h = jnp.take_along_axis(h, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)
        h = rms_norm(h, self.norm[...], cfg.norm_eps, run)
        head = self.embed_tokens[...] if cfg.tie_word_embeddings else self.lm_head[...]
        logits = linear(h, head, run).astype(jnp.float32)
        new_cache = None
        if cache is not None:
            new_cache = Cache(tuple(new_layers), start + lengths)
        return ModelOutput(
            logits=logits,
            cache=new_cache,
            hidden=tuple(hidden) if return_hidden else None,
            router=tuple(router) if return_router else None,
            attn_res_weights=tuple(weights) if return_attn_res else None,
        )


def abstract_model(cfg: ModelConfig, run: RunConfig | None = None, param_dtype=None) -> KimiModel:
    """The model with ``ShapeDtypeStruct`` leaves: shapes and dtypes, no memory (seconds even for 2.8T)."""
    return nnx.eval_shape(lambda: KimiModel(cfg, run=run, param_dtype=param_dtype, rngs=nnx.Rngs(0)))


def param_count(model: KimiModel, logical: bool = True) -> int:
    """Number of parameters; with ``logical`` an MXFP4 byte pair counts as the values it encodes."""
    total = 0
    for path, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = str(path[-1])
        n = 1
        for s in leaf.value.shape if hasattr(leaf, "value") else leaf.shape:
            n *= int(s)
        if name.endswith("_packed"):
            total += 2 * n if logical else n
        elif name.endswith("_scale") and logical:
            continue
        else:
            total += n
    return total
