"""Training: the loss and gradients against torch autograd on HF models, the optimizer against AdamW's formula
written out by hand, the balancing update against a hand calculation, LoRA's frozen base, rematerialisation.

Oracles: HF transformers' ``LlamaForCausalLM`` / ``KimiLinearForCausalLM`` (float32, ``labels=``, ``.backward()``),
``jax.nn.log_softmax`` on full logits, numpy arithmetic in the tests themselves.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file

import kimi_jax
from kimi_jax import training
from kimi_jax.checkpoint import names
from kimi_jax.model import config as C
from kimi_jax.model import params as params_lib
from kimi_jax.model.run import RunConfig
from kimi_jax.training import balance
from tests.parity import errors

GRAD_RTOL = 2e-4  # max |ours - torch| / max |torch| per parameter, float32


# -- the loss ----------------------------------------------------------------------------------------------


def _tiny_llama():
    from kimi_jax.checkpoint.synthetic import llama_config_dict

    cfg = C.from_dict(llama_config_dict())
    return training.prepare(kimi_jax.KimiModel(cfg, run=RunConfig(dtype=jnp.float32), param_dtype=jnp.float32))


@pytest.mark.parametrize("chunk", [256, 96, 1000])
def test_chunked_loss_equals_full_softmax(chunk):
    """Chunks that divide V, that do not (last chunk padded), one chunk larger than V; padding masked."""
    model = _tiny_llama()
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 256, (3, 17)), jnp.int32)
    mask = jnp.asarray(np.arange(17)[None] < np.array([17, 11, 5])[:, None])
    graphdef, state = nnx.split(model)

    def chunked(state):
        m = nnx.merge(graphdef, state)
        out = m(ids, return_hidden=True)
        return training.causal_lm_loss(out.final_hidden, m.lm_head[...], ids, mask, m.run, chunk)[0]

    def full(state):
        logp = jax.nn.log_softmax(nnx.merge(graphdef, state)(ids).logits[:, :-1], axis=-1)
        nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
        w = mask[:, 1:].astype(jnp.float32)
        return jnp.sum(nll * w) / jnp.sum(w)

    (a, ga), (b, gb) = jax.value_and_grad(chunked)(state), jax.value_and_grad(full)(state)
    assert 3.0 < float(b) < 10.0
    assert abs(float(a) - float(b)) < 1e-5
    for (p, x), (_, y) in zip(jax.tree_util.tree_flatten_with_path(ga)[0], jax.tree_util.tree_flatten_with_path(gb)[0]):
        assert errors(x, y)[0] <= 1e-5 * max(1.0, float(jnp.max(jnp.abs(y)))), jax.tree_util.keystr(p)


# -- gradient parity with HF (torch autograd) --------------------------------------------------------------


def _hf_to_file_names(name: str, value: np.ndarray, cfg) -> dict:
    """An in-memory HF parameter (transformers 5 fuses some) as the tensors ``save_pretrained`` writes."""
    import re

    m = re.fullmatch(r"model\.layers\.(\d+)\.(.*)", name)
    if m is None:
        return {name: value}
    i, rest = m.groups()
    p = f"model.layers.{i}."
    if rest == "self_attn.conv1d.weight":  # q, k, v depthwise convs concatenated over channels
        return {p + f"self_attn.{n}_conv1d.weight": part for n, part in zip("qkv", np.split(value, 3, axis=0))}
    if rest.startswith("self_attn.forget_gate."):
        return {p + "self_attn." + rest[len("self_attn.forget_gate."):]: value}
    if rest == "mlp.experts.gate_up_proj":  # [E, 2F, D]: w1 (gate) then w3 (up)
        w1, w3 = np.split(value, 2, axis=1)
        return {p + f"block_sparse_moe.experts.{e}.{w}.weight": arr[e] for e in range(value.shape[0])
                for w, arr in (("w1", w1), ("w3", w3))}
    if rest == "mlp.experts.down_proj":
        return {p + f"block_sparse_moe.experts.{e}.w2.weight": value[e] for e in range(value.shape[0])}
    if cfg.family == "kimi_linear" and rest.startswith("mlp."):  # dense layers too (the save-time rename)
        return {p + "block_sparse_moe." + rest[4:]: value}
    return {name: value}


def _hf_file_tensors(hf_model, cfg, what):
    out = {}
    for name, p in hf_model.named_parameters():
        t = p if what == "value" else p.grad
        if t is not None:
            out.update(_hf_to_file_names(name, t.detach().numpy(), cfg))
    return out


def _grad_parity(path, hf_model, vocab, T, seed):
    """Loss and every parameter's gradient, ours vs torch, on one right-padded batch. Returns the worst errors."""
    cfg = C.load(path)
    # the name mapping above is proven on the values first: the in-memory weights, renamed, are the saved file
    saved, renamed = load_file(f"{path}/model.safetensors"), _hf_file_tensors(hf_model, cfg, "value")
    for k, v in renamed.items():
        np.testing.assert_array_equal(v, saved[k], err_msg=k)
    assert set(saved) - set(renamed) <= {k for k in saved if "e_score_correction_bias" in k}

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2, T), generator=g)
    lengths = [T, T - 7]
    mask = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
    labels = torch.where(mask, ids, -100)
    hf_model.zero_grad()
    ref = hf_model(ids, labels=labels).loss
    ref.backward()
    ref_grads = _hf_file_tensors(hf_model, cfg, "grad")

    model = training.prepare(kimi_jax.from_pretrained(path, dtype="float32", progress=False))
    trainer, state = training.init(model, training.TrainConfig(vocab_chunk=48))
    batch = training.Batch(jnp.asarray(ids.numpy(), jnp.int32), jnp.asarray(mask.numpy()))
    loss, grads = jax.jit(lambda s, b: training.loss_and_grads(trainer, s, b))(state, batch)
    loss_err = abs(float(loss) - ref.item())
    ours = params_lib.leaves(grads)
    targets = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in params_lib.leaves(state.params).items()}
    placements, _ = names.assign(list(ref_grads), cfg, targets)  # every gradient tensor fills exactly one leaf
    worst, rows = (0.0, ""), 0
    for pl in placements:
        g_ours = np.asarray(ours[pl.target])
        if pl.expert is not None:
            g_ours = g_ours[pl.expert]
        g_ref = pl.transform(ref_grads[pl.tensor], pl.tensor, g_ours.shape)
        max_abs, _ = errors(g_ours, g_ref)
        scale = float(np.max(np.abs(g_ref)))
        assert scale > 0, f"{pl.tensor}: zero gradient in torch, the comparison would mean nothing"
        rel = max_abs / scale
        worst = max(worst, (rel, pl.tensor))
        rows += 1
    print(f"\n{path}: loss {float(loss):.6f} vs torch {ref.item():.6f} (|diff| {loss_err:.2e}); "
          f"{rows} gradient tensors, worst max|diff|/max|grad| {worst[0]:.2e} ({worst[1]})")
    assert rows == len(ref_grads)
    return loss_err, worst


