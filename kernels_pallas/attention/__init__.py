"""Causal attention for prefill and for decode over a static cache (GQA, and MLA in expanded form).

Shapes: q ``[B, T, H, K]``, k ``[B, S, G, K]``, v ``[B, S, G, U]``, q_pos ``[B, T]`` int32; H = G * rep.
MLA passes its rope part separately: q_pe ``[B, T, H, O]``, k_pe ``[B, S, O]`` (shared by all heads; G == H).
``k_pos [B, S]`` (key positions) defaults to ``arange(S)``. Returns o ``[B, T, H, U]`` float32.

On a mesh: sequences split over ``batch``, query and key/value heads over ``heads`` (one decision for H and G, so
each device holds whole kv groups with their query heads); cache positions and head dims stay whole.
"""

from __future__ import annotations

from kernels_pallas._dispatch import PALLAS, REFERENCE, Op, Rule
from kernels_pallas.attention import pallas, reference

RULE = Rule(args=("BTHK", "BSGK", "BSGU", "BT", "BS", "BTHO", "BSO"), out="BTHU",
            split=(("B", "batch"), ("H", "heads"), ("G", "heads")))


def _reference(q, k, v, q_pos, k_pos, q_pe, k_pe, *, scale):
    return reference.attention(q, k, v, q_pos, scale=scale, k_pos_BS=k_pos, q_pe_BTHO=q_pe, k_pe_BSO=k_pe)


def _pallas(q, k, v, q_pos, k_pos, q_pe, k_pe, *, scale, platform, interpret):
    return pallas.attention(q, k, v, q_pos, scale=scale, k_pos_BS=k_pos, q_pe_BTHO=q_pe, k_pe_BSO=k_pe,
                            platform=platform, interpret=interpret)


OP = Op("attention", RULE, {REFERENCE: _reference, PALLAS: _pallas})


def attention(q, k, v, q_pos, *, scale, k_pos=None, q_pe=None, k_pe=None, implementation=None, placement=None):
    return OP(q, k, v, q_pos, k_pos, q_pe, k_pe, scale=scale, implementation=implementation, placement=placement)
