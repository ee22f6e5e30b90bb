"""Offload (issue #20): KDA state, MLA cache and routed experts in host memory, moved to the device per layer.

Oracles we do not compute the same way: the non-offloaded run's logits (bit for bit), the real TPU / GPU compilers'
own memory analysis (device arguments down and host arguments up by the bytes moved, counted from the arrays'
shapes and partition specs) and scheduled programs (the host -> device copies a decode step makes, against expert
bytes counted by hand), and the deployment plan's per-category bytes.
"""

import dataclasses
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kimi_jax
from kimi_jax.generation.generate import Generator
from kimi_jax.model import config as C
from kimi_jax.model.run import RunConfig
from kernels_pallas._dispatch import slices_from_host
from kimi_jax.deploy import compile as compile_lib
from kimi_jax.deploy import offload as offload_costs
from kimi_jax.model import hot_experts, offload
from kimi_jax.model.run import check_offload

ALL = ("kda_state", "cache", "experts")


def test_unknown_kind_is_refused_by_name():
    with pytest.raises(ValueError, match="kda'"):
        RunConfig(offload=("kda", "experts"))
    assert RunConfig(offload=("experts", "kda_state")).offload == ("kda_state", "experts")
    assert check_offload("cache, experts") == ("cache", "experts")


def _memory_kinds(tree):
    return {a.sharding.memory_kind for a in jax.tree.leaves(tree)}


