"""Offload (issue #20): KDA state, MLA cache and routed experts in host memory, moved to the device per layer.

Oracles we do not compute the same way: the non-offloaded run's logits (bit for bit), the real TPU / GPU compilers'
own memory analysis (device arguments down and host arguments up by the bytes moved, counted from the arrays'
shapes and partition specs), and the deployment plan's per-category bytes.
"""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kimi_jax
from kimi_jax.generation.generate import Generator
from kimi_jax.model import config as C
from kimi_jax.model.run import RunConfig
from kimi_jax.parallel import offload

ALL = ("kda_state", "cache", "experts")


def test_unknown_kind_is_refused_by_name():
    with pytest.raises(ValueError, match="kda'"):
        RunConfig(offload=("kda", "experts"))
    assert RunConfig(offload=("experts", "kda_state")).offload == ("kda_state", "experts")
    assert offload.check_kinds("cache, experts") == ("cache", "experts")


def _memory_kinds(tree):
    return {a.sharding.memory_kind for a in jax.tree.leaves(tree)}


def test_generate_offloaded_equals_on_device(k3_tiny_a, k3_golden):
    """Prefill and 5 decode steps of the K3 fixture with every kind offloaded: the same logits, bit for bit, and the
    offloaded arrays still in host memory after the compiled loop (its carry included)."""
    ids = k3_golden["input_ids"]
    base = kimi_jax.from_pretrained(k3_tiny_a, dtype="float32")
    ref = Generator(base, max_len=32).generate(ids, 6, stop=(), record_logits=True)
    model = kimi_jax.from_pretrained(k3_tiny_a, run=RunConfig(dtype=jnp.float32, offload=ALL))
    gen = Generator(model, max_len=32)
    assert _memory_kinds(model.layers[1].mlp.experts.w1.get_value()) == {"pinned_host"}
    assert _memory_kinds(model.layers[1].mlp.gate.get_value()) == {"device"}
    out = gen.generate(ids, 6, stop=(), record_logits=True)
    np.testing.assert_array_equal(np.stack(out.logits), np.stack(ref.logits))  # row 0: prefill, rows 1-5: decode
    assert out.tokens == ref.tokens
    (cache,) = gen._caches.values()
    assert all(_memory_kinds(e) == {"pinned_host"} for e in cache.layers)
    assert _memory_kinds(cache.lengths) == {"device"}


@pytest.mark.slow
def test_offloaded_forward_and_scan_equal(k3_tiny_a, k3_golden):
    """The model called directly (full prefill logits, then decode steps) and the scanned layout, offloaded vs not."""
    from kimi_jax.model.cache import init_cache

    ids = jnp.asarray(k3_golden["input_ids"][:, :12])
    for scan in (False, True):
        outs = []
        for kinds in ((), ALL):
            run = RunConfig(dtype=jnp.float32, offload=kinds, scan_layers=scan)
            model = offload.place_model(kimi_jax.from_pretrained(k3_tiny_a, run=run))
            cache = offload.place_cache(init_cache(model.cfg, ids.shape[0], 16, jnp.float32, scan=scan), kinds)
            step = jax.jit(lambda m, i, c, p: (lambda r: (r.logits, r.cache))(m(i, cache=c, prefix=p)),
                           static_argnums=3)
            logits, cache = step(model, ids, cache, False)
            seq = [logits]
            for _ in range(3):
                logits, cache = step(model, jnp.argmax(seq[-1][:, -1:], -1).astype(jnp.int32), cache, True)
                seq.append(logits)
            outs.append(seq)
            assert all(_memory_kinds(e) == {"pinned_host" if kinds else "device"}
                       for e in (*cache.layers, *cache.stack) if e is not None)
        for a, b in zip(*outs):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_experts_on_a_mesh_are_refused(k3_tiny_a):
    from flax import nnx

    from kimi_jax.model.decoder import KimiModel
    from kimi_jax.parallel import sharding

    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    run = RunConfig(dtype=jnp.float32, offload=("experts",), parallel=sharding.Parallel(mesh))
    model = KimiModel(C.load(k3_tiny_a), run=run, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="expert-parallel"):
        jax.eval_shape(lambda ids: model(ids).logits, jnp.zeros((1, 2), jnp.int32))


