"""compressed-tensors ``pack-quantized`` int4 / int8 checkpoints (weight-only, symmetric, group or channel scales)
read into Int4Weight / Int8Weight, checked against compressed-tensors itself: a float checkpoint is quantized and
compressed by its own quantizer and PackedQuantizationCompressor, and every loaded weight decodes (our
``quant.dequantize``) to the bits its ``decompress`` gives; the codes and scales are its own; the model computes what
the float model computes with the decompressed weights in place; the variants we do not take are refused by name."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.utils.helpers import calculate_qparams
from flax import nnx
from safetensors.torch import load_file, save_file

import kimi_jax
from kernels_pallas import quant
from kimi_jax.checkpoint import synthetic
from kimi_jax.checkpoint.safetensors import CheckpointError
from kimi_jax.model import config
from kimi_jax.model.config import ConfigError

VARIANTS = {  # id: (num_bits, strategy, group_size)
    "int4_g32": (4, "group", 32),
    "int4_g64": (4, "group", 64),
    "int4_channel": (4, "channel", None),
    "int8_channel": (8, "channel", None),
}


def _scheme(bits, strategy, group, symmetric=True):
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=bits, type="int", strategy=strategy, group_size=group, symmetric=symmetric))


def ct_compress(w: torch.Tensor, scheme) -> dict:
    """compressed-tensors' own path: min/max per (row, group) or per row -> calculate_qparams -> compress."""
    args = scheme.weights
    g = w.reshape(w.shape[0], -1, args.group_size) if args.strategy == "group" else w.reshape(w.shape[0], 1, -1)
    scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), args)
    return PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme)


def ct_decompress(fields: dict, scheme) -> torch.Tensor:
    return PackedQuantizationCompressor.decompress(dict(fields), scheme)["weight"]


def write_ct_checkpoint(path, scheme, *, dtype="bfloat16", ignore=("lm_head",), family="llama",
                        select=lambda name: name.endswith("_proj.weight")) -> dict:
    """A synthetic checkpoint (default: Llama) whose ``select``ed weights (default: the projections)
    compressed-tensors quantized and packed; returns {weight name: its compressed fields}."""
    synthetic.write_checkpoint(path, family, num_shards=1, dtype=dtype)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    packed = {}
    for name in list(tensors):
        if select(name):
            stem = name[:-len("weight")]
            fields = ct_compress(tensors.pop(name), scheme)
            packed[name] = fields
            tensors.update({stem + k: v for k, v in fields.items()})
    save_file(tensors, file, metadata={"format": "pt"})
    cfg_file = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_file))
    cfg["quantization_config"] = QuantizationConfig(
        config_groups={"group_0": scheme}, format="pack-quantized", quantization_status="compressed",
        ignore=list(ignore)).model_dump(mode="json")
    json.dump(cfg, open(cfg_file, "w"))
    return packed


def _param(model, path):
    v = nnx.state(model, nnx.Param)
    for part in path.split("."):
        v = v[int(part) if part.isdigit() else part]
    return v.get_value()


def _leaf(name):  # "model.layers.0.self_attn.q_proj.weight" -> "layers.0.self_attn.q_proj"
    return name[len("model."):-len(".weight")]


