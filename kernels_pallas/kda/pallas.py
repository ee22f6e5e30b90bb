"""Kimi Delta Attention in Pallas: chunked (WY/UT) prefill and a fused recurrent decode step.

Both kernels run one program per (sequence, head, block of value columns): the delta rule updates each value
column of the state independently (``S[:, v]`` depends only on ``v_t[v]``), so splitting U costs only a
recomputation of the chunk's key-side quantities. The state stays in float32 on chip for the whole sequence.

Chunked prefill, per chunk of C tokens with ``G = cumsum(g)`` inside the chunk (computed outside the kernel):

* pairwise decayed products ``A[i, j] = sum_c x_ic k_jc exp(G_ic - G_jc)`` for j <= i, built one column j at a
  time with the exponent taken from the difference ``G_i - G_j <= 0``: exact and overflow-free for any gate
  (Kimi Linear's softplus decay is unbounded; factorising ``exp(G_i) exp(-G_j)`` would overflow);
* ``(I + L)^-1`` for the strictly lower ``L = diag(beta) A_kk`` by the nilpotent product
  ``(I - L)(I + L^2)(I + L^4)...`` -- log2(C) small matmuls instead of a row-by-row substitution;
* ``U = T diag(beta) V``, ``W = T diag(beta) (Gamma * K)``, ``V' = U - W S``, ``O = (Gamma * Q) S + A_qk V'``,
  ``S <- Diag(Gamma_last) S + (exp(G_last - G) * K)^T V'``.

Inside the kernel the state is kept transposed (``[U, K]``) so the per-channel decay is a row broadcast.
All products are float32 at full precision (Triton would otherwise use TF32).

Per backend: on GPU a program walks all chunks of its sequence from whole-sequence refs (pointers); on TPU the
chunks are a sequential grid axis (only one chunk's tiles in VMEM) and the state is carried in VMEM scratch.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas._common import (
    F32,
    HIGHEST,
    NEG,
    compiler_params,
    dot_nn,
    dot_nt,
    dot_tn,
    next_pow2,
    pad_axis,
    round_up,
)


def _chunk_math(q, k, G, v, beta, St, column_of, g_last, *, C):
    """One chunk. q (already scaled), k, G: [C, K]; v: [C, BU]; beta: [C, 1]; St: [BU, K] transposed state;
    ``column_of(j)`` loads row j of (k, G) as [1, K]; g_last: [1, K]. Returns (o [C, BU], new St)."""
    rows = jax.lax.broadcasted_iota(jnp.int32, (C, 1), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (1, C), 1)
    dot = functools.partial(dot_nn, precision=HIGHEST)

    def column(j, acc):
        a_kk, a_qk = acc
        kj, Gj = column_of(j)
        kd = jnp.exp(jnp.where(rows >= j, G - Gj, NEG)) * kj  # [C, K]: rows i >= j, decayed from j to i
        sel = cols == j
        a_kk = a_kk + jnp.where(sel, jnp.sum(k * kd, axis=1, keepdims=True), 0.0)
        a_qk = a_qk + jnp.where(sel, jnp.sum(q * kd, axis=1, keepdims=True), 0.0)
        return a_kk, a_qk

    zero = jnp.zeros((C, C), F32)
    a_kk, a_qk = jax.lax.fori_loop(0, C, column, (zero, zero))
    L = jnp.where(rows > cols, a_kk * beta, 0.0)
    a_qk = jnp.where(rows >= cols, a_qk, 0.0)
    # (I + L)^-1 = sum_n (-L)^n (L nilpotent) = (I - L)(I + L^2)(I + L^4)...
    n_doublings = int(math.ceil(math.log2(C)))
    T = (rows == cols).astype(F32) - L
    P = dot(L, L)
    for step in range(n_doublings - 1):
        T = T + dot(T, P)
        if step < n_doublings - 2:
            P = dot(P, P)
    gamma = jnp.exp(G)
    u = dot(T, beta * v)  # [C, BU]
    w = dot(T, beta * gamma * k)  # [C, K]
    v_new = u - dot_nt(w, St, HIGHEST)  # w @ S
    o = dot_nt(gamma * q, St, HIGHEST) + dot(a_qk, v_new)
    kd = jnp.exp(g_last - G) * k
    return o, St * jnp.exp(g_last) + dot_tn(v_new, kd, HIGHEST)


def _chunk_kernel(q_ref, k_ref, G_ref, v_ref, beta_ref, s0_ref, o_ref, s_ref, *, C, n_chunks, scale):
    """GPU: one program walks all chunks of its (sequence, head, value block); the state stays in registers."""

    def chunk(c, St):  # St: [BU, K], the transposed state
        c0 = pl.multiple_of(c * C, C)
        o, St = _chunk_math(
            q_ref[pl.ds(c0, C), :].astype(F32) * scale, k_ref[pl.ds(c0, C), :].astype(F32), G_ref[pl.ds(c0, C), :],
            v_ref[pl.ds(c0, C), :].astype(F32), beta_ref[pl.ds(c0, C), :], St,
            lambda j: (k_ref[pl.ds(c0 + j, 1), :].astype(F32), G_ref[pl.ds(c0 + j, 1), :]),
            G_ref[pl.ds(c0 + C - 1, 1), :], C=C)
        o_ref[pl.ds(c0, C), :] = o
        return St

    s_ref[...] = jax.lax.fori_loop(0, n_chunks, chunk, s0_ref[...].T).T


def _chunk_kernel_tpu(q_ref, k_ref, G_ref, v_ref, beta_ref, s0_ref, o_ref, s_ref, st_sc, *, C, scale):
    """TPU: chunks are the last (sequential) grid axis, so only one chunk's tiles sit in VMEM; the transposed
    state is carried in VMEM scratch from chunk to chunk."""
    c = pl.program_id(2)

    @pl.when(c == 0)
    def _():
        st_sc[...] = s0_ref[...].T

    o, St = _chunk_math(q_ref[...].astype(F32) * scale, k_ref[...].astype(F32), G_ref[...],
                        v_ref[...].astype(F32), beta_ref[...], st_sc[...],
                        lambda j: (k_ref[pl.ds(j, 1), :].astype(F32), G_ref[pl.ds(j, 1), :]),
                        G_ref[pl.ds(C - 1, 1), :], C=C)
    o_ref[...] = o
    st_sc[...] = St

    @pl.when(c == pl.num_programs(2) - 1)
    def _():
        s_ref[...] = St.T


def kda_chunked(q_BTHK, k_BTHK, v_BTHU, g_BTHK, beta_BTH, state_BHKU=None, *, scale, chunk_size=None,
                platform="gpu", interpret=False, block_v=None, num_warps=None, num_stages=None):
    """Chunked KDA prefill; same contract as :func:`kernels_pallas.kda.reference.kda_chunked`.

    Returns (o ``[B, T, H, U]`` float32, final state ``[B, H, K, U]`` float32). ``chunk_size`` is the kernel's
    own tile (default 32 on GPU, 64 on TPU); any chunk gives the same result up to float32 rounding.
    """
    B, T, H, K = q_BTHK.shape
    U = v_BTHU.shape[-1]
    C = int(chunk_size or (64 if platform == "tpu" else 32))
    if C & (C - 1) or C < 8:
        raise ValueError(f"kda_chunked: chunk_size {C} must be a power of two >= 8")
    Tp = round_up(max(T, 1), C)
    Kp, Up = (next_pow2(K), next_pow2(U)) if platform == "gpu" else (K, U)
    BU = block_v or (min(Up, 64) if platform == "gpu" else Up)
    if Up % BU:
        raise ValueError(f"kda_chunked: block_v {BU} does not divide U = {Up}")

    # Padded steps are inert (g = 0, beta = 0, q = k = v = 0): they leave the state unchanged.
    def head_major(x, width):  # [B, T, H, X] -> [B, H, Tp, X]
        return jnp.transpose(pad_axis(pad_axis(x, 1, Tp), 3, width), (0, 2, 1, 3))

    q = head_major(q_BTHK.astype(F32), Kp)
    k = head_major(k_BTHK.astype(F32), Kp)
    v = head_major(v_BTHU, Up)
    g = pad_axis(pad_axis(g_BTHK.astype(F32), 1, Tp), 3, Kp)
    G = jnp.cumsum(g.reshape(B, Tp // C, C, H, Kp), axis=2).reshape(B, Tp, H, Kp)
    G = jnp.transpose(G, (0, 2, 1, 3))
    beta = jnp.transpose(pad_axis(beta_BTH.astype(F32), 1, Tp), (0, 2, 1))[..., None]  # [B, H, Tp, 1]
    if state_BHKU is None:
        s0 = jnp.zeros((B, H, Kp, Up), F32)
    else:
        s0 = pad_axis(pad_axis(state_BHKU.astype(F32), 2, Kp), 3, Up)

    if platform == "tpu":
        tile = lambda d: pl.BlockSpec((None, None, C, d), lambda b, h, c: (b, h, c, 0))
        state = pl.BlockSpec((None, None, Kp, Up), lambda b, h, c: (b, h, 0, 0))
        o, s = pl.pallas_call(
            functools.partial(_chunk_kernel_tpu, C=C, scale=float(scale)),
            out_shape=(jax.ShapeDtypeStruct((B, H, Tp, Up), F32), jax.ShapeDtypeStruct((B, H, Kp, Up), F32)),
            grid=(B, H, Tp // C),
            in_specs=[tile(Kp), tile(Kp), tile(Kp), tile(Up), tile(1), state],
            out_specs=(tile(Up), state),
            scratch_shapes=[pltpu.VMEM((Up, Kp), F32)],
            interpret=interpret,
            compiler_params=compiler_params(platform, interpret, semantics=("parallel", "parallel", "arbitrary")),
            name="kda_chunked",
        )(q, k, G, v, beta, s0)
    else:
        full = lambda d: pl.BlockSpec((None, None, Tp, d), lambda b, h, j: (b, h, 0, 0))
        vblk = lambda rows: pl.BlockSpec((None, None, rows, BU), lambda b, h, j: (b, h, 0, j))
        o, s = pl.pallas_call(
            functools.partial(_chunk_kernel, C=C, n_chunks=Tp // C, scale=float(scale)),
            out_shape=(jax.ShapeDtypeStruct((B, H, Tp, Up), F32), jax.ShapeDtypeStruct((B, H, Kp, Up), F32)),
            grid=(B, H, Up // BU),
            in_specs=[full(Kp), full(Kp), full(Kp), vblk(Tp), full(1), vblk(Kp)],
            out_specs=(vblk(Tp), vblk(Kp)),
            interpret=interpret,
            compiler_params=compiler_params(platform, interpret, num_warps=num_warps, num_stages=num_stages),
            name="kda_chunked",
        )(q, k, G, v, beta, s0)
    o = jnp.transpose(o, (0, 2, 1, 3))[:, :T, :, :U]
    return o, s[:, :, :K, :U]


def _recurrent_kernel(q_ref, k_ref, g_ref, v_ref, beta_ref, s0_ref, o_ref, s_ref, *, n_steps, scale):
    def step(t, S):  # S: [K, BU]
        q, k, g = q_ref[t], k_ref[t], g_ref[t]  # [K, 1] columns
        S = S * jnp.exp(g)  # decay along the key dimension
        kv = jnp.sum(S * k, axis=0, keepdims=True)  # [1, BU] = S^T k
        S = S + k * ((v_ref[t].astype(F32) - kv) * beta_ref[t])  # delta rule on the decayed state
        o_ref[t] = jnp.sum(S * q, axis=0, keepdims=True) * scale  # read after the update
        return S

    s_ref[...] = jax.lax.fori_loop(0, n_steps, step, s0_ref[...])


def kda_recurrent(q_BTHK, k_BTHK, v_BTHU, g_BTHK, beta_BTH, state_BHKU=None, *, scale, platform="gpu",
                  interpret=False, block_v=None, num_warps=None, num_stages=None):
    """Token-by-token KDA (decode); same contract as :func:`kernels_pallas.kda.reference.kda_recurrent`.

    A bandwidth kernel: each program streams its ``[K, BU]`` state slice in, applies every step on chip, and
    writes it back once -- no matmul units, no intermediate state in HBM. Returns (o ``[B, T, H, U]`` f32, state).
    """
    B, T, H, K = q_BTHK.shape
    U = v_BTHU.shape[-1]
    Kp, Up = (next_pow2(K), next_pow2(U)) if platform == "gpu" else (K, U)
    BU = block_v or (min(Up, 32) if platform == "gpu" else Up)
    if Up % BU:
        raise ValueError(f"kda_recurrent: block_v {BU} does not divide U = {Up}")
    # [B, T, H, X] -> [B, H, T, X, 1] key-side columns / [B, H, T, 1, U] value rows (free for T = 1)
    col = lambda x: jnp.transpose(pad_axis(x.astype(F32), 3, Kp), (0, 2, 1, 3))[..., None]
    q, k, g = col(q_BTHK), col(k_BTHK), col(g_BTHK)
    v = jnp.transpose(pad_axis(v_BTHU, 3, Up), (0, 2, 1, 3))[:, :, :, None, :]
    beta = jnp.transpose(beta_BTH.astype(F32), (0, 2, 1))[..., None, None]  # [B, H, T, 1, 1]
    if state_BHKU is None:
        s0 = jnp.zeros((B, H, Kp, Up), F32)
    else:
        s0 = pad_axis(pad_axis(state_BHKU.astype(F32), 2, Kp), 3, Up)

    cols = pl.BlockSpec((None, None, T, Kp, 1), lambda b, h, j: (b, h, 0, 0, 0))
    rows = pl.BlockSpec((None, None, T, 1, BU), lambda b, h, j: (b, h, 0, 0, j))
    state = pl.BlockSpec((None, None, Kp, BU), lambda b, h, j: (b, h, 0, j))
    o, s = pl.pallas_call(
        functools.partial(_recurrent_kernel, n_steps=T, scale=float(scale)),
        out_shape=(jax.ShapeDtypeStruct((B, H, T, 1, Up), F32), jax.ShapeDtypeStruct((B, H, Kp, Up), F32)),
        grid=(B, H, Up // BU),
        in_specs=[cols, cols, cols, rows, pl.BlockSpec((None, None, T, 1, 1), lambda b, h, j: (b, h, 0, 0, 0)),
                  state],
        out_specs=(rows, state),
        interpret=interpret,
        compiler_params=compiler_params(platform, interpret, num_warps=num_warps, num_stages=num_stages,
                                        semantics=("parallel",) * 3),
        name="kda_recurrent",
    )(q, k, g, v, beta, s0)
    o = jnp.transpose(o[:, :, :, 0, :], (0, 2, 1, 3))[..., :U]
    return o, s[:, :, :K, :U]
