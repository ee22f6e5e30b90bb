"""Auxiliary-loss-free expert balancing (DeepSeek-V3 §2.1.2, the K3 recipe): the router's correction bias is moved
by a fixed step towards balance after every training step, never by the gradient.

The bias only decides *which* experts a token visits (``kimi_jax.model.moe.route``: the top-k of score + bias);
the combine weights are the unbiased scores, so the bias has no gradient to follow. Per MoE layer, with ``load_e``
the (token, expert) pairs routed to expert ``e`` in the step's batch (valid tokens only) and ``mean`` their average
over experts, ``bias_e += rate * sign(mean - load_e)``: overloaded experts become less attractive, underloaded
ones more.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_jax.model.layer_plan import LayerPlan

BIAS = "e_score_correction_bias"


def expert_load(idx_BTX, mask_BT, num_experts: int):
    """Pairs routed to each expert, float32 ``[E]``: one per (valid token, chosen slot)."""
    hits = jax.nn.one_hot(idx_BTX, num_experts, dtype=jnp.float32)  # [B, T, X, E]
    return jnp.einsum("btxe,bt->e", hits, mask_BT.astype(jnp.float32))


def bias_step(bias_E, load_E, rate: float):
    """``bias + rate * sign(mean(load) - load)`` (float32)."""
    return (bias_E.astype(jnp.float32) + rate * jnp.sign(jnp.mean(load_E) - load_E)).astype(bias_E.dtype)


def update_biases(bias_state, loads: dict, rate: float, plan: LayerPlan):
    """``bias_state`` (the nnx state of every correction bias) with each layer's bias stepped by
    :func:`bias_step`; ``loads``: MoE layer index -> load ``[E]``. A scanned stack's bias ``[count, E]`` steps
    each repetition by its own layer's load."""
    flat = []
    for path, var in nnx.to_flat_state(bias_state):
        path = tuple(path)
        value = var.get_value()
        if path[0] == "stack":  # ("stack", "layers", j, "mlp", BIAS): rows are repetitions g
            j = path[2]
            load = jnp.stack([loads[plan.layer(j, g)] for g in range(plan.count)])
            value = jax.vmap(lambda b, l: bias_step(b, l, rate))(value, load)
        else:  # ("layers", i, "mlp", BIAS)
            value = bias_step(value, loads[path[1]], rate)
        flat.append((path, var.replace(value)))
    return nnx.from_flat_state(flat)
