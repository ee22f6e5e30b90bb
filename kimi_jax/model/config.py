"""Model configuration: one frozen, hashable dataclass parsed once from a checkpoint's `config.json`.

Three families share one model:
  * ``kimi_k3``     -- Kimi K3 as released (top-level ``model_type: kimi_k3`` wrapping a ``text_config``); Kimi K3.1
    (``KimiK31ForConditionalGeneration``) is K3 with a DSA indexer in every MLA layer (:class:`IndexerConfig`).
  * ``kimi_linear`` -- Kimi Linear as HF transformers writes it (``linear_attn_config`` or ``layer_types``).
  * ``dense``       -- Llama-shaped GQA + RoPE (``LlamaForCausalLM``, ``KimiForCausalLM``).

K3 features are switched on by the presence of their keys (``attn_res_block_size``,
``routed_expert_hidden_size``, ``gate_lower_bound``, ...), never by the inner ``KimiLinearForCausalLM``
architecture name, which K3's ``text_config`` also carries. Every key that is read is named here; keys
that would change the math but are not implemented raise :class:`ConfigError` naming key and value.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any, Mapping


class ConfigError(ValueError):
    """A config.json key or value this implementation does not support."""


# -- sub-configs: each layer receives only its own ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """Gated MLP: down(act(gate(x)) * up(x)), or SiTU-GLU when ``act == "situ"``."""

    hidden: int
    intermediate: int
    act: str = "silu"  # "silu" | "situ"
    situ_beta: float = 4.0
    situ_linear_beta: float | None = 25.0


@dataclasses.dataclass(frozen=True)
class KDAConfig:
    """Kimi Delta Attention."""

    hidden: int
    num_heads: int
    head_dim: int
    conv_size: int = 4
    gate_lower_bound: float | None = None  # None: softplus decay (Kimi Linear); else lower-bounded sigmoid (K3)
    full_rank_gate: bool = False  # K3: one g_proj; Kimi Linear: g_a_proj -> g_b_proj
    norm_eps: float = 1e-5  # o_norm (gated head RMSNorm)

    @property
    def proj(self) -> int:
        return self.num_heads * self.head_dim


@dataclasses.dataclass(frozen=True)
class IndexerConfig:
    """Kimi K3.1's DSA ("lightning") indexer in a gated MLA layer: each query attends only to the ``topk`` causal
    keys the indexer scores highest (every key while a row sees at most ``topk``).

    What the public K3.1 material leaves open, and what kimi-jax assumes (the ONE place this is said; the oracle
    ``tests/k31_oracle.py`` makes the same choices):

    * config keys [provisional spelling]: ``index_n_heads``, ``index_head_dim``, ``index_topk`` (DeepSeek-V3.2's),
      read from ``dsa_config`` (in ``text_config`` or at the top level) or flat in ``text_config``; inside
      ``dsa_config`` also ``n_heads | num_heads | head_count``, ``head_dim | key_length``, ``topk | top_k``, and the
      1-based layer list as ``dsa_layers | index_layers | layers | full_attn_layers``, which must equal the MLA
      (full-attention) layers. Any other key of ``dsa_config`` is refused (e.g. a GLM-style ``types`` list that
      would share selections between layers).
    * ``qI = wq_b(qr)``: the indexer query reads the q-LoRA latent after ``q_a_layernorm`` (as DeepSeek-V3.2).
    * ``kI = LayerNorm(wk(x); k_norm.weight, k_norm.bias)``: mean-centred, biased variance, eps
      ``index_norm_eps`` if given, else ``rms_norm_eps`` (llama.cpp's K3.1 choice); ``k_norm.bias`` may be absent
      from a checkpoint (then zero).
    * score ``I[t, s] = sum_h w[t, h] ReLU(qI[t, h] . kI[s])``, ``w = weights_proj(x) HI^-0.5 DI^-0.5`` (float32;
      the positive constants cannot change the choice); no RoPE, no Hadamard, no FP8.
    * ties: among equal scores the later key wins (score descending, then key position descending: FlashInfer's
      deterministic DSA order). ReLU makes exact ties (often 0) common.
    """

    hidden: int
    q_lora_rank: int  # wq_b's input width
    num_heads: int
    head_dim: int
    topk: int
    norm_eps: float = 1e-5

    @property
    def score_scale(self) -> float:
        return (self.num_heads * self.head_dim) ** -0.5


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention without positional encoding (NoPE), optional sigmoid output gate."""

    hidden: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int  # the "decoupled rope" key part, carried unrotated (NoPE)
    v_dim: int
    output_gate: bool = False
    lora_norm_eps: float = 1e-6  # q_a_layernorm / kv_a_layernorm use the class default eps
    indexer: IndexerConfig | None = None  # K3.1: DSA top-k selection of the keys each query attends to

    @property
    def qk_dim(self) -> int:
        return self.qk_nope_dim + self.qk_rope_dim

    @property
    def scale(self) -> float:
        return self.qk_dim**-0.5


@dataclasses.dataclass(frozen=True)
class GQAConfig:
    """Grouped-query attention with rotary position embedding (Llama-shaped)."""

    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    # ("llama3", factor, low_freq_factor, high_freq_factor, original_max_position_embeddings) or None
    rope_scaling: tuple | None = None


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Routed experts (sigmoid router, bias-corrected top-k), shared experts, optional latent projection."""

    hidden: int
    num_experts: int
    top_k: int
    expert_intermediate: int
    num_shared: int
    shared_intermediate: int  # width of the single fused shared-expert MLP
    act: str = "silu"
    situ_beta: float = 4.0
    situ_linear_beta: float | None = 25.0
    latent: int | None = None  # K3 LatentMoE width (routed_expert_hidden_size)
    latent_norm: bool = False
    norm_eps: float = 1e-5
    renormalize: bool = True
    scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    quant: str | None = None  # None | "mxfp4"

    @property
    def expert_in(self) -> int:
        return self.latent if self.latent is not None else self.hidden

    def expert_mlp(self) -> MLPConfig:
        return MLPConfig(self.expert_in, self.expert_intermediate, self.act, self.situ_beta, self.situ_linear_beta)

    def shared_mlp(self) -> MLPConfig:
        return MLPConfig(self.hidden, self.shared_intermediate, self.act, self.situ_beta, self.situ_linear_beta)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str  # "kimi_k3" | "kimi_linear" | "dense"
    vocab_size: int
    hidden_size: int
    num_layers: int
    attn_types: tuple[str, ...]  # per layer: "kda" | "mla" | "gqa"
    ffn_types: tuple[str, ...]  # per layer: "dense" | "moe"
    norm_eps: float = 1e-5
    mlp: MLPConfig | None = None
    kda: KDAConfig | None = None
    mla: MLAConfig | None = None
    gqa: GQAConfig | None = None
    moe: MoEConfig | None = None
    attn_res_block_size: int | None = None  # Block Attention Residuals; None = plain residuals
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    checkpoint_dtype: str = "bfloat16"
    checkpoint_prefix: str = ""  # "language_model." for the K3 release layout
    max_position_embeddings: int | None = None  # the context the model was made for (prompt + new tokens)
    # the checkpoint's weights stored compressed-tensors pack-quantized: (kind "int4" | "int8", group or None for one
    # scale per row); the loader reads them packed (kimi_jax.checkpoint.hf)
    packed_weights: tuple[str, int | None] | None = None

    def __post_init__(self):
        if len(self.attn_types) != self.num_layers or len(self.ffn_types) != self.num_layers:
            raise ConfigError(
                f"layer schedule covers {len(self.attn_types)} attention / {len(self.ffn_types)} FFN layers, "
                f"num_hidden_layers is {self.num_layers}"
            )
        for kind, sub in (("kda", self.kda), ("mla", self.mla), ("gqa", self.gqa)):
            if kind in self.attn_types and sub is None:
                raise ConfigError(f"layer schedule uses {kind} layers but no {kind} config was given")
        if "dense" in self.ffn_types and self.mlp is None:
            raise ConfigError("layer schedule uses dense MLP layers but intermediate_size is missing")
        if "moe" in self.ffn_types and self.moe is None:
            raise ConfigError("layer schedule uses MoE layers but no MoE config was given")

    # Derived helpers -------------------------------------------------------------------------------------
    @property
    def moe_layers(self) -> list[int]:
        """Indices of the MoE layers, in the order ``ModelOutput.router`` reports them."""
        return [i for i, kind in enumerate(self.ffn_types) if kind == "moe"]

    @property
    def attn_res(self) -> bool:
        return self.attn_res_block_size is not None

    @property
    def indexer(self):
        """K3.1's DSA indexer (:class:`IndexerConfig`) when this model's MLA layers carry one, else None."""
        return self.mla.indexer if self.mla is not None and "mla" in self.attn_types else None

    def layer_kinds(self) -> list[tuple[str, str]]:
        return list(zip(self.attn_types, self.ffn_types))

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def sliced(self, num_layers: int | None = None, num_experts: int | None = None) -> "ModelConfig":
        """First ``num_layers`` layers / first ``num_experts`` experts: still a valid model."""
        cfg = self
        if num_layers is not None:
            if not 1 <= num_layers <= self.num_layers:
                raise ConfigError(f"--layers {num_layers} outside 1..{self.num_layers}")
            cfg = dataclasses.replace(
                cfg, num_layers=num_layers, attn_types=cfg.attn_types[:num_layers], ffn_types=cfg.ffn_types[:num_layers]
            )
        if num_experts is not None and cfg.moe is not None:
            if not cfg.moe.top_k <= num_experts <= cfg.moe.num_experts:
                raise ConfigError(f"--experts {num_experts} outside {cfg.moe.top_k}..{cfg.moe.num_experts} (top-k..E)")
            if cfg.moe.n_group != 1 and num_experts % cfg.moe.n_group:
                raise ConfigError(f"--experts {num_experts} not divisible by num_expert_group {cfg.moe.n_group}")
            cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, num_experts=num_experts))
        return cfg


# -- parsing ----------------------------------------------------------------------------------------------

# Generic Hugging Face keys that never change the forward pass. Anything not here and not read below is an
# unknown key and raises, so a new switch in a future config cannot be silently ignored.
_GENERIC_KEYS = frozenset(
    """_name_or_path add_cross_attention architectures auto_map bad_words_ids begin_suppress_tokens
    chunk_size_feed_forward cross_attention_hidden_size decoder_start_token_id diversity_penalty do_sample dtype
    torch_dtype early_stopping encoder_no_repeat_ngram_size exponential_decay_length_penalty finetuning_task
    forced_bos_token_id forced_eos_token_id id2label label2id initializer_range is_decoder is_encoder_decoder
    length_penalty max_length min_length no_repeat_ngram_size num_beam_groups num_beams num_return_sequences
    output_attentions output_hidden_states output_scores prefix problem_type pruned_heads remove_invalid_values
    repetition_penalty return_dict return_dict_in_generate sep_token_id suppress_tokens task_specific_params
    temperature tf_legacy_loss tie_encoder_decoder tokenizer_class top_k top_p torchscript transformers_version
    typical_p use_bfloat16 use_cache model_type max_position_embeddings model_max_length attention_dropout
    output_router_logits router_aux_loss_coef ignore_index pretraining_tp bos_token_id eos_token_id pad_token_id
    tie_word_embeddings _attn_implementation_autoset aux_loss_alpha seq_aux""".split()
)

_K3_KEYS = ("attn_res_block_size", "routed_expert_hidden_size", "latent_moe_use_norm", "mla_use_output_gate")


class _Reader:
    """Reads keys of one config dict and remembers which were read, to reject unknown ones at the end."""

    def __init__(self, d: Mapping[str, Any], where: str):
        self.d, self.where, self.read = dict(d), where, set()

    def has(self, key):
        return key in self.d and self.d[key] is not None

    def get(self, key, default=None, *, required=False):
        self.read.add(key)
        if key not in self.d or self.d[key] is None:
            if required:
                raise ConfigError(f"{self.where}: required key {key!r} is missing")
            return default
        return self.d[key]

    def expect(self, key, allowed, default=None):
        """Read a key that may only take values in ``allowed`` (a value outside it is unsupported)."""
        value = self.get(key, default)
        if value not in allowed:
            raise ConfigError(f"{self.where}: unsupported value {key}={value!r} (supported: {sorted(map(repr, allowed))})")
        return value

    def finish(self, extra_ok=()):
        unknown = sorted(k for k in self.d if k not in self.read and k not in _GENERIC_KEYS and k not in extra_ok)
        if unknown:
            raise ConfigError(
                f"{self.where}: unknown config key(s) {unknown}; kimi-jax does not know what they change, "
                "so it refuses to guess (pass strict=False to load anyway)"
            )


def _first_id(value):
    if isinstance(value, list):
        return value[0] if value else None
    return value


def pack_quantized_format(q: Mapping[str, Any], where: str) -> tuple[str, int | None]:
    """(kind, group) of a compressed-tensors ``pack-quantized`` quantization_config: ("int4", 32) for group scales,
    ("int8" | "int4", None) for one scale per row. Refuses, naming the key, what kimi-jax does not take: activation or
    KV-cache quantization, asymmetric weights, int8 groups, other bit widths, activation order, transforms,
    sparsity, or groups that disagree. The loader packs the weights (:mod:`kimi_jax.checkpoint.hf`)."""

    def refuse(what):
        raise ConfigError(f"{where}: {what}; kimi-jax reads pack-quantized weight-only int4 (group or channel "
                          "scales) and int8 (channel scales), symmetric")

    if q.get("quantization_status", "compressed") != "compressed":
        refuse(f"quantization_status={q.get('quantization_status')!r} (expected 'compressed')")
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if q.get(key):
            refuse(f"{key} is set")
    formats = set()
    for gname, group in (q.get("config_groups") or {}).items():
        at = f"config_groups.{gname}"
        if (group.get("format") or "pack-quantized") != "pack-quantized":
            refuse(f"{at}.format={group.get('format')!r}")
        for key in ("input_activations", "output_activations"):
            if group.get(key) is not None:
                refuse(f"{at}.{key} is set (activation quantization)")
        w = group.get("weights") or {}
        bits, strategy = w.get("num_bits"), w.get("strategy")
        if w.get("type", "int") != "int" or bits not in (4, 8):
            refuse(f"{at}.weights: type={w.get('type')!r} num_bits={bits!r}")
        if not w.get("symmetric", True):
            refuse(f"{at}.weights.symmetric=False (asymmetric weights with weight_zero_point)")
        if w.get("dynamic") or w.get("actorder") not in (None, "static"):
            refuse(f"{at}.weights: dynamic={w.get('dynamic')!r} actorder={w.get('actorder')!r}")
        if strategy == "group" and bits == 4 and isinstance(w.get("group_size"), int) and w["group_size"] >= 2 \
                and w["group_size"] % 2 == 0:
            formats.add(("int4", w["group_size"]))
        elif strategy == "channel":
            formats.add((f"int{bits}", None))
        else:
            refuse(f"{at}.weights: strategy={strategy!r} group_size={w.get('group_size')!r} with num_bits={bits}")
    if len(formats) != 1:
        refuse(f"{len(formats)} weight formats in config_groups {sorted(map(str, formats))} (one is supported)")
    return formats.pop()


def _quant(q: Mapping[str, Any] | None, where: str) -> tuple[str | None, tuple[str, int | None] | None]:
    """Validate a compressed-tensors quantization_config; returns (the routed experts' format: "mxfp4" or None, the
    ``pack-quantized`` int4 / int8 weights' (kind, group), which the loader reads packed, or None)."""
    if q is None:
        return None, None
    method, fmt = q.get("quant_method"), q.get("format")
    if method == "compressed-tensors" and fmt == "pack-quantized":
        return None, pack_quantized_format(q, f"{where}: quantization_config")
    if method != "compressed-tensors" or fmt != "mxfp4-pack-quantized":
        raise ConfigError(
            f"{where}: unsupported quantization_config quant_method={method!r} format={fmt!r} "
            "(supported: compressed-tensors mxfp4-pack-quantized, pack-quantized)"
        )
    if q.get("quantization_status", "compressed") != "compressed":
        raise ConfigError(f"{where}: quantization_status={q.get('quantization_status')!r}; expected 'compressed'")
    for name, group in (q.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        want = {"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group", "symmetric": True}
        for key, val in want.items():
            if w.get(key) != val:
                raise ConfigError(f"{where}: quantization_config.config_groups.{name}.weights.{key}={w.get(key)!r}; MXFP4 needs {val!r}")
        if group.get("input_activations") is not None:
            raise ConfigError(f"{where}: activation quantization (config_groups.{name}.input_activations) is not supported")
        if group.get("format", fmt) != "mxfp4-pack-quantized":
            raise ConfigError(f"{where}: config_groups.{name}.format={group.get('format')!r} is not mxfp4-pack-quantized")
    if q.get("kv_cache_scheme") is not None:
        raise ConfigError(f"{where}: kv_cache_scheme={q.get('kv_cache_scheme')!r} is not supported")
    return "mxfp4", None


def _kimi_activation(r: _Reader) -> tuple[str, float, float | None]:
    """(hidden_act, situ_beta, situ_linear_beta): SiTU-GLU (K3) or SiLU-GLU (Kimi Linear).

    The KDA short conv always uses SiLU, whatever this says.
    """
    act = r.expect("hidden_act", {"silu", "situ"}, "silu")
    situ_beta = float(r.get("activation_situ_beta", 4.0))
    situ_linear_beta = r.get("activation_situ_linear_beta", 25.0 if act == "situ" else None)
    situ_linear_beta = None if situ_linear_beta is None else float(situ_linear_beta)
    return act, situ_beta, situ_linear_beta


def _kimi_attn_schedule(r: _Reader, la: _Reader, n: int) -> tuple[str, ...]:
    """Attention kind of each of the ``n`` layers ("kda" | "mla"), from the first schedule the config gives:
    ``linear_attn_config.kda_layers``, then ``layer_types``, then ``linear_attn_config.full_attn_layers``."""
    where = r.where
    layer_types = r.get("layer_types")
    kda_layers = la.get("kda_layers")
    full_layers = la.get("full_attn_layers")
    if kda_layers is not None:
        # 1-based, as released: layer i (0-based) is KDA iff i+1 in kda_layers (HF `is_kda_layer`).
        bad = [x for x in kda_layers if not 1 <= int(x) <= n]
        if bad:
            raise ConfigError(f"{where}: linear_attn_config.kda_layers has entries {bad} outside 1..{n} (1-based)")
        kda_set = {int(x) - 1 for x in kda_layers}
        attn = tuple("kda" if i in kda_set else "mla" for i in range(n))
        if full_layers is not None:
            full_set = {int(x) - 1 for x in full_layers}
            if full_set & kda_set or full_set | kda_set != set(range(n)):
                raise ConfigError(
                    f"{where}: kda_layers and full_attn_layers must partition layers 1..{n} "
                    f"(overlap {sorted(x + 1 for x in full_set & kda_set)}, "
                    f"missing {sorted(x + 1 for x in set(range(n)) - full_set - kda_set)})"
                )
    elif layer_types is not None:
        names = {"linear_attention": "kda", "full_attention": "mla"}
        bad = [t for t in layer_types if t not in names]
        if bad:
            raise ConfigError(f"{where}: unsupported layer_types values {sorted(set(bad))}")
        attn = tuple(names[t] for t in layer_types)
    elif full_layers is not None:
        full_set = {int(x) - 1 for x in full_layers}
        attn = tuple("mla" if i in full_set else "kda" for i in range(n))
    else:
        raise ConfigError(f"{where}: no layer schedule (linear_attn_config.kda_layers or layer_types)")
    if len(attn) != n:
        raise ConfigError(f"{where}: layer_types has {len(attn)} entries, num_hidden_layers is {n}")
    return attn


def _kimi_ffn_schedule(r: _Reader, n: int) -> tuple[tuple[str, ...], Any]:
    """(FFN kind of each of the ``n`` layers ("dense" | "moe"), the raw ``num_experts`` or None).

    ``mlp_layer_types`` wins; otherwise, with experts, layer i is MoE from ``first_k_dense_replace`` on, every
    ``moe_layer_freq``-th layer; without experts every layer is dense.
    """
    where = r.where
    mlp_types = r.get("mlp_layer_types")
    first_dense = int(r.get("first_k_dense_replace", 1))
    freq = int(r.get("moe_layer_freq", 1))
    num_experts = r.get("num_experts", r.get("num_local_experts"))
    r.read.add("num_local_experts")
    if mlp_types is not None:
        names = {"dense": "dense", "sparse": "moe"}
        bad = [t for t in mlp_types if t not in names]
        if bad:
            raise ConfigError(f"{where}: unsupported mlp_layer_types values {sorted(set(bad))}")
        ffn = tuple(names[t] for t in mlp_types)
        if len(ffn) != n:
            raise ConfigError(f"{where}: mlp_layer_types has {len(ffn)} entries, num_hidden_layers is {n}")
    elif num_experts:
        ffn = tuple("moe" if (i >= first_dense and i % freq == 0) else "dense" for i in range(n))
    else:
        ffn = ("dense",) * n
    return ffn, num_experts


def _kimi_kda(r: _Reader, la: _Reader, attn: tuple[str, ...], d: int, eps: float) -> KDAConfig | None:
    """The KDA config when any layer is KDA; its keys live in ``linear_attn_config`` (older configs: top level)."""
    kda = None
    if "kda" in attn:
        heads = la.get("num_heads", r.get("linear_num_heads"))
        head_dim = la.get("head_dim", r.get("linear_head_dim"))
        conv = la.get("short_conv_kernel_size", r.get("linear_conv_kernel_dim", 4))
        if heads is None or head_dim is None:
            raise ConfigError(f"{r.where}: KDA layers need linear_attn_config.num_heads and head_dim")
        lb = la.get("gate_lower_bound")
        kda = KDAConfig(
            hidden=d,
            num_heads=int(heads),
            head_dim=int(head_dim),
            conv_size=int(conv),
            gate_lower_bound=None if lb is None else float(lb),
            full_rank_gate=bool(la.get("use_full_rank_gate", False)),
            norm_eps=eps,
        )
    for key in ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"):
        r.read.add(key)
    return kda


def _kimi_mla(r: _Reader, attn: tuple[str, ...], d: int) -> MLAConfig | None:
    """The MLA config when any layer is full attention (NoPE only); rejects attention biases either way."""
    where = r.where
    mla = None
    nope = r.get("mla_use_nope", True)
    if "mla" in attn:
        if nope is not True:
            raise ConfigError(f"{where}: mla_use_nope={nope!r}: Kimi MLA is NoPE; rotary MLA is not implemented")
        mla = MLAConfig(
            hidden=d,
            num_heads=int(r.get("num_attention_heads", required=True)),
            q_lora_rank=r.get("q_lora_rank"),
            kv_lora_rank=int(r.get("kv_lora_rank", required=True)),
            qk_nope_dim=int(r.get("qk_nope_head_dim", required=True)),
            qk_rope_dim=int(r.get("qk_rope_head_dim", required=True)),
            v_dim=int(r.get("v_head_dim", required=True)),
            output_gate=bool(r.get("mla_use_output_gate", False)),
        )
    # Read but unused: MLA keeps all heads after kv_b expansion; no rotary; derived head dims.
    for key in ("num_key_value_heads", "head_dim", "qk_head_dim", "rope_theta", "rope_scaling", "num_attention_heads",
                "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mla_use_output_gate"):
        r.read.add(key)
    if r.get("attention_bias", False):
        raise ConfigError(f"{where}: attention_bias=True is not supported (Kimi has no biases)")
    return mla


# dsa_config spellings (IndexerConfig's docstring): the DeepSeek-V3.2 name first, then the aliases producers use.
_DSA_KEYS = {"heads": ("index_n_heads", "n_heads", "num_heads", "head_count"),
             "dim": ("index_head_dim", "head_dim", "key_length"),
             "topk": ("index_topk", "topk", "top_k"),
             "eps": ("index_norm_eps", "norm_eps", "eps"),
             "layers": ("dsa_layers", "index_layers", "layers", "full_attn_layers")}
K31_ARCH = "KimiK31ForConditionalGeneration"


def _dsa_value(dsa: _Reader, flat: _Reader, what: str):
    """The first ``_DSA_KEYS[what]`` spelling present in ``dsa_config``, else the flat DeepSeek key; None if neither."""
    for key in _DSA_KEYS[what]:
        if dsa.has(key):
            return dsa.get(key), f"dsa_config.{key}"
    first = _DSA_KEYS[what][0]
    return flat.get(first), first


def _kimi_dsa(r: _Reader, top: Mapping[str, Any], attn: tuple[str, ...], mla: MLAConfig | None, eps: float,
              strict: bool) -> MLAConfig | None:
    """``mla`` with K3.1's :class:`IndexerConfig` when the config declares one (``dsa_config`` or flat
    ``index_*`` keys; required by the K3.1 architecture). The indexed layers must be the MLA layers: a mismatch is
    refused naming both lists, before anything is built."""
    raw = r.get("dsa_config", top.get("dsa_config"))
    dsa = _Reader(dict(raw or {}), f"{r.where} dsa_config")
    k31 = K31_ARCH in tuple(top.get("architectures") or ())
    if raw is None and not r.has("index_n_heads") and not k31:
        for what in ("heads", "dim", "topk", "eps"):
            r.read.add(_DSA_KEYS[what][0])
        return mla
    vals = {w: _dsa_value(dsa, r, w) for w in ("heads", "dim", "topk", "eps", "layers")}
    missing = [vals[w][1] for w in ("heads", "dim", "topk") if vals[w][0] is None]
    if missing:
        why = "the K3.1 architecture needs a DSA indexer" if raw is None else "an incomplete DSA indexer"
        raise ConfigError(f"{r.where}: {why}: missing {missing} (dsa_config or flat index_* keys)")
    if mla is None:
        raise ConfigError(f"{r.where}: a DSA indexer ({vals['heads'][1]}) but the model has no MLA layers")
    if mla.q_lora_rank is None:
        raise ConfigError(f"{r.where}: the DSA indexer reads the q-LoRA latent, but q_lora_rank is null")
    full = [i + 1 for i, kind in enumerate(attn) if kind == "mla"]
    layers, key = vals["layers"]
    if layers is not None and sorted(int(x) for x in layers) != full:
        got = sorted(int(x) for x in layers)
        raise ConfigError(f"{r.where}: {key}={got} must equal the full-attention (MLA) layers {full} (1-based): "
                          f"not indexed {sorted(set(full) - set(got))}, not MLA {sorted(set(got) - set(full))}")
    heads, dim, topk = (int(vals[w][0]) for w in ("heads", "dim", "topk"))
    for (v, key) in ((heads, vals["heads"][1]), (dim, vals["dim"][1]), (topk, vals["topk"][1])):
        if v < 1:
            raise ConfigError(f"{r.where}: {key}={v} must be a positive integer")
    if strict:
        dsa.finish()
    ix = IndexerConfig(mla.hidden, int(mla.q_lora_rank), heads, dim, topk,
                       float(vals["eps"][0]) if vals["eps"][0] is not None else eps)
    return dataclasses.replace(mla, indexer=ix)


def _kimi_ffn(r: _Reader, top: Mapping[str, Any], ffn: tuple[str, ...], num_experts, d: int, eps: float,
              act: tuple[str, float, float | None]) -> tuple[MLPConfig | None, MoEConfig | None, tuple | None]:
    """(dense MLP config, MoE config, pack-quantized weights or None): the first two present when some layer uses
    them. ``act`` is :func:`_kimi_activation`'s.

    The quantization config may sit in the text config or, for K3, in the wrapper (``top``); it only applies to
    routed experts, so a model without them must not carry one.
    """
    mlp = None
    if "dense" in ffn:
        mlp = MLPConfig(d, int(r.get("intermediate_size", required=True)), *act)
    r.read.add("intermediate_size")
    moe = None
    quant, packed = _quant(r.get("quantization_config", top.get("quantization_config")), r.where)
    if "moe" in ffn:
        moe = _kimi_moe(r, num_experts, d, eps, act, quant)
    elif quant is not None:
        raise ConfigError(f"{r.where}: quantization_config present but the model has no routed experts")
    for key in ("moe_router_activation_func", "topk_method", "use_grouped_topk", "num_expert_group", "n_group", "topk_group",
                "moe_renormalize", "norm_topk_prob", "routed_scaling_factor", "moe_intermediate_size", "latent_moe_use_norm",
                "routed_expert_hidden_size", "num_shared_experts", "num_experts_per_token", "num_experts", "moe_layer_freq",
                "first_k_dense_replace", "activation_situ_beta", "activation_situ_linear_beta"):
        r.read.add(key)
    return mlp, moe, packed


def _kimi_moe(r: _Reader, num_experts, d: int, eps: float, act: tuple[str, float, float | None],
              quant: str | None) -> MoEConfig:
    """The routed-expert config (sigmoid router, noaux_tc top-k; K3: latent experts), checked for consistency."""
    where = r.where
    r.expect("moe_router_activation_func", {"sigmoid"}, "sigmoid")
    r.expect("topk_method", {"noaux_tc"}, "noaux_tc")
    r.get("use_grouped_topk")
    n_shared = int(r.get("num_shared_experts", r.get("n_shared_experts", 0)))
    r.read.add("n_shared_experts")
    inter = int(r.get("moe_intermediate_size", required=True))
    latent = r.get("routed_expert_hidden_size")
    top_k = r.get("num_experts_per_token", r.get("num_experts_per_tok"))
    r.read.add("num_experts_per_tok")
    if num_experts is None or top_k is None:
        raise ConfigError(f"{where}: MoE layers need num_experts and num_experts_per_token")
    act_name, situ_beta, situ_linear_beta = act
    moe = MoEConfig(
        hidden=d,
        num_experts=int(num_experts),
        top_k=int(top_k),
        expert_intermediate=inter,
        num_shared=n_shared,
        shared_intermediate=inter * n_shared,
        act=act_name,
        situ_beta=situ_beta,
        situ_linear_beta=situ_linear_beta,
        latent=None if latent is None else int(latent),
        latent_norm=bool(r.get("latent_moe_use_norm", False)),
        norm_eps=eps,
        renormalize=bool(r.get("moe_renormalize", r.get("norm_topk_prob", True))),
        scaling_factor=float(r.get("routed_scaling_factor", 1.0)),
        n_group=int(r.get("num_expert_group", r.get("n_group", 1)) or 1),
        topk_group=int(r.get("topk_group", 1) or 1),
        quant=quant,
    )
    if moe.top_k > moe.num_experts:
        raise ConfigError(f"{where}: num_experts_per_token={moe.top_k} > num_experts={moe.num_experts}")
    if moe.num_experts % moe.n_group or moe.topk_group > moe.n_group:
        raise ConfigError(f"{where}: num_expert_group={moe.n_group} / topk_group={moe.topk_group} "
                          f"do not divide {moe.num_experts} experts")
    if quant == "mxfp4" and (moe.expert_in % 32 or moe.expert_intermediate % 32):
        raise ConfigError(f"{where}: MXFP4 experts need input widths divisible by 32 "
                          f"(got {moe.expert_in}, {moe.expert_intermediate})")
    return moe


def _kimi_extras(r: _Reader) -> int | None:
    """Rejects multi-token-prediction layers; returns K3's ``attn_res_block_size`` (None: no attention residuals)."""
    where = r.where
    mtp = r.get("num_nextn_predict_layers", 0) or 0
    if mtp:
        raise ConfigError(f"{where}: num_nextn_predict_layers={mtp}: multi-token-prediction layers are not supported")
    block = r.get("attn_res_block_size")
    if block is not None and int(block) < 1:
        raise ConfigError(f"{where}: attn_res_block_size={block!r} must be a positive integer or null")
    return None if block is None else int(block)


def _parse_kimi(text: Mapping[str, Any], *, k3_wrapper: bool, top: Mapping[str, Any], strict: bool) -> ModelConfig:
    where = "config.json text_config" if k3_wrapper else "config.json"
    r = _Reader(text, where)
    r.expect("model_type", {"kimi_linear", "kimi_k3"})
    is_k3 = k3_wrapper or any(r.has(k) for k in _K3_KEYS)
    n = r.get("num_hidden_layers", required=True)
    d = r.get("hidden_size", required=True)
    eps = float(r.get("rms_norm_eps", 1e-6))
    act = _kimi_activation(r)

    la = _Reader(dict(r.get("linear_attn_config", {}) or {}), f"{where} linear_attn_config")
    attn = _kimi_attn_schedule(r, la, n)
    ffn, num_experts = _kimi_ffn_schedule(r, n)
    kda = _kimi_kda(r, la, attn, d, eps)
    if strict:  # the schedule and KDA are the only readers of linear_attn_config
        la.finish()
    mla = _kimi_dsa(r, top, attn, _kimi_mla(r, attn, d), eps, strict)
    mlp, moe, packed = _kimi_ffn(r, top, ffn, num_experts, d, eps, act)
    block = _kimi_extras(r)

    # A K3 wrapper's own token ids and tying win over its text_config's.
    bos = _first_id(top.get("bos_token_id", r.get("bos_token_id")))
    eos = _first_id(top.get("eos_token_id", r.get("eos_token_id")))
    pad = _first_id(top.get("pad_token_id", r.get("pad_token_id")))
    tie = bool(top.get("tie_word_embeddings", r.get("tie_word_embeddings", False)))
    cfg = ModelConfig(
        family="kimi_k3" if is_k3 else "kimi_linear",
        vocab_size=int(r.get("vocab_size", required=True)),
        hidden_size=d,
        num_layers=n,
        attn_types=attn,
        ffn_types=ffn,
        norm_eps=eps,
        mlp=mlp,
        kda=kda,
        mla=mla,
        moe=moe,
        attn_res_block_size=block,
        tie_word_embeddings=tie,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        checkpoint_dtype=str(r.get("dtype", r.get("torch_dtype", "bfloat16"))),
        checkpoint_prefix="language_model." if k3_wrapper else "",
        max_position_embeddings=_context(r),
        packed_weights=packed,
    )
    r.read.add("torch_dtype")
    if strict:
        r.finish()
    return cfg


def _parse_dense(c: Mapping[str, Any], *, strict: bool) -> ModelConfig:
    r = _Reader(c, "config.json")
    d = int(r.get("hidden_size", required=True))
    n = int(r.get("num_hidden_layers", required=True))
    heads = int(r.get("num_attention_heads", required=True))
    kv = int(r.get("num_key_value_heads", heads) or heads)
    head_dim = int(r.get("head_dim", d // heads) or d // heads)
    r.expect("hidden_act", {"silu"}, "silu")
    for key in ("attention_bias", "mlp_bias"):
        if r.get(key, False):
            raise ConfigError(f"config.json: {key}=True is not supported")
    # rope: transformers 5 writes rope_parameters, 4.x writes rope_theta (+ rope_scaling).
    rp = dict(r.get("rope_parameters") or {})
    rs = r.get("rope_scaling")
    theta = float(rp.get("rope_theta", r.get("rope_theta", 10000.0)))
    scaling_src = rs if rs is not None else rp
    rope_type = scaling_src.get("rope_type", scaling_src.get("type", "default")) if scaling_src else "default"
    scaling = None
    if rope_type == "llama3":
        scaling = (
            "llama3",
            float(scaling_src["factor"]),
            float(scaling_src["low_freq_factor"]),
            float(scaling_src["high_freq_factor"]),
            int(scaling_src["original_max_position_embeddings"]),
        )
    elif rope_type != "default":
        raise ConfigError(f"config.json: unsupported rope scaling type {rope_type!r} (supported: default, llama3)")
    pr = r.get("partial_rotary_factor", 1.0)
    if pr != 1.0:
        raise ConfigError(f"config.json: partial_rotary_factor={pr!r} is not supported")
    sw = r.get("sliding_window")
    if sw is not None:
        raise ConfigError(f"config.json: sliding_window={sw!r} is not supported")
    experts, packed = _quant(r.get("quantization_config"), "config.json")
    if experts is not None:  # MXFP4 applies to routed experts only
        raise ConfigError("config.json: an MXFP4 quantization_config, but a dense model has no routed experts")
    cfg = ModelConfig(
        family="dense",
        vocab_size=int(r.get("vocab_size", required=True)),
        hidden_size=d,
        num_layers=n,
        attn_types=("gqa",) * n,
        ffn_types=("dense",) * n,
        norm_eps=float(r.get("rms_norm_eps", 1e-6)),
        mlp=MLPConfig(d, int(r.get("intermediate_size", required=True)), "silu"),
        gqa=GQAConfig(d, heads, kv, head_dim, theta, scaling),
        tie_word_embeddings=bool(r.get("tie_word_embeddings", False)),
        bos_token_id=_first_id(r.get("bos_token_id")),
        eos_token_id=_first_id(r.get("eos_token_id")),
        pad_token_id=_first_id(r.get("pad_token_id")),
        checkpoint_dtype=str(r.get("dtype", r.get("torch_dtype", "float32"))),
        max_position_embeddings=_context(r),
        packed_weights=packed,
    )
    r.read.add("torch_dtype")
    if strict:
        r.finish()
    return cfg


def _context(r) -> int | None:
    """``max_position_embeddings`` (a positive integer, or absent)."""
    v = r.get("max_position_embeddings")
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"config.json: max_position_embeddings={v!r} must be a positive integer")
    return v


def from_dict(c: Mapping[str, Any], *, strict: bool = True) -> ModelConfig:
    """Parse a config.json dict. Routes on the top-level architecture and K3 keys."""
    if not isinstance(c, Mapping):
        raise ConfigError(f"config.json must hold a JSON object, got {type(c).__name__}")
    archs = tuple(c.get("architectures") or ())
    mt = c.get("model_type")
    if mt == "kimi_k3" or "KimiK3ForConditionalGeneration" in archs or K31_ARCH in archs:
        text = c.get("text_config")
        if not isinstance(text, Mapping):
            raise ConfigError("config.json: model_type kimi_k3 needs a text_config object")
        top = _Reader(c, "config.json (top level)")
        for key in ("text_config", "vision_config", "media_placeholder_token_id", "image_placeholder",
                    "quantization_config", "architectures", "auto_map", "dsa_config"):
            top.get(key)
        if strict:
            top.finish()
        return _parse_kimi(text, k3_wrapper=True, top=c, strict=strict)
    if mt in ("kimi_linear",) or "KimiLinearForCausalLM" in archs:
        return _parse_kimi(c, k3_wrapper=False, top={}, strict=strict)
    if mt in ("llama", "kimi") or any(a in archs for a in ("LlamaForCausalLM", "KimiForCausalLM")):
        return _parse_dense(c, strict=strict)
    raise ConfigError(
        f"config.json: unsupported model (model_type={mt!r}, architectures={list(archs)}); "
        "supported: kimi_k3, kimi_linear, llama / KimiForCausalLM"
    )


def read_json(path: str | os.PathLike) -> dict:
    """The raw ``config.json`` dict of a checkpoint directory (or the file itself, or ``"demo"``: :func:`model_dir`):
    the one place it is read."""
    path = model_dir(path)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise FileNotFoundError(f"{file}: no config.json (is {path!r} a model directory?)")
    try:
        with open(file) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None


def load(path: str | os.PathLike, *, strict: bool = True) -> ModelConfig:
    """Read and parse ``config.json`` from a checkpoint directory (or the file itself)."""
    return from_dict(read_json(path), strict=strict)


# -- the shipped demo model, by name ---------------------------------------------------------------------------

# The trained demo model shipped in the package (``kimi-jax demo`` runs it; scripts/make_demo_model.py re-creates
# it): a small Kimi K3 in the released format with its tokenizer. Its location lives here, below every reader of
# model directories (configs, checkpoints, tokenizers through kimi_jax.generation), so that ``"demo"`` names it
# everywhere a directory is taken.
DEMO = "demo"
DEMO_MODEL = pathlib.Path(__file__).resolve().parents[1] / "assets" / "k3-demo"
DEMO_DRAFTER = DEMO_MODEL.parent / "k3-demo-dspark"  # the DSpark drafter trained for it (scripts/make_demo_drafter.py)
DEMO_FILES = ("config.json", "model.safetensors", "tiktoken.model", "tokenizer_config.json", "RECIPE.json")


def _shipped(where: pathlib.Path, files, what: str, script: str) -> str:
    """``where``, an asset shipped with the package, as a path (a FileNotFoundError names what is missing from an
    incomplete install and the script that re-creates it)."""
    missing = [f for f in files if not (where / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{where}: the shipped {what} lacks {missing} (reinstall kimi-jax, or "
                                f"re-create it: python scripts/{script} --work DIR --install)")
    return str(where)


def demo_model_dir() -> str:
    """The shipped demo model's directory (a FileNotFoundError names what is missing from an incomplete install)."""
    return _shipped(DEMO_MODEL, DEMO_FILES, "demo model", "make_demo_model.py")


def model_dir(path: str | os.PathLike) -> str:
    """``path`` as given, or the shipped demo model's directory for the name ``"demo"`` -- unless a directory of that
    name exists where the path points (a local directory wins over a name, as with HF hub names)."""
    path = os.fspath(path)
    if path == DEMO and not os.path.isdir(path):
        return demo_model_dir()
    return path


def drafter_dir(path: str | os.PathLike) -> str:
    """``path`` as given, or the directory of the DSpark drafter shipped for the demo model for the name ``"demo"``
    (``--speculative dspark:demo``) -- unless a directory of that name exists where the path points."""
    path = os.fspath(path)
    if path == DEMO and not os.path.isdir(path):
        return _shipped(DEMO_DRAFTER, ("config.json", "model.safetensors"), "demo drafter", "make_demo_drafter.py")
    return path


# -- presets: full-size configs, to build abstract models without files ----------------------------------


def _k3_text_config() -> dict:
    kda = [i for i in range(1, 94) if i % 4 != 0 and i != 93]
    full = [i for i in range(1, 94) if i % 4 == 0] + [93]
    return {
        "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 7168, "num_hidden_layers": 93,
        "num_attention_heads": 96, "num_key_value_heads": 96, "intermediate_size": 33792,
        "max_position_embeddings": 1048576,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "hidden_act": "situ", "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0, "rms_norm_eps": 1e-5, "attn_res_block_size": 12,
        "linear_attn_config": {"kda_layers": kda, "full_attn_layers": full, "num_heads": 96, "head_dim": 128,
                               "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "use_full_rank_gate": True},
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "mla_use_nope": True, "mla_use_output_gate": True, "num_experts": 896, "num_experts_per_token": 16,
        "num_shared_experts": 2, "moe_intermediate_size": 3072, "routed_expert_hidden_size": 3584,
        "latent_moe_use_norm": True, "moe_router_activation_func": "sigmoid", "moe_renormalize": True,
        "routed_scaling_factor": 1.0, "topk_method": "noaux_tc", "use_grouped_topk": True, "num_expert_group": 1,
        "topk_group": 1, "num_nextn_predict_layers": 0, "tie_word_embeddings": False, "bos_token_id": 163584,
        "eos_token_id": 163586, "pad_token_id": 163839, "dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "mxfp4-pack-quantized",
                                          "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                                                      "symmetric": True, "scale_dtype": "torch.uint8", "dynamic": False},
                                          "input_activations": None, "output_activations": None}},
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                       "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
            "kv_cache_scheme": None,
        },
    }


def k3_config_dict() -> dict:
    """The released Kimi K3 config.json (text part; vision_config omitted)."""
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "bos_token_id": 163584,
            "eos_token_id": 163586, "pad_token_id": 163839, "media_placeholder_token_id": 163605,
            "tie_word_embeddings": False, "text_config": _k3_text_config()}


def kimi_linear_48b_config_dict() -> dict:
    kda = [i for i in range(1, 28) if i % 4 != 0 and i != 27]
    return {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 163840,
        "hidden_size": 2304, "num_hidden_layers": 27, "num_attention_heads": 32, "num_key_value_heads": 32,
        "intermediate_size": 9216, "first_k_dense_replace": 1, "moe_layer_freq": 1, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "linear_attn_config": {"kda_layers": kda, "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                                                    "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4},
        "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "mla_use_nope": True, "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1,
        "moe_intermediate_size": 1024, "moe_router_activation_func": "sigmoid", "moe_renormalize": True,
        "routed_scaling_factor": 2.446, "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
        "tie_word_embeddings": False, "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
        "dtype": "bfloat16",
    }


def kimi_dense_config_dict() -> dict:
    """The dense GQA configuration published as ``KimiForCausalLM`` (Llama-shaped)."""
    return {"architectures": ["KimiForCausalLM"], "model_type": "kimi", "vocab_size": 163840, "hidden_size": 4096,
            "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False, "hidden_act": "silu",
            "bos_token_id": 163584, "eos_token_id": 163585, "dtype": "bfloat16"}


def tiny_k3_config_dict() -> dict:
    """A tiny K3 in the released layout (KDA x3 + MLA cycle, final two MLA, AttnRes, LatentMoE, MXFP4 experts):
    the embedded default for the demo, tests and notebooks."""
    c = k3_config_dict()
    t = c["text_config"]
    t.update(vocab_size=1024, hidden_size=128, num_hidden_layers=9, num_attention_heads=4, num_key_value_heads=4,
             intermediate_size=256, attn_res_block_size=3, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
             qk_rope_head_dim=16, v_head_dim=32, num_experts=8, num_experts_per_token=2, moe_intermediate_size=64,
             routed_expert_hidden_size=64, num_shared_experts=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    t["linear_attn_config"].update(kda_layers=[1, 2, 3, 5, 6, 7], full_attn_layers=[4, 8, 9], num_heads=4, head_dim=32)
    c.update(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return c


def _as_k31(c: dict, heads: int, head_dim: int, topk: int) -> dict:
    """K3 config ``c`` made K3.1's: the architecture, and an indexer of ``heads x head_dim`` choosing ``topk`` keys
    in each MLA layer (``dsa_config`` in the provisional spelling of :class:`IndexerConfig`)."""
    c["architectures"] = [K31_ARCH]
    t = c["text_config"]
    t["dsa_config"] = {"index_n_heads": heads, "index_head_dim": head_dim, "index_topk": topk,
                       "dsa_layers": list(t["linear_attn_config"]["full_attn_layers"])}
    return c


def k31_config_dict() -> dict:
    """Kimi K3.1 Pro: K3 plus a DSA indexer (32 heads x 128, top-2048) in each of the 24 MLA layers."""
    return _as_k31(k3_config_dict(), 32, 128, 2048)


def tiny_k31_config_dict() -> dict:
    """:func:`tiny_k3_config_dict` as K3.1: an indexer of 2 heads x 16 choosing 16 keys in each of its MLA layers."""
    return _as_k31(tiny_k3_config_dict(), 2, 16, 16)


PRESETS = {
    "k3": k3_config_dict,
    "k3.1": k31_config_dict,
    "kimi-linear-48b-a3b": kimi_linear_48b_config_dict,
    "kimi-dense": kimi_dense_config_dict,
}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; available: {sorted(PRESETS)}")
    return from_dict(PRESETS[name]())
