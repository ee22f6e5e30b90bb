"""Kimi K3.1: the DSA indexer in every MLA layer -- config, checkpoint layout, the math against the float64 oracle
(``tests/k31_oracle.py``), and K3.1 reducing to K3 while every context fits in top-k."""

from __future__ import annotations

import copy
import dataclasses
import functools
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from kernels_pallas import dsa, sparse_mla
from kernels_pallas.dsa import reference as dsa_reference
from kernels_pallas.sparse_mla import reference as sparse_mla_reference
from kimi_jax.checkpoint import synthetic
from kimi_jax.checkpoint.loading import from_pretrained
from kimi_jax.checkpoint.names import WeightError
from kimi_jax.cli import main
from kimi_jax.model import config as C
from kimi_jax.model import params
from kimi_jax.model.attention import MLA, Step
from kimi_jax.model.cache import cache_shapes, init_cache, paged_cache
from kimi_jax.model.decoder import KimiModel, abstract_model
from kimi_jax.model.run import RunConfig
from kimi_jax.parallel import sharding
from kimi_jax.serving.engine import Engine
from tests import k31_oracle as oracle


def _tiny(**dsa) -> dict:
    c = C.tiny_k31_config_dict()
    c["text_config"]["dsa_config"].update(dsa)
    return c


# -- config ------------------------------------------------------------------------------------------------------


def test_presets_k31_and_k3():
    ix = C.preset("k3.1").mla.indexer
    assert (ix.num_heads, ix.head_dim, ix.topk, ix.q_lora_rank, ix.hidden) == (32, 128, 2048, 1536, 7168)
    assert ix.norm_eps == 1e-5  # rms_norm_eps: dsa_config declares none
    assert C.preset("k3").mla.indexer is None
    tiny = C.from_dict(C.tiny_k31_config_dict())
    assert tiny.family == "kimi_k3" and tiny.mla.indexer.topk == 16


@pytest.mark.parametrize("spelling", ["flat", "aliases", "top_level"])
def test_dsa_config_spellings(spelling):
    c = C.tiny_k31_config_dict()
    t = c["text_config"]
    dsa = t.pop("dsa_config")
    if spelling == "flat":  # DeepSeek-V3.2's keys in text_config, no layer list
        t.update(index_n_heads=2, index_head_dim=16, index_topk=8, index_norm_eps=1e-6)
    elif spelling == "aliases":  # llama.cpp's GGUF names
        t["dsa_config"] = {"head_count": 2, "key_length": 16, "top_k": 8, "layers": dsa["dsa_layers"],
                           "index_norm_eps": 1e-6}
    else:
        c["dsa_config"] = {**dsa, "index_topk": 8, "index_norm_eps": 1e-6}
    ix = C.from_dict(c).mla.indexer
    assert (ix.num_heads, ix.head_dim, ix.topk, ix.norm_eps) == (2, 16, 8, 1e-6)


def test_dsa_layers_must_be_the_mla_layers():
    with pytest.raises(C.ConfigError, match=r"dsa_config.dsa_layers=\[4, 8\] must equal the full-attention \(MLA\) "
                                            r"layers \[4, 8, 9\].*not indexed \[9\]"):
        C.from_dict(_tiny(dsa_layers=[4, 8]))
    with pytest.raises(C.ConfigError, match=r"not MLA \[3\]"):
        C.from_dict(_tiny(dsa_layers=[3, 4, 8, 9]))


def test_k31_refusals():
    c = C.tiny_k31_config_dict()
    del c["text_config"]["dsa_config"]
    with pytest.raises(C.ConfigError, match="K3.1 architecture needs a DSA indexer"):
        C.from_dict(c)
    with pytest.raises(C.ConfigError, match=r"unknown config key\(s\) \['types'\]"):
        C.from_dict(_tiny(types=["full", "shared", "full"]))
    with pytest.raises(C.ConfigError, match="index_topk=0 must be a positive integer"):
        C.from_dict(_tiny(index_topk=0))
    c = C.tiny_k31_config_dict()
    c["text_config"]["q_lora_rank"] = None
    with pytest.raises(C.ConfigError, match="q_lora_rank is null"):
        C.from_dict(c)
    c = copy.deepcopy(C.tiny_k31_config_dict())
    del c["text_config"]["dsa_config"]["index_head_dim"]
    with pytest.raises(C.ConfigError, match=r"missing \['index_head_dim'\]"):
        C.from_dict(c)




