"""The integer-weight matmul in Pallas: ``x [M, I] @ W^T`` with ``W [J, I]`` decoded tile by tile from its packed
fields (:mod:`kernels_pallas.quant`), never as a whole; float32 accumulation, float32 output.

Numerics, the same on both backends:

* **int8**: the tile of codes is converted to the activations' dtype (exact: ``|q| <= 127`` fits bfloat16's 8-bit
  significand), multiplied on the matrix units, and the per-row scale multiplies the accumulator once at the end.
* **int4, int4 with a zero point, NF4** (a scale per group of ``g`` input columns): the tile is decoded in float32
  as :func:`~kernels_pallas.quant.dequantize` computes it (``(q - zero) * scale``, ``NF4[code] * absmax``: the same
  values bit for bit), then rounded to the activations' dtype for one product per I block. With bfloat16
  activations that rounding (at most 2^-8 relative per weight) is the kernel's only error beyond float32 sums, as for a
  bfloat16 checkpoint weight.
* Nibbles: byte k of a row holds column 2k (low nibble) and 2k+1 (high). As in ``moe_gmm``, the wrapper splits
  the activations into even and odd columns once and the kernel multiplies low nibbles by even columns and high
  ones by odd columns, so no nibbles are interleaved in the kernel. Signed nibbles decode by two shifts; NF4 codes
  by a tree of 15 selects over the table (no gather).

Per backend:

* **TPU (Mosaic)**: grid ``(M/bm, J/bn, I/bk)``, I innermost and sequential, the float32 accumulator in VMEM
  scratch. A step's group block is ``bk/g`` scale columns (8..32), and Mosaic slices lanes only in multiples of
  128 (libtpu: ``CompileTimeMosaicUnprovenMemoryAccessAlignment``), so the kernel takes the scales (and zeros)
  transposed, ``[I/g, J]``, and reads ``bk/g`` groups as sublanes (``bk`` a multiple of ``8 g``). That transpose
  costs nothing: TPU's default layout of a ``[J, I/g]`` array is column-major (``{0,1}``; the compiled program holds
  a bitcast, where the untransposed scales cost a relayout copy per call). Mosaic cannot repeat lanes by reshaping,
  so the groups are spread over their ``g/2`` byte columns by a one-hot matmul (:func:`_spread_tpu`, exact).
* **GPU (Triton)**: grid ``(M/bm, J/bn)``. Triton program instances cannot carry an accumulator across grid steps,
  so the I blocks are a loop inside the kernel over whole-row refs (only each step's ``pl.ds`` slice is loaded),
  and the scales are spread by broadcast and reshape. Every block is a power of two (the group too).

Block sizes (:func:`blocks`): TPU ``bm`` up to 512 (a multiple of 16 for bfloat16, 8 for float32), ``bn`` 256 or
128 (or the whole J up to 2048), ``bk`` up to 1024 columns (a multiple of 128 for int8; of ``lcm(256, 8 g)`` for
the group-wise formats: 128-lane byte blocks and 8-sublane group blocks); GPU ``bm`` 16..64, ``bn`` 64 (decode) or
128, ``bk`` 256 columns per loop step (128 for float32 activations: shared memory). Sizes that do not divide are
padded in the wrapper (zeros: padded activations make any finite weight contribute nothing); the J and I defaults
divide K3's projection sizes, so real weights are never copied.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import quant
from kernels_pallas._common import (
    F32,
    compiler_params,
    dot_nt,
    pad_axis,
    pow2_divisor,
    precision_for,
    round_up,
    row_block,
)

BF16 = jnp.bfloat16
_NF4 = tuple(float(v) for v in quant.NF4_TABLE)


class Fields(NamedTuple):
    """A packed weight as the kernels take it."""

    kind: str  # "int8" | "int4" | "int4_zero" | "nf4"
    J: int
    I: int  # noqa: E741 (the dimension letter)
    group: int  # input columns per scale (int8: I, one scale per row)
    arrays: tuple  # int8: (q [J, I], scale [1, J]); else (packed [J, I/2], scale [J, I/g][, zero [J, I/g]])


def fields(w) -> Fields:
    if isinstance(w, quant.Int8Weight):
        J, I = w.q.shape
        if w.scale.shape != (J, 1):
            raise ValueError(f"int8 weight: codes {w.q.shape} and scale {w.scale.shape} do not match")
        return Fields("int8", J, I, I, (w.q, w.scale.astype(F32).reshape(1, J)))
    kinds = {quant.Int4Weight: "int4", quant.Int4ZeroWeight: "int4_zero", quant.NF4Weight: "nf4"}
    if type(w) not in kinds:
        raise TypeError(f"qmatmul: {type(w).__name__} is not an integer weight format ({quant.TYPES})")
    packed, scale, *zero = w
    J, ih = packed.shape
    if scale.shape[0] != J or (2 * ih) % scale.shape[1] or any(z.shape != scale.shape for z in zero):
        raise ValueError(f"{kinds[type(w)]} weight: fields {[tuple(a.shape) for a in w]} do not match")
    return Fields(kinds[type(w)], J, 2 * ih, 2 * ih // scale.shape[1], (packed, scale.astype(F32), *zero))


def unsupported(platform: str, w) -> str | None:
    """Why the kernel compiled for ``platform`` cannot take weight ``w``, or None: on GPU a group-wise weight's
    group must be a power of two (a Triton block holds whole groups, and its sizes are powers of two)."""
    if platform == "gpu" and isinstance(w, quant.TYPES) and not isinstance(w, quant.Int8Weight):
        g = w.group
        if g & (g - 1):
            return (f"{type(w).__name__} {tuple(w.shape)} in groups of {g} columns: the GPU kernel needs a "
                    f"power-of-two group (Triton blocks are powers of two)")
    return None


# -- block sizes ----------------------------------------------------------------------------------------------


def _largest_divisor(n: int, unit: int, target: int) -> int | None:
    """The largest multiple of ``unit`` that divides ``n`` and is at most ``max(target, unit)``."""
    for b in range(max(target, unit) // unit * unit, 0, -unit):
        if n % b == 0:
            return b
    return None


class Blocks(NamedTuple):
    bm: int  # rows of x per tile
    bn: int  # output columns (rows of W) per tile
    bk: int  # input columns per I step


def blocks(kind: str, M: int, J: int, I: int, group: int, dtype, platform: str, *, block_m=None,  # noqa: E741
           block_n=None, block_k=None) -> Blocks:
    """The tiles for these sizes (see the module docstring); ``block_*`` override them (tests)."""
    if platform == "tpu":
        bm = block_m or row_block(M, 512, "tpu", dtype)
        bn = block_n or _largest_divisor(J, 128, 256) or (J if J <= 2048 else 256)
        unit = 128 if kind == "int8" else math.lcm(256, 8 * group)
        # one whole-row step is legal for any I (full-dimension blocks) but its VMEM grows with I
        bk = block_k or _largest_divisor(I, unit, 1024) or (I if I <= 4096 else unit)
        if bk != I and bk % unit:
            raise ValueError(f"qmatmul (TPU): block_k {bk} must be I or a multiple of {unit}")
        return Blocks(bm, bn, bk)
    if kind != "int8" and group & (group - 1):
        raise ValueError(f"qmatmul (GPU): group {group} is not a power of two (Triton blocks are powers of two)")
    bm = block_m or row_block(M, 64, "gpu", dtype)
    bn = block_n or pow2_divisor(J, 64 if M <= 16 else 128, 16) or 64
    k_min = 16 if kind == "int8" else max(32, group)  # a dot's K >= 16: 16 bytes of nibble pairs per step
    # Triton stages each step's x and weight tiles in shared memory: float32 steps of 256 columns at bm=64,
    # bn=128 asked 296-320 KiB of the 227 KiB an H200 block may use (compiled), so float32 takes 128.
    k_target = max(512 // jnp.dtype(dtype).itemsize, k_min)
    bk = block_k or pow2_divisor(I, k_target, k_min) or k_target
    if bk & (bk - 1) or bk < k_min or (kind != "int8" and bk % group):
        raise ValueError(f"qmatmul (GPU): block_k {bk} must be a power of two >= {k_min} and a multiple of the group")
    return Blocks(bm, bn, bk)


def _pad_weight(f: Fields, Jp: int, Ip: int) -> tuple:
    """Weight operands padded to ``Jp`` rows and ``Ip`` input columns (zeros: the padded columns meet zero
    activations, the padded rows are cut from the output)."""
    if f.kind == "int8":
        q, s = f.arrays
        return pad_axis(pad_axis(q, 0, Jp), 1, Ip), pad_axis(s, 1, Jp)
    packed, *per_group = f.arrays
    return (pad_axis(pad_axis(packed, 0, Jp), 1, Ip // 2),
            *(pad_axis(pad_axis(a, 0, Jp), 1, Ip // f.group) for a in per_group))


# -- decoding -------------------------------------------------------------------------------------------------


def _nf4_values(codes):
    """int32 codes 0..15 -> float32 NF4 table values: a binary tree of selects, lowest bit first."""
    level = [jnp.float32(v) for v in _NF4]
    for bit in range(4):
        on = (codes & (1 << bit)) != 0
        level = [jnp.where(on, level[2 * k + 1], level[2 * k]) for k in range(len(level) // 2)]
    return level[0]


def _decode(kind, b, s, z):
    """Bytes ``b`` (int32 0..255, ``[bn, w]``) and the per-byte scale ``s`` (and zero ``z``), float32 ``[bn, w]``
    -> the (low, high) nibbles' float32 weights, as :func:`kernels_pallas.quant.dequantize` computes them."""
    if kind == "nf4":
        return _nf4_values(b & 15) * s, _nf4_values(jnp.right_shift(b, 4)) * s
    lo = jnp.right_shift(jnp.left_shift(b, 28), 28).astype(F32)  # arithmetic shifts: two's-complement nibbles
    hi = jnp.right_shift(jnp.left_shift(b, 24), 28).astype(F32)
    if kind == "int4_zero":
        lo, hi = lo - z, hi - z
    return lo * s, hi * s


