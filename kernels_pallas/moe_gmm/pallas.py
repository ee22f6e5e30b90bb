"""MoE expert matmuls in Pallas, with bf16/f32 weights or MXFP4 weights unpacked inside the kernel.

MXFP4 stays packed in HBM (uint8 ``[E, J, I/2]`` + E8M0 ``[E, J, I/32]``, ~0.53 byte per weight) and is decoded
tile by tile next to the multiply. Byte j of a row holds element 2j (low nibble) and 2j+1 (high nibble); rather
than interleave nibbles in the kernel, the wrapper splits the *activations* into even and odd columns once, and
the kernel multiplies low nibbles with even columns and high nibbles with odd ones. E2M1 codes decode with a few
compares (no table gather); the power-of-two scale is built from its exponent bits, so decoding is exact.

Two kernels:

* :func:`gmm` (prefill-shaped): rows sorted by expert, ragged group sizes. The wrapper pads every group to a
  multiple of the row tile so each tile belongs to one expert (empty groups get no tile), and gives each tile its
  expert id; the kernel reads that expert's weights. Tiles past the last used one skip all work.
* :func:`gather_matmul` (decode-shaped): one program per (token, chosen expert) pair and output block, a
  matrix-vector product that streams only the chosen experts' weights: a bandwidth kernel, no matmul units.

Per backend: on GPU (Triton) the kernel indexes the expert inside the whole weight array (Triton has no scalar
prefetch); on TPU (Mosaic) the expert ids are scalar-prefetched and select the weight block in the index map, so
only that expert's tile is copied to VMEM.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import quant
from kernels_pallas._common import (
    F32,
    cdiv,
    compiler_params,
    dot_nt,
    next_pow2,
    pad_axis,
    pow2_divisor,
    round_up,
)
from kernels_pallas._dispatch import KernelUnavailable
from kernels_pallas.mxfp4 import GROUP, MXFP4Weight


def _decode_e2m1(codes):
    """int32 nibbles (0..15) -> float32 E2M1 values: 0, .5, 1, 1.5, 2, 3, 4, 6 and their negatives."""
    mag = (codes & 7).astype(F32)
    val = jnp.where(mag < 4, mag * 0.5, jnp.where(mag < 6, mag - 2.0, mag * 2.0 - 8.0))
    return jnp.where(codes >= 8, -val, val)


def _decode_e8m0(s):
    """uint8 exponents -> float32 2^(s - 127), exactly (255 is NaN; 0 is the subnormal 2^-127)."""
    s = s.astype(jnp.int32)
    val = jax.lax.bitcast_convert_type(jnp.left_shift(s, 23), F32)
    val = jnp.where(s == 0, jnp.float32(2.0**-127), val)
    return jnp.where(s == 255, jnp.float32(jnp.nan), val)


def _expand_scale(sc, width, platform):
    """[rows, n_groups] scales -> [rows, width] with each scale repeated over its 16 packed bytes."""
    rows, n_groups = sc.shape
    if platform == "tpu":  # one-hot matmul: Mosaic reshapes below 128 lanes are not safe
        onehot = (jax.lax.broadcasted_iota(jnp.int32, (n_groups, width), 1) // (GROUP // 2)
                  == jax.lax.broadcasted_iota(jnp.int32, (n_groups, width), 0)).astype(F32)
        return jax.lax.dot_general(sc, onehot, (((1,), (0,)), ((), ())), preferred_element_type=F32,
                                   precision=jax.lax.Precision.HIGHEST)
    return jnp.broadcast_to(sc[:, :, None], (rows, n_groups, GROUP // 2)).reshape(rows, width)


def _mxfp4_halves(packed, scale, platform):
    """Packed bytes [rows, ih] + scale bytes [rows, ih/16] -> (low, high) float32 weights [rows, ih] each (ih = I/2)."""
    b = packed.astype(jnp.int32)
    sc = _expand_scale(_decode_e8m0(scale), b.shape[1], platform)
    return _decode_e2m1(b & 15) * sc, _decode_e2m1(jnp.right_shift(b, 4)) * sc


# -- grouped matmul (prefill-shaped) ----------------------------------------------------------------------


def _gmm_kernel(*refs, quant, bk, n_k, dt, platform, precision):
    ids_ref, active_ref = refs[0], refs[1]
    if quant:
        xe_ref, xo_ref, wp_ref, ws_ref, o_ref = refs[2:]
    else:
        x_ref, w_ref, o_ref = refs[2:]
    i = pl.program_id(0)
    e = ids_ref[i]
    # GPU: whole weight array, indexed by the expert here; TPU: the index map already selected the expert.
    sel = (lambda ref, ks: ref[e, :, ks]) if platform != "tpu" else (lambda ref, ks: ref[:, ks])

    @pl.when(active_ref[i] > 0)
    def _():
        def body(kk, acc):
            if quant:
                h = bk // 2
                kb = pl.multiple_of(kk * h, h)
                lo, hi = _mxfp4_halves(sel(wp_ref, pl.ds(kb, h)), sel(ws_ref, pl.ds(kk * (bk // GROUP), bk // GROUP)),
                                       platform)
                acc = acc + dot_nt(xe_ref[:, pl.ds(kb, h)], lo.astype(dt), precision)
                return acc + dot_nt(xo_ref[:, pl.ds(kb, h)], hi.astype(dt), precision)
            k0 = pl.multiple_of(kk * bk, bk)
            return acc + dot_nt(x_ref[:, pl.ds(k0, bk)], sel(w_ref, pl.ds(k0, bk)).astype(dt), precision)

        o_ref[...] = jax.lax.fori_loop(0, n_k, body, jnp.zeros(o_ref.shape, F32))

    @pl.when(active_ref[i] == 0)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, F32)


def _blocks(J, I, *, quant, platform, block_n, block_k, k_target=512):
    """Output (``block_n``, over J) and contraction (``block_k``, over I) blocks, the tile knobs of :func:`gmm`
    (with ``block_m`` rows) and :func:`gather_matmul` in GEMM terms, that divide J and I where they can,
    so the (large) weight arrays are never padded at real sizes; a dimension with no power-of-two factor large
    enough (the tiny test models' 32-wide MXFP4 experts) takes the smallest block and the wrapper pads it
    (:func:`_pad_i`)."""
    if platform == "tpu":
        bn = block_n or next((b for b in (512, 256, 128) if J % b == 0), J)
        return bn, I  # whole I per step on TPU (no lane-misaligned slices)
    k_min = 64 if quant else 16
    bn = block_n or pow2_divisor(J, 64, 16) or 16
    bk = block_k or pow2_divisor(I, k_target, k_min) or k_min
    return bn, bk


def _pad_i(x, warrs, I, Ip, quant):
    """Zero columns ``I..Ip`` of the activations and weights (MXFP4: code 0 is +0.0 whatever its scale)."""
    if Ip == I:
        return x, warrs
    x = pad_axis(x, -1, Ip)
    if quant:
        packed, scale = warrs
        return x, (pad_axis(packed, -1, Ip // 2), pad_axis(scale, -1, Ip // GROUP, value=127))
    return x, tuple(pad_axis(a, -1, Ip) for a in warrs)


def _weight_arrays(w, dt):
    """(MXFP4?, the weight's arrays, E, J, I) of a ``[E, J, I]`` weight."""
    if isinstance(w, quant.TYPES):
        raise KernelUnavailable(f"moe_gmm: {type(w).__name__} expert weights have no Pallas kernel yet (MXFP4 and "
                                "float experts do); quantize without the 'experts' class on TPU / GPU")
    if isinstance(w, MXFP4Weight):
        packed, scale = w
        E, J, ih = packed.shape
        if scale.shape != (E, J, ih * 2 // GROUP):
            raise ValueError(f"MXFP4 packed {packed.shape} and scale {scale.shape} do not match")
        return True, (packed, scale), E, J, ih * 2
    E, J, I = w.shape
    return False, (w,), E, J, I


def _split_even_odd(x):
    return x[..., 0::2], x[..., 1::2]


class _TilePlan(NamedTuple):
    """Rows sorted by expert cut into tiles of ``bm`` rows, each tile within one group (arrays int32)."""

    bm: int
    n_tiles: int  # static bound on the tiles used: cdiv(M, bm) + min(E, M)
    gs: jax.Array  # [E] group sizes
    starts: jax.Array  # [E] first sorted row of each group
    tiles: jax.Array  # [E] tiles of each group: ceil(gs / bm), 0 for an empty group
    tile_end: jax.Array  # [E] cumulative tiles: group e owns tiles tile_end[e] - tiles[e] .. tile_end[e] - 1
    used: jax.Array  # [] tiles in use
    tile_e: jax.Array  # [n_tiles] expert of each tile
    active: jax.Array  # [n_tiles] 1 for a used tile, 0 past the last one


def _tile_plan(group_sizes_E, M: int, E: int, bm: int) -> _TilePlan:
    """Group e gets ceil(size_e / bm) tiles; n_tiles bounds the total statically."""
    gs = group_sizes_E.astype(jnp.int32)
    starts = jnp.cumsum(gs) - gs
    tiles = (gs + bm - 1) // bm
    tile_end = jnp.cumsum(tiles)
    used = tile_end[-1]
    n_tiles = cdiv(M, bm) + min(E, M)
    t = jnp.arange(n_tiles, dtype=jnp.int32)
    tile_e = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), E - 1).astype(jnp.int32)
    # unused tiles repeat the last used expert, so a pipelined (TPU) kernel does not fetch new weights for them
    last_e = tile_e[jnp.maximum(used - 1, 0)]
    tile_e = jnp.where(t < used, tile_e, last_e)
    active = (t < used).astype(jnp.int32)
    return _TilePlan(bm, n_tiles, gs, starts, tiles, tile_end, used, tile_e, active)


def _tile_rows(x_MI, plan: _TilePlan, dt):
    """Sorted rows ``[M, I]`` -> tiled rows ``[n_tiles * bm, I]`` in ``dt``: padded row p <- sorted row src (or
    zeros)."""
    bm, tiles, tile_end = plan.bm, plan.tiles, plan.tile_end
    p = jnp.arange(plan.n_tiles * bm, dtype=jnp.int32)
    pe = plan.tile_e[p // bm]
    off = (p // bm - (tile_end[pe] - tiles[pe])) * bm + p % bm
    valid = (p // bm < plan.used) & (off < plan.gs[pe])
    src = jnp.where(valid, plan.starts[pe] + off, 0)
    return jnp.where(valid[:, None], x_MI[src].astype(dt), jnp.zeros((), dt))


def _untile_rows(out, plan: _TilePlan, M: int, E: int, J: int):
    """Kernel output ``[n_tiles * bm, Jp]`` -> ``[M, J]``: sorted row r from its padded position; rows past
    sum(group_sizes) give zeros."""
    bm, gs, starts, tiles, tile_end = plan.bm, plan.gs, plan.starts, plan.tiles, plan.tile_end
    r = jnp.arange(M, dtype=jnp.int32)
    re = jnp.minimum(jnp.searchsorted(starts + gs, r, side="right"), E - 1)
    pos = (tile_end[re] - tiles[re]) * bm + (r - starts[re])
    keep = r < jnp.sum(gs)
    return jnp.where(keep[:, None], out[jnp.where(keep, pos, 0), :J], 0.0)


def gmm(x_MI, w_EJI, group_sizes_E, *, compute_dtype=None, platform="gpu", interpret=False, block_m=None,
        block_n=None, block_k=None, num_warps=None, num_stages=None):
    """Grouped matmul; same contract as :func:`kernels_pallas.moe_gmm.reference.gmm`. Returns ``[M, J]`` f32."""
    dt = jnp.dtype(compute_dtype or x_MI.dtype)
    quant, warrs, E, J, I = _weight_arrays(w_EJI, dt)
    M = x_MI.shape[0]
    if x_MI.shape[1] != I:
        raise ValueError(f"gmm: x {x_MI.shape} does not match weights of input width {I}")
    # Row tile from the average group size: K3 prefill (896 experts, ~10 rows each) wants 16-row tiles, a few
    # big groups want 64. Each tile reads its expert's weights once, so oversized tiles only waste compute.
    bm = block_m or min(64, max(16, next_pow2(M // max(E, 1))))
    # Triton stages the x and weight tiles of a step in shared memory: 64-row tiles with a 512-wide I step asked
    # 258 KiB of the 227 KiB an H100/H200 block may use (compiled for both), so wide row tiles take shorter steps.
    bn, bk = _blocks(J, I, quant=quant, platform=platform, block_n=block_n, block_k=block_k,
                     k_target=min(512, 16384 // bm))
    plan = _tile_plan(group_sizes_E, M, E, bm)
    xs = _tile_rows(x_MI, plan, dt)  # [n_tiles * bm, I]
    xs, warrs = _pad_i(xs, warrs, I, round_up(I, bk), quant)
    out = _gmm_call(xs, warrs, plan.tile_e, plan.active, E=E, J=J, bm=bm, bn=bn, bk=bk, quant=quant, dt=dt,
                    platform=platform, interpret=interpret, num_warps=num_warps, num_stages=num_stages)
    return _untile_rows(out, plan, M, E, J)


def _gmm_call(xs, warrs, tile_e, active, *, E, J, bm, bn, bk, quant, dt, platform, interpret, num_warps,
              num_stages):
    """The grouped-matmul launch over tiled rows xs ``[n_tiles * bm, Ip]`` (Ip a multiple of bk) and the weight
    arrays of :func:`_weight_arrays` (I-padded), grid (tiles, output blocks). Returns ``[n_tiles * bm, Jp]``
    float32, J padded to a multiple of bn."""
    n_tiles, Ip = tile_e.shape[0], xs.shape[1]
    Jp = round_up(J, bn)
    if Jp != J:
        warrs = tuple(pad_axis(a, 1, Jp) for a in warrs)
    if quant:
        xe, xo = _split_even_odd(xs)
        xargs = (xe, xo)
        x_specs = [pl.BlockSpec((bm, Ip // 2), lambda i, j, *_: (i, 0))] * 2
        wshapes = [(Jp, Ip // 2), (Jp, Ip // GROUP)]
    else:
        xargs = (xs,)
        x_specs = [pl.BlockSpec((bm, Ip), lambda i, j, *_: (i, 0))]
        wshapes = [(Jp, Ip)]
    out_shape = jax.ShapeDtypeStruct((n_tiles * bm, Jp), F32)
    kernel = functools.partial(_gmm_kernel, quant=quant, bk=bk, n_k=Ip // bk, dt=dt, platform=platform,
                               precision=jax.lax.Precision.HIGHEST if dt == jnp.float32 else None)
    params = compiler_params(platform, interpret, num_warps=num_warps, num_stages=num_stages,
                             semantics=("parallel", "parallel"))
    grid = (n_tiles, Jp // bn)
    if platform == "tpu":
        w_specs = [pl.BlockSpec((None, bn, s[1]), lambda i, j, ids, act: (ids[i], j, 0)) for s in wshapes]
        return pl.pallas_call(
            kernel, out_shape=out_shape, interpret=interpret, compiler_params=params, name="moe_gmm",
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=2, grid=grid, in_specs=[*x_specs, *w_specs],
                out_specs=pl.BlockSpec((bm, bn), lambda i, j, ids, act: (i, j))),
        )(tile_e, active, *xargs, *warrs)
    w_specs = [pl.BlockSpec((E, bn, s[1]), lambda i, j: (0, j, 0)) for s in wshapes]
    meta = pl.BlockSpec((n_tiles,), lambda i, j: (0,))
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid, in_specs=[meta, meta, *x_specs, *w_specs],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)), interpret=interpret, compiler_params=params,
        name="moe_gmm",
    )(tile_e, active, *xargs, *warrs)


# -- gathered matrix-vector products (decode-shaped) ------------------------------------------------------


def _gather_kernel(*refs, quant, bk, n_k, dt, platform):
    ids_ref = refs[0]
    if quant:
        xe_ref, xo_ref, wp_ref, ws_ref, o_ref = refs[1:]
    else:
        x_ref, w_ref, o_ref = refs[1:]
    e = ids_ref[pl.program_id(0)]
    sel = (lambda ref, ks: ref[e, :, ks]) if platform != "tpu" else (lambda ref, ks: ref[:, ks])

    def body(kk, acc):  # acc [bn, 1]: weights x activation row, reduced over I on the vector units
        if quant:
            h = bk // 2
            kb = pl.multiple_of(kk * h, h)
            lo, hi = _mxfp4_halves(sel(wp_ref, pl.ds(kb, h)), sel(ws_ref, pl.ds(kk * (bk // GROUP), bk // GROUP)),
                                   platform)
            prod = lo * xe_ref[:, pl.ds(kb, h)].astype(F32) + hi * xo_ref[:, pl.ds(kb, h)].astype(F32)
        else:
            k0 = pl.multiple_of(kk * bk, bk)
            w = sel(w_ref, pl.ds(k0, bk)).astype(dt).astype(F32)
            prod = w * x_ref[:, pl.ds(k0, bk)].astype(F32)
        return acc + jnp.sum(prod, axis=1, keepdims=True)

    o_ref[...] = jax.lax.fori_loop(0, n_k, body, jnp.zeros(o_ref.shape, F32))


def gather_matmul(x_NXI, w_EJI, idx_NX, *, compute_dtype=None, platform="gpu", interpret=False, block_n=None,
                  block_k=None, num_warps=None, num_stages=None):
    """Decode-shaped expert matmul; same contract as the reference. Returns ``[N, X, J]`` float32.

    Products are of compute-dtype values (MXFP4 decodes exactly into any of them), summed in float32.
    """
    dt = jnp.dtype(compute_dtype or x_NXI.dtype)
    quant, warrs, E, J, I = _weight_arrays(w_EJI, dt)
    N, X, Ix = x_NXI.shape
    if Ix != I:
        raise ValueError(f"gather_matmul: x {x_NXI.shape} does not match weights of input width {I}")
    bn, bk = _blocks(J, I, quant=quant, platform=platform, block_n=block_n or (None if platform == "tpu" else 64),
                     block_k=block_k)
    M = N * X  # one program row per (token, chosen expert) slot
    ids = idx_NX.reshape(M).astype(jnp.int32)
    x = x_NXI.reshape(M, 1, I).astype(dt)
    Ip = round_up(I, bk)
    x, warrs = _pad_i(x, warrs, I, Ip, quant)
    Jp = round_up(J, bn)
    if Jp != J:
        warrs = tuple(pad_axis(a, 1, Jp) for a in warrs)
    if quant:
        xargs = _split_even_odd(x)
        x_specs = [pl.BlockSpec((None, 1, Ip // 2), lambda p, j, *_: (p, 0, 0))] * 2
        wshapes = [(Jp, Ip // 2), (Jp, Ip // GROUP)]
    else:
        xargs = (x,)
        x_specs = [pl.BlockSpec((None, 1, Ip), lambda p, j, *_: (p, 0, 0))]
        wshapes = [(Jp, Ip)]
    out_shape = jax.ShapeDtypeStruct((M, Jp, 1), F32)
    kernel = functools.partial(_gather_kernel, quant=quant, bk=bk, n_k=Ip // bk, dt=dt, platform=platform)
    params = compiler_params(platform, interpret, num_warps=num_warps, num_stages=num_stages,
                             semantics=("parallel", "parallel"))
    grid = (M, Jp // bn)
    if platform == "tpu":
        w_specs = [pl.BlockSpec((None, bn, s[1]), lambda p, j, ids: (ids[p], j, 0)) for s in wshapes]
        out = pl.pallas_call(
            kernel, out_shape=out_shape, interpret=interpret, compiler_params=params, name="moe_gather_matmul",
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1, grid=grid, in_specs=[*x_specs, *w_specs],
                out_specs=pl.BlockSpec((None, bn, 1), lambda p, j, ids: (p, j, 0))),
        )(ids, *xargs, *warrs)
    else:
        w_specs = [pl.BlockSpec((E, bn, s[1]), lambda p, j: (0, j, 0)) for s in wshapes]
        out = pl.pallas_call(
            kernel, out_shape=out_shape, grid=grid,
            in_specs=[pl.BlockSpec((M,), lambda p, j: (0,)), *x_specs, *w_specs],
            out_specs=pl.BlockSpec((None, bn, 1), lambda p, j: (p, j, 0)), interpret=interpret,
            compiler_params=params, name="moe_gather_matmul",
        )(ids, *xargs, *warrs)
    return out[:, :J, 0].reshape(N, X, J)