def test_offload_bytes_match_the_arrays():
    """The plan-based figures (by category) equal the bytes of the arrays each kind places on host, on two meshes."""
    cfg = C.preset("k3").sliced(4, 32)
    for sizes in ({"data": 1, "expert": 1, "model": 1}, {"data": 1, "expert": 4, "model": 2}):
        for kinds in (("experts",), ("kda_state",), ("cache",), ALL):
            o = offload.offload_bytes(cfg, kinds, sizes, batch=8, context=4096)
            assert o.total == offload.moved_bytes(cfg, kinds, sizes, batch=8, context=4096) > 0, (sizes, kinds)
            assert o.h2d_per_step == o.total
            assert o.d2h_per_step == sum(v for k, v in o.moved.items() if k != "experts")
    assert "per decode step" in offload.format_offload(o)


def test_offload_plan_k3_needs_fewer_h200():
    """K3, batch 8, 128K context: experts on host fit on fewer H200 than the plan's smallest on-device mesh, and the
    price is every local expert byte over PCIe each step."""
    from kimi_jax.parallel import plan

    cfg = C.preset("k3")
    r = offload.offload_plan(cfg, ("experts",), batch=8, context=131072, chip="h200")
    without, with_ = r["without"], r["with"]
    smallest = plan.search(cfg, "tp_ep", batch=8, context=131072, chips=["h200"])["h200"]
    assert without["chips"] == min(q.chips for q in smallest)
    assert without["chips"] == 16 and with_["chips"] == 8  # the goal: 16 -> 8 H200
    assert with_["host"] <= offload.HOST_PER_CHIP * 0.9 < 2 * with_["host"]  # 4 chips would need twice the host
    # by hand: 92 MoE layers x 896 experts x 3 matrices of 3072 x 3584 MXFP4 values (half a byte each plus one
    # scale byte per 32), spread over the 8 chips, all of them crossing PCIe (64 GB/s) every step
    experts_per_chip = 92 * 896 * 3 * 3072 * 3584 * (1 / 2 + 1 / 32) / 8
    assert with_["host"] == pytest.approx(experts_per_chip) and with_["h2d_per_step"] == pytest.approx(experts_per_chip)
    assert with_["copy_seconds"] == pytest.approx(experts_per_chip / 64e9)
    p = plan.make_plan(cfg, with_["sizes"], batch=8, context=131072)
    assert with_["device"] == pytest.approx(p.total - experts_per_chip)


def _compiled(target, cfg, kinds_list, batch, context):
    from kimi_jax.parallel import aot

    need = "libtpu" if target.startswith("tpu") else "jax_plugins.xla_cuda12"
    if importlib.util.find_spec(need) is None:
        pytest.skip(f"{need} not installed")
    mesh = aot.target_mesh(aot.parse_target(target))
    kw = dict(batch=batch, context=context)
    base = offload.compile_step(cfg, mesh, (), parallel=False, **kw)
    assert base["host_argument"] == 0
    for kinds in kinds_list:
        r = offload.compile_step(cfg, mesh, kinds, parallel=False, **kw)
        yield kinds, base, r, offload.moved_bytes(cfg, kinds, mesh, **kw)


def test_compiler_moves_the_bytes_tiny(k3_tiny_a):
    """TPU compiler, the fixture's tiny K3: the device argument bytes fall by exactly what the host arguments gain, at
    least the offloaded arrays' bytes (TPU pads small arrays to its tiles, in both memories)."""
    for kinds, base, r, moved in _compiled("tpu:v5e:1x1", C.load(k3_tiny_a), [ALL], 4, 256):
        assert base["argument"] - r["argument"] == r["host_argument"] >= moved, kinds
        assert r["host_output"] == r["host_alias"] > 0  # the new cache entries go back to host, in place


@pytest.mark.slow
@pytest.mark.parametrize("target", ["tpu:v5e:1x1", "gpu:h200:1x1x1"])
def test_compiler_moves_the_bytes_k3_slice(target):
    """A full-width K3 slice (4 layers, 16 experts; tile-aligned shapes): device arguments down and host arguments up
    by exactly the bytes of the offloaded arrays, on the TPU and the GPU compiler."""
    cfg = C.preset("k3").sliced(4, 16)
    for kinds, base, r, moved in _compiled(target, cfg, [("kda_state", "experts"), ALL], 8, 4096):
        assert r["host_argument"] == moved > 0, kinds
        assert base["argument"] - r["argument"] == moved, kinds


