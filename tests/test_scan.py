"""Scanned layers (kimi_jax/model/layer_plan.py): the repeating run of layers as one lax.scan over stacked parameters.

Against oracles we did not write first (HF transformers for Kimi Linear and Llama, the K3 fixture's golden outputs,
all loaded with ``scan_layers=True``), then scanned == unrolled on a 17-layer K3 whose scan runs four-layer groups
with AttnRes blocks sealed inside the loop: logits, every layer's output, the router, the AttnRes weights, cached
decode steps and ``generate``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import kimi_jax
from kimi_jax.model import config as C
from kimi_jax.model.cache import cache_shapes, init_cache
from kimi_jax.model.decoder import KimiModel, relayout
from kimi_jax.model.layer_plan import LayerPlan, layer_plan
from kimi_jax.model.run import RunConfig
from tests.parity import TOL, assert_close


def test_layer_plans_of_the_presets():
    assert layer_plan(C.preset("k3"), True) == LayerPlan(93, start=1, period=4, count=22)  # layers 1..88
    assert layer_plan(C.preset("kimi-linear-48b-a3b"), True) == LayerPlan(27, start=1, period=4, count=6)
    assert layer_plan(C.preset("kimi-dense"), True) == LayerPlan(32, start=0, period=1, count=32)
    assert layer_plan(C.preset("k3"), False).count == 0
    p = layer_plan(C.preset("k3"), True)
    assert p.unrolled() == [0, 89, 90, 91, 92] and p.slot(88) == (3, 21) and p.layer(3, 21) == 88


def test_scanned_models_match_hf(tmp_path):
    """HF transformers' logits from the scanned model: Kimi Linear with two 4-layer groups, Llama with 4 layers."""
    from tests import hf_models

    kinds = ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention",
                                                                                          "linear_attention"]
    kl = hf_models.kimi_linear(tmp_path / "kl", num_hidden_layers=9, layer_types=kinds,
                               mlp_layer_types=["dense"] + ["sparse"] * 8, seed=6)
    ll = hf_models.llama(tmp_path / "ll", num_hidden_layers=4, seed=7)
    for path, hf, vocab, plan in ((tmp_path / "kl", kl, 128, LayerPlan(9, 1, 4, 2)),
                                  (tmp_path / "ll", ll, 256, LayerPlan(4, 0, 1, 4))):
        ids = torch.randint(0, vocab, (2, 70), generator=torch.Generator().manual_seed(8))
        with torch.no_grad():
            ref = hf(ids).logits.numpy()
        model = kimi_jax.from_pretrained(path, dtype="float32", scan_layers=True)
        assert model.plan == plan and model.stack is not None
        assert_close(model(jnp.asarray(ids.numpy(), jnp.int32)).logits, ref, TOL["float32"], f"{path.name} vs HF")


def test_scanned_k3_matches_the_fixture(k3_tiny_a, k3_golden):
    """The fixture's 9 layers scan layers 4-6 (one KDA layer a group; AttnRes seals a block at layer 6, in the loop)."""
    g = k3_golden
    model = kimi_jax.from_pretrained(k3_tiny_a, dtype="float32", scan_layers=True)
    assert model.plan == LayerPlan(9, 4, 1, 3)
    out = nnx.jit(lambda m, ids: m(ids, return_hidden=True))(model, jnp.asarray(g["input_ids"]))
    assert_close(out.logits, g["logits_prefill"], TOL["float32"], "prefill logits")
    for i, h in enumerate(out.hidden):
        assert_close(h[0], g["layer_outputs_seq0"][i], TOL["float32"], f"layer {i} output")
    gen = kimi_jax.generate(model, [list(map(int, r)) for r in g["input_ids"]], g["greedy_tokens"].shape[1], stop=())
    np.testing.assert_array_equal(np.asarray(gen.tokens), g["greedy_tokens"])


def _k3_17():
    d = C.tiny_k3_config_dict()
    t = d["text_config"]
    t["num_hidden_layers"] = 17
    t["linear_attn_config"].update(kda_layers=[i for i in range(1, 17) if i % 4], full_attn_layers=[4, 8, 12, 16, 17])
    return C.from_dict(d)


@pytest.fixture(scope="module")
def k3_pair():
    cfg = _k3_17()
    unrolled = KimiModel(cfg, run=RunConfig(dtype=jnp.float32), rngs=nnx.Rngs(1))
    scanned = relayout(unrolled, scan_layers=True)
    return unrolled, scanned


