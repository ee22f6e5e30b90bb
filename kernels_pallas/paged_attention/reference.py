"""Attention over a paged cache, in plain jnp: the oracle for the paged kernels.

A paged cache keeps every sequence's keys in fixed-size pages of one pool shared by all sequences: logical cache
position ``s`` of sequence ``b`` lives in row ``s % page_size`` of page ``page_table[b, s // page_size]``. The
reference gathers each sequence's pages into the contiguous cache the static-cache references read, then runs
their math unchanged: causal by absolute position, so slots not yet written (or left stale in a reused page) sit
beyond every query that could see them. int8 pools (``kernels_pallas.cache_quant.Int8Rows``) are gathered codes and
scales alike, then read dequantized.
"""

from __future__ import annotations

import jax

from kernels_pallas.attention import reference as dense
from kernels_pallas.mla_decode import reference as mla_dense


def gather(pages, page_table):
    """``pages [n_pages, page_size, ...]`` read through ``page_table [B, pages_per_seq]`` -> ``[B, S, ...]`` with
    ``S = pages_per_seq * page_size`` (each field of an int8 pool alike)."""
    B, n = page_table.shape
    return jax.tree.map(lambda p: p[page_table].reshape(B, n * p.shape[1], *p.shape[2:]), pages)


def paged_mla_attention(q_lat_BTHR, q_pe_BTHO, c_pages, kpe_pages, page_table, q_pos_BT, *, scale):
    """Absorbed MLA over the paged latent cache (``c_pages [n_pages, page_size, R]``, ``kpe_pages [n_pages,
    page_size, O]``). Returns u ``[B, T, H, R]`` float32."""
    return mla_dense.mla_attention(q_lat_BTHR, q_pe_BTHO, gather(c_pages, page_table), gather(kpe_pages, page_table),
                                   q_pos_BT, scale=scale)


def paged_attention(q_BTHK, k_pages, v_pages, page_table, q_pos_BT, *, scale):
    """Causal GQA over the paged cache (``k_pages [n_pages, page_size, G, K]``, ``v_pages [n_pages, page_size, G,
    U]``). Returns o ``[B, T, H, U]`` float32."""
    return dense.attention(q_BTHK, gather(k_pages, page_table), gather(v_pages, page_table), q_pos_BT, scale=scale)
