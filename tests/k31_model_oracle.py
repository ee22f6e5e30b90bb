"""A float64 numpy reference ("oracle") of a whole Kimi K3 / K3.1 text model, read from a checkpoint directory.

Written from the specs only -- docs/K3_SPEC.md sections 1-5 (config, layer schedule, AttnRes, KDA with its short conv
and gates, gated NoPE MLA, SiTU-GLU, dense layer 0, Stable LatentMoE, final norm, lm_head, MXFP4) and
docs/K31_AND_DSPARK.md sections 0-5 (the DSA indexer) -- not from kimi_jax's model code, with which it shares
nothing: the config is read with ``json``, the tensors with ``safetensors.numpy.load_file``, MXFP4 experts are
decoded here (spec section 5). The MLA(+indexer) mixer is tests/k31_oracle.py (spec-written as well).

    cfg, tensors = load(path)                 # text_config dict, {name without "language_model.": float64 array}
    logits = forward(cfg, tensors, ids)       # [T, vocab] float64: one causal pass over ids [T]

The logits at position ``t`` are what a decode step feeding ``ids[t]`` after ``ids[:t]`` must give (causal model,
no positions anywhere: KDA is recurrent, MLA is NoPE). Exact arithmetic: float64 throughout, none of the reference's
bf16 rounding points (K3_SPEC 4.9) -- stored bf16 / MXFP4 values are taken exactly.

Schedule (K3_SPEC 2, 4.0, 4.2): layer ``l`` is KDA iff ``l + 1`` is in ``linear_attn_config.kda_layers`` (1-based),
else MLA; dense SiTU MLP for ``l < first_k_dense_replace``, LatentMoE after. With ``attn_res_block_size`` set, Block
Attention Residuals: at a layer with ``l % block == 0`` the raw layer input is sealed as a block and the partial sum
restarts; the attention input mixes the sealed blocks with the partial (no mix while none is sealed), the FFN input
mixes them again with the partial after attention, the model output mixes all of them. ``null`` = plain residuals.

Choices where the specs leave room (each stated in the spec as its recommendation):

- KDA's gated output norm ``o_norm`` uses ``rms_norm_eps`` (the spec's 1e-5; FLA's ``FusedRMSNormGated`` eps);
  the q/k L2 norm is ``x / sqrt(sum(x^2) + 1e-6)`` (FLA; K3_SPEC 9.2 item 3); q is scaled by ``head_dim^-0.5``.
- KDA decay: ``gate_lower_bound`` present -> ``g = lb * sigmoid(exp(A_log) * (z + dt_bias))``; absent -> the
  softplus form ``g = -exp(A_log) * softplus(z + dt_bias)`` (K3_SPEC 4.4 step 4, 9.2 item 6). ``A_log`` is stored
  zero-padded: the first ``num_heads`` entries are used. The recurrence is the plain token-by-token one (4.4 step 7):
  ``S <- diag(exp(g_t)) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T q_t``, zero initial state.
- Router (K3_SPEC 4.7): sigmoid scores, selection by score + ``e_score_correction_bias``, weights the unbiased scores
  renormalised (``/ (sum + 1e-20)``) when ``moe_renormalize``, times ``routed_scaling_factor``. Ties in the selection
  go to the lower expert index (numpy's stable sort; the spec leaves ties open). Grouped routing with more than one
  group is refused (the release has one group: a no-op).
- Indexer (K31 3.1-3.2, via tests/k31_oracle.py): ``wq_b`` reads the q-LoRA latent after ``q_a_layernorm``; key
  LayerNorm with weight and optional bias, eps ``rms_norm_eps`` unless ``index_norm_eps`` is given (llama.cpp); top-k
  ties go to the later key; a query with at most k causal keys keeps them all (then the layer is K3's dense MLA).
  ``dsa_config`` key spellings are read leniently (K31 1.3): ``index_n_heads|n_heads|num_heads|head_count``,
  ``index_head_dim|head_dim|key_length``, ``index_topk|topk|top_k``; the layer list (first list value) must equal the
  MLA layers.
- MLA ``q_a_layernorm`` / ``kv_a_layernorm`` eps 1e-6 (class default, K3_SPEC 4.1); every other RMSNorm
  ``rms_norm_eps``; the AttnRes key norm is weightless with eps 1e-5 (K3_SPEC 4.2).
"""

