"""K3.1's DSA selection: the streaming form (keys in blocks, a running top-k) chooses what the reference and the
float64 numpy oracle choose, static and paged, int8 keys included, and its memory does not grow with the context."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import cache_quant, dsa
from kernels_pallas.dsa import reference, streaming
from tests import k31_oracle as oracle

F32 = jnp.float32


def _operands(rng, B, T, S, H, K, q_pos, integer=False):
    draw = (lambda s: rng.integers(-2, 3, s).astype(np.float32)) if integer else rng.standard_normal
    q, w, k = (jnp.asarray(draw(s), F32) for s in ((B, T, H, K), (B, T, H), (B, S, K)))
    return q, w, k, jnp.asarray(q_pos, jnp.int32)


@pytest.mark.parametrize("S,topk,block,integer", [(37, 5, 8, False), (37, 5, 4, True), (40, 16, 8, True),
                                                  (20, 64, 8, False), (33, 3, 33, True)])
def test_streaming_equals_reference(S, topk, block, integer):
    """Same positions in the same order; small integer values make many exact ties (the later key must win)."""
    rng = np.random.default_rng(S + topk)
    B, T, H, K = 2, 6, 3, 4
    q_pos = [[0, 2, 7, 19, S - 2, S - 1], [1, 4, 5, 30 % S, 31 % S, 32 % S]]
    q, w, k, pos = _operands(rng, B, T, S, H, K, q_pos, integer)
    want = reference.select(q, w, k, pos, topk=topk)
    got = jax.jit(lambda *a: streaming.select(*a, topk=topk, key_block=block))(q, w, k, pos)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_streaming_matches_the_float64_oracle_with_ties():
    """The oracle's top-k mask (written from the spec, numpy) over the same scores: one causal prefill."""
    rng = np.random.default_rng(3)
    T, H, K, topk = 29, 2, 3, 6
    q, w, k, pos = _operands(rng, 1, T, T, H, K, [list(range(T))], integer=True)
    scores = np.einsum("th,tsh->ts", np.asarray(w[0], np.float64),
                       np.maximum(np.einsum("thk,sk->tsh", np.asarray(q[0], np.float64), np.asarray(k[0])), 0))
    want = oracle.topk_mask(np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf), topk)
    idx = streaming.select(q, w, k, pos, topk=topk, key_block=4)
    got = np.asarray(reference.chosen_mask(idx, T))[0]
    assert (scores[np.tril(np.ones((T, T), bool))] == 0).sum() > T  # ties at zero really occur
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("int8", [False, True])
def test_paged_streaming_equals_reference(int8):
    """Keys in a shuffled page pool: whole pages per block (a block smaller than a page still takes one page)."""
    rng = np.random.default_rng(5)
    B, T, H, K, page, P, topk = 2, 3, 2, 4, 4, 6, 5
    q, w, k, pos = _operands(rng, B, T, P * page, H, K, [[3, 17, 23], [0, 9, 10]], integer=True)
    pool = k.reshape(B * P, page, K)
    pool = cache_quant.quantize(pool) if int8 else pool
    table = jnp.asarray(rng.permutation(B * P).reshape(B, P), jnp.int32)
    want = reference.paged_select(q, w, pool, table, pos, topk=topk)
    for block in (2, 8, 12, 1000):
        got = streaming.paged_select(q, w, pool, table, pos, topk=topk, key_block=block)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"key_block={block}")


def test_automatic_choice_streams_long_contexts():
    B, T, H, K, topk = 1, 2, 2, 4, 8
    short, long_ = streaming.KEY_BLOCK + topk, streaming.KEY_BLOCK + topk + 1
    args = lambda S: (jax.ShapeDtypeStruct((B, T, H, K), F32), jax.ShapeDtypeStruct((B, T, H), F32),
                      jax.ShapeDtypeStruct((B, S, K), F32), jax.ShapeDtypeStruct((B, T), jnp.int32))
    assert dsa.SELECT_OP.choose(None, args(short), dict(topk=topk)) == "reference"
    assert dsa.SELECT_OP.choose(None, args(long_), dict(topk=topk)) == "streaming"
    assert dsa.SELECT_OP.choose("pallas", args(long_), dict(topk=topk)) == "streaming"  # no Pallas on CPU
    assert dsa.SELECT_OP.choose("pallas_interpret", args(long_), dict(topk=topk)) == "pallas_interpret"
    assert dsa.SELECT_OP.choose("reference", args(long_), dict(topk=topk)) == "reference"
    pages = (*args(0)[:2], jax.ShapeDtypeStruct((64, 64, K), F32), jax.ShapeDtypeStruct((B, 64), jnp.int32),
             args(0)[3])
    assert dsa.PAGED_SELECT_OP.choose(None, pages, dict(topk=topk)) == "streaming"  # 4,096 positions