# -- checkpoint ----------------------------------------------------------------------------------------------------

INDEXER = ("wq_b.weight", "wk.weight", "weights_proj.weight", "k_norm.weight", "k_norm.bias")


@pytest.fixture(scope="module")
def k31_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("k31"))
    assert main(["make-tiny", path, "--family", "k3.1", "--dtype", "float32", "--shards", "2"]) == 0
    return path


@pytest.fixture(scope="module")
def k31_model(k31_dir):
    return from_pretrained(k31_dir, dtype="float32", progress=False)


def _tensors(path) -> dict:
    out = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        out.update(load_file(f))
    return out


def test_make_tiny_k31_writes_the_released_layout_and_loads(k31_dir, k31_model):
    tensors = _tensors(k31_dir)
    cfg = k31_model.cfg
    ix = cfg.mla.indexer
    mla_layers = [i for i, kind in enumerate(cfg.attn_types) if kind == "mla"]
    names = {n for n in tensors if ".indexer." in n}
    assert names == {f"language_model.model.layers.{i}.self_attn.indexer.{t}" for i in mla_layers for t in INDEXER}
    i = mla_layers[0]
    pre = f"language_model.model.layers.{i}.self_attn.indexer."
    assert tensors[pre + "wq_b.weight"].shape == (ix.num_heads * ix.head_dim, ix.q_lora_rank)
    assert tensors[pre + "wk.weight"].shape == (ix.head_dim, ix.hidden)
    assert tensors[pre + "weights_proj.weight"].shape == (ix.num_heads, ix.hidden)
    got = k31_model.layers[i].self_attn.indexer
    for leaf, name in (("wq_b", "wq_b.weight"), ("wk", "wk.weight"), ("weights_proj", "weights_proj.weight"),
                       ("k_norm", "k_norm.weight"), ("k_norm_bias", "k_norm.bias")):
        np.testing.assert_array_equal(np.asarray(getattr(got, leaf)[...]), tensors[pre + name])


def test_info_shows_the_indexer(k31_dir, capsys):
    capsys.readouterr()
    assert main(["info", k31_dir]) == 0
    out = capsys.readouterr().out
    assert "DSA indexer (K3.1) in each of the 3 MLA layers: 2 heads x 16, top-16 keys per query" in out, out


def test_k_norm_bias_is_optional(k31_dir, tmp_path):
    """A checkpoint without ``k_norm.bias`` loads with a zero bias (the format leaves the bias open)."""
    shutil.copytree(k31_dir, tmp_path, dirs_exist_ok=True)
    index_file = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    for f in glob.glob(str(tmp_path / "*.safetensors")):
        kept = {n: v for n, v in load_file(f).items() if not n.endswith("k_norm.bias")}
        os.remove(f)
        save_file(kept, f)
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if not n.endswith("k_norm.bias")}
    index_file.write_text(json.dumps(index))
    m = from_pretrained(str(tmp_path), dtype="float32", progress=False)
    assert not np.any(np.asarray(m.layers[3].self_attn.indexer.k_norm_bias[...]))


def test_indexer_shape_mismatch_names_the_tensor(tmp_path):
    """Tensors written for 8-dim indexer heads under a config that says 16: refused before anything is read."""
    synthetic.write_checkpoint(tmp_path, "k3.1", config=_tiny(index_head_dim=8), dtype="float32", num_shards=1)
    (tmp_path / "config.json").write_text(json.dumps(_tiny(index_head_dim=16)))
    with pytest.raises(WeightError, match=r"tensor 'language_model\.model\.layers\.\d\.self_attn\.indexer\."
                                          r"(wq_b|wk|k_norm)\.(weight|bias)'.*does not fit parameter"):
        from_pretrained(str(tmp_path), dtype="float32", progress=False)


# -- the math --------------------------------------------------------------------------------------------------------

F32 = jnp.float32
RUN = RunConfig(dtype=F32)
LAYERS = 4  # the tiny K3.1 sliced to KDA x3 + one MLA layer with its indexer: the model tests compile in seconds


