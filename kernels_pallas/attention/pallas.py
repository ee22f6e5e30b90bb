"""Flash attention in Pallas: one online-softmax kernel for causal prefill, decode over a static cache, MLA with
split nope/rope key dims, and (via ``kernels_pallas.mla_decode``) absorbed MLA over the latent cache.

The kernel sees, per (batch, kv group, query-row block, kv split), a block of query *rows* -- the ``rep`` query
heads sharing a kv head, times the query tokens, flattened -- and the whole key/value sequence of its group as
a ref it slices in a loop. Rows carry their absolute position (``q_pos``); keys sit at ``arange(S)`` (or at
``k_pos``). The loop stops after the last key block any row of the block can see, so a causal prefill skips
the upper triangle and a decode step reads only the filled part of the cache, whatever its static size.

Scores and the softmax run in float32; the ``p @ v`` product takes ``p`` in the value dtype (bf16 on a bf16
model, as flash attention does; exact float32 on a float32 model). A row that sees no key returns zeros (the
reference returns NaN there; no caller produces such rows).

int8 caches (``kernels_pallas.cache_quant.Int8Rows`` keys, values or k_pe): the kernel reads the int8 tiles with
their per-row scales and dequantizes each tile in VMEM / registers (float32 product, rounded to the query dtype)
before the same products; the scales move as ``[.., S, 1]`` blocks beside their tiles.

Long caches can be split over several programs (``num_splits``, flash-decoding): each split writes an
unnormalised partial result with its running max and sum, and a small XLA epilogue merges them. ``with_lse``
returns the log-sum-exp of each row's visible scores beside the result (``-inf`` for a row that sees no key): what
merges the partial results of a cache split by sequence over devices (``kernels_pallas._dispatch.Rule.merge``).

Per backend: on GPU (Triton) each program loops over key blocks of a whole-sequence ref (a pointer; only the
blocks it reads move), reading the static ``[B, S, G, K]`` cache in place. On TPU (Mosaic) a whole-sequence
block would have to fit VMEM, so the key axis is a sequential grid axis with the softmax state in VMEM scratch,
and the number of key blocks each row block needs is scalar-prefetched: the index map stops fetching past it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas._common import (
    F32,
    NEG,
    cdiv,
    compiler_params,
    dot_nn,
    dot_nt,
    key_block,
    next_pow2,
    pad_axis,
    precision_for,
    round_up,
    row_block,
)
from kernels_pallas.cache_quant import split as split_rows
from kernels_pallas.cache_quant import tile

_I32_MAX = jnp.iinfo(jnp.int32).max


def run_and_store(body, lo, hi, bq, U, o_ref, m_ref, l_ref, split):
    """The online-softmax loop over key blocks ``[lo, hi)`` from the empty state, then the result: normalised, or with
    a split its unnormalised partial with the running max and sum (merged by :func:`_merge_splits`)."""
    init = (jnp.full((bq, 1), NEG, F32), jnp.zeros((bq, 1), F32), jnp.zeros((bq, U), F32))
    m, l, acc = jax.lax.fori_loop(lo, hi, body, init)
    if split:
        o_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l
    else:
        o_ref[...] = acc / jnp.where(l > 0, l, 1.0)


def _take_refs(it, has_pe, v_is_k, quant):
    """(k, k scale, kpe, kpe scale, v, v scale) refs in the launch order (scales None when plain)."""
    k_q, kpe_q, v_q = quant
    k_ref = next(it)
    ks_ref = next(it) if k_q else None
    kpe_ref = next(it) if has_pe else None
    kpes_ref = next(it) if (has_pe and kpe_q) else None
    if v_is_k:
        return k_ref, ks_ref, kpe_ref, kpes_ref, k_ref, ks_ref
    v_ref = next(it)
    vs_ref = next(it) if v_q else None
    return k_ref, ks_ref, kpe_ref, kpes_ref, v_ref, vs_ref


def _load(ref, scale_ref, index, dtype):
    """A key / value tile ``ref[index]``: as stored, or int8 codes dequantized by their row scales to ``dtype``."""
    if scale_ref is None:
        return ref[index]
    return tile(ref[index], scale_ref[index], dtype)


def _kernel(*refs, bk, blocks_per_split, has_pe, v_is_k, has_kpos, split, scale, precision, quant):
    """GPU (and interpret): one program per (batch, group, row block, split) loops over its key blocks."""
    it = iter(refs)
    qpos_ref, q_ref = next(it), next(it)
    qpe_ref = next(it) if has_pe else None
    k_ref, ks_ref, kpe_ref, kpes_ref, v_ref, vs_ref = _take_refs(it, has_pe, v_is_k, quant)
    kpos_ref = next(it) if has_kpos else None
    o_ref = next(it)
    m_ref, l_ref = (next(it), next(it)) if split else (None, None)

    qpos = qpos_ref[...]  # [bq, 1] int32
    q = q_ref[...]  # [bq, K]
    qpe = qpe_ref[...] if has_pe else None
    bq, U = q.shape[0], v_ref.shape[-1]
    n_blocks = k_ref.shape[0] // bk
    if has_kpos:
        needed = n_blocks
    else:  # keys sit at arange(S): blocks past the largest query position hold nothing visible
        needed = jnp.minimum((jnp.max(qpos) + bk) // bk, n_blocks)
    lo = pl.program_id(3) * blocks_per_split
    hi = jnp.minimum(lo + blocks_per_split, needed)

    def body(i, carry):
        m, l, acc = carry
        s0 = pl.multiple_of(i * bk, bk)
        rows = (pl.ds(s0, bk), slice(None))
        k = _load(k_ref, ks_ref, rows, q.dtype)
        s = dot_nt(q, k, precision)
        if has_pe:
            s = s + dot_nt(qpe, _load(kpe_ref, kpes_ref, rows, q.dtype), precision)
        s = s * scale
        if has_kpos:
            kpos = kpos_ref[:, pl.ds(s0, bk)]
        else:
            kpos = s0 + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        visible = kpos <= qpos  # [bq, bk]
        s = jnp.where(visible, s, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
        v = k if v_is_k else _load(v_ref, vs_ref, rows, q.dtype)
        acc = alpha * acc + dot_nn(p.astype(v.dtype), v, precision)
        return m_new, l, acc

    run_and_store(body, lo, hi, bq, U, o_ref, m_ref, l_ref, split)


def _tpu_kernel(need_ref, *refs, bk, n_q, has_pe, v_is_k, has_kpos, with_lse, scale, precision, quant):
    """TPU: the key axis is the last (sequential) grid axis; m, l and the accumulator live in VMEM scratch, and
    key blocks past what the row block can see are neither fetched (the index map repeats the last needed block)
    nor computed."""
    it = iter(refs)
    qpos_ref, q_ref = next(it), next(it)
    qpe_ref = next(it) if has_pe else None
    k_ref, ks_ref, kpe_ref, kpes_ref, v_ref, vs_ref = _take_refs(it, has_pe, v_is_k, quant)
    kpos_ref = next(it) if has_kpos else None
    o_ref = next(it)
    m_ref, l_ref = (next(it), next(it)) if with_lse else (None, None)
    m_sc, l_sc, acc_sc = next(it), next(it), next(it)
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, NEG, F32)
        l_sc[...] = jnp.zeros(l_sc.shape, F32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, F32)

    @pl.when(j < need_ref[b * n_q + i])
    def _():
        q = q_ref[...]
        k = _load(k_ref, ks_ref, ..., q.dtype)
        s = dot_nt(q, k, precision)
        if has_pe:
            s = s + dot_nt(qpe_ref[...], _load(kpe_ref, kpes_ref, ..., q.dtype), precision)
        s = s * scale
        kpos = kpos_ref[...] if has_kpos else j * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        visible = kpos <= qpos_ref[...]
        s = jnp.where(visible, s, NEG)
        m_prev = m_sc[...]  # [bq, 128], every lane equal (lane-dense scratch)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.where(visible, jnp.exp(s - m_new[:, :1]), 0.0)
        alpha = jnp.exp(m_prev - m_new)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        m_sc[...] = m_new
        v = k if v_is_k else _load(v_ref, vs_ref, ..., q.dtype)
        acc_sc[...] = alpha[:, :1] * acc_sc[...] + dot_nn(p.astype(v.dtype), v, precision)

    @pl.when(j == pl.num_programs(3) - 1)
    def _():
        l = l_sc[:, :1]
        o_ref[...] = acc_sc[...] / jnp.where(l > 0, l, 1.0)
        if with_lse:  # lane-dense [bq, 128] copies of the running max and sum
            m_ref[...] = m_sc[...]
            l_ref[...] = l_sc[...]


def flash(q_BGAK, k, v, qpos_BA, *, scale, q_pe_BGAO=None, k_pe_BSO=None, k_pos_BS=None, v_is_k=False,
          platform="gpu", interpret=False, block_q=None, block_k=None, num_splits=1, num_warps=None,
          num_stages=None, with_lse=False):
    """The kernel over query rows grouped by kv head. Returns o ``[B, G, A, U]`` float32 (with ``with_lse``: and
    the rows' log-sum-exp ``[B, G, A]``, ``-inf`` where a row sees no key).

    q ``[B, G, A, K]`` (A rows per kv group), k ``[B, S, Gk, K]``, v ``[B, S, Gk, U]`` with Gk = G (or 1, shared
    by every group), qpos ``[B, A]`` int32 (row positions, the same for every group). Optional split key dims:
    q_pe ``[B, G, A, O]`` against k_pe ``[B, S, O]`` (shared by all groups). ``v_is_k``: values are the keys
    (absorbed MLA reads its latent cache once per block). ``num_splits`` applies on GPU only. k, v and k_pe may
    each be int8 rows (``Int8Rows``: scales ``[B, S, Gk, 1]`` / ``[B, S, 1]``), dequantized per tile to q's dtype.
    """
    B, G, A, K = q_BGAK.shape
    S, Gk = k.shape[1], k.shape[2]
    (k, ks), (v, vs), (k_pe_BSO, kpes) = split_rows(k), split_rows(v), split_rows(k_pe_BSO)
    quant = (ks is not None, kpes is not None, vs is not None)
    if Gk not in (1, G):
        raise ValueError(f"flash: k has {Gk} kv groups for q with {G}")
    has_pe = q_pe_BGAO is not None
    has_kpos = k_pos_BS is not None
    if not v_is_k and v.shape[:3] != k.shape[:3]:
        raise ValueError(f"flash: v {v.shape} does not match k {k.shape}")
    dt = q_BGAK.dtype
    bq = block_q or row_block(A, 64, platform, dt)
    bk = block_k or key_block(S, 64 if platform == "gpu" else 512, platform)
    q, k, v, qpos, qpe, kpe, kpos, U = _pad_operands(
        q_BGAK, k, v, qpos_BA, q_pe_BGAO, k_pe_BSO, k_pos_BS, Ap=round_up(A, bq), Sp=round_up(S, bk), v_is_k=v_is_k,
        platform=platform)
    Sp = k.shape[1]
    scales = tuple(None if x is None else pad_axis(x, 1, Sp) for x in (ks, kpes, vs))  # padded keys: scale 0
    Up = k.shape[-1] if v_is_k else v.shape[-1]
    kw = dict(has_pe=has_pe, v_is_k=v_is_k, has_kpos=has_kpos, scale=float(scale), precision=precision_for(dt),
              quant=quant)
    if platform == "tpu":
        out, m, l = _flash_tpu(q, k, v, qpos, qpe, kpe, kpos, scales, bq=bq, bk=bk, Up=Up, interpret=interpret,
                               with_lse=with_lse, **kw)
    else:
        out, m, l = _flash_gpu(q, k, v, qpos, qpe, kpe, kpos, scales, bq=bq, bk=bk, Up=Up, num_splits=num_splits,
                               platform=platform, interpret=interpret, num_warps=num_warps, num_stages=num_stages,
                               with_lse=with_lse, **kw)
    if not with_lse:
        return out[:, :, :A, :U]
    return out[:, :, :A, :U], jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)[:, :, :A]


def _pad_operands(q_BGAK, k, v, qpos_BA, q_pe_BGAO, k_pe_BSO, k_pos_BS, *, Ap, Sp, v_is_k, platform):
    """Operands padded to whole blocks: rows to ``Ap`` (positions -1 see nothing), keys to ``Sp`` (zeros at
    positions >= S; without ``k_pos`` the row positions are capped at S - 1, which shows a row the same real keys
    and none of the padding, also a row past the end of one slice of a sequence-split cache), and on GPU the head
    dims to powers of two (zero columns add nothing to a dot). Returns q ``[B, G, Ap, Kp]``, k ``[B, Sp, Gk, Kp]``,
    v ``[B, Sp, Gk, Up]`` (as given when ``v_is_k``), qpos ``[B, Ap, 1]`` int32, q_pe ``[B, G, Ap, Op]`` and k_pe
    ``[B, Sp, Op]`` (or None), k_pos ``[B, 1, Sp]`` int32 (or None; padded keys at int32 max) and U, the value width
    to return: v's, or when ``v_is_k`` the keys' own width K, not the padded Kp (the padded columns of a latent
    that serves as values are zeros, and must not reach the caller)."""

    def heads(x, axis):
        return pad_axis(x, axis, next_pow2(x.shape[axis])) if platform == "gpu" else x

    has_pe = q_pe_BGAO is not None
    K = q_BGAK.shape[-1]
    q = heads(pad_axis(q_BGAK, 2, Ap), 3)
    qpos = qpos_BA.astype(jnp.int32)
    if k_pos_BS is None:
        qpos = jnp.minimum(qpos, k.shape[1] - 1)
    qpos = pad_axis(qpos, 1, Ap, -1)[..., None]  # [B, Ap, 1]
    k = heads(pad_axis(k, 1, Sp), 3)
    Kp = q.shape[-1]
    if k.shape[-1] != Kp:
        raise ValueError(f"flash: q head dim {K} and k head dim {k.shape[-1]} differ")
    U = K if v_is_k else v.shape[-1]
    if not v_is_k:
        v = heads(pad_axis(v, 1, Sp), 3)
    qpe = heads(pad_axis(q_pe_BGAO, 2, Ap), 3) if has_pe else None
    kpe = heads(pad_axis(k_pe_BSO, 1, Sp), 2) if has_pe else None
    kpos = pad_axis(k_pos_BS.astype(jnp.int32), 1, Sp, _I32_MAX)[:, None, :] if k_pos_BS is not None else None
    return q, k, v, qpos, qpe, kpe, kpos, U


def _flash_gpu(q, k, v, qpos, qpe, kpe, kpos, scales, *, bq, bk, Up, num_splits, platform, interpret, num_warps,
               num_stages, has_pe, v_is_k, has_kpos, with_lse, **kw):
    """GPU (and interpret) launch: grid (B, G, row blocks, kv splits) over the padded operands of
    :func:`_pad_operands`; each program loops over its share of the key blocks. Returns o ``[B, G, Ap, Up]``
    float32 (split partial results merged here) and, with ``with_lse``, each row's max score and softmax sum
    ``[B, G, Ap]`` (else None, None)."""
    B, G, Ap = q.shape[:3]
    n_blocks = k.shape[1] // bk
    splits = max(1, min(int(num_splits), n_blocks))
    per_split = cdiv(n_blocks, splits)
    splits = cdiv(n_blocks, per_split)  # no empty split
    args, in_specs = _gpu_inputs(q, k, v, qpos, qpe, kpe, kpos, scales, bq=bq, Up=Up, has_pe=has_pe, v_is_k=v_is_k,
                                 has_kpos=has_kpos)
    split = splits > 1 or with_lse  # the partial form writes the running max and sum
    if split:
        out_shape = [jax.ShapeDtypeStruct((B, G, splits, Ap, Up), F32),
                     jax.ShapeDtypeStruct((B, G, splits, Ap, 1), F32),
                     jax.ShapeDtypeStruct((B, G, splits, Ap, 1), F32)]
        part = lambda d: pl.BlockSpec((None, None, None, bq, d), lambda b, g, i, j: (b, g, j, i, 0))
        out_specs = [part(Up), part(1), part(1)]
    else:
        out_shape = jax.ShapeDtypeStruct((B, G, Ap, Up), F32)
        out_specs = pl.BlockSpec((None, None, bq, Up), lambda b, g, i, j: (b, g, i, 0))

    kernel = functools.partial(_kernel, bk=bk, blocks_per_split=per_split, split=split, has_pe=has_pe,
                               v_is_k=v_is_k, has_kpos=has_kpos, **kw)
    out = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(B, G, Ap // bq, splits), in_specs=in_specs, out_specs=out_specs,
        interpret=interpret,
        compiler_params=compiler_params(platform, interpret, num_warps=num_warps, num_stages=num_stages),
        name="flash_attention",
    )(*args)
    if not split:
        return out, None, None
    return _merge_splits(*out, stats=True)


def _gpu_inputs(q, k, v, qpos, qpe, kpe, kpos, scales, *, bq, Up, has_pe, v_is_k, has_kpos):
    """The operands in :func:`_kernel`'s order and their block specs over the grid (b, g, i, j): a row block of q
    (and q_pe, qpos), the whole key sequence of group g (k, k_pe, v, k_pos, and the scales of int8 ones)."""
    G, Kp = q.shape[1], q.shape[-1]
    Sp, Gk = k.shape[1], k.shape[2]
    ks, kpes, vs = scales
    row_spec = lambda d: pl.BlockSpec((None, None, bq, d), lambda b, g, i, j: (b, g, i, 0))
    # Triton takes the strided [B, S, Gk, K] cache as it is: no transposed copy of a static cache per step
    kv_spec = lambda d: pl.BlockSpec(
        (None, Sp, None, d), (lambda b, g, i, j: (b, 0, g, 0)) if Gk == G else (lambda b, g, i, j: (b, 0, 0, 0)))
    args = [qpos, q]
    in_specs = [pl.BlockSpec((None, bq, 1), lambda b, g, i, j: (b, i, 0)), row_spec(Kp)]
    if has_pe:
        args.append(qpe)
        in_specs.append(row_spec(qpe.shape[-1]))
    seq = lambda d: pl.BlockSpec((None, Sp, d), lambda b, g, i, j: (b, 0, 0))
    operands = [(k, kv_spec(Kp)), (ks, kv_spec(1))]
    if has_pe:
        operands += [(kpe, seq(kpe.shape[-1])), (kpes, seq(1))]
    if not v_is_k:
        operands += [(v, kv_spec(Up)), (vs, kv_spec(1))]
    for x, spec in operands:
        if x is not None:
            args.append(x)
            in_specs.append(spec)
    if has_kpos:
        args.append(kpos)
        in_specs.append(pl.BlockSpec((None, 1, Sp), lambda b, g, i, j: (b, 0, 0)))
    return args, in_specs


def _merge_splits(acc, m, l, stats=False):
    """Flash-decoding epilogue: unnormalised partials acc ``[B, G, splits, Ap, Up]`` with their running max m and
    sum l ``[B, G, splits, Ap, 1]`` -> normalised ``[B, G, Ap, Up]`` (rows that saw no key: zeros); with ``stats``
    also the merged max and sum ``[B, G, Ap]``."""
    m_all = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - m_all)
    num, den = jnp.sum(w * acc, axis=2), jnp.sum(w * l, axis=2)
    o = num / jnp.where(den > 0, den, 1.0)
    return (o, m_all[:, :, 0, :, 0], den[..., 0]) if stats else o


def _flash_tpu(q, k, v, qpos, qpe, kpe, kpos, scales, *, bq, bk, Up, interpret, has_pe, v_is_k, has_kpos, with_lse,
               **kw):
    """TPU launch: grid (B, G, row blocks, key blocks), kv-major [B, Gk, S, K] blocks of ``bk`` keys, and the
    number of key blocks each row block needs scalar-prefetched into SMEM. Returns o ``[B, G, Ap, Up]`` and, with
    ``with_lse``, each row's max score and softmax sum ``[B, G, Ap]`` (else None, None)."""
    B, G, Ap, Kp = q.shape
    Sp, Gk = k.shape[1], k.shape[2]
    nq, nk = Ap // bq, Sp // bk
    if has_kpos:
        need = jnp.full((B * nq,), nk, jnp.int32)
    else:
        need = jnp.clip((jnp.max(qpos.reshape(B, nq, bq), axis=2) + bk) // bk, 0, nk).reshape(B * nq)
    last = lambda b, i, j, need: jnp.maximum(jnp.minimum(j, need[b * nq + i] - 1), 0)  # no fetch past the need
    kv_major = lambda x: jnp.swapaxes(x, 1, 2)  # Mosaic wants whole trailing dims
    kv_spec = lambda d: pl.BlockSpec(
        (None, None, bk, d), lambda b, g, i, j, need: (b, g if Gk == G else 0, last(b, i, j, need), 0))
    row_spec = lambda d: pl.BlockSpec((None, None, bq, d), lambda b, g, i, j, need: (b, g, i, 0))
    args = [qpos, q]
    in_specs = [pl.BlockSpec((None, bq, 1), lambda b, g, i, j, need: (b, i, 0)), row_spec(Kp)]
    if has_pe:
        args.append(qpe)
        in_specs.append(row_spec(qpe.shape[-1]))
    seq = lambda d: pl.BlockSpec((None, bk, d), lambda b, g, i, j, need: (b, last(b, i, j, need), 0))
    ks, kpes, vs = scales
    operands = [(k, kv_major, kv_spec(Kp)), (ks, kv_major, kv_spec(1))]
    if has_pe:
        operands += [(kpe, None, seq(kpe.shape[-1])), (kpes, None, seq(1))]
    if not v_is_k:
        operands += [(v, kv_major, kv_spec(Up)), (vs, kv_major, kv_spec(1))]
    for x, layout, spec in operands:
        if x is not None:
            args.append(x if layout is None else layout(x))
            in_specs.append(spec)
    if has_kpos:
        args.append(kpos)
        in_specs.append(pl.BlockSpec((None, 1, bk), lambda b, g, i, j, need: (b, 0, last(b, i, j, need))))
    kernel = functools.partial(_tpu_kernel, bk=bk, n_q=nq, has_pe=has_pe, v_is_k=v_is_k, has_kpos=has_kpos,
                               with_lse=with_lse, **kw)
    out_shape, out_specs = [jax.ShapeDtypeStruct((B, G, Ap, Up), F32)], [row_spec(Up)]
    if with_lse:  # the running max and sum, lane-dense as in the scratch
        out_shape += [jax.ShapeDtypeStruct((B, G, Ap, 128), F32)] * 2
        out_specs += [row_spec(128)] * 2
    out = pl.pallas_call(
        kernel, out_shape=out_shape, interpret=interpret, name="flash_attention",
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(B, G, nq, nk), in_specs=in_specs, out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM((bq, 128), F32), pltpu.VMEM((bq, 128), F32), pltpu.VMEM((bq, Up), F32)]),
        compiler_params=compiler_params("tpu", interpret, semantics=("parallel", "parallel", "parallel", "arbitrary")),
    )(need.astype(jnp.int32), *args)
    return (out[0], out[1][..., 0], out[2][..., 0]) if with_lse else (out[0], None, None)


