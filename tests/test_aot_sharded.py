"""The tiny K3, Kimi Linear and dense GQA models, sharded, compiled by the real TPU and GPU compilers.

Each case compiles a prefill or a decode step (abstract sharded weights and cache, bf16) for a deviceless TPU v5e
2x2 or four H100s (``kimi_jax/deploy/aot.py``), with the default kernels, and asserts:

* it compiles (Mosaic refuses a kernel that GSPMD would have to partition: every kernel runs in ``shard_map``);
* the automatic choice put a Pallas kernel at every KDA / attention layer and each of the three expert matmuls of
  every MoE layer (the compiled text counts the kernel custom calls);
* (TP decode) no all-gather feeds a KDA or attention kernel: their rules split heads, so the kernels take
  their operands as the projections left them. The MLA kernel's latent cache has no head axis: it is split by
  position over ``model`` and read where it lies; only the queries (``q_lat``, ``q_pe``: heads whole inside the
  op) are gathered into it, nothing larger. The MoE up projections do receive the latent tokens gathered
  over ``model``: the expert exchange declares tokens whole-width there. On the code before the op layer this
  check fails on GPU (each MLA kernel got 5 all-gathers; TPU did not compile at all).

Meshes (data, expert, model) on 4 devices: tp 1x1x4, ep 1x4x1, dp 4x1x1, mix 1x2x2. The default set is a few
representative cases; ``-m slow`` runs every model x mesh x step x target.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from kimi_jax.checkpoint import synthetic
from kimi_jax.model import config
from kimi_jax.model.cache import MLACache, cache_shapes
from kernels_pallas._dispatch import TPU_SCAN_OPTIONS
from kimi_jax.model.run import RunConfig
from kimi_jax.deploy import aot
from kimi_jax.deploy import compile as compile_lib
from kimi_jax.parallel import sharding
from tests.hlo import gathers_into_kernels

MESHES = {"tp": (1, 1, 4), "ep": (1, 4, 1), "dp": (4, 1, 1), "mix": (1, 2, 2)}
TARGETS = {"tpu": "tpu:v5e:2x2", "gpu": "gpu:h100:1x1x4"}
MODELS = {"k3": config.tiny_k3_config_dict, "kimi_linear": synthetic.kimi_linear_config_dict,
          "llama": synthetic.llama_config_dict}
STEPS = {"prefill": 16, "decode": 1}
# CI time: K3's tp decode for GPU runs -m slow (K3 tp decode compiles for TPU here, GPU with Kimi Linear and Llama)
FAST = [("k3", "tp", "decode", "tpu"), ("k3", "mix", "prefill", "tpu"), ("kimi_linear", "ep", "decode", "tpu"),
        ("llama", "dp", "prefill", "tpu"), ("kimi_linear", "mix", "prefill", "gpu"), ("llama", "tp", "decode", "gpu")]
SLOW = [c for c in itertools.product(MODELS, MESHES, STEPS, TARGETS) if c not in FAST]
BATCH, CACHE = 8, 64


def compile_case(model, mesh, step, target, scan=False):
    """(compiled text, config, target) of one case; ``scan``: the model with scanned layers."""
    cfg = config.from_dict(MODELS[model]())
    t = aot.parse_target(TARGETS[target])
    m = aot.target_mesh(t, *MESHES[mesh])
    tokens = STEPS[step]
    graphdef, (state,), ids, cache, _ = compile_lib.step_inputs(cfg, m, batch=BATCH, tokens=tokens, context=CACHE,
                                                                scan_layers=scan)

    def run(state, ids, cache):
        out = nnx.merge(graphdef, state)(ids, cache=cache, prefix=tokens == 1)
        return out.logits, out.cache

    with jax.sharding.use_abstract_mesh(m.abstract_mesh), jax.set_mesh(m):
        compiled = jax.jit(run, donate_argnums=(2,)).lower(state, ids, cache).compile()
    return compiled.as_text(), cfg, t


def expected_kernels(cfg, layers=None) -> int:
    """One kernel per token mixer (KDA, MLA or GQA attention) and three per MoE layer (w1, w3, w2), over
    ``layers`` (default: all)."""
    layers = range(cfg.num_layers) if layers is None else layers
    return len(layers) + 3 * sum(cfg.ffn_types[i] == "moe" for i in layers)


def _check(case):
    model, mesh, step, target = case
    text, cfg, t = compile_case(*case)
    assert text.count(t.marker) == expected_kernels(cfg), f"{case}: not every op chose its Pallas kernel"
    if mesh == "tp" and step == "decode" and model != "llama":  # llama: 2 kv heads cannot split 4 ways
        fed = gathers_into_kernels(text, t.marker, sizes=True)
        assert len(fed) == expected_kernels(cfg)
        mixers = {k: v for k, v in fed.items() if not k.startswith("moe_")}
        mla = {k: v for k, v in mixers.items() if k.startswith("flash_attention")}  # these models' attention is MLA
        kda = {k: v for k, v in mixers.items() if k not in mla}
        assert kda and not any(kda.values()), f"{case}: all-gathers feed KDA kernels: {kda}"
        m = cfg.mla
        query = BATCH * m.num_heads * max(m.kv_lora_rank, m.qk_rope_dim)  # one decode token's q_lat / q_pe
        ok = all(len(v) <= 2 and all(0 < n <= query for n in v) for v in mla.values())
        assert mla and ok, f"{case}: more than the queries gathered into MLA kernels (element counts): {mla}"
        sizes = dict(zip(sharding.MESH_AXES, MESHES[mesh]))
        specs = sharding.cache_specs(cfg, cache_shapes(cfg, BATCH, CACHE, jnp.bfloat16), sizes, "tp_ep")
        mla_specs = [e.c for e in specs.layers if isinstance(e, MLACache)]
        assert mla_specs and all(c[1] == "model" for c in mla_specs), mla_specs  # the cache split by position


@pytest.mark.parametrize("case", FAST, ids=["-".join(c) for c in FAST])
def test_sharded_model_compiles_with_pallas_kernels(case):
    _check(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW, ids=["-".join(c) for c in SLOW])
def test_every_layout_compiles(case):
    _check(case)


@pytest.mark.parametrize("case", [("k3", "mix", "decode", "tpu"),
                                  pytest.param(("k3", "tp", "prefill", "gpu"), marks=pytest.mark.slow)],
                         ids=["k3-mix-decode-tpu", "k3-tp-prefill-gpu"])
def test_scanned_model_compiles_with_pallas_kernels(case):
    """Scanned layers (kimi_jax/model/layer_plan.py): the kernels of the loop body appear once, each still in shard_map."""
    text, cfg, t = compile_case(*case, scan=True)
    from kimi_jax.model.layer_plan import layer_plan

    p = layer_plan(cfg, True)
    assert p.count > 1
    body = range(p.start, p.start + p.period)
    assert text.count(t.marker) == expected_kernels(cfg, p.unrolled()) + expected_kernels(cfg, body)
    assert " while(" in text


def _carried(text: str) -> str:
    """The types of the largest while loop's carried tuple (the scanned layers' loop) in a compiled program."""
    loops = [line for line in text.splitlines() if " while(" in line]
    return max(loops, key=len).split(" = ", 1)[1].split(" while(")[0]


def test_scanned_tpu_programs_keep_the_weights_tiling():
    """XLA:TPU on TPU7x carries a scanned model's stacked bfloat16 weights through the layer loop in the T(16,128)
    tiling and copies every whole stack into it before the loop (full K3 serving decode: 14.4 GB per device), unless
    the program is compiled with the model's options (RunConfig.compiler_options, which the serving programs and
    kimi_jax.deploy.compile use): then the loop carries the T(8,128) tiling the parameters arrive in."""
    cfg = config.from_dict(MODELS["k3"]())
    m = aot.target_mesh(aot.parse_target("tpu:tpu7x:1x1x1"), 1, 1, 2)
    graphdef, (state,), ids, cache, _ = compile_lib.step_inputs(cfg, m, batch=BATCH, tokens=1, context=CACHE,
                                                                scan_layers=True)

    def run(state, ids, cache):
        out = nnx.merge(graphdef, state)(ids, cache=cache, prefix=True)
        return out.logits, out.cache

    def carried(options):
        with jax.sharding.use_abstract_mesh(m.abstract_mesh), jax.set_mesh(m):
            return _carried(jax.jit(run, donate_argnums=(2,), compiler_options=options).lower(state, ids, cache)
                            .compile().as_text())

    options = nnx.merge(graphdef, state).run.compiler_options()
    assert options == TPU_SCAN_OPTIONS
    assert "T(16,128)" in carried(None)  # the compiler's own choice: the copy this test guards against
    loop = carried(options)
    assert "bf16[" in loop and "T(16,128)" not in loop and "T(8,128)(2,1)" in loop


def test_compiler_options_only_for_scanned_tpu_models():
    m = aot.target_mesh(aot.parse_target("tpu:tpu7x:1x1x1"), 1, 1, 2)
    tpu = sharding.Parallel(m, sharding.layout("tp_ep"))
    assert RunConfig(scan_layers=True, parallel=tpu).compiler_options() == TPU_SCAN_OPTIONS
    assert RunConfig(parallel=tpu).compiler_options() is None
    assert RunConfig(scan_layers=True).compiler_options() is None  # this process's backend: XLA:CPU
    gpu = aot.target_mesh(aot.parse_target("gpu:h100:1x1x4"), 1, 1, 4)
    assert RunConfig(scan_layers=True, parallel=sharding.Parallel(gpu, sharding.layout("tp_ep"))).compiler_options() \
        is None


# -m slow for CI time (the 30-minute budget): the scanned TPU programs and the sharded Pallas compiles run in the
# default set
@pytest.mark.slow
def test_generator_programs_compile_for_tpu():
    """The public generation path's two programs (``kimi_jax.generation.generate.prefill`` and the ``while_loop`` of
    ``decode``, what ``Generator`` runs) compile for a TPU v5e 2x2 with the sharded tiny K3's abstract weights."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from kimi_jax.generation.generate import STOP_SLOTS, Sampling, decode, prefill

    cfg = config.from_dict(MODELS["k3"]())
    t = aot.parse_target(TARGETS["tpu"])
    m = aot.target_mesh(t, *MESHES["mix"])
    graphdef, (params,), ids, cache, _ = compile_lib.step_inputs(cfg, m, batch=BATCH, tokens=16, context=CACHE)
    rep = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(m, P()))
    samp = Sampling(temperature=rep((BATCH,), jnp.float32), top_k=rep((BATCH,), jnp.int32),
                        top_p=rep((BATCH,), jnp.float32), budget=rep((BATCH,), jnp.int32),
                        stop=rep((STOP_SLOTS,), jnp.int32), seed=rep((), jnp.uint32))
    lengths = jax.ShapeDtypeStruct((BATCH,), jnp.int32, sharding=NamedSharding(m, P(ids.sharding.spec[0])))
    with jax.sharding.use_abstract_mesh(m.abstract_mesh), jax.set_mesh(m):
        pre = prefill.lower(graphdef, params, cache, ids, lengths, samp, out_len=CACHE).compile()
        state = jax.eval_shape(lambda *a: prefill(*a, out_len=CACHE), graphdef, params, cache, ids, lengths, samp)
        dec = decode.lower(graphdef, params, state, samp, rep((), jnp.int32)).compile()
    assert pre.as_text().count(t.marker) == expected_kernels(cfg)
    assert dec.as_text().count(t.marker) == expected_kernels(cfg)  # one decode step inside the loop body


# -m slow (CI time): tests/test_aot_dspark.py compiles the same speculative loop with a DSpark drafter
@pytest.mark.slow
@pytest.mark.parametrize("target", ["tpu", "gpu"])
def test_speculative_loop_compiles(target):
    """``generate``'s speculative decode loop (n-gram drafting, the verify forward over k + 1 positions with the KDA
    layers in verify mode, the commit, and the plain step for when nobody drafts: one ``while_loop``) compiles for
    the sharded tiny K3 with the default kernels: both forwards keep their Pallas kernels."""
    from kimi_jax.generation.speculative import NGram

    cfg = config.from_dict(MODELS["k3"]())
    t = aot.parse_target(TARGETS[target])
    m = aot.target_mesh(t, *MESHES["mix"])
    r = compile_lib.compile_speculative(cfg, m, batch=BATCH, context=CACHE, drafter=NGram(k=3))
    assert r["pallas_calls"] >= 2 * expected_kernels(cfg), r  # the verify forward's and the plain step's
    assert r["argument"] > 0 and r["temp"] >= 0