def _with_weights(cfg, src):
    """A model of ``cfg`` holding ``src``'s weights (every leaf ``cfg`` has; K3: all but the indexers)."""
    m = KimiModel(cfg, run=RUN, rngs=nnx.Rngs(1))
    have = params.leaves(nnx.state(src, nnx.Param))
    state = nnx.state(m, nnx.Param)
    params.fill(state, {k: have[k] for k in params.leaves(state)})
    nnx.update(m, state)
    return m


def _one_mla_layer(src, indexer=True):
    """A one-layer model (MLA + dense MLP) whose layer is ``src``'s first MLA layer (attention) and layer 0 (the
    rest): the cheapest whole model to compile that runs the indexer."""
    cfg = src.cfg
    mla = cfg.attn_types.index("mla")
    one = cfg.replace(num_layers=1, attn_types=("mla",), ffn_types=(cfg.ffn_types[0],),
                      mla=cfg.mla if indexer else dataclasses.replace(cfg.mla, indexer=None))
    m = KimiModel(one, run=RUN, rngs=nnx.Rngs(1))
    have = params.leaves(nnx.state(src, nnx.Param))
    state = nnx.state(m, nnx.Param)
    at = lambda k: k.replace("layers.0.self_attn.", f"layers.{mla}.self_attn.")
    params.fill(state, {k: have[at(k)] for k in params.leaves(state)})
    nnx.update(m, state)
    return m


def _mla_layer(src, topk):
    """``src``'s first MLA layer's token mixer, its indexer choosing ``topk`` keys."""
    cfg = _with_topk(src.cfg, topk)
    layer = MLA(cfg.mla, param_dtype=F32, rngs=nnx.Rngs(1))
    nnx.update(layer, nnx.state(src.layers[cfg.attn_types.index("mla")].self_attn, nnx.Param))
    return layer


def _with_topk(cfg, topk):
    return cfg.replace(mla=dataclasses.replace(cfg.mla, indexer=dataclasses.replace(cfg.mla.indexer, topk=topk)))


def _jitted(model):
    """``call(ids, cache=None, prefix=False) -> (logits, cache)``: ``model`` as one jitted function."""
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, static_argnames="prefix")
    def call(state, ids, cache, prefix):
        out = nnx.merge(graphdef, state)(ids, cache=cache, prefix=prefix)
        return out.logits, out.cache

    return lambda ids, cache=None, prefix=False: call(state, ids, cache, prefix)


def _prefill_then_decode(model, ids, n_prefill, max_len, chunk=0):
    """Logits ``[B, T, V]``: a cached prefill of the first ``n_prefill`` tokens, a continued prefill of the next
    ``chunk`` (if any), then one decode step per token."""
    call = _jitted(model)
    lg, cache = call(ids[:, :n_prefill], init_cache(model.cfg, ids.shape[0], max_len, F32))
    logits = [lg]
    if chunk:
        lg, cache = call(ids[:, n_prefill:n_prefill + chunk], cache, prefix=True)
        logits.append(lg)
    for t in range(n_prefill + chunk, ids.shape[1]):
        lg, cache = call(ids[:, t:t + 1], cache, prefix=True)
        logits.append(lg)
    return jnp.concatenate(logits, axis=1)


def test_k31_equals_k3_while_contexts_fit_in_topk(k31_model):
    """must-show 1: with every context <= top-k (16) each query selects all its keys, so K3.1 is K3 with the same
    weights (indexers ignored) to float32 rounding -- a prefill of 8 tokens (its 8 keys <= 16: the dense path), a
    continued prefill of 4 and decode steps up to 16 tokens over a 20-slot cache (the selection path). Past 16
    keys the selection bites: every later decode step differs."""
    k31, k3 = _one_mla_layer(k31_model), _one_mla_layer(k31_model, indexer=False)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, k31.cfg.vocab_size, (2, 20)), jnp.int32)
    a = _prefill_then_decode(k31, ids, 8, 20, chunk=4)
    b = _prefill_then_decode(k3, ids, 8, 20, chunk=4)
    err = float(jnp.max(jnp.abs(a[:, :16] - b[:, :16])))
    assert err < 1e-4, err
    assert float(jnp.min(jnp.max(jnp.abs(a[:, 16:] - b[:, 16:]), axis=(0, 2)))) > 1e-3  # every row past 16 differs


