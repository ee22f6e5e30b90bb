"""Decode-shaped expert matmul on XLA:CPU as a native kernel (``native.cc``), float32 weights only.

Same contract as :func:`kernels_pallas.moe_gmm.reference.gather_matmul`; the chosen experts' weights are read in
place instead of copied out of the stacked array first (see ``kernels_pallas/_native.py``).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from kernels_pallas import _native
from kernels_pallas.mxfp4 import MXFP4Weight

SOURCE = Path(__file__).with_name("native.cc")
SYMBOL = "KimiGatherMatvecF32"
_F32 = jnp.float32


def unsupported(x_NXK, w_ENK, compute_dtype) -> str | None:
    """Why this kernel cannot run these operands, or None when it can."""
    if isinstance(w_ENK, MXFP4Weight):
        return "MXFP4 expert weights (the native kernel takes float32 weights)"
    if jnp.dtype(w_ENK.dtype) != _F32 or jnp.dtype(compute_dtype or x_NXK.dtype) != _F32:
        return f"{jnp.dtype(w_ENK.dtype).name} weights / {jnp.dtype(compute_dtype or x_NXK.dtype).name} compute " \
               f"(the native kernel runs float32)"
    return None


def gather_matmul(x_NXK, w_ENK, idx_NX, *, compute_dtype=None):
    """``out[n, x] = w[idx[n, x]] @ x[n, x]`` -> ``[N, X, N_out]`` float32. Builds the kernel on first use; raises
    :class:`~kernels_pallas._native.NativeUnavailable` when it cannot run these operands or cannot be built."""
    why = unsupported(x_NXK, w_ENK, compute_dtype)
    if why is not None:
        raise _native.NativeUnavailable(f"moe gather_matmul: {why}")
    target = _native.target(SOURCE, SYMBOL)
    N, X, K = x_NXK.shape
    out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((N * X, w_ENK.shape[1]), _F32))(
        x_NXK.reshape(N * X, K).astype(_F32), w_ENK, idx_NX.reshape(N * X).astype(jnp.int32))
    return out.reshape(N, X, -1)
