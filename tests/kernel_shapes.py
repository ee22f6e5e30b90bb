"""Awkward shapes a model config allows, one table for every kernel op: what the deviceless compile sweep
(tests/test_aot_shapes.py) compiles for a TPU and a GPU, and what the interpret-mode parity test
(tests/test_kernels_shapes.py) checks against the references.

Full-size models have friendly dims (head dims 128, latent 512, 2^k experts); a config may ask for any. The
kernels pad what their backend's block rules refuse (Triton: power-of-two blocks; Mosaic: (8, 128) tiles or whole
dims) and must slice it back, so the table takes sizes that no such rule likes: latent ranks and head dims of 24, 40
and 72 (not multiples of 16, 32 or 128; 24 and 40 not of 16 either), odd head counts (1, 3, 5), KDA head dims 32
and 48, expert counts 3, 5 and 6 (never a power of two), value dims that differ from key dims, and lengths that fill
no block. Each case is a few sequences long: enough to cross a block boundary, cheap to run in interpret mode. A few
sizes come from run options rather than the config (a page of 8 or 24 tokens, int4 / NF4 groups of 48 or 96
columns): the GPU kernels cannot block those and refuse them by name (``Case.gpu`` False), the TPU ones take them.

``FAST`` cases cover every value of every dimension at least once (a covering set, not the cross product, which is
``SLOW``). A case builds its own operands from a seed (numpy draws: no per-shape compiles in the setup); the
parity test runs them in float32, the compile sweep in the dtypes a bfloat16 model feeds the kernels.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import kernels_pallas.attention as attn_api
import kernels_pallas.kda as kda_api
import kernels_pallas.mla_decode as mla_api
import kernels_pallas.moe_gmm as moe_api
import kernels_pallas.paged_attention as paged_api
import kernels_pallas.qmatmul as qmatmul_api
import kernels_pallas.sparse_mla as sparse_api
from kernels_pallas import cache_quant, mxfp4, quant
from kernels_pallas.paged_attention import pallas as paged_pallas

F32, BF = jnp.float32, jnp.bfloat16
B = 2  # sequences in every attention / KDA case
PAGE = 16  # the smallest page the GPU paged kernel takes (a power of two >= 16)

OPS = ("attention", "mla_decode", "paged_attention", "sparse_mla", "kda", "moe_gmm", "qmatmul")


@dataclasses.dataclass(frozen=True)
class Case:
    """One op at one shape. ``make(rng, dt)``: the operands, with ``dt`` the activation / cache dtype (float32 for
    parity, bfloat16 as a model compiles them); ``run(*operands, implementation=...)``: the op's result (an array
    or a tuple of them)."""

    op: str  # the kernels_pallas package
    name: str  # readable parametrize id: "mla_decode-H3-R24-O8"
    make: Callable
    run: Callable
    gpu: bool = True  # whether the GPU (Triton) kernel takes these shapes; else it must refuse them by name


def _normal(rng, shape, dt, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape, np.float32) * scale).astype(dt)


def _positions(T, S):
    """Query positions ``[B, T]``: sequence 0 early in the cache (most blocks unseen), sequence 1 at its end."""
    return jnp.asarray(np.stack([np.arange(T) + min(3, S - T), np.arange(T) + S - T]), jnp.int32)


# -- attention ------------------------------------------------------------------------------------------------


def gqa(H, G, K, T, S):
    """Causal GQA over ``S`` keys: prefill when ``T == S`` (keys at 0..T-1), else decode over a static cache."""

    def make(rng, dt):
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)) if T == S else _positions(T, S)
        return (_normal(rng, (B, T, H, K), dt), _normal(rng, (B, S, G, K), dt), _normal(rng, (B, S, G, K), dt), pos)

    run = lambda q, k, v, pos, **kw: attn_api.attention(q, k, v, pos, scale=K**-0.5, **kw)
    return Case("attention", f"gqa-{'prefill' if T == S else 'decode'}-H{H}-G{G}-K{K}-T{T}-S{S}", make, run)


def mla_prefill(H, K, O, U, T):
    """MLA's expanded prefill: nope ``K`` + decoupled ``O`` key dims, value dim ``U`` (unlike ``K``)."""

    def make(rng, dt):
        return (_normal(rng, (B, T, H, K), dt), _normal(rng, (B, T, H, K), dt), _normal(rng, (B, T, H, U), dt),
                jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)), _normal(rng, (B, T, H, O), dt),
                _normal(rng, (B, T, O), dt))

    run = lambda q, k, v, pos, qpe, kpe, **kw: attn_api.attention(q, k, v, pos, scale=(K + O)**-0.5, q_pe=qpe,
                                                                  k_pe=kpe, **kw)
    return Case("attention", f"mla-prefill-H{H}-K{K}-O{O}-U{U}-T{T}", make, run)


