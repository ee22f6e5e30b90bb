"""Plain-jnp products: each item on its own (a chosen expert is gathered out of its stack first)."""

from __future__ import annotations

import jax.numpy as jnp

_F32 = jnp.float32


def product(x_SK, w, ids_S=None, *, precision=None):
    """``x @ w.T`` (``w [N, K]``) or ``x[s] @ w[ids[s]].T`` (``w [E, N, K]``) -> ``[S, N]`` float32."""
    if ids_S is None:
        return jnp.einsum("sk,nk->sn", x_SK, w, preferred_element_type=_F32, precision=precision)
    return jnp.einsum("sk,snk->sn", x_SK, w[ids_S], preferred_element_type=_F32, precision=precision)


def group(items, *, precision=None):
    return [product(x, w, ids, precision=precision) for x, w, ids in items]


def per_head(x_BTHI, w, *, transpose_w, precision=None):
    """``x_h @ w_h`` per head (``w [H, I, O]``), or ``x_h @ w_h.T`` with ``transpose_w`` (``w [H, O, I]``) ->
    ``[B, T, H, O]`` float32."""
    spec = "bthi,hoi->btho" if transpose_w else "bthi,hio->btho"
    return jnp.einsum(spec, x_BTHI, w, precision=precision, preferred_element_type=_F32)
