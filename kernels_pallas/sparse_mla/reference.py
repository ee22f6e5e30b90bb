"""Sparse absorbed MLA (Kimi K3.1's DSA attention) in plain jnp, gather form: the oracle of the sparse kernels.

Each query row ``(b, t)`` reads only the cache positions ``idx[b, t, :]`` chosen for it (the indexer's top-k):
their latent rows ``c`` and decoupled key parts ``kpe`` are gathered, then scored and softmaxed as in
:mod:`kernels_pallas.mla_decode.reference` (``u_h = sum_x p_h(x) c_idx[x]``, in latent space, float32). An index
outside ``[0, S)`` (``-1``: no entry) is no key; the chosen positions are not checked against the query's position
(the selection is causal already). Indices are expected to be distinct (a repeated one counts twice here, once in
the TPU kernel).

:func:`masked_attention` is the same attention in mask form (the dense scores over every cache position, all but the
chosen ones at ``-inf``): the DeepSeek reference's and llama.cpp's form, which the tests hold the gather form to.

Paged caches (``[n_pages, page_size, ...]`` pools read through a page table ``[B, pages_per_seq]``): the chosen
entries are cache positions as for the static cache; :func:`pool_rows` translates them to rows of the pool, which
:func:`paged_sparse_mla_attention` gathers (as the kernel reads them).

``with_lse=True`` (a cache split by sequence over devices, ``kernels_pallas._dispatch.Rule.merge``): also the
log-sum-exp of the chosen scores ``[B, T, H]``; a row with no entry gets zeros and ``-inf``.

"float32": float64 where an operand is float64 (:func:`kernels_pallas._common.acc_dtype`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas._common import acc_dtype
from kernels_pallas.cache_quant import dense

_F32 = jnp.float32
_HI = jax.lax.Precision.HIGHEST


def valid(idx_BTX, S):
    """Which chosen entries are keys ``[B, T, X]``: those inside the cache's ``S`` positions."""
    return (idx_BTX >= 0) & (idx_BTX < S)


def gather_rows(x_BSI, idx_BTX, dtype=_F32):
    """Rows ``x[b, idx[b, t, x]]`` -> ``[B, T, X, I]`` float32 (``dtype``; indices clipped into the cache; an int8
    cache read dequantized)."""
    safe = jnp.clip(idx_BTX, 0, jax.tree.leaves(x_BSI)[0].shape[1] - 1)
    return dense(jax.tree.map(lambda x: jax.vmap(lambda rows, i: rows[i])(x, safe), x_BSI), dtype)  # int8: codes first


def _softmax(s, keep, with_lse):
    """Softmax over the last axis of the scores where ``keep``; rows with nothing kept: zeros (and lse ``-inf``)."""
    s = jnp.where(keep, s, -jnp.inf)
    top = jnp.max(s, axis=-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    e = jnp.exp(s - top)
    total = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(total > 0, total, 1.0)
    return p, (top + jnp.log(total))[..., 0] if with_lse else None


def _attend(q_lat_BTHR, q_pe_BTHO, c_BTXR, kpe_BTXO, ok_BTX, *, scale, with_lse):
    """Softmax attention of each query row over its gathered rows (those where ``ok``)."""
    s = jnp.einsum("bthr,btxr->bthx", q_lat_BTHR.astype(c_BTXR.dtype), c_BTXR, precision=_HI)
    s = s + jnp.einsum("btho,btxo->bthx", q_pe_BTHO.astype(c_BTXR.dtype), kpe_BTXO, precision=_HI)
    p, lse = _softmax(s * scale, ok_BTX[:, :, None, :], with_lse)
    u = jnp.einsum("bthx,btxr->bthr", p, c_BTXR, precision=_HI)
    return (u, lse) if with_lse else u


def sparse_mla_attention(q_lat_BTHR, q_pe_BTHO, c_BSR, kpe_BSO, idx_BTX, *, scale, with_lse=False):
    """Returns u ``[B, T, H, R]`` float32 (and with ``with_lse`` its log-sum-exp ``[B, T, H]``)."""
    dt = acc_dtype(q_lat_BTHR, q_pe_BTHO, c_BSR, kpe_BSO)
    return _attend(q_lat_BTHR, q_pe_BTHO, gather_rows(c_BSR, idx_BTX, dt), gather_rows(kpe_BSO, idx_BTX, dt),
                   valid(idx_BTX, c_BSR.shape[1]), scale=scale, with_lse=with_lse)


def selection_mask(idx_BTX, S):
    """The chosen positions as a mask ``[B, T, S]`` (True where chosen)."""
    B, T, _ = idx_BTX.shape
    ok = valid(idx_BTX, S)
    rows = jnp.zeros((B, T, S + 1), bool)  # column S collects the entries that are no key
    at = jnp.where(ok, idx_BTX, S)
    rows = rows.at[jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None], at].set(True)
    return rows[..., :S]


def masked_attention(q_lat_BTHR, q_pe_BTHO, c_BSR, kpe_BSO, idx_BTX, *, scale):
    """The mask form: dense scores over all ``S`` positions, the unchosen ones at ``-inf``. Returns u ``[B, T, H,
    R]`` float32."""
    dt = acc_dtype(q_lat_BTHR, q_pe_BTHO, c_BSR, kpe_BSO)
    c = dense(c_BSR, dt)
    s = jnp.einsum("bthr,bsr->bths", q_lat_BTHR.astype(dt), c, precision=_HI)
    s = s + jnp.einsum("btho,bso->bths", q_pe_BTHO.astype(dt), dense(kpe_BSO, dt), precision=_HI)
    p, _ = _softmax(s * scale, selection_mask(idx_BTX, c.shape[1])[:, :, None, :], False)
    return jnp.einsum("bths,bsr->bthr", p, c, precision=_HI)


def pool_rows(idx_BTX, page_table, page_size, n_pages):
    """Cache positions -> rows of a page pool viewed as ``[n_pages * page_size]``: position ``s`` of sequence ``b`` is
    row ``s % page_size`` of page ``page_table[b, s // page_size]`` (clipped into the pool). An entry outside the
    table's ``pages_per_seq * page_size`` positions stays ``-1``."""
    ok = valid(idx_BTX, page_table.shape[1] * page_size)
    safe = jnp.where(ok, idx_BTX, 0)
    page = jax.vmap(lambda table, i: table[i])(page_table, safe // page_size)
    row = jnp.clip(page, 0, n_pages - 1) * page_size + safe % page_size
    return jnp.where(ok, row, -1).astype(jnp.int32)


def paged_sparse_mla_attention(q_lat_BTHR, q_pe_BTHO, c_pages, kpe_pages, page_table, idx_BTX, *, scale):
    """The gather form over a paged cache: the chosen rows gathered out of the pool through the page table."""
    n, ps = jax.tree.leaves(c_pages)[0].shape[:2]
    rows = pool_rows(idx_BTX, page_table, ps, n)
    flat = lambda a: a.reshape(n * ps, a.shape[-1])[jnp.maximum(rows, 0)]  # [B, T, X, I]
    dt = acc_dtype(q_lat_BTHR, q_pe_BTHO, c_pages, kpe_pages)
    take = lambda pages: dense(jax.tree.map(flat, pages), dt)  # int8: the chosen codes and scales, then dequantized
    return _attend(q_lat_BTHR, q_pe_BTHO, take(c_pages), take(kpe_pages), rows >= 0, scale=scale, with_lse=False)