def _bits(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_weights_decode_to_compressed_tensors_decompress(tmp_path, variant, dtype):
    scheme = _scheme(*VARIANTS[variant])
    packed = write_ct_checkpoint(tmp_path, scheme, dtype=dtype)
    model = kimi_jax.from_pretrained(tmp_path, dtype=dtype, progress=False)
    bits, strategy, group = VARIANTS[variant]
    assert len(packed) == 14
    for name, fields in packed.items():
        w = _param(model, _leaf(name))
        assert isinstance(w, quant.Int8Weight if bits == 8 else quant.Int4Weight), name
        rows, cols = (int(x) for x in fields["weight_shape"])
        assert w.shape == (rows, cols)
        if bits == 4:
            assert w.group == (group or cols)
        ref = ct_decompress(fields, scheme)  # the scale's dtype, as compressed-tensors decodes
        ours = np.asarray(quant.dequantize(w, jnp.bfloat16 if dtype == "bfloat16" else jnp.float32))
        want = ref.view(torch.int16 if dtype == "bfloat16" else torch.int32).numpy()
        np.testing.assert_array_equal(_bits(ours), want.reshape(-1).view(_bits(ours).dtype), err_msg=name)
        # the codes and scales are compressed-tensors' own (not merely something that decodes alike)
        codes = unpack_from_int32(fields["weight_packed"], bits, fields["weight_shape"]).numpy()
        got = np.asarray(w.q) if bits == 8 else np.asarray(quant.signed_nibbles(quant.unpack_nibbles(w.packed)))
        np.testing.assert_array_equal(got, codes, err_msg=name)
        np.testing.assert_array_equal(np.asarray(w.scale), fields["weight_scale"].float().numpy(), err_msg=name)
        assert codes.min() < -(2 ** (bits - 2)) and codes.max() > 2 ** (bits - 2)  # the whole code range is used
    assert not isinstance(_param(model, "lm_head"), quant.TYPES)  # ignored by the config: stored float


def test_model_computes_with_the_decompressed_weights(tmp_path):
    """Logits of the loaded pack-quantized model equal the float model's with compressed-tensors' decompressed
    weights in place (float32 throughout: the decode is exact there)."""
    scheme = _scheme(4, "group", 32)
    packed = write_ct_checkpoint(tmp_path / "ct", scheme, dtype="float32")
    model = kimi_jax.from_pretrained(tmp_path / "ct", dtype="float32", progress=False)
    synthetic.write_checkpoint(tmp_path / "float", "llama", num_shards=1, dtype="float32")
    fake = kimi_jax.from_pretrained(tmp_path / "float", dtype="float32", progress=False)
    state = nnx.state(fake, nnx.Param)
    for p_, var in nnx.to_flat_state(state):
        name = "model." + ".".join(map(str, p_)) + ".weight"
        if name in packed:
            var.set_value(jnp.asarray(ct_decompress(packed[name], scheme).numpy()))
    nnx.update(fake, state)
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 256, (2, 12)))
    np.testing.assert_allclose(np.asarray(model(ids).logits), np.asarray(fake(ids).logits), rtol=1e-4, atol=1e-4)


def _edit_config(path, edit):
    cfg_file = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_file))
    edit(cfg["quantization_config"])
    json.dump(cfg, open(cfg_file, "w"))


@pytest.mark.parametrize("edit, why", [
    (lambda q: q["config_groups"]["group_0"]["weights"].update(symmetric=False), "symmetric=False"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=2), "num_bits=2"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=8), "strategy='group' group_size=32 with "
                                                                              "num_bits=8"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(actorder="group"), "actorder='group'"),
    (lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8}), "activation quantization"),
    (lambda q: q.update(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme is set"),
    (lambda q: q["config_groups"].update(group_1=dict(q["config_groups"]["group_0"], weights=dict(
        q["config_groups"]["group_0"]["weights"], group_size=64))), "2 weight formats"),
])
def test_variants_we_do_not_take_are_refused(tmp_path, edit, why):
    write_ct_checkpoint(tmp_path, _scheme(4, "group", 32))
    _edit_config(tmp_path, edit)
    # the model config parser is the one reader of quantization_config (from_pretrained reports what it says)
    with pytest.raises(ConfigError, match=why):
        kimi_jax.from_pretrained(tmp_path, progress=False)
    with pytest.raises(ConfigError, match=why):
        config.load(tmp_path)


@pytest.mark.parametrize("family", ["llama", "kimi_linear"])
def test_the_config_parser_takes_a_pack_quantized_config(tmp_path, family):
    """``config.load`` (what ``kimi-jax plan --model DIR`` and the converter read) on a pack-quantized checkpoint: the
    model config, not an "unsupported quantization_config" error; the weights' format is the loader's."""
    write_ct_checkpoint(tmp_path, _scheme(4, "group", 32), family=family,
                        select=lambda name: name.endswith("o_proj.weight"))
    assert json.load(open(os.path.join(tmp_path, "config.json")))["quantization_config"]["format"] == "pack-quantized"
    cfg = config.load(tmp_path)
    assert cfg == kimi_jax.from_pretrained(tmp_path, progress=False).cfg and (cfg.moe is None) == (family == "llama")


