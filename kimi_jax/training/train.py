"""The train step: one jitted function ``(TrainState, Batch) -> (TrainState, metrics)`` for all three families.

The model's parameters are split three ways (``nnx.split``): what the optimizer updates, the router correction
biases (moved by the expert load, :mod:`kimi_jax.training.balance`, never by the gradient) and anything else. With
LoRA the optimizer updates the adapters only and the whole base is frozen (:mod:`kimi_jax.training.lora`).
Parameters are float32 masters; the model computes in ``run.dtype`` (bf16: every product casts its weight, norms
round as in inference) -- pure float32 is ``dtype=float32``. MXFP4 experts are decoded to float32 before training
(:func:`prepare`) and re-quantized on export (:mod:`kimi_jax.training.export`).

On a mesh the batch is split over the batch axes (``data``, ``expert``) and every parameter, its optimizer moments
and its gradient take the inference layout (:func:`kimi_jax.parallel.sharding.param_specs`); XLA inserts the
gradient all-reduce. MoE layers run expert-parallel there as in inference (:mod:`kernels_pallas.experts.expert_parallel`):
the gradient flows back through the token exchange, and the router (outside that map) still reports every token's
experts, whose loads step the biases.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec

from kernels_pallas import mxfp4, packed
from kimi_jax.model.decoder import KimiModel
from kimi_jax.model.run import RunConfig
from kimi_jax.parallel import distributed, sharding
from kimi_jax.training import balance
from kimi_jax.training import lora as lora_lib
from kimi_jax.training.loss import causal_lm_loss
from kimi_jax.training.optim import OptimConfig, optimizer, schedule

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """``vocab_chunk``: vocabulary columns per step of the chunked loss. ``balance_rate``: the correction-bias
    step per update (DeepSeek-V3's gamma; 0 freezes the biases). ``lora``: train adapters only."""

    optim: OptimConfig = OptimConfig()
    vocab_chunk: int = 4096
    balance_rate: float = 1e-3
    lora: lora_lib.LoraConfig | None = None
    seed: int = 0


class Batch(NamedTuple):
    ids: jax.Array  # [B, T] int32
    mask: jax.Array  # [B, T] bool / 0-1: which tokens count as targets (padding: 0)


@struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: updates applied
    params: Any  # what the optimizer updates: nnx.State of the model's parameters, or the LoRA adapters dict
    frozen: Any  # LoRA: nnx.State of the frozen base parameters; else None
    bias: Any  # nnx.State of the router correction biases (empty for dense models)
    rest: Any  # nnx.State of any other model variables
    opt_state: Any


@dataclasses.dataclass(frozen=True, eq=False)
class Trainer:
    """What the step functions close over: the model's graph, the optimizer and the configs."""

    graphdef: Any
    tx: optax.GradientTransformation
    config: TrainConfig
    model_cfg: Any
    run: RunConfig
    plan: Any
    shardings: Any = None  # on a mesh: the TrainState's shardings, kept by every step

    def model(self, state: TrainState) -> KimiModel:
        """The model with ``state``'s parameters (LoRA adapters merged)."""
        return nnx.merge(self.graphdef, state.bias, self.model_params(state), state.rest)

    def model_params(self, state: TrainState):
        c = self.config.lora
        return state.params if c is None else lora_lib.merged(state.frozen, state.params, c)


def training_run(run: RunConfig) -> RunConfig:
    """``run`` with differentiable kernel choices: the plain-jnp references (the CPU native kernels and the Pallas
    kernels have no VJP, the XLA:CPU grouped matmul loops with traced bounds, which reverse-mode differentiation
    cannot run; its reference is ``lax.ragged_dot``), and the MoE as dense products on one device (the gathered
    path's reference loops too). Experts split over a mesh run expert-parallel, their local experts through the
    grouped matmul. Explicit choices other than the automatic ones are kept."""
    return dataclasses.replace(run, implementation=run.implementation or "reference",
                               moe_path="dense" if run.moe_path == "auto" else run.moe_path)


def prepare(model: KimiModel, dtype=None) -> KimiModel:
    """The model ready to train (in place): float parameters as float32 masters, MXFP4 experts decoded to float32,
    the run switched to :func:`training_run` (its ``dtype``: the compute dtype, or ``dtype`` when given)."""
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        v = var.get_value()
        if isinstance(v, mxfp4.MXFP4Weight):
            var.set_value(mxfp4.dequantize(v, F32))
        elif packed.is_packed(v):
            raise ValueError(f"cannot train a {type(v).__name__} weight: load the model without quantize=")
        elif jnp.issubdtype(v.dtype, jnp.floating):
            var.set_value(v.astype(F32))
    run = model.run if dtype is None else dataclasses.replace(model.run, dtype=jnp.dtype(dtype))
    model.run = training_run(run)
    return model


def init(model: KimiModel, config: TrainConfig = TrainConfig(), mesh=None,
         layout="tp_ep") -> tuple[Trainer, TrainState]:
    """A :class:`Trainer` and the first :class:`TrainState` of ``model`` (call :func:`prepare` first). With ``mesh``,
    the model runs on it (``RunConfig.parallel``) and the state is placed in the inference layout."""
    if mesh is not None:
        model.run = distributed.with_parallel(model.run, mesh, layout)
    graphdef, bias, params, rest = nnx.split(model, nnx.PathContains(balance.BIAS), nnx.Param, ...)
    frozen = None
    if config.lora is not None:
        frozen, params = params, lora_lib.init(params, config.lora, jax.random.key(config.seed))
    tx = optimizer(config.optim)
    trainer = Trainer(graphdef, tx, config, model.cfg, model.run, model.plan)
    state = TrainState(jnp.zeros((), jnp.int32), params, frozen, bias, rest, None)
    if mesh is not None:
        state = jax.device_put(state, state_shardings(model, state, mesh, layout))
    opt_state = jax.jit(tx.init)(state.params)
    if mesh is not None:
        shard = param_tree_shardings(model, state.params, mesh, layout)
        rep = NamedSharding(mesh, PartitionSpec())
        opt_state = optax.tree_map_params(tx, lambda p, s: jax.device_put(p, s), opt_state, shard,
                                          transform_non_params=lambda x: jax.device_put(x, rep))
    state = state.replace(opt_state=opt_state)
    if mesh is not None:
        trainer = dataclasses.replace(trainer, shardings=jax.tree.map(lambda x: x.sharding, state))
    return trainer, state


# -- shardings ---------------------------------------------------------------------------------------------


def _dotted(path) -> str:
    """A pytree key path as the dotted leaf name (the ``.value`` attribute of an nnx Variable left out)."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path
                    if not isinstance(k, jax.tree_util.GetAttrKey))


def param_tree_shardings(model, tree, mesh, layout="tp_ep"):
    """NamedShardings for a tree of model parameters (an ``nnx.State`` or the LoRA adapters dict): a model leaf
    takes its inference spec; anything else (adapters) is replicated."""
    specs = sharding.param_specs(model, mesh, layout)
    rep = PartitionSpec()
    return jax.tree_util.tree_map_with_path(
        lambda p, x: NamedSharding(mesh, specs.get(_dotted(p), rep)), tree)


def state_shardings(model, state: TrainState, mesh, layout="tp_ep"):
    rep = NamedSharding(mesh, PartitionSpec())
    tree = lambda t: None if t is None else param_tree_shardings(model, t, mesh, layout)  # noqa: E731
    return TrainState(rep, tree(state.params), tree(state.frozen), tree(state.bias), tree(state.rest), None)


def batch_sharding(shape, mesh, layout="tp_ep") -> NamedSharding:
    return NamedSharding(mesh, sharding.batch_spec(shape, mesh, layout))


# -- the step ----------------------------------------------------------------------------------------------


def _forward(trainer: Trainer, params, state: TrainState, batch: Batch):
    """(loss, (token count, router, per-layer hidden, AttnRes weights)) for ``params`` in place of
    ``state.params``."""
    cfg, c = trainer.model_cfg, trainer.config
    model = trainer.model(state.replace(params=params))
    out = model(batch.ids, return_hidden=True, return_router=True, return_attn_res=cfg.attn_res)
    head = model.embed_tokens[...] if cfg.tie_word_embeddings else model.lm_head[...]
    loss, count = causal_lm_loss(out.final_hidden, head, batch.ids, batch.mask, model.run, c.vocab_chunk)
    return loss, (count, out.router, out.hidden, out.attn_res_weights)


def loss_and_grads(trainer: Trainer, state: TrainState, batch: Batch):
    """(loss, grads of ``state.params``) -- for tests and the step."""
    (loss, _), grads = jax.value_and_grad(_forward, argnums=1, has_aux=True)(trainer, state.params, state, batch)
    return loss, grads


def _layer_of(name: str, plan):
    """(layer index or None for a global leaf, stacked: the leaf's leading dimension is the repetitions)."""
    parts = name.split(".")
    if parts[0] == "layers":
        return int(parts[1]), False
    if parts[0] == "stack":
        return int(parts[2]), True
    return None, False


def layer_norms(tree, num_layers: int, plan) -> jax.Array:
    """Per-layer L2 norm ``[num_layers]`` of a parameter-shaped tree (gradients), by each leaf's layer."""
    sq = [jnp.zeros((), F32)] * num_layers
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = _dotted(path)
        layer, stacked = _layer_of(name, plan)
        if layer is None:
            continue
        x = x.astype(F32)
        if stacked:  # j = position in the group; rows g are repetitions
            per = jnp.sum(x.reshape(x.shape[0], -1) ** 2, axis=-1)
            for g in range(plan.count):
                i = plan.layer(layer, g)
                sq[i] = sq[i] + per[g]
        else:
            sq[layer] = sq[layer] + jnp.sum(x * x)
    return jnp.sqrt(jnp.stack(sq))


def signals(trainer: Trainer, router, hidden, attn_res, mask_BT) -> dict:
    """What a step reports about the model: expert load fractions per MoE layer ``[n_moe, E]``, per-layer output
    RMS ``[L]`` over valid tokens, and each AttnRes mix's mean weights (a tuple of ``[n_sources]``)."""
    cfg = trainer.model_cfg
    w = mask_BT.astype(F32)
    n = jnp.maximum(jnp.sum(w), 1.0)
    out = {"layer_out_rms": jnp.stack([jnp.sqrt(jnp.sum(jnp.mean(h.astype(F32) ** 2, -1) * w) / n) for h in hidden])}
    if router:
        E = cfg.moe.num_experts
        loads = jnp.stack([balance.expert_load(idx, mask_BT, E) for idx, _ in router])
        out["expert_load"] = loads / jnp.maximum(jnp.sum(loads, -1, keepdims=True), 1.0)
    if attn_res:
        out["attn_res"] = tuple(jnp.sum(a * w, axis=(1, 2)) / n for a in attn_res)
    return out


def train_step(trainer: Trainer, state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
    """One update: loss and gradients, clip + AdamW, the correction-bias step from this batch's expert load."""
    cfg = trainer.model_cfg
    (loss, (count, router, hidden, attn_res)), grads = jax.value_and_grad(_forward, argnums=1, has_aux=True)(
        trainer, state.params, state, batch)
    updates, opt_state = trainer.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    bias = state.bias
    if router and trainer.config.balance_rate:
        loads = {layer: balance.expert_load(idx, batch.mask, cfg.moe.num_experts)
                 for layer, (idx, _) in zip(cfg.moe_layers, router)}
        bias = balance.update_biases(state.bias, loads, trainer.config.balance_rate, trainer.plan)
    metrics = {"loss": loss, "tokens": count, "grad_norm": optax.global_norm(grads),
               "lr": schedule(trainer.config.optim)(state.step),
               "layer_grad_norm": layer_norms(grads, cfg.num_layers, trainer.plan),
               **signals(trainer, router, hidden, attn_res, batch.mask)}
    new = state.replace(step=state.step + 1, params=params, bias=bias, opt_state=opt_state)
    if trainer.shardings is not None:  # the compiler would otherwise choose the outputs' layout
        new = jax.lax.with_sharding_constraint(new, trainer.shardings)
    return new, metrics


def eval_loss(trainer: Trainer, state: TrainState, batch: Batch):
    """(mean next-token loss, counted tokens) of ``batch`` under ``state``."""
    loss, (count, *_) = _forward(trainer, state.params, state, batch)
    return loss, count


def compile_steps(trainer: Trainer):
    """``(train_step, eval_loss)`` jitted over ``(state, batch)``; the train step donates the state."""
    step = jax.jit(lambda s, b: train_step(trainer, s, b), donate_argnums=0)
    ev = jax.jit(lambda s, b: eval_loss(trainer, s, b))
    return step, ev
