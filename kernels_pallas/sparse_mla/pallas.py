"""Sparse absorbed MLA in Pallas, gather form: each query row reads only its chosen latent rows (vLLM's FlashMLA
sparse decode, SGLang's NSA backend, for Kimi K3.1's DSA).

One program per (sequence, query token) -- and on GPU per block of heads and split of the chosen entries --
walks the token's chosen cache positions ``idx[b, t, :]`` in blocks of ``block_k``: it gathers those rows of the
latent cache ``c`` (and of ``kpe``), scores all heads of the token against them (MQA-style: the latent row is
key and value, the score split into its latent part R and its decoupled part O as in ``kernels_pallas.mla_decode``)
and folds them into an online softmax in float32. Entries outside ``[0, S)`` (``-1``: padding) are no key: their
row is read clipped into the cache and masked. The whole cache is never read, copied or gathered into a
temporary: per query token only its ``X`` chosen rows move (on TPU the 8-row groups that hold them, below).

Per backend:

* GPU (Triton) and interpret mode: grid (sequence, token, head block, split); each program loads a block of
  indices and gathers the rows with a vector index on the cache ref's position axis (a pointer: only those rows
  move). Head blocks of 32 rows for a wide latent (the ``[rows, R]`` float32 accumulator is the register budget),
  splits of the chosen entries (flash-decoding) to fill the GPU, merged by an XLA epilogue.
* TPU (Mosaic): grid (sequence, token, block), the block axis sequential with the softmax state in VMEM scratch
  and every head in one block. The cache stays in HBM (``memory_space=ANY``), viewed as groups of 8 rows (a free
  reshape of its tiled ``[S, R]`` layout). Mosaic copies whole (8, 128) tiles only -- a DMA of one row at a
  dynamic row offset is refused ("offsets along tiled dimensions must be aligned to tiles"), in HBM as in VMEM --
  so the wrapper turns each query row's chosen positions into the distinct 8-row groups that hold them (sorted,
  packed at the front, with their count and a mask of the chosen rows in each: :func:`tile_groups`, a few
  integer ops in XLA), scalar-prefetched into SMEM. Each grid step copies ``block_k`` groups, one DMA each, into
  a double-buffered VMEM block (step ``j`` starts block ``j + 1``'s copies before it waits for block ``j``),
  scores all their rows and masks the unchosen ones; steps past the row's group count copy and compute nothing.
  At worst (no two chosen positions share a group) that reads 8x the chosen rows -- 2048 chosen: 16 MB of a
  bf16 latent per query token and layer, the dense kernel's read of a 16K-token cache --; chosen positions that
  cluster (DSA's are not uniform) share groups and read less. A cache layout with the position axis leading
  would read 1x.

Numerics as the dense kernels: queries cast to the cache dtype, scores and softmax in float32, ``p @ c`` with ``p``
in the cache dtype. A row with no chosen key returns zeros (lse ``-inf``). int8 caches are not taken (the op's
``pallas_unsupported``; the reference reads them).
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
    next_pow2,
    pad_axis,
    precision_for,
    round_up,
    row_block,
)
from kernels_pallas.attention.pallas import _merge_splits, run_and_store
from kernels_pallas.cache_quant import is_int8
from kernels_pallas.sparse_mla.reference import pool_rows


def unsupported(c, kpe) -> str | None:
    """Why the kernel cannot take these caches, or None."""
    if is_int8(c) or is_int8(kpe):
        return "an int8 cache (the sparse kernel reads plain rows; the reference dequantizes)"
    return None


def _online_step(m, l, acc, s, ok, v, precision):
    """One online-softmax update of (max ``m [bq, 1]``, sum ``l [bq, 1]``, ``acc [bq, U]``) by the scaled scores
    ``s [bq, n]`` of the keys where ``ok [1, n]``, over values ``v [n, U]``."""
    s = jnp.where(ok, s, NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(ok, jnp.exp(s - m_new), 0.0)
    alpha = jnp.exp(m - m_new)
    l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    acc = alpha * acc + dot_nn(p.astype(v.dtype), v, precision)
    return m_new, l, acc


# -- GPU (Triton) and interpret ------------------------------------------------------------------------------


def _gpu_kernel(*refs, bk, S, blocks_per_split, has_pe, split, scale, precision):
    """One program per (sequence, token, head block, split): a loop over its blocks of chosen entries."""
    it = iter(refs)
    idx_ref, q_ref = next(it), next(it)  # idx: [Xp] (this token's), q: [bq, Rp]
    qpe_ref = next(it) if has_pe else None
    c_ref = next(it)  # [S, Rp]: the sequence's whole cache, read at the chosen rows only
    kpe_ref = next(it) if has_pe else None
    o_ref = next(it)
    m_ref, l_ref = (next(it), next(it)) if split else (None, None)
    q = q_ref[...]
    qpe = qpe_ref[...] if has_pe else None
    bq, U = q.shape[0], c_ref.shape[-1]
    lo = pl.program_id(3) * blocks_per_split

    def body(j, carry):
        ids = idx_ref[pl.ds(pl.multiple_of(j * bk, bk), bk)]  # [bk]
        ok = (ids >= 0) & (ids < S)
        rows = jnp.where(ok, ids, 0)
        k = c_ref[rows]  # [bk, Rp]: a gather of the chosen rows
        s = dot_nt(q, k, precision)
        if has_pe:
            s = s + dot_nt(qpe, kpe_ref[rows], precision)
        return _online_step(*carry, s * scale, ok[None, :], k, precision)

    run_and_store(body, lo, lo + blocks_per_split, bq, U, o_ref, m_ref, l_ref, split)


def _sparse_gpu(q, qpe, c, kpe, idx, *, S, bq, bk, num_splits, interpret, num_warps, with_lse, **kw):
    """Launch over q ``[B, T, Hp, Rp]``, q_pe ``[B, T, Hp, Op]`` (or None), c ``[B, S, Rp]``, kpe ``[B, S, Op]``
    (or None), idx ``[B, T, X]``. Returns o ``[B, T, Hp, Rp]`` float32 and, with ``with_lse``, each row's max score
    and softmax sum ``[B, T, Hp]`` (else None, None)."""
    B, T, Hp, Rp = q.shape
    has_pe = qpe is not None
    n_blocks = cdiv(idx.shape[-1], bk)
    splits = max(1, min(int(num_splits), n_blocks))
    per_split = cdiv(n_blocks, splits)
    splits = cdiv(n_blocks, per_split)  # no empty split
    Xp = splits * per_split * bk
    idx = pad_axis(idx, 2, Xp, -1)
    row = lambda d: pl.BlockSpec((None, None, bq, d), lambda b, t, i, j: (b, t, i, 0))
    one = c.shape[0] == 1  # one cache (a page pool) shared by every sequence
    seq = lambda d: pl.BlockSpec((None, S, d), lambda b, t, i, j: (0 if one else b, 0, 0))
    args = [idx, q]
    in_specs = [pl.BlockSpec((None, None, Xp), lambda b, t, i, j: (b, t, 0)), row(Rp)]
    if has_pe:
        args.append(qpe)
        in_specs.append(row(qpe.shape[-1]))
    args.append(c)
    in_specs.append(seq(Rp))
    if has_pe:
        args.append(kpe)
        in_specs.append(seq(kpe.shape[-1]))
    split = splits > 1 or with_lse
    if split:
        out_shape = [jax.ShapeDtypeStruct((B, T, splits, Hp, d), F32) for d in (Rp, 1, 1)]
        out_specs = [pl.BlockSpec((None, None, None, bq, d), lambda b, t, i, j: (b, t, j, i, 0)) for d in (Rp, 1, 1)]
    else:
        out_shape, out_specs = jax.ShapeDtypeStruct((B, T, Hp, Rp), F32), row(Rp)
    kernel = functools.partial(_gpu_kernel, bk=bk, S=S, blocks_per_split=per_split, has_pe=has_pe, split=split, **kw)
    out = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(B, T, Hp // bq, splits), in_specs=in_specs, out_specs=out_specs,
        interpret=interpret, name="sparse_mla_attention",
        compiler_params=compiler_params("gpu", interpret, num_warps=num_warps),
    )(*args)
    if not split:
        return out, None, None
    return _merge_splits(*out, stats=True)


# -- TPU (Mosaic) ------------------------------------------------------------------------------------------


# Rows of one tile of a TPU cache's ``[S, R]`` layout (``(8, 128)``, bf16 packed in pairs): Mosaic copies whole tiles
# only, so one chosen row is read as the 8-row group that holds it.
TILE_ROWS = 8


def tile_groups(idx_BTX, S, Xp):
    """What the TPU kernel reads for each query row: the distinct 8-row tile groups holding its chosen entries,
    ascending and packed at the front ``[B, T, Xp]`` (``-1`` after them), their count ``[B, T]``, and which rows of
    each group are chosen, int32 ``[B, T, Xp * 8]`` (lane ``x * 8 + r``: row ``r`` of group ``x``; built flat, as the
    kernel reads it: a trailing dim of 8 would be laid out padded to 128 lanes); entries outside ``[0, S)`` choose
    none."""
    B, T, _ = idx_BTX.shape
    big = jnp.iinfo(jnp.int32).max
    group = jnp.where((idx_BTX >= 0) & (idx_BTX < S), idx_BTX // TILE_ROWS, big)
    order = jnp.argsort(group, axis=-1)
    gs = jnp.take_along_axis(group, order, axis=-1)
    rs = jnp.take_along_axis(idx_BTX % TILE_ROWS, order, axis=-1)
    ok = gs < big
    new = ok & jnp.concatenate([jnp.ones_like(ok[..., :1]), gs[..., 1:] != gs[..., :-1]], axis=-1)
    slot = jnp.cumsum(new, axis=-1) - 1  # each sorted entry's group's place among the distinct groups
    bi, ti = jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None]
    dump = Xp  # writes of entries that place nothing land in this extra column, cut off
    groups = jnp.full((B, T, Xp + 1), -1, jnp.int32).at[bi, ti, jnp.where(new, slot, dump)].set(gs)[..., :Xp]
    lane = jnp.where(ok, slot * TILE_ROWS + rs, dump * TILE_ROWS)
    rows = jnp.zeros((B, T, (Xp + 1) * TILE_ROWS), jnp.int32).at[bi, ti, lane].set(1)[..., :Xp * TILE_ROWS]
    return groups, jnp.sum(new, axis=-1).astype(jnp.int32), rows


def _tpu_kernel(count_sm, groups_sm, sel_ref, q_ref, *refs, bk, n_groups, one, has_pe, with_lse, scale, precision):
    """TPU: one grid step = ``bk`` distinct 8-row tile groups of one (sequence, token)'s chosen entries (``[bk * 8]``
    rows, all scored; ``sel_ref [1, bk * 8]`` marks the chosen rows). In SMEM: ``count_sm`` (every row's number of
    groups, ``[B * T]``, scalar-prefetched: steps past it neither copy nor compute) and ``groups_sm`` (this row's
    groups ``[1, Xp]``, a block of its own: SMEM (1 MiB) would not hold every row's at a verify step's ``T``)."""
    it = iter(refs)
    qpe_ref = next(it) if has_pe else None
    c_hbm = next(it)  # [B, S / 8, 8, R] in HBM
    kpe_hbm = next(it) if has_pe else None
    o_ref = next(it)
    m_ref, l_ref = (next(it), next(it)) if with_lse else (None, None)
    cbuf, pbuf, sem, m_sc, l_sc, acc_sc = (next(it) for _ in range(6))
    b, t, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cb = 0 if one else b  # the cache's sequence (one pool shared by all: 0)
    row_id = b * pl.num_programs(1) + t
    steps = (count_sm[row_id] + bk - 1) // bk

    def copies(slot, group_of):
        """Entry i's copies into buffer ``slot`` (its tile group ``group_of(i)``)."""
        def one(i):
            g = group_of(i)
            out = [pltpu.make_async_copy(c_hbm.at[cb, g], cbuf.at[slot, i], sem.at[0, slot])]
            if has_pe:
                out.append(pltpu.make_async_copy(kpe_hbm.at[cb, g], pbuf.at[slot, i], sem.at[1, slot]))
            return out
        return one

    def start(block, slot):  # the -1s after the last group read group 0 (no row of it chosen)
        group_of = lambda i: jnp.clip(groups_sm[0, block * bk + i], 0, n_groups - 1)
        one = copies(slot, group_of)
        jax.lax.fori_loop(0, bk, lambda i, _: [d.start() for d in one(i)] and None, None)

    def wait(slot):  # one wait per copy, each as large as its copy (any group names the size)
        one = copies(slot, lambda i: 0)
        jax.lax.fori_loop(0, bk, lambda i, _: [d.wait() for d in one(i)] and None, None)

    @pl.when(j == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, NEG, F32)
        l_sc[...] = jnp.zeros(l_sc.shape, F32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, F32)

        @pl.when(steps > 0)
        def _():
            start(0, 0)

    @pl.when(j + 1 < steps)
    def _():
        start(j + 1, (j + 1) % 2)

    @pl.when(j < steps)
    def _():
        _tpu_step(j % 2, wait, sel_ref, q_ref, qpe_ref, cbuf, pbuf, m_sc, l_sc, acc_sc, scale=scale,
                  precision=precision)

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        l = l_sc[:, :1]
        o_ref[...] = acc_sc[...] / jnp.where(l > 0, l, 1.0)
        if with_lse:  # lane-dense [Hp, 128] copies of the running max and sum
            m_ref[...] = m_sc[...]
            l_ref[...] = l_sc[...]


