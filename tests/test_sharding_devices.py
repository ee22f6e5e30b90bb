"""On 8 simulated CPU devices: sharded runs equal the single-device run, and parameters really are sharded.

Every case loads the model with ``from_pretrained(path, mesh=...)`` (parameters read straight into their shards),
prefills 8 right-padded prompts and decodes greedily, next to the unsharded model on one device of the same
process (tests/sharding_worker.py). Models: the K3 fixture (whose rows 0-1 are also checked against Moonshot's
golden outputs), and HF Kimi Linear / Llama written by transformers with 8 heads and 8 experts.
Meshes (data, expert, model): tp = 1x1x8, ep = 1x8x1, mix = 2x2x2; layouts from kimi_jax/parallel/sharding.py. Every
kernel op runs inside shard_map on its local shard; some cases run the Pallas kernels (interpret mode) there.
"""

import pytest

from tests.parity import TOL
from tests.sharding_run import plan_vs_compiler, single_process
from tests.sharding_worker import CASES, SLOW_CASES, kernels, scanned


@pytest.fixture(scope="module")
def result():
    return single_process()


def _case(result, model, mesh, layout, impl=None, scan=False):
    for c in result["cases"]:
        if (c["model"], c["mesh"], c["layout"], c["kernels"], c["scan"]) == (model, mesh, layout, impl, scan):
            return c
    raise AssertionError(f"no result for {model} {mesh} {layout} kernels={impl} scan={scan}")


def _ids(case):
    return "-".join(c for c in case if c)


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_sharded_run_equals_single_device(result, case):
    c = _case(result, *case[:3], kernels(case), scanned(case))
    assert c["dispatch"] == case[3]
    assert c["max_logit"] > 1.0  # logits are O(1-5): the tolerance means something
    assert c["logits_err"] <= TOL["float32"], f"prefill logits differ by {c['logits_err']:.3g}"
    assert c["tokens_equal"], f"greedy tokens differ:\n{c['tokens']}\nvs single device\n" \
                              f"{result['baseline'][case[0]]['tokens']}"
    if case[0] == "k3":  # the fixture's own oracle, for the two golden prompts
        assert c["golden_logits_err"] <= TOL["float32"]
        assert c["golden_tokens_equal"]
    _check_expert_shards(c, case)
    if case[:2] == ("k3", "ep") and kernels(case) is None:  # kimi_jax.generate on the sharded model, too
        assert c["generate_tokens_equal"]


def _check_expert_shards(c, case):
    for name, p in c["params"].items():
        if ".experts." in name:  # wide EP: experts over expert x model, each whole on its device
            e = 1 if name.startswith("stack.") else 0  # scanned layers: [repetitions, experts, ...], stack unsplit
            shape, shard = p["shape"][e:], p["shard"][e:]
            n = c["sizes"]["expert"] * (c["sizes"]["model"] if case[2] == "wide_ep" else 1)
            assert shard[0] == shape[0] // n and p["shard"][:e] == p["shape"][:e], (name, p)
            if case[2] == "wide_ep":
                assert shard[1:] == shape[1:] and p["distinct"] == n, (name, p)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=[_ids(c) for c in SLOW_CASES])
def test_more_layouts_equal_single_device(case):
    test_sharded_run_equals_single_device(single_process("slow"), case)


def test_single_device_baselines_are_sane(result):
    k3 = result["baseline"]["k3"]
    assert k3["golden_logits_err"] <= TOL["float32"] and k3["golden_tokens_equal"]
    assert result["devices"] == 8


def _shard(c, name):
    p = c["params"][name]
    return tuple(p["shard"]), p


def test_expert_parallel_shards_experts(result):
    """Under EP each device holds E/8 experts and the 8 slices are all different (nothing replicated)."""
    for model, layer in (("k3", 1),):  # (Kimi Linear's EP case is -m slow)
        c = _case(result, model, "ep", "tp_ep")
        for name, p in c["params"].items():
            if ".experts." in name:
                assert p["shard"][0] == p["shape"][0] // 8 and p["distinct"] == 8, (model, name, p)
        # attention and caches run data-parallel over the expert axis: replicated weights, batch-split caches
        assert c["params"][f"layers.{layer}.self_attn.q_proj"]["distinct"] == 1
        assert c["cache"]["0.state"]["shard"][0] == 1 and all(c["cache_as_planned"].values())


