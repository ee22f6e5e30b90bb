"""Loading a checkpoint that does not match its config fails with an error naming tensor, file and shapes."""

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import kimi_jax
from kimi_jax.checkpoint.safetensors import CheckpointError
from kimi_jax.model.config import ConfigError

SHARD1 = "model-00001-of-000002.safetensors"
SHARD2 = "model-00002-of-000002.safetensors"
LAYER0 = "language_model.model.layers.0."


@pytest.fixture
def ckpt(k3_tiny_a, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(k3_tiny_a, dst)
    return dst


def _rewrite(path, shard, edit):
    tensors = load_file(os.path.join(path, shard))
    edit(tensors)
    save_file(tensors, os.path.join(path, shard), metadata={"format": "pt"})
    return tensors


def _reindex(path):
    index = {"metadata": {"total_size": 0}, "weight_map": {}}
    for shard in (SHARD1, SHARD2):
        for name in load_file(os.path.join(path, shard)):
            index["weight_map"][name] = shard
    json.dump(index, open(os.path.join(path, "model.safetensors.index.json"), "w"))


def test_missing_tensor(ckpt):
    _rewrite(ckpt, SHARD1, lambda t: t.pop(LAYER0 + "self_attn.q_proj.weight"))
    _reindex(ckpt)
    with pytest.raises(CheckpointError, match=r"layers\.0\.self_attn\.q_proj .* has no tensor"):
        kimi_jax.from_pretrained(ckpt, dtype="float32")


def test_extra_tensor(ckpt):
    _rewrite(ckpt, SHARD1, lambda t: t.update({LAYER0 + "self_attn.mystery.weight": np.zeros((2, 2), np.float32)}))
    _reindex(ckpt)
    with pytest.raises(CheckpointError, match=r"match no parameter.*self_attn\.mystery\.weight"):
        kimi_jax.from_pretrained(ckpt, dtype="float32")


def test_wrong_shape(ckpt):
    name = LAYER0 + "self_attn.k_proj.weight"
    _rewrite(ckpt, SHARD1, lambda t: t.update({name: t[name][:, :64].copy()}))
    with pytest.raises(CheckpointError, match=rf"{name}.*{SHARD1}.*\[128, 64\].*\[128, 128\]"):
        kimi_jax.from_pretrained(ckpt, dtype="float32")


def test_nonzero_a_log_padding(ckpt):
    name = LAYER0 + "self_attn.A_log"

    def edit(t):
        a = t[name].copy()
        a[7] = 0.5  # 4 real heads, entries 4.. must be zero
        t[name] = a

    _rewrite(ckpt, SHARD1, edit)
    with pytest.raises(CheckpointError, match=rf"{name}.*padding.*must be zero"):
        kimi_jax.from_pretrained(ckpt, dtype="float32")


def test_packed_dtype_mismatch(ckpt):
    name = "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"
    _rewrite(ckpt, SHARD1, lambda t: t.update({name: t[name].astype(np.float32)}))
    with pytest.raises(CheckpointError, match=rf"{name}.*dtype F32"):
        kimi_jax.from_pretrained(ckpt, dtype="float32")


def test_unsupported_config_value(ckpt):
    cfg = json.load(open(ckpt / "config.json"))
    cfg["text_config"]["hidden_act"] = "relu2"
    json.dump(cfg, open(ckpt / "config.json", "w"))
    with pytest.raises(ConfigError, match="hidden_act='relu2'"):
        kimi_jax.from_pretrained(ckpt, dtype="float32")


def test_truncated_safetensors(ckpt):
    path = ckpt / SHARD2
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=rf"{SHARD2}: truncated"):
        kimi_jax.from_pretrained(ckpt, dtype="float32")


def test_corrupt_header_and_lying_offsets(ckpt):
    path = ckpt / SHARD2
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    name = "language_model.model.norm.weight"
    b, e = header[name]["data_offsets"]
    header[name]["data_offsets"] = [b, e + 2]  # claims more bytes than the dtype/shape need
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(raw) == n
    path.write_bytes(bytes(data[:8]) + raw + bytes(data[8 + n :]))
    with pytest.raises(CheckpointError, match=rf"{SHARD2}: tensor '{name}': data_offsets span"):
        kimi_jax.from_pretrained(ckpt, dtype="float32")
    path.write_bytes(bytes(data[:8]) + b"{" * n + bytes(data[8 + n :]))
    with pytest.raises(CheckpointError, match=rf"{SHARD2}: corrupt safetensors header"):
        kimi_jax.from_pretrained(ckpt, dtype="float32")


def test_missing_shard_and_duplicate_tensor(ckpt):
    os.rename(ckpt / SHARD2, ckpt / "elsewhere.safetensors")
    with pytest.raises(CheckpointError, match=rf"shard {SHARD2} is missing"):
        kimi_jax.from_pretrained(ckpt, dtype="float32")
    os.rename(ckpt / "elsewhere.safetensors", ckpt / SHARD2)
    norm = "language_model.model.norm.weight"
    t2 = load_file(ckpt / SHARD2)
    _rewrite(ckpt, SHARD1, lambda t: t.update({norm: t2[norm]}))
    with pytest.raises(CheckpointError, match=rf"{norm}.* defined twice"):
        kimi_jax.from_pretrained(ckpt, dtype="float32")
