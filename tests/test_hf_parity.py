"""Parity with HF transformers (an oracle we did not write), float32, on tiny random checkpoints."""

import jax.numpy as jnp
import numpy as np
import torch

import kimi_jax
from tests.parity import TOL, assert_close


def _compare(path, hf_model, vocab, T, seed):
    ids = torch.randint(0, vocab, (2, T), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref = hf_model(ids).logits.numpy()
    assert 1.0 < np.abs(ref).max() < 20, "oracle logits should be O(1-5) for the tolerance to mean something"
    model = kimi_jax.from_pretrained(path, dtype="float32")
    out = model(jnp.asarray(ids.numpy(), jnp.int32)).logits
    err = assert_close(out, ref, TOL["float32"], "logits vs HF")
    print(f"max |logits - HF| = {err:.3g} (max |logit| {np.abs(ref).max():.2f})")


def test_llama_matches_hf(hf_llama):
    path, hf_model = hf_llama
    _compare(path, hf_model, 256, 33, seed=1)


def test_kimi_linear_matches_hf(hf_kimi_linear):
    # 70 tokens: crosses the 64-token KDA chunk boundary.
    path, hf_model = hf_kimi_linear
    _compare(path, hf_model, 128, 70, seed=2)


def test_kimi_linear_config_forms_agree(hf_kimi_linear, tmp_path):
    """HF's `layer_types` form and the released `linear_attn_config` (1-based lists) give the same model."""
    import json

    from kimi_jax.model import config as C

    path, _ = hf_kimi_linear
    raw = json.load(open(f"{path}/config.json"))
    lac = dict(raw)
    lac.pop("layer_types")
    lac.pop("mlp_layer_types")
    for k in ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"):
        lac.pop(k)
    lac["linear_attn_config"] = {"kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 4, "head_dim": 16,
                                 "short_conv_kernel_size": 4}
    lac["first_k_dense_replace"] = 1
    assert C.from_dict(raw) == C.from_dict(lac)


def test_llama3_rope_scaling_matches_hf(tmp_path):
    from tests import hf_models

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 5e5}
    model = hf_models.llama(tmp_path, rope_parameters=scaling, num_hidden_layers=1)
    _compare(str(tmp_path), model, 256, 40, seed=3)


def test_kimi_linear_without_q_lora_matches_hf(tmp_path):
    """Kimi-Linear-48B's MLA has no query low-rank (a plain q_proj), and 2 shared experts."""
    from tests import hf_models

    model = hf_models.kimi_linear(tmp_path, q_lora_rank=None, num_shared_experts=2, seed=4)
    _compare(str(tmp_path), model, 128, 20, seed=5)
