"""Packed weight types: a weight stored as a small pytree of arrays (codes, scales) instead of one float array.

Each type is a ``NamedTuple`` of arrays with

* ``shape``: the logical (decoded) shape; every field shares its leading dimensions;
* ``GROUP_UNITS``: per field, the elements of its last dimension that belong to one quantization group, so a shard
  boundary on that dimension falls between groups in every field at once.

Model parameters hold one such value (``nnx.Param(MXFP4Weight(...))``), so loading, sharding, the MoE, the plan and
parameter counting read a weight's format from its type; only the checkpoint name table knows how the fields are
named in a file. :data:`TYPES` lists the types: MXFP4 (:mod:`kernels_pallas.mxfp4`) and the weight-only integer
formats (:mod:`kernels_pallas.quant`: int8, int4, int4 with a zero point, NF4). A ``GROUP_UNITS`` entry of 0 marks a
field whose last dimension is broadcast over the logical one (int8's per-row scale): it is never split.
"""

from __future__ import annotations

import math

import numpy as np

from kernels_pallas import mxfp4, quant
from kernels_pallas.mxfp4 import MXFP4Weight

TYPES: tuple[type, ...] = (MXFP4Weight, *quant.TYPES)


def is_packed(value) -> bool:
    return isinstance(value, TYPES)


def logical_size(value) -> int:
    """Values the weight encodes (a plain array: its size)."""
    return math.prod(value.shape)


def nbytes(value) -> int:
    """Bytes in memory (every field; a plain array: its own)."""
    fields = value if is_packed(value) else (value,)
    return sum(math.prod(f.shape) * np.dtype(f.dtype).itemsize for f in fields)


def group_units(value) -> tuple[int, ...]:
    """Per field (one entry for a plain array), the last-dimension elements of one quantization group."""
    return tuple(value.GROUP_UNITS) if is_packed(value) else (1,)


def as_dense(value, dtype):
    """The decoded array of a packed weight (the kernels' oracle), or a plain array cast to ``dtype``."""
    if isinstance(value, MXFP4Weight):
        return mxfp4.dequantize(value, dtype)
    if isinstance(value, quant.TYPES):
        return quant.dequantize(value, dtype)
    return value.astype(dtype)


def format_name(value) -> str:
    """``mxfp4``, ``int8``, ``int4:g32``, ..., or the dtype name of a plain array."""
    if isinstance(value, MXFP4Weight):
        return "mxfp4"
    if isinstance(value, quant.TYPES):
        return quant.format_of(value).name()
    return np.dtype(value.dtype).name
