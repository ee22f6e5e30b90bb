"""Kimi Delta Attention: chunked prefill and recurrent decode.

Shapes: q, k ``[B, T, H, K]`` (L2-normalised), v ``[B, T, H, V]``, g ``[B, T, H, K]`` (log decay, <= 0),
beta ``[B, T, H]``, state ``[B, H, K, V]`` float32. Both functions return ``(o [B, T, H, V] float32, state)``.

``chunk_size`` is the chunk of the reference's chunked form; the Pallas kernel tiles time with its own block
(:func:`kernels_pallas.kda.pallas.kda_chunked`), which changes only float32 rounding.
``implementation="recurrent"`` runs the token-by-token reference for prefill too.
"""

from __future__ import annotations

from kernels_pallas._dispatch import INTERPRET, PALLAS, pallas_platform, resolve
from kernels_pallas.kda import pallas, reference

_PREFILL = {"reference": reference.kda_chunked, "recurrent": reference.kda_recurrent, PALLAS: pallas.kda_chunked,
            INTERPRET: pallas.kda_chunked}
_DECODE = {"reference": reference.kda_recurrent, PALLAS: pallas.kda_recurrent, INTERPRET: pallas.kda_recurrent}


def _kernel_kw(impl):
    platform, interpret = pallas_platform(impl)
    return dict(platform=platform, interpret=interpret)


def kda_prefill(q, k, v, g, beta, state=None, *, scale, chunk_size=64, implementation=None):
    impl = resolve("kda_prefill", implementation, _PREFILL, accelerated=(PALLAS,))
    if impl == "recurrent":
        return reference.kda_recurrent(q, k, v, g, beta, state, scale=scale)
    if impl in (PALLAS, INTERPRET):
        return pallas.kda_chunked(q, k, v, g, beta, state, scale=scale, **_kernel_kw(impl))
    return reference.kda_chunked(q, k, v, g, beta, state, scale=scale, chunk_size=chunk_size)


def kda_decode(q, k, v, g, beta, state, *, scale, implementation=None):
    impl = resolve("kda_decode", implementation, _DECODE, accelerated=(PALLAS,))
    kw = _kernel_kw(impl) if impl in (PALLAS, INTERPRET) else {}
    return _DECODE[impl](q, k, v, g, beta, state, scale=scale, **kw)
