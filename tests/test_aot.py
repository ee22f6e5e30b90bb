"""The real TPU and NVIDIA GPU compilers, run deviceless on this CPU machine (kimi_jax/deploy/aot.py).

Each kernel is *compiled* (libtpu: Mosaic layout passes and VMEM budget; XLA:GPU: Triton -> PTX -> cubin) at full
K3, Kimi-Linear and dense-GQA shapes with the automatic choice, and the compiled text must hold the Pallas custom
call, so the kernel and not the reference was compiled. The default set compiles every kernel for one TPU and one
GPU and a few kernels for the other chips; the full sweep is ``-m slow``. Then ``kimi-jax plan --compile``: a
sliced full-width K3 on one device of each kind, sharded with the reference kernels, and its clear errors.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kimi_jax import cli
from kimi_jax.deploy import aot
from tests.test_kernels_lowering import KERNELS

S = jax.ShapeDtypeStruct
BF, F32, I32, U8 = jnp.bfloat16, jnp.float32, jnp.int32, jnp.uint8

# One device of each chip (TPU7x's smallest topology has 2 devices: one chip, two TensorCores).
TARGETS = {"v5e": "tpu:v5e:1x1", "v6e": "tpu:v6e:1x1", "v5p": "tpu:v5p:1x1x1", "tpu7x": "tpu:tpu7x:1x1x1",
           "h100": "gpu:h100:1x1x1", "h200": "gpu:h200:1x1x1", "b200": "gpu:b200:1x1x1"}


def _entry(name):
    return KERNELS[name][0]


def _mla_decode(B, H, S_):  # absorbed MLA decode: latent 512 + rope 64 per cached token
    return _entry("mla_decode"), (S((B, 1, H, 512), F32), S((B, 1, H, 64), BF), S((B, S_, 512), BF),
                                  S((B, S_, 64), BF), S((B, 1), I32))


def _mla_prefill(T, H):  # nope 128 + rope 64 keys, v 128
    return _entry("mla_prefill"), (S((1, T, H, 128), BF), S((1, T, H, 128), BF), S((1, T, H, 128), BF),
                                   S((1, T), I32), S((1, T, H, 64), BF), S((1, T, 64), BF))


def _kda(name, B, T, H):  # KDA head dim 128; the state stays float32
    return _entry(name), (S((B, T, H, 128), F32), S((B, T, H, 128), F32), S((B, T, H, 128), BF),
                          S((B, T, H, 128), F32), S((B, T, H), F32), S((B, H, 128, 128), F32))


def _gqa(B, T, S_, H, KV):
    return _entry("gqa_prefill"), (S((B, T, H, 128), BF), S((B, S_, KV, 128), BF), S((B, S_, KV, 128), BF),
                                   S((B, T), I32))


def _gmm_mxfp4(M, E, N, K):
    return _entry("gmm_mxfp4"), (S((M, K), BF), S((E, N, K // 2), U8), S((E, N, K // 32), U8), S((E,), I32))


def _gather_mxfp4(B, X, E, N, K):
    return _entry("gather_mxfp4"), (S((B, X, K), BF), S((E, N, K // 2), U8), S((E, N, K // 32), U8),
                                    S((B, X), I32))


def _gather_bf16(B, X, E, N, K):
    from kernels_pallas import moe_gmm

    return (lambda x, w, i: moe_gmm.gather_matmul(x, w, i)), (S((B, X, K), BF), S((E, N, K), BF), S((B, X), I32))


# Full-size shapes of one device's share: K3 (96 heads, latent MoE 3584 -> 3072, MXFP4, 16 of 896 experts per
# token), Kimi Linear 48B (32 heads, experts 2304 -> 1024 in bf16), dense GQA (32 query on 8 kv heads). Prefill
# chunks of 2048 tokens, decode at batch 8 over a 128K (K3, Linear) / 32K (dense) cache; 32 local experts.
FULL = {
    "k3_mla_decode": _mla_decode(8, 96, 131072),
    "k3_mla_prefill": _mla_prefill(2048, 96),
    "k3_kda_prefill": _kda("kda_prefill", 1, 2048, 96),
    "k3_kda_decode": _kda("kda_decode", 8, 1, 96),
    "k3_gmm_up": _gmm_mxfp4(2048 * 16, 32, 3072, 3584),
    "k3_gmm_down": _gmm_mxfp4(2048 * 16, 32, 3584, 3072),
    "k3_gather_up": _gather_mxfp4(8, 16, 32, 3072, 3584),
    "k3_gather_down": _gather_mxfp4(8, 16, 32, 3584, 3072),
    "linear_mla_decode": _mla_decode(8, 32, 131072),
    "linear_kda_prefill": _kda("kda_prefill", 1, 2048, 32),
    "linear_gmm_up": (_entry("gmm_bf16"), (S((2048 * 8, 2304), BF), S((32, 1024, 2304), BF), S((32,), I32))),
    "linear_gmm_down": (_entry("gmm_bf16"), (S((2048 * 8, 1024), BF), S((32, 2304, 1024), BF), S((32,), I32))),
    "linear_gather_down": _gather_bf16(8, 8, 32, 2304, 1024),
    "dense_gqa_prefill": _gqa(1, 2048, 2048, 32, 8),
    "dense_gqa_decode": _gqa(8, 1, 32768, 32, 8),
}
ALL = {**{f"small_{k}": v for k, v in KERNELS.items()}, **FULL}
# Outside the two fully compiled targets, the default set takes the largest kernel of each family that differs most
# between chips: MLA decode over a 128K cache on every chip, the MXFP4 grouped matmul (VMEM / shared memory per tile)
# on the newest TPU too (v5p and v6e: -m slow, 11 s each).
FEW = {"k3_mla_decode": tuple(TARGETS), "k3_gmm_up": ("tpu7x",)}


def _cases():
    for chip, target in TARGETS.items():
        for name in ALL:
            fast = chip in ("v5e", "h200") or chip in FEW.get(name, ())
            yield pytest.param(target, name, id=f"{chip}-{name}", marks=() if fast else pytest.mark.slow)


def _compile_kernel(target_text, f, args):
    """Compiled text of ``f`` on one device of the target, traced under that device's mesh."""
    target = aot.parse_target(target_text)
    mesh = Mesh(aot.device_array(target, (1,)), ("x",))
    args = [S(a.shape, a.dtype, sharding=NamedSharding(mesh, PartitionSpec())) for a in args]
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), jax.set_mesh(mesh):
        return target, jax.jit(f).lower(*args).compile().as_text()


