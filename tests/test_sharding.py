"""Sharding tables, partition specs, the deployment plan and the `kimi-jax plan` CLI (one process, no devices needed).

Expected numbers are computed here from the released K3 config (K3_SPEC: 93 layers = 69 KDA + 24 MLA, 96 heads
x 128, 896 routed experts of 3072 x 3584 in MXFP4, MLA latent 512 + 64), not taken from the code under test.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from kimi_jax.model import config as C
from kimi_jax.model import params
from kimi_jax.model.cache import cache_shapes
from kimi_jax.model.decoder import abstract_model
from kimi_jax.deploy import plan
from kimi_jax.parallel import sharding

K3_SIZES = dict(data=1, expert=8, model=8)


@pytest.fixture(scope="module")
def k3():
    cfg = C.preset("k3")
    return cfg, plan._abstract(cfg, "bfloat16")[0]  # the abstract model the plan builds (cached)


@pytest.fixture(scope="module")
def tiny():
    cfg = C.from_dict(C.tiny_k3_config_dict())
    return cfg, abstract_model(cfg)


def test_one_array_never_maps_two_logical_axes_to_one_mesh_axis():
    bad = sharding._table("bad", batch=("data",), expert=("expert", "model"), expert_mlp=("model",))
    arrays = {"w1": (("expert", "expert_mlp", None), (8, 64, 64))}
    with pytest.raises(sharding.ShardingError, match=r"w1.*'expert'.*'expert_mlp'.*same mesh axis 'model'"):
        sharding.group_specs(arrays, dict(data=1, expert=2, model=2), bad)
    # the shipped tables pass the check for every parameter and cache array of every family
    for name in sharding.LAYOUTS:
        for cfg in (C.from_dict(C.tiny_k3_config_dict()), C.preset("kimi-linear-48b-a3b"), C.preset("kimi-dense")):
            sharding.param_specs(abstract_model(cfg), dict(data=2, expert=2, model=2), name)
            sharding.cache_specs(cfg, cache_shapes(cfg, 4, 16), dict(data=2, expert=2, model=2), name)


def test_unknown_axes_and_meshes_are_named():
    with pytest.raises(sharding.ShardingError, match="unknown mesh axes"):
        sharding._table("t", heads=("tensor",))
    with pytest.raises(sharding.ShardingError, match="'fsdp=2'"):
        sharding.parse_mesh("data=1,fsdp=2")
    with pytest.raises(sharding.ShardingError, match="unknown layout 'zz'"):
        sharding.layout("zz")
    assert sharding.parse_mesh("expert=64,model=8") == {"data": 1, "expert": 64, "model": 8}
    with pytest.raises(sharding.ShardingError, match=r"= 2 devices, but 1 are available"):
        sharding.make_mesh(1, 1, 2, devices=jax.devices()[:1])


def test_k3_full_size_shard_shapes(k3):
    """Per-device shapes on data=1, expert=8, model=8, worked out by hand."""
    cfg, model = k3
    specs = sharding.param_specs(model, K3_SIZES)
    want = {
        "embed_tokens": (163840 // 8, 7168),
        "lm_head": (163840 // 8, 7168),
        "layers.1.self_attn.q_proj": (96 * 128 // 8, 7168),  # KDA: 12 of 96 heads per chip
        "layers.1.self_attn.A_log": (12,),
        "layers.1.self_attn.o_proj": (7168, 96 * 128 // 8),
        "layers.3.self_attn.q_b_proj": (96 * 192 // 8, 1536),  # MLA heads
        "layers.3.self_attn.kv_a_proj_with_mqa": (576, 7168),  # shared latent: replicated
        "layers.0.mlp.gate_proj": (33792 // 8, 7168),
        "layers.5.mlp.shared_experts.down_proj": (7168, 2 * 3072 // 8),
        "layers.5.mlp.routed_expert_down_proj": (3584 // 8, 7168),
        "layers.5.mlp.experts.w1.packed": (896 // 8, 3072 // 8, 3584 // 2),  # EP x TP inside each expert
        "layers.5.mlp.experts.w1.scale": (896 // 8, 3072 // 8, 3584 // 32),
        "layers.5.mlp.experts.w2.packed": (896 // 8, 3584, 3072 // 8 // 2),
        "layers.5.mlp.experts.w2.scale": (896 // 8, 3584, 3072 // 8 // 32),
    }
    shapes = {k: v.shape for k, v in params.leaves(nnx.state(model)).items()}
    for name, shape in want.items():
        assert sharding.shard_shape(shapes[name], specs[name], K3_SIZES) == shape, name
    # wide EP (TP16/EP16 on 16 chips): each expert whole on one chip, 56 per chip
    wide = sharding.param_specs(model, dict(data=1, expert=1, model=16), "wide_ep")
    assert sharding.shard_shape(shapes["layers.5.mlp.experts.w2.packed"], wide["layers.5.mlp.experts.w2.packed"],
                                dict(data=1, expert=1, model=16)) == (56, 3584, 3072 // 2)


def test_divisibility_fallbacks_keep_heads_and_mxfp4_groups_whole(tiny):
    cfg, model = tiny  # 4 heads, experts of width 64 (two 32-value MXFP4 groups in w2's input)
    tp8 = sharding.param_specs(model, dict(data=1, expert=1, model=8))
    assert tp8["layers.1.self_attn.q_proj"] == P(None, None)  # 4 heads cannot split 8 ways: never mid-head
    assert tp8["layers.3.self_attn.q_b_proj"] == P(None, None)
    assert tp8["layers.0.mlp.gate_proj"] == P("model", None)  # MLP width 256 can
    # w2's 2 scale groups cannot split 8 ways, so no expert array of that module splits its hidden width
    assert {tp8[f"layers.3.mlp.experts.{n}"] for n in ("w1.packed", "w1.scale", "w2.packed", "w2.scale")} == {
        P(None, None, None)}
    mix = sharding.param_specs(model, dict(data=2, expert=2, model=2))
    assert mix["layers.1.self_attn.q_proj"] == P("model", None)
    assert mix["layers.1.self_attn.A_log"] == P("model")
    assert mix["layers.3.mlp.experts.w2.packed"] == P("expert", None, "model")
    assert mix["layers.3.mlp.experts.w2.scale"] == P("expert", None, "model")
    c = sharding.cache_specs(cfg, cache_shapes(cfg, 2, 32), dict(data=2, expert=2, model=2))
    assert c.layers[0].state == P("data", "model", None, None)  # batch 2 splits over data only
    assert c.layers[3].c == P("data", "model", None)  # the latent cache: no head axis; positions over model
    assert sharding.cache_specs(cfg, cache_shapes(cfg, 2, 33), dict(data=2, expert=2, model=2)).layers[3].c == P(
        "data", None, None)  # 33 positions cannot split 2 ways: whole
    assert c.lengths == P("data")


def _k3_bytes():
    experts = 92 * 896 * 3 * 3072 * 3584 * (1 / 2 + 1 / 32)  # MXFP4: packed nibbles + one E8M0 byte per 32
    kda_state = 69 * 96 * 128 * 128 * 4  # per sequence, float32
    mla_per_token = 24 * (512 + 64) * 2  # bf16
    return experts, kda_state, mla_per_token


def test_plan_matches_hand_computed_k3_bytes():
    cfg = C.preset("k3")
    experts, kda_state, mla_per_token = _k3_bytes()
    assert kda_state == 434_110_464 and mla_per_token == 27_648  # FIELD_NOTES: ~0.43 GB, ~27.6 KB/token
    one = plan.make_plan(cfg, dict(data=1, expert=1, model=1), batch=8, context=131072)
    assert one.params["routed experts"] == experts
    assert one.cache["kda_state"] == 8 * kda_state
    assert one.cache["mla"] == 8 * 131072 * mla_per_token
    assert 1.55e12 < one.param_total < 1.57e12  # 1.446 TB experts + ~114 GB bf16 trunk (K3_SPEC: ~1.44 TB + ~109 GB)
    p = plan.make_plan(cfg, dict(data=1, expert=64, model=8), batch=8, context=131072)
    assert p.params["routed experts"] == experts / 512
    # batch 8 cannot split 64 ways: every chip holds all 8 sequences, heads split 8 ways, the latent cache's
    # positions 8 ways (it has no head axis)
    assert p.cache["kda_state"] == 8 * kda_state / 8
    assert p.cache["mla"] == 8 * 131072 * mla_per_token / 8
    assert any("replicated" in n for n in p.notes)
    # roofline: at least the local non-expert weights and the whole local MLA cache are read every step
    assert p.step_seconds(4.8e12) > (p.cache["mla"] + p.params["attention"]) / 4.8e12
    assert p.fits(plan.CHIPS["h200"]) and p.fits(plan.CHIPS["v6e"])  # ~23 GB per chip (48 GB with the cache whole)
    assert not one.fits(plan.CHIPS["v7x"])  # 1.56 TB on one chip


def test_plan_notes_what_the_layout_cannot_split(tiny):
    """The tiny K3 (4 heads) on model=8: attention replicated; a 33-token context: the latent cache whole over model;
    a 32-token one splits (no note)."""
    cfg, _ = tiny
    odd = plan.make_plan(cfg, dict(data=1, expert=1, model=8), batch=8, context=33)
    assert any("4 heads do not divide the model axis" in n for n in odd.notes), odd.notes
    assert any("does not split its 33 positions over the model axis" in n for n in odd.notes), odd.notes
    even = plan.make_plan(cfg, dict(data=1, expert=1, model=8), batch=8, context=32)
    assert not any("positions" in n for n in even.notes), even.notes
    assert even.cache["mla"] * 8 == odd.cache["mla"] * 32 // 33


def test_plan_cli(capsys):
    from kimi_jax.cli import main

    assert main(["plan", "--model", "k3", "--mesh", "data=1,expert=64,model=8", "--batch", "8",
                 "--context", "131072", "--hbm-bandwidth", "4.8e12"]) == 0
    out = capsys.readouterr().out
    assert "512 chips" in out and "routed experts" in out and "MLA latent cache" in out
    assert "ms/step" in out and "NVIDIA H200" in out and "TPU v7x" in out and "TPU v5p" in out
    # smallest fitting meshes: 1.56 TB of weights over 90% of HBM needs > 12.3 H200s, > 18.3 v5p, > 9.0 v7x chips
    assert main(["plan", "--model", "k3", "--mesh", "data=1,expert=2,model=8", "--batch", "8", "--context", "4096",
                 "--search", "--chips", "h200,v5p,v7x", "--prefill-chunk", "4096"]) == 0
    out = capsys.readouterr().out
    assert "prefill-chunk activations" in out and "MoE expert exchange (lossless)" in out
    smallest = {line.split()[1]: int(line.split()[2]) for line in out.split("smallest fitting meshes")[1].splitlines()
                if line.strip().startswith(("NVIDIA", "TPU"))}
    assert smallest == {"H200": 16, "v5p": 32, "v7x": 16}, smallest
    assert main(["plan", "--model", "k3", "--mesh", "data=1,expert=3,model=8"]) == 2  # 896 experts
    assert "does not divide the 896 routed experts" in capsys.readouterr().err
    assert main(["plan", "--model", "k3", "--mesh", "bogus"]) == 2


def test_ragged_dispatch_lowers_for_tpu_and_gpu(tiny):
    """The TPU/GPU exchange (ragged_all_to_all, not implemented by XLA:CPU) lowers for both platforms."""
    from flax import nnx
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, NamedSharding

    from kimi_jax.model.moe import MoE
    from kimi_jax.model.run import RunConfig

    cfg, _ = tiny
    # TPU with experts over `expert`; GPU with wide EP, experts over `expert` x `model` (a two-axis exchange)
    for platform, dev, lay in (
            ("tpu", AbstractDevice(device_kind="TPU v5p", num_cores=1, platform="tpu"), "tp_ep"),
            ("cuda", AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu"), "wide_ep")):
        mesh = AbstractMesh((1, 4, 2), sharding.MESH_AXES, axis_types=(AxisType.Auto,) * 3, abstract_device=dev)
        # reference kernels: this checks the exchange, not the (tiny-shape-limited) Pallas matmuls
        run = RunConfig(dtype=jnp.bfloat16, implementation="reference",
                        parallel=sharding.Parallel(mesh, sharding.layout(lay), dispatch="ragged"))
        moe = nnx.eval_shape(lambda: MoE(cfg.moe, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
        specs = sharding.param_specs(moe, mesh, lay)
        graphdef, state = nnx.split(moe)
        state = params.fill(state, {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, specs[k]))
                                    for k, v in params.leaves(state).items()})
        x = jax.ShapeDtypeStruct((4, 3, cfg.hidden_size), jnp.bfloat16)
        fn = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, run)[0])
        with jax.sharding.use_abstract_mesh(mesh):
            text = fn.trace(state, x).lower(lowering_platforms=(platform,)).as_text()
        assert "ragged_all_to_all" in text, platform


def test_capacity_exchange_is_lossless_unless_capped():
    """The CPU exchange on a one-chip axis: every (token, expert) pair comes back to its slot; with a capacity
    below the load, the pairs past it (in expert order) come back as zeros, the rest intact."""
    from jax.sharding import AxisType

    from kernels_pallas.experts import expert_parallel as ep

    mesh = jax.make_mesh((1,), ("expert",), axis_types=(AxisType.Auto,))
    z = jnp.arange(1.0, 5.0)[:, None] * jnp.ones((4, 3))  # token t carries value t + 1
    idx = jnp.array([[3, 0], [1, 2], [0, 3], [2, 1]])
    e_loc = 4

    def run(cap):
        def body(z, idx):
            e = idx.reshape(-1)
            local = lambda x, ids: x * (ids < e_loc)[:, None]  # an "expert" that returns its input row
            return ep._capacity_dispatch(z, e, jnp.ones_like(e, bool), 2, e_loc, 1, ("expert",), cap, local)
        return jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False)(z, idx)

    full = run(8)[:, 0].reshape(4, 2)
    assert (full == jnp.array([[1, 1], [2, 2], [3, 3], [4, 4]])).all()
    capped = run(3)[:, 0].reshape(4, 2)  # kept: the first 3 pairs by expert id: (t0, e0), (t2, e0), (t1, e1)
    assert (capped == jnp.array([[0, 1], [2, 0], [3, 0], [0, 0]])).all()
    with pytest.raises(sharding.ShardingError, match="dispatch='bogus'"):
        sharding.Parallel(mesh=sharding.abstract_mesh(1, 2, 2), dispatch="bogus")
