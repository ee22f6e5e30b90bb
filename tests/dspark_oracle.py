"""A float64 numpy reference ("oracle") of the MLA-native ``k3_dspark`` speculative drafter.

Written from docs/K31_AND_DSPARK.md section 6 (6.2 inference dataflow, 6.3 tensor inventory) only; it shares no
code with the JAX implementation, so the two can check each other. Pure numpy, float64 throughout, no jax.

Dataflow (one drafting step for one request):

1. ``context = rms(context_proj(taps), context_norm)``; ``taps`` are the target's hidden states at the context
   positions ``0..T-1`` (the ``target_layer_ids`` captures concatenated in that order).
2. Per draft layer, context K/V: ``kv_a_proj_with_mqa(context) -> [kv_lora | rope]``; the latent through
   ``kv_a_layernorm``; the rope part roped (interleaved pairs, theta = ``rope_theta``) at positions ``0..T-1``.
   Context tokens contribute K/V only.
3. The query block ``[anchor, mask_token_id x (n-1)]`` at positions ``T..T+n-1``, embedded with the target's
   embedding, runs through pre-norm layers (MLA with q-LoRA attending to context + block K/V, then a SwiGLU MLP),
   ``final_norm`` and the target's ``lm_head`` -> ``base_logits [n, V]``.
4. Sequential Markov head: ``prev = anchor``; ``logits_i = base_logits[i] + markov_w2 @ markov_w1[prev]``;
   greedy ``d_i = argmax`` (lowest index on ties); ``prev = d_i``.

Choices where the spec is silent (see the module's ``draft`` docstring too):

- Attention is non-causal inside the block unless ``cfg.get("causal")`` is truthy, in which case block query ``i``
  sees all context keys and block keys ``<= i``. Context keys are always visible.
- Softmax scale is ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)`` with no YaRN mscale (no ``rope_scaling`` is
  handled; a config with one is refused).
- RoPE inverse frequencies ``theta ** (-2i/d)`` for ``i = 0..d/2-1``, applied to adjacent pairs ``(x[2i], x[2i+1])``
  of the rope slice (q's rope slice is the tail ``[qk_nope:]`` of each head; kv_a's is the tail ``[kv_lora:]``).
- ``hidden_act`` is ``"silu"`` by default; only ``silu``/``swish`` are accepted.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "TINY",
    "draft",
    "forward_base_logits",
    "markov_greedy",
    "random_checkpoint",
    "random_target",
    "rms_norm",
    "rope_interleaved",
    "tensor_names",
    "tiny_config",
]


# --------------------------------------------------------------------------------------------------- config helpers


def tiny_config(vocab: int = 96, **overrides) -> dict:
    """A tiny ``k3_dspark`` config; ``mask_token_id = vocab - 1``. ``overrides`` replace keys (e.g. ``causal=True``)."""
    cfg = {
        "architectures": ["K3DSparkModel"],
        "model_type": "k3_dspark",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "mla_use_nope": False,
        "mla_use_output_gate": False,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 50000.0,
        "num_target_layers": 2,
        "target_hidden_size": 64,
        "target_layer_ids": [0, 2],
        "mask_token_id": vocab - 1,
        "markov_rank": 8,
        "hidden_act": "silu",
    }
    cfg.update(overrides)
    return cfg


TINY = tiny_config(96)


def tensor_names(cfg: dict) -> list[str]:
    """Every tensor name the oracle reads, in a fixed order."""
    names = []
    for l in range(cfg["num_hidden_layers"]):
        p = f"layers.{l}."
        names += [p + f"self_attn.{m}.weight" for m in
                  ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
                   "o_proj")]
        names += [p + f"mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    names += ["context_proj.weight", "context_norm.weight", "final_norm.weight", "markov_head.markov_w1.weight",
              "markov_head.markov_w2.weight"]
    return names


def _shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    H = cfg["hidden_size"]
    nh = cfg["num_attention_heads"]
    qr, kvr = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    I = cfg["intermediate_size"]
    V = cfg["vocab_size"]
    r = cfg["markov_rank"]
    tin = len(cfg["target_layer_ids"]) * cfg["target_hidden_size"]
    s = {}
    for l in range(cfg["num_hidden_layers"]):
        p = f"layers.{l}."
        s[p + "self_attn.q_a_proj.weight"] = (qr, H)
        s[p + "self_attn.q_a_layernorm.weight"] = (qr,)
        s[p + "self_attn.q_b_proj.weight"] = (nh * (dn + dr), qr)
        s[p + "self_attn.kv_a_proj_with_mqa.weight"] = (kvr + dr, H)
        s[p + "self_attn.kv_a_layernorm.weight"] = (kvr,)
        s[p + "self_attn.kv_b_proj.weight"] = (nh * (dn + dv), kvr)
        s[p + "self_attn.o_proj.weight"] = (H, nh * dv)
        s[p + "mlp.gate_proj.weight"] = (I, H)
        s[p + "mlp.up_proj.weight"] = (I, H)
        s[p + "mlp.down_proj.weight"] = (H, I)
        s[p + "input_layernorm.weight"] = (H,)
        s[p + "post_attention_layernorm.weight"] = (H,)
    s["context_proj.weight"] = (H, tin)
    s["context_norm.weight"] = (H,)
    s["final_norm.weight"] = (H,)
    s["markov_head.markov_w1.weight"] = (V, r)
    s["markov_head.markov_w2.weight"] = (V, r)
    return s


def random_checkpoint(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    """Every drafter tensor (torch ``[out, in]`` layout), float32: norm weights ``1 + 0.1 N(0,1)``, linear weights
    ``N(0, 1) / sqrt(fan_in)``, ``markov_w1`` (an embedding) ``N(0, 1)``."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in _shapes(cfg).items():
        if len(shape) == 1:
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name == "markov_head.markov_w1.weight":
            w = rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / np.sqrt(shape[1])
        out[name] = w.astype(np.float32)
    return out


