"""Self-checks of the float64 numpy DSpark oracle (tests/dspark_oracle.py): each could fail on a wrong convention."""

import numpy as np
import pytest

from tests import dspark_oracle as O

V = 96
T = 5


def _setup(seed=0, **over):
    cfg = O.tiny_config(V, **over)
    t = O.random_checkpoint(cfg, seed)
    embed, lm_head, taps = O.random_target(cfg, seed + 100, T)
    return cfg, t, embed, lm_head, taps


def test_checkpoint_names_shapes_dtypes():
    cfg = O.TINY
    assert cfg["mask_token_id"] == cfg["vocab_size"] - 1 and cfg["model_type"] == "k3_dspark"
    t = O.random_checkpoint(cfg, 0)
    assert sorted(t) == sorted(O.tensor_names(cfg))
    assert len(t) == 12 * cfg["num_hidden_layers"] + 5
    assert all(a.dtype == np.float32 for a in t.values())
    assert t["layers.1.self_attn.q_b_proj.weight"].shape == (4 * 24, 32)
    assert t["layers.1.self_attn.kv_a_proj_with_mqa.weight"].shape == (32 + 8, 64)
    assert t["layers.1.self_attn.kv_b_proj.weight"].shape == (4 * 32, 32)
    assert t["layers.0.self_attn.o_proj.weight"].shape == (64, 4 * 16)
    assert t["context_proj.weight"].shape == (64, 128)
    assert t["markov_head.markov_w1.weight"].shape == t["markov_head.markov_w2.weight"].shape == (V, 8)
    assert abs(t["final_norm.weight"].mean() - 1) < 0.1
    # same seed -> same tensors, other seed -> different
    assert np.array_equal(O.random_checkpoint(cfg, 0)["context_proj.weight"], t["context_proj.weight"])
    assert not np.array_equal(O.random_checkpoint(cfg, 1)["context_proj.weight"], t["context_proj.weight"])


def test_draft_shapes_and_finiteness():
    cfg, t, embed, lm_head, taps = _setup()
    base, drafts = O.draft(cfg, t, embed, lm_head, taps, anchor=7, n=4)
    assert base.shape == (4, V) and base.dtype == np.float64 and np.isfinite(base).all()
    assert len(drafts) == 4 and all(isinstance(d, int) and 0 <= d < V for d in drafts)
    assert base.std() > 0.1  # not degenerate


def test_rope_is_an_interleaved_rotation():
    rng = np.random.default_rng(0)
    d, theta = 8, 50000.0
    x = rng.standard_normal((6, 3, d))
    pos = np.arange(6) * 13 + 2
    y = O.rope_interleaved(x, pos, theta)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-12)
    # position 0 is the identity
    np.testing.assert_allclose(O.rope_interleaved(x[:1], np.array([0]), theta), x[:1], rtol=0, atol=0)
    # interleaved: as complex numbers x[2i] + j x[2i+1] multiplied by exp(j pos theta^(-2i/d)) (DeepSeek's view_as_complex)
    inv = theta ** (-np.arange(0, d, 2) / d)
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * pos[:, None, None] * inv)
    np.testing.assert_allclose(y[..., 0::2], z.real, atol=1e-12)
    np.testing.assert_allclose(y[..., 1::2], z.imag, atol=1e-12)
    # hand value: d=4, pos=1 -> pair 0 turns by 1 rad, pair 1 by theta^-0.5 rad; NeoX would mix x0 with x2
    e = O.rope_interleaved(np.array([[1.0, 0.0, 0.0, 0.0]]), np.array([1]), 100.0)
    np.testing.assert_allclose(e, [[np.cos(1), np.sin(1), 0, 0]], atol=1e-15)
    e = O.rope_interleaved(np.array([[0.0, 0.0, 1.0, 0.0]]), np.array([1]), 100.0)
    np.testing.assert_allclose(e, [[0, 0, np.cos(0.1), np.sin(0.1)]], atol=1e-15)
    # relative position: q(p).k(p') depends on p - p' only
    q, k = rng.standard_normal((1, d)), rng.standard_normal((1, d))
    dots = [(O.rope_interleaved(q, np.array([p + s]), theta) @ O.rope_interleaved(k, np.array([p]), theta).T).item()
            for p, s in [(0, 3), (10, 3), (1000, 3)]]
    np.testing.assert_allclose(dots, dots[0], rtol=1e-9)
    other = (O.rope_interleaved(q, np.array([4]), theta) @ O.rope_interleaved(k, np.array([0]), theta).T).item()
    assert abs(other - dots[0]) > 1e-6


