"""Softmax attention in plain jnp: the oracle for the attention kernels and the CPU path.

Causality is by absolute position: query at position p sees keys at positions <= p. Over a static cache the
same rule hides every slot that was not written yet (or holds stale padding), because those slots sit at
positions beyond the query's own. Keys and values may be int8 cache rows (``kernels_pallas.cache_quant``): read
dequantized to float32. "float32": float64 where an operand is float64 (:func:`kernels_pallas._common.acc_dtype`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas._common import acc_dtype
from kernels_pallas.cache_quant import dense

_HI = jax.lax.Precision.HIGHEST


def attention(q_BTHK, k_BSGK, v_BSGU, q_pos_BT, *, scale, k_pos_BS=None, q_pe_BTHO=None, k_pe_BSO=None):
    """Causal GQA attention. ``H = G * rep``; returns o ``[B, T, H, U]`` float32.

    ``k_pos_BS`` defaults to ``arange(S)`` (keys stored at their positions, as in a cache or a fresh prompt).
    MLA may pass its decoupled key part separately: ``q_pe [B, T, H, O]`` scores against ``k_pe [B, S, O]``,
    one row shared by every head (then ``G == H``); the score is the sum of both dot products.
    Scores, softmax and the weighted sum run in float32.
    """
    B, T, H, K = q_BTHK.shape
    S, G = k_BSGK.shape[1], k_BSGK.shape[2]
    rep = H // G
    dt = acc_dtype(q_BTHK, k_BSGK, v_BSGU, q_pe_BTHO, k_pe_BSO)
    q, k = q_BTHK.astype(dt), dense(k_BSGK, dt)
    if q_pe_BTHO is not None:
        # one score product over [nope | pe]: two separate ones cost XLA:CPU a transposing pass (+35% here)
        O = q_pe_BTHO.shape[-1]
        q = jnp.concatenate([q, q_pe_BTHO.astype(dt)], axis=-1)
        k = jnp.concatenate([k, jnp.broadcast_to(dense(k_pe_BSO, dt)[:, :, None], (B, S, G, O))], axis=-1)
    # h: the rep query heads of kv group g (H split as G x rep)
    s = jnp.einsum("btghk,bsgk->bghts", q.reshape(B, T, G, rep, -1), k, precision=_HI)
    s = s * scale
    k_pos = jnp.arange(S)[None] if k_pos_BS is None else k_pos_BS
    mask = k_pos[:, None, None, None, :] <= q_pos_BT[:, None, None, :, None]
    s = jnp.where(mask, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bghts,bsgu->btghu", p, dense(v_BSGU, dt), precision=_HI)
    return o.reshape(B, T, H, v_BSGU.shape[-1])
