"""A DSpark drafter in the deviceless compiles and the plan (issue 37): ``kimi-jax plan --compile TARGET
--speculative dspark:PATH`` where PATH holds only the drafter's ``config.json``.

The tiny K3 fixture's first 3 layers (a dense layer, KDA and MLA mixers, MXFP4 experts) as the target, a tiny
drafter tapping its layers 0 and 2, compiled for a TPU v5e 2x2 with the model axis over its 4 chips (the drafter's
weights split by their logical axes, its context cache by position, as the target's latent cache): the speculative
loop (the drafter's block, the verify
forward returning the tapped hidden states, the drafter's context written from them) holds the target's Pallas
kernels in both forwards, and its arguments exceed the decode step's by the drafter's weights and context cache
that the plan counts (plus the loop's token history). The CLI's four programs (with the tapped prefill chunk, which
takes every drafter weight though it reads only the context projections) are ``-m slow``.
"""

from __future__ import annotations

import json
import math

import jax
import pytest
from flax import nnx

from kimi_jax.deploy import aot
from kimi_jax.deploy import compile as compile_lib
from kimi_jax.deploy.plan import drafter_bytes, make_plan, tpu_loop_expert_copies
from kimi_jax.generation import speculative
from kimi_jax.model import config, params
from tests import dspark_oracle as oracle
from tests.test_aot import _kernel_calls, _plan, _ratios
from tests.test_aot_sharded import expected_kernels

BATCH, CONTEXT, LAYERS = 2, 64, 3


def _drafter_dir(tmp_path, cfg, **overrides):
    keys = dict(hidden_size=cfg.hidden_size, target_hidden_size=cfg.hidden_size, target_layer_ids=[0, LAYERS - 1],
                num_target_layers=2, block_size=3)
    d = oracle.tiny_config(cfg.vocab_size, **{**keys, **overrides})
    path = tmp_path / "drafter"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(d))  # no weights: the plan needs none
    return str(path)


