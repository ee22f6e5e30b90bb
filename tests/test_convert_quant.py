"""``kimi-jax convert --quantize``: the packed fields stored in the Orbax checkpoint equal the load-time quantization
of the source bit for bit (and greedy generation with them), the stored bytes match the packed sizes computed from
the shapes, the float weight lives only until it is quantized, kill + resume with the same --quantize gives the
uninterrupted result, and a resume or a load asking for another format is refused naming both."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kimi_jax
from convert.converter import ConvertError, VerifyError, convert_checkpoint, verify_checkpoint
from kernels_pallas import packed, quant
from kimi_jax.checkpoint import orbax as orbax_io
from kimi_jax.model import params
from kimi_jax.model import quantize as Q

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORMATS = ("int8", "int4:g32", "int4:g128:zero", "nf4")


def _leaves(model) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in params.leaves(nnx.state(model, nnx.Param)).items()}


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.reshape(-1).view(np.uint8),
                                                                        b.reshape(-1).view(np.uint8))


@pytest.fixture(scope="module")
def converted(k3_tiny_a, tmp_path_factory):
    """{format: DST} of the fixture converted (bfloat16, default classes, verified) in each format."""
    root = tmp_path_factory.mktemp("convq")
    out = {}
    for fmt in FORMATS:
        dst = root / fmt.replace(":", "_")
        convert_checkpoint(k3_tiny_a, dst, quantize=fmt, verify=True, progress=False)
        out[fmt] = str(dst)
    return out


def _no_requantization(monkeypatch):
    """From here on a concrete weight reaching the quantizer fails the test (the abstract model's shapes may be
    traced), and every restore target is recorded."""
    real = Q.quantizer

    def guarded(fmt):
        one = real(fmt)

        def call(w):
            assert isinstance(w, jax.core.Tracer), "a weight was requantized at load"
            return one(w)

        return call

    monkeypatch.setattr(Q, "quantizer", guarded)
    targets = []
    real_restore = orbax_io.restore
    monkeypatch.setattr(orbax_io, "restore", lambda p, t, **kw: targets.append(dict(t)) or real_restore(p, t, **kw))
    return targets


@pytest.mark.parametrize("fmt", FORMATS)
def test_stored_packed_fields_equal_load_time_quantization(k3_tiny_a, converted, monkeypatch, fmt):
    want = kimi_jax.from_pretrained(k3_tiny_a, quantize=fmt, progress=False)
    targets = _no_requantization(monkeypatch)
    if fmt == "int8":  # the guard trips on a load that quantizes
        with pytest.raises(AssertionError, match="requantized at load"):
            kimi_jax.from_pretrained(k3_tiny_a, quantize=fmt, progress=False)
        targets.clear()
    got = kimi_jax.from_pretrained(converted[fmt], progress=False)
    a, b = _leaves(want), _leaves(got)
    assert a.keys() == b.keys()
    differ = [k for k in a if not _same_bits(a[k], b[k])]
    assert not differ, differ[:5]
    planned = Q.plan(kimi_jax.abstract_model(got.cfg), fmt)
    assert len(planned) == 107
    for name, f in planned.items():  # the loaded weights are of the planned types; no float copy was restored
        w = nnx.state(got, nnx.Param)
        for part in name.split("."):
            w = w[int(part) if part.isdigit() else part]
        assert quant.format_of(w.get_value()) == f, name
    (restored,) = targets
    assert not set(planned) & set(restored), "a quantized weight was read as a float array"
    assert all(np.issubdtype(restored[f"{n}.scale" if f.kind != "nf4" else f"{n}.absmax"].dtype, np.floating)
               for n, f in planned.items())
    marker = orbax_io.read_marker(converted[fmt])
    assert marker["quantize"] == {"format": quant.Format.parse(fmt).name(), "include": list(Q.DEFAULT)}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["int8", "int4:g128:zero"])
def test_greedy_generation_equals_load_time_quantization(k3_tiny_a, converted, fmt):
    ids = np.random.default_rng(3).integers(3, 200, (1, 6)).astype(np.int32)
    runs = [kimi_jax.Generator(kimi_jax.from_pretrained(p, progress=False, **kw), max_len=16).generate(ids, 6, stop=())
            for p, kw in ((k3_tiny_a, {"quantize": fmt}), (converted[fmt], {}))]
    assert len(runs[0].tokens[0]) == 6 and list(runs[0].tokens[0]) == list(runs[1].tokens[0])


def _packed_bytes(shape, fmt: quant.Format) -> int:
    """Bytes of one weight [..., J, I] in ``fmt``, from the layout quant.py documents (not from the types)."""
    *lead, rows, cols = shape
    n = int(np.prod(lead, dtype=np.int64)) * rows
    if fmt.kind == "int8":
        return n * cols + n * 4  # int8 codes, one float32 scale per row
    group = cols if cols < fmt.group else fmt.group  # a row narrower than the group is one group
    groups = cols // group
    return n * cols // 2 + n * groups * 4 + (n * groups if fmt.zero_point else 0)  # nibbles, f32 scales, int8 zeros


@pytest.mark.parametrize("fmt", FORMATS)
def test_loaded_bytes_match_the_packed_sizes(k3_tiny_a, converted, fmt):
    float_model = kimi_jax.from_pretrained(k3_tiny_a, progress=False)  # bfloat16, as converted
    want, quantized = 0, 0
    f = quant.Format.parse(fmt)
    for path, var in nnx.to_flat_state(nnx.state(float_model, nnx.Param)):
        name, value = ".".join(map(str, path)), var.get_value()
        if Q.module_class(name) in Q.DEFAULT and not packed.is_packed(value):
            want += _packed_bytes(value.shape, f)
            quantized += int(np.prod(value.shape)) * 2
        else:
            want += sum(int(x.nbytes) for x in (value if packed.is_packed(value) else (value,)))
    model = kimi_jax.from_pretrained(converted[fmt], progress=False)
    got = sum(int(x.nbytes) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert got == want
    assert orbax_io.read_marker(converted[fmt])["bytes"] == want
    stored = sum(int(np.prod(s.shape)) * s.dtype.itemsize for s in orbax_io.stored(converted[fmt]).values())
    assert stored == want
    print(f"{fmt}: {got} bytes loaded ({quantized} bytes of bfloat16 weights quantized)")


def test_float_leaf_lives_only_until_quantized(k3_tiny_a, tmp_path, monkeypatch):
    """Every partial save holds the packed fields, never a float copy of a quantized weight, and the JAX arrays alive
    at each save stay within the two batches in flight (far under the float model)."""
    saves = []
    before = {id(a) for a in jax.live_arrays()}
    real = orbax_io.save_batch

    def record(dst, arrays, batch_id, **kw):
        live = sum(a.nbytes for a in jax.live_arrays() if id(a) not in before)
        saves.append((dict(arrays), live))
        return real(dst, arrays, batch_id, **kw)

    monkeypatch.setattr(orbax_io, "save_batch", record)
    batch = 100_000
    convert_checkpoint(k3_tiny_a, tmp_path / "d", quantize="int8", progress=False, batch_bytes=batch)
    planned = Q.plan(kimi_jax.abstract_model(kimi_jax.from_pretrained(k3_tiny_a, progress=False).cfg), "int8")
    saved = {k: v for arrays, _ in saves for k, v in arrays.items()}
    assert not set(planned) & set(saved)
    assert all(f"{n}.q" in saved and saved[f"{n}.q"].dtype == jnp.int8 for n in planned)
    leaves = jax.tree.leaves(nnx.state(kimi_jax.from_pretrained(k3_tiny_a, progress=False), nnx.Param))
    float_bytes, largest = sum(int(x.nbytes) for x in leaves), max(int(x.nbytes) for x in leaves)
    peak = max(live for _, live in saves)
    # two batches in flight (the one saved, the one read), each at most max(batch, the largest leaf)
    assert len(saves) > 10 and peak <= 2 * max(batch, largest) and peak < float_bytes / 10, (peak, largest)
    print(f"conversion: {len(saves)} saves, at most {peak} bytes of JAX arrays alive (float model {float_bytes})")


KILLER = """
import os, signal, sys
from convert.converter import convert_checkpoint
def hook(name, n):
    if name == "saved" and n == 3:
        os.kill(os.getpid(), signal.SIGKILL)
