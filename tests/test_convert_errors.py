"""Bad input through the converter: each case fails with an error naming the file or tensor, and leaves nothing that
looks like a complete checkpoint (DST absent, or refused by from_pretrained)."""

import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import kimi_jax
from convert.converter import convert_checkpoint
from kimi_jax.checkpoint import orbax as orbax_io
from kimi_jax.checkpoint import synthetic
from kimi_jax.checkpoint.safetensors import CheckpointError

SHARD1 = "model-00001-of-000002.safetensors"
SHARD2 = "model-00002-of-000002.safetensors"
A_LOG = "language_model.model.layers.0.self_attn.A_log"
PACKED = "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return synthetic.write_checkpoint(tmp_path_factory.mktemp("src") / "k3", "k3", seed=3)


@pytest.fixture
def src(pristine, tmp_path):
    """A fresh copy of the synthetic K3 checkpoint to damage."""
    import shutil

    return shutil.copytree(pristine, tmp_path / "src")


def header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return n, json.loads(f.read(n))


def rewrite_header(path, mutate):
    """Change a shard's header, keeping its data section as it was (offsets are relative to it)."""
    n, h = header(path)
    with open(path, "rb") as f:
        f.seek(8 + n)
        data = f.read()
    mutate(h)
    raw = json.dumps(h, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


def rewrite_tensors(path, mutate):
    tensors = load_file(path)
    mutate(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def fails(src, dst, match, **kw):
    with pytest.raises((ValueError, OSError)) as info:
        convert_checkpoint(src, dst, progress=False, **kw)
    assert info.match(match), str(info.value)
    assert not os.path.exists(os.path.join(dst, orbax_io.MARKER))
    if os.path.isdir(dst) and os.listdir(dst):
        with pytest.raises(orbax_io.IncompleteCheckpointError):
            kimi_jax.from_pretrained(dst)
    return str(info.value)


def test_truncated_shard(src, tmp_path):
    path = os.path.join(src, SHARD2)
    os.truncate(path, os.path.getsize(path) - 100)
    fails(src, tmp_path / "dst", rf"{SHARD2}: truncated: tensor '.*' ends at byte")
    assert not os.path.exists(tmp_path / "dst"), "validation happens before DST is created"


def test_corrupt_header_json(src, tmp_path):
    with open(os.path.join(src, SHARD1), "r+b") as f:
        f.seek(8)
        f.write(b"{not json")
    fails(src, tmp_path / "dst", rf"{SHARD1}: corrupt safetensors header \(not JSON")


def test_lying_offsets(src, tmp_path):
    def overlap(h):  # A_log claims bytes that belong to dt_bias (the header stays self-consistent otherwise)
        start = h[A_LOG.replace("A_log", "dt_bias")]["data_offsets"][0]
        size = h[A_LOG]["data_offsets"][1] - h[A_LOG]["data_offsets"][0]
        h[A_LOG]["data_offsets"] = [start, start + size]

    rewrite_header(os.path.join(src, SHARD1), overlap)
    fails(src, tmp_path / "dst", rf"{SHARD1}: corrupt header: tensors .* overlap")


def test_offsets_past_the_end(src, tmp_path):
    def past_end(h):
        b, e = h[PACKED]["data_offsets"]
        h[PACKED]["data_offsets"] = [b + 10**9, e + 10**9]

    rewrite_header(os.path.join(src, SHARD1), past_end)
    fails(src, tmp_path / "dst", rf"{SHARD1}: truncated: tensor '{PACKED}'")


def test_index_points_at_missing_file(src, tmp_path):
    index = os.path.join(src, "model.safetensors.index.json")
    data = json.load(open(index))
    data["weight_map"][A_LOG] = "model-00003-of-000002.safetensors"
    json.dump(data, open(index, "w"))
    fails(src, tmp_path / "dst", r"shard model-00003-of-000002.safetensors is missing")


def test_tensor_defined_in_two_shards(src, tmp_path):
    dup = load_file(os.path.join(src, SHARD1))[A_LOG]
    rewrite_tensors(os.path.join(src, SHARD2), lambda t: t.__setitem__(A_LOG, dup))
    fails(src, tmp_path / "dst", rf"tensor '{A_LOG}' is defined twice: in {SHARD1} and {SHARD2}")


def test_shape_mismatch_with_config(src, tmp_path):
    cfg_path = os.path.join(src, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["text_config"]["intermediate_size"] = 512  # the dense layer-0 MLP in the shards is 256 wide
    json.dump(cfg, open(cfg_path, "w"))
    fails(src, tmp_path / "dst", r"tensor 'language_model.model.layers.0.mlp.(gate|up|down)_proj.weight' in "
                                 rf"{SHARD1}: shape .* does not fit parameter layers.0.mlp")


def test_dtype_mismatch(src, tmp_path):
    def to_bf16(t):
        t[PACKED] = t[PACKED].astype(ml_dtypes.bfloat16)

    rewrite_tensors(os.path.join(src, SHARD1), to_bf16)
    fails(src, tmp_path / "dst", rf"tensor '{PACKED}' in {SHARD1}: dtype BF16 cannot fill parameter "
                                 r"layers.1.mlp.experts.w1.packed of dtype uint8")


def test_nonzero_a_log_padding(src, tmp_path):
    def pad(t):
        t[A_LOG] = t[A_LOG].copy()
        t[A_LOG][-1] = 0.5

    rewrite_tensors(os.path.join(src, SHARD1), pad)
    fails(src, tmp_path / "dst", rf"tensor '{A_LOG}' in {SHARD1}: A_log padding beyond the first 4 entries must be "
                                 r"zero, found 1 non-zero")


def test_unknown_quantization_format(src, tmp_path):
    cfg_path = os.path.join(src, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["text_config"]["quantization_config"]["format"] = "nvfp4-pack-quantized"
    json.dump(cfg, open(cfg_path, "w"))
    fails(src, tmp_path / "dst", r"unsupported quantization_config .*format='nvfp4-pack-quantized'")


def test_dst_not_writable(src, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    msg = fails(src, blocker / "dst", r"DST .*a_file/dst is not writable")
    assert "Not a directory" in msg
    fails(src, "/proc/kimi_jax_convert_test", r"DST /proc/kimi_jax_convert_test is not writable")


def test_source_truncated_during_conversion(src, tmp_path, monkeypatch):
    """A shard that shrinks after validation (e.g. a copy still in progress) fails naming file and tensor."""
    from kimi_jax.checkpoint import reader

    real = reader.preflight

    def preflight_then_truncate(ckpt, jobs):
        real(ckpt, jobs)
        path = os.path.join(src, SHARD2)
        os.truncate(path, os.path.getsize(path) // 2)

    monkeypatch.setattr(reader, "preflight", preflight_then_truncate)
    fails(src, tmp_path / "dst", rf"{SHARD2}: tensor '.*': file ended after")


def test_non_finite_tensor(src, tmp_path):
    """A NaN in a source tensor stops the conversion naming tensor and file, before its batch is saved; with
    --no-check-finite it converts, and loading the result then refuses it (checked on the loaded arrays)."""
    name = "language_model.model.layers.5.self_attn.o_proj.weight"

    def poison(t):
        a = t[name].copy()
        a.reshape(-1)[3] = np.nan
        t[name] = a

    rewrite_tensors(os.path.join(src, SHARD2), poison)
    fails(src, tmp_path / "dst", rf"tensor '{name}' in {SHARD2}: 1 NaN / Inf values")
    dst = tmp_path / "unchecked"
    convert_checkpoint(src, dst, progress=False, check_finite=False)
    with pytest.raises(CheckpointError, match=r"parameter layers\.5\.self_attn\.o_proj holds 1 NaN / Inf values"):
        kimi_jax.from_pretrained(dst, dtype="float32")
    assert kimi_jax.from_pretrained(dst, dtype="float32", check_finite=False).cfg.num_layers == 9