def _oracle_inputs(layer):
    """(oracle config dict, oracle tensors float64) of one K3.1 MLA module."""
    c, ix = layer.cfg, layer.cfg.indexer
    cfg = {"hidden_size": c.hidden, "num_attention_heads": c.num_heads, "q_lora_rank": c.q_lora_rank,
           "kv_lora_rank": c.kv_lora_rank, "qk_nope_head_dim": c.qk_nope_dim, "qk_rope_head_dim": c.qk_rope_dim,
           "v_head_dim": c.v_dim, "mla_use_output_gate": c.output_gate, "rms_norm_eps": ix.norm_eps,
           "mla_norm_eps": c.lora_norm_eps, "dsa_config": {"index_n_heads": ix.num_heads,
                                                           "index_head_dim": ix.head_dim, "index_topk": ix.topk}}
    f64 = lambda a: np.asarray(a[...], np.float64)
    t = {oracle.P + f"{n}.weight": f64(getattr(layer, n)) for n in
         ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "g_proj",
          "o_proj")}
    idx = layer.indexer
    t.update({oracle.IDX + "wq_b.weight": f64(idx.wq_b), oracle.IDX + "wk.weight": f64(idx.wk),
              oracle.IDX + "weights_proj.weight": f64(idx.weights_proj), oracle.IDX + "k_norm.weight": f64(idx.k_norm),
              oracle.IDX + "k_norm.bias": f64(idx.k_norm_bias)})
    return cfg, t


def _same_up_to_ties(ours, scores, k, tol=1e-6):
    """Our selection ``[T, S]`` against the oracle's scores: each row keeps min(k, visible) keys, and wherever it
    differs from the oracle's choice the keys swapped in and out score the row's k-th best (an exact tie) within
    ``tol``. Returns the number of rows that differ."""
    want = oracle.topk_mask(scores, k)
    differ = 0
    for t in range(scores.shape[0]):
        assert ours[t].sum() == want[t].sum() == min(k, t + 1), t
        if (ours[t] != want[t]).any():
            differ += 1
            kth = np.sort(scores[t, want[t]])[0]
            swapped = scores[t, ours[t] != want[t]]
            np.testing.assert_allclose(swapped, kth, rtol=tol, atol=tol, err_msg=f"row {t}: not a tie")
    return differ


def test_one_mla_layer_matches_the_float64_oracle(k31_model):
    """must-show 2: top-4 over 64 tokens. One MLA layer of the model (its weights) against tests/k31_oracle.py in
    float32: the selection (ties allowed), the prefill output, and every decode step's output over a cache."""
    cfg = _with_topk(k31_model.cfg, 4)
    layer = _mla_layer(k31_model, 4)
    ocfg, tensors = _oracle_inputs(layer)
    T = 64
    x = np.random.default_rng(1).standard_normal((T, cfg.hidden_size)).astype(np.float32)
    want = oracle.mla_layer(ocfg, tensors, x, index_topk=4)
    scores = oracle.index_scores(ocfg, tensors, x, oracle.q_lora(ocfg, tensors, x))

    pos = jnp.arange(T, dtype=jnp.int32)[None]
    step = Step(pos, jnp.ones((1, T), bool), jnp.full((1,), T, jnp.int32), False)
    *_, index = layer._projections(jnp.asarray(x)[None], RUN)
    idx = dsa.select(index.q, index.w, index.k, pos, topk=4)
    assert idx.shape == (1, T, 4) and np.all(np.asarray(idx)[0, :3, 3] == -1)  # rows 0-2 see fewer than 4 keys
    chosen = np.asarray(dsa_reference.chosen_mask(idx, T))[0]
    assert _same_up_to_ties(chosen, scores, 4) == 0  # no exact ties at the boundary in this draw
    y, _ = layer(jnp.asarray(x)[None], step, None, RUN)
    assert np.max(np.abs(np.asarray(y[0]) - want)) < 1e-5

    n0 = 8  # a cached prefill of 8 tokens, then 56 decode steps
    cache = init_cache(cfg, 1, T, F32).layers[3]
    y0, cache = layer(jnp.asarray(x[None, :n0]), Step(pos[:, :n0], jnp.ones((1, n0), bool),
                                                      jnp.full((1,), n0, jnp.int32), False), cache, RUN)
    graphdef, state = nnx.split(layer)
    one = jnp.ones((1, 1), bool), jnp.ones((1,), jnp.int32)
    decode = jax.jit(lambda s, xt, c, p: nnx.merge(graphdef, s)(xt, Step(p, *one, True), c, RUN))
    ys = [y0[0]]
    for t in range(n0, T):
        yt, cache = decode(state, jnp.asarray(x[None, t:t + 1]), cache, pos[:, t:t + 1])
        ys.append(yt[0])
    err = np.max(np.abs(np.concatenate([np.asarray(v) for v in ys]) - want))
    assert err < 1e-5, err


