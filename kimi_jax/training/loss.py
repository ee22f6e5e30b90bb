"""Causal-LM cross-entropy in float32, chunked over the vocabulary.

The lm_head product is never materialised as ``[N, V]``: a ``lax.scan`` over vocabulary chunks keeps a running
max, a running sum of exponentials and the target logit (an online logsumexp), and each chunk is rematerialised
in the backward pass (``jax.checkpoint`` on the scan body), so the activations the loss holds are ``[N, chunk]``
whatever ``V`` is. Each chunk's logits are computed exactly as the model's head computes them (the run dtype's
product rounded, then float32), so the loss equals the cross-entropy of ``model(ids).logits``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kimi_jax.model.layers import F32, linear
from kimi_jax.model.run import RunConfig


def token_nll(h_ND, head_VD, targets_N, run: RunConfig, chunk: int = 4096):
    """``-log softmax(h @ head.T)[target]`` per row, float32 ``[N]``; ``head`` ``[V, D]`` in checkpoint layout."""
    V, D = head_VD.shape
    chunk = min(chunk, V)
    n = -(-V // chunk)
    pad = n * chunk - V
    head = jnp.pad(head_VD, ((0, pad), (0, 0))) if pad else head_VD
    targets = targets_N.astype(jnp.int32)
    N = h_ND.shape[0]

    @jax.checkpoint
    def body(carry, xs):
        top, total, picked = carry
        w_CD, k = xs
        z = linear(h_ND, w_CD, run).astype(F32)  # [N, chunk], as the model's head rounds it
        cols = k * chunk + jnp.arange(chunk)
        z = jnp.where(cols[None] < V, z, -jnp.inf)  # padding rows of the last chunk
        new_top = jnp.maximum(top, jnp.max(z, axis=-1))
        total = total * jnp.exp(top - new_top) + jnp.sum(jnp.exp(z - new_top[:, None]), axis=-1)
        picked = picked + jnp.sum(jnp.where(cols[None] == targets[:, None], z, 0.0), axis=-1)
        return (new_top, total, picked), None

    init = (jnp.full((N,), -jnp.inf, F32), jnp.zeros((N,), F32), jnp.zeros((N,), F32))
    (top, total, picked), _ = jax.lax.scan(body, init, (head.reshape(n, chunk, D), jnp.arange(n)))
    return top + jnp.log(total) - picked


def causal_lm_loss(h_BTD, head_VD, ids_BT, mask_BT, run: RunConfig, chunk: int = 4096):
    """Mean next-token cross-entropy: position ``t`` predicts ``ids[t + 1]``, counted where ``mask[t + 1]`` (padding
    and anything else masked out never counts). Returns (loss, number of counted tokens)."""
    B, T, D = h_BTD.shape
    nll = token_nll(h_BTD[:, :-1].reshape(-1, D), head_VD, ids_BT[:, 1:].reshape(-1), run, chunk)
    w = mask_BT[:, 1:].reshape(-1).astype(F32)
    count = jnp.sum(w)
    return jnp.sum(nll * w) / jnp.maximum(count, 1.0), count
