"""The converter against the shared K3 fixture and the HF loader: bit-exact parameters and logits, golden logits,
slicing, DST handling, and kill -9 + resume giving the same checkpoint as an uninterrupted run."""

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
from convert.converter import ConvertError, convert_checkpoint
from kimi_jax.checkpoint import orbax as orbax_io
from kimi_jax.checkpoint.safetensors import Checkpoint
from kimi_jax.model import config as config_lib
from kimi_jax.model import params
from tests.parity import assert_close

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def flat_params(model) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in params.leaves(nnx.state(model, nnx.Param)).items()}


def assert_same_params(a: dict, b: dict, what=""):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, (what, k)
        assert np.array_equal(a[k].reshape(-1).view(np.uint8), b[k].reshape(-1).view(np.uint8)), f"{what}: {k} differs"


@pytest.fixture(scope="module")
def converted_f32(k3_tiny_a, tmp_path_factory):
    dst = tmp_path_factory.mktemp("conv") / "k3_f32"
    summary = convert_checkpoint(k3_tiny_a, dst, dtype="float32", verify=True, progress=False)
    return str(dst), summary


def test_fixture_converted_equals_hf_load_and_golden(k3_tiny_a, k3_golden, converted_f32):
    dst, summary = converted_f32
    assert summary.verified and summary.tensors == 618 and summary.skipped == 0
    assert sorted(os.listdir(dst)) == ["config.json", "kimi_jax_checkpoint.json", "params"]
    hf = kimi_jax.from_pretrained(k3_tiny_a, dtype="float32")
    ob = kimi_jax.from_pretrained(dst, dtype="float32")
    assert_same_params(flat_params(hf), flat_params(ob), "float32")
    fwd = nnx.jit(lambda m, x: m(x).logits)
    ids = jnp.asarray(k3_golden["input_ids"])
    a, b = np.asarray(fwd(hf, ids)), np.asarray(fwd(ob, ids))
    assert np.array_equal(a, b), "logits of the converted checkpoint must be bit-identical to the HF load"
    err = assert_close(b, k3_golden["logits_prefill"], 2e-4, "converted logits vs golden")
    print(f"converted fixture: logits bit-identical to HF load; max |logits - golden| = {err:.3g}")


def test_bfloat16_conversion_keeps_mxfp4_packed(k3_tiny_a, tmp_path):
    dst = tmp_path / "k3_bf16"
    convert_checkpoint(k3_tiny_a, dst, progress=False)
    hf = flat_params(kimi_jax.from_pretrained(k3_tiny_a, dtype="bfloat16"))
    assert_same_params(hf, flat_params(kimi_jax.from_pretrained(dst, dtype="bfloat16")), "bfloat16")
    stored = orbax_io.stored(dst)
    ck = Checkpoint(k3_tiny_a)
    src_u8 = sum(i.nbytes for i in ck.tensors.values() if i.dtype == "U8")
    out_u8 = sum(int(np.prod(s.shape)) for s in stored.values() if s.dtype == np.uint8)
    assert out_u8 == src_u8, "expert bytes on disk must equal the source's packed bytes"
    assert stored["layers.1.mlp.experts.w1.packed"].shape == (8, 64, 32)
    assert stored["layers.1.mlp.experts.w2.scale"].shape == (8, 64, 2)
    # a bf16 checkpoint restores exactly into a float32 model (cast on read)
    f32 = flat_params(kimi_jax.from_pretrained(dst, dtype="float32"))
    for k, v in hf.items():
        np.testing.assert_array_equal(f32[k], v.astype(f32[k].dtype), err_msg=k)


def test_slicing_layers_and_experts(k3_tiny_a, tmp_path):
    dst = tmp_path / "sliced"
    convert_checkpoint(k3_tiny_a, dst, dtype="float32", layers=5, experts=4, verify=True, progress=False)
    full_cfg = config_lib.load(k3_tiny_a)
    cfg = config_lib.load(dst)
    assert cfg == full_cfg.sliced(5, 4)
    raw = json.load(open(dst / "config.json"))["text_config"]
    assert raw["num_hidden_layers"] == 5 and raw["num_experts"] == 4
    assert raw["linear_attn_config"]["kda_layers"] == [1, 2, 3, 5] and raw["linear_attn_config"]["full_attn_layers"] == [4]
    full = flat_params(kimi_jax.from_pretrained(k3_tiny_a, dtype="float32"))
    model = kimi_jax.from_pretrained(dst, dtype="float32")
    for k, v in flat_params(model).items():
        want = full[k]
        if ".experts." in k or k.endswith(("mlp.gate", "mlp.e_score_correction_bias")):
            want = want[:4]
        np.testing.assert_array_equal(v, want, err_msg=k)
    logits = np.asarray(model(jnp.ones((1, 4), jnp.int32)).logits)
    assert np.isfinite(logits).all()