def test_tensor_parallel_shards_heads_mlp_vocab(result):
    kl = _case(result, "kimi_linear", "tp", "tp_ep")  # 8 KDA / MLA heads, MLP 96, vocab 128
    assert _shard(kl, "layers.0.self_attn.q_proj")[0][0] == kl["params"]["layers.0.self_attn.q_proj"]["shape"][0] // 8
    assert _shard(kl, "layers.3.self_attn.o_proj")[0][1] == kl["params"]["layers.3.self_attn.o_proj"]["shape"][1] // 8
    assert _shard(kl, "layers.0.mlp.gate_proj")[0][0] == 96 // 8
    assert _shard(kl, "lm_head")[0][0] == 128 // 8 and _shard(kl, "embed_tokens")[0][0] == 128 // 8
    assert kl["cache"]["0.state"]["shard"][1] == 1  # one KDA head of 8 per device
    ll = _case(result, "llama", "tp", "tp_ep")  # 8 query heads split; 4 KV heads cannot split 8 ways
    assert _shard(ll, "layers.0.self_attn.q_proj")[0][0] == 64 // 8
    assert _shard(ll, "layers.0.self_attn.k_proj")[1]["distinct"] == 1
    k3 = _case(result, "k3", "tp", "tp_ep")  # 4 heads: attention stays whole; MLP and vocab split
    assert _shard(k3, "layers.1.self_attn.q_proj")[1]["distinct"] == 1
    assert _shard(k3, "layers.0.mlp.gate_proj")[0][0] == 256 // 8


def test_mixed_layout_shards_every_axis(result):
    for model, layer in (("k3", 3), ("kimi_linear", 3)):  # (the Llama-shaped model's mixed case is -m slow)
        c = _case(result, model, "mix", "tp_ep")
        assert c["sizes"] == {"data": 2, "expert": 2, "model": 2}
        q = c["params"][f"layers.{layer}.self_attn.o_proj"]
        assert q["shard"][1] == q["shape"][1] // 2
        w = c["params"]["layers.3.mlp.experts.w1" + (".packed" if model == "k3" else "")]
        assert w["shard"][:2] == [w["shape"][0] // 2, w["shape"][1] // 2] and w["distinct"] == 4
        # caches: batch over data x expert (8 / 4 = 2 sequences per device), heads over model
        assert all(c["cache_as_planned"].values()), c["cache_as_planned"]
        assert c["cache"]["0.state"]["shard"][0] == 2


def test_plan_matches_compiler_on_a_sliced_k3():
    """benchmarks/plan_vs_compiler.py on a 4-layer, 64-expert K3 decode step, 8 sequences of 2048 tokens, on a
    simulated data=1 x expert=4 x model=2 mesh: XLA's per-device memory analysis against the plan."""
    r = plan_vs_compiler("--layers", "4", "--experts", "64", "--mesh", "data=1,expert=4,model=2", "--batch", "8",
                         "--context", "2048")
    plan, xla = r["plan"], r["xla"]
    assert r["layers"] == 4 and r["experts"] == 64
    ids = 8 * 4 // 4  # the [8, 1] int32 token ids, split over expert
    assert plan["params"] + plan["cache"] + ids == xla["argument"]  # parameters and caches: exact to the byte
    assert abs(plan["total"] - xla["peak"]) <= 0.10 * xla["peak"], (plan, xla)


def test_scanned_layers_shard_their_stacked_weights(result):
    """The scanned K3 (layers 4-6 stacked): stacked weights keep their layers' split, whole over the repetitions;
    the stacked cache is split as the unrolled one (batch over data x expert)."""
    c = _case(result, "k3", "mix", "tp_ep", None, True)
    flat = _case(result, "k3", "mix", "tp_ep")
    w = c["params"]["stack.layers.0.mlp.experts.w1.packed"]
    ref = flat["params"]["layers.4.mlp.experts.w1.packed"]
    assert w["shape"] == [3, *ref["shape"]] and w["shard"] == [3, *ref["shard"]] and w["distinct"] == ref["distinct"]
    assert c["cache"]["stack.0.state"]["shard"][:2] == [3, 2] and all(c["cache_as_planned"].values())


def test_converted_orbax_checkpoint_restores_into_the_same_shards(result):
    """from_pretrained(orbax_dir, mesh=...) (converter output) = the sharded safetensors load, shard for shard."""
    r = result["orbax"]
    assert r["params"] > 100 and r["equal"] == r["params"] and r["same_sharding"] == r["params"], r
    assert r["sharded"] > 50 and r["parallel"]
