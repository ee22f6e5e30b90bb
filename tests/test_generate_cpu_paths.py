"""The CPU fast paths generation relies on, against independent float64 numpy products and the slow forms
they replace: tiled grouped matmul (vs the reference, lax.ragged_dot), slot-loop expert gather, KDA prefill as the
recurrence."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.kda import reference as kda_ref
from kernels_pallas.moe_gmm import reference as moe_ref
from kernels_pallas.moe_gmm import xla_cpu as moe_cpu
from kernels_pallas.mxfp4 import MXFP4Weight, dequantize
from kimi_jax.model.run import RunConfig


def _groups_np(x, w, sizes):
    out = np.zeros((x.shape[0], w.shape[1]))
    o = 0
    for e, n in enumerate(sizes):
        out[o : o + n] = x[o : o + n] @ w[e].T
        o += n
    return out


@pytest.mark.parametrize("sizes", [[5, 0, 40, 1, 0, 19], [0, 0, 0, 64, 0, 0], [3, 3, 3, 3, 3, 3], [0] * 6])
@pytest.mark.parametrize("tile", [8, 32])
def test_tiled_gmm_matches_numpy_and_ragged_dot(sizes, tile):
    rng = np.random.default_rng(sum(sizes) + tile)
    M = 70  # rows past sum(sizes) must come out zero
    x = rng.standard_normal((M, 48)).astype(np.float32)
    w = rng.standard_normal((6, 24, 48)).astype(np.float32) / 7
    gs = jnp.asarray(sizes, jnp.int32)
    got = np.asarray(jax.jit(lambda a, b, c: moe_cpu.gmm(a, b, c, tile=tile))(x, w, gs))
    want = _groups_np(x.astype(np.float64), w.astype(np.float64), sizes)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    ragged = jax.jit(moe_ref.gmm)(x, w, gs)
    np.testing.assert_allclose(got, np.asarray(ragged), atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(ragged), want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("M,sizes,capacity", [(10, [2, 0, 3, 1, 0, 2], None), (70, [30, 0, 0, 2, 0, 1], 8)])
def test_gmm_tile_only_and_capacity_overflow(M, sizes, capacity):
    """Few rows per expert (every row goes through the tile loop) and a small capacity (most rows overflow it)."""
    rng = np.random.default_rng(M)
    x = rng.standard_normal((M, 16)).astype(np.float32)
    w = rng.standard_normal((6, 8, 16)).astype(np.float32)
    got = np.asarray(jax.jit(lambda a, b, c: moe_cpu.gmm(a, b, c, tile=4, capacity=capacity))(
        x, w, jnp.asarray(sizes, jnp.int32)))
    np.testing.assert_allclose(got, _groups_np(x.astype(np.float64), w.astype(np.float64), sizes), atol=2e-5)


def test_tiled_gmm_and_gather_with_mxfp4_weights():
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (4, 16, 32), dtype=np.uint8)
    scale = rng.integers(120, 124, (4, 16, 2), dtype=np.uint8)
    w = MXFP4Weight(jnp.asarray(packed), jnp.asarray(scale))
    dense = np.asarray(dequantize(w, jnp.float32), np.float64)
    x = rng.standard_normal((20, 64)).astype(np.float32)
    sizes = [7, 0, 9, 4]
    for gmm in (moe_cpu.gmm, moe_ref.gmm):
        got = np.asarray(jax.jit(gmm)(x, w, jnp.asarray(sizes, jnp.int32)))
        np.testing.assert_allclose(got, _groups_np(x.astype(np.float64), dense, sizes), atol=1e-5)
    idx = rng.integers(0, 4, (3, 2))
    xs = rng.standard_normal((3, 2, 64)).astype(np.float32)
    got = np.asarray(jax.jit(moe_ref.gather_matmul)(xs, w, jnp.asarray(idx)))
    want = np.einsum("nxk,nxfk->nxf", xs.astype(np.float64), dense[idx])
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("E,N", [(5, 4), (70, 6)])
@pytest.mark.parametrize("unroll_slots", [0, 16])  # the slot loop, and slots written out (up to 16)
def test_gather_matmul_float_weights(E, N, unroll_slots):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((E, 12, 16)).astype(np.float32)
    xs = rng.standard_normal((N, 3, 16)).astype(np.float32)
    idx = rng.integers(0, E, (N, 3))
    got = np.asarray(jax.jit(functools.partial(moe_ref.gather_matmul, unroll_slots=unroll_slots))(
        xs, w, jnp.asarray(idx)))
    np.testing.assert_allclose(got, np.einsum("nxk,nxfk->nxf", xs, w[idx]), atol=1e-5)


def test_kda_chunk_of_one_is_the_recurrence_and_the_cpu_choice():
    ks = jax.random.split(jax.random.key(3), 6)
    B, T, H, K = 2, 9, 2, 8
    n = lambda a: a / jnp.linalg.norm(a, axis=-1, keepdims=True)
    q, k = n(jax.random.normal(ks[0], (B, T, H, K))), n(jax.random.normal(ks[1], (B, T, H, K)))
    v = jax.random.normal(ks[2], (B, T, H, K))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, H, K)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    s0 = jax.random.normal(ks[5], (B, H, K, K))
    o1, s1 = kda_ref.kda_chunked(q, k, v, g, beta, s0, scale=0.3, chunk_size=1)
    o4, s4 = kda_ref.kda_chunked(q, k, v, g, beta, s0, scale=0.3, chunk_size=4)
    np.testing.assert_allclose(np.asarray(o1), np.asarray(o4), atol=1e-5)
    np.testing.assert_allclose(np.asarray(s1), np.asarray(s4), atol=1e-5)
    # the model leaves the chunk to the op (RunConfig.kda_chunk None): on CPU it runs the recurrence
    assert RunConfig().kda_chunk is None
    from kernels_pallas import kda

    assert kda.PREFILL.choose(None, (q, k, v, g, beta, s0), {"chunk_size": None}) in ("cpu_native", "xla_cpu")
    assert kda.PREFILL.choose("reference", (q, k, v, g, beta, s0), {"chunk_size": None}) == "reference"


@pytest.mark.parametrize("act", ["silu", "situ"])
def test_expert_paths_agree_with_numpy(act):
    """gather (per-slot loop), sorted (grouped matmul) and dense (every expert on every token) against a float64
    numpy oracle; the automatic choice on CPU picks each in its range of (token, expert) pairs."""
    from flax import nnx

    from kimi_jax.model.config import MoEConfig
    from kimi_jax.model.moe import Experts

    cfg = MoEConfig(hidden=32, num_experts=8, top_k=2, expert_intermediate=16, num_shared=0, shared_intermediate=0,
                    act=act, situ_beta=2.0, situ_linear_beta=3.0)
    ex = Experts(cfg, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    w1, w3, w2 = (np.asarray(getattr(ex, n)[...], np.float64) * 20 for n in ("w1", "w3", "w2"))
    for n, v in zip(("w1", "w3", "w2"), (w1, w3, w2)):
        getattr(ex, n)[...] = jnp.asarray(v, jnp.float32)

    def oracle(z, idx):
        a, b = np.einsum("nl,nxfl->nxf", z, w1[idx]), np.einsum("nl,nxfl->nxf", z, w3[idx])
        if act == "silu":
            h = a / (1 + np.exp(-a)) * b
        else:
            h = 2.0 * np.tanh(a / 2.0) / (1 + np.exp(-a)) * 3.0 * np.tanh(b / 3.0)
        return np.einsum("nxf,nxlf->nxl", h, w2[idx])

    run = RunConfig(dtype=jnp.float32)
    rng = np.random.default_rng(0)
    for N in (1, 3, 6, 40):
        z = rng.standard_normal((N, 32))
        idx = np.stack([rng.choice(8, 2, replace=False) for _ in range(N)]).astype(np.int32)
        want = oracle(z, idx)
        for path in ("gather", "sorted", "dense"):
            got = ex(jnp.asarray(z, jnp.float32), jnp.asarray(idx), RunConfig(dtype=jnp.float32, moe_path=path))
            np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5 * np.abs(want).max(),
                                       err_msg=f"{path} N={N}")
    # bfloat16 runs every path too (XLA:CPU has no standalone bf16 dot with f32 output: the CPU forms must not need one)
    z, idx = rng.standard_normal((3, 32)), np.array([[0, 1], [2, 3], [1, 7]], np.int32)
    for path in ("gather", "sorted", "dense"):
        got = ex(jnp.asarray(z, jnp.bfloat16), jnp.asarray(idx), RunConfig(dtype=jnp.bfloat16, moe_path=path))
        want = oracle(z, idx)
        np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=0.03 * np.abs(want).max(), err_msg=path)
    # 8 experts on CPU: gather up to 8 pairs with the native kernel, dense up to 16, sorted beyond; the
    # reference: gather up to one pair per expert, sorted beyond (dense is an XLA:CPU form, not the oracle's)
    ref = RunConfig(dtype=jnp.float32, implementation="reference")
    assert [ex.path(p, ref) for p in (2, 5, 8, 9, 17)] == ["gather", "gather", "gather", "sorted", "sorted"]
    assert [ex.path(p, run) for p in (2, 6, 8, 9, 16, 17)] == \
        ["gather", "gather", "gather", "dense", "dense", "sorted"]


@pytest.mark.parametrize("rows", [1, 2, 7, 32, 33])
def test_linear_skinny_form_matches_numpy(rows):
    """``linear`` computes few-row products as (W x^T)^T on CPU: same values as the plain product."""
    from kimi_jax.model.layers import linear

    rng = np.random.default_rng(rows)
    x = rng.standard_normal((1, rows, 64)).astype(np.float32)
    w = rng.standard_normal((48, 64)).astype(np.float32)
    got = np.asarray(jax.jit(lambda a, b: linear(a, b, RunConfig(dtype=jnp.float32)))(x, w))
    assert got.shape == (1, rows, 48)
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-5, atol=1e-4)
    bf = np.asarray(jax.jit(lambda a, b: linear(a, b, RunConfig(dtype=jnp.bfloat16)))(x, w), np.float32)
    np.testing.assert_allclose(bf, got, atol=0.02 * np.abs(got).max())


@pytest.mark.parametrize("rows", [(1, 1), (8, 1), (2, 3), (3, 40)])  # (B, T): one row, skinny rows, many rows
@pytest.mark.parametrize("transpose_w", [False, True])
def test_mla_per_head_products_match_numpy(rows, transpose_w):
    """The absorbed-MLA per-head products: the heads-first form for a few rows on CPU (xla_cpu), the plain einsum
    (reference), both against numpy."""
    from kernels_pallas import matvec

    B, T = rows
    rng = np.random.default_rng(B * 100 + T)
    x = rng.standard_normal((B, T, 4, 24)).astype(np.float32)
    w = rng.standard_normal((4, 24, 40) if not transpose_w else (4, 40, 24)).astype(np.float32) / 5
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    want = np.einsum("bthi,hoi->btho" if transpose_w else "bthi,hio->btho", x64, w64)
    for impl in (None, "xla_cpu", "reference"):
        f = lambda a, b: matvec.per_head(a, b, transpose_w=transpose_w, implementation=impl)  # noqa: B023
        got = np.asarray(jax.jit(f)(x, w))
        assert got.shape == (B, T, 4, 40)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0, err_msg=str(impl))
