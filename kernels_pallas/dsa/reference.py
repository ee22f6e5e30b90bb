"""Kimi K3.1's DSA selection in plain jnp: the oracle and the path on every platform.

Selection (:func:`select`): the indexer score ``I[b, t, s] = sum_h w[b, t, h] ReLU(q[b, t, h] . k[b, s])`` of each
query over the keys at positions ``<= q_pos`` (absolute, as in the attention references: cache slots not yet
written sit beyond every query); each query keeps its ``X = min(topk, S)`` best keys, ties going to the later key,
and every visible key while it sees at most ``topk``. The result is their positions ``idx [B, T, X]`` int32, ``-1``
where a query sees fewer than ``X`` keys (vLLM's sentinel).

The attention over the chosen keys is :mod:`kernels_pallas.sparse_mla`. "float32": float64 where an operand is
float64 (:func:`kernels_pallas._common.acc_dtype`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas._common import acc_dtype
from kernels_pallas.cache_quant import dense
from kernels_pallas.paged_attention.reference import gather

_HI = jax.lax.Precision.HIGHEST


def index_scores(q_BTHK, w_BTH, k_BSK, q_pos_BT):
    """Indexer scores ``[B, T, S]`` float32 (``-inf`` beyond each query's position). ``q``: the indexer queries
    (``H`` indexer heads of dim ``K``); ``w``: the per-head weights, scale included; ``k``: the indexer keys."""
    S = k_BSK.shape[1]
    dt = acc_dtype(q_BTHK, w_BTH, k_BSK)
    k = dense(k_BSK, dt)

    def head(acc_BTS, qw):  # one head at a time: [B, T, S] live, never [B, T, H, S]
        q_BTK, w_BT = qw
        logits = jnp.einsum("btk,bsk->bts", q_BTK, k, precision=_HI)
        return acc_BTS + w_BT[..., None] * jax.nn.relu(logits), None

    B, T = q_pos_BT.shape
    xs = (jnp.moveaxis(q_BTHK.astype(dt), 2, 0), jnp.moveaxis(w_BTH.astype(dt), 2, 0))
    s, _ = jax.lax.scan(head, jnp.zeros((B, T, S), dt), xs)
    return jnp.where(jnp.arange(S)[None, None, :] <= q_pos_BT[:, :, None], s, -jnp.inf)


def top_keys(scores_BTS, q_pos_BT, *, topk):
    """Positions ``[B, T, X]`` int32 of each query's ``min(topk, visible)`` best keys (``-1`` pads): score
    descending, then position descending (``lax.top_k`` puts the lower index first among equals, so it runs over
    the reversed key axis)."""
    S = scores_BTS.shape[-1]
    visible = jnp.arange(S)[None, None, :] <= q_pos_BT[:, :, None]
    vals, idx = jax.lax.top_k(jnp.where(visible, scores_BTS, -jnp.inf)[..., ::-1], min(int(topk), S))
    return jnp.where(vals > -jnp.inf, S - 1 - idx, -1).astype(jnp.int32)


def chosen_mask(idx_BTX, S: int):
    """The positions ``idx`` as a mask ``[B, T, S]`` bool (``-1`` chooses nothing)."""
    B, T, _ = idx_BTX.shape
    slot = jnp.where(idx_BTX < 0, S, idx_BTX)  # -1 -> a spare column, dropped
    out = jnp.put_along_axis(jnp.zeros((B, T, S + 1), bool), slot, True, axis=-1, inplace=False)
    return out[..., :S]


def select(q_BTHK, w_BTH, k_BSK, q_pos_BT, *, topk):
    """The chosen keys' positions ``[B, T, X]`` (:func:`index_scores`, then :func:`top_keys`)."""
    return top_keys(index_scores(q_BTHK, w_BTH, k_BSK, q_pos_BT), q_pos_BT, topk=topk)


def paged_select(q_BTHK, w_BTH, k_pages, page_table, q_pos_BT, *, topk):
    """:func:`select` over indexer keys in pages ``[n_pages, page_size, K]`` read through ``page_table``."""
    return select(q_BTHK, w_BTH, gather(k_pages, page_table), q_pos_BT, topk=topk)
