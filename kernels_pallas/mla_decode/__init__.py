"""MLA absorbed attention over the latent cache (latent R + shared decoupled key part O per token).

Shapes: q_lat ``[B, T, H, R]``, q_pe ``[B, T, H, O]``, c ``[B, S, R]``, kpe ``[B, S, O]``, q_pos ``[B, T]``.
Returns u ``[B, T, H, R]`` float32 (still in latent space). On CPU the automatic choice is ``"xla_cpu"``
(``xla_cpu.py``: the reference's math with the cache product oriented for XLA:CPU).

On a mesh: sequences split over ``batch``; the cache positions over ``mla_seq`` where the layout has it (the
latent cache has no head axis: this is how it is split over the tensor-parallel axis), each device attending over
its slice and the partials merged by their softmax weights (``Rule.merge``); query heads over ``heads`` where the
cache positions left that axis free (else every device computes every head over its slice of the cache).
"""

from __future__ import annotations

from kernels_pallas._dispatch import PALLAS, REFERENCE, XLA_CPU, CpuImpl, Op, Rule
from kernels_pallas.mla_decode import pallas, reference, xla_cpu

RULE = Rule(args=("BTHR", "BTHO", "BSR", "BSO", "BT"), out="BTHR",
            split=(("B", "batch"), ("S", "mla_seq"), ("H", "heads")), merge="S", positions=4)
OP = Op("mla_attention", RULE, {REFERENCE: reference.mla_attention, PALLAS: pallas.mla_attention},
        cpu=(CpuImpl(XLA_CPU, xla_cpu.mla_attention),))


def mla_attention(q_lat, q_pe, c, kpe, q_pos, *, scale, implementation=None, placement=None):
    return OP(q_lat, q_pe, c, kpe, q_pos, scale=scale, implementation=implementation, placement=placement)
