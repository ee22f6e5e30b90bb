"""MoE expert matmuls in plain jnp: the oracle for the grouped-matmul kernels and the CPU path.

Weights are ``[E, N, K]`` (checkpoint layout ``[out, in]`` per expert), either a float array or an
:class:`~kernels_pallas.mxfp4.MXFP4Weight` that is decoded here (the kernels decode per tile instead).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.mxfp4 import MXFP4Weight, as_dense

_F32 = jnp.float32


def gmm(x_MK, w_ENK, group_sizes_E, *, compute_dtype=None):
    """Grouped matmul: rows of ``x`` are sorted by expert, ``group_sizes[e]`` rows use expert ``e``.

    Rows past ``sum(group_sizes)`` produce zeros. Returns ``[M, N]`` float32.
    """
    dt = compute_dtype or x_MK.dtype
    w = as_dense(w_ENK, dt)
    return jax.lax.ragged_dot(
        x_MK.astype(dt), jnp.swapaxes(w, 1, 2), group_sizes_E.astype(jnp.int32), preferred_element_type=_F32
    )


def gather_matmul(x_NXK, w_ENK, idx_NX, *, compute_dtype=None):
    """Decode-shaped expert matmul: token n's slot x uses expert ``idx[n, x]``. Returns ``[N, X, N_out]`` f32.

    Only the chosen experts' weights are read (and, for MXFP4, decoded): at small batch this is the
    bandwidth-optimal form.
    """
    dt = compute_dtype or x_NXK.dtype
    if isinstance(w_ENK, MXFP4Weight):
        w = as_dense(MXFP4Weight(w_ENK.packed[idx_NX], w_ENK.scale[idx_NX]), dt)
    else:
        w = w_ENK[idx_NX].astype(dt)
    return jnp.einsum("nxk,nxfk->nxf", x_NXK.astype(dt), w, preferred_element_type=_F32)
