"""Dimension letters used in array names (`x_BTD`) and einsum strings across kimi-jax.

B  batch (sequences)                      N  flattened tokens (B*T)
T  query tokens in this call              S  cache positions (static max length)
D  model width (hidden_size)              V  vocabulary (on logits/embeddings)
H  attention heads (query heads)          G  key/value heads (GQA)
K  key/query head dim                     U  value head dim
R  MLA latent rank (kv_lora_rank)         Q  MLA query rank (q_lora_rank)
O  MLA decoupled ("rope") key dim, unrotated in Kimi (NoPE)
P  KDA projection width (heads * head_dim)
C  KDA chunk length                       W  short-conv width
E  routed experts                         X  experts chosen per token (top-k)
F  MLP / expert hidden width              L  latent-MoE width (routed_expert_hidden_size)
M  rows of the expert-sorted token matrix (N * X)

Weights follow the checkpoint layout `[out, in]`, so a linear layer is `einsum("...d,fd->...f")`.
"""
