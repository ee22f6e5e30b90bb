"""The grouped decode products as one native XLA:CPU call (``native.cc``): one weight format per call, float32
(``float32`` / ``bfloat16`` arrays) or packed (:mod:`kernels_pallas.quant`: int8, int4, int4 with a zero point, NF4;
:mod:`kernels_pallas.mxfp4`: MXFP4, its E8M0 scale bytes decoded in the kernel; each field read in place); float32
or bfloat16 inputs (widened to float32 before the call: M x I values), float32 sums and results."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from kernels_pallas import _native, packed, quant
from kernels_pallas.mxfp4 import MXFP4Weight

KERNEL = _native.Kernel(Path(__file__).with_name("native.cc"))
SYMBOL = "KimiMatvecGroupF32"
SYMBOLS = {jnp.dtype(jnp.float32): SYMBOL, jnp.dtype(jnp.bfloat16): "KimiMatvecGroupBF16"}  # by weight dtype
PACKED_SYMBOLS = {  # by packed weight type
    quant.Int8Weight: "KimiMatvecGroupI8",
    quant.Int4Weight: "KimiMatvecGroupI4",
    quant.Int4ZeroWeight: "KimiMatvecGroupI4Z",
    quant.NF4Weight: "KimiMatvecGroupNF4",
    MXFP4Weight: "KimiMatvecGroupMXFP4",
}
# The fields' dtypes as the kernel reads them: codes as stored; scales and zero points (one per row or group, a
# small fraction of the bytes) are cast to these before the call.
_CODES = {quant.Int8Weight: jnp.int8, quant.Int4Weight: jnp.uint8, quant.Int4ZeroWeight: jnp.uint8,
          quant.NF4Weight: jnp.uint8, MXFP4Weight: jnp.uint8}
_SIDE = (jnp.float32, jnp.int8)  # scale (or absmax), zero; MXFP4's scale bytes go as stored
NIBBLE_BLOCK = 32  # the 4-bit kernels take groups of a multiple of this many columns (16 bytes of codes)
_F32 = jnp.float32


def symbol(w) -> str:
    """The FFI handler for this weight's format."""
    return PACKED_SYMBOLS[type(w)] if packed.is_packed(w) else SYMBOLS[jnp.dtype(w.dtype)]


def _format(w) -> str:
    return packed.format_name(w)


def _kernel_key(w):
    """What selects the handler: the packed type, or the array's dtype."""
    return type(w) if packed.is_packed(w) else jnp.dtype(w.dtype)


def _why_not(x, w, ids) -> str | None:
    if jnp.dtype(x.dtype) not in SYMBOLS:
        return f"{jnp.dtype(x.dtype).name} inputs (the native kernel takes float32 or bfloat16 inputs)"
    if type(w) in PACKED_SYMBOLS:
        if jnp.dtype(w[0].dtype) != jnp.dtype(_CODES[type(w)]):
            return f"{_format(w)} codes stored as {jnp.dtype(w[0].dtype).name} (the native kernel reads " \
                   f"{jnp.dtype(_CODES[type(w)]).name})"
        if isinstance(w, MXFP4Weight):
            if jnp.dtype(w.scale.dtype) != jnp.dtype(jnp.uint8):
                return f"MXFP4 scales stored as {jnp.dtype(w.scale.dtype).name} (the native kernel reads uint8)"
        elif not isinstance(w, quant.Int8Weight) and w.group % NIBBLE_BLOCK:
            return f"{_format(w)}: groups of {w.group} columns (the native 4-bit kernels take multiples of " \
                   f"{NIBBLE_BLOCK})"
    elif packed.is_packed(w):
        return f"{type(w).__name__} weights (no native kernel for this format)"
    elif jnp.dtype(w.dtype) not in SYMBOLS:
        return (f"{jnp.dtype(w.dtype).name} weights / {jnp.dtype(x.dtype).name} inputs (the native kernel takes "
                "float32 or bfloat16 arrays, or int8 / int4 / NF4 / MXFP4 packed weights)")
    if x.ndim != 2 or len(w.shape) != (2 if ids is None else 3) or x.shape[-1] != w.shape[-1]:
        return f"shapes x {x.shape}, w {tuple(w.shape)}{'' if ids is None else ' with ids'} (x [M, I] with " \
               f"w [J, I], or w [E, J, I] with ids [M])"
    return None


def unsupported(items) -> str | None:
    """Why this kernel cannot run these items, or None when it can."""
    for x, w, ids in items:
        why = _why_not(x, w, ids)
        if why is not None:
            return why
        first = items[0][1]
        if _kernel_key(w) != _kernel_key(first):
            return f"weights of different dtypes in one call (one kernel per weight dtype or format): " \
                   f"{_format(first)} and {_format(w)}"
    return None


def _fields(w, plain: bool):
    """The weight's arrays as the kernel takes them, each with a leading expert dimension."""
    if not packed.is_packed(w):
        fields = [w]
    elif isinstance(w, MXFP4Weight):
        fields = [w.packed, w.scale]
    else:
        codes, *side = w
        fields = [codes, *(f.astype(dt) for f, dt in zip(side, _SIDE))]
    return [f[None] for f in fields] if plain else fields


def group(items):
    """One native call for all items; raises :class:`~kernels_pallas._native.NativeUnavailable` when it cannot run
    these operands or cannot be built."""
    why = unsupported(items)
    if why is not None:
        raise _native.NativeUnavailable(f"matvec: {why}")
    target = KERNEL.target(symbol(items[0][1]))
    operands, shapes = [], []
    for x, w, ids in items:
        M = x.shape[0]
        plain = ids is None
        ids = jnp.zeros((M,), jnp.int32) if plain else ids.astype(jnp.int32)
        operands += [x.astype(_F32), *_fields(w, plain), ids]
        shapes.append(jax.ShapeDtypeStruct((M, w.shape[-2]), _F32))
    return list(jax.ffi.ffi_call(target, shapes)(*operands))
