"""Config parsing: the three families, presets, and clear errors for what we do not implement."""

import copy
import json
import time

import pytest

from kimi_jax.model import config as C
from kimi_jax.model.decoder import abstract_model, param_count


def test_k3_fixture_config(k3_tiny_a):
    cfg = C.load(k3_tiny_a)
    assert cfg.family == "kimi_k3"
    # 1-based kda_layers [1,2,3,5,6,7] -> 0-based KDA at 0,1,2,4,5,6; MLA at 3,7,8 (final two both MLA)
    assert cfg.attn_types == ("kda", "kda", "kda", "mla", "kda", "kda", "kda", "mla", "mla")
    assert cfg.ffn_types == ("dense",) + ("moe",) * 8
    assert cfg.kda.gate_lower_bound == -5.0 and cfg.kda.full_rank_gate
    assert cfg.mla.output_gate and cfg.mla.lora_norm_eps == 1e-6
    assert cfg.moe.latent == 64 and cfg.moe.latent_norm and cfg.moe.quant == "mxfp4" and cfg.moe.num_shared == 2
    assert cfg.moe.act == "situ" and cfg.moe.situ_beta == 4.0 and cfg.moe.situ_linear_beta == 25.0
    assert cfg.attn_res_block_size == 3 and cfg.checkpoint_prefix == "language_model."
    assert hash(cfg) == hash(C.load(k3_tiny_a))  # frozen + hashable: usable as a static jit argument


def test_k3_full_preset_abstract_in_seconds():
    cfg = C.preset("k3")
    assert cfg.attn_types.count("kda") == 69 and cfg.attn_types.count("mla") == 24
    assert cfg.attn_types[91] == cfg.attn_types[92] == "mla" and cfg.attn_types[3] == "mla"
    t = time.perf_counter()
    n = param_count(abstract_model(cfg))
    assert time.perf_counter() - t < 60
    assert abs(n / 2.78e12 - 1) < 0.01, n  # 2.7795T from the released shapes (K3_SPEC §3.1)


@pytest.mark.parametrize("name,billions", [("kimi-linear-48b-a3b", 49.1), ("kimi-dense", 7.0)])
def test_other_presets(name, billions):
    n = param_count(abstract_model(C.preset(name)))
    assert abs(n / 1e9 - billions) / billions < 0.02


def test_k3_keys_route_even_without_wrapper(k3_tiny_a):
    """K3 features follow the K3 keys, never the inner KimiLinearForCausalLM name."""
    raw = json.load(open(f"{k3_tiny_a}/config.json"))
    text = raw["text_config"]
    cfg = C.from_dict(text)
    assert cfg.family == "kimi_k3" and cfg.attn_res_block_size == 3 and cfg.checkpoint_prefix == ""


def test_gate_forms(k3_tiny_a):
    raw = json.load(open(f"{k3_tiny_a}/config.json"))
    del raw["text_config"]["linear_attn_config"]["gate_lower_bound"]
    assert C.from_dict(raw).kda.gate_lower_bound is None  # softplus decay (the 0.40B miniature's form)


def _k3(k3_tiny_a):
    return json.load(open(f"{k3_tiny_a}/config.json"))


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.update(hidden_act="gelu"), "hidden_act='gelu'"),
    (lambda t: t.update(moe_router_activation_func="softmax"), "moe_router_activation_func='softmax'"),
    (lambda t: t.update(mla_use_nope=False), "mla_use_nope=False"),
    (lambda t: t.update(topk_method="greedy"), "topk_method='greedy'"),
    (lambda t: t.update(some_new_switch=True), "some_new_switch"),
    (lambda t: t["linear_attn_config"].update(kda_layers=[0, 1]), "kda_layers"),
    (lambda t: t["quantization_config"].update(format="nvfp4-pack-quantized"), "nvfp4-pack-quantized"),
    (lambda t: t.update(num_nextn_predict_layers=1), "num_nextn_predict_layers"),
    (lambda t: t.update(num_experts_per_token=99), "num_experts_per_token=99"),
])
def test_unsupported_values_name_key_and_value(k3_tiny_a, edit, match):
    raw = copy.deepcopy(_k3(k3_tiny_a))
    edit(raw["text_config"])
    with pytest.raises(C.ConfigError, match=match):
        C.from_dict(raw)


def test_unknown_key_can_be_allowed(k3_tiny_a):
    raw = _k3(k3_tiny_a)
    raw["text_config"]["some_new_switch"] = True
    assert C.from_dict(raw, strict=False).family == "kimi_k3"


@pytest.mark.parametrize("edit,match", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "gelu"),
    ({"sliding_window": 4096}, "sliding_window"),
])
def test_dense_unsupported(edit, match):
    raw = C.kimi_dense_config_dict()
    raw.update(edit)
    with pytest.raises(C.ConfigError, match=match):
        C.from_dict(raw)


def test_dense_kimi_config():
    cfg = C.preset("kimi-dense")
    assert cfg.family == "dense" and cfg.gqa.num_heads == 32 and cfg.gqa.num_kv_heads == 8
    assert cfg.gqa.rope_theta == 1e6 and cfg.num_layers == 32 and not cfg.tie_word_embeddings
    assert cfg.mlp.intermediate == 11008 and cfg.norm_eps == 1e-6


def test_unknown_model_and_bad_json(tmp_path):
    with pytest.raises(C.ConfigError, match="unsupported model"):
        C.from_dict({"model_type": "gpt2"})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(C.ConfigError, match="not valid JSON"):
        C.load(tmp_path)
