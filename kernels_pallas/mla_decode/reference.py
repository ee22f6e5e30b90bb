"""Absorbed MLA attention over the compressed latent cache, in plain jnp.

The query has already been absorbed into latent space (``q_lat_h = W_UK_h^T q_nope_h``); keys are the cached
latent ``c`` (shared by all heads, MQA-style) plus the shared decoupled key part ``kpe``. The output stays in
latent space (``u_h = sum_s p_h(s) c_s``); the caller applies ``W_UV``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_F32 = jnp.float32
_HI = jax.lax.Precision.HIGHEST


def probabilities(q_lat_BTHR, q_pe_BTHO, c_BSR, kpe_BSO, q_pos_BT, *, scale):
    """Attention probabilities ``[B, H, T, S]`` float32 (causal by absolute position over ``S`` cache slots)."""
    S = c_BSR.shape[1]
    s = jnp.einsum("bthr,bsr->bhts", q_lat_BTHR.astype(_F32), c_BSR.astype(_F32), precision=_HI)
    s = s + jnp.einsum("btho,bso->bhts", q_pe_BTHO.astype(_F32), kpe_BSO.astype(_F32), precision=_HI)
    s = s * scale
    mask = jnp.arange(S)[None, None, None, :] <= q_pos_BT[:, None, :, None]
    return jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)


def mla_attention(q_lat_BTHR, q_pe_BTHO, c_BSR, kpe_BSO, q_pos_BT, *, scale):
    """Returns u ``[B, T, H, R]`` float32."""
    p = probabilities(q_lat_BTHR, q_pe_BTHO, c_BSR, kpe_BSO, q_pos_BT, scale=scale)
    return jnp.einsum("bhts,bsr->bthr", p, c_BSR.astype(_F32), precision=_HI)
