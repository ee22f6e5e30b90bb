"""Self-checks of the float64 K3.1 DSA layer oracle (tests/k31_oracle.py). Pure numpy, well under 2 s."""

from __future__ import annotations

import numpy as np
import pytest

from tests import k31_oracle as K

CFG = K.tiny_config()
W = K.random_layer(CFG, seed=0)


def _x(T: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((T, CFG["hidden_size"]))


def _scores(x: np.ndarray, tensors=W) -> np.ndarray:
    return K.index_scores(CFG, tensors, x, K.q_lora(CFG, tensors, x))


# (a) T <= k: every query sees all its causal keys -> exactly K3 dense MLA.
@pytest.mark.parametrize("T", [1, 3, 4])
def test_short_sequence_is_dense(T):
    x = _x(T)
    dense = K.mla_layer(CFG, W, x, index_topk=None)
    sparse = K.mla_layer(CFG, W, x, index_topk=CFG["index_topk"])
    assert T <= CFG["index_topk"]
    np.testing.assert_array_equal(sparse, dense)


# (b) k >= T for every query of a longer sequence: the same.
@pytest.mark.parametrize("k", [12, 13, 100])
def test_large_k_is_dense(k):
    x = _x(12, seed=2)
    np.testing.assert_array_equal(K.mla_layer(CFG, W, x, index_topk=k), K.mla_layer(CFG, W, x, index_topk=None))


def test_sparse_differs_from_dense_when_t_exceeds_k():
    x = _x(12, seed=3)
    d = K.mla_layer(CFG, W, x, index_topk=None)
    s = K.mla_layer(CFG, W, x, index_topk=4)
    k = CFG["index_topk"]
    np.testing.assert_array_equal(s[:k], d[:k])  # rows with <= k causal keys
    assert np.all(np.abs(s[k:] - d[k:]).max(axis=1) > 1e-6)


# (c) the mask: causal, min(k, t+1) keys per row, contains the highest-ranked keys.
@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_topk_mask_properties(k):
    T = 12
    sc = _scores(_x(T, seed=4))
    m = K.topk_mask(sc, k)
    assert m.dtype == bool and m.shape == (T, T)
    assert not np.any(np.triu(m, 1))
    np.testing.assert_array_equal(m.sum(axis=1), np.minimum(k, np.arange(T) + 1))
    for t in range(T):
        causal = np.arange(T) <= t
        sel, rest = sc[t, m[t]], sc[t, causal & ~m[t]]
        if rest.size:
            assert sel.min() >= rest.max()
        assert sel.max() == sc[t, : t + 1].max()


def test_topk_mask_ties_go_to_later_key():
    # row 4: keys 0..4 with scores [5, 1, 1, 1, 0] and k=2 -> key 0 and, of the tied 1s, the latest (3).
    sc = np.full((5, 5), -np.inf)
    for t in range(5):
        sc[t, : t + 1] = [5.0, 1.0, 1.0, 1.0, 0.0][: t + 1]
    m = K.topk_mask(sc, 2)
    assert np.flatnonzero(m[4]).tolist() == [0, 3]
    assert np.flatnonzero(m[3]).tolist() == [0, 3]
    assert np.flatnonzero(m[2]).tolist() == [0, 2]
    # a -inf inside the causal window counts as not selectable
    sc2 = sc.copy()
    sc2[4, 0] = -np.inf
    assert np.flatnonzero(K.topk_mask(sc2, 2)[4]).tolist() == [2, 3]


def test_index_scores_by_hand():
    x = _x(6, seed=5)
    qr = K.q_lora(CFG, W, x)
    sc = K.index_scores(CFG, W, x, qr)
    HI, DI = CFG["index_n_heads"], CFG["index_head_dim"]
    t, s = 5, 2
    kk = x[s] @ W["self_attn.indexer.wk.weight"].T
    kk = (kk - kk.mean()) / np.sqrt(kk.var() + CFG["rms_norm_eps"])
    kk = kk * W["self_attn.indexer.k_norm.weight"] + W["self_attn.indexer.k_norm.bias"]
    qq = (qr[t] @ W["self_attn.indexer.wq_b.weight"].T).reshape(HI, DI)
    w = x[t] @ W["self_attn.indexer.weights_proj.weight"].T / np.sqrt(HI * DI)
    np.testing.assert_allclose(sc[t, s], np.sum(w * np.maximum(qq @ kk, 0)), rtol=1e-12)
    assert np.all(np.isneginf(sc[np.triu_indices(6, 1)]))
    assert np.all(np.isfinite(sc[np.tril_indices(6)]))


# (d) changing an excluded key leaves that query's output alone; changing an included one changes it.
def test_excluded_key_has_no_effect_included_key_does():
    T, k, t = 12, CFG["index_topk"], 11
    x = _x(T, seed=6)
    sc = _scores(x)
    m = K.topk_mask(sc, k)
    y = K.mla_layer(CFG, W, x, index_topk=k)
    excluded = [s for s in np.flatnonzero(~m[t, : t + 1]) if s != t]
    included = [s for s in np.flatnonzero(m[t]) if s != t]
    assert excluded and included

    s_out = min(excluded, key=lambda s: sc[t, s])  # the lowest-ranked key: a small nudge keeps it out
    x2 = x.copy()
    x2[s_out] += 1e-3 * np.random.default_rng(7).standard_normal(x.shape[1])
    assert np.array_equal(K.topk_mask(_scores(x2), k)[t], m[t])
    y2 = K.mla_layer(CFG, W, x2, index_topk=k)
    np.testing.assert_allclose(y2[t], y[t], rtol=0, atol=1e-14)
    assert np.abs(y2[s_out] - y[s_out]).max() > 1e-6  # the change itself is visible elsewhere

    s_in = included[0]
    x3 = x.copy()
    x3[s_in] += 1e-3 * np.random.default_rng(8).standard_normal(x.shape[1])
    y3 = K.mla_layer(CFG, W, x3, index_topk=k)
    assert np.abs(y3[t] - y[t]).max() > 1e-8


# The mask form agrees with the absorbed gather form (K31 3.3 / K3_SPEC 4.3 absorbed decode).
def test_mask_form_matches_absorbed_gather_form():
    T, k = 10, 3
    x = _x(T, seed=9)
    y = K.mla_layer(CFG, W, x, index_topk=k)
    m = K.topk_mask(_scores(x), k)
    H, nope, pe, v, kvl = (
        CFG[n] for n in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank")
    )
    q = (K.q_lora(CFG, W, x) @ W["self_attn.q_b_proj.weight"].T).reshape(T, H, nope + pe)
    ckv = x @ W["self_attn.kv_a_proj_with_mqa.weight"].T
    c = (
        ckv[:, :kvl]
        / np.sqrt(np.mean(ckv[:, :kvl] ** 2, -1, keepdims=True) + 1e-6)
        * W["self_attn.kv_a_layernorm.weight"]
    )
    kpe = ckv[:, kvl:]
    wkv = W["self_attn.kv_b_proj.weight"].reshape(H, nope + v, kvl)
    w_uk, w_uv = wkv[:, :nope], wkv[:, nope:]
    o = np.zeros((T, H, v))
    for t in range(T):
        sel = np.flatnonzero(m[t])
        for h in range(H):
            ql = w_uk[h].T @ q[t, h, :nope]
            sc = (c[sel] @ ql + kpe[sel] @ q[t, h, nope:]) * (nope + pe) ** -0.5
            p = np.exp(sc - sc.max())
            p /= p.sum()
            o[t, h] = w_uv[h] @ (p @ c[sel])
    g = x @ W["self_attn.g_proj.weight"].T
    ref = (o.reshape(T, H * v) / (1 + np.exp(-g))) @ W["self_attn.o_proj.weight"].T
    np.testing.assert_allclose(y, ref, rtol=1e-10, atol=1e-12)


# (e) shapes and tensor inventory.
def test_shapes():
    T = 7
    x = _x(T)
    assert set(W) == set(K.layer_shapes(CFG))
    for name, shape in K.layer_shapes(CFG).items():
        assert W[name].shape == shape and W[name].dtype == np.float64, name
    assert W["self_attn.indexer.wq_b.weight"].shape == (2 * 16, 48)  # reads the q-LoRA latent
    assert K.q_lora(CFG, W, x).shape == (T, CFG["q_lora_rank"])
    assert _scores(x).shape == (T, T)
    for k in (None, 1, 4):
        y = K.mla_layer(CFG, W, x, index_topk=k)
        assert y.shape == (T, CFG["hidden_size"]) and y.dtype == np.float64 and np.all(np.isfinite(y))
    no_bias = {n: a for n, a in W.items() if n != "self_attn.indexer.k_norm.bias"}
    assert K.mla_layer(CFG, no_bias, x, index_topk=2).shape == (T, CFG["hidden_size"])
    bad = dict(W)
    bad["self_attn.indexer.wk.weight"] = np.zeros((3, 64))
    with pytest.raises(ValueError):
        K.mla_layer(CFG, bad, x, index_topk=2)
    nested = {k: v for k, v in CFG.items() if not k.startswith("index_")}
    nested["dsa_config"] = {k: CFG[k] for k in ("index_n_heads", "index_head_dim", "index_topk")}
    np.testing.assert_array_equal(K.mla_layer(nested, W, x, index_topk=2), K.mla_layer(CFG, W, x, index_topk=2))
