"""A float64 numpy reference ("oracle") of one Kimi K3.1 full-attention (DSA) layer's token mixer.

Written from the specs only -- docs/K31_AND_DSPARK.md sections 0-5 (config, tensor names/shapes, indexer math 3.1,
masking/short context/ties 3.2, sparse consumption 3.3, reference pseudo-code 3.6) and docs/K3_SPEC.md 3.4/4.1/4.3
(K3 gated NoPE MLA, KimiRMSNorm). It shares no code with the JAX implementation, so the two can check each other.
Pure numpy, float64 throughout, no jax, no bf16 rounding anywhere (the spec's bf16 roundings are deliberately left
out: this is the exact-arithmetic reference).

Input ``x [T, hidden]`` is what the mixer sees: the (AttnRes-mixed) layer input after ``input_layernorm``
(K3_SPEC 4.2 ``y = Attn_l(RMSNorm(a; input_layernorm))``). The whole sequence is one causal prefill at positions
``0..T-1``.

K3 gated NoPE MLA (K3_SPEC 4.3)::

    qr   = RMSNorm_{mla_norm_eps}(q_a_proj(x); q_a_layernorm)         [T, q_lora]
    q    = q_b_proj(qr) -> [T, H, nope + rope]  (per head [nope | pe], pe NOT rotated)
    ckv  = kv_a_proj_with_mqa(x) -> c = RMSNorm_{mla_norm_eps}(ckv[:, :kv_lora]; kv_a_layernorm), kpe = ckv[:, kv_lora:]
    kv   = kv_b_proj(c) -> [T, H, nope + v]    (per head [k_nope | v])
    K_h  = [k_nope_h | kpe]  (kpe shared by all heads, not normalised, not rotated)
    s    = Q_h K_h^T * (nope + rope)^-0.5 + mask;  o_h = softmax(s) V_h
    o    = concat_h(o_h) * sigmoid(g_proj(x));  y = o_proj(o)

K3.1 indexer (K31 3.1, 3.6)::

    qI   = wq_b(qr) -> [T, HI, DI]                      (qr = the q-LoRA latent AFTER q_a_layernorm)
    kI   = LayerNorm_{index_norm_eps}(wk(x); k_norm.weight, k_norm.bias)   [T, DI]
    w    = weights_proj(x) * HI^-0.5 * DI^-0.5           [T, HI]
    I[t, s] = sum_h w[t, h] * ReLU(qI[t, h] . kI[s])  for s <= t, -inf for s > t
    sel[t] = top-min(k, t+1) of I[t, :t+1];   attention mask = causal AND sel

Choices where the spec is marked [I]/[U] (each one is a keyword in the config dict, so tests can vary them):

- ``k_norm``: LayerNorm (mean-centred, biased variance) with weight and bias [C: S3 "LayerNorm"; bias I: V3.2].
  ``self_attn.indexer.k_norm.bias`` is optional in ``tensors``; missing means zero bias.
- LayerNorm eps: ``cfg["index_norm_eps"]`` if given, else ``cfg["rms_norm_eps"]`` (llama.cpp's K3.1 behaviour,
  the spec's recommended default; DeepSeek V3.2 / vLLM use 1e-6).
- MLA norm eps: ``cfg["mla_norm_eps"]`` if given, else 1e-6 (K3's q_a/kv_a layernorm class default).
- Indexer query source: ``wq_b`` reads ``qr``, the q-LoRA latent after ``q_a_layernorm`` [I: V3.2 passes the
  post-``q_norm`` ``qr``]; ``index_scores`` takes it as an argument (``q_lora``), see ``q_lora()``.
- Weights scaling: DeepSeek's positive constants ``HI^-0.5 * DI^-0.5`` are applied (``cfg["index_score_scale"]``
  = False drops them). They cannot change the selection. No Hadamard rotation, no FP8, no RoPE.
- Ties (unknown for K3.1): among equal index scores the LARGER key index wins (score descending, then key id
  descending) -- FlashInfer's deterministic DSA rule, the only deterministic rule the spec cites [C: S30].
  Ties are not rare here: ReLU zeros every head of a pair often enough that many keys score exactly 0.
- Short rows: a query with ``t + 1 <= k`` causal keys selects all of them, so the layer is exactly K3's dense
  causal MLA; the same masking code runs in both cases, so the outputs are bit-identical.
- Config keys: the K3 names (``hidden_size``, ``num_attention_heads``, ``q_lora_rank``, ``kv_lora_rank``,
  ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``rms_norm_eps``) plus DeepSeek-style indexer keys
  ``index_n_heads``, ``index_head_dim``, ``index_topk`` [I: provisional spelling], read either flat or from a
  nested ``cfg["dsa_config"]``.
"""

from __future__ import annotations

import numpy as np

P = "self_attn."
IDX = "self_attn.indexer."


