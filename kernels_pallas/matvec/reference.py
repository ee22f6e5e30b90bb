"""Plain-jnp products: each item on its own (a chosen expert is gathered out of its stack first). A packed weight
(:mod:`kernels_pallas.packed`) is decoded to the input's dtype first (``packed.as_dense``, the kernels' oracle):
for an expert stack only the chosen experts' fields are gathered and decoded. "float32" results: float64 where an
operand is float64 (:func:`kernels_pallas._common.acc_dtype`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import packed
from kernels_pallas._common import acc_dtype


def _chosen(w, ids_M):
    """``w[ids]``: the chosen experts ``[M, J, I]`` (a packed stack: each field gathered, then decoded)."""
    return jax.tree.map(lambda f: f[ids_M], w) if packed.is_packed(w) else w[ids_M]


def _dense(w, dtype):
    """A float weight as it is (the einsum promotes); a packed one decoded to ``dtype``."""
    return packed.as_dense(w, dtype) if packed.is_packed(w) else w


def product(x_MI, w, ids_M=None, *, precision=None):
    """``x @ w.T`` (``w [J, I]``) or ``x[m] @ w[ids[m]].T`` (``w [E, J, I]``) -> ``[M, J]`` float32."""
    dt = acc_dtype(x_MI, w)
    if ids_M is None:
        return jnp.einsum("mi,ji->mj", x_MI, _dense(w, x_MI.dtype), preferred_element_type=dt, precision=precision)
    return jnp.einsum("mi,mji->mj", x_MI, _dense(_chosen(w, ids_M), x_MI.dtype), preferred_element_type=dt,
                      precision=precision)


def group(items, *, precision=None):
    return [product(x, w, ids, precision=precision) for x, w, ids in items]


def per_head(x_BTHI, w, *, transpose_w, precision=None):
    """``x_h @ w_h`` per head (``w [H, I, J]``), or ``x_h @ w_h.T`` with ``transpose_w`` (``w [H, J, I]``) ->
    ``[B, T, H, J]`` float32."""
    spec = "bthi,hji->bthj" if transpose_w else "bthi,hij->bthj"
    return jnp.einsum(spec, x_BTHI, w, precision=precision, preferred_element_type=acc_dtype(x_BTHI, w))