def random_target(cfg: dict, seed: int, T: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A stand-in target: ``embed [V, H]``, ``lm_head [V, H]`` and ``taps [T, len(ids) * target_hidden]``, float32."""
    rng = np.random.default_rng(seed)
    V, H = cfg["vocab_size"], cfg["hidden_size"]
    embed = rng.standard_normal((V, H)).astype(np.float32)
    lm_head = (rng.standard_normal((V, H)) / np.sqrt(H)).astype(np.float32)
    taps = rng.standard_normal((T, len(cfg["target_layer_ids"]) * cfg["target_hidden_size"])).astype(np.float32)
    return embed, lm_head, taps


# ------------------------------------------------------------------------------------------------------- primitives


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(w, np.float64)


def rope_interleaved(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """Interleaved (non-NeoX) RoPE on the last axis of ``x [..., T, (heads,) d]``-like arrays.

    ``x`` has shape ``[T, d]`` or ``[T, heads, d]``; ``pos [T]``. Pair ``(x[2i], x[2i+1])`` is rotated by
    ``pos * theta ** (-2i/d)``.
    """
    x = np.asarray(x, np.float64)
    d = x.shape[-1]
    assert d % 2 == 0
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)  # [d/2]
    ang = np.asarray(pos, np.float64)[:, None] * inv[None, :]  # [T, d/2]
    if x.ndim == 3:
        ang = ang[:, None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out


def _act(cfg: dict, x: np.ndarray) -> np.ndarray:
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise NotImplementedError(f"dspark oracle: hidden_act {act!r} (only silu)")
    return x / (1.0 + np.exp(-x))


def _lin(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """torch Linear without bias: ``x @ w.T`` with ``w [out, in]``."""
    return x @ np.asarray(w, np.float64).T


# --------------------------------------------------------------------------------------------------------- the model


def _check_cfg(cfg: dict) -> None:
    for k in ("mla_use_nope", "mla_use_output_gate", "mla_use_qk_norm", "dspark_bonus_anchor"):
        if cfg.get(k):
            raise NotImplementedError(f"dspark oracle: {k}=True is not the k3_dspark format")
    if cfg.get("q_lora_rank") is None:
        raise NotImplementedError("dspark oracle: q_lora_rank=None")
    if cfg.get("rope_scaling"):
        raise NotImplementedError("dspark oracle: rope_scaling is not modelled")


def _kv_entries(cfg, t, l, x, pos):
    """MLA latent K/V for rows ``x [S, H]`` at ``pos [S]``: (normed latent [S, kv_lora], roped k_rope [S, dr])."""
    p = f"layers.{l}.self_attn."
    kvr = cfg["kv_lora_rank"]
    c = _lin(x, t[p + "kv_a_proj_with_mqa.weight"])
    lat = rms_norm(c[:, :kvr], t[p + "kv_a_layernorm.weight"], cfg["rms_norm_eps"])
    kr = rope_interleaved(c[:, kvr:], pos, cfg["rope_theta"])
    return lat, kr


def _attention(cfg, t, l, x, block_pos, ctx_lat, ctx_kr):
    """MLA with q-LoRA for the block rows ``x [n, H]`` against context + block K/V. Returns ``[n, H]``."""
    p = f"layers.{l}.self_attn."
    nh = cfg["num_attention_heads"]
    dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    kvr = cfg["kv_lora_rank"]
    eps = cfg["rms_norm_eps"]
    n = x.shape[0]
    T = ctx_lat.shape[0]

    q = _lin(rms_norm(_lin(x, t[p + "q_a_proj.weight"]), t[p + "q_a_layernorm.weight"], eps), t[p + "q_b_proj.weight"])
    q = q.reshape(n, nh, dn + dr)
    q_nope, q_rope = q[..., :dn], rope_interleaved(q[..., dn:], block_pos, cfg["rope_theta"])

    blk_lat, blk_kr = _kv_entries(cfg, t, l, x, block_pos)
    lat = np.concatenate([ctx_lat, blk_lat], axis=0)  # [S, kvr]
    kr = np.concatenate([ctx_kr, blk_kr], axis=0)  # [S, dr]
    S = lat.shape[0]

    wkv = np.asarray(t[p + "kv_b_proj.weight"], np.float64).reshape(nh, dn + dv, kvr)
    kv = np.einsum("sc,hoc->sho", lat, wkv)  # [S, nh, dn+dv]
    k_nope, v = kv[..., :dn], kv[..., dn:]

    scores = (np.einsum("nhd,shd->hns", q_nope, k_nope) + np.einsum("nhd,sd->hns", q_rope, kr)) / np.sqrt(dn + dr)
    if cfg.get("causal"):
        mask = np.ones((n, S), bool)
        mask[:, T:] = np.tril(np.ones((n, n), bool))
        scores = np.where(mask[None], scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    o = np.einsum("hns,shd->nhd", probs, v).reshape(n, nh * dv)
    return _lin(o, t[p + "o_proj.weight"])


def _mlp(cfg, t, l, x):
    p = f"layers.{l}.mlp."
    return _lin(_act(cfg, _lin(x, t[p + "gate_proj.weight"])) * _lin(x, t[p + "up_proj.weight"]), t[p + "down_proj.weight"])


def forward_base_logits(cfg: dict, tensors: dict, embed: np.ndarray, lm_head: np.ndarray, taps: np.ndarray,
                        block_tokens, pos0: int = 0) -> np.ndarray:
    """The backbone on an explicit block of token ids. Context positions are ``pos0 .. pos0+T-1`` and the block's
    ``pos0+T .. pos0+T+len(block)-1`` (``pos0`` is 0 in ``draft``; other values exist for the RoPE-shift test)."""
    _check_cfg(cfg)
    eps = cfg["rms_norm_eps"]
    taps = np.asarray(taps, np.float64)
    T = taps.shape[0]
    block_tokens = np.asarray(block_tokens, np.int64)
    n = block_tokens.shape[0]
    ctx_pos = pos0 + np.arange(T)
    blk_pos = pos0 + T + np.arange(n)

    context = rms_norm(_lin(taps, tensors["context_proj.weight"]), tensors["context_norm.weight"], eps)
    h = np.asarray(embed, np.float64)[block_tokens]
    for l in range(cfg["num_hidden_layers"]):
        ctx_lat, ctx_kr = _kv_entries(cfg, tensors, l, context, ctx_pos)
        p = f"layers.{l}."
        x = h + _attention(cfg, tensors, l, rms_norm(h, tensors[p + "input_layernorm.weight"], eps), blk_pos, ctx_lat,
                           ctx_kr)
        h = x + _mlp(cfg, tensors, l, rms_norm(x, tensors[p + "post_attention_layernorm.weight"], eps))
    h = rms_norm(h, tensors["final_norm.weight"], eps)
    return h @ np.asarray(lm_head, np.float64).T


def markov_greedy(tensors: dict, base_logits: np.ndarray, anchor: int) -> list[int]:
    """Sequential greedy Markov decoding: ``prev = anchor``; ``d_i = argmax(base[i] + w2 @ w1[prev])``."""
    w1 = np.asarray(tensors["markov_head.markov_w1.weight"], np.float64)  # [V, r] embedding
    w2 = np.asarray(tensors["markov_head.markov_w2.weight"], np.float64)  # [V, r] Linear r -> V
    prev = int(anchor)
    out = []
    for i in range(base_logits.shape[0]):
        logits = np.asarray(base_logits[i], np.float64) + w2 @ w1[prev]
        prev = int(np.argmax(logits))  # first maximum: lowest index on ties
        out.append(prev)
    return out


def draft(cfg: dict, tensors: dict[str, np.ndarray], embed: np.ndarray, lm_head: np.ndarray,
          taps: np.ndarray, anchor: int, n: int) -> tuple[np.ndarray, list[int]]:
    """cfg: the drafter's config.json dict (k3_dspark format: hidden_size, num_hidden_layers, num_attention_heads,
    q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, rms_norm_eps, rope_theta,
    intermediate_size, target_layer_ids, target_hidden_size, mask_token_id, markov_rank, hidden_act ('silu'
    default)). tensors: released checkpoint names -> arrays in torch [out, in] layout. embed, lm_head: the
    target's [V, H]. taps: [T, len(target_layer_ids) * target_hidden_size] -- the target's hidden states at the
    context positions 0..T-1 (concatenated in target_layer_ids order). anchor: the token at position T (the last
    token the target produced). n: block size.
    Returns (base_logits [n, V] float64 before the Markov head, greedy drafts: n token ids with the Markov
    correction).

    Optional cfg key ``causal`` (default False): block query i sees block keys <= i (context keys always).
    """
    block = [int(anchor)] + [int(cfg["mask_token_id"])] * (n - 1)
    base = forward_base_logits(cfg, tensors, embed, lm_head, taps, block, pos0=0)
    return base, markov_greedy(tensors, base, anchor)
