"""Dimension letters used in array names (`x_BTD`, `state_BHKU`), shape notes (`[B, T, H, K]`), partition rules
and einsum strings (lowercase there) across kimi-jax. Each letter means one thing; :data:`LETTERS` is the table.

B  batch (sequences)                      T  query tokens in this call
S  cache / key positions                  N  flattened tokens (B*T)
D  model width (hidden_size)              V  vocabulary (logits, embeddings)
H  query heads                            G  key/value heads (GQA)
K  key/query head dim (MLA: its nope part)
U  value head dim (KDA, MLA, GQA values)
O  MLA decoupled ("rope") key dim, unrotated in Kimi (NoPE)
R  MLA latent rank (kv_lora_rank)         Q  MLA query rank (q_lora_rank)
P  KDA projection width (heads * head dim)
C  KDA chunk length                       W  short-conv width
E  routed experts                         X  chosen per token (top-k): experts; K3.1 DSA cache positions
F  MLP / expert hidden width              L  latent-MoE width (routed_expert_hidden_size)
M  rows of a matrix product (the expert-sorted token matrix N*X in the MoE; the few rows of a decode product)
I  input features of a generic product (the contraction dim)
J  output features of a generic product
A  query rows per kv head inside an attention kernel ((H/G)*T)

Weights follow the checkpoint layout `[out, in]`, so a linear layer is `einsum("...d,fd->...f")` and a generic
product `x [M, I] @ w [J, I]^T -> [M, J]`. A `p` suffix marks a padded size (`Kp`); counts that are not array
dims are spelled out (`n_blocks`, `cap`). Kernel tuning knobs keep the usual kernel names (`block_m/n/k` of a
GEMM tile, `block_q/k` of flash attention, `block_v`), and written-out math names matrices (KDA's `S`, `T`, `U`,
`W`): neither is a dimension letter. ``tests/test_dims.py`` checks every shape-suffixed name against the table.
"""

LETTERS = {
    "B": "batch (sequences)",
    "T": "query tokens in this call",
    "S": "cache / key positions",
    "N": "flattened tokens (B*T)",
    "D": "model width (hidden_size)",
    "V": "vocabulary (logits, embeddings)",
    "H": "query heads",
    "G": "key/value heads (GQA)",
    "K": "key/query head dim (MLA: its nope part)",
    "U": "value head dim (KDA, MLA, GQA values)",
    "O": 'MLA decoupled ("rope") key dim, unrotated in Kimi (NoPE)',
    "R": "MLA latent rank (kv_lora_rank)",
    "Q": "MLA query rank (q_lora_rank)",
    "P": "KDA projection width (heads * head dim)",
    "C": "KDA chunk length",
    "W": "short-conv width",
    "E": "routed experts",
    "X": "chosen per token (top-k): experts; K3.1 DSA cache positions",
    "F": "MLP / expert hidden width",
    "L": "latent-MoE width (routed_expert_hidden_size)",
    "M": "rows of a matrix product (the expert-sorted token matrix N*X in the MoE; the few rows of a decode product)",
    "I": "input features of a generic product (the contraction dim)",
    "J": "output features of a generic product",
    "A": "query rows per kv head inside an attention kernel ((H/G)*T)",
}
