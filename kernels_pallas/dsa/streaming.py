"""Kimi K3.1's DSA selection with the indexer keys streamed in blocks: the form every platform runs for long
contexts, in plain XLA.

The reference (``reference.py``) scores a query against every key at once, ``[B, T, S]`` float32 in memory: at a
prefill chunk of 2,048 queries over a 128K-token context that is 1 GiB per sequence before ``top_k`` copies it. Here
the keys come ``key_block`` at a time (a static cache's rows, or whole pages through the page table); each block's
scores ``[B, T, key_block]`` join the best ``X`` kept so far and ``lax.top_k`` keeps the best ``X`` of the two, so
memory is ``[B, T, key_block + X]`` whatever ``S`` is.

Same selection as the reference, position for position: each block's scores are the reference's
(:func:`kernels_pallas.dsa.reference.index_scores` on the block, with the query positions shifted by its first
key), and ties go to the later key because the candidates stand in descending position order -- the block
reversed, then the kept ones (all earlier, already in descending order among equal scores) -- and ``lax.top_k``
puts the lower index first among equals. The result lists the chosen positions by score, then position,
descending, as the reference does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas._common import acc_dtype
from kernels_pallas.dsa.reference import index_scores

KEY_BLOCK = 2048  # keys per step: [B, T, KEY_BLOCK + X] float32 live


def _stream(q_BTHK, w_BTH, keys_at, n_blocks: int, block: int, S: int, q_pos_BT, topk: int, scores):
    """The selection over ``n_blocks`` key blocks of ``block`` positions, block ``j`` being ``keys_at(j)`` ``[B,
    block, K]`` at positions ``j * block + i`` (those at ``S`` or beyond: none), scored by ``scores`` (the
    reference's :func:`~kernels_pallas.dsa.reference.index_scores` or a kernel of its signature)."""
    B, T = q_pos_BT.shape
    X = min(int(topk), S)
    down = jnp.arange(block - 1, -1, -1)  # a block's positions, last first

    def step(j, kept):
        vals, pos = kept
        first = j * block
        s = scores(q_BTHK, w_BTH, keys_at(j), q_pos_BT - first)[..., ::-1]  # [B, T, block], last key first
        at = jnp.broadcast_to(first + down, s.shape)
        s = jnp.where(at < S, s, -jnp.inf)
        cand_v, cand_p = jnp.concatenate([s, vals], -1), jnp.concatenate([at, pos], -1)
        vals, i = jax.lax.top_k(cand_v, X)
        return vals, jnp.take_along_axis(cand_p, i, axis=-1)

    kept = (jnp.full((B, T, X), -jnp.inf, acc_dtype(q_BTHK, w_BTH)), jnp.full((B, T, X), -1, jnp.int32))
    vals, pos = jax.lax.fori_loop(0, n_blocks, step, kept)
    return jnp.where(vals > -jnp.inf, pos, -1).astype(jnp.int32)


def select(q_BTHK, w_BTH, k_BSK, q_pos_BT, *, topk, key_block=KEY_BLOCK, scores=index_scores):
    """:func:`kernels_pallas.dsa.reference.select`, streaming the keys ``key_block`` rows at a time."""
    S = jax.tree.leaves(k_BSK)[0].shape[1]
    block = min(int(key_block), S)
    n = -(-S // block)
    pad = lambda a: jnp.pad(a, [(0, 0), (0, n * block - S)] + [(0, 0)] * (a.ndim - 2))
    k = jax.tree.map(pad, k_BSK)
    rows = lambda j: jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, j * block, block, axis=1), k)
    return _stream(q_BTHK, w_BTH, rows, n, block, S, q_pos_BT, topk, scores)


def paged_select(q_BTHK, w_BTH, k_pages, page_table, q_pos_BT, *, topk, key_block=KEY_BLOCK, scores=index_scores):
    """:func:`select` over indexer keys in pages ``[n_pages, page_size, K]``: whole pages at a time, gathered through
    ``page_table [B, pages_per_seq]`` (a block of at least one page)."""
    page_size = jax.tree.leaves(k_pages)[0].shape[1]
    B, P = page_table.shape
    per = max(1, min(int(key_block) // page_size, P))
    n = -(-P // per)
    table = jnp.pad(page_table, [(0, 0), (0, n * per - P)])  # padded entries read page 0, beyond S: never chosen

    def pages(j):
        ids = jax.lax.dynamic_slice_in_dim(table, j * per, per, axis=1)  # [B, per]
        return jax.tree.map(lambda a: a[ids].reshape(B, per * page_size, *a.shape[2:]), k_pages)

    return _stream(q_BTHK, w_BTH, pages, n, per * page_size, P * page_size, q_pos_BT, topk, scores)