def _count(monkeypatch, name):
    """A list that grows by one per call of ``offload.<name>`` (which still runs)."""
    calls, real = [], getattr(offload, name)
    monkeypatch.setattr(offload, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@pytest.fixture(scope="module")
def on_device(k3_tiny_a, k3_golden):
    """The K3 fixture on the device (float32) and its generation: prefill + 5 decode steps, logits recorded."""
    base = kimi_jax.from_pretrained(k3_tiny_a, dtype="float32")
    return base, Generator(base, max_len=32).generate(k3_golden["input_ids"], 6, stop=(), record_logits=True)


def test_generate_offloaded_equals_on_device(k3_tiny_a, k3_golden, on_device, monkeypatch):
    """Prefill and 5 decode steps of the K3 fixture (MXFP4 experts) with every kind offloaded: the same logits, bit
    for bit, with the decode steps fetching only the routed experts (2 sequences x top-2 of 8), and the offloaded
    arrays still in host memory after the compiled loop (its carry included)."""
    ids = k3_golden["input_ids"]
    ref = on_device[1]
    model = kimi_jax.from_pretrained(k3_tiny_a, run=RunConfig(dtype=jnp.float32, offload=ALL))
    gen = Generator(model, max_len=32)
    slots = _count(monkeypatch, "fetch_slots")
    assert _memory_kinds(model.layers[1].mlp.experts.w1.get_value()) == {"pinned_host"}
    assert _memory_kinds(model.layers[1].mlp.gate.get_value()) == {"device"}
    out = gen.generate(ids, 6, stop=(), record_logits=True)
    np.testing.assert_array_equal(np.stack(out.logits), np.stack(ref.logits))  # row 0: prefill, rows 1-5: decode
    assert out.tokens == ref.tokens
    assert len(slots) == model.cfg.ffn_types.count("moe")  # traced once, in the compiled decode step
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
            o = offload_costs.offload_bytes(cfg, kinds, sizes, batch=8, context=4096)
            assert o.total == offload_costs.moved_bytes(cfg, kinds, sizes, batch=8, context=4096) > 0, (sizes, kinds)
            # 8 tokens x top-16 = 128 pairs > 32 experts: the products do not gather, every local expert moves
            assert o.h2d_per_step == o.h2d_whole_layers == o.total and o.expert_slots == 0
            assert o.d2h_per_step == sum(v for k, v in o.moved.items() if k != "experts")
    assert "per decode step" in offload_costs.format_offload(o)


# -m slow for CI time (the 30-minute budget): the offload plan's other checks run in the default set
@pytest.mark.slow
def test_offload_plan_k3_needs_fewer_h200():
    """K3, batch 8, 128K context: experts on host fit on fewer H200 than the plan's smallest on-device mesh, and the
    price is the routed experts' bytes over PCIe each decode step (every local expert byte before, and still on TPU,
    whose compiler cannot slice MXFP4 bytes out of host memory)."""
    from kimi_jax.deploy import plan

    cfg = C.preset("k3")
    r = offload_costs.offload_plan(cfg, ("experts",), batch=8, context=131072, chip="h200")
    without, with_ = r["without"], r["with"]
    smallest = plan.search(cfg, "tp_ep", batch=8, context=131072, chips=["h200"])["h200"]
    assert without["chips"] == min(q.chips for q in smallest)
    assert without["chips"] == 16 and with_["chips"] == 8  # the goal: 16 -> 8 H200
    assert with_["host"] <= offload_costs.HOST_PER_CHIP * 0.9 < 2 * with_["host"]  # 4 chips would need twice the host
    # by hand: 92 MoE layers x 896 experts x 3 matrices of 3072 x 3584 MXFP4 values (half a byte each plus one
    # scale byte per 32), spread over the 8 chips, all of them crossing PCIe (64 GB/s) every step
    experts_per_chip = 92 * 896 * 3 * 3072 * 3584 * (1 / 2 + 1 / 32) / 8
    assert with_["host"] == pytest.approx(experts_per_chip)
    assert with_["h2d_whole_layers"] == pytest.approx(experts_per_chip)
    assert with_["whole_layer_seconds"] == pytest.approx(experts_per_chip / 64e9)  # 2.8 s
    # decode fetches what the 8 tokens chose: 8 x 16 = 128 experts per layer, each chip its 1/8 of their rows
    assert with_["sizes"] == {"data": 1, "expert": 1, "model": 8} and with_["expert_slots"] == 128
    routed_per_chip = 92 * 128 * 3 * 3072 * 3584 * (1 / 2 + 1 / 32) / 8
    assert with_["h2d_per_step"] == pytest.approx(routed_per_chip)
    assert with_["copy_seconds"] == pytest.approx(routed_per_chip / 64e9)  # 0.40 s
    p = plan.make_plan(cfg, with_["sizes"], batch=8, context=131072)
    assert with_["device"] == pytest.approx(p.total - experts_per_chip)
    v5p = offload_costs.offload_plan(cfg, ("experts",), batch=8, context=131072, chip="v5p")["with"]
    assert v5p["h2d_per_step"] == v5p["h2d_whole_layers"] == pytest.approx(experts_per_chip * 8 / v5p["chips"])


def test_routed_fetch_per_chip_is_capped_at_the_local_experts():
    """K3 on expert=8 (112 experts per chip and layer): batch 1 fetches 16 of them, batch 8 (128 pairs) all 112; a
    float K3 on TPU fetches the routed ones too."""
    import dataclasses

    cfg = C.preset("k3")
    expert_bytes = 3 * 3072 * 3584 * (1 / 2 + 1 / 32)  # one MXFP4 expert, whole (expert=8 splits experts, not rows)
    for batch, slots in ((1, 16), (8, 112)):
        o = offload_costs.offload_bytes(cfg, ("experts",), {"expert": 8}, batch=batch, context=4096)
        assert (o.expert_slots, o.local_experts) == (slots, 112)
        assert o.h2d_per_step == pytest.approx(92 * slots * expert_bytes)
        assert o.h2d_whole_layers == pytest.approx(92 * 112 * expert_bytes)
    bf16 = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, quant=None))
    for quant_cfg, slots in ((cfg, 0), (bf16, 16)):
        o = offload_costs.offload_bytes(quant_cfg, ("experts",), {"expert": 8}, batch=1, context=4096, platform="tpu")
        assert o.expert_slots == slots
    assert "routed experts only: 16 of 112" in offload_costs.format_offload(
        offload_costs.offload_bytes(cfg, ("experts",), {"expert": 8}, batch=1, context=4096))


def _compiled(target, cfg, kinds_list, batch, context):
    from kimi_jax.deploy import aot

    need = "libtpu" if target.startswith("tpu") else "jax_plugins.xla_cuda12"
    if importlib.util.find_spec(need) is None:
        pytest.skip(f"{need} not installed")
    mesh = aot.target_mesh(aot.parse_target(target))
    kw = dict(batch=batch, context=context)
    base = compile_lib.compile_step(cfg, mesh, parallel=False, **kw)
    assert base["host_argument"] == 0
    for kinds in kinds_list:
        r = compile_lib.compile_step(cfg, mesh, offload=kinds, parallel=False, **kw)
        yield kinds, base, r, offload_costs.moved_bytes(cfg, kinds, mesh, **kw)