@pytest.mark.parametrize("implementation", [None, "reference"])
def test_each_moe_layer_fetches_its_experts_once(hf_kimi_linear, monkeypatch, implementation):
    """Eager decode of one token with float experts in host memory: one host -> device copy of the expert weights
    per MoE layer, whichever path the products take (the fused native call, or each part on its own)."""
    from kimi_jax.model.cache import init_cache

    path, _ = hf_kimi_linear
    run = RunConfig(dtype=jnp.float32, offload=("experts",), implementation=implementation)
    model = offload.place_model(kimi_jax.from_pretrained(path, run=run))
    copies = []
    real = offload.to_device
    monkeypatch.setattr(offload, "to_device", lambda tree, after=None: copies.append(1) or real(tree, after))
    cache = init_cache(model.cfg, 1, 8, jnp.float32)
    model(jnp.zeros((1, 1), jnp.int32), cache=cache, prefix=True)
    assert len(copies) == model.cfg.ffn_types.count("moe") > 0


def test_from_pretrained_reads_the_experts_into_host_memory(k3_tiny_a, k3_golden, monkeypatch):
    """``from_pretrained(run=RunConfig(offload=("experts",)))`` puts every routed-expert leaf into host memory as it is
    read (the device never holds them), refuses a mesh before reading, and the model called directly (no
    Generator) computes the on-device model's logits exactly."""
    from flax import nnx

    from kimi_jax.model import params
    from kimi_jax.parallel import sharding

    placed = []
    real = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda x, s=None, **kw: placed.append(getattr(s, "memory_kind", None))
                        or real(x, s, **kw))
    run = RunConfig(dtype=jnp.float32, offload=("experts",))
    model = kimi_jax.from_pretrained(k3_tiny_a, run=run, progress=False)
    monkeypatch.setattr(jax, "device_put", real)
    n_expert_leaves = sum(offload.is_expert_leaf(k) for k in params.leaves(nnx.state(model)))
    assert n_expert_leaves > 0 and placed.count("pinned_host") == n_expert_leaves
    assert _memory_kinds(model.layers[1].mlp.experts.w1.get_value()) == {"pinned_host"}
    assert _memory_kinds(model.layers[1].mlp.gate.get_value()) == {"device"}
    ids = jnp.asarray(k3_golden["input_ids"][:, :8])
    base = kimi_jax.from_pretrained(k3_tiny_a, dtype="float32", progress=False)
    np.testing.assert_array_equal(np.asarray(model(ids).logits), np.asarray(base(ids).logits))
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="offload=\\('experts',\\) runs on one device"):
        kimi_jax.from_pretrained(k3_tiny_a, run=run, mesh=mesh, progress=False)


def test_a_converted_checkpoint_restores_the_experts_into_host_memory(k3_tiny_a, k3_golden, tmp_path,
                                                                       monkeypatch):
    """The converter's Orbax output with ``offload=("experts",)``: the experts restored straight into host memory
    (the move after loading disabled here), the rest on the device, the logits those of the on-device model."""
    from convert.converter import convert_checkpoint

    convert_checkpoint(k3_tiny_a, tmp_path / "k3", progress=False)
    monkeypatch.setattr(offload, "place_model", lambda model, kinds=None: model)
    model = kimi_jax.from_pretrained(tmp_path / "k3", run=RunConfig(dtype=jnp.float32, offload=("experts",)))
    assert _memory_kinds(model.layers[1].mlp.experts.w1.get_value()) == {"pinned_host"}
    assert _memory_kinds(model.layers[1].mlp.gate.get_value()) == {"device"}
    ids = jnp.asarray(k3_golden["input_ids"][:, :8])
    base = kimi_jax.from_pretrained(k3_tiny_a, dtype="float32", progress=False)
    np.testing.assert_array_equal(np.asarray(model(ids).logits), np.asarray(base(ids).logits))
