"""Plain-jnp decode products: each item on its own (a chosen expert is gathered out of its stack first)."""

from __future__ import annotations

import jax.numpy as jnp

_F32 = jnp.float32


def group(items, *, precision=None):
    out = []
    for x, w, ids in items:
        if ids is None:
            out.append(jnp.einsum("sk,nk->sn", x, w, preferred_element_type=_F32, precision=precision))
        else:
            out.append(jnp.einsum("sk,snk->sn", x, w[ids], preferred_element_type=_F32, precision=precision))
    return out