def test_streaming_memory_does_not_grow_with_the_context():
    """XLA:CPU's buffer assignment: the reference holds [B, T, S] float32 scores; the streaming form's temporaries
    stay near [B, T, KEY_BLOCK + X] whether the context is 16K or 64K keys."""
    B, T, H, K, topk = 1, 128, 4, 32, 256

    def temp(fn, S):
        shapes = (jax.ShapeDtypeStruct((B, T, H, K), F32), jax.ShapeDtypeStruct((B, T, H), F32),
                  jax.ShapeDtypeStruct((B, S, K), F32), jax.ShapeDtypeStruct((B, T), jnp.int32))
        return jax.jit(lambda *a: fn(*a, topk=topk)).lower(*shapes).compile().memory_analysis().temp_size_in_bytes

    bound = B * T * (streaming.KEY_BLOCK + topk) * 4
    for S in (1 << 14, 1 << 16):
        assert temp(reference.select, S) >= B * T * S * 4
        assert temp(streaming.select, S) < 4 * bound, (S, temp(streaming.select, S), bound)


# each backend's block rules, run by the interpreter (TPU's -m slow: CI time)
@pytest.mark.parametrize("platform", ["gpu", pytest.param("tpu", marks=pytest.mark.slow)])
def test_pallas_scores_equal_the_reference(platform):
    """The kernel's scores equal the reference's bit for bit on integer-valued operands (exact in float32; -inf past
    each query), and so the selection (static and paged), including decode-shaped calls of one query."""
    from kernels_pallas.dsa import pallas

    rng = np.random.default_rng(11)
    for B, T, S, H, K, topk in ((2, 6, 37, 3, 4, 5), (1, 9, 150, 4, 16, 8), (3, 1, 100, 2, 8, 16)):
        q_pos = np.sort(rng.integers(0, S, (B, T)), axis=1)
        q, w, k, pos = _operands(rng, B, T, S, H, K, q_pos, integer=True)
        got = pallas.block_scores(q, w, k, pos, platform=platform, interpret=True)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(reference.index_scores(q, w, k, pos)))
        want = reference.select(q, w, k, pos, topk=topk)
        got = pallas.select(q, w, k, pos, topk=topk, platform=platform, interpret=True, key_block=64)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    page, P = 16, 5
    q, w, k, pos = _operands(rng, 2, 3, P * page, 2, 4, [[3, 40, 79], [0, 17, 18]], integer=True)
    pool, table = k.reshape(2 * P, page, 4), jnp.asarray(rng.permutation(2 * P).reshape(2, P), jnp.int32)
    got = pallas.paged_select(q, w, pool, table, pos, topk=6, platform=platform, interpret=True, key_block=32)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(reference.paged_select(q, w, pool, table, pos, topk=6)))


def test_int8_keys_pass_over_the_kernel():
    """int8 keys: the automatic choice on GPU runs a plain-XLA form; asking for the kernel raises."""
    from kernels_pallas._dispatch import KernelUnavailable

    B, T, H, K, S = 1, 2, 2, 4, 64
    args = (jax.ShapeDtypeStruct((B, T, H, K), F32), jax.ShapeDtypeStruct((B, T, H), F32),
            cache_quant.quantize(jnp.zeros((B, S, K), F32)), jax.ShapeDtypeStruct((B, T), jnp.int32))
    assert dsa.SELECT_OP.choose("pallas_interpret", args[:2] + (jnp.zeros((B, S, K)),) + args[3:],
                                dict(topk=8)) == "pallas_interpret"
    with pytest.raises(KernelUnavailable, match="int8"):
        dsa.SELECT_OP.choose("pallas_interpret", args, dict(topk=8))
