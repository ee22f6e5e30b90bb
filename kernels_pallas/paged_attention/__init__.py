"""Attention over a paged cache: absorbed MLA over latent pages, and GQA over key/value pages.

Pages: one pool per layer, ``[n_pages, page_size, ...]``, shared by every sequence; ``page_table [B,
pages_per_seq]`` int32 names the page holding each sequence's positions ``[j * page_size, (j + 1) * page_size)``.
Entries past a sequence's length may name any page (their keys sit beyond every query and are never seen).
Shapes: MLA q_lat ``[B, T, H, R]``, q_pe ``[B, T, H, O]``, c pages ``[n, page_size, R]``, kpe pages ``[n,
page_size, O]``; GQA q ``[B, T, H, K]``, k pages ``[n, page_size, G, K]``, v pages ``[n, page_size, G, U]``;
q_pos ``[B, T]``.

On a mesh: query heads (and GQA kv heads, with their pages' head axis) split over ``heads``; the page pool and
the page table stay whole (every device holds every sequence's pages for its heads).

Implementations: ``"reference"`` (``reference.py``: gathers each sequence's pages, then the dense references) and
``"pallas"`` / ``"pallas_interpret"`` (``pallas.py``: reads the pool through the page table, page by page); on CPU
MLA's automatic choice is ``"xla_cpu"`` (``xla_cpu.py``: the gathered pages in the static cache's CPU form, 2.5x
faster than the reference at batch 8).
"""

from __future__ import annotations

from kernels_pallas._dispatch import PALLAS, REFERENCE, XLA_CPU, CpuImpl, Op, Rule
from kernels_pallas.paged_attention import pallas, reference, xla_cpu

MLA_RULE = Rule(args=("BTHR", "BTHO", "SSR", "SSO", "BS", "BT"), out="BTHR", split=(("H", "heads"),))
GQA_RULE = Rule(args=("BTHK", "SSGK", "SSGU", "BS", "BT"), out="BTHU", split=(("H", "heads"), ("G", "heads")))

# page sizes the GPU kernel cannot tile: the automatic choice runs the reference there, an explicit request raises
MLA_OP = Op("paged_mla_attention", MLA_RULE,
            {REFERENCE: reference.paged_mla_attention, PALLAS: pallas.paged_mla_attention},
            cpu=(CpuImpl(XLA_CPU, xla_cpu.paged_mla_attention),),
            pallas_unsupported=lambda platform, q_lat, q_pe, c_pages, *_, **__: pallas.unsupported(platform,
                                                                                                   c_pages.shape))
GQA_OP = Op("paged_attention", GQA_RULE, {REFERENCE: reference.paged_attention, PALLAS: pallas.paged_attention},
            pallas_unsupported=lambda platform, q, k_pages, *_, **__: pallas.unsupported(platform, k_pages.shape))


def paged_mla_attention(q_lat, q_pe, c_pages, kpe_pages, page_table, q_pos, *, scale, implementation=None,
                        placement=None):
    return MLA_OP(q_lat, q_pe, c_pages, kpe_pages, page_table, q_pos, scale=scale, implementation=implementation,
                  placement=placement)


def paged_attention(q, k_pages, v_pages, page_table, q_pos, *, scale, implementation=None, placement=None):
    return GQA_OP(q, k_pages, v_pages, page_table, q_pos, scale=scale, implementation=implementation,
                  placement=placement)