def _spread_tpu(rows, per: int, width: int, parts: int):
    """Per-group values ``rows [n_groups, bn]`` (float32) -> ``[bn, width]``, group i on lanes ``[i per, (i+1) per)``.

    A one-hot matmul. It is exact whatever precision the MXU gives float32: the values are split into ``parts``
    bfloat16 pieces (3 hold any float32; 1 holds a small integer), each one-hot product of a piece is that piece,
    and their float32 sum is the value again."""
    n = rows.shape[0]
    lane = jax.lax.broadcasted_iota(jnp.int32, (n, width), 1)
    start = jax.lax.broadcasted_iota(jnp.int32, (n, width), 0) * per
    onehot = ((lane >= start) & (lane < start + per)).astype(BF16)
    out, rest = None, rows
    for _ in range(parts):
        piece = rest.astype(BF16)
        rest = rest - piece.astype(F32)
        d = jax.lax.dot_general(piece, onehot, (((0,), (0,)), ((), ())), preferred_element_type=F32)
        out = d if out is None else out + d
    return out


def _spread_gpu(v, per: int):
    """``[bn, n_groups]`` -> ``[bn, n_groups * per]``, each value repeated over its ``per`` byte columns."""
    bn, n = v.shape
    return jnp.broadcast_to(v[:, :, None], (bn, n, per)).reshape(bn, n * per)