def _nbytes(tree) -> int:
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _shard_bytes(tree) -> int:
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def test_dspark_loop_compiles_and_the_plan_counts_the_drafter(tmp_path, k3_tiny_a):
    cfg = config.load(k3_tiny_a).sliced(LAYERS)
    drafter = speculative.parse(f"dspark:{_drafter_dir(tmp_path, cfg)},k=3", dtype="bfloat16", weights=False)
    weights = params.leaves(nnx.state(drafter.model, nnx.Param))
    assert all(isinstance(v, jax.ShapeDtypeStruct) for v in weights.values())  # abstract: no weights read
    sizes = {"model": 4}
    m = aot.target_mesh(aot.parse_target("tpu:v5e:2x2"), 1, 1, 4)
    plan = make_plan(cfg, sizes, batch=BATCH, context=CONTEXT, drafter=drafter.model.cfg)
    _, _, dparams, dcache = compile_lib.drafter_inputs(drafter, m, batch=BATCH, context=CONTEXT)
    # the plan counts exactly the weights and the DraftCache the compiled loop takes, per chip
    assert plan.drafter == drafter_bytes(drafter.model.cfg, BATCH, CONTEXT, "bfloat16", sizes)
    assert plan.drafter["weights"] == _shard_bytes(dparams) > 0
    assert plan.drafter["context cache"] == _shard_bytes(dcache) == _nbytes(dcache) // 4
    assert dcache.c.shape == (2, BATCH, CONTEXT, 32) and dcache.kpe.shape == (2, BATCH, CONTEXT, 8)
    assert dcache.c.sharding.shard_shape(dcache.c.shape) == (2, BATCH, CONTEXT // 4, 32)  # positions over model
    o_proj = params.leaves(dparams)["layers.0.self_attn.o_proj"]
    assert o_proj.sharding.shard_shape(o_proj.shape) == (cfg.hidden_size, 4 * 16 // 4)  # its 4 heads over model
    # what is split: all but the norms and the two down projections of the q and kv latents
    assert 3 * plan.drafter["weights"] < _nbytes(dparams)
    assert plan.total == plan.param_total + plan.cache_total + plan.drafter_total + plan.activation_total

    spec = compile_lib.compile_speculative(cfg, m, batch=BATCH, context=CONTEXT, drafter=drafter)
    dec = compile_lib.compile_step(cfg, m, batch=BATCH, context=CONTEXT)
    assert spec["pallas_calls"] >= 2 * expected_kernels(cfg), spec  # the verify forward's and the plain step's
    history = BATCH * 3 * CONTEXT * 4  # the loop's output and token history (int32)
    extra = spec["argument"] - dec["argument"]
    # the drafter's arguments at least; the compiler pads small arrays to its tiles (a [64, 4] shard of a tiny
    # drafter's weight to [64, 128]), but the whole lies below its weights' replicated bytes alone (x4 split)
    assert plan.drafter_total + history <= extra < min(1.5 * (plan.drafter_total + history), _nbytes(dparams)), (
        extra, plan.drafter, _nbytes(dparams))


def test_dspark_for_another_target_is_refused_by_name(capsys, tmp_path, k3_tiny_a):
    cfg = config.load(k3_tiny_a)
    path = _drafter_dir(tmp_path, cfg, target_layer_ids=[0, 40])
    rc, out, err = _plan(capsys, "--model", k3_tiny_a, "--compile", "tpu:v5e:1x1", "--mesh", "data=1",
                         "--speculative", f"dspark:{path}")
    assert rc == 2 and "target_layer_ids [40]" in err and out == "", err


@pytest.mark.slow
def test_plan_compile_dspark_cli(capsys, tmp_path, k3_tiny_a):
    """The CLI as a user runs it: the decode step, a fresh prefill chunk, the speculative loop and the prefill chunk
    that writes the drafter's context, each fitting with its Pallas kernels; the plan prints the drafter's bytes."""
    cfg = config.load(k3_tiny_a).sliced(LAYERS)
    path = _drafter_dir(tmp_path, cfg)
    rc, out, err = _plan(capsys, "--model", k3_tiny_a, "--layers", str(LAYERS), "--compile", "tpu:v5e:1x1", "--mesh",
                         "data=1", "--batch", str(BATCH), "--context", str(CONTEXT), "--prefill-chunk", "16",
                         "--speculative", f"dspark:{path},k=3")
    assert rc == 0, out + err
    assert "drafter weights" in out and "drafter context cache" in out, out
    assert out.count("compiled in") == 4 and out.count(", fits (") == 4, out
    assert "prefill chunk writing the drafter's context" in out, out
    assert all(n >= expected_kernels(cfg) for n in _kernel_calls(out)), out
    assert len(_ratios(out)) == 4, out
    # the tapped chunk reads only the drafter's context projections, but takes (keeps resident) all its weights
    drafter = speculative.parse(f"dspark:{path},k=3", dtype="bfloat16", weights=False)
    m = aot.target_mesh(aot.parse_target("tpu:v5e:1x1"))
    plan = make_plan(cfg, {"data": 1}, batch=BATCH, context=CONTEXT, drafter=drafter.model.cfg)
    kw = dict(batch=BATCH, context=CONTEXT, tokens=16)
    tapped = compile_lib.compile_prefill_tapped(cfg, m, drafter=drafter, **kw)
    fresh = compile_lib.compile_step(cfg, m, **kw)
    extra = tapped["argument"] - fresh["argument"]
    assert plan.drafter_total <= extra < 1.1 * plan.drafter_total + 4096, (extra, plan.drafter)


def test_tpu_loop_expert_copies_count_the_padded_expert_leaves():
    """Full K3 on v5p's expert=8, model=8: per MoE layer, 112 local experts' w2 (packed [3584, 192] -> 256 and its
    scales [3584, 12] -> 128) and the w1 / w3 scales ([384, 112] -> 128): what the v5p loop's buffer assignment
    holds."""
    cfg = config.preset("k3")
    moe_layers = sum(1 for t in cfg.ffn_types if t == "moe")
    per_layer = 112 * (3584 * 256 + 3584 * 128 + 2 * 384 * 128)
    assert tpu_loop_expert_copies(cfg, {"expert": 8, "model": 8}) == moe_layers * per_layer
    assert tpu_loop_expert_copies(config.preset("kimi-dense"), {"model": 8}) == 0


@pytest.mark.slow  # ~15 s (CI time: the default set's 30-minute budget); the loop's compile above runs by default
def test_plan_compile_serve_with_a_dspark_drafter(capsys, tmp_path, k3_tiny_a):
    """``plan --serve --compile --speculative dspark:PATH``: the serving engine's programs with the drafter -- the
    decode step, a prefill chunk, the verify step over every slot and the drafter's step -- each compiled and fitting
    on a TPU v5e 2x2 (model=4), the target's Pallas kernels in the verify step, the drafter's context attention the
    MLA kernel in each of its 2 layers. (The plan / compiler ratios of so tiny a model are the compiler's tile
    padding; full K3's are in benchmarks/results/plan_serve_speculative_dspark_k3_h200.txt: 0.990 and 1.013.)"""
    cfg = config.load(k3_tiny_a).sliced(LAYERS)
    path = _drafter_dir(tmp_path, cfg)
    rc, out, err = _plan(capsys, "--model", k3_tiny_a, "--layers", str(LAYERS), "--compile", "tpu:v5e:2x2", "--mesh",
                         "model=4", "--serve", "--slots", "2", "--max-len", str(CONTEXT), "--page-size", "16",
                         "--prefill-chunk", "16", "--speculative", f"dspark:{path},k=3")
    assert rc == 0, out + err
    assert "drafter context pools (replicated)" in out, out
    assert out.count("compiled in") == 4 and out.count(", fits (") == 4, out
    assert "serving verify step (2 slots x 4 positions" in out and "the DSpark drafter's step" in out, out
    calls = _kernel_calls(out)
    assert all(n >= expected_kernels(cfg) for n in calls[:3]) and calls[3] == 2, out