def test_compiler_moves_the_bytes_tiny(k3_tiny_a):
    """TPU compiler, the fixture's tiny K3: the device argument bytes fall by exactly what the host arguments gain, at
    least the offloaded arrays' bytes (TPU pads small arrays to its tiles, in both memories)."""
    for kinds, base, r, moved in _compiled("tpu:v5e:1x1", C.load(k3_tiny_a), [ALL], 4, 256):
        assert base["argument"] - r["argument"] == r["host_argument"] >= moved, kinds
        assert r["host_output"] == r["host_alias"] > 0  # the new cache entries go back to host, in place
        assert r["h2d"] == moved  # MXFP4 experts move whole on TPU (slices_from_host), the cache entries too


def _float_experts(cfg):
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, quant=None))


def _routed_expert_bytes(cfg, dtype_bytes):
    """One routed expert's bytes, by hand: w1, w3 ``[F, L]`` and w2 ``[L, F]``; MXFP4 holds half a byte per value
    and one scale byte per 32 values."""
    m = cfg.moe
    return 3 * m.expert_intermediate * m.latent * (dtype_bytes if m.quant is None else 1 / 2 + 1 / 32)


@pytest.mark.parametrize("target,experts", [("tpu:v5e:1x1", "bfloat16"), ("gpu:h200:1x1x1", "mxfp4")])
def test_compiler_fetches_only_the_routed_experts(k3_tiny_a, target, experts):
    """Deviceless TPU (bf16 experts) and GPU (MXFP4 experts) compiles of a decode step of the tiny K3 (its first 3
    layers: 2 MoE layers of 8 experts, top-2), batch 2, experts in host memory: the device arguments drop by what the
    host arguments gain (the experts' bytes; TPU pads them to its tiles), and the scheduled program's host -> device
    copies (:func:`compile_lib.host_to_device_bytes`) are the 2 x 2 routed experts per layer, counted by hand: half of
    the layer."""
    cfg = C.load(k3_tiny_a).sliced(3)
    cfg = _float_experts(cfg) if experts == "bfloat16" else cfg
    for kinds, base, r, moved in _compiled(target, cfg, [("experts",)], 2, 256):
        assert base["argument"] - r["argument"] == r["host_argument"] >= moved > 0
        assert r["h2d"] == 2 * (2 * 2) * _routed_expert_bytes(cfg, 2) == moved / 2