def test_llama_loss_and_grads_match_torch(hf_llama):
    path, hf_model = hf_llama
    loss_err, (rel, name) = _grad_parity(path, hf_model, 256, 24, seed=11)
    assert loss_err < 1e-5 and rel < GRAD_RTOL, (loss_err, rel, name)


def test_kimi_linear_loss_and_grads_match_torch(hf_kimi_linear):
    path, hf_model = hf_kimi_linear
    loss_err, (rel, name) = _grad_parity(path, hf_model, 128, 24, seed=12)
    assert loss_err < 1e-5 and rel < GRAD_RTOL, (loss_err, rel, name)


# -- the optimizer: AdamW written out -----------------------------------------------------------------------


def test_optimizer_matches_adamw_formula():
    """clip_by_global_norm, then AdamW with bias correction and decoupled weight decay (matrices only), on the
    warmup + cosine schedule, each written here from its documented formula."""
    c = training.OptimConfig(lr=0.1, steps=6, warmup=2, final_lr_frac=0.1, b1=0.9, b2=0.95, eps=1e-8,
                             weight_decay=0.1, clip=1.0)
    rng = np.random.default_rng(0)
    p = {"w": rng.standard_normal((3, 4)).astype(np.float32), "b": rng.standard_normal(4).astype(np.float32)}
    grads = [{k: (2.0 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in p.items()} for _ in range(5)]
    tx = training.optimizer(c)
    ours = jax.tree.map(jnp.asarray, p)
    opt = tx.init(ours)
    for g in grads:
        upd, opt = tx.update(jax.tree.map(jnp.asarray, g), opt, ours)
        ours = jax.tree.map(lambda a, u: a + u, ours, upd)

    def lr(t):
        if t < c.warmup:
            return c.lr * t / c.warmup
        frac = (t - c.warmup) / (c.steps - c.warmup)
        end = c.lr * c.final_lr_frac
        return end + (c.lr - end) * 0.5 * (1 + math.cos(math.pi * frac))

    ref = {k: v.astype(np.float64) for k, v in p.items()}
    m = {k: np.zeros_like(v) for k, v in ref.items()}
    v2 = {k: np.zeros_like(v) for k, v in ref.items()}
    for t, g in enumerate(grads):
        norm = math.sqrt(sum(float(np.sum(x.astype(np.float64) ** 2)) for x in g.values()))
        f = min(1.0, c.clip / norm)
        for k in ref:
            gk = g[k].astype(np.float64) * f
            m[k] = c.b1 * m[k] + (1 - c.b1) * gk
            v2[k] = c.b2 * v2[k] + (1 - c.b2) * gk * gk
            mhat, vhat = m[k] / (1 - c.b1 ** (t + 1)), v2[k] / (1 - c.b2 ** (t + 1))
            decay = c.weight_decay * ref[k] if ref[k].ndim >= 2 else 0.0
            ref[k] = ref[k] - lr(t) * (mhat / (np.sqrt(vhat) + c.eps) + decay)
    for k in ref:
        np.testing.assert_allclose(np.asarray(ours[k]), ref[k], rtol=0, atol=2e-6, err_msg=k)
    assert not np.allclose(np.asarray(ours["w"]), p["w"], atol=1e-3)  # it moved


# -- balancing: a hand calculation --------------------------------------------------------------------------


def test_balance_update_hand_calculation():
    # 2 sequences x 3 tokens, top-2 of 4 experts; the last token of sequence 1 is padding.
    idx = jnp.array([[[0, 1], [0, 2], [0, 1]], [[3, 0], [1, 0], [2, 3]]], jnp.int32)
    mask = jnp.array([[1, 1, 1], [1, 1, 0]])
    load = balance.expert_load(idx, mask, 4)
    # valid pairs: e0: 5 (tokens (0,0) (0,1) (0,2) (1,0) (1,1)), e1: 3, e2: 1, e3: 1; mean 10 / 4 = 2.5
    np.testing.assert_array_equal(np.asarray(load), [5, 3, 1, 1])
    bias = jnp.array([0.5, -0.25, 0.0, 0.125], jnp.float32)
    new = balance.bias_step(bias, load, 0.01)
    np.testing.assert_allclose(np.asarray(new), [0.5 - 0.01, -0.25 - 0.01, 0.0 + 0.01, 0.125 + 0.01], atol=0)
    even = balance.bias_step(bias, jnp.full((4,), 2.0), 0.01)  # balanced: no move
    np.testing.assert_array_equal(np.asarray(even), np.asarray(bias))


def test_train_step_moves_bias_by_load_not_gradient():
    """In a K3 step each layer's correction bias moves by exactly rate * sign(mean - load) of that step's routing
    (recomputed here from the model's own router outputs), and every other parameter is left to AdamW."""
    cfg = C.from_dict(C.tiny_k3_config_dict()).sliced(num_layers=3)
    model = training.prepare(kimi_jax.KimiModel(cfg, run=RunConfig(dtype=jnp.float32), param_dtype=jnp.float32))
    rate = 0.05
    trainer, state = training.init(model, training.TrainConfig(balance_rate=rate))
    ids = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
    mask = jnp.ones_like(ids).at[1, 9:].set(0)
    router = trainer.model(state)(ids, return_router=True).router
    before = {k: np.asarray(v) for k, v in params_lib.leaves(state.bias).items()}
    state, _ = jax.jit(lambda s, b: training.train_step(trainer, s, b))(state, training.Batch(ids, mask))
    after = params_lib.leaves(state.bias)
    assert len(before) == len(router) == 2
    for (name, b0), (idx, _) in zip(sorted(before.items()), router):
        hits = np.zeros(cfg.moe.num_experts)
        for bb in range(2):
            for t in range(12):
                if mask[bb, t]:
                    for e in np.asarray(idx)[bb, t]:
                        hits[e] += 1
        want = b0 + rate * np.sign(hits.mean() - hits)
        np.testing.assert_allclose(np.asarray(after[name]), want, atol=1e-7, err_msg=name)


# -- LoRA ----------------------------------------------------------------------------------------------------


def test_lora_trains_adapters_and_leaves_base_bit_for_bit():
    model = _tiny_llama()
    base_before = {k: np.array(v) for k, v in params_lib.leaves(nnx.state(model, nnx.Param)).items()}
    config = training.TrainConfig(optim=training.OptimConfig(lr=1e-2, warmup=0, steps=10),
                                  lora=training.LoraConfig(rank=4, alpha=8))
    trainer, state = training.init(model, config)
    names_ = sorted(state.params)
    assert "layers.0.self_attn.q_proj" in names_ and "layers.1.mlp.down_proj" in names_
    assert not any("norm" in n or "embed" in n or "lm_head" in n for n in names_)
    step, evaluate = training.compile_steps(trainer)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 256, (4, 16)), jnp.int32)
    batch = training.Batch(ids, jnp.ones_like(ids))
    first = float(evaluate(state, batch)[0])
    for _ in range(5):
        state, metrics = step(state, batch)
    assert float(evaluate(state, batch)[0]) < first - 0.05
    for k, v in params_lib.leaves(state.frozen).items():
        np.testing.assert_array_equal(np.asarray(v), base_before[k], err_msg=k)  # bit for bit
    # merge on export: the merged model's logits equal base + scale * B @ A applied by hand
    merged = params_lib.leaves(nnx.state(trainer.model(state), nnx.Param))
    ad = state.params["layers.0.self_attn.q_proj"]
    want = base_before["layers.0.self_attn.q_proj"] + 2.0 * np.asarray(ad["b"]) @ np.asarray(ad["a"])
    np.testing.assert_allclose(np.asarray(merged["layers.0.self_attn.q_proj"]), want, atol=1e-6)
    assert np.abs(np.asarray(ad["b"])).max() > 0


