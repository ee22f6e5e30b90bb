"""Kimi K3.1's DSA selection and the sparse MLA that consumes it, in plain jnp: the oracle and the path on every
platform.

Selection (:func:`select`): the indexer score ``I[b, t, s] = sum_h w[b, t, h] ReLU(q[b, t, h] . k[b, s])`` of each
query over the keys at positions ``<= q_pos`` (absolute, as in the attention references: cache slots not yet
written sit beyond every query); each query keeps its ``X = min(topk, S)`` best keys, ties going to the later key,
and every visible key while it sees at most ``topk``. The result is their positions ``idx [B, T, X]`` int32, ``-1``
where a query sees fewer than ``X`` keys (vLLM's sentinel).

Sparse attention (:func:`sparse_mla_attention`): the absorbed MLA of :mod:`kernels_pallas.mla_decode` over the
chosen rows only, gathered (``[B, T, X, R]``: the cost no longer grows with the cache, the scores are ``[B, H, T,
X]``). The paged form gathers the rows straight from the pool through the page table. :func:`masked_mla_attention` is
the same math in mask form (dense scores, the unchosen at ``-inf``; DeepSeek's reference form), for the tests.
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


def _attend(q_lat_BTHR, q_pe_BTHO, c_BTXR, kpe_BTXO, idx_BTX, scale):
    """Absorbed MLA of each query over its own gathered rows (``idx < 0``: no key)."""
    s = jnp.einsum("bthr,btxr->bhtx", q_lat_BTHR.astype(_F32), c_BTXR, precision=_HI)
    s = s + jnp.einsum("btho,btxo->bhtx", q_pe_BTHO.astype(_F32), kpe_BTXO, precision=_HI)
    p = jax.nn.softmax(jnp.where(idx_BTX[:, None] >= 0, s * scale, -jnp.inf), axis=-1)
    return jnp.einsum("bhtx,btxr->bthr", p, c_BTXR, precision=_HI)


def sparse_mla_attention(q_lat_BTHR, q_pe_BTHO, c_BSR, kpe_BSO, idx_BTX, *, scale):
    """Absorbed MLA over the chosen rows of a static cache (``c [B, S, R]``, ``kpe [B, S, O]``, int8 rows read
    dequantized). Returns u ``[B, T, H, R]`` float32 (latent space)."""
    safe = jnp.maximum(idx_BTX, 0)

    def rows(a):  # [B, S, ...] -> [B, T, X, ...]
        return jax.vmap(lambda a_b, i_b: a_b[i_b])(a, safe)

    c, kpe = (dense(jax.tree.map(rows, x), _F32) for x in (c_BSR, kpe_BSO))
    return _attend(q_lat_BTHR, q_pe_BTHO, c, kpe, idx_BTX, scale)


def paged_sparse_mla_attention(q_lat_BTHR, q_pe_BTHO, c_pages, kpe_pages, page_table, idx_BTX, *, scale):
    """:func:`sparse_mla_attention` over the paged latent cache: each chosen position ``s`` read from row ``s %
    page_size`` of page ``page_table[b, s // page_size]``."""
    ps = jax.tree.leaves(c_pages)[0].shape[1]
    safe = jnp.maximum(idx_BTX, 0)
    page = jax.vmap(lambda table_b, i_b: table_b[i_b // ps])(page_table, safe)  # [B, T, X]

    def rows(a):  # [n_pages, page_size, ...] -> [B, T, X, ...]
        return a[page, safe % ps]

    c, kpe = (dense(jax.tree.map(rows, x), _F32) for x in (c_pages, kpe_pages))
    return _attend(q_lat_BTHR, q_pe_BTHO, c, kpe, idx_BTX, scale)


def masked_mla_attention(q_lat_BTHR, q_pe_BTHO, c_BSR, kpe_BSO, q_pos_BT, idx_BTX, *, scale):
    """:func:`sparse_mla_attention` in mask form: the dense absorbed scores with every unchosen key at ``-inf``."""
    s = mla_dense.scores(q_lat_BTHR, q_pe_BTHO, c_BSR, kpe_BSO, q_pos_BT, scale=scale)
    chosen = chosen_mask(idx_BTX, s.shape[-1])
    p = jax.nn.softmax(jnp.where(chosen[:, None], s, -jnp.inf), axis=-1)
    return jnp.einsum("bhts,bsr->bthr", p, dense(c_BSR, _F32), precision=_HI)
