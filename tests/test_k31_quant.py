"""Kimi K3.1's quantized indexer: FP8 block-quantized ``wq_b`` / ``wk`` at load (DeepSeek-V3.2's layout), and the
int8 index-key cache (``kv_cache="int8-index"``: only the DSA indexer keys in int8, the latent in full precision)."""

from __future__ import annotations

import json
import os
import shutil
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from kernels_pallas.cache_quant import Int8Rows
from kimi_jax.checkpoint import reader as reader_lib
from kimi_jax.checkpoint import synthetic
from kimi_jax.checkpoint.loading import from_pretrained
from kimi_jax.checkpoint.names import WeightError
from kimi_jax.checkpoint.safetensors_write import Entry, write_file
from kimi_jax.cli import main
from kimi_jax.deploy.plan import make_plan
from kimi_jax.model import config as C
from kimi_jax.model import params
from kimi_jax.model.cache import MLACache, cache_bytes, cache_shapes, init_cache, paged_cache, paged_cache_shapes
from kimi_jax.serving.engine import Engine
from tests.test_k31 import F32, LAYERS, _layer_run, _mla_layer, _one_mla_layer, _with_topk, _with_weights

# -- FP8 block-quantized indexer weights -----------------------------------------------------------------------------

# 3 heads x 96 over a q-LoRA rank of 160: wq_b [288, 160] spans 3 x 2 blocks of 128, the last row and column blocks
# partial; wk [96, 128] one partial block
FP8_DSA = dict(index_n_heads=3, index_head_dim=96)
PRE = "language_model.model.layers.3.self_attn.indexer."


def _fp8_config() -> dict:
    c = C.tiny_k31_config_dict()
    c["text_config"]["dsa_config"].update(FP8_DSA)
    c["text_config"]["q_lora_rank"] = 160
    return c


def _read_raw(path) -> dict:
    """Every tensor of one safetensors file, parsed here from its header and bytes (float8 as ml_dtypes')."""
    types = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F32": np.float32, "U8": np.uint8}
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    out = {}
    for name, e in json.loads(data[8:8 + n]).items():
        if name != "__metadata__":
            b, end = e["data_offsets"]
            out[name] = np.frombuffer(data[8 + n + b:8 + n + end], types[e["dtype"]]).reshape(e["shape"])
    return out


