"""Kimi Delta Attention: chunked prefill and recurrent decode.

Shapes: q, k ``[B, T, H, K]`` (L2-normalised), v ``[B, T, H, U]``, g ``[B, T, H, K]`` (log decay, <= 0),
beta ``[B, T, H]``, state ``[B, H, K, U]`` float32. Both functions return ``(o [B, T, H, U] float32, state)``.

``chunk_size`` is the chunk of the reference's chunked form (None: 64, or the recurrence where the automatic
choice prefers it, on CPU); the Pallas kernel tiles time with its own block
(:func:`kernels_pallas.kda.pallas.kda_chunked`), which changes only float32 rounding.
``implementation="recurrent"`` runs the token-by-token reference for prefill too.

On CPU the recurrence also has a native kernel (``native.cc``, ``implementation="cpu_native"``): the automatic
choice for decode and for prefill with ``chunk_size`` None or 1 (the recurrence) when it builds
(``kernels_pallas/_native.py``), else ``"xla_cpu"`` (the plain-jnp recurrence, ~20x faster than the chunked form
on XLA:CPU); ``implementation="reference"`` runs the plain-jnp chunked form.

On a mesh: sequences split over ``batch`` and heads over ``heads`` (each head's recurrence is independent).
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
    target_platform,
)
from kernels_pallas.kda import native, pallas, reference

RULE = Rule(args=("BTHK", "BTHK", "BTHU", "BTHK", "BTH", "BHKU"), out=("BTHU", "BHKU"),
            split=(("B", "batch"), ("H", "heads")))


def _native_kernel(automatic):
    fn = lambda q, k, v, g, beta, state, *, scale, **_: native.kda_recurrent(q, k, v, g, beta, state, scale=scale)
    return CpuImpl(NATIVE, fn, ready=native.KERNEL.ready, automatic=automatic)


def _chunked(q, k, v, g, beta, state, *, scale, chunk_size):
    # No chunk asked for on CPU: the recurrence, the faster form there (see _RECURRENCE); training, which runs the
    # references, differentiates it.
    if chunk_size is None and target_platform() == "cpu":
        return _recurrent(q, k, v, g, beta, state, scale=scale)
    return reference.kda_chunked(q, k, v, g, beta, state, scale=scale, chunk_size=chunk_size or 64)


def _recurrent(q, k, v, g, beta, state, *, scale, chunk_size=None):
    return reference.kda_recurrent(q, k, v, g, beta, state, scale=scale)


def _pallas_chunked(q, k, v, g, beta, state, *, scale, chunk_size, platform, interpret):
    return pallas.kda_chunked(q, k, v, g, beta, state, scale=scale, platform=platform, interpret=interpret)


# On XLA:CPU the recurrence beats the chunked form ~20x at 512 tokens (the chunk's [C, C, K] decay tensors
# dominate) and compiles ~6x faster: with no chunk asked for (or chunk 1), CPU prefill runs the recurrence, the
# reference's included (its gradient: 3.8 s against 27.6 s for chunks of 64, [8, 256] tokens through 8 KDA layers).
_RECURRENCE = lambda *args, chunk_size, **_: chunk_size in (None, 1)
PREFILL = Op("kda_prefill", RULE, {REFERENCE: _chunked, "recurrent": _recurrent, PALLAS: _pallas_chunked},
             cpu=(_native_kernel(automatic=_RECURRENCE), CpuImpl(XLA_CPU, _recurrent, automatic=_RECURRENCE)))
DECODE = Op("kda_decode", RULE, {REFERENCE: _recurrent, PALLAS: pallas.kda_recurrent},
            cpu=(_native_kernel(automatic=lambda *args, **_: True),))


def kda_prefill(q, k, v, g, beta, state=None, *, scale, chunk_size=None, implementation=None, placement=None):
    return PREFILL(q, k, v, g, beta, state, scale=scale, chunk_size=chunk_size, implementation=implementation,
                   placement=placement)


def kda_decode(q, k, v, g, beta, state, *, scale, implementation=None, placement=None):
    return DECODE(q, k, v, g, beta, state, scale=scale, implementation=implementation, placement=placement)