@pytest.mark.parametrize("target,name", list(_cases()))
def test_kernel_compiles(target, name):
    f, args = ALL[name]
    t, text = _compile_kernel(target, f, args)
    assert t.marker in text, f"{name}: no Pallas kernel ({t.marker}) in the program compiled for {target}"


# -- targets -----------------------------------------------------------------------------------------------


def test_parse_target():
    t = aot.parse_target("tpu:v5p:4x4x4")
    assert (t.platform, t.chip, t.topology) == ("tpu", "v5p", "v5p:4x4x4")
    t = aot.parse_target("gpu:h200:1x2x8")
    assert (t.platform, t.chip, t.topology, t.marker) == ("gpu", "h200", "1x2x8", "__gpu$xla.gpu.triton")
    for bad, match in [("tpu:v9:2x2", "CHIP one of"), ("tpu:v5e", "CHIP one of"), ("gpu:a100:1x1x8", "NAME one of"),
                       ("gpu:h200:8", "SLICESxHOSTSxGPUS"), ("h200", "tpu:TOPOLOGY")]:
        with pytest.raises(aot.TargetError, match=match):
            aot.parse_target(bad)


def test_target_devices_mesh_and_hbm():
    t = aot.parse_target("tpu:v5e:2x2")
    mesh = aot.target_mesh(t, expert=2, model=2)
    assert dict(mesh.shape) == {"data": 1, "expert": 2, "model": 2}
    assert mesh.devices.flat[0].platform == "tpu"
    with pytest.raises(aot.TargetError, match="= 2 devices, but target 'tpu:v5e:2x2' has 4"):
        aot.target_mesh(t, expert=2)
    assert len(aot.target_devices(aot.parse_target("tpu:tpu7x:1x1x1"))) == 2  # two TensorCores per chip
    assert aot.hbm_bytes(t) == 16 * 2**30
    h200 = aot.parse_target("gpu:h200:1x2x8")
    assert len(aot.target_devices(h200)) == 16
    assert aot.hbm_bytes(h200) == 151397597184  # the target config's device_memory_size (141 GiB)
    with pytest.raises(aot.TargetError, match="refused the topology"):
        aot.target_devices(aot.parse_target("tpu:v5e:3x7"))
    # model=8 on a 4x4x4 torus spans two physical axes (jax.make_mesh alone refuses it)
    v5p = aot.target_mesh(aot.parse_target("tpu:v5p:4x4x4"), expert=8, model=8)
    assert v5p.devices.shape == (1, 8, 8) and len({d.id for d in v5p.devices.flat}) == 64


# -- kimi-jax plan --compile -------------------------------------------------------------------------------

# A full-width K3 slice: layer 0 (KDA + dense MLP) and layer 1 (KDA + 16 MXFP4 experts). Small batch and cache
# keep the compile short; the weights are full size (8.6 GB on one device).
SLICE = ["--layers", "2", "--experts", "16", "--batch", "2", "--context", "1024", "--prefill-chunk", "16"]


def _plan(capsys, *argv):
    rc = cli.main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _kernel_calls(out):
    """Pallas kernel calls per compiled program, as printed."""
    return [int(line.split(" Pallas kernel calls")[0].rsplit(" ", 1)[-1]) for line in out.splitlines()
            if " Pallas kernel calls" in line]


def _ratios(out):
    """plan/compiler ratios of the 'arguments' rows, one per compiled program."""
    return [float(line.split()[-1]) for line in out.splitlines() if line.strip().startswith("arguments (")]


