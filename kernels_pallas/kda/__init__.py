"""Kimi Delta Attention: chunked prefill and recurrent decode.

Shapes: q, k ``[B, T, H, K]`` (L2-normalised), v ``[B, T, H, U]``, g ``[B, T, H, K]`` (log decay, <= 0),
beta ``[B, T, H]``, state ``[B, H, K, U]`` float32. Both functions return ``(o [B, T, H, U] float32, state)``.

``chunk_size`` is the chunk of the plain-jnp prefill: 1 runs the token-by-token recurrence
(``reference.kda_recurrent``), any other the chunked form. Left None it is the target's default: 1 on CPU (where
the recurrence beats the chunked form ~20x at 512 tokens, the chunk's ``[C, C, K]`` decay tensors dominating, and
compiles ~6x faster; training differentiates it: 3.8 s against 27.6 s for chunks of 64), else 64. The Pallas
kernel tiles time with its own block (:func:`kernels_pallas.kda.pallas.kda_chunked`), which changes only float32
rounding. ``implementation="recurrent"`` runs the recurrence whatever the chunk.

CPU forms of the recurrence: the native kernel (``native.cc``) and the plain-jnp recurrence (``"xla_cpu"``), the
automatic choice for decode and for a prefill whose chunk is 1. On a mesh: sequences split over ``batch`` and heads
over ``heads`` (each head's recurrence is independent).
"""

from __future__ import annotations

from kernels_pallas._dispatch import (
    NATIVE,
    PALLAS,
    REFERENCE,
    XLA_CPU,
    CpuImpl,
    Op,
    Rule,
)
from kernels_pallas.kda import native, pallas, reference

RULE = Rule(args=("BTHK", "BTHK", "BTHU", "BTHK", "BTH", "BHKU"), out=("BTHU", "BHKU"),
            split=(("B", "batch"), ("H", "heads")))


def _native_kernel(automatic):
    fn = lambda q, k, v, g, beta, state, *, scale, **_: native.kda_recurrent(q, k, v, g, beta, state, scale=scale)
    return CpuImpl(NATIVE, fn, unsupported=native.unsupported, ready=native.KERNEL.ready, automatic=automatic)


def _chunked(q, k, v, g, beta, state, *, scale, chunk_size):
    if chunk_size == 1:
        return reference.kda_recurrent(q, k, v, g, beta, state, scale=scale)
    return reference.kda_chunked(q, k, v, g, beta, state, scale=scale, chunk_size=chunk_size)


def _recurrent(q, k, v, g, beta, state, *, scale, chunk_size=None):
    return reference.kda_recurrent(q, k, v, g, beta, state, scale=scale)


def _pallas_chunked(q, k, v, g, beta, state, *, scale, chunk_size, platform, interpret):
    return pallas.kda_chunked(q, k, v, g, beta, state, scale=scale, platform=platform, interpret=interpret)


_RECURRENCE = lambda *args, chunk_size, **_: chunk_size == 1
PREFILL = Op("kda_prefill", RULE, {REFERENCE: _chunked, "recurrent": _recurrent, PALLAS: _pallas_chunked},
             defaults={"chunk_size": {"cpu": 1, None: 64}},
             cpu=(_native_kernel(automatic=_RECURRENCE), CpuImpl(XLA_CPU, _recurrent, automatic=_RECURRENCE)))
DECODE = Op("kda_decode", RULE, {REFERENCE: _recurrent, PALLAS: pallas.kda_recurrent},
            cpu=(_native_kernel(automatic=lambda *args, **_: True),))


def kda_prefill(q, k, v, g, beta, state=None, *, scale, chunk_size=None, implementation=None, placement=None):
    return PREFILL(q, k, v, g, beta, state, scale=scale, chunk_size=chunk_size, implementation=implementation,
                   placement=placement)


def kda_decode(q, k, v, g, beta, state, *, scale, implementation=None, placement=None):
    return DECODE(q, k, v, g, beta, state, scale=scale, implementation=implementation, placement=placement)

