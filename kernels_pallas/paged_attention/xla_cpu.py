"""Paged attention in the form XLA:CPU runs fastest (``implementation="xla_cpu"``, its automatic choice on CPU).

The pages are gathered into the contiguous cache (one copy of the pages the table names, cheap beside the
attention) and the static-cache CPU forms run on it: :mod:`kernels_pallas.mla_decode.xla_cpu` for MLA, and for GQA
the reference's math (it has no tuned form).
"""

from __future__ import annotations

from kernels_pallas.mla_decode import xla_cpu as mla_cpu
from kernels_pallas.paged_attention.reference import gather


def paged_mla_attention(q_lat_BTHR, q_pe_BTHO, c_pages, kpe_pages, page_table, q_pos_BT, *, scale):
    return mla_cpu.mla_attention(q_lat_BTHR, q_pe_BTHO, gather(c_pages, page_table), gather(kpe_pages, page_table),
                                 q_pos_BT, scale=scale)
