"""The synthetic checkpoint writer against oracles we did not write: the safetensors library (file bytes), HF
transformers (loads the Kimi Linear / Llama checkpoints, re-saves them identically, same logits as kimi_jax) and the
shared K3 fixture (same config -> same file layout, byte for byte in every header and the index)."""

import json
import os
import re
import struct
import subprocess
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx

import kimi_jax
from kimi_jax.checkpoint import synthetic
from kimi_jax.checkpoint.safetensors import Checkpoint
from kimi_jax.checkpoint.safetensors_write import Entry, write_file
from tests.parity import TOL, assert_close


def headers(d):
    """{tensor name: (file, dtype, shape, data_offsets)} over every model*.safetensors of a directory."""
    out = {}
    for f in sorted(os.listdir(d)):
        if f.startswith("model") and f.endswith(".safetensors"):
            with open(os.path.join(d, f), "rb") as fh:
                n = struct.unpack("<Q", fh.read(8))[0]
                h = json.loads(fh.read(n))
            h.pop("__metadata__", None)
            out.update({k: (f, v["dtype"], tuple(v["shape"]), tuple(v["data_offsets"])) for k, v in h.items()})
    return out


def test_stream_writer_bytes_equal_safetensors(tmp_path):
    from safetensors.numpy import save

    rng = np.random.default_rng(0)
    tensors = {"b.w": rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16), "a.f32": rng.standard_normal(7).astype(np.float32),
               "c.u8": rng.integers(0, 255, (4, 2)).astype(np.uint8), "z.i64": np.arange(3), "m.f16": np.ones((1, 1), np.float16),
               "a.bf16": np.zeros((2, 0), ml_dtypes.bfloat16)}
    entries = [Entry(k, {"bfloat16": "BF16", "float32": "F32", "uint8": "U8", "int64": "I64", "float16": "F16"}[str(v.dtype)],
                     v.shape) for k, v in tensors.items()]
    write_file(str(tmp_path / "x.safetensors"), entries, lambda e: tensors[e.name])
    assert (tmp_path / "x.safetensors").read_bytes() == save(tensors, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="'z.i64': produced float64"):
        write_file(str(tmp_path / "y.safetensors"), entries, lambda e: tensors[e.name].astype(np.float64))
    assert os.listdir(tmp_path) == ["x.safetensors"], "a failed write must leave nothing behind"


def test_k3_layout_equals_fixture(k3_tiny_a, tmp_path):
    """Same config as tests/fixtures/k3-tiny-a -> the same files: shard names, every header byte (names, dtypes,
    shapes, offsets, order), the index JSON, config.json -- only the random values differ."""
    with open(os.path.join(k3_tiny_a, "config.json")) as f:
        cfg = json.load(f)
    out = synthetic.write_checkpoint(tmp_path / "k3", "k3", config=cfg, seed=7)
    names = sorted(f for f in os.listdir(out))
    assert names == ["config.json", "model-00001-of-000002.safetensors", "model-00002-of-000002.safetensors",
                     "model.safetensors.index.json"]
    for f in names:
        ours, ref = open(os.path.join(out, f), "rb").read(), open(os.path.join(k3_tiny_a, f), "rb").read()
        if f.endswith(".safetensors"):
            n = struct.unpack("<Q", ref[:8])[0]
            assert ours[: 8 + n] == ref[: 8 + n], f"{f}: header differs from the fixture"
            assert len(ours) == len(ref)
            assert ours[8 + n:] != ref[8 + n:]  # the values are ours
        else:
            assert ours == ref, f"{f} differs from the fixture"
    ck = Checkpoint(out)
    dtypes = {}
    for name, info in ck.tensors.items():
        dtypes[info.dtype] = dtypes.get(info.dtype, 0) + 1
    assert dtypes == {"BF16": 190, "F32": 44, "U8": 384}  # the fixture README's count
    a_log = ck.get("language_model.model.layers.0.self_attn.A_log")
    assert a_log.shape == (32,) and np.all(a_log[4:] == 0) and np.all(np.exp(a_log[:4]) > 1)
    scale = ck.get("language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_scale")
    assert len(np.unique(scale)) >= 3 and (scale[:, 0] != scale[:, 1]).any(), "scale bytes should vary inside rows"
    codes = np.stack([ck.get(n) for n in ck.tensors if n.endswith("weight_packed")])
    assert ((codes & 0xF) == 8).any(), "the quantizer emits -0 for small negatives, as compressed-tensors does"