from __future__ import annotations

import glob
import json
import os

import ml_dtypes  # noqa: F401 -- registers bfloat16 with numpy, which safetensors.numpy needs for BF16 tensors
import numpy as np
from safetensors.numpy import load_file

from tests import k31_oracle

PREFIX = "language_model."
ATTN_RES_EPS = 1e-5  # K3_SPEC 4.2: the AttnRes key RMSNorm (weightless, fixed eps)
KDA_L2_EPS = 1e-6  # K3_SPEC 4.1 item 4: added to the sum of squares
MLA_NORM_EPS = 1e-6  # K3_SPEC 4.1: q_a_layernorm / kv_a_layernorm class default
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)  # K3_SPEC 5
DSA_ALIASES = {"index_n_heads": ("index_n_heads", "n_heads", "num_heads", "head_count"),
               "index_head_dim": ("index_head_dim", "head_dim", "key_length"),
               "index_topk": ("index_topk", "topk", "top_k"),
               "index_norm_eps": ("index_norm_eps",)}


# -- reading ----------------------------------------------------------------------------------------------------


def mxfp4_dequantize(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """K3_SPEC 5: ``packed`` U8 [out, in/2] (element 2j in the low nibble of byte j, 2j+1 in the high one),
    ``scale`` U8 [out, in/32] (E8M0: 2^(s-127)) -> W [out, in] float64."""
    packed = np.asarray(packed, np.uint8)
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[0], -1)  # [out, in]
    if np.any(scale == 255):
        raise ValueError("E8M0 scale byte 255 is NaN")
    s = np.exp2(np.asarray(scale, np.float64) - 127.0)
    return E2M1[codes] * np.repeat(s, 32, axis=1)


def _dsa(t: dict) -> dict | None:
    """The indexer keys of ``text_config`` under their DeepSeek spelling (K31 1.3), or None (K3)."""
    raw = t.get("dsa_config")
    if raw is None:
        return None
    out = {}
    for key, names in DSA_ALIASES.items():
        for n in names:
            if n in raw:
                out[key] = raw[n]
                break
    lists = [v for v in raw.values() if isinstance(v, list)]
    out["layers"] = [int(i) for i in lists[0]] if lists else None
    return out


def load(path: str) -> tuple[dict, dict]:
    """``(text_config, tensors)`` of the checkpoint directory ``path``: every ``*.safetensors`` file, names without
    ``language_model.``, values float64, MXFP4 experts decoded to ``experts.{e}.w{1,2,3}.weight``."""
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    cfg = dict(raw.get("text_config", raw))
    if "dsa_config" not in cfg and "dsa_config" in raw:  # K31 1.2: the object may sit at the top level
        cfg["dsa_config"] = raw["dsa_config"]
    tensors = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        for name, a in load_file(file).items():
            tensors[name.removeprefix(PREFIX)] = a
    out = {}
    for name, a in tensors.items():
        if name.endswith(".weight_scale"):
            continue
        if name.endswith(".weight_packed"):
            base = name.removesuffix("_packed")
            out[base] = mxfp4_dequantize(a, tensors[base + "_scale"])
        else:
            out[name] = np.asarray(a, np.float64)
    return cfg, out


# -- pieces -----------------------------------------------------------------------------------------------------


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def silu(x):
    return x * sigmoid(x)


def situ(a, b, beta, linear_beta):
    """K3_SPEC 4.5: ``[beta tanh(a/beta) sigmoid(a)] * [linear_beta tanh(b/linear_beta)]``."""
    up = b if linear_beta is None else linear_beta * np.tanh(b / linear_beta)
    return beta * np.tanh(a / beta) * sigmoid(a) * up


def linear(x, tensors, name):
    return x @ tensors[name + ".weight"].T