@pytest.mark.slow
def test_k31_prefill_equals_decode(k31_model):
    """The whole model with top-4: logits of one prefill equal a cached prefill plus decode steps."""
    m = _with_weights(_with_topk(k31_model.cfg.sliced(LAYERS), 4), k31_model)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, m.cfg.vocab_size, (2, 24)), jnp.int32)
    full = _jitted(m)(ids)[0]
    steps = _prefill_then_decode(m, ids, 8, 32)
    assert float(jnp.max(jnp.abs(full - steps))) < 1e-4


def test_selection_ties_go_to_the_later_key():
    """Equal indexer scores: the later key wins; a row with at most k visible keys keeps them all."""
    scores = jnp.asarray([[[1.0, 2.0, 2.0, 0.0, 2.0, -jnp.inf]]])

    def mask(q_pos, topk, s=scores):
        return np.asarray(dsa_reference.chosen_mask(dsa_reference.top_keys(s, jnp.asarray([[q_pos]]), topk=topk),
                                                    s.shape[-1]))[0, 0]

    np.testing.assert_array_equal(mask(4, 2), [False, False, True, False, True, False])
    np.testing.assert_array_equal(mask(1, 2), [True, True, False, False, False, False])
    np.testing.assert_array_equal(dsa_reference.top_keys(scores, jnp.asarray([[0]]), topk=2), [[[0, -1]]])
    zeros = jnp.zeros((1, 1, 6))  # all ReLUs zero: every score ties
    np.testing.assert_array_equal(mask(5, 3, zeros), oracle.topk_mask(np.zeros((6, 6)), 3)[5])


def test_gather_and_mask_forms_agree():
    """The sparse MLA gathers the chosen rows; the mask form (dense scores, the rest at -inf) gives the same."""
    rng = np.random.default_rng(6)
    B, T, S, H, R, O = 2, 3, 12, 4, 16, 8
    q_lat, q_pe, c, kpe = (jnp.asarray(rng.standard_normal(s), F32) for s in
                           ((B, T, H, R), (B, T, H, O), (B, S, R), (B, S, O)))
    q_pos = jnp.asarray([[9, 10, 11], [0, 1, 2]], jnp.int32)
    idx = dsa_reference.top_keys(jnp.asarray(rng.standard_normal((B, T, S)), F32), q_pos, topk=5)
    got = sparse_mla.sparse_mla_attention(q_lat, q_pe, c, kpe, idx, scale=0.2)
    want = sparse_mla_reference.masked_attention(q_lat, q_pe, c, kpe, idx, scale=0.2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def _layer_run(layer, x, cache, n_prefill, pages=None):
    """One MLA layer over ``x [B, T, D]``: a prefill of ``n_prefill`` tokens into ``cache``, then decode steps
    (jitted); the outputs ``[B, T, D]``."""
    B, T, _ = x.shape
    graphdef, state = nnx.split(layer)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))

    @functools.partial(jax.jit, static_argnames="prefix")
    def call(state, x, cache, p, prefix):
        n = x.shape[1]
        step = Step(p, jnp.ones((B, n), bool), jnp.full((B,), n, jnp.int32), prefix, pages)
        return nnx.merge(graphdef, state)(x, step, cache, RUN)

    y, cache = call(state, x[:, :n_prefill], cache, pos[:, :n_prefill], False)
    ys = [y]
    for t in range(n_prefill, T):
        y, cache = call(state, x[:, t:t + 1], cache, pos[:, t:t + 1], True)
        ys.append(y)
    return jnp.concatenate(ys, axis=1)


