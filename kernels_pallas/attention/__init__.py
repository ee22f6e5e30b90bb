"""Causal attention for prefill and for decode over a static cache (GQA, and MLA in expanded form).

Shapes: q ``[B, T, H, K]``, k ``[B, S, G, K]``, v ``[B, S, G, U]``, q_pos ``[B, T]`` int32; H = G * rep.
"""

from __future__ import annotations

from kernels_pallas._dispatch import resolve
from kernels_pallas.attention import reference

_IMPLS = {"reference": reference.attention}


def attention(q, k, v, q_pos, *, scale, k_pos=None, implementation=None):
    impl = resolve("attention", implementation, _IMPLS, accelerated=("pallas",))
    return _IMPLS[impl](q, k, v, q_pos, scale=scale, k_pos_BS=k_pos)