def test_dst_rules(k3_tiny_a, converted_f32, tmp_path):
    dst, _ = converted_f32
    with pytest.raises(ConvertError, match="already holds a complete"):
        convert_checkpoint(k3_tiny_a, dst, dtype="float32", progress=False)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ConvertError, match="not empty; pass --overwrite"):
        convert_checkpoint(k3_tiny_a, other, progress=False)
    assert (other / "notes.txt").read_text() == "mine"
    convert_checkpoint(k3_tiny_a, other, progress=False, overwrite=True, layers=2)
    assert not (other / "notes.txt").exists() and config_lib.load(other).num_layers == 2
    with pytest.raises(ConvertError, match="SRC or contains it"):
        convert_checkpoint(k3_tiny_a, k3_tiny_a, overwrite=True, progress=False)
    with pytest.raises(ConvertError, match="already a kimi-jax"):
        convert_checkpoint(dst, tmp_path / "again", progress=False)


def test_cli_convert(k3_tiny_a, tmp_path):
    import convert
    from kimi_jax.cli import main

    assert convert.convert_checkpoint is convert_checkpoint

    assert main(["convert", k3_tiny_a, str(tmp_path / "c"), "--layers", "2", "--experts", "2", "--no-progress"]) == 0
    assert os.path.exists(tmp_path / "c" / orbax_io.MARKER)
    assert main(["convert", k3_tiny_a, str(tmp_path / "c"), "--no-progress"]) == 2  # exists: one-line error


KILLER = """
import os, signal, sys
from convert.converter import convert_checkpoint
event, at = sys.argv[3], int(sys.argv[4])
def hook(name, n):
    if name == event and n == at:
        os.kill(os.getpid(), signal.SIGKILL)
convert_checkpoint(sys.argv[1], sys.argv[2], dtype="float32", progress=False, batch_bytes=200_000,
                   sync_bytes=int(sys.argv[5]) if len(sys.argv) > 5 else 4 << 30, on_event=hook)
raise SystemExit("the hook should have killed this process")
"""


