"""Kimi K3.1's DSA: the indexer's top-k key selection and the MLA attention restricted to it.

Shapes: indexer queries q ``[B, T, H, K]`` (``H`` indexer heads of dim ``K``), weights w ``[B, T, H]`` (scale
included), indexer keys k ``[B, S, K]`` (paged: ``[n_pages, page_size, K]`` with ``page_table [B, pages_per_seq]``),
q_pos ``[B, T]``; the selection is the chosen positions ``idx [B, T, X]`` int32 (``X = min(topk, S)``, ``-1`` pads);
the sparse MLA takes the absorbed MLA operands of :mod:`kernels_pallas.mla_decode` (paged: of
:mod:`kernels_pallas.paged_attention`) with ``idx`` in place of the positions, gathers the chosen rows and returns u
``[B, T, H, R]`` float32.

One implementation so far, ``"reference"`` (``reference.py``, plain jnp), on every platform: the ops are ``plain`` (a
run that asks for Pallas kernels runs it) with no partition rule (on a mesh GSPMD partitions the plain XLA). A
kernel that streams the indexer keys (scores and top-k without the ``[B, T, S]`` scores in memory) and a FlashMLA-
style sparse kernel are the next steps for long contexts.
"""

from __future__ import annotations

from kernels_pallas._dispatch import REFERENCE, Op
from kernels_pallas.dsa import reference

SELECT_OP = Op("dsa_select", None, {REFERENCE: reference.select}, plain=True)
PAGED_SELECT_OP = Op("dsa_paged_select", None, {REFERENCE: reference.paged_select}, plain=True)
SPARSE_MLA_OP = Op("sparse_mla_attention", None, {REFERENCE: reference.sparse_mla_attention}, plain=True)
PAGED_SPARSE_MLA_OP = Op("paged_sparse_mla_attention", None, {REFERENCE: reference.paged_sparse_mla_attention},
                         plain=True)


def select(q, w, k, q_pos, *, topk, implementation=None, placement=None):
    return SELECT_OP(q, w, k, q_pos, topk=topk, implementation=implementation, placement=placement)


def paged_select(q, w, k_pages, page_table, q_pos, *, topk, implementation=None, placement=None):
    return PAGED_SELECT_OP(q, w, k_pages, page_table, q_pos, topk=topk, implementation=implementation,
                           placement=placement)


def sparse_mla_attention(q_lat, q_pe, c, kpe, idx, *, scale, implementation=None, placement=None):
    return SPARSE_MLA_OP(q_lat, q_pe, c, kpe, idx, scale=scale, implementation=implementation, placement=placement)


def paged_sparse_mla_attention(q_lat, q_pe, c_pages, kpe_pages, page_table, idx, *, scale, implementation=None,
                               placement=None):
    return PAGED_SPARSE_MLA_OP(q_lat, q_pe, c_pages, kpe_pages, page_table, idx, scale=scale,
                               implementation=implementation, placement=placement)