def _greedy(model, ids, lengths, steps):
    """Jitted prefill (every per-layer output) and ``steps`` decode steps: (prefill output, [steps + 1, B, V] logits of
    each new token, greedy tokens [B, steps + 1])."""
    graphdef, state = nnx.split(model)
    scan = bool(model.plan.count)
    kw = dict(return_hidden=True, return_router=True, return_attn_res=True)
    prefill = jax.jit(lambda s, ids, c: nnx.merge(graphdef, s)(ids, cache=c, lengths=lengths, **kw))
    decode = jax.jit(lambda s, tok, c: nnx.merge(graphdef, s)(tok, cache=c, prefix=True))
    out = prefill(state, ids, init_cache(model.cfg, ids.shape[0], 32, jnp.float32, scan=scan))
    logits = [out.logits[jnp.arange(ids.shape[0]), lengths - 1]]
    cache, first = out.cache, out
    for _ in range(steps):
        tok = jnp.argmax(logits[-1], -1)
        out = decode(state, tok[:, None], cache)
        cache = out.cache
        logits.append(out.logits[:, -1])
    logits = jnp.stack(logits)
    return first, logits, jnp.argmax(logits, -1).T


@pytest.fixture(scope="module")
def k3_runs(k3_pair):
    ids = jax.random.randint(jax.random.key(1), (2, 9), 0, 1024)
    lengths = jnp.array([9, 6])
    return [_greedy(m, ids, lengths, 4) for m in k3_pair], ids, lengths


def test_relayout_round_trip_is_exact(k3_pair):
    unrolled, scanned = k3_pair
    # like K3: layer 0 (dense FFN) and the tail (..., MLA, MLA) unrolled, three KDA, KDA, MLA, KDA groups scanned
    assert scanned.plan == LayerPlan(17, 1, 4, 3)
    assert [i for i, x in enumerate(scanned.layers) if x is not None] == [0, 13, 14, 15, 16]
    w = scanned.stack.layers[2].self_attn.kv_b_proj[...]  # position 2 of the group is the MLA layer 3, 7, 11
    np.testing.assert_array_equal(w[1], unrolled.layers[7].self_attn.kv_b_proj[...])
    back = relayout(scanned, scan_layers=False)
    for a, b in zip(jax.tree.leaves(nnx.state(unrolled)), jax.tree.leaves(nnx.state(back))):
        np.testing.assert_array_equal(a, b)


def test_scanned_prefill_equals_unrolled(k3_runs):
    """Logits, every layer's output, the router and the AttnRes weights of a right-padded prefill."""
    ((a, _, _), (b, _, _)), _, _ = k3_runs
    assert np.abs(np.asarray(a.logits)).max() > 1.0
    assert_close(b.logits, a.logits, 1e-4, "logits")
    assert len(b.hidden) == len(a.hidden) == 17 and len(b.router) == len(a.router) == 16
    for i, (x, y) in enumerate(zip(b.hidden, a.hidden)):
        assert_close(x, y, 1e-4, f"layer {i} output")
    for (xi, xw), (yi, yw) in zip(b.router, a.router):
        np.testing.assert_array_equal(xi, yi)
        assert_close(xw, yw, 1e-5, "router weights")
    assert len(b.attn_res_weights) == len(a.attn_res_weights) == 2 * 17 - 1 + 1  # layer 0 has no attention mix
    for x, y in zip(b.attn_res_weights, a.attn_res_weights):
        assert x.shape == y.shape
        assert_close(x, y, 1e-5, "AttnRes weights")


def test_scanned_decode_equals_unrolled(k3_pair, k3_runs):
    """Decode steps that write the stacked cache in place: the unrolled model's logits and tokens."""
    unrolled, scanned = k3_pair
    ((_, la, ta), (_, lb, tb)), ids, _ = k3_runs
    assert_close(lb, la, 1e-4, "logits of the first token and 4 decode steps")
    np.testing.assert_array_equal(tb, ta)
    stacked = cache_shapes(unrolled.cfg, 2, 32, jnp.float32, scan=True)
    assert [type(e).__name__ for e in stacked.stack] == ["KDACache", "KDACache", "MLACache", "KDACache"]
    assert stacked.stack[2].c.shape == (3, 2, 32, unrolled.cfg.mla.kv_lora_rank) and stacked.max_len == 32
    with pytest.raises(ValueError, match="laid out for unrolled layers"):
        scanned(ids[:, :1], cache=init_cache(unrolled.cfg, 2, 32, jnp.float32), prefix=True)


@pytest.mark.slow
def test_scanned_generate(k3_pair, k3_runs):
    """``generate`` (bucketed prefill, while_loop decode) on the scanned model: the greedy tokens above."""
    (_, (_, _, tokens)), ids, lengths = k3_runs
    prompts = [list(map(int, ids[b, : int(lengths[b])])) for b in range(2)]
    out = kimi_jax.generate(k3_pair[1], prompts, tokens.shape[1], stop=())
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(tokens))
