"""kimi_jax/analysis (what the notebooks show) against oracles: the K3 fixture's golden routing and AttnRes
tensors (Moonshot's layer code), cache sizes from the K3 config arithmetic (K3_SPEC / FIELD_NOTES numbers), real
allocations, and figures that carry titles, labels and units."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kimi_jax
from kimi_jax.analysis import devices, hub, memory, plots, probes, tables
from kimi_jax.model import config as C
from kimi_jax.model import params
from kimi_jax.model.cache import KDACache, init_cache
from tests.parity import assert_close
from tests.test_notebooks import figure_problems


@pytest.fixture(scope="module")
def model(k3_tiny_a):
    return kimi_jax.from_pretrained(k3_tiny_a, dtype="float32")


@pytest.fixture(scope="module")
def probed(model, k3_golden):
    """Both golden prompts (24 tokens) plus a third row holding the first 10 tokens of prompt 0, right-padded."""
    ids = k3_golden["input_ids"]
    prompts = [ids[0].tolist(), ids[1].tolist(), ids[0, :10].tolist()]
    padded, lengths = probes.pad_prompts(prompts)
    assert padded.shape == (3, 32) and lengths.tolist() == [24, 24, 10]
    return probes.probe(model, padded, lengths)


def test_expert_counts_match_golden_routing(model, k3_tiny_a, k3_golden, probed):
    with open(os.path.join(k3_tiny_a, "build_report.json")) as f:
        routing = json.load(f)["routing"]  # counts over the 48 tokens of both golden prompts
    layers = model.cfg.moe_layers
    assert layers == k3_golden["router_layers"].tolist()
    counts = probes.expert_counts(probed, model.cfg.moe.num_experts)
    # Row 2 repeats prompt 0's first 10 tokens: causal, so its routing is the golden routing of those tokens.
    extra = np.stack([np.bincount(k3_golden["router_topk_idx_seq0"][j, :10].reshape(-1), minlength=8)
                      for j in range(len(layers))])
    expected = np.stack([routing[f"layer{i}"]["expert_counts"] for i in layers]) + extra
    np.testing.assert_array_equal(counts, expected)  # padded positions (8 + 8 + 22) never counted
    assert (counts.sum(axis=1) == (24 + 24 + 10) * model.cfg.moe.top_k).all()
    stats = probes.load_stats(counts)
    assert stats["max_over_mean"].shape == (len(layers),) and (stats["max_over_mean"] >= 1).all()


def test_attn_res_weights_and_labels_reconstruct_golden_mix(model, k3_golden, probed):
    g = k3_golden
    names, sizes = probes.attn_res_layout(model.cfg)
    # 9 layers, blocks sealed at 0, 3, 6: layer 0 has only its MLP mix; 8 attention + 9 MLP mixes + the output.
    assert len(names) == 18 and names[0] == "layer 0 mlp" and names[-1] == "output" and sizes[-1] == 4
    out_w = probed.attn_res[-1][:, 0, :24]  # [4 sources, 24 tokens] of prompt 0's output mix
    # The labelled sources -- embedding, block 1, block 2 (golden sealed blocks) and the partial sum (the last
    # layer's output) -- mixed with our weights must give the golden output mix.
    sources = np.concatenate([g["attn_res_blocks_seq0"], g["layer_outputs_seq0"][-1:]])
    assert_close(np.einsum("st,std->td", out_w, sources), g["output_attn_res_mix_seq0"], 2e-4, "output AttnRes mix")
    table = probes.attn_res_table(model.cfg, probed)
    assert table.sources == ["embedding", "block 1", "block 2", "partial sum"]
    assert table.weights.shape == (18, 4)
    np.testing.assert_allclose(np.nansum(table.weights, axis=1), 1.0, rtol=1e-5)  # every mix is a softmax
    assert np.isnan(table.weights[0, 1:3]).all()  # layer 0's MLP mixes the embedding and its own output only
    valid = probed.valid
    np.testing.assert_allclose(table.weights[-1], probed.attn_res[-1][:, valid].mean(axis=1), rtol=1e-6)


def test_attn_res_layout_rejects_a_mismatch(model, probed):
    cfg = model.cfg.replace(attn_res_block_size=2)
    with pytest.raises(ValueError, match="AttnRes mix"):  # source counts differ from layer 2 on
        probes.attn_res_table(cfg, probed)


def _small_k3(path, layer_kinds="KMK"):
    """A random tiny K3 checkpoint with the given layer kinds (K = KDA, M = MLA), loaded: cheap to compile."""
    from kimi_jax.checkpoint.synthetic import write_checkpoint

    c = C.tiny_k3_config_dict()
    t = c["text_config"]
    t["num_hidden_layers"] = len(layer_kinds)
    t["linear_attn_config"].update(kda_layers=[i + 1 for i, k in enumerate(layer_kinds) if k == "K"],
                                   full_attn_layers=[i + 1 for i, k in enumerate(layer_kinds) if k == "M"])
    return kimi_jax.from_pretrained(write_checkpoint(path, "k3", config=c), dtype="float32")


def test_kda_state_norms_chunked_equal_one_prefill(tmp_path):
    model = _small_k3(tmp_path, "KMK")  # a KDA layer after an MLA layer: its state depends on MLA's continued prefill
    rng = np.random.default_rng(0)
    ids = rng.integers(3, model.cfg.vocab_size, (2, 48)).astype(np.int32)
    s = probes.kda_state_norms(model, ids, chunk=16)
    assert s.layers == [0, 2] and s.positions.tolist() == [16, 32, 48]
    assert s.norms.shape == (3, 2, 2) and (s.norms > 0).all()
    # The oracle: one fresh prefill of all 48 tokens (prefix=False) leaves the same states.
    prefill = nnx.jit(lambda m, x, c: m(x, cache=c, last_only=True))  # jitted: eager KDA steps token by token
    out = prefill(model, jnp.asarray(ids), init_cache(model.cfg, 2, 48, jnp.float32))
    full = [np.sqrt((np.asarray(c.state, np.float64) ** 2).sum(axis=(1, 2, 3)))
            for c in out.cache.layers if isinstance(c, KDACache)]
    np.testing.assert_allclose(s.norms[-1], np.stack(full, -1), rtol=1e-4)
    assert not np.allclose(s.norms[0], s.norms[-1])  # the states did move between chunks
    with pytest.raises(ValueError, match="must divide"):
        probes.kda_state_norms(model, ids, chunk=20)


def test_cache_curve_matches_k3_arithmetic():
    k3 = C.preset("k3")
    contexts = [1024, 16384, 1 << 20]
    c = memory.cache_curve(k3, contexts)
    # K3_SPEC / FIELD_NOTES: 69 KDA layers x 96 heads x 128 x 128 fp32 state; 24 MLA layers x 576 bf16 per token.
    assert k3.attn_types.count("kda") == 69 and k3.attn_types.count("mla") == 24
    assert (c["kda_state"] == 69 * 96 * 128 * 128 * 4).all()
    np.testing.assert_array_equal(c["mla"], [24 * 576 * 2 * n for n in contexts])
    assert memory.crossover_context(k3) == int(np.ceil(69 * 96 * 128 * 128 * 4 / (24 * 576 * 2)))  # ~15.7K tokens
    mla = memory.cache_curve(memory.all_mla(k3), contexts)
    np.testing.assert_array_equal(mla["total"], [93 * 576 * 2 * n for n in contexts])
    dense = memory.cache_curve(C.preset("kimi-dense"), contexts)  # 32 layers x K,V x 8 heads x 128 x bf16
    np.testing.assert_array_equal(dense["total"], [32 * 2 * 8 * 128 * 2 * n for n in contexts])
    assert 0.70 < 1 - c["total"][-1] / mla["total"][-1] < 0.80  # "~75% less cache than full MLA" at 1M


def test_measured_cache_bytes_equal_computed():
    tiny = C.from_dict(C.tiny_k3_config_dict())
    for cfg in (tiny, memory.all_mla(tiny)):
        for n in (64, 1000):
            assert memory.measured_cache_bytes(cfg, n, batch=2) == memory.cache_curve(cfg, [n], batch=2)["total"][0]
    with pytest.raises(ValueError, match="no MLA"):
        memory.all_mla(C.preset("kimi-dense"))


def test_memory_report_counts_every_parameter_once_per_device(model):
    rows = devices.memory_report(model)
    assert len(rows) == len(devices.devices())
    total = sum(np.asarray(v).nbytes for v in params.leaves(nnx.state(model, nnx.Param)).values())
    assert rows[0]["params_bytes"] == devices.param_bytes(model) == total  # one device holds everything
    assert devices.mesh_sizes(model.cfg, 8) == {"data": 1, "expert": 8, "model": 1}
    assert devices.mesh_sizes(model.cfg, 12) == {"data": 1, "expert": 4, "model": 3}


def test_markdown_table_and_errors():
    text = tables.markdown_table([{"a": 1.234, "b": True, "c": None}], {"a": "A", "b": "B", "c": "C"})
    assert text.splitlines() == ["| A | B | C |", "|---|---|---|", "| 1.23 | yes | - |"]
    with pytest.raises(ValueError, match="no rows"):
        tables.markdown_table([])
    with pytest.raises(ValueError, match="empty"):
        probes.pad_prompts([[1, 2], []])


def test_figures_have_titles_labels_and_units():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = np.array([[3, 1, 0, 4], [2, 2, 2, 2]])
    table = probes.AttnResTable(np.array([[0.4, np.nan, 0.6], [0.2, 0.3, 0.5]]), ["layer 0 mlp", "output"],
                                ["embedding", "block 1", "partial sum"])
    norms = probes.StateNorms(np.array([16, 32]), np.ones((2, 1, 2)), [0, 1])
    rows = [{"deployment": "x", "params_gb": 1.0, "cache_gb": 0.5, "activations_gb": 0.1, "hbm_gb": 2.0, "fits": True}]
    figs = [plots.plot_expert_load(counts, [1, 2], tokens=4), plots.plot_attn_res(table), plots.plot_state_norms(norms),
            plots.plot_cache_curve([1024, 2048], {"a": np.array([1e9, 2e9])}, measured=[("a", 1024, 1e9)],
                                   crossover=1500),
            plots.plot_plan_memory(rows),
            plots.plot_roofline({"x": {"batch": np.array([1, 2]), "tokens_per_s": np.array([10.0, 19.0]),
                                       "fits": np.array([True, False])}}, context=4096)]
    for fig in figs:
        assert figure_problems(fig) == [], figure_problems(fig)
        plt.close(fig)


def test_layer_subset_converts_like_the_full_checkpoint(tmp_path):
    """The shards a partial download keeps (first 2 layers + embedding/head) convert with --layers 2 to the same
    parameters as the complete checkpoint does."""
    import shutil

    from convert.converter import convert_checkpoint
    from kimi_jax.checkpoint.synthetic import write_checkpoint
    from kimi_jax.cli.demo import demo_config

    full, part = tmp_path / "full", tmp_path / "part"
    write_checkpoint(full, "k3", config=demo_config(), num_shards=4)  # layers 0-2 | 3-4 | 5-6 | 7-8 + the rest
    with open(full / hub.INDEX) as f:
        index = json.load(f)
    files, weight_map = hub.layer_subset(index["weight_map"], 2)
    assert files == ["model-00001-of-000004.safetensors", "model-00004-of-000004.safetensors"]
    assert set(weight_map.values()) == set(files) and len(weight_map) < len(index["weight_map"])
    part.mkdir()
    for name in files + ["config.json"]:
        shutil.copy(full / name, part / name)
    with open(part / hub.INDEX, "w") as f:
        json.dump({"metadata": index["metadata"], "weight_map": weight_map}, f)
    for src in (full, part):
        convert_checkpoint(src, tmp_path / f"{src.name}-orbax", dtype="float32", layers=2, experts=4, progress=False)
    a, b = (kimi_jax.from_pretrained(tmp_path / f"{n}-orbax", dtype="float32") for n in ("full", "part"))
    pa, pb = (dict(devices._var_arrays(m)) for m in (a, b))
    assert sorted(pa) == sorted(pb) and len(pa) > 20
    for k in pa:
        np.testing.assert_array_equal(np.asarray(pa[k]), np.asarray(pb[k]), err_msg=k)
    with pytest.raises(ValueError, match=">= 1"):
        hub.layer_subset(index["weight_map"], 0)


def test_shard_table_on_one_device(model):
    rows = devices.shard_table(model, ["embed_tokens", "layers.1.mlp.experts.w1.packed"])
    assert rows[0]["shape"] == (512, 128) and rows[0]["shard_shape"] == (512, 128) and rows[0]["distinct_shards"] == 1
    assert rows[1]["dtype"] == "uint8"
    default = [r["parameter"] for r in devices.shard_table(model)]
    assert default[:2] == ["embed_tokens", "layers.0.self_attn.q_proj"]
    assert sorted(default[2:]) == sorted(f"layers.1.mlp.experts.{w}.{k}" for w in ("w1", "w2", "w3")
                                         for k in ("packed", "scale"))
    with pytest.raises(KeyError, match="no parameter"):
        devices.shard_table(model, ["layers.99.nothing"])