# -- rematerialisation -----------------------------------------------------------------------------------------


@pytest.mark.slow  # ~20 s each on 2 cores (CI time)
@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_remat_changes_nothing_but_memory(scan):
    cfg = C.from_dict(C.tiny_k3_config_dict()).sliced(num_layers=5)
    grads, marks = [], []
    for remat in (False, True):
        run = RunConfig(dtype=jnp.float32, remat=remat, scan_layers=scan)
        model = training.prepare(kimi_jax.KimiModel(cfg, run=run, param_dtype=jnp.float32))
        trainer, state = training.init(model)
        ids = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 8)), jnp.int32)
        fn = jax.jit(lambda s, b: training.loss_and_grads(trainer, s, b))
        grads.append(fn(state, training.Batch(ids, jnp.ones_like(ids))))
        jaxpr = str(jax.make_jaxpr(lambda s, b: training.loss_and_grads(trainer, s, b))(
            state, training.Batch(ids, jnp.ones_like(ids))))
        marks.append(jaxpr.count("checkpoint[") + jaxpr.count("remat2["))
    # the chunked loss is rematerialised either way; remat adds one per layer (one for the scanned stack's body)
    assert marks[1] >= marks[0] + (1 if scan else cfg.num_layers), marks
    assert abs(float(grads[0][0]) - float(grads[1][0])) < 1e-6
    for a, b in zip(jax.tree.leaves(grads[0][1]), jax.tree.leaves(grads[1][1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)  # fusion order only


def test_bf16_compute_keeps_f32_masters():
    """bf16 compute, float32 master weights: the step's loss is the f32 loss to bf16 accuracy, the parameters and
    the optimizer moments stay float32, and the update is the f32 run's to a bf16 gradient's accuracy."""
    ids = jnp.asarray(np.random.default_rng(4).integers(0, 256, (2, 16)), jnp.int32)
    batch = training.Batch(ids, jnp.ones_like(ids))
    out = {}
    for dt in ("float32", "bfloat16"):
        model = training.prepare(_tiny_llama(), dtype=dt)
        assert model.run.dtype == jnp.dtype(dt)
        trainer, state = training.init(model, training.TrainConfig(optim=training.OptimConfig(lr=1e-3, warmup=0)))
        state, m = jax.jit(lambda s, b: training.train_step(trainer, s, b))(state, batch)
        out[dt] = (float(m["loss"]), params_lib.leaves(state.params))
        assert all(v.dtype == jnp.float32 for v in out[dt][1].values())
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.opt_state) if x.ndim)
    assert abs(out["float32"][0] - out["bfloat16"][0]) < 5e-2
    moved = [float(np.max(np.abs(np.asarray(out["bfloat16"][1][k]) - np.asarray(out["float32"][1][k]))))
             for k in out["float32"][1]]
    assert max(moved) <= 2.1e-3  # Adam moves every weight by at most ~lr: bf16 gradients change signs, not scale