def default_splits(platform: str, B: int, G: int, A: int, S: int, bk: int) -> int:
    """Flash-decoding split count: enough programs to fill a GPU when few rows meet a long cache."""
    if platform != "gpu":
        return 1
    programs = B * G * cdiv(A, 64)
    want = max(1, 256 // max(programs, 1))
    return max(1, min(want, S // max(bk * 4, 1)))


def attention(q_BTHK, k_BSGK, v_BSGU, q_pos_BT, *, scale, k_pos_BS=None, q_pe_BTHO=None, k_pe_BSO=None,
              platform="gpu", interpret=False, block_q=None, block_k=None, num_splits=None):
    """Causal GQA / MLA attention with the reference's signature. Returns o ``[B, T, H, U]`` float32.

    q ``[B, T, H, K]``, k ``[B, S, G, K]``, v ``[B, S, G, U]``; the rows of the ``rep = H / G`` heads sharing
    a kv head are processed together. MLA passes its nope part as q/k and the rope part separately:
    q_pe ``[B, T, H, O]`` against the shared k_pe ``[B, S, O]`` (then G must equal H).
    """
    B, T, H, K = q_BTHK.shape
    S, G = k_BSGK.shape[1], k_BSGK.shape[2]
    if H % G:
        raise ValueError(f"attention: {H} query heads are not a multiple of {G} kv heads")
    rep = H // G
    if q_pe_BTHO is not None and rep != 1:
        raise ValueError("attention: split rope dims (q_pe/k_pe) need one kv head per query head (MLA)")
    # rows of group g: (t, h) flattened t-major, so row // rep is the token
    to_rows = lambda x: jnp.transpose(x.reshape(B, T, G, rep, x.shape[-1]), (0, 2, 1, 3, 4)).reshape(B, G, T * rep, -1)
    qpos = jnp.repeat(q_pos_BT.astype(jnp.int32), rep, axis=1)  # [B, T*rep]
    dt = q_BTHK.dtype
    bq = block_q or row_block(T * rep, 64, platform, dt)
    bk = block_k or key_block(S, 64 if platform == "gpu" else 512, platform)
    if num_splits is None:
        num_splits = default_splits(platform, B, G, T * rep, S, bk) if T * rep <= 64 else 1
    o = flash(to_rows(q_BTHK), k_BSGK, v_BSGU, qpos, scale=scale,
              q_pe_BGAO=None if q_pe_BTHO is None else to_rows(q_pe_BTHO), k_pe_BSO=k_pe_BSO, k_pos_BS=k_pos_BS,
              platform=platform, interpret=interpret, block_q=bq, block_k=bk, num_splits=num_splits)
    U = o.shape[-1]
    return jnp.transpose(o.reshape(B, G, T, rep, U), (0, 2, 1, 3, 4)).reshape(B, T, H, U)