# -- TPU (Mosaic) ---------------------------------------------------------------------------------------------


def _tpu_kernel(*refs, kind, n_k, per, dt, precision):
    """One (row tile, output tile, I step): decode this step's weight tile and add its product."""
    k = pl.program_id(2)
    if kind == "int8":
        x_ref, q_ref, s_ref, o_ref, acc_ref = refs
    else:
        xe_ref, xo_ref, p_ref, s_ref, *z_ref, o_ref, acc_ref = refs

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, F32)

    if kind == "int8":
        acc_ref[...] += dot_nt(x_ref[...], q_ref[...].astype(dt), precision)
    else:
        width = p_ref.shape[1]
        s = _spread_tpu(s_ref[...], per, width, parts=3)
        z = _spread_tpu(z_ref[0][...].astype(F32), per, width, parts=1) if z_ref else None
        lo, hi = _decode(kind, p_ref[...].astype(jnp.int32), s, z)
        acc_ref[...] += (dot_nt(xe_ref[...], lo.astype(dt), precision)
                         + dot_nt(xo_ref[...], hi.astype(dt), precision))

    @pl.when(k == n_k - 1)
    def _():
        o_ref[...] = acc_ref[...] * s_ref[...] if kind == "int8" else acc_ref[...]  # int8: the row scale, once


