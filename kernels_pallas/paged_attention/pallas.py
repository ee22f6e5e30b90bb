"""Attention over a paged cache in Pallas: the online-softmax kernel of ``kernels_pallas.attention`` with its keys
read *through the page table*, page by page, straight out of the shared pool. No gathered contiguous cache is
ever written.

Both ops run as one kernel over query *rows*: GQA's ``rep = H / G`` heads sharing a kv head times the query
tokens (rows of kv group g), absorbed MLA's ``T * H`` rows sharing the one latent "kv head" (MQA-style; the latent
page serves as key and value, and the score is split into its latent part R and its decoupled part O, as
``kernels_pallas.mla_decode`` does). Rows carry their absolute position ``q_pos``; the key in row r of a
sequence's j-th page sits at position ``j * page_size + r``. A row block needs pages ``0 .. max(q_pos) //
page_size``: later pages are neither read nor computed, whatever the page table names there.

Per backend:

* GPU (Triton) and interpret mode: one program per (sequence, kv group, row block, split) loops over its pages;
  each iteration reads the page indices from the sequence's page-table row and loads those pages' rows with
  dynamic indices on the pool's leading axis (the pool ref is a pointer: only the pages read move). Small pages
  go a few per iteration (pages of 16 tokens: 4, so a score tile has 64 keys). Long tables
  are split over several programs (flash-decoding); an XLA epilogue merges the partial results.
* TPU (Mosaic): the page table and the pages each row block needs are scalar-prefetched into SMEM; the grid is
  (sequence, row block, page step) with the page axis sequential and the softmax state in VMEM
  scratch. A page step covers ``pages_per_step`` pages: the pool is passed once per page slot, each with a
  BlockSpec whose index map returns ``page_table[b, step * pages_per_step + slot]`` as the block index on the
  pool's page axis, clamped to the last needed page (a repeated block index is not fetched again), and steps
  past the need are skipped with ``pl.when``. A GQA page block holds every kv head (``[page_size, G, K]``:
  Mosaic takes no one-head block of it); the kernel reads each head's rows with a strided load.

Numerics as in the flash kernel: scores and the softmax in float32, ``p @ v`` with ``p`` in the value dtype (bf16 for
a bf16 cache, exact float32 for a float32 one). Queries are cast to the cache dtype (MLA's float32 absorbed query
too, as ``kernels_pallas.mla_decode`` does). A row that sees no key returns zeros. Page-table entries are clipped
into the pool (a stale entry never reads out of bounds).

int8 pools (``kernels_pallas.cache_quant.Int8Rows``: codes ``[n, page_size, ...]``, scales ``[n, page_size, ..., 1]``)
are read page by page like the plain ones, each page's scales beside its codes, and every page dequantized in VMEM /
registers to the query's dtype (the activation dtype; MLA's float32 absorbed query is cast to q_pe's) before the
same products.
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
from kernels_pallas.attention.pallas import _merge_splits, _take_refs, default_splits, run_and_store
from kernels_pallas.cache_quant import is_int8, tile
from kernels_pallas.cache_quant import split as split_rows


def _online_step(m, l, acc, s, visible, v, precision):
    """One online-softmax update of (max ``m [bq, 1]``, sum ``l [bq, 1]``, ``acc [bq, U]``) by scores ``s [bq, n]``
    (already scaled) over values ``v [n, U]``."""
    s = jnp.where(visible, s, NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
    alpha = jnp.exp(m - m_new)
    l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    acc = alpha * acc + dot_nn(p.astype(v.dtype), v, precision)
    return m_new, l, acc


# -- GPU (Triton) and interpret ------------------------------------------------------------------------------


def _gpu_kernel(*refs, ps, ppb, blocks_per_split, n_pages, has_pe, v_is_k, split, scale, precision, quant):
    """One program per (sequence, group, row block, split): a loop over its pages, ``ppb`` at a time, each read
    through the table."""
    it = iter(refs)
    pt_ref, qpos_ref, q_ref = next(it), next(it), next(it)
    qpe_ref = next(it) if has_pe else None
    # the whole pool of this kv group: [n, ps, Kp] (int8: its scales [n, ps, 1] beside it)
    k_ref, ks_ref, kpe_ref, kpes_ref, v_ref, vs_ref = _take_refs(it, has_pe, v_is_k, quant)
    o_ref = next(it)
    m_ref, l_ref = (next(it), next(it)) if split else (None, None)

    qpos = qpos_ref[...]  # [bq, 1] int32
    q = q_ref[...]
    qpe = qpe_ref[...] if has_pe else None
    bq, U = q.shape[0], v_ref.shape[-1]
    needed = jnp.minimum((jnp.max(qpos) + ps) // ps, n_pages)  # pages 0 .. max(q_pos) // ps
    lo = pl.program_id(3) * blocks_per_split
    hi = jnp.minimum(lo + blocks_per_split, (needed + ppb - 1) // ppb)
    bk = ppb * ps

    def pages(j):  # the table's pages j*ppb .. j*ppb + ppb - 1; those past the need repeat the step's first page
        if ppb == 1:
            return pt_ref[j]
        slots = pt_ref[pl.ds(pl.multiple_of(j * ppb, ppb), ppb)]
        return jnp.where(j * ppb + jnp.arange(ppb) < needed, slots, pt_ref[j * ppb])

    def load(ref, scale_ref, page):  # the pages' rows: dynamic indices on the pool's page axis; int8 dequantized
        rows = lambda r: r[page] if ppb == 1 else r[page].reshape(bk, r.shape[-1])  # noqa: E731
        return rows(ref) if scale_ref is None else tile(rows(ref), rows(scale_ref), q.dtype)

    def body(j, carry):
        page = pages(j)
        k = load(k_ref, ks_ref, page)  # [bk, Kp]
        s = dot_nt(q, k, precision)
        if has_pe:
            s = s + dot_nt(qpe, load(kpe_ref, kpes_ref, page), precision)
        kpos = j * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        v = k if v_is_k else load(v_ref, vs_ref, page)
        return _online_step(*carry, s * scale, kpos <= qpos, v, precision)

    run_and_store(body, lo, hi, bq, U, o_ref, m_ref, l_ref, split)


def _paged_gpu(q, qpe, qpos, k_pool, kpe_pool, v_pool, pt, scales, *, bq, ppb, num_splits, interpret, num_warps,
               num_stages, has_pe, v_is_k, **kw):
    """Launch over q ``[B, G, Ap, Kp]`` rows, k pool ``[n, ps, G, Kp]`` (v likewise, or None when ``v_is_k``),
    kpe pool ``[n, ps, Op]``, page table ``[B, P]``; ``ppb`` pages per loop step. Returns ``[B, G, Ap, Up]``
    float32."""
    B, G, Ap, Kp = q.shape
    n, ps = k_pool.shape[:2]
    n_blocks = cdiv(pt.shape[1], ppb)
    P = pt.shape[1]
    pt = pad_axis(pt, 1, n_blocks * ppb)  # page 0 past the table: beyond every (clipped) query position
    Up = Kp if v_is_k else v_pool.shape[-1]
    splits = max(1, min(int(num_splits), n_blocks))
    per_split = cdiv(n_blocks, splits)
    splits = cdiv(n_blocks, per_split)  # no empty split
    split = splits > 1
    row = lambda d: pl.BlockSpec((None, None, bq, d), lambda b, g, i, j: (b, g, i, 0))
    pool = lambda d: pl.BlockSpec((n, ps, None, d), lambda b, g, i, j: (0, 0, g, 0))
    args = [pt, qpos, q]
    in_specs = [pl.BlockSpec((None, pt.shape[1]), lambda b, g, i, j: (b, 0)),
                pl.BlockSpec((None, bq, 1), lambda b, g, i, j: (b, i, 0)), row(Kp)]
    if has_pe:
        args.append(qpe)
        in_specs.append(row(qpe.shape[-1]))
    ks, kpes, vs = scales
    shared = lambda d: pl.BlockSpec((n, ps, d), lambda b, g, i, j: (0, 0, 0))
    operands = [(k_pool, pool(Kp)), (ks, pool(1))]
    if has_pe:
        operands += [(kpe_pool, shared(kpe_pool.shape[-1])), (kpes, shared(1))]
    if not v_is_k:
        operands += [(v_pool, pool(Up)), (vs, pool(1))]
    for x, spec in operands:
        if x is not None:
            args.append(x)
            in_specs.append(spec)
    if split:
        out_shape = [jax.ShapeDtypeStruct((B, G, splits, Ap, d), F32) for d in (Up, 1, 1)]
        out_specs = [pl.BlockSpec((None, None, None, bq, d), lambda b, g, i, j: (b, g, j, i, 0)) for d in (Up, 1, 1)]
    else:
        out_shape, out_specs = jax.ShapeDtypeStruct((B, G, Ap, Up), F32), row(Up)
    kernel = functools.partial(_gpu_kernel, ps=ps, ppb=ppb, blocks_per_split=per_split, n_pages=P, has_pe=has_pe,
                               v_is_k=v_is_k, split=split, **kw)
    out = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(B, G, Ap // bq, splits), in_specs=in_specs, out_specs=out_specs,
        interpret=interpret, name="paged_attention",
        compiler_params=compiler_params("gpu", interpret, num_warps=num_warps, num_stages=num_stages),
    )(*args)
    return _merge_splits(*out) if split else out


# -- TPU (Mosaic) ------------------------------------------------------------------------------------------


def _tpu_kernel(pt_ref, need_ref, *refs, ps, ppb, G, n_q, has_pe, v_is_k, scale, precision, quant):
    """TPU: one grid step = ``ppb`` pages (one ref per page slot, each ``[ps, G, K]``, or ``[ps, K]`` for one kv
    head; int8 pools: each with its scales ``[ps, G, 1]`` / ``[ps, 1]``) of one (sequence, row block); the softmax
    state of each kv head lives in VMEM scratch across the steps."""
    del pt_ref  # read by the index maps only
    k_q, kpe_q, v_q = quant
    it = iter(refs)
    slots = lambda present: [next(it) for _ in range(ppb)] if present else None  # noqa: E731
    qpos_ref, q_ref = next(it), next(it)
    qpe_ref = next(it) if has_pe else None
    k_refs, ks_refs = slots(True), slots(k_q)
    kpe_refs, kpes_refs = slots(has_pe), slots(has_pe and kpe_q)
    v_refs, vs_refs = (k_refs, ks_refs) if v_is_k else (slots(True), slots(v_q))
    o_ref, m_sc, l_sc, acc_sc = next(it), next(it), next(it), next(it)
    b, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    dt = q_ref.dtype

    def pages(rs, h, scale_rs=None):  # the step's pages of kv head h, in table order: [ppb * ps, K]
        one = lambda r: r[...] if G == 1 else r[:, h, :]  # noqa: E731  (a strided load picks one head of [ps, G, K])
        rows = [one(r) if scale_rs is None else tile(one(r), one(sr), dt) for r, sr in zip(rs, scale_rs or rs)]
        return rows[0] if ppb == 1 else jnp.concatenate(rows, axis=0)

    @pl.when(j == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, NEG, F32)
        l_sc[...] = jnp.zeros(l_sc.shape, F32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, F32)

    @pl.when(j * ppb < need_ref[b * n_q + i])
    def _():
        pe = pages(kpe_refs, 0, kpes_refs) if has_pe else None
        kpos = j * (ppb * ps) + jax.lax.broadcasted_iota(jnp.int32, (1, ppb * ps), 1)
        visible = kpos <= qpos_ref[...]
        for h in range(G):
            k = pages(k_refs, h, ks_refs)
            s = dot_nt(q_ref[h], k, precision)
            if has_pe:
                s = s + dot_nt(qpe_ref[h], pe, precision)
            s = jnp.where(visible, s * scale, NEG)
            m_prev = m_sc[h]  # [bq, 128], every lane equal (lane-dense scratch)
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            p = jnp.where(visible, jnp.exp(s - m_new[:, :1]), 0.0)
            alpha = jnp.exp(m_prev - m_new)
            l_sc[h] = alpha * l_sc[h] + jnp.sum(p, axis=1, keepdims=True)
            m_sc[h] = m_new
            v = k if v_is_k else pages(v_refs, h, vs_refs)
            acc_sc[h] = alpha[:, :1] * acc_sc[h] + dot_nn(p.astype(v.dtype), v, precision)

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        l = l_sc[:, :, :1]
        o_ref[...] = acc_sc[...] / jnp.where(l > 0, l, 1.0)


def _paged_tpu(q, qpe, qpos, k_pool, kpe_pool, v_pool, pt, scales, *, bq, pages_per_step, interpret, has_pe, v_is_k,
               **kw):
    """TPU launch over the operands of :func:`_paged_gpu`: grid (sequence, row block, page step), every kv head
    in one block (Mosaic takes no block of one head out of ``[ps, G, K]``; the kernel reads each head with a
    strided load). Returns ``[B, G, Ap, U]`` float32."""
    B, G, Ap, K = q.shape
    n, ps = k_pool.shape[:2]
    U = K if v_is_k else v_pool.shape[-1]
    P = pt.shape[1]
    ppb = max(1, min(int(pages_per_step), P))
    steps, nq = cdiv(P, ppb), Ap // bq
    flat_pt = pad_axis(pt, 1, steps * ppb).reshape(-1)  # 1-D: SMEM pads 2-D arrays to (8, 128) tiles
    need = jnp.clip((jnp.max(qpos.reshape(B, nq, bq), axis=2) + ps) // ps, 0, P).reshape(B * nq)

    def pool_spec(p, tail):  # page slot p of step j: the table's page there, clamped to the last needed one
        def index(b, i, j, pt_ref, need_ref):
            slot = jnp.maximum(jnp.minimum(j * ppb + p, need_ref[b * nq + i] - 1), 0)
            return (pt_ref[b * (steps * ppb) + slot],) + (0,) * (1 + len(tail))
        return pl.BlockSpec((None, ps, *tail), index)

    # one kv head (MLA's latent, or a GQA shard holding one): [n, ps, K] (TPU lays [n, ps, 1, K] out as that)
    pool = (lambda x: x.reshape(n, ps, x.shape[-1])) if G == 1 else (lambda x: x)
    tail = lambda d: (d,) if G == 1 else (G, d)
    rows = lambda d: pl.BlockSpec((None, G, bq, d), lambda b, i, j, *_: (b, 0, i, 0))
    args, in_specs = [qpos, q], [pl.BlockSpec((None, bq, 1), lambda b, i, j, *_: (b, i, 0)), rows(K)]
    if has_pe:
        args.append(qpe)
        in_specs.append(rows(qpe.shape[-1]))
    ks, kpes, vs = scales
    operands = [(k_pool, tail(K)), (ks, tail(1))]
    if has_pe:
        operands += [(kpe_pool, (kpe_pool.shape[-1],)), (kpes, (1,))]
    if not v_is_k:
        operands += [(v_pool, tail(U)), (vs, tail(1))]
    for x, block in operands:
        if x is not None:
            args += [pool(x) if x.ndim == 4 else x] * ppb  # kpe pools are [n, ps, O] already
            in_specs += [pool_spec(p, block) for p in range(ppb)]
    kernel = functools.partial(_tpu_kernel, ps=ps, ppb=ppb, G=G, n_q=nq, has_pe=has_pe, v_is_k=v_is_k, **kw)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((B, G, Ap, U), F32), interpret=interpret, name="paged_attention",
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(B, nq, steps), in_specs=in_specs, out_specs=rows(U),
            scratch_shapes=[pltpu.VMEM((G, bq, 128), F32), pltpu.VMEM((G, bq, 128), F32),
                            pltpu.VMEM((G, bq, U), F32)]),
        compiler_params=compiler_params("tpu", interpret, semantics=("parallel", "parallel", "arbitrary")),
    )(flat_pt, need.astype(jnp.int32), *args)


# -- entries -----------------------------------------------------------------------------------------------


def unsupported(platform: str, pool_shape) -> str | None:
    """Why the kernel compiled for ``platform`` cannot read a pool of this shape (``[n, page_size, ...]``), or None.
    On GPU a page is a Triton tile: a power of two of >= 16 rows (``jnp.dot`` wants each side >= 16)."""
    ps = pool_shape[1]
    if platform == "gpu" and (ps < 16 or ps != next_pow2(ps)):
        return (f"a pool of pages {tuple(pool_shape)}: the GPU kernel needs a page size that is a power of two "
                f">= 16 (Triton dot tiles), not {ps}")
    return None


def paged_rows(q_BGAK, qpos_BA, k_pages, v_pages, page_table, *, scale, q_pe_BGAO=None, kpe_pages=None,
               v_is_k=False, platform="gpu", interpret=False, block_q, pages_per_step=None, num_splits=1,
               num_warps=None, num_stages=None, dtype=None):
    """The kernel over query rows grouped by kv head. Returns o ``[B, G, A, U]`` float32.

    q ``[B, G, A, K]`` (A rows per kv group), qpos ``[B, A]``, k pages ``[n, ps, G, K]``, v pages ``[n, ps, G, U]``
    (ignored when ``v_is_k``: the key pages are the values), page table ``[B, P]``. Optional decoupled key part
    (MLA): q_pe ``[B, G, A, O]`` against kpe pages ``[n, ps, O]``, shared by every group. ``block_q``: rows per
    block; ``pages_per_step``: pages per grid step (TPU) or loop step (GPU); ``num_splits`` (GPU) programs per
    row block. int8 pools (``Int8Rows`` k / v / kpe pages) are dequantized per page; ``dtype``: the products'
    dtype (default: the pool's; needed for an int8 pool).
    """
    B, G, A, K = q_BGAK.shape
    n, ps, Gk = k_pages.shape[:3]
    P = page_table.shape[1]
    has_pe = q_pe_BGAO is not None
    if Gk != G:
        raise ValueError(f"paged attention: k pages have {Gk} kv heads for q with {G}")
    (k_pages, ks), (v_pages, vs), (kpe_pages, kpes) = split_rows(k_pages), split_rows(v_pages), split_rows(kpe_pages)
    quant = (ks is not None, kpes is not None, vs is not None)
    if any(quant) and dtype is None:  # the int8 codes' dtype is no compute dtype
        raise ValueError("paged attention over an int8 pool needs dtype= (the products' dtype)")
    dt = jnp.dtype(dtype or k_pages.dtype)
    if has_pe and kpes is None:
        kpe_pages = kpe_pages.astype(dt)
    Ap = round_up(A, block_q)
    # a row past the table sees all P * ps keys, as in the reference; padding rows (position -1) see none
    qpos = pad_axis(jnp.minimum(qpos_BA.astype(jnp.int32), P * ps - 1), 1, Ap, -1)[..., None]  # [B, Ap, 1]
    pt = jnp.clip(page_table.astype(jnp.int32), 0, n - 1)
    q = pad_axis(q_BGAK.astype(dt), 2, Ap)
    qpe = pad_axis(q_pe_BGAO.astype(dt), 2, Ap) if has_pe else None
    kw = dict(has_pe=has_pe, v_is_k=v_is_k, scale=float(scale), precision=precision_for(dt), quant=quant)
    if platform == "tpu":
        out = _paged_tpu(q, qpe, qpos, k_pages, kpe_pages, v_pages, pt, (ks, kpes, vs), bq=block_q,
                         pages_per_step=pages_per_step or max(1, min(16, 512 // ps)), interpret=interpret, **kw)
        return out[:, :, :A]
    why = unsupported("gpu", k_pages.shape)
    if why is not None:
        raise ValueError(f"paged attention: {why}")
    U = K if v_is_k else v_pages.shape[-1]
    # Triton wants power-of-two head dims: zero columns add nothing to a dot (a copy of the pool if they are not)
    pow2 = lambda x, axis: pad_axis(x, axis, next_pow2(x.shape[axis]))
    q, k_pages = pow2(q, 3), pow2(k_pages, 3)
    v_pages = None if v_is_k else pow2(v_pages, 3)
    qpe, kpe_pages = (pow2(qpe, 3), pow2(kpe_pages, 2)) if has_pe else (None, None)
    # small pages: a few per loop step, so each step's tile holds >= 64 keys (a page table row of a power of two)
    ppb = pages_per_step or max(1, min(64 // ps, next_pow2(P)))
    if ppb != next_pow2(ppb):
        raise ValueError(f"paged attention on GPU: pages_per_step={ppb} must be a power of two")
    out = _paged_gpu(q, qpe, qpos, k_pages, kpe_pages, v_pages, pt, (ks, kpes, vs), bq=block_q, ppb=ppb,
                     num_splits=num_splits,
                     interpret=interpret, num_warps=num_warps, num_stages=num_stages, **kw)
    return out[:, :, :A, :U]


def paged_mla_attention(q_lat_BTHR, q_pe_BTHO, c_pages, kpe_pages, page_table, q_pos_BT, *, scale, platform="gpu",
                        interpret=False, block_q=None, pages_per_step=None, num_splits=None, num_warps=None):
    """Absorbed MLA over the paged latent cache; the reference's signature plus block choices. Returns u ``[B, T,
    H, R]`` float32 (latent space). All ``T * H`` query rows (row = t * H + h) share the one latent kv head."""
    B, T, H, R = q_lat_BTHR.shape
    ps, P = c_pages.shape[1], page_table.shape[1]
    rows = lambda x: x.reshape(B, 1, T * H, x.shape[-1])
    qpos = jnp.repeat(q_pos_BT.astype(jnp.int32), H, axis=1)
    # A wide latent makes the [rows, R] float32 accumulator the register budget on GPU: smaller tiles there. On
    # TPU every row block reads the pages once more: large row blocks.
    target = (32 if R > 256 else 64) if platform != "tpu" else 256
    dt = q_pe_BTHO.dtype if is_int8(c_pages) else c_pages.dtype
    bq = block_q or row_block(T * H, target, platform, dt)
    if num_splits is None:
        num_splits = default_splits(platform, B, 1, T * H, P * ps, ps)
    u = paged_rows(rows(q_lat_BTHR), qpos, jax.tree.map(lambda x: x[:, :, None, :], c_pages), None, page_table,
                   scale=scale, q_pe_BGAO=rows(q_pe_BTHO), kpe_pages=kpe_pages, v_is_k=True, platform=platform,
                   interpret=interpret, block_q=bq, pages_per_step=pages_per_step, num_splits=num_splits,
                   num_warps=num_warps or (8 if R > 256 else None), dtype=dt)
    return u.reshape(B, T, H, R)


def paged_attention(q_BTHK, k_pages, v_pages, page_table, q_pos_BT, *, scale, platform="gpu", interpret=False,
                    block_q=None, pages_per_step=None, num_splits=None):
    """Causal GQA over the paged cache; the reference's signature plus block choices. Returns o ``[B, T, H, U]``
    float32. The rows of the ``rep = H / G`` query heads sharing a kv head are processed together."""
    B, T, H, K = q_BTHK.shape
    ps, G = k_pages.shape[1], k_pages.shape[2]
    P = page_table.shape[1]
    if H % G:
        raise ValueError(f"paged_attention: {H} query heads are not a multiple of {G} kv heads")
    rep = H // G
    # rows of group g: (t, h) flattened t-major, so row // rep is the token
    q = jnp.transpose(q_BTHK.reshape(B, T, G, rep, K), (0, 2, 1, 3, 4)).reshape(B, G, T * rep, K)
    qpos = jnp.repeat(q_pos_BT.astype(jnp.int32), rep, axis=1)  # [B, T*rep]
    dt = q_BTHK.dtype if is_int8(k_pages) else k_pages.dtype
    bq = block_q or row_block(T * rep, 64 if platform != "tpu" else 128, platform, dt)
    if num_splits is None:
        num_splits = default_splits(platform, B, G, T * rep, P * ps, ps) if T * rep <= 64 else 1
    o = paged_rows(q, qpos, k_pages, v_pages, page_table, scale=scale, platform=platform, interpret=interpret,
                   block_q=bq, pages_per_step=pages_per_step, num_splits=num_splits, dtype=dt)
    U = o.shape[-1]
    return jnp.transpose(o.reshape(B, G, T, rep, U), (0, 2, 1, 3, 4)).reshape(B, T, H, U)
