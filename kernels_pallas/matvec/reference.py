"""Plain-jnp products: each item on its own (a chosen expert is gathered out of its stack first)."""

from __future__ import annotations

import jax.numpy as jnp

_F32 = jnp.float32


def product(x_MI, w, ids_M=None, *, precision=None):
    """``x @ w.T`` (``w [J, I]``) or ``x[m] @ w[ids[m]].T`` (``w [E, J, I]``) -> ``[M, J]`` float32."""
    if ids_M is None:
        return jnp.einsum("mi,ji->mj", x_MI, w, preferred_element_type=_F32, precision=precision)
    return jnp.einsum("mi,mji->mj", x_MI, w[ids_M], preferred_element_type=_F32, precision=precision)


def group(items, *, precision=None):
    return [product(x, w, ids, precision=precision) for x, w, ids in items]


def per_head(x_BTHI, w, *, transpose_w, precision=None):
    """``x_h @ w_h`` per head (``w [H, I, J]``), or ``x_h @ w_h.T`` with ``transpose_w`` (``w [H, J, I]``) ->
    ``[B, T, H, J]`` float32."""
    spec = "bthi,hji->bthj" if transpose_w else "bthi,hij->bthj"
    return jnp.einsum(spec, x_BTHI, w, precision=precision, preferred_element_type=_F32)