convert_checkpoint(sys.argv[1], sys.argv[2], progress=False, batch_bytes=200_000, quantize=sys.argv[3], on_event=hook)
raise SystemExit("the hook should have killed this process")
"""


def test_kill_and_resume_same_quantization_only(k3_tiny_a, converted, tmp_path):
    """SIGKILL after 3 partial saves of an int8 conversion: a resume asking for int4 (or none, or other classes) is
    refused naming both; the int8 resume skips what was saved and equals the uninterrupted int8 conversion bit for
    bit."""
    dst = tmp_path / "killed"
    r = subprocess.run([sys.executable, "-c", KILLER, k3_tiny_a, str(dst), "int8"], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == -9, r.stderr[-2000:]
    with pytest.raises(ConvertError, match=r"made with --quantize int8 .*asks for --quantize int4:g32 .*same "
                                           r"quantization to resume, or pass --overwrite"):
        convert_checkpoint(k3_tiny_a, dst, quantize="int4", progress=False)
    with pytest.raises(ConvertError, match=r"made with --quantize int8 .*asks for no --quantize"):
        convert_checkpoint(k3_tiny_a, dst, progress=False)
    with pytest.raises(ConvertError, match=r"made with --quantize int8 --quantize-include attention,mlp,latent,lm_head;"
                                           r" this run asks for --quantize int8 --quantize-include mlp\. "):
        convert_checkpoint(k3_tiny_a, dst, quantize="int8", quantize_include=["mlp"], progress=False)
    summary = convert_checkpoint(k3_tiny_a, dst, quantize="int8", progress=False, batch_bytes=200_000, verify=True)
    assert 0 < summary.skipped < 282 and summary.params == 282 - summary.skipped and summary.verified
    ref = orbax_io.stored(converted["int8"])
    assert orbax_io.stored(dst).keys() == ref.keys()
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in ref.items()}
    a, b = orbax_io.restore(converted["int8"], target), orbax_io.restore(dst, target)
    assert all(_same_bits(np.asarray(a[k]), np.asarray(b[k])) for k in a)


def test_load_asking_for_another_format_is_refused(converted, monkeypatch):
    from kimi_jax.checkpoint import loading

    dst = converted["int8"]
    same = _leaves(kimi_jax.from_pretrained(dst, quantize="int8", progress=False))  # the stored one: a no-op
    plain = _leaves(kimi_jax.from_pretrained(dst, progress=False))
    assert same.keys() == plain.keys() and all(_same_bits(same[k], plain[k]) for k in same)
    monkeypatch.setattr(loading, "_load", lambda *a, **k: pytest.fail("weights were read"))
    with pytest.raises(ValueError, match=r"quantized to int8 .*cannot load it as int4:g32"):
        kimi_jax.from_pretrained(dst, quantize="int4", progress=False)
    with pytest.raises(ValueError, match=r"classes attention, mlp, latent, lm_head\).*int8 \(classes embed"):
        kimi_jax.from_pretrained(dst, quantize="int8", quantize_include=("embed",), progress=False)


def test_verify_compares_the_packed_fields(k3_tiny_a, converted, monkeypatch):
    """--verify requantizes each source weight and compares the stored fields: a quantizer giving other scales is
    caught, naming the field and the format."""
    dst = converted["int4:g32"]
    verify_checkpoint(dst, k3_tiny_a, progress=False)  # standalone: the plan comes from the marker
    real = Q.quantizer

    def off(fmt):
        one = real(fmt)
        return lambda w: one(w)._replace(scale=one(w).scale * 2)

    monkeypatch.setattr(Q, "quantizer", off)
    with pytest.raises(VerifyError, match=r"parameter \S+\.scale differs from its source .* quantized to int4:g32"):
        verify_checkpoint(dst, k3_tiny_a, progress=False)


def test_cli_quantize_and_bad_requests(k3_tiny_a, tmp_path):
    from kimi_jax.cli import main

    dst = tmp_path / "c"
    assert main(["convert", k3_tiny_a, str(dst), "--quantize", "nf4:g32", "--quantize-include", "embed,attention",
                 "--layers", "2", "--no-progress"]) == 0
    marker = orbax_io.read_marker(dst)
    assert marker["quantize"] == {"format": "nf4:g32", "include": ["attention", "embed"]}
    model = kimi_jax.from_pretrained(dst, progress=False)
    values = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert isinstance(values["embed_tokens"], quant.NF4Weight)
    assert not packed.is_packed(values["layers.0.mlp.gate_proj"])
    for args, why in ((["--quantize", "int5"], "unknown weight format"),
                      (["--quantize", "int8", "--quantize-include", "router"], "unknown module classes"),
                      (["--quantize-include", "mlp"], "needs --quantize"),
                      (["--quantize", "int4:g48"], "not a multiple of the group 48")):
        bad = tmp_path / "bad"
        with pytest.raises(ConvertError, match=why):
            convert_checkpoint(k3_tiny_a, bad, progress=False, quantize=args[1] if args[0] == "--quantize" else None,
                               quantize_include=(args[-1].split(",") if "--quantize-include" in args else None))
        assert main(["convert", k3_tiny_a, str(bad), *args, "--no-progress"]) == 2
        assert not bad.exists(), "a refused request wrote to DST"


def test_float_experts_quantized_on_request(tmp_path):
    """Kimi Linear's float expert stacks ([E, out, in], one leaf) are quantized whole, as the load-time path does."""
    from kimi_jax.checkpoint import synthetic

    src = synthetic.write_checkpoint(tmp_path / "src", "kimi_linear")
    include = ("experts", "mlp")
    convert_checkpoint(src, tmp_path / "dst", quantize="int8", quantize_include=include, verify=True, progress=False)
    want = _leaves(kimi_jax.from_pretrained(src, quantize="int8", quantize_include=include, progress=False))
    got = _leaves(kimi_jax.from_pretrained(tmp_path / "dst", progress=False))
    assert got.keys() == want.keys() and all(_same_bits(got[k], want[k]) for k in got)
    stacks = [k for k in got if k.endswith("experts.w1.q")]
    assert stacks and all(got[k].ndim == 3 for k in stacks)
    assert json.load(open(tmp_path / "dst" / orbax_io.MARKER))["quantize"]["include"] == ["mlp", "experts"]


