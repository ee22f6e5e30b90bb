"""Synthetic checkpoints in the exact released layouts, for tests, the demo and benchmarks (no torch needed).

    write_checkpoint(path, "k3")            # tiny K3 as Moonshot ships it: text_config, language_model. keys,
                                            # MXFP4 experts as compressed-tensors packs them, F32 where the release is
    write_checkpoint(path, "k3.1")          # tiny K3.1: the K3 layout plus self_attn.indexer.* in each MLA layer
    write_checkpoint(path, "k3.1", fp8_indexer=True)  # its indexer wq_b / wk FP8 in 128 x 128 blocks (DeepSeek-V3.2)
    write_checkpoint(path, "kimi_linear")   # Kimi Linear as HF transformers' save_pretrained writes it
    write_checkpoint(path, "llama")         # LlamaForCausalLM, likewise
    write_checkpoint(path, "k3", tokenizer=True)  # with a small Kimi-format tokenizer: text prompts work

The tensor inventory is derived here from the raw config keys (independently of ``kimi_jax.model.config`` and the loader's
name table, which it is meant to test). Every tensor gets its own random stream seeded by (seed, crc32(name)), so
values do not depend on sharding or write order, and shards are written one tensor at a time (bounded memory for
multi-gigabyte benchmark checkpoints).

Value scales follow tests/fixtures/k3-tiny-a/README.md so logits are O(1-5) and routing is non-degenerate:
linear N(0, clamp(1/sqrt(fan_in), 0.02, 0.1)); embeddings N(0, 0.3); lm_head N(0, 0.1 * sqrt(128/D)) (0.1 at the
fixture's width); norm weights 1 + N(0, 0.1); AttnRes projections N(0, 0.1); conv N(0, 0.3); exp(A_log) ~ U(1, 3);
dt_bias N(-1.5, 0.5); router correction bias N(0, 0.1). MXFP4 experts: the linear init with each 32-column group
multiplied by 2**m, m in {-1, 0, 1} (so scale bytes differ inside a row), quantized bit-exactly as compressed-tensors.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import zlib

import ml_dtypes
import numpy as np

from kernels_pallas import mxfp4
from kimi_jax.checkpoint import names as name_table
from kimi_jax.checkpoint.safetensors import DTYPES
from kimi_jax.checkpoint.safetensors_write import Entry, write_file
from kimi_jax.model.config import tiny_k3_config_dict, tiny_k31_config_dict
from kimi_jax.text.tokenizer import NUM_RESERVED_SPECIAL, write_demo_tokenizer

FAMILIES = ("k3", "kimi_linear", "llama")
VARIANTS = {"k3.1": "k3"}  # a name make-tiny takes -> the family whose layout it is written in (its own tiny config)
TRANSFORMERS_VERSION = "5.24.0"  # the version whose save_pretrained output the HF layouts reproduce


@dataclasses.dataclass(frozen=True)
class Spec:
    """One checkpoint tensor: name, safetensors dtype, shape, how to draw it."""

    name: str
    dtype: str
    shape: tuple
    init: str  # linear | embed | lm_head | norm | res_proj | conv | a_log | dt_bias | bias | mxfp4_packed | mxfp4_scale
    # | fp8 | fp8_scale
    layer: int | None = None  # None: a global tensor (embeddings, final norm, lm_head)
    heads: int = 0  # a_log: real entries (the rest is zero padding)
    weight: tuple = ()  # fp8_scale: the shape of the FP8 weight it scales

    @property
    def entry(self) -> Entry:
        return Entry(self.name, self.dtype, self.shape)


# -- default configs ------------------------------------------------------------------------------------------


def kimi_linear_config_dict() -> dict:
    """A tiny Kimi Linear (KDA x3 + MLA; dense layer 0, MoE with a shared expert) exactly as transformers 5.24's
    ``KimiLinearConfig(...).save_pretrained`` writes config.json."""
    return {
        "architectures": ["KimiLinearForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 1, "dtype": "bfloat16", "eos_token_id": 2, "head_dim": 8, "hidden_act": "silu",
        "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96, "kv_lora_rank": 16,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "linear_conv_kernel_dim": 4, "linear_head_dim": 16, "linear_num_heads": 4,
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "model_max_length": 1048576,
        "model_type": "kimi_linear", "moe_intermediate_size": 32, "moe_renormalize": True, "num_attention_heads": 4,
        "num_expert_group": 1, "num_experts": 4, "num_experts_per_token": 2, "num_hidden_layers": 4,
        "num_key_value_heads": 4, "num_shared_experts": 1, "output_router_logits": False, "pad_token_id": 0,
        "pretraining_tp": 1, "q_lora_rank": 24, "qk_head_dim": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "rms_norm_eps": 1e-05, "routed_scaling_factor": 2.446, "tie_word_embeddings": False, "topk_group": 1,
        "transformers_version": TRANSFORMERS_VERSION, "use_cache": True, "v_head_dim": 16, "vocab_size": 128,
    }


def llama_config_dict() -> dict:
    """A tiny Llama (GQA 4 q / 2 kv heads) exactly as transformers 5.24's ``LlamaConfig(...).save_pretrained``
    writes config.json."""
    return {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
        "dtype": "bfloat16", "eos_token_id": 2, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
        "initializer_range": 0.02, "intermediate_size": 128, "max_position_embeddings": 512, "mlp_bias": False,
        "model_type": "llama", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
        "pad_token_id": None, "pretraining_tp": 1, "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}, "tie_word_embeddings": False,
        "transformers_version": TRANSFORMERS_VERSION, "use_cache": True, "vocab_size": 256,
    }


def default_config(family: str) -> dict:
    _check_family(family)
    return {"k3": tiny_k3_config_dict, "k3.1": tiny_k31_config_dict, "kimi_linear": kimi_linear_config_dict,
            "llama": llama_config_dict}[family]()


def _check_family(family):
    if family not in FAMILIES and family not in VARIANTS:
        raise ValueError(f"family={family!r}: choose one of {list(FAMILIES) + list(VARIANTS)}")


# -- inventories ---------------------------------------------------------------------------------------------


def _req(c: dict, key: str, where: str):
    if c.get(key) is None:
        raise ValueError(f"{where}: config key {key!r} is required to lay out the checkpoint")
    return c[key]


def _fp8_specs(name: str, shape: tuple, layer: int) -> list[Spec]:
    """An FP8 block-quantized weight as DeepSeek-V3.2 stores its indexer's ``wq_b`` / ``wk``: float8_e4m3fn codes and
    float32 ``weight_scale_inv [ceil(J/128), ceil(I/128)]``."""
    blocks = tuple(-(-n // FP8_BLOCK) for n in shape)
    return [Spec(name, "F8_E4M3", shape, "fp8", layer),
            Spec(name + "_scale_inv", "F32", blocks, "fp8_scale", layer, weight=shape)]


def _mla_specs(t: dict, p: str, D: int, dt: str, layer: int, fp8_indexer: bool = False) -> list[Spec]:
    H = _req(t, "num_attention_heads", "config")
    nope, rope, v = t["qk_nope_head_dim"], t["qk_rope_head_dim"], t["v_head_dim"]
    q_lora, kv_lora = t.get("q_lora_rank"), t["kv_lora_rank"]
    out = []
    if q_lora:
        out += [Spec(p + "q_a_proj.weight", dt, (q_lora, D), "linear", layer),
                Spec(p + "q_a_layernorm.weight", dt, (q_lora,), "norm", layer),
                Spec(p + "q_b_proj.weight", dt, (H * (nope + rope), q_lora), "linear", layer)]
    else:
        out.append(Spec(p + "q_proj.weight", dt, (H * (nope + rope), D), "linear", layer))
    out += [Spec(p + "kv_a_proj_with_mqa.weight", dt, (kv_lora + rope, D), "linear", layer),
            Spec(p + "kv_a_layernorm.weight", dt, (kv_lora,), "norm", layer),
            Spec(p + "kv_b_proj.weight", dt, (H * (nope + v), kv_lora), "linear", layer)]
    if t.get("mla_use_output_gate"):
        out.append(Spec(p + "g_proj.weight", dt, (H * v, D), "linear", layer))
    out.append(Spec(p + "o_proj.weight", dt, (D, H * v), "linear", layer))
    dsa = t.get("dsa_config") or {}
    HI, DI = dsa.get("index_n_heads", t.get("index_n_heads")), dsa.get("index_head_dim", t.get("index_head_dim"))
    if HI is not None and DI is not None:  # K3.1: the DSA indexer of every MLA layer (DeepSeek-V3.2's tensors)
        q = p + "indexer."
        for name, shape in (("wq_b", (HI * DI, _req(t, "q_lora_rank", "config"))), ("wk", (DI, D))):
            out += (_fp8_specs(q + name + ".weight", shape, layer) if fp8_indexer
                    else [Spec(q + name + ".weight", dt, shape, "linear", layer)])
        out += [Spec(q + "weights_proj.weight", dt, (HI, D), "linear", layer),
                Spec(q + "k_norm.weight", dt, (DI,), "norm", layer),
                Spec(q + "k_norm.bias", dt, (DI,), "bias", layer)]
    return out


def _kda_specs(p: str, D: int, H: int, K: int, W: int, full_rank_gate: bool, a_log_shape: tuple, dt: str,
               f32: dict, layer: int) -> list[Spec]:
    P = H * K
    out = [Spec(p + f"{n}_proj.weight", dt, (P, D), "linear", layer) for n in "qkv"]
    out += [Spec(p + f"{n}_conv1d.weight", f32["conv"], (P, 1, W), "conv", layer) for n in "qkv"]
    out += [Spec(p + "f_a_proj.weight", dt, (K, D), "linear", layer),
            Spec(p + "f_b_proj.weight", dt, (P, K), "linear", layer),
            Spec(p + "A_log", f32["a_log"], a_log_shape, "a_log", layer, heads=H),
            Spec(p + "dt_bias", f32["dt_bias"], (P,), "dt_bias", layer),
            Spec(p + "b_proj.weight", dt, (H, D), "linear", layer)]
    if full_rank_gate:
        out.append(Spec(p + "g_proj.weight", dt, (P, D), "linear", layer))
    else:
        out += [Spec(p + "g_a_proj.weight", dt, (K, D), "linear", layer),
                Spec(p + "g_b_proj.weight", dt, (P, K), "linear", layer)]
    out += [Spec(p + "o_norm.weight", f32["o_norm"], (K,), "norm", layer),
            Spec(p + "o_proj.weight", dt, (D, P), "linear", layer)]
    return out


def _mlp_specs(p: str, D: int, inter: int, dt: str, layer: int) -> list[Spec]:
    return [Spec(p + "gate_proj.weight", dt, (inter, D), "linear", layer),
            Spec(p + "up_proj.weight", dt, (inter, D), "linear", layer),
            Spec(p + "down_proj.weight", dt, (D, inter), "linear", layer)]


def k3_inventory(config: dict, dtype: str = "bfloat16", fp8_indexer: bool = False) -> list[Spec]:
    """Every tensor of a K3 checkpoint in the release layout (K3_SPEC §3), from the raw config.json dict.
    ``fp8_indexer``: K3.1's indexer ``wq_b`` and ``wk`` FP8-block-quantized, as DeepSeek-V3.2 ships them."""
    t = config.get("text_config")
    if not isinstance(t, dict):
        raise ValueError("K3 config needs a text_config object (the release's top-level kimi_k3 wrapper)")
    dt = _st_dtype(dtype)
    D, n_layers, V = _req(t, "hidden_size", "text_config"), _req(t, "num_hidden_layers", "text_config"), t["vocab_size"]
    lac = _req(t, "linear_attn_config", "text_config")
    kda = {int(i) - 1 for i in lac.get("kda_layers") or ()}  # 1-based in the release
    H, K, W = lac["num_heads"], lac["head_dim"], lac.get("short_conv_kernel_size", 4)
    # The release stores A_log zero-padded: [128] for 96 heads x head_dim 128 (k3-tiny-a: [32] for 4 x 32).
    a_log = (max(H, K),)
    f32 = dict.fromkeys(("conv", "a_log", "dt_bias", "o_norm", "bias"), "F32")  # F32 in the release at any dtype
    first_dense = t.get("first_k_dense_replace", 1)
    E, latent = t.get("num_experts"), t.get("routed_expert_hidden_size")
    F, n_shared = t.get("moe_intermediate_size"), t.get("num_shared_experts", 0)
    quant = (t.get("quantization_config") or config.get("quantization_config") or {}).get("format")
    if quant not in (None, "mxfp4-pack-quantized"):
        raise ValueError(f"K3 synthetic writer: unsupported quantization format {quant!r}")
    attn_res = t.get("attn_res_block_size") is not None
    pre = "language_model."
    out = [Spec(pre + "model.embed_tokens.weight", dt, (V, D), "embed"),
           Spec(pre + "model.norm.weight", dt, (D,), "norm")]
    if attn_res:
        out += [Spec(pre + "model.output_attn_res_norm.weight", dt, (D,), "norm"),
                Spec(pre + "model.output_attn_res_proj.weight", dt, (1, D), "res_proj")]
    if not (config.get("tie_word_embeddings") or t.get("tie_word_embeddings")):
        out.append(Spec(pre + "lm_head.weight", dt, (V, D), "lm_head"))
    for i in range(n_layers):
        p = f"{pre}model.layers.{i}."
        out += [Spec(p + "input_layernorm.weight", dt, (D,), "norm", i),
                Spec(p + "post_attention_layernorm.weight", dt, (D,), "norm", i)]
        if attn_res:
            for site in ("self_attention", "mlp"):
                out += [Spec(p + f"{site}_res_norm.weight", dt, (D,), "norm", i),
                        Spec(p + f"{site}_res_proj.weight", dt, (1, D), "res_proj", i)]
        if i in kda:
            out += _kda_specs(p + "self_attn.", D, H, K, W, bool(lac.get("use_full_rank_gate")), a_log, dt, f32, i)
        else:
            out += _mla_specs(t, p + "self_attn.", D, dt, i, fp8_indexer)
        if i < first_dense:
            out += _mlp_specs(p + "mlp.", D, t["intermediate_size"], dt, i)
            continue
        m = p + "block_sparse_moe."
        out += [Spec(m + "gate.weight", dt, (E, D), "linear", i),
                Spec(m + "gate.e_score_correction_bias", f32["bias"], (E,), "bias", i)]
        if latent:
            out.append(Spec(m + "routed_expert_down_proj.weight", dt, (latent, D), "linear", i))
            if t.get("latent_moe_use_norm"):
                out.append(Spec(m + "routed_expert_norm.weight", dt, (latent,), "norm", i))
            out.append(Spec(m + "routed_expert_up_proj.weight", dt, (D, latent), "linear", i))
        if n_shared:
            out += _mlp_specs(m + "shared_experts.", D, F * n_shared, dt, i)
        L = latent or D
        for e in range(E):
            for w, (rows, cols) in (("w1", (F, L)), ("w2", (L, F)), ("w3", (F, L))):
                q = f"{m}experts.{e}.{w}."
                if quant:
                    if cols % mxfp4.GROUP:
                        raise ValueError(f"{q}: MXFP4 needs input widths divisible by 32, got {cols}")
                    out += [Spec(q + name_table.PACKED, "U8", (rows, cols // 2), "mxfp4_packed", i),
                            Spec(q + name_table.SCALE, "U8", (rows, cols // mxfp4.GROUP), "mxfp4_scale", i)]
                else:
                    out.append(Spec(q + "weight", dt, (rows, cols), "linear", i))
    return out


def kimi_linear_inventory(config: dict, dtype: str = "bfloat16") -> list[Spec]:
    """Every tensor of a Kimi Linear checkpoint as transformers 5.24's ``from_pretrained(dtype=...).save_pretrained``
    writes it (the dense layer's MLP under ``block_sparse_moe.``; A_log [1, 1, H, 1]; router weight and bias and
    dt_bias in F32)."""
    c, dt = config, _st_dtype(dtype)
    D, n_layers, V = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    types = c.get("layer_types") or ["linear_attention"] * n_layers
    mlp_types = c.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n_layers - 1)
    H, K, W = c["linear_num_heads"], c["linear_head_dim"], c.get("linear_conv_kernel_dim", 4)
    E, F, n_shared = c["num_experts"], c["moe_intermediate_size"], c.get("num_shared_experts", 0)
    # transformers keeps these in float32 (`_keep_in_fp32_modules_strict`), so a bf16 save writes them as F32.
    keep = dict(conv=dt, a_log=dt, o_norm=dt, dt_bias="F32", bias="F32")
    out = [Spec("model.embed_tokens.weight", dt, (V, D), "embed"), Spec("model.norm.weight", dt, (D,), "norm")]
    if not c.get("tie_word_embeddings"):
        out.append(Spec("lm_head.weight", dt, (V, D), "lm_head"))
    for i in range(n_layers):
        p = f"model.layers.{i}."
        out += [Spec(p + "input_layernorm.weight", dt, (D,), "norm", i),
                Spec(p + "post_attention_layernorm.weight", dt, (D,), "norm", i)]
        if types[i] == "linear_attention":
            out += _kda_specs(p + "self_attn.", D, H, K, W, False, (1, 1, H, 1), dt, keep, i)
        else:
            out += _mla_specs(c, p + "self_attn.", D, dt, i)
        m = p + "block_sparse_moe."
        if mlp_types[i] == "dense":
            out += _mlp_specs(m, D, c["intermediate_size"], dt, i)
            continue
        out += [Spec(m + "gate.weight", "F32", (E, D), "linear", i),
                Spec(m + "gate.e_score_correction_bias", keep["bias"], (E,), "bias", i)]
        if n_shared:
            out += _mlp_specs(m + "shared_experts.", D, F * n_shared, dt, i)
        for e in range(E):
            for w, shape in (("w1", (F, D)), ("w2", (D, F)), ("w3", (F, D))):
                out.append(Spec(f"{m}experts.{e}.{w}.weight", dt, shape, "linear", i))
    return out


def llama_inventory(config: dict, dtype: str = "bfloat16") -> list[Spec]:
    c, dt = config, _st_dtype(dtype)
    D, n_layers, V, F = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["intermediate_size"]
    H = c["num_attention_heads"]
    G = c.get("num_key_value_heads") or H
    hd = c.get("head_dim") or D // H
    out = [Spec("model.embed_tokens.weight", dt, (V, D), "embed"), Spec("model.norm.weight", dt, (D,), "norm")]
    if not c.get("tie_word_embeddings"):
        out.append(Spec("lm_head.weight", dt, (V, D), "lm_head"))
    for i in range(n_layers):
        p = f"model.layers.{i}."
        out += [Spec(p + "input_layernorm.weight", dt, (D,), "norm", i),
                Spec(p + "post_attention_layernorm.weight", dt, (D,), "norm", i),
                Spec(p + "self_attn.q_proj.weight", dt, (H * hd, D), "linear", i),
                Spec(p + "self_attn.k_proj.weight", dt, (G * hd, D), "linear", i),
                Spec(p + "self_attn.v_proj.weight", dt, (G * hd, D), "linear", i),
                Spec(p + "self_attn.o_proj.weight", dt, (D, H * hd), "linear", i)]
        out += _mlp_specs(p + "mlp.", D, F, dt, i)
    return out


INVENTORIES = {"k3": k3_inventory, "kimi_linear": kimi_linear_inventory, "llama": llama_inventory}


def _st_dtype(dtype: str) -> str:
    table = {"bfloat16": "BF16", "float32": "F32", "float16": "F16"}
    if dtype not in table:
        raise ValueError(f"dtype={dtype!r}: choose one of {sorted(table)}")
    return table[dtype]


# -- values ----------------------------------------------------------------------------------------------------


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def draw(spec: Spec, seed: int, hidden: int) -> np.ndarray:
    """The tensor for ``spec`` (deterministic in (seed, name)), in its safetensors dtype."""
    rng = _rng(seed, spec.name)
    shape, kind = spec.shape, spec.init
    n = lambda std, mean=0.0: mean + std * rng.standard_normal(shape, dtype=np.float32)  # noqa: E731
    if kind in ("mxfp4_packed", "mxfp4_scale"):
        packed, scale = _expert(spec, seed)
        return packed if kind == "mxfp4_packed" else scale
    if kind in ("fp8", "fp8_scale"):
        codes, scale = _fp8_block(spec, seed)
        return codes if kind == "fp8" else scale
    if kind == "linear":
        x = n(float(np.clip(1 / math.sqrt(shape[-1]), 0.02, 0.1)))
    elif kind == "embed":
        x = n(0.3)
    elif kind == "lm_head":
        x = n(0.1 * math.sqrt(128 / hidden))
    elif kind == "norm":
        x = n(0.1, 1.0)
    elif kind in ("res_proj", "bias"):
        x = n(0.1)
    elif kind == "conv":
        x = n(0.3)
    elif kind == "dt_bias":
        x = n(0.5, -1.5)
    elif kind == "a_log":
        x = np.zeros(shape, np.float32).reshape(-1)
        x[: spec.heads] = np.log(rng.uniform(1.0, 3.0, spec.heads))
        x = x.reshape(shape)
    else:
        raise AssertionError(kind)
    return x.astype(DTYPES[spec.dtype])


_EXPERT_CACHE: dict = {}


def _expert(spec: Spec, seed: int):
    """One routed expert matrix, drawn in bf16 and MXFP4-quantized; cached so packed and scale agree."""
    base = spec.name.rsplit(".", 1)[0]  # ...experts.{e}.w{1,2,3}
    key = (seed, base, spec.shape[0])
    if key not in _EXPERT_CACHE:
        _EXPERT_CACHE.clear()  # one matrix at a time: packed and scale are written back to back
        rows, cols = spec.shape[0], (spec.shape[1] * 2 if spec.init == "mxfp4_packed" else spec.shape[1] * mxfp4.GROUP)
        rng = _rng(seed, base)
        std = float(np.clip(1 / math.sqrt(cols), 0.02, 0.1))
        w = std * rng.standard_normal((rows, cols // mxfp4.GROUP, mxfp4.GROUP), dtype=np.float32)
        w *= np.exp2(rng.integers(-1, 2, (rows, cols // mxfp4.GROUP, 1))).astype(np.float32)
        _EXPERT_CACHE[key] = mxfp4.quantize_np(w.reshape(rows, cols).astype(ml_dtypes.bfloat16))
    return _EXPERT_CACHE[key]


FP8_BLOCK, FP8_MAX = 128, 448.0  # DeepSeek's weight_block_size and float8_e4m3fn's largest finite value


def _fp8_block(spec: Spec, seed: int):
    """(codes float8_e4m3fn, scale_inv float32) of one FP8 weight: the linear init with each 128 x 128 block times
    2**m, m in {-1, 0, 1} (so block scales differ), then per block ``scale_inv = amax / 448`` and codes
    ``round(w / scale_inv)`` as DeepSeek's ``weight_quant`` writes them. Both tensors draw from the weight's name."""
    name = spec.name.removesuffix("_scale_inv")
    shape = spec.weight or spec.shape
    rng = _rng(seed, name)
    rows, cols = (-(-n // FP8_BLOCK) for n in shape)
    w = float(np.clip(1 / math.sqrt(shape[1]), 0.02, 0.1)) * rng.standard_normal(shape, dtype=np.float32)
    up = lambda a: np.repeat(np.repeat(a, FP8_BLOCK, 0)[:shape[0]], FP8_BLOCK, 1)[:, :shape[1]]  # noqa: E731
    w *= up(np.exp2(rng.integers(-1, 2, (rows, cols))).astype(np.float32))
    amax = np.abs(np.pad(w, [(0, rows * FP8_BLOCK - shape[0]), (0, cols * FP8_BLOCK - shape[1])]))
    amax = amax.reshape(rows, FP8_BLOCK, cols, FP8_BLOCK).max(axis=(1, 3))
    scale = np.maximum(amax, 1e-12).astype(np.float32) / np.float32(FP8_MAX)
    codes = np.clip(w / up(scale), -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return codes, scale


# -- files ----------------------------------------------------------------------------------------------------


def shard_groups(specs: list[Spec], num_layers: int, num_shards: int) -> list[list[Spec]]:
    """Split by layer like the release: contiguous runs of layers per shard (earlier shards take the extra layer),
    global tensors in the last shard. ``num_shards == num_layers + 1`` is the release's one-layer-per-shard layout
    with the globals alone in the last shard."""
    if not 1 <= num_shards <= num_layers + 1:
        raise ValueError(f"num_shards={num_shards}: must be 1..{num_layers + 1} for {num_layers} layers")
    if num_shards == 1:
        return [specs]
    layer_shards = num_shards - 1 if num_shards == num_layers + 1 else num_shards
    bounds = np.cumsum([len(a) for a in np.array_split(np.arange(num_layers), layer_shards)])
    groups: list[list[Spec]] = [[] for _ in range(num_shards)]
    for s in specs:
        idx = num_shards - 1 if s.layer is None else int(np.searchsorted(bounds, s.layer, side="right"))
        groups[idx].append(s)
    return groups


# -- tokenizers -----------------------------------------------------------------------------------------------

TOKENIZER_FAMILIES = ("k3", "kimi_linear")  # the Kimi tiktoken format (tiktoken.model + tokenizer_config.json)


def tokenizer_problem(family: str, config: dict | None = None) -> str | None:
    """Why no tokenizer can be written for a checkpoint of ``family`` with ``config`` (default: the family's tiny
    one), or None when one can: a small byte-level BPE in the Kimi format needs the 256 byte tokens plus the 256
    reserved specials at the top of the vocabulary."""
    _check_family(family)
    if VARIANTS.get(family, family) not in TOKENIZER_FAMILIES:
        return f"tokenizers are written in the Kimi tiktoken format only, for {' and '.join(TOKENIZER_FAMILIES)}"
    text = (config if config is not None else default_config(family))
    text = text.get("text_config", text)
    vocab = text.get("vocab_size") or 0
    if vocab < 2 * NUM_RESERVED_SPECIAL:
        return (f"vocab_size {vocab} cannot hold a Kimi tokenizer, which needs {2 * NUM_RESERVED_SPECIAL} ids at "
                f"least (256 byte tokens + {NUM_RESERVED_SPECIAL} specials)")
    return None


def with_special_ids(c: dict) -> dict:
    """A Kimi config dict (in place) with the special ids of its own vocabulary, as the release's config has
    (bos = [BOS], eos = <|end_of_msg|>, pad = [PAD] at the first / third / last special id); K3's ``text_config``
    too."""
    text = c.get("text_config", c)
    first = text["vocab_size"] - NUM_RESERVED_SPECIAL
    ids = dict(bos_token_id=first, eos_token_id=first + 2, pad_token_id=first + NUM_RESERVED_SPECIAL - 1)
    c.update(ids)
    text.update(ids)
    return c


# -- writing ---------------------------------------------------------------------------------------------------


def write_checkpoint(path, family: str = "k3", *, config: dict | None = None, seed: int = 0, num_shards: int = 2,
                     dtype: str = "bfloat16", tokenizer: bool = False, fp8_indexer: bool = False) -> str:
    """Write a random checkpoint of ``family`` ("k3" | "kimi_linear" | "llama", or "k3.1": K3's layout with
    :func:`~kimi_jax.model.config.tiny_k31_config_dict`) to directory ``path``.

    ``config``: a full config.json dict (default: the family's tiny config; K3: ``tiny_k3_config_dict()``).
    ``num_shards``: 1 writes ``model.safetensors``; more write ``model-00001-of-000002.safetensors`` (K3: 5-digit
    index, 6-digit total, as released) or ``model-00001-of-00002.safetensors`` (HF) plus the index.
    ``dtype``: the dtype of every tensor the release does not pin (F32 and U8 tensors stay as released).
    ``tokenizer``: also write a small BPE tokenizer in the Kimi format whose vocabulary is the model's, the config's
    special ids set to its specials (:func:`with_special_ids`); a checkpoint that cannot take one is refused before
    anything is written, with :func:`tokenizer_problem`'s reason. ``fp8_indexer``: K3.1's indexer ``wq_b`` and ``wk``
    stored FP8-block-quantized (float8_e4m3fn + float32 ``weight_scale_inv`` per 128 x 128 block), as DeepSeek-V3.2
    ships them; refused for a config without an indexer.
    Returns ``path``.
    """
    _check_family(family)
    path = os.fspath(path)
    config = copy.deepcopy(config if config is not None else default_config(family))
    family = VARIANTS.get(family, family)
    if tokenizer:
        problem = tokenizer_problem(family, config)
        if problem is not None:
            raise ValueError(f"no tokenizer for this {family} checkpoint: {problem}")
        with_special_ids(config)
    for c in (config, config.get("text_config")):  # the config describes the tensors it ships with
        if isinstance(c, dict):
            c.pop("torch_dtype", None)
            c["dtype"] = dtype
    specs = INVENTORIES[family](config, dtype, **({"fp8_indexer": True} if fp8_indexer and family == "k3" else {}))
    if fp8_indexer and not any(s.init == "fp8" for s in specs):
        raise ValueError(f"fp8_indexer: this {family} config has no DSA indexer (K3.1's) whose weights could be FP8")
    text = config.get("text_config", config)
    hidden, layers = text["hidden_size"], text["num_hidden_layers"]
    groups = shard_groups(specs, layers, num_shards)
    os.makedirs(path, exist_ok=True)
    stale = sorted(f for f in os.listdir(path) if f.endswith(".safetensors") or f == "model.safetensors.index.json")
    if stale:  # leftover shards of another checkpoint would make the directory inconsistent
        raise FileExistsError(f"{path}: already holds checkpoint files {stale[:3]}; write into an empty directory")
    if num_shards == 1:
        names = ["model.safetensors"]
    else:
        width = 6 if family == "k3" else 5
        names = [f"model-{i + 1:05d}-of-{num_shards:0{width}d}.safetensors" for i in range(num_shards)]
    weight_map, total = {}, 0
    for fname, group in zip(names, groups):
        total += write_file(os.path.join(path, fname), [s.entry for s in group],
                            _producer(group, seed, hidden))
        weight_map.update({s.name: fname for s in group})
    _EXPERT_CACHE.clear()
    if num_shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        if family == "k3":  # as the release's index: exactly these two keys, no trailing newline
            text_out = json.dumps(index, indent=2)
        else:  # as transformers writes it
            index["metadata"] = {"total_parameters": sum(math.prod(s.shape) for s in specs), "total_size": total}
            text_out = json.dumps(index, indent=2, sort_keys=True) + "\n"
        _write_text(os.path.join(path, "model.safetensors.index.json"), text_out)
    # The release's config.json has no trailing newline; transformers adds one.
    _write_text(os.path.join(path, "config.json"),
                json.dumps(config, indent=2, sort_keys=True) + ("" if family == "k3" else "\n"))
    if family != "k3":
        gen = {"_from_model_config": True, "bos_token_id": config.get("bos_token_id"),
               "eos_token_id": config.get("eos_token_id"), "output_attentions": False, "output_hidden_states": False,
               "pad_token_id": config.get("pad_token_id"), "transformers_version": TRANSFORMERS_VERSION,
               "use_cache": True}
        _write_text(os.path.join(path, "generation_config.json"),
                    json.dumps({k: v for k, v in gen.items() if v is not None}, indent=2, sort_keys=True) + "\n")
    if tokenizer:
        write_demo_tokenizer(path, vocab_size=config.get("text_config", config)["vocab_size"])
    return path


def _producer(group: list[Spec], seed: int, hidden: int):
    by_name = {s.name: s for s in group}
    return lambda entry: draw(by_name[entry.name], seed, hidden)


def _write_text(path: str, text: str):
    tmp = path + ".partial"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
