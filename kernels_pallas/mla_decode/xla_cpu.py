"""Absorbed MLA attention in the form XLA:CPU runs fastest (``implementation="xla_cpu"``, its automatic choice).

The same float32 math as :mod:`kernels_pallas.mla_decode.reference`; the weighted sum over the cache is written
as ``[B, H*T, S] @ [B, S, R]`` with the cache as the right operand, kept in that orientation: left to itself
XLA:CPU puts the cache on the left (contracting its major axis) and runs the product 2-3x slower at batch 8.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.cache_quant import dense
from kernels_pallas.mla_decode.reference import probabilities

_HI = jax.lax.Precision.HIGHEST


def mla_attention(q_lat_BTHR, q_pe_BTHO, c_BSR, kpe_BSO, q_pos_BT, *, scale, with_lse=False):
    p = probabilities(q_lat_BTHR, q_pe_BTHO, c_BSR, kpe_BSO, q_pos_BT, scale=scale, with_lse=with_lse)
    p, lse = p if with_lse else (p, None)
    B, H, T, S = p.shape
    u = jax.lax.optimization_barrier(
        jnp.einsum("bms,bsr->bmr", p.reshape(B, H * T, S), dense(c_BSR, p.dtype), precision=_HI))
    u = jnp.swapaxes(u.reshape(B, H, T, -1), 1, 2)
    return (u, jnp.swapaxes(lse, 1, 2)) if with_lse else u