@pytest.mark.parametrize("event,at", [("saved", 4), ("finalize", 0), ("marker", 0)])
def test_kill_and_resume(k3_tiny_a, converted_f32, tmp_path, event, at):
    """SIGKILL the converter (after 4 partial saves / before finalizing / before the marker), check the directory is
    refused, rerun: the result equals the uninterrupted conversion bit for bit."""
    dst = tmp_path / "killed"
    r = subprocess.run([sys.executable, "-c", KILLER, k3_tiny_a, str(dst), event, str(at)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == -9, r.stderr[-2000:]
    assert not os.path.exists(dst / orbax_io.MARKER)
    with pytest.raises(orbax_io.IncompleteCheckpointError, match="incomplete kimi-jax checkpoint.*resume"):
        kimi_jax.from_pretrained(dst)
    summary = convert_checkpoint(k3_tiny_a, dst, dtype="float32", progress=False, batch_bytes=200_000)
    if event == "saved":
        assert 0 < summary.skipped < 282 and summary.params == 282 - summary.skipped
    else:
        assert summary.skipped == 282 and summary.params == 0
    assert sorted(os.listdir(dst)) == ["config.json", "kimi_jax_checkpoint.json", "params"]
    assert_equals_reference(dst, converted_f32)


def assert_equals_reference(dst, converted_f32):
    ref_dst, _ = converted_f32
    full = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in orbax_io.stored(ref_dst).items()}
    assert orbax_io.stored(dst).keys() == full.keys()
    a, b = orbax_io.restore(ref_dst, full), orbax_io.restore(dst, full)
    assert_same_params({k: np.asarray(v) for k, v in a.items()}, {k: np.asarray(v) for k, v in b.items()}, "resumed")


@pytest.mark.parametrize("rebooted", [False, True])
def test_resume_trusts_unsynced_saves_only_within_the_same_boot(k3_tiny_a, converted_f32, tmp_path, rebooted):
    """Partial saves are not fsynced one by one; the filesystem is synced every `sync_bytes` and the state file
    records which saves are durable. Killed after 7 saves with syncs along the way: resumed in the same boot every
    committed save is kept (the page cache still holds them); after a restart (another boot id in the state file)
    only the saves recorded as durable are kept and the rest are redone. Both give the uninterrupted result."""
    dst = tmp_path / "killed"
    r = subprocess.run([sys.executable, "-c", KILLER, k3_tiny_a, str(dst), "saved", "7", "700000"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == -9, r.stderr[-2000:]
    with open(dst / orbax_io.STATE) as f:
        state = json.load(f)
    saves = orbax_io.committed_saves(dst)
    assert state["boot_id"] == orbax_io.boot_id() and len(saves) == 7
    durable = set(state["durable"])
    committed_ids = [i for _, ids, _ in saves for i in ids]
    assert 0 < len(durable) < 7 and durable < set(committed_ids)
    kept = saves
    if rebooted:
        state["boot_id"] = "another-boot"
        with open(dst / orbax_io.STATE, "w") as f:
            json.dump(state, f)
        kept = [s for s in saves if set(s[1]) <= durable]
    summary = convert_checkpoint(k3_tiny_a, dst, dtype="float32", progress=False, batch_bytes=200_000)
    assert summary.skipped == sum(len(paths) for _, _, paths in kept) and summary.params == 282 - summary.skipped
    assert_equals_reference(dst, converted_f32)


def test_failed_sync_is_an_error_and_its_saves_are_redone(k3_tiny_a, converted_f32, tmp_path, monkeypatch):
    """A write error reported by the sync stops the conversion with a clear error; the rerun does not trust the saves
    made since the last successful sync."""
    dst = tmp_path / "eio"
    calls = []

    def failing_sync(path):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(5, "Input/output error", path)

    monkeypatch.setattr(orbax_io, "sync_filesystem", failing_sync)
    with pytest.raises(ConvertError, match="writing the converted data to disk failed.*Input/output error.*rerun"):
        convert_checkpoint(k3_tiny_a, dst, dtype="float32", progress=False, batch_bytes=200_000, sync_bytes=700_000)
    monkeypatch.undo()
    with open(dst / orbax_io.STATE) as f:
        state = json.load(f)
    assert state["boot_id"] == "sync-failed" and state["durable"]
    durable = set(state["durable"])
    kept = [s for s in orbax_io.committed_saves(dst) if set(s[1]) <= durable]
    assert len(kept) < len(orbax_io.committed_saves(dst))
    summary = convert_checkpoint(k3_tiny_a, dst, dtype="float32", progress=False, batch_bytes=200_000)
    assert summary.skipped == sum(len(paths) for _, _, paths in kept)
    assert_equals_reference(dst, converted_f32)


def _resident_bytes(path) -> int:
    """Bytes of ``path`` in the page cache (mincore over a read-only shared mapping, which reads nothing in)."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    if size == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        try:
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec) * mmap.PAGESIZE


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="posix_fadvise is Linux/Unix only")
def test_synced_saves_leave_the_page_cache(k3_tiny_a, converted_f32, tmp_path, monkeypatch):
    """After each sync the synced partial saves are dropped from the page cache: a conversion does not read its
    output back. Checked on the files themselves (mincore), with the drops counted, and the result unchanged."""
    dst = tmp_path / "drop"
    advised = []
    real = orbax_io.drop_cached
    monkeypatch.setattr(orbax_io, "drop_cached", lambda d, seen: advised.append(real(d, seen)) or advised[-1])
    hook = {}

    def on_event(name, n):
        if name == "finalize":  # every save synced and dropped; nothing finalized yet
            files = [os.path.join(r, f) for r, _, fs in os.walk(dst / orbax_io.PARTIAL) for f in fs]
            hook["resident"] = sum(_resident_bytes(f) for f in files)
            hook["total"] = sum(os.path.getsize(f) for f in files)

    convert_checkpoint(k3_tiny_a, dst, dtype="float32", progress=False, batch_bytes=200_000, sync_bytes=700_000,
                       on_event=on_event)
    assert len(advised) >= 3 and all(a > 0 for a in advised)  # each sync dropped the saves made since the last
    assert sum(advised) >= hook["total"] * 0.9
    assert hook["resident"] < hook["total"] * 0.1, hook
    assert_equals_reference(dst, converted_f32)


def test_saves_are_unsynced_only_inside_the_block():
    """The TensorStore context Orbax builds has file_io_sync off only while an unsynced save runs."""
    from orbax.checkpoint._src.serialization import tensorstore_utils as tsu

    def sync_setting():
        return tsu.get_ts_context(use_ocdbt=True).spec.to_json().get("file_io_sync", True)

    assert sync_setting() is True
    with orbax_io._unsynced_writes() as active:
        assert active and sync_setting() is False
    assert sync_setting() is True


def test_resume_with_other_options_is_refused(k3_tiny_a, tmp_path):
    dst = tmp_path / "k"
    r = subprocess.run([sys.executable, "-c", KILLER, k3_tiny_a, str(dst), "saved", "2"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == -9, r.stderr[-2000:]
    with pytest.raises(ConvertError, match="unfinished conversion with other settings.*dtype"):
        convert_checkpoint(k3_tiny_a, dst, dtype="bfloat16", progress=False)
    convert_checkpoint(k3_tiny_a, dst, dtype="bfloat16", progress=False, overwrite=True)
    assert orbax_io.read_marker(dst)["dtype"] == "bfloat16"


def test_verify_detects_a_different_source(k3_tiny_a, converted_f32, tmp_path):
    """--verify is a real comparison: the converted fixture verifies against the fixture, and fails naming the
    parameter against a checkpoint with the same layout and other values."""
    from convert.converter import VerifyError, verify_checkpoint
    from kimi_jax.checkpoint import synthetic

    dst, _ = converted_f32
    verify_checkpoint(dst, k3_tiny_a, progress=False)
    other = synthetic.write_checkpoint(tmp_path / "other", "k3", config=json.load(open(os.path.join(k3_tiny_a, "config.json"))))
    with pytest.raises(VerifyError, match=r"parameter \S+ differs from its source \['language_model\."):
        verify_checkpoint(dst, other, progress=False)


def test_tokenizer_and_generation_files_are_copied(tmp_path):
    from kimi_jax.checkpoint import synthetic

    src = synthetic.write_checkpoint(tmp_path / "src", "k3", num_shards=3)
    files = {"tiktoken.model": b"IQ== 0\n", "tokenizer_config.json": b'{"bos_token": "[BOS]"}',
             "generation_config.json": b'{"max_new_tokens": 8}'}
    for name, data in files.items():
        (tmp_path / "src" / name).write_bytes(data)
    (tmp_path / "src" / "modeling_kimi_k3.py").write_text("raise SystemExit  # remote code is not copied")
    dst = tmp_path / "dst"
    convert_checkpoint(src, dst, layers=2, progress=False)
    for name, data in files.items():
        assert (dst / name).read_bytes() == data, name
    assert not (dst / "modeling_kimi_k3.py").exists()
    out, full = config_lib.load(dst), config_lib.load(src)
    assert (out.num_layers, out.attn_types, out.ffn_types) == (2, ("kda", "kda"), ("dense", "moe"))
    assert (out.kda, out.moe, out.mlp, out.attn_res_block_size) == (full.kda, full.moe, full.mlp, full.attn_res_block_size)


MESH = """
import sys
import numpy as np
from flax import nnx
import kimi_jax
from kimi_jax.model import params
from kimi_jax.parallel.sharding import make_mesh
dst, src = sys.argv[1], sys.argv[2]
mesh = make_mesh(expert=2, model=2)
flat = lambda m: params.leaves(nnx.state(m, nnx.Param))
conv = flat(kimi_jax.from_pretrained(dst, dtype="float32", mesh=mesh))
hf = flat(kimi_jax.from_pretrained(src, dtype="float32", mesh=mesh))
assert conv.keys() == hf.keys()
for k in conv:
    assert conv[k].sharding == hf[k].sharding, (k, conv[k].sharding, hf[k].sharding)
    assert np.array_equal(np.asarray(conv[k]), np.asarray(hf[k])), k
w = conv["layers.1.mlp.experts.w1.packed"]
assert len(w.sharding.device_set) == 4, w.sharding
print("ok", w.sharding.spec)
"""


def test_sharded_restore_on_a_mesh(k3_tiny_a, converted_f32):
    """from_pretrained(DST, mesh=...) reads the converted checkpoint straight into the layout's shardings (4 fake CPU
    devices): every parameter has the same sharding and value as in the sharded HF load."""
    dst, _ = converted_f32
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    r = subprocess.run([sys.executable, "-c", MESH, dst, k3_tiny_a], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
