"""Absorbed MLA attention over the compressed latent cache, in plain jnp.

The query has already been absorbed into latent space (``q_lat_h = W_UK_h^T q_nope_h``); keys are the cached
latent ``c`` (shared by all heads, MQA-style) plus the shared decoupled key part ``kpe``. The output stays in
latent space (``u_h = sum_s p_h(s) c_s``); the caller applies ``W_UV``. An int8 cache
(``kernels_pallas.cache_quant.Int8Rows``) is read dequantized to float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.cache_quant import dense

_F32 = jnp.float32
_HI = jax.lax.Precision.HIGHEST


def probabilities(q_lat_BTHR, q_pe_BTHO, c_BSR, kpe_BSO, q_pos_BT, *, scale):
    """Attention probabilities ``[B, H, T, S]`` float32 (causal by absolute position over ``S`` cache slots)."""
    S = c_BSR.shape[1]
    s = jnp.einsum("bthr,bsr->bhts", q_lat_BTHR.astype(_F32), dense(c_BSR, _F32), precision=_HI)
    s = s + jnp.einsum("btho,bso->bhts", q_pe_BTHO.astype(_F32), dense(kpe_BSO, _F32), precision=_HI)
    s = s * scale
    mask = jnp.arange(S)[None, None, None, :] <= q_pos_BT[:, None, :, None]
    return jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)


def mla_attention(q_lat_BTHR, q_pe_BTHO, c_BSR, kpe_BSO, q_pos_BT, *, scale):
    """Returns u ``[B, T, H, R]`` float32."""
    p = probabilities(q_lat_BTHR, q_pe_BTHO, c_BSR, kpe_BSO, q_pos_BT, scale=scale)
    return jnp.einsum("bhts,bsr->bthr", p, dense(c_BSR, _F32), precision=_HI)
