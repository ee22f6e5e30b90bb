"""Absorbed MLA attention at decode as a native XLA:CPU kernel (``native.cc``): the cache read in place (float32 or
bfloat16), every query row's slots split over the threads. Same contract as
:func:`kernels_pallas.mla_decode.reference.mla_attention`; queries are cast to float32 as there."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import _native
from kernels_pallas.cache_quant import is_int8

KERNEL = _native.Kernel(Path(__file__).with_name("native.cc"))
SYMBOLS = {jnp.dtype(jnp.float32): "KimiMlaDecodeF32", jnp.dtype(jnp.bfloat16): "KimiMlaDecodeBF16"}
_F32 = jnp.float32


def unsupported(q_lat, q_pe, c, kpe, q_pos, **_) -> str | None:
    """Why the kernel cannot take these operands, or None."""
    if is_int8(c) or is_int8(kpe):
        return "an int8 cache (the kernel reads float32 or bfloat16 caches)"
    if jnp.dtype(c.dtype) not in SYMBOLS or jnp.dtype(kpe.dtype) != jnp.dtype(c.dtype):
        return f"a {jnp.dtype(c.dtype).name} / {jnp.dtype(kpe.dtype).name} cache (float32 or bfloat16, both alike)"
    return None


def mla_attention(q_lat_BTHR, q_pe_BTHO, c_BSR, kpe_BSO, q_pos_BT, *, scale, with_lse=False):
    """Returns u ``[B, T, H, R]`` float32, and with ``with_lse`` also the log-sum-exp ``[B, T, H]`` of the visible
    scores (a cache split over devices, ``kernels_pallas._dispatch.Rule.merge``); raises
    :class:`~kernels_pallas._native.NativeUnavailable` when the kernel cannot take the operands or cannot be built."""
    why = unsupported(q_lat_BTHR, q_pe_BTHO, c_BSR, kpe_BSO, q_pos_BT)
    if why is not None:
        raise _native.NativeUnavailable(f"mla_attention: {why}")
    target = KERNEL.target(SYMBOLS[jnp.dtype(c_BSR.dtype)])
    B, T, H, _ = q_lat_BTHR.shape
    out = (jax.ShapeDtypeStruct(q_lat_BTHR.shape, _F32), jax.ShapeDtypeStruct((B, T, H), _F32))
    u, lse = jax.ffi.ffi_call(target, out)(q_lat_BTHR.astype(_F32), q_pe_BTHO.astype(_F32), c_BSR, kpe_BSO,
                                           q_pos_BT.astype(jnp.int32), scale=np.float32(scale))
    return (u, lse) if with_lse else u
