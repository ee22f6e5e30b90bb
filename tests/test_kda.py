"""KDA: the chunked (WY/UT) form equals the token-by-token recurrence (outputs and final state)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.kda import reference as ref


def _inputs(T, B=2, H=3, K=16, V=8, seed=0, lower_bound=True):
    ks = jax.random.split(jax.random.key(seed), 7)
    n = lambda x: x / jnp.sqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)
    q = n(jax.random.normal(ks[0], (B, T, H, K)))
    k = n(jax.random.normal(ks[1], (B, T, H, K)))
    v = jax.random.normal(ks[2], (B, T, H, V))
    z = jax.random.normal(ks[3], (B, T, H, K))
    g = -5.0 * jax.nn.sigmoid(z) if lower_bound else -2.0 * jax.nn.softplus(z)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    s0 = 0.3 * jax.random.normal(ks[5], (B, H, K, V))
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("T,chunk", [(32, 8), (37, 8), (64, 64), (100, 64), (5, 16), (1, 4)])
@pytest.mark.parametrize("lower_bound", [True, False])
def test_chunked_equals_recurrent(T, chunk, lower_bound):
    q, k, v, g, beta, s0 = _inputs(T, lower_bound=lower_bound)
    o_r, s_r = ref.kda_recurrent(q, k, v, g, beta, s0, scale=16**-0.5)
    o_c, s_c = ref.kda_chunked(q, k, v, g, beta, s0, scale=16**-0.5, chunk_size=chunk)
    assert float(jnp.abs(o_c - o_r).max()) <= 1e-5
    assert float(jnp.abs(s_c - s_r).max()) <= 1e-5


def test_zero_state_default_and_inert_padding():
    """g = 0, beta = 0 steps leave the state untouched (how right padding is kept out of the state)."""
    q, k, v, g, beta, _ = _inputs(12)
    o, s = ref.kda_recurrent(q, k, v, g, beta, scale=0.25)
    g2 = jnp.concatenate([g, jnp.zeros_like(g[:, :5])], 1)
    b2 = jnp.concatenate([beta, jnp.zeros_like(beta[:, :5])], 1)
    pad = lambda x: jnp.concatenate([x, jnp.ones_like(x[:, :5])], 1)
    o2, s2 = ref.kda_chunked(pad(q), pad(k), pad(v), g2, b2, scale=0.25, chunk_size=8)
    np.testing.assert_allclose(np.asarray(s2), np.asarray(s), atol=1e-5)
    np.testing.assert_allclose(np.asarray(o2[:, :12]), np.asarray(o), atol=1e-5)


def test_recurrence_matches_explicit_delta_rule():
    """A direct numpy transcription of S <- (I - b k k^T) diag(a) S + b k v^T, o = S^T q."""
    q, k, v, g, beta, s0 = _inputs(6, B=1, H=1, K=4, V=3)
    o, s = ref.kda_recurrent(q, k, v, g, beta, s0, scale=0.5)
    S = np.asarray(s0[0, 0], np.float64)
    for t in range(6):
        kt, qt, vt = (np.asarray(x[0, t, 0], np.float64) for x in (k, q, v))
        a, b = np.exp(np.asarray(g[0, t, 0], np.float64)), float(beta[0, t, 0])
        S = (np.eye(4) - b * np.outer(kt, kt)) @ np.diag(a) @ S + b * np.outer(kt, vt)
        np.testing.assert_allclose(np.asarray(o[0, t, 0]), S.T @ (0.5 * qt), atol=1e-5)
    np.testing.assert_allclose(np.asarray(s[0, 0]), S, atol=1e-5)
