"""Sampling (temperature / top-k / top-p) against numpy-computed target distributions, and cache sizes
against the K3 spec's arithmetic."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax.generation.generate import argmax, sample
from kimi_jax.model import cache as cache_lib
from kimi_jax.model import config as C

N = 20000  # draws per case: a 4.5-sigma band on each probability is about +-0.016


def _target(logits, temperature, top_k, top_p):
    """Reference filter in float64: softmax(l / T); keep the top_k largest; then the smallest prefix (by
    decreasing probability) whose renormalised mass reaches top_p."""
    p = np.exp((logits - logits.max()) / temperature)
    order = np.argsort(-logits, kind="stable")
    keep = np.zeros(len(p), bool)
    keep[order[: top_k if top_k > 0 else len(p)]] = True
    p = np.where(keep, p, 0.0)
    p /= p.sum()
    mass = 0.0
    final = np.zeros(len(p), bool)
    for i in order:
        if not keep[i] or mass >= top_p:
            continue
        final[i] = True
        mass += p[i]
    p = np.where(final, p, 0.0)
    return p / p.sum()


_sample = jax.jit(sample)


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.5, 3, 1.0), (1.0, 0, 0.8), (1.0, 4, 0.6), (2.0, 0, 0.3),
])
def test_sampling_distribution(temperature, top_k, top_p):
    logits = np.array([2.0, 1.5, 1.2, 0.3, -0.5, -1.0, 0.9, -3.0], np.float32)
    keys = jax.random.split(jax.random.key(123), N)
    rows = jnp.broadcast_to(jnp.asarray(logits), (N, len(logits)))
    full = lambda v, dt: jnp.full((N,), v, dt)
    toks = np.asarray(_sample(rows, keys, full(temperature, jnp.float32), full(top_k, jnp.int32),
                              full(top_p, jnp.float32)))
    freq = np.bincount(toks, minlength=len(logits)) / N
    want = _target(logits.astype(np.float64), temperature, top_k, top_p)
    assert np.all(freq[want == 0] == 0), f"sampled filtered-out tokens: {freq} vs {want}"
    sigma = np.sqrt(want * (1 - want) / N)
    assert np.all(np.abs(freq - want) <= 4.5 * sigma + 1e-3), f"{freq} vs {want}"


def test_greedy_rows_and_mixed_batch():
    logits = jnp.asarray([[0.1, 3.0, 3.0, -1.0], [5.0, 0.0, 0.0, 0.0], [0.0, 0.0, 9.0, 0.0]], jnp.float32)
    keys = jax.random.split(jax.random.key(0), 3)
    toks = _sample(logits, keys, jnp.asarray([0.0, 0.0, 1.0]), jnp.zeros(3, jnp.int32), jnp.ones(3))
    # ties go to the first index (as torch.argmax); the sampled row with one dominant logit takes it
    assert np.asarray(toks).tolist() == [1, 0, 2]


def test_argmax_equals_numpy_argmax():
    """Greedy decoding's argmax (two plain reductions) against numpy's: random rows, ties (first index), NaN (the
    first NaN, as numpy and jnp.argmax), rows of -inf, a maximum at the last index."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 32000)).astype(np.float32)
    x[1, [5, 900, 31999]] = 40.0
    x[2, [17, 3]] = np.nan
    x[2, 0] = 99.0
    x[3] = -np.inf
    x[4, 31999] = 12.0
    x[5, :] = 0.0
    got = np.asarray(jax.jit(argmax)(jnp.asarray(x)))
    assert got.dtype == np.int32
    assert got.tolist() == np.argmax(x, -1).tolist() == np.asarray(jnp.argmax(x, -1)).tolist()
    assert got[1] == 5 and got[2] == 3 and got[3] == 0 and got[4] == 31999 and got[5] == 0


def test_k3_cache_bytes_match_the_spec_arithmetic():
    """K3_SPEC / FIELD_NOTES: MLA latent 24 layers x (512 + 64) x 2 B per token = 27,648 B (~27.6 KB) in bf16;
    KDA state 69 layers x 96 heads x 128 x 128 x 4 B = 434,110,464 B (~0.43 GB) per sequence in fp32, plus
    the conv tails 69 x 3 (q, k, v) x 3 rows x 12,288 x 2 B."""
    cfg = C.preset("k3")
    one = cache_lib.cache_bytes(cfg, batch=1, max_len=1, dtype=jnp.bfloat16)
    long = cache_lib.cache_bytes(cfg, batch=1, max_len=1001, dtype=jnp.bfloat16)
    assert (long["mla"] - one["mla"]) / 1000 == 24 * 576 * 2 == 27_648
    assert one["kda_state"] == 69 * 96 * 128 * 128 * 4 == 434_110_464
    assert long["kda_state"] == one["kda_state"]  # independent of context length
    assert one["kda_conv"] == 69 * 3 * 3 * 12_288 * 2
    assert one["kv"] == 0
    eight = cache_lib.cache_bytes(cfg, batch=8, max_len=4096, dtype=jnp.bfloat16)
    assert eight["total"] == 8 * (4096 * 27_648 + 434_110_464 + 69 * 3 * 3 * 12_288 * 2)
    # a dense GQA model: K and V per layer per token
    dense = C.preset("kimi-dense")
    assert cache_lib.cache_bytes(dense, 1, 10, jnp.bfloat16)["kv"] == 32 * 2 * 8 * 128 * 2 * 10


def test_request_longer_than_the_context_or_the_memory(tmp_path):
    """Refused before anything is allocated, naming what was asked and what fits: a prompt + budget past the
    model's context (max_position_embeddings), and a cache larger than the memory free on the device."""
    import kimi_jax
    from kimi_jax.checkpoint import synthetic
    from kimi_jax.generation.generate import GenerationError, free_memory

    path = synthetic.write_checkpoint(tmp_path / "llama", "llama", num_shards=1, dtype="float32")
    model = kimi_jax.from_pretrained(path, dtype="float32")
    assert model.cfg.max_position_embeddings == 512
    with pytest.raises(GenerationError, match=r"prompt 0 \(500 tokens\) \+ max_new_tokens \(20\) = 520 tokens "
                                              r"exceeds the model's context of 512"):
        kimi_jax.generate(model, [[t % 250 + 3 for t in range(500)]], 20)
    free = free_memory(jax.local_devices()[0])
    assert free is not None and free > 0  # the host's available memory on CPU
    cfg = dataclasses.replace(model.cfg, max_position_embeddings=None)
    huge = 1 << 40  # a cache of 2**40 positions: terabytes
    model.cfg = cfg
    with pytest.raises(GenerationError, match=r"the cache for 1 sequence\(s\) x 1099511627776 tokens needs [0-9.]+ GB "
                                              r"per device \(float32 rows\), but cpu:0 has [0-9.]+ GB free and a "
                                              r"request takes at most 90% of it: lower max_len"):
        kimi_jax.generate(model, [[1, 2, 3]], 4, max_len=huge)
