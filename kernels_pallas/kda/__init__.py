"""Kimi Delta Attention: chunked prefill and recurrent decode.

Shapes: q, k ``[B, T, H, K]`` (L2-normalised), v ``[B, T, H, V]``, g ``[B, T, H, K]`` (log decay, <= 0),
beta ``[B, T, H]``, state ``[B, H, K, V]`` float32. Both functions return ``(o [B, T, H, V] float32, state)``.
"""

from __future__ import annotations

from kernels_pallas._dispatch import resolve
from kernels_pallas.kda import reference

_PREFILL = {"reference": reference.kda_chunked, "recurrent": reference.kda_recurrent}
_DECODE = {"reference": reference.kda_recurrent}


def kda_prefill(q, k, v, g, beta, state=None, *, scale, chunk_size=64, implementation=None):
    impl = resolve("kda_prefill", implementation, _PREFILL, accelerated=("pallas",))
    if impl == "recurrent":
        return reference.kda_recurrent(q, k, v, g, beta, state, scale=scale)
    return _PREFILL[impl](q, k, v, g, beta, state, scale=scale, chunk_size=chunk_size)


def kda_decode(q, k, v, g, beta, state, *, scale, implementation=None):
    impl = resolve("kda_decode", implementation, _DECODE, accelerated=("pallas",))
    return _DECODE[impl](q, k, v, g, beta, state, scale=scale)