# -m slow (33 s and 25 s on 2 cores): test_plan_compile_sharded_pallas and the tiny families' plan compiles
# (tests/test_aot_plan_families.py) run the same planner and compiler path in the default set
@pytest.mark.parametrize("target", [pytest.param("tpu:v5e:1x1", marks=pytest.mark.slow),
                                    pytest.param("gpu:h200:1x1x1", marks=pytest.mark.slow)])
def test_plan_compile_one_device(capsys, target):
    rc, out, err = _plan(capsys, "--compile", target, "--mesh", "data=1", *SLICE)
    assert rc == 0, out + err
    assert f"compiled for {target}" in out
    assert out.count("compiled in") == 2 and out.count(", fits (") == 2  # decode step and prefill chunk
    # the automatic choice compiled Pallas kernels: 2 KDA layers, one of them with 16 MXFP4 experts
    assert all(n >= 2 for n in _kernel_calls(out)) and len(_kernel_calls(out)) == 2, out
    # parameters and cache: the plan and the compiler count the same bytes
    assert all(abs(r - 1) < 0.01 for r in _ratios(out)) and len(_ratios(out)) == 2, out


@pytest.mark.slow
def test_plan_compile_sharded_reference(capsys):
    """Experts split 4 ways over a v5e 2x2 with the jnp kernels; the decode step only (the prefill chunk is
    compiled by the other plan tests)."""
    rc, out, err = _plan(capsys, "--compile", "tpu:v5e:2x2", "--mesh", "expert=4", "--kernels", "reference",
                         *SLICE[:-1], "0")
    assert rc == 0, out + err
    assert out.count("compiled in") == 1 and all(abs(r - 1) < 0.01 for r in _ratios(out)), out
    assert _kernel_calls(out) == [0], out  # --kernels reference: no Pallas kernel anywhere


def test_plan_compile_sharded_pallas(capsys):
    """The default (Pallas) kernels on a sharded TPU mesh: every kernel op runs inside shard_map on its shard
    (kernels_pallas/_dispatch.py), which Mosaic requires."""
    rc, out, err = _plan(capsys, "--compile", "tpu:v5e:2x2", "--mesh", "expert=2,model=2", *SLICE)
    assert rc == 0, out + err
    assert out.count("compiled in") == 2 and all(n >= 2 for n in _kernel_calls(out)), out


def test_plan_compile_does_not_fit(capsys):
    """1024 sequences of K3 KDA state (2 layers x 6.4 GB) beside 8.6 GB of weights: not on a 16 GiB v5e. The
    compiler's own out-of-memory (or a peak above HBM) is "does not fit", exit status 1, not a crash."""
    rc, out, err = _plan(capsys, "--compile", "tpu:v5e:1x1", "--mesh", "data=1", "--layers", "2", "--experts", "16",
                         "--batch", "1024", "--context", "1024", "--prefill-chunk", "0")
    assert rc == 1, out + err
    assert "decode step ([1024, 1] ids): does NOT fit" in out or ", does NOT fit (" in out, out
    assert "prefill chunk" not in out  # --prefill-chunk 0: the decode step only


@pytest.mark.parametrize("argv,message", [
    (["--compile", "tpu:v9:2x2"], "expected tpu:CHIP"),
    (["--compile", "gpu:h200"], "expected gpu:NAME:SLICESxHOSTSxGPUS"),
    (["--compile", "tpu:v5e:2x2", "--mesh", "expert=8"], "= 8 devices, but target 'tpu:v5e:2x2' has 4"),
    (["--compile", "gpu:h200:1x2x8", "--mesh", "expert=2,model=4"], "= 8 devices, but target 'gpu:h200:1x2x8' has 16"),
    (["--speculative", "ngram"], "--speculative compiles the speculative programs for a target: it needs --compile"),
    (["--compile", "tpu:v5e:2x2", "--speculative", "ngram:k=0"], "ngram k=0"),
], ids=["tpu-chip", "gpu-form", "tpu-mesh", "gpu-mesh", "spec-no-compile", "spec-bad"])
def test_plan_compile_errors(capsys, argv, message):
    rc, out, err = _plan(capsys, *argv)
    assert rc == 2 and message in err and "Traceback" not in err, err
    assert out == ""  # fails before printing a plan


@pytest.mark.parametrize("target,module", [("tpu:v5e:4x4", "libtpu"), ("gpu:b200:1x1x4", "nvidia.cuda_nvcc"),
                                           ("gpu:b200:1x1x4", "jax_plugins.xla_cuda12")])
def test_plan_compile_names_the_missing_extra(capsys, monkeypatch, target, module):
    find_spec = aot.importlib.util.find_spec
    monkeypatch.setattr(aot.importlib.util, "find_spec", lambda name, *a: None if name == module else find_spec(name, *a))
    aot.target_devices.cache_clear()
    aot.gpu_target_config.cache_clear()
    try:
        rc, out, err = _plan(capsys, "--compile", target, "--mesh", "data=1")
    finally:
        aot.target_devices.cache_clear()
        aot.gpu_target_config.cache_clear()
    assert rc == 2 and 'pip install "kimi-jax[aot]"' in err and module in err, err