def test_fallback_weights_stored_and_restored_as_quantized_at_load(tmp_path, caplog):
    """``--quantize int4`` of a Llama whose ``o_proj`` (64, 72) no group divides: the converter says what fell back,
    stores it int8, and the restore builds the same packed types (the plan is a function of the shapes), bit for bit
    the load-time quantization."""
    import logging

    from kimi_jax.checkpoint import synthetic

    cfg = synthetic.llama_config_dict()
    cfg.update(num_attention_heads=3, head_dim=24, num_key_value_heads=1)
    src = synthetic.write_checkpoint(tmp_path / "src", "llama", config=cfg, num_shards=1)
    with caplog.at_level(logging.WARNING, logger="kimi_jax.model.quantize"):
        convert_checkpoint(src, tmp_path / "dst", quantize="int4", progress=False)
    assert any(m.startswith("convert --quantize int4:g32: 2 of 15 weights fell back") for m in caplog.messages)
    want = _leaves(kimi_jax.from_pretrained(src, quantize="int4", progress=False))
    got = _leaves(kimi_jax.from_pretrained(tmp_path / "dst", progress=False))
    assert got.keys() == want.keys() and all(_same_bits(got[k], want[k]) for k in got)
    assert "layers.0.self_attn.o_proj.q" in got and "layers.0.self_attn.q_proj.packed" in got  # int8 / int4 fields
