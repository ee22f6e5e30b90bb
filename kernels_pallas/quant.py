"""Weight-only integer formats: int8 per output channel, int4 group-wise (symmetric or with a zero point) and NF4.

A weight ``W [..., J, I]`` (checkpoint layout ``[out, in]``) becomes one packed weight type
(:mod:`kernels_pallas.packed`), a ``NamedTuple`` of arrays that passes through ``jit`` and sharding like the MXFP4
expert weight:

* :class:`Int8Weight`: ``q`` int8 ``[..., J, I]`` and ``scale`` float32 ``[..., J, 1]``; ``W = q * scale``.
* :class:`Int4Weight`: ``packed`` uint8 ``[..., J, I/2]`` (element 2k in the low nibble, 2k+1 in the high one, each a
  two's-complement int4 in -8..7) and ``scale`` float32 ``[..., J, I/g]`` for groups of ``g`` input columns;
  ``W = q * scale``.
* :class:`Int4ZeroWeight`: as :class:`Int4Weight` plus ``zero`` int8 ``[..., J, I/g]`` (an int4 value, -8..7);
  ``W = (q - zero) * scale``.
* :class:`NF4Weight`: ``packed`` uint8 ``[..., J, I/2]`` of 4-bit indices into the NormalFloat table
  (:data:`NF4_TABLE`, QLoRA appendix E) and ``absmax`` float32 ``[..., J, I/g]``; ``W = NF4_TABLE[code] * absmax``.

The numerics of quantizing (the calibration, the scale and zero point, the rounding) are qwix's (``qwix.quantize``,
Google's JAX quantization library): :func:`quantize` calls it and only repacks its ``QArray`` into these fields,
and :func:`dequantize` reproduces ``qwix.dequantize`` bit for bit (``tests/test_quant.py``). The kernels read the
fields directly (``kernels_pallas/matvec``); :func:`dequantize` is their oracle.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from qwix._src.core import qarray
from qwix.contrib import gptq_core

_F32 = jnp.float32

# QLoRA (Dettmers et al. 2023, appendix E) NormalFloat-4 values, as qwix and bitsandbytes tabulate them.
NF4_TABLE = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], np.float32)


def _whole_or_field(self, key):
    """``w[...]`` is the weight itself (how model code reads an ``nnx.Param``); an int or slice indexes the fields."""
    return self if key is Ellipsis else tuple.__getitem__(self, key)


def _pairs_shape(packed):
    return (*packed.shape[:-1], packed.shape[-1] * 2)


# The 4-bit types' common protocol (a NamedTuple takes no mixin base, so the three share these as attributes): field
# 0 is the nibble pairs, field 1 the per-group scale, any further field per group too.
_nibble_shape = property(lambda self: _pairs_shape(self[0]), doc="Logical (decoded) shape.")
_group = property(lambda self: 2 * self[0].shape[-1] // self[1].shape[-1], doc="Input columns per scale.")
_group_units = property(lambda self: (self.group // 2,) + (1,) * (len(self) - 1),
                        doc="Elements of each field's last dimension per group (the packed-type protocol).")


class Int8Weight(NamedTuple):
    """int8 codes ``q [..., J, I]`` with one float32 scale per output row, ``scale [..., J, 1]``."""

    q: jax.Array
    scale: jax.Array

    @property
    def shape(self):
        return tuple(self.q.shape)

    # The scale's last dimension is broadcast (0): a split of the input dimension leaves it whole.
    GROUP_UNITS = (1, 0)
    __getitem__ = _whole_or_field

    @classmethod
    def random(cls, key, shape) -> "Int8Weight":
        kq, ks = jax.random.split(key)
        q = jax.random.randint(kq, shape, -127, 128, jnp.int32).astype(jnp.int8)
        return cls(q, jax.random.uniform(ks, (*shape[:-1], 1), _F32, 1e-4, 3e-4))


class Int4Weight(NamedTuple):
    """Symmetric int4: nibble pairs ``packed [..., J, I/2]`` and ``scale [..., J, I/g]`` (float32)."""

    packed: jax.Array
    scale: jax.Array

    shape, group, GROUP_UNITS = _nibble_shape, _group, _group_units

    __getitem__ = _whole_or_field

    @classmethod
    def random(cls, key, shape, group: int = 32) -> "Int4Weight":
        kq, ks = jax.random.split(key)
        packed = jax.random.randint(kq, (*shape[:-1], shape[-1] // 2), 0, 256, jnp.int32).astype(jnp.uint8)
        return cls(packed, jax.random.uniform(ks, (*shape[:-1], shape[-1] // group), _F32, 2e-3, 6e-3))


class Int4ZeroWeight(NamedTuple):
    """int4 with a zero point per group: ``W = (q - zero) * scale``."""

    packed: jax.Array
    scale: jax.Array
    zero: jax.Array  # int8 [..., J, I/g], values -8..7

    shape, group, GROUP_UNITS = _nibble_shape, _group, _group_units

    __getitem__ = _whole_or_field

    @classmethod
    def random(cls, key, shape, group: int = 32) -> "Int4ZeroWeight":
        base = Int4Weight.random(key, shape, group)
        return cls(base.packed, base.scale, jnp.zeros(base.scale.shape, jnp.int8))


class NF4Weight(NamedTuple):
    """NormalFloat-4: index pairs ``packed [..., J, I/2]`` and ``absmax [..., J, I/g]`` (float32)."""

    packed: jax.Array
    absmax: jax.Array

    shape, group, GROUP_UNITS = _nibble_shape, _group, _group_units

    __getitem__ = _whole_or_field

    @classmethod
    def random(cls, key, shape, group: int = 64) -> "NF4Weight":
        base = Int4Weight.random(key, shape, group)
        return cls(base.packed, base.scale)


TYPES = (Int8Weight, Int4Weight, Int4ZeroWeight, NF4Weight)


# -- the format a user asks for ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Format:
    """How to quantize one weight: ``kind`` int8 | int4 | nf4; ``group`` input columns per scale (int4, nf4);
    ``zero_point`` (int4): asymmetric, min/max calibrated."""

    kind: str
    group: int = 32
    zero_point: bool = False

    def __post_init__(self):
        if self.kind not in ("int8", "int4", "nf4"):
            raise ValueError(f"unknown weight format {self.kind!r} (int8, int4, nf4)")
        if self.kind != "int8" and (self.group < 2 or self.group % 2):
            raise ValueError(f"{self.kind}: group {self.group} must be an even number of columns")
        if self.zero_point and self.kind != "int4":
            raise ValueError(f"{self.kind}: a zero point applies to int4 only")

    @classmethod
    def parse(cls, text: str) -> "Format":
        """``int8``, ``int4`` (group 32), ``int4:g64``, ``int4:g128:zero``, ``nf4`` (group 64), ``nf4:g32``."""
        kind, *opts = str(text).split(":")
        kw: dict = {} if kind != "nf4" else {"group": 64}
        for o in opts:
            if o.startswith("g") and o[1:].isdigit():
                kw["group"] = int(o[1:])
            elif o in ("zero", "asym"):
                kw["zero_point"] = True
            elif o != "sym":
                raise ValueError(f"{text!r}: unknown option {o!r} (gN, zero)")
        return cls(kind, **kw)

    def name(self) -> str:
        if self.kind == "int8":
            return "int8"
        return f"{self.kind}:g{self.group}" + (":zero" if self.zero_point else "")

    def fitted(self, shape) -> "Format":
        """The format a weight of this shape gets: a row narrower than the group is one group (no coarser than
        asked)."""
        if self.kind != "int8" and len(shape) >= 2 and shape[-1] < self.group and shape[-1] % 2 == 0:
            return dataclasses.replace(self, group=int(shape[-1]))
        return self

    def fits(self, shape) -> str | None:
        """Why a weight of this logical shape cannot take the format, or None."""
        if len(shape) < 2:
            return f"a {len(shape)}-d array (weights are [..., out, in])"
        group = self.fitted(shape).group
        if self.kind != "int8" and shape[-1] % group:
            return f"{shape[-1]} input columns are not a multiple of the group {group}"
        return None

    def bytes_per_value(self, columns: int) -> float:
        """Stored bytes per logical value of a weight with ``columns`` input columns (codes and scales)."""
        if self.kind == "int8":
            return 1.0 + 4 / columns
        return 0.5 + (4 + (1 if self.zero_point else 0)) / self.group


def format_of(w) -> Format:
    """The :class:`Format` a packed weight of :data:`TYPES` is in."""
    if isinstance(w, Int8Weight):
        return Format("int8")
    kinds = {Int4Weight: ("int4", False), Int4ZeroWeight: ("int4", True), NF4Weight: ("nf4", False)}
    if type(w) not in kinds:
        raise TypeError(f"{type(w).__name__} is not an integer weight format")
    kind, zero = kinds[type(w)]
    return Format(kind, w.group, zero)


def pack_nibbles(codes):
    """int codes 0..15 ``[..., I]`` -> bytes ``[..., I/2]`` (element 2k in the low nibble)."""
    c = codes.astype(jnp.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed):
    """bytes ``[..., I/2]`` -> nibbles 0..15 ``[..., I]`` as int32."""
    p = packed.astype(jnp.int32)
    return jnp.stack([p & 0xF, p >> 4], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def signed_nibbles(nibbles):
    """Nibbles 0..15 -> the int4 codes they store, -8..7 (two's complement)."""
    return jnp.where(nibbles >= 8, nibbles - 16, nibbles)


def _qtype(fmt: Format):
    return {"int8": jnp.int8, "int4": jnp.int4, "nf4": "nf4"}[fmt.kind]


def _calibration(fmt: Format) -> str:
    return "minmax" if fmt.zero_point else "absmax"


def quantize(w, fmt: Format, hessian=None, damp: float = 0.01):
    """One float weight ``[..., J, I]`` in ``fmt`` (qwix computes the codes and scales from the float32 values).

    ``hessian``: ``[I, I]``, the sum of ``x x^T`` over the inputs ``x`` this (2-d) weight multiplies: the codes are
    then chosen by GPTQ (:func:`gptq`) instead of rounding each weight to its nearest code."""
    why = fmt.fits(w.shape)
    if why is not None:
        raise ValueError(f"cannot quantize to {fmt.name()}: {why}")
    fmt = fmt.fitted(w.shape)
    w = jnp.asarray(w).astype(_F32)
    if hessian is not None:
        return _pack(fmt, *gptq(w, hessian, fmt, damp=damp))
    rows = tuple(range(w.ndim - 1))
    tiles = {} if fmt.kind == "int8" else {w.ndim - 1: fmt.group}
    qa = qwix.quantize(w, _qtype(fmt), channelwise_axes=rows, tiled_axes=tiles, calibration_method=_calibration(fmt))
    return _pack(fmt, qa.qvalue, qa.scale, qa.zero_point)


def _pack(fmt: Format, q, scale, zero):
    """qwix's codes, scales and zero points (a ``QArray``'s fields) as the fields of ``fmt``'s packed type."""
    if fmt.kind == "int8":
        return Int8Weight(q.astype(jnp.int8), scale)
    if fmt.kind == "nf4":
        return NF4Weight(pack_nibbles(q.astype(jnp.int32)), scale)
    packed = pack_nibbles(q.astype(jnp.int32) & 0xF)
    if fmt.zero_point:
        return Int4ZeroWeight(packed, scale, zero.astype(jnp.int8))
    return Int4Weight(packed, scale)


# -- GPTQ ----------------------------------------------------------------------------------------------------


def gptq(w_JI, hessian_II, fmt: Format, *, damp: float = 0.01, block: int = 128):
    """GPTQ (Frantar et al. 2022): the codes of ``w [J, I]`` that keep ``||(W - Q) X||`` small for the inputs ``X``
    whose ``X X^T`` is ``hessian``, rather than each weight's nearest code. Returns qwix's ``(codes [J, I], scale,
    zero point or None)``.

    The algorithm, its order and its numerics are ``qwix.contrib.gptq_core.quantize_weight``'s (its group scales
    from ``find_params`` on the weights as they stand at the start of each block of ``block`` columns, its rounding
    ``quantize``; ``damp`` times the mean diagonal added to the Hessian; dead inputs zeroed), which
    ``tests/test_quant.py`` checks bit for bit. qwix unrolls its loop over every column in Python, which compiles
    for minutes per weight shape (and runs one compile per column eagerly); here the columns of a block are one
    ``fori_loop``, so a weight compiles in seconds."""
    if w_JI.ndim != 2:
        raise ValueError(f"GPTQ quantizes one [out, in] matrix at a time, not {tuple(w_JI.shape)}")
    J, I = w_JI.shape
    if hessian_II.shape != (I, I):
        raise ValueError(f"a Hessian {tuple(hessian_II.shape)} for a weight of {I} input columns")
    fmt = fmt.fitted(w_JI.shape)
    g = I if fmt.kind == "int8" else fmt.group
    qtype = _qtype(fmt)

    how = qarray.HowToQuantize(qtype=qtype, channelwise_axes=(0,), tiled_axes={1: g},
                               calibration_method=_calibration(fmt))
    return _gptq(w_JI.astype(_F32), hessian_II.astype(_F32), how, g, damp, block, gptq_core)


def _inverse_factor(H, damp):
    """The upper Cholesky factor of the damped Hessian's inverse, with dead inputs (zero diagonal) made harmless."""
    I = H.shape[0]
    diag = jnp.diag(H)
    H = jnp.where((diag == 0) & jnp.eye(I, dtype=bool), 1.0, H)
    H = H + damp * jnp.mean(diag) * jnp.eye(I, dtype=H.dtype)
    L = jnp.linalg.cholesky(H)
    return jnp.linalg.cholesky(jax.scipy.linalg.cho_solve((L, True), jnp.eye(I, dtype=H.dtype)), upper=True)


def _gptq(W, H, how, g, damp, block, core):
    J, I = W.shape
    W = jnp.where(jnp.diag(H)[None] == 0, 0.0, W)
    U = _inverse_factor(H, damp)
    n_groups = I // g
    scale, zero = core.find_params(W[:, :g], how)  # shapes and dtypes of one group's parameters
    scales = jnp.zeros((n_groups, *scale.shape), scale.dtype)
    zeros = None if zero is None else jnp.zeros((n_groups, *zero.shape), zero.dtype)
    codes = []
    for i1 in range(0, I, block):
        i2 = min(i1 + block, I)
        W_start, U1 = W, U[i1:i2, i1:i2]

        def column(i, carry):
            W1, Err, Q1, scales, zeros = carry
            c = i1 + i
            gi = c // g

            def new_group(sz):  # the group's parameters, from the weights as they stood at the block's start
                s, z = core.find_params(jax.lax.dynamic_slice_in_dim(W_start, c, g, axis=1), how)
                return sz[0].at[gi].set(s), (None if z is None else sz[1].at[gi].set(z))

            scales, zeros = jax.lax.cond(c % g == 0, new_group, lambda sz: sz, (scales, zeros))
            w = jax.lax.dynamic_slice_in_dim(W1, i, 1, axis=1)  # [J, 1]
            q, dq = core.quantize(w, how.qtype, scales[gi], None if zeros is None else zeros[gi])
            err = (w - dq)[:, 0] / U1[i, i]
            W1 = W1 - jnp.where(jnp.arange(i2 - i1) >= i, jnp.outer(err, U1[i]), 0.0)
            Q1 = jax.lax.dynamic_update_slice_in_dim(Q1, q, i, axis=1)
            return W1, Err.at[:, i].set(err), Q1, scales, zeros

        q0 = core.quantize(W[:, i1:i1 + 1], how.qtype, scales[0], None if zeros is None else zeros[0])[0]
        init = (W[:, i1:i2], jnp.zeros((J, i2 - i1), W.dtype), jnp.zeros((J, i2 - i1), q0.dtype), scales, zeros)
        W1, Err, Q1, scales, zeros = jax.lax.fori_loop(0, i2 - i1, column, init)
        codes.append(Q1)
        W = W.at[:, i1:i2].set(W1).at[:, i2:].add(-(Err @ U[i1:i2, i2:]))
    scale = jnp.moveaxis(scales[..., 0], 0, 1)  # [J, groups]
    zero = None if zeros is None else jnp.moveaxis(zeros[..., 0], 0, 1)
    return jnp.concatenate(codes, axis=1), scale, zero


def _grouped(values, scale):
    """``values [..., I] * scale [..., I/g]`` per group of ``g`` columns (float32)."""
    g = values.shape[-1] // scale.shape[-1]
    v = values.reshape(*scale.shape, g)
    return v, scale[..., None]


def dequantize(w, dtype=jnp.float32):
    """Decode any of :data:`TYPES` to ``[..., J, I]`` in ``dtype``: the oracle of the kernels (float32 arithmetic,
    qwix's order: ``(q - zero) * scale``)."""
    if isinstance(w, Int8Weight):
        return (w.q.astype(_F32) * w.scale.astype(_F32)).astype(dtype)
    if isinstance(w, NF4Weight):
        v, s = _grouped(jnp.asarray(NF4_TABLE)[unpack_nibbles(w.packed)], w.absmax.astype(_F32))
        return (v * s).reshape(w.shape).astype(dtype)
    if isinstance(w, (Int4Weight, Int4ZeroWeight)):
        v, s = _grouped(signed_nibbles(unpack_nibbles(w.packed)).astype(_F32), w.scale.astype(_F32))
        if isinstance(w, Int4ZeroWeight):
            v = v - w.zero.astype(_F32)[..., None]
        return (v * s).reshape(w.shape).astype(dtype)
    raise TypeError(f"{type(w).__name__} is not an integer weight format")
