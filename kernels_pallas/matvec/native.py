"""The grouped decode products as one native XLA:CPU call (``native.cc``): float32 or bfloat16 weights (one dtype
per call), float32 or bfloat16 inputs (widened to float32 before the call: M x I values), float32 sums and results."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from kernels_pallas import _native
from kernels_pallas.mxfp4 import MXFP4Weight

SOURCE = Path(__file__).with_name("native.cc")
SYMBOL = "KimiMatvecGroupF32"
SYMBOLS = {jnp.dtype(jnp.float32): SYMBOL, jnp.dtype(jnp.bfloat16): "KimiMatvecGroupBF16"}  # by weight dtype
_F32 = jnp.float32


def unsupported(items) -> str | None:
    """Why this kernel cannot run these items, or None when it can."""
    for x, w, ids in items:
        if isinstance(w, MXFP4Weight):
            return "MXFP4 weights (the native kernel takes float32 or bfloat16 weights)"
        if jnp.dtype(w.dtype) not in SYMBOLS or jnp.dtype(x.dtype) not in SYMBOLS:
            return (f"{jnp.dtype(w.dtype).name} weights / {jnp.dtype(x.dtype).name} inputs (the native kernel takes "
                    "float32 or bfloat16)")
        if jnp.dtype(w.dtype) != jnp.dtype(items[0][1].dtype):
            return "weights of different dtypes in one call (one kernel per weight dtype)"
        if x.ndim != 2 or w.ndim != (2 if ids is None else 3):
            return f"shapes x {x.shape}, w {w.shape}{'' if ids is None else ' with ids'} (x [M, I] with w [J, I], " \
                   f"or w [E, J, I] with ids [M])"
    return None


def group(items):
    """One native call for all items; raises :class:`~kernels_pallas._native.NativeUnavailable` when it cannot run
    these operands or cannot be built."""
    why = unsupported(items)
    if why is not None:
        raise _native.NativeUnavailable(f"matvec: {why}")
    target = _native.target(SOURCE, SYMBOLS[jnp.dtype(items[0][1].dtype)])
    operands, shapes = [], []
    for x, w, ids in items:
        M = x.shape[0]
        ids = jnp.zeros((M,), jnp.int32) if ids is None else ids.astype(jnp.int32)
        operands += [x.astype(_F32), w[None] if w.ndim == 2 else w, ids]
        shapes.append(jax.ShapeDtypeStruct((M, w.shape[-2]), _F32))
    return list(jax.ffi.ffi_call(target, shapes)(*operands))
