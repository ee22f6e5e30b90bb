"""The model: config, the layer math (token mixers, MoE, AttnRes), the static cache, the decoder stack."""