def _dequantize(w, scale_inv):
    """Independent FP8 block dequantization: each element times the scale of the 128 x 128 block holding it."""
    rows, cols = np.indices(w.shape)
    return w.astype(np.float32) * scale_inv[rows // 128, cols // 128]


def _rewrite(path, tensors: dict) -> None:
    """``path``'s single ``model.safetensors`` replaced by ``tensors`` (any dtype, float8 included)."""
    rev = {np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3", np.dtype(np.float32): "F32", np.dtype(np.uint8): "U8"}
    entries = [Entry(n, rev[np.dtype(a.dtype)], tuple(a.shape)) for n, a in tensors.items()]
    os.remove(os.path.join(path, "model.safetensors"))
    write_file(os.path.join(path, "model.safetensors"), entries, lambda e: tensors[e.name])


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("k31_fp8")
    (path / "in.json").write_text(json.dumps(_fp8_config()))
    assert main(["make-tiny", str(path / "ckpt"), "--family", "k3.1", "--config", str(path / "in.json"), "--dtype",
                 "float32", "--shards", "1", "--fp8-indexer"]) == 0
    return str(path / "ckpt")


@pytest.fixture(scope="module")
def fp8_model(fp8_dir):
    return from_pretrained(fp8_dir, dtype="float32", progress=False)


def test_fp8_indexer_loads_dequantized(fp8_dir, fp8_model, tmp_path):
    """make-tiny --fp8-indexer writes wq_b / wk as float8_e4m3fn + float32 weight_scale_inv [ceil(J/128),
    ceil(I/128)] (weights_proj stays float); float32 and bfloat16 loads and a conversion to Orbax hold exactly the
    block-wise dequantization done here."""
    raw = _read_raw(os.path.join(fp8_dir, "model.safetensors"))
    assert raw[PRE + "wq_b.weight"].dtype == ml_dtypes.float8_e4m3fn and raw[PRE + "wq_b.weight"].shape == (288, 160)
    assert raw[PRE + "wq_b.weight_scale_inv"].shape == (3, 2) and raw[PRE + "wk.weight_scale_inv"].shape == (1, 1)
    assert raw[PRE + "weights_proj.weight"].dtype == np.float32 and PRE + "weights_proj.weight_scale_inv" not in raw
    assert len(np.unique(raw[PRE + "wq_b.weight_scale_inv"])) == 6  # every block its own scale: indexing matters
    from convert.converter import convert_checkpoint

    convert_checkpoint(fp8_dir, str(tmp_path / "orbax"), dtype="float32", verify=True, progress=False)
    converted = from_pretrained(str(tmp_path / "orbax"), dtype="float32", progress=False)
    bf16 = from_pretrained(fp8_dir, dtype="bfloat16", progress=False)
    for layer in (3, 7, 8):
        pre = PRE.replace("layers.3.", f"layers.{layer}.")
        for leaf in ("wq_b", "wk"):
            want = _dequantize(raw[pre + leaf + ".weight"], raw[pre + leaf + ".weight_scale_inv"])
            for m, dtype in ((fp8_model, np.float32), (converted, np.float32), (bf16, ml_dtypes.bfloat16)):
                got = np.asarray(getattr(m.layers[layer].self_attn.indexer, leaf)[...])
                assert got.dtype == dtype
                np.testing.assert_array_equal(got, want.astype(dtype))


def test_fp8_checkpoint_gives_the_logits_of_its_dequantized_values(fp8_dir, fp8_model, tmp_path):
    """The same checkpoint with wq_b / wk stored as float32 (the dequantized values, computed here) loads to the same
    parameters and the same logits (one MLA layer with its indexer, 24 tokens: top-16 selection bites)."""
    raw = _read_raw(os.path.join(fp8_dir, "model.safetensors"))
    plain = {}
    for name, a in raw.items():
        if name.endswith(".weight_scale_inv"):
            continue
        plain[name] = _dequantize(a, raw[name + "_scale_inv"]) if a.dtype == ml_dtypes.float8_e4m3fn else a
    save_file(plain, str(tmp_path / "model.safetensors"))
    shutil.copy(os.path.join(fp8_dir, "config.json"), tmp_path / "config.json")
    ref = from_pretrained(str(tmp_path), dtype="float32", progress=False)
    a, b = params.leaves(nnx.state(fp8_model, nnx.Param)), params.leaves(nnx.state(ref, nnx.Param))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)
    one_a, one_b = _one_mla_layer(fp8_model), _one_mla_layer(ref)
    graphdef, state_a = nnx.split(one_a)
    call = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids).logits)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, one_a.cfg.vocab_size, (2, 24)), jnp.int32)
    la, lb = call(state_a, ids), call(nnx.split(one_b)[1], ids)
    np.testing.assert_array_equal(np.asarray(la), np.asarray(lb))
    assert float(jnp.std(la)) > 0.1  # real logits, not zeros


def _broken(fp8_dir, tmp_path, edit) -> str:
    shutil.copytree(fp8_dir, tmp_path, dirs_exist_ok=True)
    tensors = dict(_read_raw(os.path.join(fp8_dir, "model.safetensors")))
    edit(tensors)
    _rewrite(str(tmp_path), tensors)
    return str(tmp_path)


def _refused_before_reading(path, match, monkeypatch):
    def read(*a, **k):
        raise AssertionError("a parameter was read before the checkpoint was refused")

    monkeypatch.setattr(reader_lib.Reader, "read", read)
    with pytest.raises(WeightError, match=match):
        from_pretrained(path, dtype="float32", progress=False)


def test_fp8_scale_of_the_wrong_shape_is_refused(fp8_dir, tmp_path, monkeypatch):
    def edit(t):
        t[PRE + "wq_b.weight_scale_inv"] = np.ones((2, 2), np.float32)

    _refused_before_reading(_broken(fp8_dir, tmp_path, edit),
                            r"tensor 'language_model\.model\.layers\.3\.self_attn\.indexer\.wq_b\.weight'.*"
                            r"weight_scale_inv' are F32 \[2, 2\].*needs float32 \[3, 2\]", monkeypatch)


def test_fp8_weight_without_its_scale_is_refused(fp8_dir, tmp_path, monkeypatch):
    def edit(t):
        del t[PRE + "wk.weight_scale_inv"]

    _refused_before_reading(_broken(fp8_dir, tmp_path, edit),
                            r"tensor 'language_model\.model\.layers\.3\.self_attn\.indexer\.wk\.weight'.*float8 "
                            r"weight \(F8_E4M3\) without its block scales", monkeypatch)