def test_paged_cache_equals_static(k31_model):
    """The serving engine's paged cache: indexer keys in page pools on the latent's page table. One MLA layer
    (top-4), two sequences on shuffled pages: a prefill and decode steps equal the static cache's."""
    cfg = _with_topk(k31_model.cfg, 4)
    layer = _mla_layer(k31_model, 4)
    B, T, ps = 2, 24, 4
    x = jnp.asarray(np.random.default_rng(3).standard_normal((B, T, cfg.hidden_size)), F32)
    static = _layer_run(layer, x, init_cache(cfg, B, T, F32).layers[3], 8)
    pool = paged_cache(cfg, B, 2 * T // ps + 2, ps, F32).layers[3]
    assert pool.ik.shape == (2 * T // ps + 2, ps, cfg.mla.indexer.head_dim)
    table = jnp.asarray(np.random.default_rng(4).permutation(2 * T // ps + 2)[:B * T // ps].reshape(B, T // ps))
    paged = _layer_run(layer, x, pool, 8, pages=table)
    err = float(jnp.max(jnp.abs(paged - static)))
    assert err < 1e-6, err


@pytest.mark.slow
def test_serving_engine_runs_k31(k31_model):
    """The serving engine (paged cache, chunked prefill, several requests in flight, then a prefix hit) on K3.1 with
    top-4: greedy tokens and every step's logits equal the static cache's prefill + decode of each request alone."""
    m = _with_weights(_with_topk(k31_model.cfg.sliced(LAYERS), 4), k31_model)
    eng = Engine(m, slots=4, max_len=64, page_size=8, prefill_chunk=16, min_chunk=16, record_logits=True,
                 compact_decode=False)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, m.cfg.vocab_size, n).tolist() for n in (11, 37, 5)]
    new = 6
    out = eng.generate(prompts, max_tokens=new, stop_ids=())
    # then a prompt sharing the 37-token one's first 32: a prefix hit (its pages carry the indexer keys)
    hit_prompt = prompts[1][:32] + rng.integers(3, m.cfg.vocab_size, 7).tolist()
    hit = eng.generate([hit_prompt], max_tokens=new, stop_ids=())[0]
    assert hit.cached_tokens == 32
    for p, o in zip(prompts + [hit_prompt], out + [hit]):
        ids = jnp.asarray([p + o.tokens[:-1]], jnp.int32)
        want = _prefill_then_decode(m, ids, len(p), 64)[0, len(p) - 1:]
        np.testing.assert_array_equal(np.asarray(jnp.argmax(want, -1)), o.tokens)
        err = float(np.max(np.abs(np.asarray(o.logits) - np.asarray(want))))
        assert err < 1e-4, err


def _plan(capsys, tmp_path, raw, *argv):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    capsys.readouterr()
    rc = main(["plan", "--model", str(tmp_path), "--mesh", "data=2,expert=2,model=1", "--batch", "8", "--context",
               "256", *argv])
    out = capsys.readouterr()
    assert rc == 0, out.out + out.err
    return out.out


def test_plan_counts_the_indexer_keys(capsys, tmp_path):
    """``kimi-jax plan``: the MLA cache of K3.1 holds the indexer keys too (tiny: 32 + 16 latent + 16 index values a
    token instead of 48)."""
    def mla_gb(out):
        return float(re.search(r"MLA latent cache\s+([\d.]+) GB", out).group(1))

    (tmp_path / "k3").mkdir()
    (tmp_path / "k31").mkdir()
    def mla_read_gb(out):
        return float(re.search(r"MLA / KV cache ([\d.]+) GB", out).group(1))

    k3_out = _plan(capsys, tmp_path / "k3", C.tiny_k3_config_dict(), "--context", "1048576")
    k31_out = _plan(capsys, tmp_path / "k31", C.tiny_k31_config_dict(), "--context", "1048576")
    k3, k31 = mla_gb(k3_out), mla_gb(k31_out)
    assert k31 == pytest.approx(k3 * 64 / 48, rel=0.02)
    # a decode step reads every indexer key (16 of 64 values a token) but only top-16 of the 1M latent rows
    assert mla_read_gb(k31_out) == pytest.approx(k31 * 16 / 64, rel=0.02) and mla_read_gb(k3_out) == pytest.approx(k3)


@pytest.mark.slow
def test_plan_compiles_k31_for_tpu(capsys, tmp_path):
    """The tiny K3.1 (its first 4 layers) compiles deviceless for a TPU v5e 2x2, decode step (the selection path over
    256 cache slots) and prefill chunk, and fits."""
    out = _plan(capsys, tmp_path, C.tiny_k31_config_dict(), "--prefill-chunk", "16", "--layers", "4", "--compile",
                "tpu:v5e:2x2")
    assert out.count("compiled in") == 2 and out.count(", fits (") == 2, out


def test_indexer_keys_and_weights_are_sharded():
    """The indexer keys split like the latent they sit beside (sequences, then positions over ``mla_seq``); the
    indexer weights are laid out with the rest (K3.1 at full size, abstract)."""
    cfg = C.preset("k3.1")
    sizes = {"data": 2, "expert": 4, "model": 8}
    specs = sharding.cache_specs(cfg, cache_shapes(cfg, 8, 4096), sizes)
    assert specs.layers[3].ik == specs.layers[3].c and specs.layers[0].state is not None
    tiny = C.from_dict(C.tiny_k31_config_dict())
    p = sharding.param_specs(abstract_model(tiny), sizes)
    assert {k for k in p if ".indexer." in k} == {f"layers.{i}.self_attn.indexer.{n}" for i in (3, 7, 8)
                                                  for n in ("wq_b", "wk", "weights_proj", "k_norm", "k_norm_bias")}


MESH_SCRIPT = """
import functools, json, sys
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from kimi_jax.checkpoint.loading import from_pretrained
from kimi_jax.model.cache import init_cache
from kimi_jax.parallel import sharding

def jitted(model):
    graphdef, state = nnx.split(model)
    @functools.partial(jax.jit, static_argnames="prefix")
    def call(state, ids, cache, prefix):
        out = nnx.merge(graphdef, state)(ids, cache=cache, prefix=prefix)
        return out.logits, out.cache
    return lambda ids, cache=None, prefix=False: call(state, ids, cache, prefix)

path = sys.argv[1]
ids = jnp.asarray(np.random.default_rng(0).integers(0, 1000, (8, 24)), jnp.int32)
ref = jitted(from_pretrained(path, dtype="float32", progress=False))(ids)[0]
errs = {}
for shape in ((1, 1, 8), (1, 8, 1), (2, 2, 2)):
    mesh = sharding.make_mesh(*shape)
    m = from_pretrained(path, dtype="float32", progress=False, mesh=mesh)
    f = jitted(m)
    shapes = init_cache(m.cfg, 8, 32, jnp.float32)
    lg, cache = f(ids[:, :20], init_cache(m.cfg, 8, 32, jnp.float32,
                                          sharding=sharding.cache_shardings(m.cfg, shapes, mesh)))
    out = [lg]
    for t in range(20, 24):
        lg, cache = f(ids[:, t:t + 1], cache, prefix=True)
        out.append(lg)
    errs[str(shape)] = float(jnp.max(jnp.abs(jnp.concatenate(out, axis=1) - ref)))
print(json.dumps(errs))
"""


@pytest.mark.slow
def test_sharded_k31_equals_one_device(k31_dir):
    """On 8 simulated CPU devices, K3.1 (top-16 over 24 tokens) sharded data x expert x model = 1x1x8 (tensor
    parallel: the latent and indexer keys split by position over the model axis), 1x8x1 (expert parallel) and 2x2x2:
    a cached prefill and decode steps equal one device's prefill."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", MESH_SCRIPT, k31_dir], env=env, capture_output=True, text=True, check=False,
                         timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    errs = json.loads(res.stdout.strip().splitlines()[-1])
    assert all(e < 2e-4 for e in errs.values()), errs
