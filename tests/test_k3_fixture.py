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
    layer_err = max(assert_close(h[0], g["layer_outputs_seq0"][i], 2e-4, f"layer {i} output")
                    for i, h in enumerate(out.hidden))
    idx = np.sort(np.stack([np.asarray(r[0][0]) for r in out.router]), axis=-1)
    np.testing.assert_array_equal(idx, g["router_topk_idx_seq0"])
    order = np.argsort(np.stack([np.asarray(r[0][0]) for r in out.router]), axis=-1)
    w = np.take_along_axis(np.stack([np.asarray(r[1][0]) for r in out.router]), order, axis=-1)
    assert_close(w, g["router_topk_weight_seq0"], 1e-5, "router weights")
    print(f"max |logits - golden| = {err:.3g}, max |layer output - golden| = {layer_err:.3g}")


@pytest.mark.parametrize("ids_key,logits_key", [("input_ids_long", "logits_long"), ("full_ids", "logits_full")])
def test_longer_sequences(model, k3_golden, ids_key, logits_key):
    out = model(jnp.asarray(k3_golden[ids_key]))
    assert_close(out.logits, k3_golden[logits_key], 2e-4, logits_key)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_attn_res_extras(model, k3_golden, scan_layers):
    """The sealed AttnRes blocks, the output AttnRes mix (before the final norm) and the final hidden state (the
    lm_head's input), through the public hidden-states option, unrolled and with scanned layers."""
    from kimi_jax.model.decoder import relayout

    g = k3_golden
    m = relayout(model, scan_layers=True) if scan_layers else model
    out = m(jnp.asarray(g["input_ids"][:1]), return_hidden=True)
    emb = np.asarray(model.embed_tokens[...][g["input_ids"][0]])
    assert_close(emb, g["embeds_seq0"], 0.0, "embeddings")
    assert len(out.hidden) == 9
    assert out.attn_res_blocks.shape == (3, 1, 24, 128)
    assert_close(out.attn_res_blocks[:, 0], g["attn_res_blocks_seq0"], 2e-4, "sealed AttnRes blocks")
    err = assert_close(out.output_mix[0], g["output_attn_res_mix_seq0"], 2e-4, "output AttnRes mix")
    err2 = assert_close(out.final_hidden[0], g["final_hidden_seq0"], 2e-4, "final hidden")
    print(f"max |output mix - golden| = {err:.3g}, max |final hidden - golden| = {err2:.3g}")
