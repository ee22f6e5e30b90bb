"""MLA absorbed attention over the latent cache (latent R + shared decoupled key part O per token).

Shapes: q_lat ``[B, T, H, R]``, q_pe ``[B, T, H, O]``, c ``[B, S, R]``, kpe ``[B, S, O]``, q_pos ``[B, T]``.
Returns u ``[B, T, H, R]`` float32 (still in latent space).
"""

from __future__ import annotations

from kernels_pallas._dispatch import INTERPRET, PALLAS, pallas_platform, resolve
from kernels_pallas.mla_decode import pallas, reference

_IMPLS = {"reference": reference.mla_attention, PALLAS: pallas.mla_attention, INTERPRET: pallas.mla_attention}


def mla_attention(q_lat, q_pe, c, kpe, q_pos, *, scale, implementation=None):
    impl = resolve("mla_attention", implementation, _IMPLS, accelerated=(PALLAS,))
    kw = {}
    if impl in (PALLAS, INTERPRET):
        platform, interpret = pallas_platform(impl)
        kw = dict(platform=platform, interpret=interpret)
    return _IMPLS[impl](q_lat, q_pe, c, kpe, q_pos, scale=scale, **kw)
