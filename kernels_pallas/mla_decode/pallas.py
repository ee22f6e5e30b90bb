"""Absorbed MLA attention over the latent cache, in Pallas: the flash kernel of ``kernels_pallas.attention`` run
MQA-style (one kv group; all ``T * H`` query rows share the cache), with the score split into its latent part
(R = 512 for K3) and its decoupled part (O = 64), since 576 is not a power of two for Triton. The latent block
is read once per key block and serves as both key and value (``u_h = sum_s p_h(s) c_s``). An int8 cache
(``Int8Rows`` c and kpe) is read as codes and dequantized per tile, multiplied in the query's (activation) dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas._common import key_block, row_block
from kernels_pallas.attention.pallas import default_splits, flash
from kernels_pallas.cache_quant import is_int8


def mla_attention(q_lat_BTHR, q_pe_BTHO, c_BSR, kpe_BSO, q_pos_BT, *, scale, platform="gpu", interpret=False,
                  block_q=None, block_k=None, num_splits=None, num_warps=None, with_lse=False):
    """Returns u ``[B, T, H, R]`` float32 (latent space; with ``with_lse`` also its log-sum-exp ``[B, T, H]``).
    Same signature as the reference plus block choices."""
    B, T, H, R = q_lat_BTHR.shape
    S = c_BSR.shape[1]
    rows = lambda x: x.reshape(B, 1, T * H, x.shape[-1])  # row = t * H + h
    qpos = jnp.repeat(q_pos_BT.astype(jnp.int32), H, axis=1)
    # q_lat is float32 (absorbed in float32 by the caller); the kernel multiplies in the cache dtype, or for an int8
    # cache in the activation dtype (q_pe's)
    dt = q_pe_BTHO.dtype if is_int8(c_BSR) else c_BSR.dtype
    # A wide latent makes the [rows, R] float32 accumulator the register budget on GPU: smaller tiles there.
    bq = block_q or row_block(T * H, 32 if R > 256 else 64, platform, dt)
    bk = block_k or key_block(S, (32 if R > 256 else 64) if platform == "gpu" else 512, platform)
    if num_splits is None:
        num_splits = default_splits(platform, B, 1, T * H, S, bk)
    kpe = kpe_BSO if is_int8(kpe_BSO) else kpe_BSO.astype(dt)
    out = flash(rows(q_lat_BTHR.astype(dt)), jax.tree.map(lambda x: x[:, :, None, :], c_BSR), None, qpos,
                scale=scale, q_pe_BGAO=rows(q_pe_BTHO.astype(dt)), k_pe_BSO=kpe, v_is_k=True, platform=platform,
                interpret=interpret, block_q=bq, block_k=bk, num_splits=num_splits,
                num_warps=num_warps or (8 if R > 256 else None),  # 8 warps: room for the [bq, R] accumulator
                with_lse=with_lse)
    if with_lse:
        return out[0].reshape(B, T, H, R), out[1].reshape(B, T, H)
    return out.reshape(B, T, H, R)
