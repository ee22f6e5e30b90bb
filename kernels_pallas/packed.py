"""Packed weight types: a weight stored as a small pytree of arrays (codes, scales) instead of one float array.

Each type is a ``NamedTuple`` of arrays with

* ``shape``: the logical (decoded) shape; every field shares its leading dimensions;
* ``GROUP_UNITS``: per field, the elements of its last dimension that belong to one quantization group, so a shard
  boundary on that dimension falls between groups in every field at once.

Model parameters hold one such value (``nnx.Param(MXFP4Weight(...))``), so loading, sharding, the MoE, the plan and
parameter counting read a weight's format from its type; only the checkpoint name table knows how the fields are
named in a file. :data:`TYPES` lists the types (MXFP4 today; int8 / int4 weight-only formats join it).
"""

from __future__ import annotations

import math

import numpy as np

from kernels_pallas.mxfp4 import MXFP4Weight

TYPES: tuple[type, ...] = (MXFP4Weight,)


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
    return tuple(type(value).GROUP_UNITS) if is_packed(value) else (1,)