def attn_res_mix(blocks: list, partial, norm_w, proj_w):
    """K3_SPEC 4.2 Mix: softmax over the sources (sealed blocks + partial) of ``(RMSNorm(v) * norm_w) . proj_w``,
    per token; the weighted sum takes the raw sources."""
    V = np.stack(blocks + [partial])  # [n, T, D]
    normed = V / np.sqrt(np.mean(V * V, axis=-1, keepdims=True) + ATTN_RES_EPS)
    s = np.einsum("ntd,d->nt", normed, norm_w * proj_w.reshape(-1))
    s = s - s.max(axis=0, keepdims=True)
    a = np.exp(s)
    a = a / a.sum(axis=0, keepdims=True)
    return np.einsum("nt,ntd->td", a, V)


def _causal_conv_silu(x, w):
    """K3_SPEC 4.4 step 2: depthwise causal conv, ``w [C, 1, W]`` (``w[:, 0, -1]`` on the current token), then
    SiLU. ``x [T, C]``, zero history."""
    W = w.shape[-1]
    xp = np.concatenate([np.zeros((W - 1, x.shape[1]), x.dtype), x])
    u = sum(w[:, 0, j] * xp[j:j + x.shape[0]] for j in range(W))
    return silu(u)


def _l2(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + KDA_L2_EPS)


def kda(cfg: dict, t: dict, x):
    """K3_SPEC 4.4: Kimi Delta Attention over ``x [T, D]`` (normed layer input), zero initial state."""
    lac = cfg["linear_attn_config"]
    H, K = int(lac["num_heads"]), int(lac["head_dim"])
    T = x.shape[0]
    q, k, v = (_causal_conv_silu(linear(x, t, f"self_attn.{n}_proj"), t[f"self_attn.{n}_conv1d.weight"])
               .reshape(T, H, K) for n in "qkv")
    z = linear(linear(x, t, "self_attn.f_a_proj"), t, "self_attn.f_b_proj").reshape(T, H, K)
    a = np.exp(t["self_attn.A_log"].reshape(-1)[:H])[None, :, None]  # stored zero-padded past num_heads
    zb = z + t["self_attn.dt_bias"].reshape(H, K)
    lb = lac.get("gate_lower_bound")
    g = lb * sigmoid(a * zb) if lb is not None else -a * np.logaddexp(0.0, zb)  # log-decay [T, H, K]
    beta = sigmoid(linear(x, t, "self_attn.b_proj"))  # [T, H]
    q, k = _l2(q) * K**-0.5, _l2(k)
    S = np.zeros((H, K, K), x.dtype)  # [H, K (key), V (value)]
    o = np.zeros((T, H, K), x.dtype)
    for i in range(T):
        S = S * np.exp(g[i])[:, :, None]
        err = v[i] - np.einsum("hk,hkv->hv", k[i], S)
        S = S + beta[i][:, None, None] * k[i][:, :, None] * err[:, None, :]
        o[i] = np.einsum("hk,hkv->hv", q[i], S)
    if lac.get("use_full_rank_gate", True):
        gate = linear(x, t, "self_attn.g_proj")
    else:
        gate = linear(linear(x, t, "self_attn.g_a_proj"), t, "self_attn.g_b_proj")
    o = rms_norm(o, t["self_attn.o_norm.weight"], cfg["rms_norm_eps"]) * sigmoid(gate.reshape(T, H, K))
    return linear(o.reshape(T, H * K), t, "self_attn.o_proj")


def _mla_cfg(cfg: dict) -> dict:
    """The tests/k31_oracle.py config of this model's MLA layers (flat DeepSeek-style indexer keys)."""
    out = {k: cfg[k] for k in ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                               "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rms_norm_eps")}
    out["mla_use_output_gate"] = cfg.get("mla_use_output_gate", True)
    out["mla_norm_eps"] = MLA_NORM_EPS
    dsa = _dsa(cfg)
    if dsa is not None:
        out.update({k: v for k, v in dsa.items() if k != "layers"})
    return out


