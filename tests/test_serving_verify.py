"""The serving engine's speculative verify step (kimi_jax/serving/steps.py ``verify_step``) on the paged cache,
against its own one-token decode step: the K3 fixture in float32, two slots with different prompt lengths, one slot's
drafts wrong at the second position and the other's all right. The kept tokens are the decode steps' tokens, the
lengths match, the KDA states agree, and the next decode step from either cache gives the same logits (the attention
rows written past a rejected draft are never read)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kimi_jax
from kimi_jax.model.cache import KDACache, paged_cache
from kimi_jax.serving import steps

SLOTS, PAGE, PAGES_PER_SEQ = 2, 16, 4


def _samp(n=SLOTS):
    return steps.SlotSampling(jnp.zeros((n,), jnp.float32), jnp.zeros((n,), jnp.int32), jnp.ones((n,), jnp.float32),
                              jnp.zeros((n,), jnp.uint32), jnp.zeros((n,), jnp.int32))


def _kda(cache):
    return [e for e in (*cache.layers, *cache.stack) if isinstance(e, KDACache)]


@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["unrolled", "scanned"])
def test_verify_step_keeps_the_decode_steps_tokens_and_cache(k3_tiny_a, scan):
    model = kimi_jax.from_pretrained(k3_tiny_a, dtype="float32", progress=False, scan_layers=scan)
    graphdef, params = nnx.split(model)
    cache = paged_cache(model.cfg, SLOTS, SLOTS * PAGES_PER_SEQ, PAGE, jnp.float32, scan=scan)
    table = jnp.arange(SLOTS * PAGES_PER_SEQ, dtype=jnp.int32).reshape(SLOTS, PAGES_PER_SEQ)
    prefill = jax.jit(functools.partial(steps.prefill_chunk, graphdef, fresh=True))
    decode = jax.jit(functools.partial(steps.decode_step, graphdef))
    verify = jax.jit(functools.partial(steps.verify_step, graphdef))

    rng = np.random.default_rng(0)
    first = []
    for slot, n in enumerate((11, 20)):
        ids = np.zeros((1, 32), np.int32)
        ids[0, :n] = rng.integers(3, model.cfg.vocab_size, n)
        cache, tok, *_ = prefill(params, cache, table[slot:slot + 1], jnp.int32(slot), jnp.asarray(ids),
                                   jnp.int32(n), _samp(1))
        first.append(int(tok[0]))

    # plain: slot 0 takes 2 decode steps, slot 1 takes 4 (then idles)
    plain, toks, last = cache, [[t] for t in first], jnp.asarray(first, jnp.int32)
    for step in range(4):
        active = jnp.asarray([step < 2, True])
        plain, last, *_ = decode(params, plain, table, last, active, _samp())
        for b in range(SLOTS):
            if bool(active[b]):
                toks[b].append(int(last[b]))

    # speculative: one verify step; slot 0's second draft is wrong, slot 1's three are right
    drafts = np.array([[toks[0][1], toks[0][2] + 1, 5], toks[1][1:4]], np.int32)
    x = jnp.asarray(np.concatenate([np.array(first, np.int32)[:, None], drafts], axis=1))
    spec, t, kept, accepted, *_ = verify(params, cache, table, x, jnp.asarray([3, 3], jnp.int32), jnp.asarray([True, True]),
                                     _samp())
    assert kept.tolist() == [2, 4] and accepted.tolist() == [1, 3]
    assert [np.asarray(t)[b, :int(kept[b])].tolist() for b in range(SLOTS)] == [toks[0][1:3], toks[1][1:5]]
    np.testing.assert_array_equal(np.asarray(spec.lengths), np.asarray(plain.lengths))
    for a, b in zip(_kda(plain), _kda(spec)):
        for name in ("state", "conv_q", "conv_k", "conv_v"):
            np.testing.assert_allclose(np.asarray(getattr(b, name)), np.asarray(getattr(a, name)), atol=2e-5,
                                       err_msg=name)

    # the next step reads both caches alike
    nxt = jnp.asarray([toks[0][2], toks[1][4]], jnp.int32)
    both = jnp.asarray([True, True])
    record = jax.jit(functools.partial(steps.decode_step, graphdef, record=True))
    _, tp, _, lp, _ = record(params, plain, table, nxt, both, _samp())
    _, ts, _, ls, _ = record(params, spec, table, nxt, both, _samp())
    np.testing.assert_allclose(np.asarray(ls), np.asarray(lp), atol=1e-4)
    assert ts.tolist() == tp.tolist()