def test_tpu_copies_an_8_bit_host_array_whole_to_slice_it():
    """What :func:`kernels_pallas._dispatch.slices_from_host` works around: XLA:TPU slices a bf16 host array per expert as just the
    slices, but a uint8 one (MXFP4 codes) only after copying the whole array to the device and back (another tiling).
    Should a libtpu change this, MXFP4 experts could be fetched routed-only on TPU too."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from kimi_jax.deploy import aot

    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu not installed")
    mesh = aot.target_mesh(aot.parse_target("tpu:v5e:1x1"))
    am = mesh.abstract_mesh
    ids = jax.ShapeDtypeStruct((4,), jnp.int32, sharding=NamedSharding(am, P(), memory_kind="device"))

    def fetched(dtype):
        w = jax.ShapeDtypeStruct((64, 512, 512), dtype, sharding=NamedSharding(am, P(), memory_kind="pinned_host"))
        step = lambda w, ids: jax.tree.map(lambda a: a.astype(jnp.float32).sum((1, 2)),  # noqa: E731
                                           offload.fetch_slots(w, ids[None])[0])
        with jax.sharding.use_abstract_mesh(am), jax.set_mesh(mesh):
            return compile_lib.host_to_device_bytes(jax.jit(step).lower(w, ids).compile().as_text())

    assert fetched(jnp.bfloat16) == 4 * 512 * 512 * 2
    assert fetched(jnp.uint8) == 64 * 512 * 512 + 4 * 512 * 512
    assert not slices_from_host([jnp.uint8], "tpu")


@pytest.mark.slow
@pytest.mark.parametrize("target", ["tpu:v5e:1x1", "gpu:h200:1x1x1"])
def test_compiler_moves_the_bytes_k3_slice(target):
    """A full-width K3 slice (4 layers, 16 experts; tile-aligned shapes): device arguments down and host arguments up
    by exactly the bytes of the offloaded arrays, on the TPU and the GPU compiler."""
    cfg = C.preset("k3").sliced(4, 16)
    for kinds, base, r, moved in _compiled(target, cfg, [("kda_state", "experts"), ALL], 8, 4096):
        assert r["host_argument"] == moved > 0, kinds
        assert base["argument"] - r["argument"] == moved, kinds
        assert r["h2d"] == moved, kinds  # 128 pairs > 16 experts: the products do not gather, the layers move whole


@pytest.mark.slow
@pytest.mark.parametrize("target,experts,slots", [("gpu:h200:1x1x1", "mxfp4", 16), ("tpu:v5p:1x1x1", "bfloat16", 16),
                                                  ("tpu:v5p:1x1x1", "mxfp4", 32)])
def test_compiler_fetches_the_routed_experts_k3_slice(target, experts, slots):
    """A full-width K3 slice (4 layers, 3 of them MoE, 32 experts), batch-1 decode, experts in host memory: the step
    copies the 16 routed experts of each layer (MXFP4 17.5 MB each on GPU: 0.84 of 1.68 GB; bf16 66 MB each on TPU:
    3.17 of 6.34 GB), and on TPU the MXFP4 layers whole (32 experts: 1.68 GB)."""
    cfg = C.preset("k3").sliced(4, 32)
    cfg = _float_experts(cfg) if experts == "bfloat16" else cfg
    for kinds, base, r, moved in _compiled(target, cfg, [("experts",)], 1, 4096):
        assert r["host_argument"] == moved == 3 * 32 * _routed_expert_bytes(cfg, 2)
        assert base["argument"] - r["argument"] == moved
        assert r["h2d"] == 3 * slots * _routed_expert_bytes(cfg, 2)


@pytest.mark.parametrize("implementation", [None, pytest.param("reference", marks=pytest.mark.slow)])
def test_decode_fetches_the_routed_experts_prefill_the_layer(hf_kimi_linear, monkeypatch, implementation):
    """Eager calls of the float Kimi Linear fixture (4 experts, top-2) with its experts in host memory: a one-token
    decode step moves only the 2 chosen experts of each MoE layer (a ``[2, ...]`` stack), a 3-token prefill (6 pairs
    > 4 experts) each layer's whole stack, whichever path the products take (the fused native call, or each part on
    its own)."""
    from kimi_jax.model.cache import init_cache

    path, _ = hf_kimi_linear
    run = RunConfig(dtype=jnp.float32, offload=("experts",), implementation=implementation)
    model = offload.place_model(kimi_jax.from_pretrained(path, run=run))
    moe_layers = model.cfg.ffn_types.count("moe")
    shapes, real = [], offload.fetch_slots

    def fetch(w, idx, hot=None):
        out = real(w, idx, hot)
        shapes.append(out[0]["w1"].shape)
        return out

    monkeypatch.setattr(offload, "fetch_slots", fetch)
    whole = _count(monkeypatch, "to_device")
    cache = model(jnp.ones((1, 3), jnp.int32), cache=init_cache(model.cfg, 1, 8, jnp.float32)).cache
    assert (len(shapes), len(whole)) == (0, moe_layers)
    model(jnp.zeros((1, 1), jnp.int32), cache=cache, prefix=True)
    assert (len(shapes), len(whole)) == (moe_layers, moe_layers)
    assert shapes[0] == (2, *model.layers[1].mlp.experts.w1.get_value().shape[1:])


@pytest.mark.parametrize("fixture,batch", [pytest.param("k3_tiny_a", 2, marks=pytest.mark.slow),  # 28 s; the
                                           ("hf_kimi_linear", 1)])  # Generator test above fetches K3's too
def test_routed_fetch_decode_equals_on_device(fixture, batch, request, monkeypatch):
    """The model called directly (no Generator): a prefill, then 4 greedy decode steps, with the experts in host
    memory (MXFP4 K3, 2 sequences: 4 of 8 experts fetched per layer and step; float Kimi Linear, 1 sequence: 2 of 4)
    and without: the same logits, bit for bit, hence the same tokens."""
    from kimi_jax.model.cache import init_cache

    path = request.getfixturevalue(fixture)
    path = path[0] if isinstance(path, tuple) else path
    ids = jnp.asarray(np.arange(6 * batch).reshape(batch, 6) % 100 + 3, jnp.int32)
    slots = _count(monkeypatch, "fetch_slots")
    runs = []
    for kinds in ((), ("experts",)):
        model = offload.place_model(kimi_jax.from_pretrained(path, run=RunConfig(dtype=jnp.float32, offload=kinds)))
        step = jax.jit(lambda m, i, c, p: (lambda r: (r.logits[:, -1], r.cache))(m(i, cache=c, prefix=p)),
                       static_argnums=3)
        logits, cache = step(model, ids, init_cache(model.cfg, batch, 16, jnp.float32), False)
        seq = [logits]
        for _ in range(4):
            logits, cache = step(model, jnp.argmax(seq[-1], -1)[:, None].astype(jnp.int32), cache, True)
            seq.append(logits)
        runs.append(np.stack(seq))
    assert len(slots) == model.cfg.ffn_types.count("moe")  # the decode step, traced once
    np.testing.assert_array_equal(runs[1], runs[0])


# -m slow for CI time (the 30-minute budget): offloaded generation equals on-device in the default set
@pytest.mark.slow
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


# -- hot experts: the most used routed experts kept in device memory too ----------------------------------------


def _zero_host_experts(model):
    """Every routed-expert weight in host memory replaced by zeros: what the host path would read from now on."""
    for experts in hot_experts.routed_experts(model):
        for name in ("w1", "w3", "w2"):
            var = getattr(experts, name)
            var.set_value(jax.tree.map(lambda a: jax.device_put(np.zeros(a.shape, a.dtype), a.sharding), var.get_value()))


# -m slow for CI time (the 30-minute budget): offloaded generation equals on-device in the default set
@pytest.mark.slow
def test_hot_experts_generate_bit_for_bit_and_are_read_from_the_device(k3_tiny_a, k3_golden, on_device):
    """`hot_experts.keep_hot_experts`: (1) usage counts every routed choice once (tokens x top-k per MoE layer); (2) with
    2 of 8 experts per layer hot, generation (prefill + 5 decode steps) gives the on-device logits bit for bit; (3)
    the hot rows really come from the device copy: with every expert hot and the host weights then zeroed, a
    decode-sized call (2 tokens x top-2: the routed path) still gives the on-device logits, and without the hot set it
    does not."""
    ids = k3_golden["input_ids"]
    base, ref = on_device
    cfg = base.cfg
    usage = hot_experts.expert_usage(base, k3_golden["full_ids"])
    moe_layers = cfg.ffn_types.count("moe")
    assert len(usage) == moe_layers
    assert all(u.sum() == k3_golden["full_ids"].size * cfg.moe.top_k for u in usage)

    model = kimi_jax.from_pretrained(k3_tiny_a, run=RunConfig(dtype=jnp.float32, offload=("experts",)))
    hot = hot_experts.keep_hot_experts(model, 2, usage)
    assert [sorted(h) for h in hot] == [sorted(np.argsort(-u, kind="stable")[:2].tolist()) for u in usage]
    out = Generator(model, max_len=32).generate(ids, 6, stop=(), record_logits=True)
    np.testing.assert_array_equal(np.stack(out.logits), np.stack(ref.logits))
    experts = model.layers[1].mlp.experts
    assert _memory_kinds(experts.hot_cache.get_value()) == {"device"}  # the Generator placed only the weights
    assert _memory_kinds(experts.w1.get_value()) == {"pinned_host"}

    step = jnp.asarray(ids[:, :1])
    fwd = nnx.jit(lambda m, x: m(x).logits)
    want = np.asarray(fwd(base, step))
    for per_layer, same in ((cfg.moe.num_experts, True), (0, False)):
        m = kimi_jax.from_pretrained(k3_tiny_a, run=RunConfig(dtype=jnp.float32, offload=("experts",)))
        hot_experts.keep_hot_experts(m, per_layer, usage)
        _zero_host_experts(m)
        got = np.asarray(fwd(m, step))
        assert np.array_equal(got, want) == same, per_layer


def test_hot_experts_refusals(k3_tiny_a, on_device):
    base = on_device[0]
    usage = [np.ones(base.cfg.moe.num_experts, np.int64)] * base.cfg.ffn_types.count("moe")
    with pytest.raises(ValueError, match="not offloaded"):
        hot_experts.keep_hot_experts(base, 2, usage)
    model = kimi_jax.from_pretrained(k3_tiny_a, run=RunConfig(dtype=jnp.float32, offload=("experts",)))
    with pytest.raises(ValueError, match=r"per_layer=9 must lie in \[0, 8\]"):
        hot_experts.keep_hot_experts(model, 9, usage)
    with pytest.raises(ValueError, match="one per MoE layer"):
        hot_experts.keep_hot_experts(model, 2, usage[:-1])
    with pytest.raises(ValueError, match="must lie in"):
        hot_experts.expert_usage(base, np.array([[0, base.cfg.vocab_size]]))


def test_plan_counts_hot_experts_on_the_device():
    """`kimi-jax plan --offload experts --hot-experts N`: K3 on 8 H200 (``model=8``), batch 1, 128K: each chip keeps
    its eighth of 64 experts per MoE layer on the device too (92 layers x 64 x 3 MXFP4 matrices of 3072 x 3584, counted
    by hand), the host still holds every expert, the worst-case copies per step do not change."""
    cfg = C.preset("k3")
    sizes = {"data": 1, "expert": 1, "model": 8}
    kw = dict(batch=1, context=131072)
    cold = offload_costs.offload_bytes(cfg, ("experts",), sizes, **kw)
    hot = offload_costs.offload_bytes(cfg, ("experts",), sizes, hot=64, **kw)
    hot_by_hand = 92 * 64 * 3 * 3072 * 3584 * (1 / 2 + 1 / 32) / 8
    assert hot.hot_bytes == pytest.approx(hot_by_hand) and cold.hot_bytes == 0
    assert hot.total == cold.total and hot.device_freed == cold.total - hot.hot_bytes
    assert hot.h2d_per_step == cold.h2d_per_step
    assert "hot experts: 64 of 896" in offload_costs.format_offload(hot)
    from kimi_jax.deploy import plan

    r = offload_costs.offload_plan(cfg, ("experts",), chip="h200", hot=64, **kw)["with"]
    assert r["sizes"] == sizes  # the smallest mesh that fits with the experts on host, as without a hot set
    assert r["device"] == pytest.approx(plan.make_plan(cfg, sizes, **kw).total - cold.total + hot_by_hand)


def test_compiler_copies_cold_experts_only_in_their_branch(k3_tiny_a):
    """XLA:GPU, deviceless, the tiny K3's first 3 layers (2 MoE layers of 8 MXFP4 experts, top-2), batch 2, experts
    on host, 3 per layer also on the device: the device arguments grow by exactly 2 x 3 experts' bytes (counted by
    hand) and the slot map, the host arguments do not change, and every host -> device expert copy now sits inside a
    branch of a ``conditional`` (none runs unconditionally; with all four slots cold, the same bytes as without a hot
    set)."""
    from kimi_jax.deploy import aot

    cfg = C.load(k3_tiny_a).sliced(3)
    mesh = aot.target_mesh(aot.parse_target("gpu:h200:1x1x1"))
    kw = dict(batch=2, context=256, parallel=False)
    cold = compile_lib.compile_step(cfg, mesh, offload=("experts",), **kw)
    hot = compile_lib.compile_step(cfg, mesh, offload=("experts",), hot_experts=3, **kw)
    slot_map = cfg.moe.num_experts * 4
    assert hot["argument"] - cold["argument"] == 2 * (3 * _routed_expert_bytes(cfg, 2) + slot_map)
    assert hot["host_argument"] == cold["host_argument"] > 0
    assert cold["h2d_always"] == cold["h2d"] == 2 * (2 * 2) * _routed_expert_bytes(cfg, 2)
    assert hot["h2d"] == cold["h2d"] and hot["h2d_always"] == 0


def test_plan_cli_takes_hot_experts(capsys):
    from kimi_jax.cli import main

    main(["plan", "--model", "k3", "--layers", "4", "--mesh", "model=8", "--offload", "experts", "--hot-experts", "16",
          "--batch", "1", "--context", "4096", "--chips", "h200"])
    out = capsys.readouterr().out
    assert "hot experts: 16 of 896 per MoE layer also on the device" in out and "left on each chip" in out