def mla(cfg: dict, t: dict, x, index_topk):
    """K3_SPEC 4.3 gated NoPE MLA; K3.1 (K31 3.1): only the indexer's top ``index_topk`` causal keys per query."""
    mcfg = _mla_cfg(cfg)
    if not k31_oracle.has_indexer(mcfg):
        index_topk = None
    return k31_oracle.mla_layer(mcfg, t, x, index_topk=index_topk, dtype=x.dtype)


def dense_mlp(cfg: dict, t: dict, x, prefix="mlp."):
    """K3_SPEC 4.6 (and the shared experts of 4.7 step 6): ``down(SiTU(gate(x), up(x)))``."""
    a, b = linear(x, t, prefix + "gate_proj"), linear(x, t, prefix + "up_proj")
    h = situ(a, b, cfg["activation_situ_beta"], cfg.get("activation_situ_linear_beta"))
    return linear(h, t, prefix + "down_proj")


def route(cfg: dict, t: dict, x):
    """K3_SPEC 4.7 step 1: ``(idx [T, k] sorted ascending, weights [T, k])``."""
    if cfg.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise NotImplementedError("only the sigmoid router")
    if int(cfg.get("num_expert_group") or 1) != 1:
        raise NotImplementedError("grouped routing with more than one group")
    m = "block_sparse_moe.gate."
    s = sigmoid(x @ t[m + "weight"].T)  # [T, E]
    choice = s + t.get(m + "e_score_correction_bias", 0.0)
    k = int(cfg["num_experts_per_token"])
    idx = np.sort(np.argsort(-choice, axis=-1, kind="stable")[:, :k], axis=-1)
    p = np.take_along_axis(s, idx, axis=-1)
    if cfg.get("moe_renormalize", True):
        p = p / (p.sum(axis=-1, keepdims=True) + 1e-20)
    return idx, p * float(cfg.get("routed_scaling_factor", 1.0))


def latent_moe(cfg: dict, t: dict, x):
    """K3_SPEC 4.7: routed experts on the latent ``down(x)``, weighted sum, RMSNorm, up; plus the shared experts."""
    m = "block_sparse_moe."
    idx, p = route(cfg, t, x)
    latent = cfg.get("routed_expert_hidden_size")
    z = linear(x, t, m + "routed_expert_down_proj") if latent else x
    u = np.zeros_like(z)
    for e in np.unique(idx):
        w = np.sum(np.where(idx == e, p, 0.0), axis=-1)  # [T]: this expert's weight per token (0: not chosen)
        rows = np.flatnonzero(w)
        pe = f"{m}experts.{e}."
        a, b = z[rows] @ t[pe + "w1.weight"].T, z[rows] @ t[pe + "w3.weight"].T
        h = situ(a, b, cfg["activation_situ_beta"], cfg.get("activation_situ_linear_beta"))
        u[rows] += w[rows, None] * (h @ t[pe + "w2.weight"].T)
    if latent:
        if cfg.get("latent_moe_use_norm"):
            u = rms_norm(u, t[m + "routed_expert_norm.weight"], cfg["rms_norm_eps"])
        u = linear(u, t, m + "routed_expert_up_proj")
    if int(cfg.get("num_shared_experts") or 0):
        u = u + dense_mlp(cfg, t, x, m + "shared_experts.")
    return u


# -- the model --------------------------------------------------------------------------------------------------


def layer_kinds(cfg: dict) -> list[tuple[str, str]]:
    """``(attention, ffn)`` per layer: ``("kda" | "mla", "dense" | "moe")`` (K3_SPEC 2.1)."""
    n = int(cfg["num_hidden_layers"])
    kda_layers = {int(i) for i in cfg["linear_attn_config"].get("kda_layers") or ()}
    if int(cfg.get("moe_layer_freq", 1)) != 1:
        raise NotImplementedError("moe_layer_freq != 1")
    dense = int(cfg.get("first_k_dense_replace", 1))
    kinds = [("kda" if l + 1 in kda_layers else "mla", "dense" if l < dense else "moe") for l in range(n)]
    dsa = _dsa(cfg)
    if dsa is not None and dsa["layers"] is not None:
        mla_layers = [l + 1 for l, (a, _) in enumerate(kinds) if a == "mla"]
        if sorted(dsa["layers"]) != mla_layers:
            raise ValueError(f"dsa_config layers {dsa['layers']} != the MLA layers {mla_layers} (1-based)")
    return kinds


