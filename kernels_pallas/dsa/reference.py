"""Kimi K3.1's DSA selection and the sparse MLA that consumes it, in plain jnp (mask form): the oracle and the path
on every platform.

Selection (:func:`select`): the indexer score ``I[b, t, s] = sum_h w[b, t, h] ReLU(q[b, t, h] . k[b, s])`` of each
query over the keys at positions ``<= q_pos`` (absolute, as in the attention references: cache slots not yet
written sit beyond every query); each query keeps its ``topk`` best keys, ties going to the later key, and every
visible key while it sees at most ``topk``. The result is a mask ``[B, T, S]``: the sparse attention
(:func:`sparse_mla_attention`) is the dense absorbed MLA with the unchosen keys' scores at ``-inf``, which is
exactly the gather form's math (``docs/K31_AND_DSPARK.md`` 3.3) at a dense form's cost.

Paged forms gather each sequence's pages first (:func:`kernels_pallas.paged_attention.reference.gather`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.cache_quant import dense
from kernels_pallas.mla_decode import reference as mla_dense
from kernels_pallas.paged_attention.reference import gather

_F32 = jnp.float32
_HI = jax.lax.Precision.HIGHEST


def index_scores(q_BTHK, w_BTH, k_BSK, q_pos_BT):
    """Indexer scores ``[B, T, S]`` float32 (``-inf`` beyond each query's position). ``q``: the indexer queries
    (``H`` indexer heads of dim ``K``); ``w``: the per-head weights, scale included; ``k``: the indexer keys."""
    S = k_BSK.shape[1]
    k = dense(k_BSK, _F32)

    def head(acc_BTS, qw):  # one head at a time: [B, T, S] live, never [B, T, H, S]
        q_BTK, w_BT = qw
        logits = jnp.einsum("btk,bsk->bts", q_BTK, k, precision=_HI)
        return acc_BTS + w_BT[..., None] * jax.nn.relu(logits), None

    B, T = q_pos_BT.shape
    xs = (jnp.moveaxis(q_BTHK.astype(_F32), 2, 0), jnp.moveaxis(w_BTH.astype(_F32), 2, 0))
    s, _ = jax.lax.scan(head, jnp.zeros((B, T, S), _F32), xs)
    return jnp.where(jnp.arange(S)[None, None, :] <= q_pos_BT[:, :, None], s, -jnp.inf)


def top_keys(scores_BTS, q_pos_BT, *, topk):
    """Mask ``[B, T, S]`` of each query's ``min(topk, visible)`` best keys: score descending, then key position
    descending (``lax.top_k`` puts the lower index first among equals, so it runs over the reversed key axis)."""
    S = scores_BTS.shape[-1]
    n = min(int(topk), S)
    visible = jnp.arange(S)[None, None, :] <= q_pos_BT[:, :, None]
    _, idx = jax.lax.top_k(jnp.where(visible, scores_BTS, -jnp.inf)[..., ::-1], n)
    chosen = jnp.put_along_axis(jnp.zeros(scores_BTS.shape, bool), S - 1 - idx, True, axis=-1, inplace=False)
    return chosen & visible


def select(q_BTHK, w_BTH, k_BSK, q_pos_BT, *, topk):
    """The chosen keys ``[B, T, S]`` bool (:func:`index_scores`, then :func:`top_keys`)."""
    return top_keys(index_scores(q_BTHK, w_BTH, k_BSK, q_pos_BT), q_pos_BT, topk=topk)


def paged_select(q_BTHK, w_BTH, k_pages, page_table, q_pos_BT, *, topk):
    """:func:`select` over indexer keys in pages ``[n_pages, page_size, K]`` read through ``page_table``."""
    return select(q_BTHK, w_BTH, gather(k_pages, page_table), q_pos_BT, topk=topk)


def sparse_mla_attention(q_lat_BTHR, q_pe_BTHO, c_BSR, kpe_BSO, q_pos_BT, chosen_BTS, *, scale):
    """Absorbed MLA (:mod:`kernels_pallas.mla_decode`) over the chosen keys only. Returns u ``[B, T, H, R]``
    float32 (latent space)."""
    s = mla_dense.scores(q_lat_BTHR, q_pe_BTHO, c_BSR, kpe_BSO, q_pos_BT, scale=scale)
    p = jax.nn.softmax(jnp.where(chosen_BTS[:, None], s, -jnp.inf), axis=-1)
    return jnp.einsum("bhts,bsr->bthr", p, dense(c_BSR, _F32), precision=_HI)


def paged_sparse_mla_attention(q_lat_BTHR, q_pe_BTHO, c_pages, kpe_pages, page_table, q_pos_BT, chosen_BTS, *,
                               scale):
    """:func:`sparse_mla_attention` over the paged latent cache."""
    return sparse_mla_attention(q_lat_BTHR, q_pe_BTHO, gather(c_pages, page_table), gather(kpe_pages, page_table),
                                q_pos_BT, chosen_BTS, scale=scale)
