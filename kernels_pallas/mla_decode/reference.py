"""Absorbed MLA attention over the compressed latent cache, in plain jnp.

The query has already been absorbed into latent space (``q_lat_h = W_UK_h^T q_nope_h``); keys are the cached
latent ``c`` (shared by all heads, MQA-style) plus the shared decoupled key part ``kpe``. The output stays in
latent space (``u_h = sum_s p_h(s) c_s``); the caller applies ``W_UV``. An int8 cache
(``kernels_pallas.cache_quant.Int8Rows``) is read dequantized to float32. "float32": float64 where an operand is
float64 (:func:`kernels_pallas._common.acc_dtype`).

``with_lse=True`` (a cache split by sequence over devices, ``kernels_pallas._dispatch.Rule.merge``): the result
over these keys and the log-sum-exp of the visible scores ``[B, T, H]``; a query that sees none of these keys gets
zeros and ``-inf``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas._common import acc_dtype
from kernels_pallas.cache_quant import dense

_HI = jax.lax.Precision.HIGHEST


def scores(q_lat_BTHR, q_pe_BTHO, c_BSR, kpe_BSO, q_pos_BT, *, scale):
    """Scaled scores ``[B, H, T, S]`` float32, ``-inf`` where the key's position is beyond the query's."""
    S = c_BSR.shape[1]
    dt = acc_dtype(q_lat_BTHR, q_pe_BTHO, c_BSR, kpe_BSO)
    s = jnp.einsum("bthr,bsr->bhts", q_lat_BTHR.astype(dt), dense(c_BSR, dt), precision=_HI)
    s = s + jnp.einsum("btho,bso->bhts", q_pe_BTHO.astype(dt), dense(kpe_BSO, dt), precision=_HI)
    s = s * scale
    mask = jnp.arange(S)[None, None, None, :] <= q_pos_BT[:, None, :, None]
    return jnp.where(mask, s, -jnp.inf)


def probabilities(q_lat_BTHR, q_pe_BTHO, c_BSR, kpe_BSO, q_pos_BT, *, scale, with_lse=False):
    """Attention probabilities ``[B, H, T, S]`` float32 (causal by absolute position over ``S`` cache slots); with
    ``with_lse`` also the log-sum-exp ``[B, H, T]`` (rows that see no key: zero probabilities and ``-inf``)."""
    s = scores(q_lat_BTHR, q_pe_BTHO, c_BSR, kpe_BSO, q_pos_BT, scale=scale)
    if not with_lse:
        return jax.nn.softmax(s, axis=-1)
    top = jnp.max(s, axis=-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    e = jnp.exp(s - top)
    total = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.where(total > 0, total, 1.0), (top + jnp.log(total))[..., 0]


def mla_attention(q_lat_BTHR, q_pe_BTHO, c_BSR, kpe_BSO, q_pos_BT, *, scale, with_lse=False):
    """Returns u ``[B, T, H, R]`` float32 (and with ``with_lse`` its log-sum-exp ``[B, T, H]``)."""
    p = probabilities(q_lat_BTHR, q_pe_BTHO, c_BSR, kpe_BSO, q_pos_BT, scale=scale, with_lse=with_lse)
    p, lse = p if with_lse else (p, None)
    u = jnp.einsum("bhts,bsr->bthr", p, dense(c_BSR, p.dtype), precision=_HI)
    return (u, jnp.swapaxes(lse, 1, 2)) if with_lse else u
