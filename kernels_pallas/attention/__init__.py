"""Causal attention for prefill and for decode over a static cache (GQA, and MLA in expanded form).

Shapes: q ``[B, T, H, K]``, k ``[B, S, G, K]``, v ``[B, S, G, U]``, q_pos ``[B, T]`` int32; H = G * rep.
MLA passes its rope part separately: q_pe ``[B, T, H, O]``, k_pe ``[B, S, O]`` (shared by all heads; G == H).
``k_pos [B, S]`` (key positions) defaults to ``arange(S)``. Returns o ``[B, T, H, U]`` float32.
"""

from __future__ import annotations

from kernels_pallas._dispatch import INTERPRET, PALLAS, pallas_platform, resolve
from kernels_pallas.attention import pallas, reference

_IMPLS = {"reference": reference.attention, PALLAS: pallas.attention, INTERPRET: pallas.attention}


def attention(q, k, v, q_pos, *, scale, k_pos=None, q_pe=None, k_pe=None, implementation=None):
    impl = resolve("attention", implementation, _IMPLS, accelerated=(PALLAS,))
    kw = dict(scale=scale, k_pos_BS=k_pos, q_pe_BTHO=q_pe, k_pe_BSO=k_pe)
    if impl in (PALLAS, INTERPRET):
        platform, interpret = pallas_platform(impl)
        kw.update(platform=platform, interpret=interpret)
    return _IMPLS[impl](q, k, v, q_pos, **kw)