def test_k3_default_is_a_sane_model(tmp_path):
    """The embedded tiny K3 default loads, gives O(1-5) logits and uses every expert with varied top-k sets."""
    path = synthetic.write_checkpoint(tmp_path / "k3", "k3")
    model = kimi_jax.from_pretrained(path, dtype="float32")
    ids = np.random.default_rng(0).integers(3, 1024, (2, 24))
    out = nnx.jit(lambda m, x: m(x, return_router=True))(model, jnp.asarray(ids, jnp.int32))
    logits = np.asarray(out.logits)
    assert 1.0 < np.abs(logits).max() < 20 and 0.3 < logits.std() < 5, (np.abs(logits).max(), logits.std())
    for layer, (idx, _) in enumerate(out.router):
        idx = np.sort(np.asarray(idx).reshape(-1, 2), -1)
        counts = np.bincount(idx.ravel(), minlength=8)
        assert (counts > 0).sum() >= 6 and counts.max() < 0.8 * len(idx), f"MoE layer {layer}: expert counts {counts}"
        assert len({tuple(r) for r in idx}) >= 8, f"MoE layer {layer}: routing is degenerate"


def _unstamped(text):
    """A config file's text with the ``transformers_version`` that save_pretrained stamps blanked: the installed
    transformers may be newer than the version the synthetic layouts reproduce."""
    return re.sub(r'"transformers_version": "[^"]*"', '"transformers_version": ""', text)


def _hf_header_after_resave(model, tmp_path, name):
    d = tmp_path / name
    model.save_pretrained(d)
    return {k: v[1:3] for k, v in headers(d).items()}, d


@pytest.mark.parametrize("family", ["kimi_linear", "llama"])
def test_hf_family_loads_in_transformers_with_same_logits(family, tmp_path):
    """HF transformers loads the checkpoint with no missing/unexpected keys, writes back the same tensors and
    configs (a save_pretrained fixpoint), and its float32 logits equal kimi_jax's."""
    from transformers import AutoModelForCausalLM

    path = synthetic.write_checkpoint(tmp_path / family, family, num_shards=2)
    hf_bf16, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, output_loading_info=True)
    assert not any(info.values()), info
    resaved, d = _hf_header_after_resave(hf_bf16, tmp_path, "resaved")
    assert {k: v[1:3] for k, v in headers(path).items()} == resaved
    for f in ("config.json", "generation_config.json"):  # byte for byte, but for the writer's version stamp
        assert _unstamped((d / f).read_text()) == _unstamped(open(os.path.join(path, f)).read()), f
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    ids = torch.randint(0, vocab, (2, 70), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits.numpy()
    assert 1.0 < np.abs(ref).max() < 20, "logits should be O(1-5) for the tolerance to mean something"
    ours = kimi_jax.from_pretrained(path, dtype="float32")(jnp.asarray(ids.numpy(), jnp.int32)).logits
    err = assert_close(ours, ref, TOL["float32"], f"{family} logits vs HF")
    print(f"{family}: max |logits - HF| = {err:.3g} (max |logit| {np.abs(ref).max():.2f})")


def test_sharding_options_and_determinism(tmp_path):
    one = synthetic.write_checkpoint(tmp_path / "one", "k3", num_shards=1)
    assert sorted(os.listdir(one)) == ["config.json", "model.safetensors"]
    rel = synthetic.write_checkpoint(tmp_path / "rel", "k3", num_shards=10)  # 9 layers + globals, like the release
    h = headers(rel)
    assert len({v[0] for v in h.values()}) == 10
    last = {k for k, v in h.items() if v[0] == "model-00010-of-000010.safetensors"}
    assert last == {"language_model.model.embed_tokens.weight", "language_model.lm_head.weight",
                    "language_model.model.norm.weight", "language_model.model.output_attn_res_norm.weight",
                    "language_model.model.output_attn_res_proj.weight"}
    assert all(v[0] == f"model-{int(k.split('.')[3]) + 1:05d}-of-000010.safetensors"
               for k, v in h.items() if ".layers." in k)
    a, b = Checkpoint(one), Checkpoint(rel)
    for name in a.tensors:  # values depend on (seed, name) only
        np.testing.assert_array_equal(a.get(name), b.get(name), err_msg=name)
    with pytest.raises(ValueError, match="num_shards=11"):
        synthetic.write_checkpoint(tmp_path / "bad", "k3", num_shards=11)
    with pytest.raises(FileExistsError, match="already holds"):
        synthetic.write_checkpoint(one, "k3")
    with pytest.raises(ValueError, match="family='gpt2'"):
        synthetic.write_checkpoint(tmp_path / "x", "gpt2")


def test_make_tiny_cli_without_torch(tmp_path):
    """`kimi-jax make-tiny` works in a process where torch cannot be imported."""
    code = ("import sys; sys.modules['torch'] = None; from kimi_jax.cli import main; "
            f"sys.exit(main(['make-tiny', {str(tmp_path / 'k3')!r}, '--family', 'k3', '--shards', '3']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp_path / "k3"))[1:] == [f"model-0000{i}-of-000003.safetensors" for i in (1, 2, 3)] + \
        ["model.safetensors.index.json", "tiktoken.model", "tokenizer_config.json"]
    kimi_jax.model.config.load(tmp_path / "k3")  # parses
