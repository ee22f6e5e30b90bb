"""The routed-expert paths in plain JAX over the expert-matmul ops (:mod:`kernels_pallas.moe_gmm`, which dispatch
their own kernels). Each returns ``[N, X, L]`` in ``compute_dtype``: token n's slot x through expert
``idx[n, x]``, ``w2(act(w1 z, w3 z))``. :func:`gather` is the obvious form and the oracle of the others."""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas import moe_gmm


def gather(z_NL, w, idx_NX, *, act, compute_dtype, implementation=None):
    """Each (token, expert) pair reads its expert's weights (decode-shaped)."""
    N, X = idx_NX.shape
    kw = dict(compute_dtype=compute_dtype, implementation=implementation)
    zx = jnp.broadcast_to(z_NL[:, None], (N, X, z_NL.shape[-1]))
    h = act(moe_gmm.gather_matmul(zx, w["w1"], idx_NX, **kw), moe_gmm.gather_matmul(zx, w["w3"], idx_NX, **kw))
    return moe_gmm.gather_matmul(h, w["w2"], idx_NX, **kw).astype(compute_dtype)


def sorted_groups(z_NL, w, idx_NX, *, act, compute_dtype, implementation=None):
    """The pairs sorted by expert into one grouped matmul per projection (prefill-shaped)."""
    X = idx_NX.shape[1]
    kw = dict(compute_dtype=compute_dtype, implementation=implementation)
    flat = idx_NX.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=w["w1"].shape[0]).astype(jnp.int32)
    xs = z_NL[order // X]  # [M, L] rows sorted by expert
    h = act(moe_gmm.gmm(xs, w["w1"], sizes, **kw), moe_gmm.gmm(xs, w["w3"], sizes, **kw))
    ys = moe_gmm.gmm(h, w["w2"], sizes, **kw).astype(compute_dtype)
    return jnp.zeros_like(ys).at[order].set(ys).reshape(*idx_NX.shape, -1)


def dense(z_NL, w, idx_NX, *, act, compute_dtype, precision=None, implementation=None):
    """Every expert on every token, each expert read once; each token's slots picked out after (float experts)."""
    N = idx_NX.shape[0]
    y = moe_gmm.dense_experts(z_NL.astype(compute_dtype), w["w1"], w["w3"], w["w2"], act=act,
                              compute_dtype=compute_dtype, precision=precision,
                              implementation=implementation)  # [E, N, L]
    return y[idx_NX, jnp.arange(N)[:, None]].astype(compute_dtype)
