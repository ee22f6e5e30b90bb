"""MXFP4 weights as kernels see them: packed E2M1 nibbles + E8M0 scale bytes, never expanded in HBM.

``MXFP4Weight(packed [..., N, K/2] uint8, scale [..., N, K/32] uint8)`` is a pytree, so it passes through
``jit``/sharding like any array pair. Layout and codes follow compressed-tensors ``mxfp4-pack-quantized``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

GROUP = 32
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
PAIR = np.stack([E2M1[np.arange(256) & 0xF], E2M1[np.arange(256) >> 4]], axis=-1)  # byte -> (low, high)


class MXFP4Weight(NamedTuple):
    packed: jax.Array  # uint8 [..., N, K/2]
    scale: jax.Array  # uint8 [..., N, K/32]

    @property
    def shape(self):
        """Logical (dequantized) shape."""
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)


def dequantize(w: MXFP4Weight, dtype=jnp.bfloat16) -> jax.Array:
    """Decode to ``[..., N, K]``: a 256-entry byte->pair table, times the power-of-two scale (exact)."""
    packed, scale = w
    if packed.shape[-1] * 2 != scale.shape[-1] * GROUP or packed.shape[:-1] != scale.shape[:-1]:
        raise ValueError(f"MXFP4 packed {packed.shape} and scale {scale.shape} do not match")
    vals = jnp.asarray(PAIR)[packed.astype(jnp.int32)]
    vals = vals.reshape(*packed.shape[:-1], scale.shape[-1], GROUP)
    s = jax.lax.bitcast_convert_type(scale, jnp.float8_e8m0fnu).astype(jnp.float32)
    return (vals * s[..., None]).reshape(*packed.shape[:-1], packed.shape[-1] * 2).astype(dtype)


def as_dense(w, dtype) -> jax.Array:
    """Dense array for either a plain weight or an :class:`MXFP4Weight`."""
    return dequantize(w, dtype) if isinstance(w, MXFP4Weight) else w.astype(dtype)