# -- MLA over the latent cache --------------------------------------------------------------------------------


def _latent(rng, shape, dt, int8):
    """Cache rows in ``dt``, or int8 rows: random codes and positive per-row scales (any such pair is a valid
    cache)."""
    if not int8:
        return _normal(rng, shape, dt)
    return cache_quant.Int8Rows(jnp.asarray(rng.integers(-127, 128, shape), jnp.int8),
                                jnp.asarray(rng.uniform(0.005, 0.02, (*shape[:-1], 1)), F32))


def mla_decode(H, R, O, T, S, int8=False):
    """Absorbed MLA: the float32 absorbed query ``[B, T, H, R]`` over a latent cache of rank ``R`` (int8 rows with
    ``int8``)."""

    def make(rng, dt):
        return (_normal(rng, (B, T, H, R), F32, 0.3), _normal(rng, (B, T, H, O), dt), _latent(rng, (B, S, R), dt, int8),
                _latent(rng, (B, S, O), dt, int8), _positions(T, S))

    run = lambda ql, qpe, c, kpe, pos, **kw: mla_api.mla_attention(ql, qpe, c, kpe, pos, scale=(R + O)**-0.5, **kw)
    return Case("mla_decode", f"mla_decode-H{H}-R{R}-O{O}-T{T}-S{S}" + ("-int8" if int8 else ""), make, run)


# -- paged cache ------------------------------------------------------------------------------------------------

N_PAGES, TABLE = 9, 3  # a pool of 9 pages; 3 pages per sequence


def _page_table(rng):
    return jnp.asarray(rng.permutation(N_PAGES)[: B * TABLE].reshape(B, TABLE), jnp.int32)


def _page_name(page):
    return "" if page == PAGE else f"-page{page}"


def paged_mla(H, R, O, T, page=PAGE):
    """Absorbed MLA over a paged latent cache; a ``page`` that is not a power of two >= 16 is one the GPU kernel
    refuses (the automatic choice runs the reference there)."""

    def make(rng, dt):
        return (_normal(rng, (B, T, H, R), F32, 0.3), _normal(rng, (B, T, H, O), dt),
                _normal(rng, (N_PAGES, page, R), dt), _normal(rng, (N_PAGES, page, O), dt), _page_table(rng),
                _positions(T, TABLE * page))

    run = lambda ql, qpe, c, kpe, pt, pos, **kw: paged_api.paged_mla_attention(ql, qpe, c, kpe, pt, pos,
                                                                               scale=(R + O)**-0.5, **kw)
    return Case("paged_attention", f"paged_mla-H{H}-R{R}-O{O}-T{T}{_page_name(page)}", make, run,
                gpu=paged_pallas.unsupported("gpu", (N_PAGES, page)) is None)


def paged_gqa(H, G, K, T, page=PAGE):
    def make(rng, dt):
        return (_normal(rng, (B, T, H, K), dt), _normal(rng, (N_PAGES, page, G, K), dt),
                _normal(rng, (N_PAGES, page, G, K), dt), _page_table(rng), _positions(T, TABLE * page))

    run = lambda q, k, v, pt, pos, **kw: paged_api.paged_attention(q, k, v, pt, pos, scale=K**-0.5, **kw)
    return Case("paged_attention", f"paged_gqa-H{H}-G{G}-K{K}-T{T}{_page_name(page)}", make, run,
                gpu=paged_pallas.unsupported("gpu", (N_PAGES, page)) is None)