def test_fp8_scale_where_the_table_takes_none_is_refused(fp8_dir, tmp_path, monkeypatch):
    """weights_proj is never FP8 (DeepSeek-V3.2 keeps it unquantized): a scale beside it matches no parameter."""
    def edit(t):
        t[PRE + "weights_proj.weight_scale_inv"] = np.ones((1, 1), np.float32)

    _refused_before_reading(_broken(fp8_dir, tmp_path, edit), r"match no parameter.*weights_proj\.weight_scale_inv",
                            monkeypatch)


def test_fp8_indexer_needs_an_indexer(tmp_path):
    with pytest.raises(ValueError, match="no DSA indexer"):
        synthetic.write_checkpoint(tmp_path, "k3", fp8_indexer=True)
    assert not any(tmp_path.iterdir())


# -- the int8 index-key cache -------------------------------------------------------------------------------------


def test_int8_index_cache_holds_only_the_indexer_keys_in_int8():
    """kv_cache="int8-index": ik is Int8Rows (static and paged), c / kpe keep the model dtype; the cache shrinks by
    n_mla x tokens x (2 DI - (DI + 4)) bytes from bf16; refused for a model without an indexer."""
    cfg = C.from_dict(C.tiny_k31_config_dict())
    B, S, DI = 2, 64, cfg.mla.indexer.head_dim
    n_mla = cfg.attn_types.count("mla")
    for shapes in (cache_shapes(cfg, B, S, jnp.bfloat16, kv_cache="int8-index"),
                   paged_cache_shapes(cfg, B, 16, 8, jnp.bfloat16, kv_cache="int8-index")):
        entries = [e for e in shapes.layers if isinstance(e, MLACache)]
        assert len(entries) == n_mla
        for e in entries:
            assert e.c.dtype == jnp.bfloat16 and e.kpe.dtype == jnp.bfloat16
            assert isinstance(e.ik, Int8Rows) and e.ik.q.dtype == jnp.int8 and e.ik.scale.shape[-1] == 1
    full = cache_bytes(cfg, B, S, jnp.bfloat16)
    index = cache_bytes(cfg, B, S, jnp.bfloat16, kv_cache="int8-index")
    assert full["mla"] - index["mla"] == n_mla * B * S * (2 * DI - (DI + 4))
    assert full["total"] - index["total"] == full["mla"] - index["mla"]
    # kimi-jax plan on one chip: a decode step at 4096 tokens reads every int8 index key (DI + 4 bytes a token) but
    # only the top-k latent rows (R + O bf16 values)
    S, m = 4096, cfg.mla
    plan = make_plan(cfg, {"data": 1, "expert": 1, "model": 1}, batch=1, context=S, kv_cache="int8-index")
    assert plan.cache["mla"] == n_mla * S * (2 * (m.kv_lora_rank + m.qk_rope_dim) + DI + 4)
    want = n_mla * (S * (DI + 4) + m.indexer.topk * 2 * (m.kv_lora_rank + m.qk_rope_dim))
    assert plan.step_read["MLA / KV cache"] == pytest.approx(want, rel=1e-6)
    with pytest.raises(ValueError, match="int8-index.*has no indexer"):
        cache_bytes(C.from_dict(C.tiny_k3_config_dict()), 1, 8, kv_cache="int8-index")
    with pytest.raises(ValueError, match="'int8-index'"):
        cache_bytes(cfg, 1, 8, kv_cache="int4")


@pytest.fixture(scope="module")
def k31(tmp_path_factory):
    """The tiny K3.1 of tests/test_k31.py (make-tiny, float32)."""
    path = str(tmp_path_factory.mktemp("k31"))
    assert main(["make-tiny", path, "--family", "k3.1", "--dtype", "float32", "--shards", "2"]) == 0
    return from_pretrained(path, dtype="float32", progress=False)


def _greedy(model, prompt, new, kv_cache, max_len=None):
    """Greedy tokens ``[B, new]`` and each step's logits ``[B, new, V]``: a cached prefill of ``prompt [B, T]``,
    then one decode step per token (a static cache of ``max_len``, default ``T + new``)."""
    graphdef, state = nnx.split(model)

    def step(state, ids, cache, prefix):
        out = nnx.merge(graphdef, state)(ids, cache=cache, prefix=prefix)
        return out.logits[:, -1], out.cache

    call = jax.jit(step, static_argnames="prefix")
    cache = init_cache(model.cfg, prompt.shape[0], max_len or prompt.shape[1] + new, F32, kv_cache=kv_cache)
    lg, cache = call(state, prompt, cache, False)
    tokens, logits = [], []
    for _ in range(new):
        logits.append(lg)
        tokens.append(jnp.argmax(lg, -1))
        lg, cache = call(state, tokens[-1][:, None].astype(jnp.int32), cache, True)
    return np.stack([np.asarray(t) for t in tokens], 1), np.stack([np.asarray(x) for x in logits], 1)


