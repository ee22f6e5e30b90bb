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


def mla_attention(q_lat_BTHR, q_pe_BTHO, c_BSR, kpe_BSO, q_pos_BT, *, scale):
    """Returns u ``[B, T, H, R]`` float32. Causal by absolute position over ``S`` cache slots."""
    S = c_BSR.shape[1]
    s = jnp.einsum("bthr,bsr->bhts", q_lat_BTHR.astype(_F32), c_BSR.astype(_F32), precision=_HI)
    s = s + jnp.einsum("btho,bso->bhts", q_pe_BTHO.astype(_F32), kpe_BSO.astype(_F32), precision=_HI)
    s = s * scale
    mask = jnp.arange(S)[None, None, None, :] <= q_pos_BT[:, None, :, None]
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    B, H, T, _ = p.shape
    # [B, H*T, S] @ [B, S, R] with the cache as the right operand, kept in that orientation: left to itself XLA:CPU
    # puts the cache on the left (contracting its major axis) and runs the product 2-3x slower at batch 8.
    u = jax.lax.optimization_barrier(
        jnp.einsum("bms,bsr->bmr", p.reshape(B, H * T, S), c_BSR.astype(_F32), precision=_HI))
    return jnp.swapaxes(u.reshape(B, H, T, -1), 1, 2)