# -- sparse MLA (K3.1's DSA attention) ------------------------------------------------------------------------

X = 20  # chosen positions per query row: no whole block of them


def _chosen(rng, T, positions):
    """Distinct chosen positions ``[B, T, X]`` among ``positions``: query row r has ``X - 3 * r`` of them (the last
    rows fewer: -1 padding), shuffled among the -1s."""
    idx = np.full((B, T, X), -1, np.int32)
    for r in range(B * T):
        n = max(X - 3 * r, 0)
        row = idx[r // T, r % T]
        row[:n] = rng.permutation(positions)[:n]
        rng.shuffle(row)
    return jnp.asarray(idx)


def sparse_mla(H, R, O, T, S):
    """Absorbed MLA over ``X`` chosen positions of a latent cache of ``S`` slots (``O = 0``: no decoupled part)."""

    def make(rng, dt):
        return (_normal(rng, (B, T, H, R), F32, 0.3), _normal(rng, (B, T, H, O), dt), _normal(rng, (B, S, R), dt),
                _normal(rng, (B, S, O), dt), _chosen(rng, T, S))

    run = lambda ql, qpe, c, kpe, idx, **kw: sparse_api.sparse_mla_attention(ql, qpe, c, kpe, idx,
                                                                             scale=(R + O)**-0.5, **kw)
    return Case("sparse_mla", f"sparse_mla-H{H}-R{R}-O{O}-T{T}-S{S}", make, run)


def paged_sparse_mla(H, R, O, T, page=PAGE):
    def make(rng, dt):
        return (_normal(rng, (B, T, H, R), F32, 0.3), _normal(rng, (B, T, H, O), dt),
                _normal(rng, (N_PAGES, page, R), dt), _normal(rng, (N_PAGES, page, O), dt), _page_table(rng),
                _chosen(rng, T, TABLE * page))

    run = lambda ql, qpe, c, kpe, pt, idx, **kw: sparse_api.paged_sparse_mla_attention(ql, qpe, c, kpe, pt, idx,
                                                                                       scale=(R + O)**-0.5, **kw)
    return Case("sparse_mla", f"paged_sparse_mla-H{H}-R{R}-O{O}-T{T}{_page_name(page)}", make, run)


# -- KDA ------------------------------------------------------------------------------------------------------


def kda(H, D, T):
    """KDA with head dim ``D`` (keys and values): chunked prefill for ``T > 1``, the recurrent step for ``T == 1``.
    Operands as the model makes them: L2-normalised q and k, log decays <= 0, beta in (0, 1), a float32 state."""

    def make(rng, dt):
        def unit():
            x = rng.standard_normal((B, T, H, D), np.float32)
            return jnp.asarray(x / np.linalg.norm(x, axis=-1, keepdims=True))

        g = -jnp.asarray(rng.uniform(0.01, 0.7, (B, T, H, D)), F32)
        return (unit(), unit(), _normal(rng, (B, T, H, D), dt), g,
                jnp.asarray(rng.uniform(0.1, 0.9, (B, T, H)), F32), _normal(rng, (B, H, D, D), F32, 0.1))

    if T == 1:
        run = lambda *a, **kw: kda_api.kda_decode(*a, scale=D**-0.5, **kw)
    else:
        run = lambda *a, **kw: kda_api.kda_prefill(*a, scale=D**-0.5, **kw)
    return Case("kda", f"kda_{'decode' if T == 1 else 'prefill'}-H{H}-D{D}-T{T}", make, run)


# -- expert matmuls -------------------------------------------------------------------------------------------


def _experts(rng, E, J, I, dt, fmt):  # noqa: E741
    if fmt == "mxfp4":  # random codes over every byte; E8M0 scales 2^-2 .. 2^0 keep products O(1)
        return mxfp4.MXFP4Weight(jnp.asarray(rng.integers(0, 256, (E, J, I // 2)), jnp.uint8),
                                 jnp.asarray(rng.integers(125, 128, (E, J, I // mxfp4.GROUP)), jnp.uint8))
    return _normal(rng, (E, J, I), dt, I**-0.5)


def gmm(E, J, I, M, fmt="float"):  # noqa: E741
    """Prefill-shaped: ``M`` rows sorted by expert over ``E`` experts, one group empty, a few rows past the groups."""

    def make(rng, dt):
        cuts = np.sort(rng.integers(0, M - 3, E - 1))
        sizes = np.diff(np.concatenate([[0], cuts, [M - 3]]))
        sizes[E // 2] += sizes[0]  # one empty group; the last 3 rows belong to none (the kernel gives zeros)
        sizes[0] = 0
        return _normal(rng, (M, I), dt), _experts(rng, E, J, I, dt, fmt), jnp.asarray(sizes, jnp.int32)

    run = lambda x, w, gs, **kw: moe_api.gmm(x, w, gs, compute_dtype=x.dtype, **kw)
    return Case("moe_gmm", f"gmm-{fmt}-E{E}-J{J}-I{I}-M{M}", make, run)


def gather(E, X, J, I, N, fmt="float"):  # noqa: E741
    """Decode-shaped: ``N`` tokens, ``X`` experts each out of ``E``."""

    def make(rng, dt):
        return (_normal(rng, (N, X, I), dt), _experts(rng, E, J, I, dt, fmt),
                jnp.asarray(rng.integers(0, E, (N, X)), jnp.int32))

    run = lambda x, w, idx, **kw: moe_api.gather_matmul(x, w, idx, compute_dtype=x.dtype, **kw)
    return Case("moe_gmm", f"gather-{fmt}-E{E}-X{X}-J{J}-I{I}-N{N}", make, run)


# -- integer-weight matmul ------------------------------------------------------------------------------------


def _qweight(rng, J, I, fmt):  # noqa: E741
    """A ``[J, I]`` weight in ``fmt``: random codes over every byte value, positive scales (zero points over -8..7)."""
    f = quant.Format.parse(fmt)
    if f.kind == "int8":
        return quant.Int8Weight(jnp.asarray(rng.integers(-128, 128, (J, I)), jnp.int8),
                                jnp.asarray(rng.uniform(0.5, 1.5, (J, 1)) / (64 * I**0.5), F32))
    packed = jnp.asarray(rng.integers(0, 256, (J, I // 2)), jnp.uint8)
    scale = jnp.asarray(rng.uniform(0.5, 1.5, (J, I // f.group)) / (4 * I**0.5), F32)
    if f.kind == "nf4":
        return quant.NF4Weight(packed, scale)
    if f.zero_point:
        return quant.Int4ZeroWeight(packed, scale, jnp.asarray(rng.integers(-8, 8, (J, I // f.group)), jnp.int8))
    return quant.Int4Weight(packed, scale)


def qmatmul(M, J, I, fmt):  # noqa: E741
    """``x [M, I]`` times a ``[J, I]`` weight in ``fmt`` (``int8``, ``int4:g32``, ``int4:g32:zero``, ``nf4:g64``)."""

    def make(rng, dt):
        return _normal(rng, (M, I), dt), _qweight(rng, J, I, fmt)

    run = lambda x, w, **kw: qmatmul_api.matmul(x, w, **kw)
    group = quant.Format.parse(fmt).group
    return Case("qmatmul", f"qmatmul-{fmt.replace(':', '-')}-M{M}-J{J}-I{I}", make, run,
                gpu=fmt == "int8" or group & (group - 1) == 0)


# -- the table --------------------------------------------------------------------------------------------------

# Every value of every awkward dimension at least once; the latent / head dims pair with different head counts in
# each op so that a kernel broken for one (head count, dim) pair still shows.
FAST = [
    gqa(1, 1, 24, 19, 19), gqa(3, 1, 40, 19, 19), gqa(5, 5, 72, 19, 19), gqa(3, 3, 40, 2, 100),
    gqa(5, 1, 72, 1, 100),
    mla_prefill(1, 16, 8, 24, 19), mla_prefill(3, 40, 24, 72, 19), mla_prefill(5, 24, 8, 40, 19),
    mla_decode(3, 24, 8, 1, 100), mla_decode(1, 40, 24, 2, 100), mla_decode(5, 72, 8, 1, 100),
    mla_decode(3, 24, 8, 1, 100, int8=True),
    paged_mla(3, 24, 8, 1), paged_mla(5, 72, 24, 2), paged_gqa(3, 1, 40, 1), paged_gqa(5, 5, 24, 2),
    sparse_mla(3, 24, 8, 1, 100), sparse_mla(1, 40, 0, 1, 100), paged_sparse_mla(5, 72, 24, 2),
    kda(3, 32, 37), kda(5, 48, 37), kda(1, 48, 1), kda(3, 32, 1),
    gmm(3, 24, 96, 40), gmm(6, 72, 40, 40), gmm(5, 40, 96, 40, "mxfp4"),
    gather(6, 3, 24, 96, 2), gather(5, 3, 40, 160, 2, "mxfp4"),
    qmatmul(1, 24, 96, "int8"), qmatmul(37, 72, 40, "int8"), qmatmul(5, 40, 96, "int4:g32"),
    qmatmul(3, 24, 192, "nf4:g64"),
    # sizes the GPU kernels refuse by name (the automatic choice runs the reference there); the TPU ones take them
    paged_gqa(3, 1, 40, 1, page=8), qmatmul(5, 24, 96, "int4:g48"),
]


def _slow():
    """The cross product of the same dimensions, less the fast cases."""
    heads, dims = (1, 3, 5), (24, 40, 72)
    cases = []
    for H, K in itertools.product(heads, dims):
        cases += [gqa(H, 1, K, 19, 19), gqa(H, H, K, 19, 19), gqa(H, 1, K, 1, 100), gqa(H, H, K, 2, 100),
                  mla_prefill(H, 16, 8, K, 19), mla_prefill(H, K, 24, K, 19),
                  mla_decode(H, K, 8, 1, 100), mla_decode(H, K, 24, 2, 100), mla_decode(H, K, 8, 1, 100, int8=True),
                  paged_mla(H, K, 8, 1), paged_gqa(H, 1, K, 1), paged_gqa(H, H, K, 2), paged_mla(H, K, 8, 2, page=24),
                  paged_gqa(H, H, K, 1, page=8), sparse_mla(H, K, 8, 1, 100), sparse_mla(H, K, 24, 2, 100),
                  sparse_mla(H, K, 0, 1, 100), paged_sparse_mla(H, K, 8, 1), paged_sparse_mla(H, K, 24, 2),
                  paged_sparse_mla(H, K, 8, 2, page=24)]
    for H, D in itertools.product(heads, (32, 48)):
        cases += [kda(H, D, 37), kda(H, D, 1)]
    for E, (J, I) in itertools.product((3, 5, 6), ((24, 96), (72, 40), (40, 72))):  # noqa: E741
        cases += [gmm(E, J, I, 40), gather(E, 3, J, I, 2)]
    for E, (J, I) in itertools.product((3, 5, 6), ((24, 96), (40, 160))):  # noqa: E741
        cases += [gmm(E, J, I, 40, "mxfp4"), gather(E, 3, J, I, 2, "mxfp4")]
    for M, (J, I) in itertools.product((1, 37), ((24, 96), (72, 40), (40, 72))):  # noqa: E741
        cases.append(qmatmul(M, J, I, "int8"))
    for M, (J, I), fmt in itertools.product((1, 37), ((24, 96), (40, 192)), ("int4:g32", "int4:g32:zero",  # noqa: E741
                                                                             "nf4:g64", "int4:g48", "nf4:g96")):
        if I % int(fmt.split(":")[1][1:]) == 0:
            cases.append(qmatmul(M, J, I, fmt))
    fast = {c.name for c in FAST}
    return list({c.name: c for c in cases if c.name not in fast}.values())


SLOW = _slow()


def operands(case: Case, dt, seed=0):
    """The case's operands, drawn from a stream seeded by (seed, op, name): the same whatever runs first."""
    rng = np.random.default_rng([seed, *map(ord, case.name)])
    return case.make(rng, dt)


def leaves(out):
    """The op's results as a list of arrays (KDA returns (o, state))."""
    return jax.tree.leaves(out)