def test_inconsistent_files_are_refused(tmp_path):
    write_ct_checkpoint(tmp_path, _scheme(8, "channel", None))
    with pytest.raises(ValueError, match="would requantize them"):
        kimi_jax.from_pretrained(tmp_path, quantize="int8", progress=False)
    file = os.path.join(tmp_path, "model.safetensors")
    tensors = load_file(file)
    name = "model.layers.1.mlp.up_proj.weight_shape"
    tensors[name] = torch.tensor([128, 32])
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"weight_shape' says \[128, 32\], parameter layers.1.mlp.up_proj is "
                                              r"\[128, 64\]"):
        kimi_jax.from_pretrained(tmp_path, progress=False)
    tensors[name] = torch.tensor([128, 64])
    words = "model.layers.1.mlp.up_proj.weight_packed"
    tensors[words] = tensors[words][:, :8].contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="8 int32 words of 4 values per row do not hold the parameter's 64"):
        kimi_jax.from_pretrained(tmp_path, progress=False)


def test_convert_refuses_a_pack_quantized_source(tmp_path):
    """`kimi-jax convert` takes float and MXFP4 sources; a pack-quantized one is refused by name before DST is
    written (from_pretrained reads it directly)."""
    from convert.converter import ConvertError, convert_checkpoint

    write_ct_checkpoint(tmp_path / "ct", _scheme(4, "group", 32))
    with pytest.raises(ConvertError, match=r"int4 pack-quantized \(group 32\) \(compressed-tensors\): convert does "
                                           r"not take pack-quantized sources"):
        convert_checkpoint(tmp_path / "ct", tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()


def test_pack_quantized_routed_experts_are_refused(tmp_path):
    """Routed experts stored pack-quantized (one weight_packed per expert) are not read yet: refused naming the
    tensor and the parameter, not misread as MXFP4 fields."""
    written = write_ct_checkpoint(tmp_path, _scheme(4, "group", 32), family="kimi_linear",
                                  select=lambda name: ".experts." in name and name.endswith(".weight"))
    assert written
    with pytest.raises(CheckpointError, match=r"experts\.0\.w1\.weight_packed'?: pack-quantized routed experts are "
                                              r"not supported \(parameter layers\.\d+\.mlp\.experts\.w1\)"):
        kimi_jax.from_pretrained(tmp_path, progress=False)


def _config_reads(monkeypatch) -> list:
    """A list that grows by one each time any code opens a file named config.json."""
    import builtins

    opened, real = [], builtins.open

    def counting(file, *args, **kw):
        if isinstance(file, (str, os.PathLike)) and os.path.basename(os.fspath(file)) == "config.json":
            opened.append(os.fspath(file))
        return real(file, *args, **kw)

    monkeypatch.setattr(builtins, "open", counting)
    return opened


@pytest.mark.parametrize("stored", ["float", "int4_g32"])
def test_config_json_is_read_once_per_load(tmp_path, monkeypatch, stored):
    """One load reads config.json once and hands the parsed config down (the weights' pack-quantized format
    included); the counter sees every open, so a second reader anywhere fails this."""
    if stored == "float":
        synthetic.write_checkpoint(tmp_path, "llama", num_shards=1)
    else:
        write_ct_checkpoint(tmp_path, _scheme(*VARIANTS[stored]))
    opened = _config_reads(monkeypatch)
    model = kimi_jax.from_pretrained(tmp_path, progress=False)
    assert opened == [os.path.join(tmp_path, "config.json")]
    assert (model.cfg.packed_weights is None) == (stored == "float")
    opened.clear()
    config.load(tmp_path)
    config.load(tmp_path)
    assert len(opened) == 2  # the counter counts each read