def _tpu_step(slot, wait, sel_ref, q_ref, qpe_ref, cbuf, pbuf, m_sc, l_sc, acc_sc, *, scale, precision):
    """Waits for buffer ``slot``'s copies, then folds its ``bk * 8`` rows into the online softmax."""
    wait(slot)
    n = cbuf.shape[1] * TILE_ROWS
    k = cbuf[slot].reshape(n, cbuf.shape[-1])  # [bk * 8, R]
    s = dot_nt(q_ref[...], k, precision)
    if qpe_ref is not None:
        s = s + dot_nt(qpe_ref[...], pbuf[slot].reshape(n, pbuf.shape[-1]), precision)
    ok = sel_ref[...] > 0  # [1, bk * 8]
    s = jnp.where(ok, s * scale, NEG)
    m_prev = m_sc[...]  # [Hp, 128], every lane equal (lane-dense scratch)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(ok, jnp.exp(s - m_new[:, :1]), 0.0)
    alpha = jnp.exp(m_prev - m_new)
    l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
    m_sc[...] = m_new
    acc_sc[...] = alpha[:, :1] * acc_sc[...] + dot_nn(p.astype(k.dtype), k, precision)


def _sparse_tpu(q, qpe, c, kpe, idx, *, S, bk, interpret, with_lse, **kw):
    """TPU launch over q ``[B, T, Hp, R]``, q_pe ``[B, T, Hp, O]`` (or None), c ``[B, S, R]`` and kpe ``[B, S, O]``
    left in HBM (viewed as 8-row tile groups), idx ``[B, T, X]``. Returns o ``[B, T, Hp, R]`` and, with
    ``with_lse``, each row's max score and softmax sum ``[B, T, Hp]`` (else None, None)."""
    B, T, Hp, R = q.shape
    has_pe = qpe is not None
    Xp = round_up(idx.shape[-1], bk)
    Sp = round_up(S, TILE_ROWS)  # a copy of the cache only when S is not a multiple of 8
    view = lambda x: pad_axis(x, 1, Sp).reshape(x.shape[0], Sp // TILE_ROWS, TILE_ROWS, x.shape[-1])
    groups, count, sel = tile_groups(idx, S, Xp)
    sel = sel.reshape(B * T, 1, Xp * TILE_ROWS)
    row = lambda d: pl.BlockSpec((None, None, Hp, d), lambda b, t, j, *_: (b, t, 0, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)

    def sel_block(b, t, j, count_sm):  # steps past the count repeat the last block: not fetched again
        return b * T + t, 0, jnp.maximum(jnp.minimum(j, (count_sm[b * T + t] + bk - 1) // bk - 1), 0)

    args = [groups.reshape(B * T, 1, Xp), sel, q]  # [1, Xp] blocks: whole trailing dims
    in_specs = [pl.BlockSpec((None, 1, Xp), lambda b, t, j, *_: (b * T + t, 0, 0), memory_space=pltpu.SMEM),
                pl.BlockSpec((None, 1, bk * TILE_ROWS), sel_block), row(R)]
    if has_pe:
        args.append(qpe)
        in_specs.append(row(qpe.shape[-1]))
    args.append(view(c))
    in_specs.append(hbm)
    if has_pe:
        args.append(view(kpe))
        in_specs.append(hbm)
    O = kpe.shape[-1] if has_pe else 128
    out_shape, out_specs = [jax.ShapeDtypeStruct((B, T, Hp, R), F32)], [row(R)]
    if with_lse:
        out_shape += [jax.ShapeDtypeStruct((B, T, Hp, 128), F32)] * 2
        out_specs += [row(128)] * 2
    buf = lambda d: pltpu.VMEM((2, bk, TILE_ROWS, d), c.dtype)
    scratch = [buf(R), buf(O), pltpu.SemaphoreType.DMA((2, 2)),
               pltpu.VMEM((Hp, 128), F32), pltpu.VMEM((Hp, 128), F32), pltpu.VMEM((Hp, R), F32)]
    kernel = functools.partial(_tpu_kernel, bk=bk, n_groups=Sp // TILE_ROWS, one=c.shape[0] == 1,
                               has_pe=has_pe, with_lse=with_lse, **kw)
    out = pl.pallas_call(
        kernel, out_shape=out_shape, interpret=interpret, name="sparse_mla_attention",
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(B, T, Xp // bk), in_specs=in_specs, out_specs=out_specs,
            scratch_shapes=scratch),
        compiler_params=compiler_params("tpu", interpret, semantics=("parallel", "parallel", "arbitrary")),
    )(count.reshape(-1), *args)
    return (out[0], out[1][..., 0], out[2][..., 0]) if with_lse else (out[0], None, None)


# -- entry ---------------------------------------------------------------------------------------------------


def default_splits(B: int, T: int, head_blocks: int, n_blocks: int) -> int:
    """GPU splits of the chosen entries: enough programs (about 256) to fill the GPU, >= 4 blocks per split."""
    want = max(1, 256 // max(B * T * head_blocks, 1))
    return max(1, min(want, n_blocks // 4))


def sparse_mla_attention(q_lat_BTHR, q_pe_BTHO, c_BSR, kpe_BSO, idx_BTX, *, scale, platform="gpu", interpret=False,
                         block_q=None, block_k=None, num_splits=None, num_warps=None, with_lse=False):
    """Returns u ``[B, T, H, R]`` float32 (latent space; with ``with_lse`` also its log-sum-exp ``[B, T, H]``).
    The reference's signature plus block choices: ``block_q`` heads per program (GPU), ``block_k`` chosen entries
    per step, ``num_splits`` (GPU) programs per head block. ``O = 0`` (no decoupled key part) skips its product."""
    B, T, H, R = q_lat_BTHR.shape
    S, X = c_BSR.shape[1], idx_BTX.shape[-1]
    has_pe = q_pe_BTHO.shape[-1] > 0
    dt = c_BSR.dtype
    idx = idx_BTX.astype(jnp.int32)
    kw = {"S": S, "scale": float(scale), "precision": precision_for(dt), "with_lse": with_lse, "interpret": interpret}
    if platform == "tpu":
        Hp = row_block(H, H, "tpu", dt)  # every head in one block
        q = pad_axis(q_lat_BTHR.astype(dt), 2, Hp)
        qpe = pad_axis(q_pe_BTHO.astype(dt), 2, Hp) if has_pe else None
        bk = block_k or min(128, round_up(X, 16))  # entries per step: 128 tile groups are 1024 scored rows
        o, m, l = _sparse_tpu(q, qpe, c_BSR, kpe_BSO.astype(dt) if has_pe else None, idx, bk=bk, **kw)
    else:
        # Triton: power-of-two tiles (zero columns add nothing to a dot; R = 512 and O = 64 need no copy)
        pow2 = lambda x, axis: pad_axis(x, axis, next_pow2(x.shape[axis]))
        bq = block_q or row_block(H, 32 if R > 256 else 64, "gpu", dt)
        Hp = round_up(H, bq)
        q = pow2(pad_axis(q_lat_BTHR.astype(dt), 2, Hp), 3)
        qpe = pow2(pad_axis(q_pe_BTHO.astype(dt), 2, Hp), 3) if has_pe else None
        c, kpe = pow2(c_BSR, 2), (pow2(kpe_BSO.astype(dt), 2) if has_pe else None)
        bk = block_k or max(16, min(32 if R > 256 else 64, next_pow2(X)))
        splits = num_splits or default_splits(B, T, Hp // bq, cdiv(X, bk))
        o, m, l = _sparse_gpu(q, qpe, c, kpe, idx, bq=bq, bk=bk, num_splits=splits,
                              num_warps=num_warps or (8 if R > 256 else None), **kw)
    u = o[:, :, :H, :R]
    if not with_lse:
        return u
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    return u, lse[:, :, :H]


def paged_sparse_mla_attention(q_lat_BTHR, q_pe_BTHO, c_pages, kpe_pages, page_table, idx_BTX, *, scale,
                               platform="gpu", interpret=False, **blocks):
    """The same over a paged cache (``c_pages [n_pages, page_size, R]``, ``kpe_pages [n_pages, page_size, O]``, page
    table ``[B, pages_per_seq]``; ``idx`` holds cache positions, as for the static cache): the chosen positions are
    translated to rows of the pool through the page table (``B * T * X`` integers, in XLA), and the kernel reads
    those rows out of the pool, shared by every sequence, where they lie. TPU: a page size that is a multiple of 8
    keeps the pool's view as 8-row groups a free reshape."""
    n, ps = c_pages.shape[:2]
    rows = pool_rows(idx_BTX, page_table, ps, n)
    flat = lambda x: x.reshape(1, n * ps, x.shape[-1])
    return sparse_mla_attention(q_lat_BTHR, q_pe_BTHO, flat(c_pages), flat(kpe_pages), rows, scale=scale,
                                platform=platform, interpret=interpret, **blocks)
