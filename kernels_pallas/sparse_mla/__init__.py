"""Sparse absorbed MLA (Kimi K3.1's DSA attention), gather form: each query row attends over only the cache positions
chosen for it (the indexer's top-k), reading just those latent rows.

Shapes: q_lat ``[B, T, H, R]``, q_pe ``[B, T, H, O]`` (``O`` may be 0), c ``[B, S, R]``, kpe ``[B, S, O]``, idx
``[B, T, X]`` int32: the cache positions chosen per query row, distinct; an entry outside ``[0, S)`` (``-1``) is
no key. Returns u ``[B, T, H, R]`` float32 (still in latent space), as :mod:`kernels_pallas.mla_decode`, whose
attention over the chosen positions this is (the dense op over the whole cache when every visible position is
chosen).

Implementations: ``"reference"`` (``reference.py``: gathers the chosen rows, then the softmax; also the mask form
the tests hold it to) and ``"pallas"`` / ``"pallas_interpret"`` (``pallas.py``: per query row, blocks of chosen
rows gathered from the cache in place -- Triton gathers on GPU; on TPU one DMA per distinct 8-row tile group
holding chosen rows, as Mosaic copies whole tiles -- with an online softmax). On CPU the automatic choice is the
reference. int8 caches: the reference only (the automatic choice passes over the kernel for them; an explicit
``"pallas"`` raises).

Paged caches (``paged_sparse_mla_attention``: pools ``[n_pages, page_size, R]`` / ``[n_pages, page_size, O]`` and a
page table ``[B, pages_per_seq]``, as :mod:`kernels_pallas.paged_attention`; idx still holds cache positions): the
kernel reads the chosen rows out of the shared pool through the page table; on a mesh the query heads split over
``heads``, the pool and the table whole.

On a mesh: sequences split over ``batch``, the cache positions over ``mla_seq`` where the layout has it (each
device attends over the chosen entries in its slice: the indices are shifted by the slice's first position like
the dense op's query positions, so the others fall outside ``[0, S_local)``; the partials merge by their softmax
weights, ``Rule.merge``), query heads over ``heads``.
"""

from __future__ import annotations

from kernels_pallas._dispatch import PALLAS, REFERENCE, Op, Rule
from kernels_pallas.sparse_mla import pallas, reference

RULE = Rule(args=("BTHR", "BTHO", "BSR", "BSO", "BTX"), out="BTHR",
            split=(("B", "batch"), ("S", "mla_seq"), ("H", "heads")), merge="S", positions=4)

PAGED_RULE = Rule(args=("BTHR", "BTHO", "SSR", "SSO", "BS", "BTX"), out="BTHR", split=(("H", "heads"),))

OP = Op("sparse_mla_attention", RULE, {REFERENCE: reference.sparse_mla_attention, PALLAS: pallas.sparse_mla_attention},
        pallas_unsupported=lambda platform, q_lat, q_pe, c, kpe, *_, **__: pallas.unsupported(c, kpe))


def sparse_mla_attention(q_lat, q_pe, c, kpe, idx, *, scale, implementation=None, placement=None):
    return OP(q_lat, q_pe, c, kpe, idx, scale=scale, implementation=implementation, placement=placement)

PAGED_OP = Op("paged_sparse_mla_attention", PAGED_RULE,
              {REFERENCE: reference.paged_sparse_mla_attention, PALLAS: pallas.paged_sparse_mla_attention},
              pallas_unsupported=lambda platform, q_lat, q_pe, c, kpe, *_, **__: pallas.unsupported(c, kpe))


def paged_sparse_mla_attention(q_lat, q_pe, c_pages, kpe_pages, page_table, idx, *, scale, implementation=None,
                               placement=None):
    return PAGED_OP(q_lat, q_pe, c_pages, kpe_pages, page_table, idx, scale=scale, implementation=implementation,
                    placement=placement)
