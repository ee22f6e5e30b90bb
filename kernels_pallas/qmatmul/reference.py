"""The integer-weight matmul in plain jnp: the oracle of the kernels and the CPU path.

The weight is decoded whole by :func:`kernels_pallas.quant.dequantize` (float32, qwix's order) and multiplied by the
activations widened to float32 at full precision: the exact product of the operands as given, rounded once per
product and summed in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import quant

_F32 = jnp.float32


def matmul(x_MI, w):
    """``x [M, I] @ dequantize(w)^T`` for ``w`` one of :data:`kernels_pallas.quant.TYPES` (logical ``[J, I]``) ->
    ``[M, J]`` float32."""
    if x_MI.ndim != 2 or x_MI.shape[1] != w.shape[-1] or len(w.shape) != 2:
        raise ValueError(f"qmatmul: x {x_MI.shape} does not match a [J, I] weight of shape {w.shape}")
    return jnp.einsum("mi,ji->mj", x_MI.astype(_F32), quant.dequantize(w, _F32), preferred_element_type=_F32,
                      precision=jax.lax.Precision.HIGHEST)
