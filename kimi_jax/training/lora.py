"""LoRA: rank-``r`` adapters on the attention and MLP projections; the base weights stay frozen.

A projection ``W [out, in]`` becomes ``W + (alpha / r) * B @ A`` with ``A [r, in]`` (normal, std ``1/sqrt(in)``)
and ``B [out, r]`` (zeros, so training starts from the base model). The merged weight is formed inside the step
and passed to the unchanged model code: the adapters need no module of their own, and merging on export is the
same sum. Scanned stacks carry a leading repetition dimension on ``W``, ``A`` and ``B`` alike. Only the adapters
are differentiated and only they have optimizer state; the base is held outside the optimizer.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

ATTENTION = "self_attn"
MLP_NAMES = ("gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: int = 8
    alpha: float = 16.0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _name(path) -> str:
    return ".".join(str(k) for k in path)


def targeted(path, value) -> bool:
    """Attention projections (``self_attn.*_proj``, ``kv_a_proj_with_mqa``) and the gated MLPs' ``gate / up /
    down_proj`` (dense layers, shared experts), float matrices only (a packed or 1-D leaf is not adapted)."""
    path = tuple(str(k) for k in path)
    if not hasattr(value, "ndim") or not jnp.issubdtype(value.dtype, jnp.floating):
        return False
    per_layer = value.ndim - int(path[0] == "stack")
    if per_layer != 2:
        return False
    name = path[-1]
    attention = ATTENTION in path and (name.endswith("_proj") or name == "kv_a_proj_with_mqa")
    return attention or ("mlp" in path and name in MLP_NAMES)


def init(base_state, c: LoraConfig, key) -> dict:
    """Adapters ``{dotted path: {"a": [..., r, in], "b": [..., out, r]}}`` (float32) for every targeted leaf."""
    out = {}
    flat = [(tuple(p), v.get_value()) for p, v in nnx.to_flat_state(base_state)]
    keys = jax.random.split(key, max(len(flat), 1))
    for k, (path, w) in zip(keys, flat):
        if not targeted(path, w):
            continue
        *lead, o, i = w.shape
        a = jax.random.normal(k, (*lead, c.rank, i), jnp.float32) / jnp.sqrt(i)
        out[_name(path)] = {"a": a, "b": jnp.zeros((*lead, o, c.rank), jnp.float32)}
    return out


def delta(ad: dict, scale: float):
    """``scale * B @ A`` ``[..., out, in]`` float32."""
    return scale * jnp.einsum("...or,...ri->...oi", ad["b"], ad["a"], precision=jax.lax.Precision.HIGHEST)


def merged(base_state, adapters: dict, c: LoraConfig):
    """``base_state`` with every adapted weight replaced by ``W + scale * B @ A`` (in the base weight's dtype)."""
    flat = []
    for path, var in nnx.to_flat_state(base_state):
        ad = adapters.get(_name(path))
        if ad is not None:
            w = var.get_value()
            var = var.replace((w.astype(jnp.float32) + delta(ad, c.scale)).astype(w.dtype))
        flat.append((tuple(path), var))
    return nnx.from_flat_state(flat)
