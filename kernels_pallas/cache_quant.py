"""int8 cache rows: the row format of a quantized attention cache (MLA latent / rope key, GQA keys / values).

:class:`Int8Rows` holds ``q`` int8 ``[..., X]`` and ``scale`` float32 ``[..., 1]``: one scale per cached row (a
token's latent, or one kv head of a token's keys), ``x ~= q * scale``. Quantized once, when the row is written:
``scale = max|x| * float32(1/127)``, ``q = round_half_even(x * (1 / scale))`` clipped to [-127, 127] (a zero row
gets scale 0 and codes 0). Written as products because XLA rewrites a division by a constant or by a broadcast row
value into one anyway; so spelled, the codes are the same on every backend that rounds its float32 products.
The scale keeps a trailing 1 so it has the rank of the codes: every op's partition rule and every cache sharding
rule reads both fields with the letters of the plain array (the size-1 dim is never split).

Readers: every op's reference (and CPU form) takes :func:`dense` of its operand, the plain oracle; the Pallas
kernels read the int8 tiles and their scales and dequantize in VMEM / registers (:func:`tile`), so no dense copy
of the cache is ever written.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

_F32 = jnp.float32
QMAX = 127

# the ``kv_cache`` option of kimi_jax.model.cache: None = rows in the model dtype; "int8" = every MLA / GQA field;
# "int8-index" = only K3.1's DSA indexer keys (they only rank keys), the latent and the values' rows in full precision
FORMATS = (None, "int8", "int8-index")


class Int8Rows(NamedTuple):
    """int8 codes ``q [..., X]`` and one float32 scale per row ``scale [..., 1]``."""

    q: jax.Array
    scale: jax.Array

    @property
    def shape(self):
        return tuple(self.q.shape)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.q) + _nbytes(self.scale)

    @classmethod
    def shapes(cls, shape) -> "Int8Rows":
        """``ShapeDtypeStruct`` fields: no memory."""
        return cls(jax.ShapeDtypeStruct(tuple(shape), jnp.int8), jax.ShapeDtypeStruct((*shape[:-1], 1), _F32))


def _nbytes(a) -> int:
    return int(a.size) * jnp.dtype(a.dtype).itemsize


def quantize(x) -> Int8Rows:
    """Rows ``x [..., X]`` (any float dtype) -> :class:`Int8Rows`, one scale per row (see the module docstring)."""
    x = x.astype(_F32)
    scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) * jnp.float32(1 / QMAX)
    # a row whose scale is below float32's smallest normal (all zero, or |x| < 1.5e-36) is stored as zeros: its
    # reciprocal would overflow to inf and 0 * inf make NaN codes
    scale = jnp.where(scale >= jnp.finfo(_F32).tiny, scale, 0.0)
    inv = 1.0 / jnp.where(scale > 0, scale, 1.0)  # [..., 1]: one division per row
    q = jnp.clip(jnp.round(x * inv), -QMAX, QMAX).astype(jnp.int8)
    return Int8Rows(q, scale)


def dequantize(rows: Int8Rows, dtype=_F32):
    """``q * scale`` (float32 product), in ``dtype``."""
    return (rows.q.astype(_F32) * rows.scale).astype(dtype)


def dense(x, dtype=None):
    """A cache operand as a plain array: ``x`` itself, or an :class:`Int8Rows` dequantized (to ``dtype``, default
    float32). What the references read."""
    if isinstance(x, Int8Rows):
        return dequantize(x, dtype or _F32)
    return x if dtype is None else x.astype(dtype)


def is_int8(x) -> bool:
    return isinstance(x, Int8Rows)


def split(x):
    """``(codes or array, scale or None)``: how a kernel wrapper passes an operand to ``pallas_call``."""
    return (x.q, x.scale) if isinstance(x, Int8Rows) else (x, None)


def tile(values, scale, dtype):
    """A loaded tile ``[n, X]`` in the kernel's compute ``dtype``: int8 codes times their row scales ``[n, 1]``
    (float32 product, then rounded to ``dtype``), or a plain tile cast."""
    if scale is None:
        return values.astype(dtype)
    return (values.astype(_F32) * scale).astype(dtype)


def check(kv_cache) -> None:
    if kv_cache not in FORMATS:
        raise ValueError(f"kv_cache={kv_cache!r}: choose None (rows in the model dtype), 'int8' (every cache field) "
                         "or 'int8-index' (only K3.1's DSA indexer keys)")