def _layer_tensors(tensors: dict, l: int) -> dict:
    pre = f"model.layers.{l}."
    return {k[len(pre):]: v for k, v in tensors.items() if k.startswith(pre)}


def forward(cfg: dict, tensors: dict, ids, *, index_topk: int | None = None, return_hidden: bool = False,
            dtype=np.float64):
    """Logits ``[T, vocab]`` (in ``dtype``) of one causal pass over ``ids [T]``. ``index_topk``: K3.1's top-k (default:
    the config's). ``return_hidden``: also a dict of each layer's output (the AttnRes partial sum, or the hidden
    state), the sealed blocks, the output mix, the final hidden state, each MoE layer's routing and each layer's
    (normed) token mixer and FFN inputs. ``dtype``: the arithmetic; float64, or float32 to measure what float32
    rounding alone does to this model (the floor a float32 implementation can reach)."""
    tensors = {k: np.asarray(v, dtype) for k, v in tensors.items()}
    eps = cfg["rms_norm_eps"]
    dsa = _dsa(cfg)
    if index_topk is None and dsa is not None:
        index_topk = int(dsa["index_topk"])
    h = tensors["model.embed_tokens.weight"][np.asarray(ids)]
    block = cfg.get("attn_res_block_size")
    blocks, layers, routes, inputs, ffn_inputs = [], [], [], [], []
    for l, (attn, ffn) in enumerate(layer_kinds(cfg)):
        t = _layer_tensors(tensors, l)

        def mixer(x, attn=attn, t=t):
            inputs.append(x)
            return kda(cfg, t, x) if attn == "kda" else mla(cfg, t, x, index_topk)

        m, h, blocks = _ffn_input(t, blocks, h, block, l, mixer, eps)
        xn = rms_norm(m, t["post_attention_layernorm.weight"], eps)
        ffn_inputs.append(xn)
        if ffn == "dense":
            h = h + dense_mlp(cfg, t, xn)
        else:
            routes.append(route(cfg, t, xn))
            h = h + latent_moe(cfg, t, xn)
        layers.append(h)
    mixed = h if block is None else attn_res_mix(blocks, h, tensors["model.output_attn_res_norm.weight"],
                                                 tensors["model.output_attn_res_proj.weight"])
    final = rms_norm(mixed, tensors["model.norm.weight"], eps)
    head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])  # tied when there is no lm_head
    logits = final @ head.T
    if not return_hidden:
        return logits
    return logits, {"layers": np.stack(layers), "blocks": np.stack(blocks) if blocks else None, "output_mix": mixed,
                    "final_hidden": final, "routes": routes, "mixer_inputs": inputs, "ffn_inputs": ffn_inputs}


def _ffn_input(t: dict, blocks: list, x, block: int | None, l: int, mixer, eps):
    """K3_SPEC 4.2 decoder layer up to the FFN input: ``(FFN input m, partial after attention, sealed blocks)``.
    Without AttnRes (``block`` None): ``(h + attn, h + attn, [])``."""
    if block is None:
        h = x + mixer(rms_norm(x, t["input_layernorm.weight"], eps))
        return h, h, []
    a = x if not blocks else attn_res_mix(blocks, x, t["self_attention_res_norm.weight"],
                                          t["self_attention_res_proj.weight"])
    seal = l % block == 0
    if seal:
        blocks = blocks + [x]  # the RAW layer input; the partial sum restarts
    y = mixer(rms_norm(a, t["input_layernorm.weight"], eps))
    partial = y if seal else x + y
    m = attn_res_mix(blocks, partial, t["mlp_res_norm.weight"], t["mlp_res_proj.weight"])
    return m, partial, blocks
