"""Kimi K3.1's DSA indexer: each query's top-k keys.

Shapes: indexer queries q ``[B, T, H, K]`` (``H`` indexer heads of dim ``K``), weights w ``[B, T, H]`` (scale
included), indexer keys k ``[B, S, K]`` (paged: ``[n_pages, page_size, K]`` with ``page_table [B, pages_per_seq]``),
q_pos ``[B, T]``; the selection is the chosen positions ``idx [B, T, X]`` int32 (``X = min(topk, S)``, ``-1``
pads), ties to the later key. The MLA attention restricted to them is :mod:`kernels_pallas.sparse_mla` (gather form,
with its Pallas kernels).

Implementations (no partition rule: on a mesh GSPMD partitions the plain-XLA forms, and the kernel is not chosen
there; the ops are ``plain``: a run that asks for Pallas kernels where the kernel cannot run gets the form the
automatic choice takes):

* ``"reference"`` (``reference.py``): the scores of every key at once, one indexer head at a time (``[B, T, S]``
  float32 live); the oracle, and the automatic choice while a query's keys fit in :data:`streaming.KEY_BLOCK` plus
  the top-k.
* ``"streaming"`` (``streaming.py``): the keys in blocks (whole pages when paged), a running top-k: ``[B, T,
  KEY_BLOCK + X]`` live whatever the context; the same positions as the reference. The automatic choice beyond.

* ``"pallas"`` / ``"pallas_interpret"`` (``pallas.py``): the streaming form with each block's scores from a Pallas
  kernel (every indexer head in one pass, no per-head scores or float32 keys in memory); the automatic choice on TPU
  and GPU (one device). The top-k stays XLA's; a kernel fusing it into the scoring is the next step.
"""

from __future__ import annotations

import jax

from kernels_pallas._dispatch import PALLAS, REFERENCE, CpuImpl, Op
from kernels_pallas.dsa import pallas, reference, streaming


def _keys(k) -> int:
    return jax.tree.leaves(k)[0].shape[1]


def _long(q, w, k, q_pos, *, topk, **_):
    """Whether the scores of all ``S`` keys at once would outgrow the streaming form's block plus top-k."""
    S = _keys(k)
    return S > streaming.KEY_BLOCK + min(int(topk), S)


def _long_paged(q, w, k_pages, page_table, q_pos, *, topk, **_):
    S = page_table.shape[1] * _keys(k_pages)
    return S > streaming.KEY_BLOCK + min(int(topk), S)


SELECT_OP = Op("dsa_select", None, {REFERENCE: reference.select, PALLAS: pallas.select}, plain=True,
               forms=(CpuImpl("streaming", streaming.select, automatic=_long),),
               pallas_unsupported=lambda platform, q, w, k, *_, **__: pallas.unsupported(k))
PAGED_SELECT_OP = Op("dsa_paged_select", None, {REFERENCE: reference.paged_select, PALLAS: pallas.paged_select},
                     plain=True, forms=(CpuImpl("streaming", streaming.paged_select, automatic=_long_paged),),
                     pallas_unsupported=lambda platform, q, w, k, *_, **__: pallas.unsupported(k))


def select(q, w, k, q_pos, *, topk, implementation=None, placement=None):
    return SELECT_OP(q, w, k, q_pos, topk=topk, implementation=implementation, placement=placement)


def paged_select(q, w, k_pages, page_table, q_pos, *, topk, implementation=None, placement=None):
    return PAGED_SELECT_OP(q, w, k_pages, page_table, q_pos, topk=topk, implementation=implementation,
                           placement=placement)