def tiny_config() -> dict:
    """A small K3.1-shaped layer config (K3's 128/64/128 nope/pe/v ratio scaled to 16/8/16)."""
    return {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 48,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,  # carried unrotated (NoPE)
        "v_head_dim": 16,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "rms_norm_eps": 1e-5,
        "mla_norm_eps": 1e-6,
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_topk": 4,
    }


def _get(cfg: dict, key: str, default=None):
    dsa = cfg.get("dsa_config") or {}
    if key in dsa:
        return dsa[key]
    if key in cfg:
        return cfg[key]
    if default is not None:
        return default
    raise KeyError(key)


def _dims(cfg: dict) -> dict:
    return {
        "d": int(cfg["hidden_size"]),
        "H": int(cfg["num_attention_heads"]),
        "ql": int(cfg["q_lora_rank"]),
        "kvl": int(cfg["kv_lora_rank"]),
        "nope": int(cfg["qk_nope_head_dim"]),
        "pe": int(cfg["qk_rope_head_dim"]),
        "v": int(cfg["v_head_dim"]),
        "HI": int(_get(cfg, "index_n_heads")) if has_indexer(cfg) else 0,
        "DI": int(_get(cfg, "index_head_dim")) if has_indexer(cfg) else 0,
    }


def layer_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of one K3.1 MLA layer's ``self_attn`` (prefix stripped), torch ``[out, in]``."""
    m = _dims(cfg)
    d, H, ql, kvl, nope, pe, v, HI, DI = (m[k] for k in ("d", "H", "ql", "kvl", "nope", "pe", "v", "HI", "DI"))
    return {
        P + "q_a_proj.weight": (ql, d),
        P + "q_a_layernorm.weight": (ql,),
        P + "q_b_proj.weight": (H * (nope + pe), ql),
        P + "kv_a_proj_with_mqa.weight": (kvl + pe, d),
        P + "kv_a_layernorm.weight": (kvl,),
        P + "kv_b_proj.weight": (H * (nope + v), kvl),
        P + "g_proj.weight": (H * v, d),
        P + "o_proj.weight": (d, H * v),
        IDX + "wq_b.weight": (HI * DI, ql),
        IDX + "wk.weight": (DI, d),
        IDX + "weights_proj.weight": (HI, d),
        IDX + "k_norm.weight": (DI,),
        IDX + "k_norm.bias": (DI,),
    }