def _tpu_call(f: Fields, xargs, warrs, b: Blocks, Mp, Jp, Ip, dt, interpret, cost):
    bm, bn, bk = b
    grid = (Mp // bm, Jp // bn, Ip // bk)
    if f.kind == "int8":
        in_specs = [pl.BlockSpec((bm, bk), lambda i, j, k: (i, k)), pl.BlockSpec((bn, bk), lambda i, j, k: (j, k)),
                    pl.BlockSpec((1, bn), lambda i, j, k: (0, j))]
    else:
        # groups on sublanes: TPU's default layout of a [J, I/g] scale array is column-major ({0,1}), so its
        # transpose is free here, and a block of bk/g groups starts at a multiple of 8 sublanes (lanes would need 128)
        packed, *per_group = warrs
        warrs = (packed, *(a.T for a in per_group))
        h = bk // 2
        x_spec = pl.BlockSpec((bm, h), lambda i, j, k: (i, k))
        group_spec = pl.BlockSpec((bk // f.group, bn), lambda i, j, k: (k, j))
        in_specs = [x_spec, x_spec, pl.BlockSpec((bn, h), lambda i, j, k: (j, k)), *[group_spec] * len(per_group)]
    kernel = functools.partial(_tpu_kernel, kind=f.kind, n_k=grid[2], per=f.group // 2, dt=dt,
                               precision=precision_for(dt))
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((Mp, Jp), F32), grid=grid, in_specs=in_specs,
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, k: (i, j)), scratch_shapes=[pltpu.VMEM((bm, bn), F32)],
        compiler_params=compiler_params("tpu", interpret, semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret, cost_estimate=cost, name="qmatmul",
    )(*xargs, *warrs)


# -- GPU (Triton) ---------------------------------------------------------------------------------------------


def _gpu_kernel(*refs, kind, n_k, bk, group, dt, precision):
    """One (row tile, output tile): the I steps in a loop, each decoding its weight tile next to its product."""
    if kind == "int8":
        x_ref, q_ref, s_ref, o_ref = refs

        def body(k, acc):
            k0 = pl.multiple_of(k * bk, bk)
            return acc + dot_nt(x_ref[:, pl.ds(k0, bk)], q_ref[:, pl.ds(k0, bk)].astype(dt), precision)

        o_ref[...] = jax.lax.fori_loop(0, n_k, body, jnp.zeros(o_ref.shape, F32)) * s_ref[...]
        return

    xe_ref, xo_ref, p_ref, s_ref, *z_ref, o_ref = refs
    h, ngb, per = bk // 2, bk // group, group // 2

    def body(k, acc):
        kb = pl.multiple_of(k * h, h)
        kg = pl.multiple_of(k * ngb, ngb)
        s = _spread_gpu(s_ref[:, pl.ds(kg, ngb)], per)
        z = _spread_gpu(z_ref[0][:, pl.ds(kg, ngb)].astype(F32), per) if z_ref else None
        lo, hi = _decode(kind, p_ref[:, pl.ds(kb, h)].astype(jnp.int32), s, z)
        return (acc + dot_nt(xe_ref[:, pl.ds(kb, h)], lo.astype(dt), precision)
                + dot_nt(xo_ref[:, pl.ds(kb, h)], hi.astype(dt), precision))

    o_ref[...] = jax.lax.fori_loop(0, n_k, body, jnp.zeros(o_ref.shape, F32))


def _gpu_call(f: Fields, xargs, warrs, b: Blocks, Mp, Jp, Ip, dt, interpret, cost, num_warps, num_stages):
    bm, bn, bk = b
    whole = lambda cols: pl.BlockSpec((bn, cols), lambda i, j: (j, 0))  # noqa: E731 (whole rows; sliced inside)
    if f.kind == "int8":
        in_specs = [pl.BlockSpec((bm, Ip), lambda i, j: (i, 0)), whole(Ip), pl.BlockSpec((1, bn), lambda i, j: (0, j))]
    else:
        x_spec = pl.BlockSpec((bm, Ip // 2), lambda i, j: (i, 0))
        in_specs = [x_spec, x_spec, whole(Ip // 2), *[whole(Ip // f.group)] * (len(warrs) - 1)]
    kernel = functools.partial(_gpu_kernel, kind=f.kind, n_k=Ip // bk, bk=bk, group=f.group, dt=dt,
                               precision=precision_for(dt))
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((Mp, Jp), F32), grid=(Mp // bm, Jp // bn), in_specs=in_specs,
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        compiler_params=compiler_params("gpu", interpret, num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, cost_estimate=cost, name="qmatmul",
    )(*xargs, *warrs)


# -- entry ----------------------------------------------------------------------------------------------------


def matmul(x_MI, w, *, platform="gpu", interpret=False, block_m=None, block_n=None, block_k=None, num_warps=None,
           num_stages=None):
    """Same contract as :func:`kernels_pallas.qmatmul.reference.matmul`: ``[M, J]`` float32. ``x`` is bfloat16 or
    float32 (the products' dtype); ``platform`` picks the TPU or the GPU kernel (both run under ``interpret``)."""
    f = fields(w)
    dt = jnp.dtype(x_MI.dtype)
    if dt not in (jnp.dtype(BF16), jnp.dtype(F32)):
        raise ValueError(f"qmatmul: activations are {dt.name}; the kernels take bfloat16 or float32")
    if x_MI.ndim != 2 or x_MI.shape[1] != f.I:
        raise ValueError(f"qmatmul: x {x_MI.shape} does not match a weight of input width {f.I}")
    M = x_MI.shape[0]
    b = blocks(f.kind, M, f.J, f.I, f.group, dt, platform, block_m=block_m, block_n=block_n, block_k=block_k)
    Mp, Jp, Ip = round_up(M, b.bm), round_up(f.J, b.bn), round_up(f.I, b.bk)
    x = pad_axis(pad_axis(x_MI, 0, Mp), 1, Ip)
    warrs = _pad_weight(f, Jp, Ip)
    xargs = (x,) if f.kind == "int8" else (x[:, 0::2], x[:, 1::2])  # even columns meet low nibbles, odd high
    nbytes = sum(math.prod(a.shape) * a.dtype.itemsize for a in (*xargs, *warrs)) + Mp * Jp * 4
    cost = pl.CostEstimate(flops=2 * Mp * Jp * Ip, transcendentals=0, bytes_accessed=nbytes)
    if platform == "tpu":
        out = _tpu_call(f, xargs, warrs, b, Mp, Jp, Ip, dt, interpret, cost)
    else:
        out = _gpu_call(f, xargs, warrs, b, Mp, Jp, Ip, dt, interpret, cost, num_warps, num_stages)
    return out[:M, :f.J]
