"""Tiny random Hugging Face models (the external oracles), written with ``save_pretrained``.

Weights are drawn at a larger scale than HF's default init so logits are O(1-5) and a 2e-4 tolerance means
something; the MoE correction bias is non-zero so it changes which experts are chosen.
"""

from __future__ import annotations

import torch


def _rescale(model, seed: int):
    """Variance-preserving weights (std 1/sqrt(fan_in)), unit embeddings, a lm_head giving O(1-5) logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 1.5 / p.shape[-1] ** 0.5)
            elif p.ndim >= 2 and "conv" not in name:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            elif "norm" in name and p.ndim == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
        for mod in model.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.copy_(0.1 * torch.randn(mod.e_score_correction_bias.shape, generator=g))
    return model


def llama(path, *, seed=0, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rope_theta=1e6, max_position_embeddings=512, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    model = _rescale(LlamaForCausalLM(LlamaConfig(**kw)).float().eval(), seed)
    model.save_pretrained(path)
    return model


def kimi_linear(path, *, seed=0, **overrides):
    """4 layers: KDA, KDA, KDA, MLA; dense first layer, MoE (4 experts top-2 + shared) after."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    torch.manual_seed(seed)
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
              qk_nope_head_dim=16, v_head_dim=16, num_experts=4, num_experts_per_token=2, num_shared_experts=1,
              linear_head_dim=16, linear_num_heads=4,
              layer_types=["linear_attention"] * 3 + ["full_attention"], mlp_layer_types=["dense"] + ["sparse"] * 3,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    model = _rescale(KimiLinearForCausalLM(KimiLinearConfig(**kw)).float().eval(), seed)
    model.save_pretrained(path)
    return model