def _absorbed_forward(cfg, t, embed, lm_head, taps, block, causal):
    """An independent formulation: weight-absorbed MLA (DeepSeek's 'absorb' decode path), scores and values in the
    kv-latent space, RoPE via complex multiplication, positions written out explicitly."""
    eps, nh = cfg["rms_norm_eps"], cfg["num_attention_heads"]
    dn, dr, dv, kvr = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    theta = cfg["rope_theta"]
    W = {k: v.astype(np.float64) for k, v in t.items()}

    def rms(x, w):
        return x * (1.0 / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps)) * w

    def rope(x, pos):  # x [S, ..., dr]
        inv = 1.0 / theta ** (np.arange(dr // 2) * 2.0 / dr)
        ph = np.exp(1j * np.outer(pos, inv)).reshape((len(pos),) + (1,) * (x.ndim - 2) + (dr // 2,))
        z = (x[..., 0::2] + 1j * x[..., 1::2]) * ph
        return np.stack([z.real, z.imag], axis=-1).reshape(x.shape)

    n, Tn = len(block), taps.shape[0]
    ctx = rms(taps.astype(np.float64) @ W["context_proj.weight"].T, W["context_norm.weight"])
    h = embed.astype(np.float64)[np.array(block)]
    allpos = np.arange(Tn + n)
    for l in range(cfg["num_hidden_layers"]):
        a = f"layers.{l}.self_attn."
        x = rms(h, W[f"layers.{l}.input_layernorm.weight"])
        src = np.concatenate([ctx, x])  # K/V sources: context rows, then block rows
        kva = src @ W[a + "kv_a_proj_with_mqa.weight"].T
        lat = rms(kva[:, :kvr], W[a + "kv_a_layernorm.weight"])
        kr = rope(kva[:, kvr:], allpos)
        q = (rms(x @ W[a + "q_a_proj.weight"].T, W[a + "q_a_layernorm.weight"]) @ W[a + "q_b_proj.weight"].T)
        q = q.reshape(n, nh, dn + dr)
        qr = rope(q[..., dn:], allpos[Tn:])
        wkv = W[a + "kv_b_proj.weight"].reshape(nh, dn + dv, kvr)
        q_lat = np.einsum("nhd,hdc->nhc", q[..., :dn], wkv[:, :dn])  # absorb W_UK into q
        s = (np.einsum("nhc,sc->nhs", q_lat, lat) + np.einsum("nhr,sr->nhs", qr, kr)) / np.sqrt(dn + dr)
        if causal:
            for i in range(n):
                s[i, :, Tn + i + 1:] = -np.inf
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o_lat = np.einsum("nhs,sc->nhc", p, lat)
        o = np.einsum("nhc,hvc->nhv", o_lat, wkv[:, dn:])  # absorb W_UV after
        h = h + o.reshape(n, nh * dv) @ W[a + "o_proj.weight"].T
        m = f"layers.{l}.mlp."
        y = rms(h, W[f"layers.{l}.post_attention_layernorm.weight"])
        g = y @ W[m + "gate_proj.weight"].T
        h = h + ((g * (1 / (1 + np.exp(-g)))) * (y @ W[m + "up_proj.weight"].T)) @ W[m + "down_proj.weight"].T
    return rms(h, W["final_norm.weight"]) @ lm_head.astype(np.float64).T


@pytest.mark.parametrize("causal", [False, True])
def test_matches_an_absorbed_mla_formulation(causal):
    cfg, t, embed, lm_head, taps = _setup(seed=3, causal=causal)
    base, _ = O.draft(cfg, t, embed, lm_head, taps, anchor=11, n=4)
    ref = _absorbed_forward(cfg, t, embed, lm_head, taps, [11] + [cfg["mask_token_id"]] * 3, causal)
    np.testing.assert_allclose(base, ref, rtol=1e-9, atol=1e-9)


def test_block_attention_is_bidirectional_unless_causal():
    cfg, t, embed, lm_head, taps = _setup(seed=1)
    b3, _ = O.draft(cfg, t, embed, lm_head, taps, anchor=5, n=3)
    b6, _ = O.draft(cfg, t, embed, lm_head, taps, anchor=5, n=6)
    assert np.abs(b3 - b6[:3]).max() > 1e-4  # later mask slots feed earlier ones
    cfgc = dict(cfg, causal=True)
    c3, _ = O.draft(cfgc, t, embed, lm_head, taps, anchor=5, n=3)
    c6, _ = O.draft(cfgc, t, embed, lm_head, taps, anchor=5, n=6)
    np.testing.assert_allclose(c3, c6[:3], rtol=1e-12, atol=1e-12)
    assert np.abs(c3 - b3).max() > 1e-4


def test_context_and_anchor_matter_and_only_relative_positions():
    cfg, t, embed, lm_head, taps = _setup(seed=2)
    base, _ = O.draft(cfg, t, embed, lm_head, taps, anchor=5, n=3)
    taps2 = taps.copy()
    taps2[0] += 1.0
    assert np.abs(O.draft(cfg, t, embed, lm_head, taps2, anchor=5, n=3)[0] - base).max() > 1e-4
    assert np.abs(O.draft(cfg, t, embed, lm_head, taps, anchor=6, n=3)[0] - base).max() > 1e-4
    # shifting every position by the same offset changes nothing (RoPE is the only position signal)
    block = [5, cfg["mask_token_id"], cfg["mask_token_id"]]
    shifted = O.forward_base_logits(cfg, t, embed, lm_head, taps, block, pos0=1234)
    np.testing.assert_allclose(shifted, base, rtol=1e-8, atol=1e-8)
    # but permuting the context rows does (the context is roped at its positions)
    perm = O.forward_base_logits(cfg, t, embed, lm_head, taps[::-1].copy(), block)
    assert np.abs(perm - base).max() > 1e-4


def test_markov_chain_starts_at_anchor_and_feeds_back():
    cfg, t, embed, lm_head, taps = _setup(seed=4)
    t = dict(t)
    # rank-V Markov head: w1 = I, w2 = shift, so the correction for prev is a large one-hot at (prev + 3) % V
    t["markov_head.markov_w1.weight"] = np.eye(V, dtype=np.float32)
    t["markov_head.markov_w2.weight"] = (1e3 * np.roll(np.eye(V), 3, axis=0)).astype(np.float32)
    base, drafts = O.draft(cfg, t, embed, lm_head, taps, anchor=10, n=5)
    assert drafts == [13, 16, 19, 22, 25]
    # zero Markov head: plain argmax of the base logits; ties go to the lowest index
    t["markov_head.markov_w1.weight"] = np.zeros((V, 8), np.float32)
    t["markov_head.markov_w2.weight"] = np.zeros((V, 8), np.float32)
    base, drafts = O.draft(cfg, t, embed, lm_head, taps, anchor=10, n=5)
    assert drafts == [int(i) for i in base.argmax(-1)]
    tie = np.zeros((2, V))
    tie[:, [40, 7, 60]] = 1.0
    assert O.markov_greedy(t, tie, anchor=0) == [7, 7]
    # the random head actually changes something and is applied with the previous draft, not the anchor, after step 0
    cfg, t, embed, lm_head, taps = _setup(seed=5)
    base, drafts = O.draft(cfg, t, embed, lm_head, taps, anchor=10, n=6)
    w1, w2 = t["markov_head.markov_w1.weight"].astype(np.float64), t["markov_head.markov_w2.weight"].astype(np.float64)
    prevs = [10] + drafts[:-1]
    assert drafts == [int(np.argmax(base[i] + w2 @ w1[prevs[i]])) for i in range(6)]


def test_refuses_other_formats():
    cfg, t, embed, lm_head, taps = _setup()
    with pytest.raises(NotImplementedError):
        O.draft(dict(cfg, mla_use_output_gate=True), t, embed, lm_head, taps, 1, 2)
    with pytest.raises(NotImplementedError):
        O.draft(dict(cfg, hidden_act="gelu"), t, embed, lm_head, taps, 1, 2)
