"""K3.1's DSA selection with the index scores in Pallas: the streaming form (``streaming.py``: keys in blocks, a
running ``lax.top_k``) whose per-block scores come from one kernel instead of XLA's products.

The kernel scores a block of queries against a block of keys for every indexer head at once: per head one
``[tq, K] x [K, bs]`` product in float32, its ReLU weighted by the head's weight and summed into a ``[tq, bs]``
accumulator, so neither the per-head scores nor float32 copies of the keys are ever written out; keys beyond a
query's position come out ``-inf``. The queries arrive head-major (``[B, H, T, K]``, one transpose in XLA) so each
head's rows are a plain block on both backends. Grid (sequence, query block, key block), all parallel; GPU (Triton)
blocks of 16-64 queries x 64-128 keys (powers of two), TPU (Mosaic) 8-128 queries x 128-512 keys.

The top-k stays XLA's (``lax.top_k`` over the block's scores and the best kept so far, as in the streaming form): the
selection is the reference's position for position wherever the scores agree bit for bit (integer-valued tests);
in bfloat16 the kernel's products may round apart from XLA's and flip a near tie at the top-k boundary.
int8 keys are not taken (``unsupported``; the streaming form reads them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas._common import F32, compiler_params, dot_nt, next_pow2, pad_axis, precision_for, round_up
from kernels_pallas.cache_quant import is_int8
from kernels_pallas.dsa import streaming


def unsupported(k) -> str | None:
    if is_int8(k):
        return "int8 indexer keys (the streaming form reads them)"
    return None


def _blocks(T: int, S: int, platform: str) -> tuple[int, int]:
    """(queries, keys) per program."""
    if platform == "tpu":
        return min(128, round_up(T, 8)), min(512, round_up(S, 128))
    return min(64, max(16, next_pow2(T))), min(128, max(64, next_pow2(S)))


def _kernel(qpos_ref, q_ref, w_ref, k_ref, o_ref, *, heads: int, bs: int, precision):
    """One (sequence, query block, key block): ``o [tq, bs] = sum_h w_h ReLU(q_h k^T)``, ``-inf`` past each query's
    position (``qpos``: relative to the block's first key)."""
    kb = k_ref[0]  # [bs, K]

    def head(h, acc):
        s = dot_nt(q_ref[0, h].astype(kb.dtype), kb, precision)  # [tq, bs] float32
        return acc + w_ref[0, h] * jnp.maximum(s, 0.0)

    acc = jax.lax.fori_loop(0, heads, head, jnp.zeros(o_ref.shape[1:], F32))
    pos = pl.program_id(2) * bs + jax.lax.broadcasted_iota(jnp.int32, acc.shape, 1)
    o_ref[0] = jnp.where(pos <= qpos_ref[0], acc, -jnp.inf)


def block_scores(q_BTHK, w_BTH, k_BSK, q_pos_BT, *, platform: str = "gpu", interpret: bool = False):
    """:func:`kernels_pallas.dsa.reference.index_scores` by the kernel: ``[B, T, S]`` float32."""
    B, T, H, K = q_BTHK.shape
    S = k_BSK.shape[1]
    tq, bs = _blocks(T, S, platform)
    Tp, Sp = round_up(T, tq), round_up(S, bs)
    q = pad_axis(jnp.transpose(q_BTHK, (0, 2, 1, 3)), 2, Tp)  # [B, H, Tp, K]
    w = pad_axis(jnp.transpose(w_BTH.astype(F32), (0, 2, 1)), 2, Tp)[..., None]  # [B, H, Tp, 1]
    qpos = pad_axis(q_pos_BT.astype(jnp.int32), 1, Tp, value=-1)[..., None]  # [B, Tp, 1]; padding sees nothing
    k = pad_axis(k_BSK, 1, Sp)
    kernel = functools.partial(_kernel, heads=H, bs=bs, precision=precision_for(k.dtype))
    out = pl.pallas_call(
        kernel, grid=(B, Tp // tq, Sp // bs), interpret=interpret, name="dsa_index_scores",
        in_specs=[pl.BlockSpec((1, tq, 1), lambda b, i, j: (b, i, 0)),
                  pl.BlockSpec((1, H, tq, K), lambda b, i, j: (b, 0, i, 0)),
                  pl.BlockSpec((1, H, tq, 1), lambda b, i, j: (b, 0, i, 0)),
                  pl.BlockSpec((1, bs, K), lambda b, i, j: (b, j, 0))],
        out_specs=pl.BlockSpec((1, tq, bs), lambda b, i, j: (b, i, j)),
        out_shape=jax.ShapeDtypeStruct((B, Tp, Sp), F32),
        compiler_params=compiler_params(platform, interpret, num_warps=4,
                                        semantics=("parallel", "parallel", "parallel")),
    )(qpos, q, w, k)
    return out[:, :T, :S]


def select(q_BTHK, w_BTH, k_BSK, q_pos_BT, *, topk, platform="gpu", interpret=False, key_block=None):
    """:func:`kernels_pallas.dsa.streaming.select` with :func:`block_scores`."""
    scores = functools.partial(block_scores, platform=platform, interpret=interpret)
    return streaming.select(q_BTHK, w_BTH, k_BSK, q_pos_BT, topk=topk, key_block=key_block or streaming.KEY_BLOCK,
                            scores=scores)


def paged_select(q_BTHK, w_BTH, k_pages, page_table, q_pos_BT, *, topk, platform="gpu", interpret=False,
                 key_block=None):
    """:func:`kernels_pallas.dsa.streaming.paged_select` with :func:`block_scores`."""
    scores = functools.partial(block_scores, platform=platform, interpret=interpret)
    return streaming.paged_select(q_BTHK, w_BTH, k_pages, page_table, q_pos_BT, topk=topk,
                                  key_block=key_block or streaming.KEY_BLOCK, scores=scores)