def test_int8_index_keys_decode_like_full_precision(k31):
    """The tiny K3.1 (float32) through its first MLA layer, top-4 of 16 to 27 keys: int8 index keys give the greedy
    tokens of full-precision keys and the same logits up to summation order (1.3e-6): the latent is exact, so only a
    changed key set moves a logit. Measured over 8 such prompts x 2 rows x 12 steps: 2 of 182 decode steps chose
    another key set (logits then differ by 1.5 and 2.6, this random model's scores having near-ties), one of them
    changing a greedy token (prompt seed 7)."""
    m = _one_mla_layer(_with_weights(_with_topk(k31.cfg.sliced(LAYERS), 4), k31))
    prompt = jnp.asarray(np.random.default_rng(0).integers(3, m.cfg.vocab_size, (2, 16)), jnp.int32)
    want, want_logits = _greedy(m, prompt, 12, None)
    got, got_logits = _greedy(m, prompt, 12, "int8-index")
    np.testing.assert_array_equal(got, want)
    err = float(np.max(np.abs(got_logits - want_logits)))
    print(f"int8-index vs full-precision index keys: max logit difference {err:.3g}")
    assert err < 1e-4, err


def test_int8_index_paged_cache_equals_static(k31):
    """One MLA layer (top-4), two sequences on shuffled pages, int8 index keys in both: a prefill and decode steps on
    the paged cache equal the static cache's."""
    cfg = _with_topk(k31.cfg, 4)
    layer = _mla_layer(k31, 4)
    B, T, ps = 2, 24, 4
    x = jnp.asarray(np.random.default_rng(3).standard_normal((B, T, cfg.hidden_size)), F32)
    static = _layer_run(layer, x, init_cache(cfg, B, T, F32, kv_cache="int8-index").layers[3], 8)
    pool = paged_cache(cfg, B, 2 * T // ps + 2, ps, F32, kv_cache="int8-index").layers[3]
    assert isinstance(pool.ik, Int8Rows) and pool.c.dtype == F32
    table = jnp.asarray(np.random.default_rng(4).permutation(2 * T // ps + 2)[:B * T // ps].reshape(B, T // ps))
    paged = _layer_run(layer, x, pool, 8, pages=table)
    assert float(jnp.max(jnp.abs(paged - static))) < 1e-6


@pytest.mark.slow
def test_serving_engine_runs_int8_index_keys(k31):
    """The serving engine with kv_cache="int8-index" (paged int8 index-key pools beside float32 latent pools) on a
    pool of 8 pages of 8 tokens: two requests in flight; a second conversation needs the pages the first one's
    prefix entries hold, so they spill to host memory; the first conversation's next turn hits its stored reply and
    its pages (int8 keys and scales with them) come back. Greedy tokens and logits equal the static cache's with the
    same option, request by request."""
    m = _with_weights(_with_topk(k31.cfg.sliced(LAYERS), 4), k31)
    eng = Engine(m, slots=2, max_len=64, page_size=8, pages=8, prefill_chunk=16, min_chunk=16, record_logits=True,
                 compact_decode=False, prefix_cache_bytes=1 << 30, prefix_host_bytes=1 << 30, kv_cache="int8-index")
    pools = eng.executor.cache.layers[3]
    assert isinstance(pools.ik, Int8Rows) and pools.c.dtype == F32 and pools.kpe.dtype == F32
    rng = np.random.default_rng(5)
    first, small, other, more = (rng.integers(3, m.cfg.vocab_size, n).tolist() for n in (30, 5, 40, 6))
    done = list(zip([first, small], eng.generate([first, small], max_tokens=6, stop_ids=())))
    done.append((other, eng.generate([other], max_tokens=6, stop_ids=())[0]))
    assert eng.stats()["prefix_page_spills"] > 0
    turn = first + done[0][1].tokens + more
    hit = eng.generate([turn], max_tokens=6, stop_ids=())[0]
    assert hit.cached_tokens > len(first) and eng.stats()["prefix_page_restores"] > 0
    for p, o in done + [(turn, hit)]:
        tokens, logits = _greedy(m, jnp.asarray([p], jnp.int32), 6, "int8-index", max_len=64)
        np.testing.assert_array_equal(tokens[0], o.tokens)
        err = float(np.max(np.abs(np.asarray(o.logits) - logits[0])))
        assert err < 1e-4, err
