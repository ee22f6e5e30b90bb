"""Loading a checkpoint that does not match its config fails with an error naming tensor, file and shapes."""

import json
import os
import re
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
    """The message names the tensor as the checkpoint should have had it, the files searched, then our parameter."""
    _rewrite(ckpt, SHARD1, lambda t: t.pop(LAYER0 + "self_attn.q_proj.weight"))
    _reindex(ckpt)
    want = rf"checkpoint tensor '{LAYER0}self_attn\.q_proj\.weight' is in none of {SHARD1}, {SHARD2}; it fills " \
           r"parameter layers\.0\.self_attn\.q_proj \[128, 128\]"
    with pytest.raises(CheckpointError, match=want):
        kimi_jax.from_pretrained(ckpt, dtype="float32")


def test_missing_experts(ckpt):
    expert = "language_model.model.layers.1.block_sparse_moe.experts.{}.w2.weight_scale"
    _rewrite(ckpt, SHARD1, lambda t: [t.pop(expert.format(e)) for e in (3, 5)])
    _reindex(ckpt)
    want = (f"checkpoint tensor '{expert.format(3)}' (and 1 more experts: [5]) is in none of {SHARD1}, {SHARD2}; "
            "it fills parameter layers.1.mlp.experts.w2.scale")
    with pytest.raises(CheckpointError, match=re.escape(want)):
        kimi_jax.from_pretrained(ckpt, dtype="float32")


def test_every_parameter_has_a_checkpoint_name():
    """The name table answers "which tensor fills this parameter" for every leaf of the three families."""
    from flax import nnx

    from kimi_jax.checkpoint import names, synthetic
    from kimi_jax.model import config as C
    from kimi_jax.model import params
    from kimi_jax.model.decoder import abstract_model

    for family in ("k3", "kimi_linear", "llama"):
        cfg = C.from_dict(synthetic.default_config(family))
        leaves = params.leaves(nnx.state(abstract_model(cfg)))
        got = {leaf: names.expected_tensor(leaf, cfg) for leaf in leaves}
        assert all(got.values()), [k for k, v in got.items() if not v]
        for leaf, name in got.items():  # and the table maps the name back onto the leaf
            p = names.match(name.format(expert=0), names.canonical(name.format(expert=0), cfg), leaves)
            assert p is not None and p.target == leaf, (leaf, name)


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


@pytest.mark.parametrize("case", ["nan_f32", "inf_bf16", "nan_scale_byte"])
def test_non_finite_weights_are_refused(ckpt, case):
    """NaN / Inf in a float tensor, or E8M0's NaN byte in an MXFP4 scale: refused naming tensor and file, unless
    the caller opts out."""
    import ml_dtypes

    name, shard = {"nan_f32": (LAYER0 + "self_attn.dt_bias", SHARD1),
                   "inf_bf16": ("language_model.model.layers.6.self_attn.o_proj.weight", SHARD2),
                   "nan_scale_byte": ("language_model.model.layers.1.block_sparse_moe.experts.2.w3.weight_scale",
                                      SHARD1)}[case]

    def edit(t):
        a = t[name].copy()
        flat = a.reshape(-1)
        if case == "nan_scale_byte":
            flat[5] = 255
        elif case == "inf_bf16":
            assert a.dtype == ml_dtypes.bfloat16
            flat[5] = np.inf
        else:
            flat[5] = np.nan
        t[name] = a

    _rewrite(ckpt, shard, edit)
    what = "E8M0 NaN scale bytes" if case == "nan_scale_byte" else "NaN / Inf values"
    with pytest.raises(CheckpointError, match=rf"tensor '{re.escape(name)}' in {shard}: 1 {what}"):
        kimi_jax.from_pretrained(ckpt, dtype="float32")
    model = kimi_jax.from_pretrained(ckpt, dtype="float32", check_finite=False)  # the opt-out loads it as it is
    assert model.cfg.num_layers == 9
