"""MLA absorbed attention over the latent cache (latent R + shared decoupled key part O per token).

Shapes: q_lat ``[B, T, H, R]``, q_pe ``[B, T, H, O]``, c ``[B, S, R]``, kpe ``[B, S, O]``, q_pos ``[B, T]``.
Returns u ``[B, T, H, R]`` float32 (still in latent space). On CPU the automatic choice is ``"xla_cpu"``
(``xla_cpu.py``: the reference's math with the cache product oriented for XLA:CPU).

On a mesh: sequences split over ``batch``, query heads over ``heads``; the latent cache (shared by all heads) is
split by sequence only.
"""

from __future__ import annotations

from kernels_pallas._dispatch import PALLAS, REFERENCE, XLA_CPU, CpuImpl, Op, Rule
from kernels_pallas.mla_decode import pallas, reference, xla_cpu

RULE = Rule(args=("BTHR", "BTHO", "BSR", "BSO", "BT"), out="BTHR", split=(("B", "batch"), ("H", "heads")))
OP = Op("mla_attention", RULE, {REFERENCE: reference.mla_attention, PALLAS: pallas.mla_attention},
        cpu=(CpuImpl(XLA_CPU, xla_cpu.mla_attention),))


def mla_attention(q_lat, q_pe, c, kpe, q_pos, *, scale, implementation=None, placement=None):
    return OP(q_lat, q_pe, c, kpe, q_pos, scale=scale, implementation=implementation, placement=placement)
