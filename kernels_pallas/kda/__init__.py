"""Kimi Delta Attention: chunked prefill and recurrent decode.

Shapes: q, k ``[B, T, H, K]`` (L2-normalised), v ``[B, T, H, V]``, g ``[B, T, H, K]`` (log decay, <= 0),
beta ``[B, T, H]``, state ``[B, H, K, V]`` float32. Both functions return ``(o [B, T, H, V] float32, state)``.

``chunk_size`` is the chunk of the reference's chunked form; the Pallas kernel tiles time with its own block
(:func:`kernels_pallas.kda.pallas.kda_chunked`), which changes only float32 rounding.
``implementation="recurrent"`` runs the token-by-token reference for prefill too.

On CPU the recurrence also has a native kernel (``native.cc``, ``implementation="cpu_native"``): the automatic
choice for decode and for prefill with ``chunk_size=1`` (the CPU default) when it builds
(``kernels_pallas/_native.py``); ``implementation="reference"`` keeps the plain-jnp form.
"""

from __future__ import annotations

from kernels_pallas import _native
from kernels_pallas._dispatch import INTERPRET, NATIVE, PALLAS, KernelUnavailable, pallas_platform, resolve, \
    target_platform
from kernels_pallas.kda import native, pallas, reference

_PREFILL = {"reference": reference.kda_chunked, "recurrent": reference.kda_recurrent, PALLAS: pallas.kda_chunked,
            INTERPRET: pallas.kda_chunked}
_DECODE = {"reference": reference.kda_recurrent, PALLAS: pallas.kda_recurrent, INTERPRET: pallas.kda_recurrent}


def _kernel_kw(impl):
    platform, interpret = pallas_platform(impl)
    return dict(platform=platform, interpret=interpret)


def native_ready() -> bool:
    """Whether the automatic choice of the recurrence is the native kernel here (on CPU, built, not turned off)."""
    return target_platform() == "cpu" and _native.try_target(native.SOURCE, native.SYMBOL) is not None


def _use_native(op, implementation, automatic: bool) -> bool:
    """Run the native recurrence? Explicitly asked (raises off CPU), or the automatic choice where it applies."""
    if implementation == NATIVE:
        if target_platform() != "cpu":
            raise KernelUnavailable(f"{op}: implementation={NATIVE!r} runs on CPU only, not on {target_platform()!r}")
        return True
    return implementation is None and automatic and native_ready()


def kda_prefill(q, k, v, g, beta, state=None, *, scale, chunk_size=64, implementation=None):
    if _use_native("kda_prefill", implementation, automatic=chunk_size == 1):
        return native.kda_recurrent(q, k, v, g, beta, state, scale=scale)
    impl = resolve("kda_prefill", implementation, _PREFILL, accelerated=(PALLAS,))
    if impl == "recurrent":
        return reference.kda_recurrent(q, k, v, g, beta, state, scale=scale)
    if impl in (PALLAS, INTERPRET):
        return pallas.kda_chunked(q, k, v, g, beta, state, scale=scale, **_kernel_kw(impl))
    return reference.kda_chunked(q, k, v, g, beta, state, scale=scale, chunk_size=chunk_size)


def kda_decode(q, k, v, g, beta, state, *, scale, implementation=None):
    if _use_native("kda_decode", implementation, automatic=True):
        return native.kda_recurrent(q, k, v, g, beta, state, scale=scale)
    impl = resolve("kda_decode", implementation, _DECODE, accelerated=(PALLAS,))
    kw = _kernel_kw(impl) if impl in (PALLAS, INTERPRET) else {}
    return _DECODE[impl](q, k, v, g, beta, state, scale=scale, **kw)