def random_layer(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    """Random float64 tensors: projections N(0, 1/fan_in); norm weights 1 + 0.1 N(0,1); k_norm bias 0.1 N(0,1)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in layer_shapes(cfg).items():
        if name.endswith("norm.weight"):
            out[name] = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            out[name] = 0.1 * rng.standard_normal(shape)
        else:
            out[name] = rng.standard_normal(shape) / np.sqrt(shape[1])
    return out


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, eps: float) -> np.ndarray:
    mu = np.mean(x, axis=-1, keepdims=True)
    var = np.mean((x - mu) ** 2, axis=-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + eps) * w
    return y if b is None else y + b


def has_indexer(cfg: dict) -> bool:
    """Whether ``cfg`` describes an indexer (K3.1); without one the layer is K3's dense MLA (``index_topk=None``)."""
    return "index_n_heads" in (cfg.get("dsa_config") or {}) or "index_n_heads" in cfg


def _check(cfg: dict, tensors: dict, x: np.ndarray) -> None:
    for name, shape in layer_shapes(cfg).items():
        if name == IDX + "k_norm.bias" and name not in tensors:
            continue
        if name.startswith(IDX) and not has_indexer(cfg):
            continue
        got = tuple(np.shape(tensors[name]))
        if got != shape:
            raise ValueError(f"{name}: shape {got}, expected {shape}")
    if x.ndim != 2 or x.shape[1] != int(cfg["hidden_size"]):
        raise ValueError(f"x must be [T, {cfg['hidden_size']}], got {x.shape}")


def q_lora(cfg: dict, tensors: dict, x: np.ndarray, dtype=np.float64) -> np.ndarray:
    """``qr = RMSNorm(q_a_proj(x); q_a_layernorm)`` [T, q_lora_rank]: feeds q_b_proj and the indexer's wq_b."""
    x = np.asarray(x, dtype)
    eps = float(cfg.get("mla_norm_eps", 1e-6))
    return _rms(x @ tensors[P + "q_a_proj.weight"].T, tensors[P + "q_a_layernorm.weight"], eps)


def index_scores(cfg: dict, tensors: dict, x: np.ndarray, q_lora: np.ndarray, dtype=np.float64) -> np.ndarray:
    """Indexer logits ``I [T, T]``: ``I[t, s] = sum_h w[t,h] ReLU(qI[t,h] . kI[s])`` for ``s <= t``, -inf above."""
    m = _dims(cfg)
    x = np.asarray(x, dtype)
    q_lora = np.asarray(q_lora, dtype)
    T = x.shape[0]
    HI, DI = m["HI"], m["DI"]
    eps = float(cfg.get("index_norm_eps", cfg["rms_norm_eps"]))
    qI = (q_lora @ tensors[IDX + "wq_b.weight"].T).reshape(T, HI, DI)
    kI = _layer_norm(
        x @ tensors[IDX + "wk.weight"].T, tensors[IDX + "k_norm.weight"], tensors.get(IDX + "k_norm.bias"), eps
    )
    w = x @ tensors[IDX + "weights_proj.weight"].T  # [T, HI]
    if cfg.get("index_score_scale", True):
        w = w * (HI**-0.5) * (DI**-0.5)
    logits = np.einsum("thd,sd->ths", qI, kI)  # [T, HI, T]
    s = np.einsum("th,ths->ts", w, np.maximum(logits, 0.0))
    causal = np.tril(np.ones((T, T), dtype=bool))
    return np.where(causal, s, -np.inf)


def topk_mask(scores: np.ndarray, k: int) -> np.ndarray:
    """Boolean ``[T, T]`` selection: row ``t`` keeps the ``min(k, t+1)`` best causal keys.

    Causal keys are ``s <= t`` with a score above -inf (re-masked causally, as DeepSeek does). Order: score
    descending, then key index descending (ties go to the later key).
    """
    scores = np.asarray(scores, np.float64)
    T, S = scores.shape
    if k < 1:
        raise ValueError("k must be >= 1")
    causal = np.tril(np.ones((T, S), dtype=bool))
    valid = causal & (scores > -np.inf)
    mask = np.zeros((T, S), dtype=bool)
    idx = np.arange(S)
    for t in range(T):
        cand = idx[valid[t]]
        if cand.size <= k:
            mask[t, cand] = True
            continue
        # lexsort: last key is primary. Primary: -score ascending (score descending); secondary: -index ascending.
        order = np.lexsort((-cand, -scores[t, cand]))
        mask[t, cand[order[:k]]] = True
    return mask


def mla_layer_masked(cfg: dict, tensors: dict, x: np.ndarray, mask: np.ndarray, dtype=np.float64) -> np.ndarray:
    """K3 gated NoPE MLA where query ``t`` attends to keys ``s`` with ``mask[t, s]`` (always ANDed with causal)."""
    _check(cfg, tensors, x)
    m = _dims(cfg)
    x = np.asarray(x, dtype)
    T = x.shape[0]
    H, kvl, nope, pe, v = m["H"], m["kvl"], m["nope"], m["pe"], m["v"]
    eps = float(cfg.get("mla_norm_eps", 1e-6))

    qr = q_lora(cfg, tensors, x, dtype)
    q = (qr @ tensors[P + "q_b_proj.weight"].T).reshape(T, H, nope + pe)  # per head [nope | pe], no rotation
    ckv = x @ tensors[P + "kv_a_proj_with_mqa.weight"].T
    c = _rms(ckv[:, :kvl], tensors[P + "kv_a_layernorm.weight"], eps)
    kpe = ckv[:, kvl:]  # [T, pe], shared by all heads, not normalised, not rotated
    kv = (c @ tensors[P + "kv_b_proj.weight"].T).reshape(T, H, nope + v)
    k_nope, val = kv[..., :nope], kv[..., nope:]
    k = np.concatenate([k_nope, np.broadcast_to(kpe[:, None, :], (T, H, pe))], axis=-1)  # [T, H, nope+pe]

    scale = (nope + pe) ** -0.5
    s = np.einsum("thd,shd->hts", q, k) * scale  # [H, T, T]
    allowed = np.asarray(mask, bool) & np.tril(np.ones((T, T), dtype=bool))
    s = np.where(allowed[None], s, -np.inf)
    s = s - np.max(s, axis=-1, keepdims=True)
    p = np.exp(s)
    p = p / np.sum(p, axis=-1, keepdims=True)
    o = np.einsum("hts,shd->thd", p, val).reshape(T, H * v)

    if cfg.get("mla_use_output_gate", True):
        g = x @ tensors[P + "g_proj.weight"].T
        o = o * (1.0 / (1.0 + np.exp(-g)))  # sigmoid gate after head concat, before o_proj
    return o @ tensors[P + "o_proj.weight"].T


def mla_layer(cfg: dict, tensors: dict, x: np.ndarray, *, index_topk: int | None, dtype=np.float64) -> np.ndarray:
    """One K3.1 full-attention layer's token mixer over a causal sequence ``x [T, hidden]`` -> ``[T, hidden]``.

    ``index_topk=None``: dense causal MLA (K3). Otherwise query ``t`` attends only to ``topk_mask`` of the indexer
    scores (all its causal keys when ``t + 1 <= index_topk``, which is then exactly K3). ``dtype``: the arithmetic
    (float64; float32 only to measure what float32 rounding does, with float32 ``tensors``).
    """
    x = np.asarray(x, dtype)
    T = x.shape[0]
    if index_topk is None:
        mask = np.tril(np.ones((T, T), dtype=bool))
    else:
        mask = topk_mask(index_scores(cfg, tensors, x, q_lora(cfg, tensors, x, dtype), dtype), int(index_topk))
    return mla_layer_masked(cfg, tensors, x, mask, dtype)
