"""The products in the forms XLA:CPU runs fastest (``implementation="xla_cpu"``, the automatic choice there).

Same contracts as :mod:`kernels_pallas.matvec.reference`; only the orientation of the products differs, so the
values are the same float32 sums.

* **Few rows, weight first.** For 2..32 rows XLA:CPU computes ``x @ w.T`` faster as ``(w @ x.T).T`` (measured in
  float32: 2-3x for 2..16 rows, i.e. batched decode, where its GEMM packs the whole weight for a handful of rows;
  equal at 1 row and >= 64). The optimization barrier keeps that orientation: without it XLA folds the transpose
  back into an ``x @ w.T`` product.
* **Per-head products heads-first** (absorbed MLA): as plain einsums XLA:CPU ran these batched products 3-4x
  slower at 8 rows (batch-8 decode of the benchmark model: ~2.2 ms per MLA layer). They run in float32: XLA:CPU
  has no fast bf16 x bf16 -> f32 batched dot, and the float32 product of the same bf16 values is identical.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas._common import acc_dtype
from kernels_pallas.matvec import reference
SKINNY_ROWS = 32  # up to this many rows the weight-first form wins


def skinny(rows: int) -> bool:
    return 1 < rows <= SKINNY_ROWS


def w_xT(w_JI, x_MI, precision=None):
    """``w @ x.T`` -> ``[J, M]`` float32, kept in that orientation."""
    y = jnp.einsum("ji,mi->jm", w_JI, x_MI, preferred_element_type=acc_dtype(w_JI, x_MI), precision=precision)
    return jax.lax.optimization_barrier(y)


def group(items, *, precision=None):
    return [w_xT(w, x, precision).T if ids is None and skinny(x.shape[0]) else
            reference.product(x, w, ids, precision=precision) for x, w, ids in items]


def per_head(x_BTHI, w, *, transpose_w, precision=None):
    B, T, H, _ = x_BTHI.shape
    dt = acc_dtype(x_BTHI, w)  # float32 (float64 operands: float64)
    x_BTHI, w = x_BTHI.astype(dt), w.astype(dt)
    if not skinny(B * T):
        return reference.per_head(x_BTHI, w, transpose_w=transpose_w, precision=precision)
    x_NHI = x_BTHI.reshape(B * T, H, -1)
    if transpose_w:  # w [H, J, I]: the weight as the left operand
        y_HJN = jnp.einsum("hji,hin->hjn", w, jnp.transpose(x_NHI, (1, 2, 0)), precision=precision,
                           preferred_element_type=dt)
        y_HNJ = jnp.swapaxes(jax.lax.optimization_barrier(y_HJN), 1, 2)
    else:
        y_HNJ = jnp.einsum("hni,hij->hnj", jnp.moveaxis(x_NHI, 1, 0), w, precision=precision,
                           preferred_element_type=dt)
    return jnp.moveaxis(y_HNJ, 0, 1).reshape(B, T, H, -1)
