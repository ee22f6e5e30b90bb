"""Kimi K3.1's DSA indexer: each query's top-k keys.

Shapes: indexer queries q ``[B, T, H, K]`` (``H`` indexer heads of dim ``K``), weights w ``[B, T, H]`` (scale
included), indexer keys k ``[B, S, K]`` (paged: ``[n_pages, page_size, K]`` with ``page_table [B, pages_per_seq]``),
q_pos ``[B, T]``; the selection is the chosen positions ``idx [B, T, X]`` int32 (``X = min(topk, S)``, ``-1`` pads),
ties to the later key. The MLA attention restricted to them is :mod:`kernels_pallas.sparse_mla` (gather form, with
its Pallas kernels).

One implementation so far, ``"reference"`` (``reference.py``, plain jnp: the scores one indexer head at a time), on
every platform: the ops are ``plain`` (a run that asks for Pallas kernels runs it) with no partition rule (on a mesh
GSPMD partitions the plain XLA). A kernel that streams the indexer keys (scores and top-k without the ``[B, T, S]``
scores in memory) is the next step for long contexts.
"""

from __future__ import annotations

from kernels_pallas._dispatch import REFERENCE, Op
from kernels_pallas.dsa import reference

SELECT_OP = Op("dsa_select", None, {REFERENCE: reference.select}, plain=True)
PAGED_SELECT_OP = Op("dsa_paged_select", None, {REFERENCE: reference.paged_select}, plain=True)



def select(q, w, k, q_pos, *, topk, implementation=None, placement=None):
    return SELECT_OP(q, w, k, q_pos, topk=topk, implementation=implementation, placement=placement)


def paged_select(q, w, k_pages, page_table, q_pos, *, topk, implementation=None, placement=None):
    return PAGED_SELECT_OP(q, w, k_pages, page_table, q_pos, topk=topk, implementation=implementation,
                           placement=placement)
