"""MLA absorbed attention over the latent cache (latent R + shared decoupled key part O per token).

Shapes: q_lat ``[B, T, H, R]``, q_pe ``[B, T, H, O]``, c ``[B, S, R]``, kpe ``[B, S, O]``, q_pos ``[B, T]``.
Returns u ``[B, T, H, R]`` float32 (still in latent space). On CPU the automatic choice is ``"cpu_native"``
(``native.cc``: the cache read in place, each query row's slots split over the threads) for a bfloat16 cache and
up to :data:`NATIVE_ROWS` query rows, else ``"xla_cpu"`` (``xla_cpu.py``: the reference's math with the cache
product oriented for XLA:CPU), which also takes what the native kernel does not (int8 caches). Over a float32
cache XLA's form is the faster at long contexts, so it keeps those (``benchmarks/native_attention.py`` measures both).

On a mesh: sequences split over ``batch``; the cache positions over ``mla_seq`` where the layout has it (the
latent cache has no head axis: this is how it is split over the tensor-parallel axis), each device attending over
its slice and the partials merged by their softmax weights (``Rule.merge``); query heads over ``heads`` where the
cache positions left that axis free (else every device computes every head over its slice of the cache).
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas._dispatch import NATIVE, PALLAS, REFERENCE, XLA_CPU, CpuImpl, Op, Rule
from kernels_pallas.mla_decode import native, pallas, reference, xla_cpu

# Query rows (B * T) up to which the automatic choice on CPU is the native kernel: decode steps. Each chunk of the
# cache is read once for all heads of one row; a prefill chunk of many rows is one large product that XLA:CPU runs
# on every core.
NATIVE_ROWS = 16

RULE = Rule(args=("BTHR", "BTHO", "BSR", "BSO", "BT"), out="BTHR",
            split=(("B", "batch"), ("S", "mla_seq"), ("H", "heads")), merge="S", positions=4)


OP = Op("mla_attention", RULE, {REFERENCE: reference.mla_attention, PALLAS: pallas.mla_attention},
        cpu=(CpuImpl(NATIVE, native.mla_attention, unsupported=native.unsupported, ready=native.KERNEL.ready,
                     automatic=lambda q_lat, q_pe, c, *_, **__: (q_lat.shape[0] * q_lat.shape[1] <= NATIVE_ROWS
                                                                 and getattr(c, "dtype", None) == jnp.bfloat16)),
             CpuImpl(XLA_CPU, xla_cpu.mla_attention)))


def mla_attention(q_lat, q_pe, c, kpe, q_pos, *, scale, with_lse=False, implementation=None, placement=None):
    """u ``[B, T, H, R]`` float32; with ``with_lse`` also the log-sum-exp ``[B, T, H]`` of the scores each query saw
    (``-inf`` and zeros where it saw none), over the whole cache wherever it lies."""
    return OP(q_lat, q_pe, c, kpe, q_pos, scale=scale, with_lse=with_lse, implementation=implementation,
              placement=placement)
