"""Hot experts: the most used routed experts of each MoE layer kept in device memory too, while every expert lives in
host memory (``RunConfig(offload=("experts",))``). A decode slot whose expert is hot reads the device copy; a cold one
copies its expert across the host link inside the other branch of a ``lax.cond`` (:func:`kimi_jax.model.offload.fetch_experts`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels_pallas._dispatch import host_slices
from kimi_jax.model.moe import MoE
from kimi_jax.model.offload import HotExperts, fetch_slots
from kimi_jax.model.quantize import check_calibration
from kimi_jax.model.run import check_offload


def expert_usage(model, ids, batch: int = 8) -> list:
    """How often each routed expert of each MoE layer is chosen while ``model`` runs on the token ids ``ids [B, T]``
    (padding counts like any token): one int64 array ``[E]`` per MoE layer, in layer order."""
    ids = check_calibration(ids, model.cfg.vocab_size)
    routers = nnx.jit(lambda m, x: m(x, return_router=True).router)
    counts = None
    for i in range(0, len(ids), batch):
        r = routers(model, jnp.asarray(ids[i:i + batch]))
        c = [np.bincount(np.asarray(idx).ravel(), minlength=model.cfg.moe.num_experts) for idx, _ in r]
        counts = c if counts is None else [a + b for a, b in zip(counts, c)]
    return counts


def routed_experts(model) -> list:
    """The routed-expert modules (:class:`kimi_jax.model.moe.Experts`) of an unscanned model, in layer order."""
    return [layer.mlp.experts for layer in getattr(model, "layers", ()) if isinstance(getattr(layer, "mlp", None), MoE)]


def keep_hot_experts(model, per_layer: int, usage) -> list:
    """Keep, of each MoE layer's host-resident routed experts, the ``per_layer`` most used (``usage``: counts per
    layer as :func:`expert_usage` returns them; ties go to the lower id) in device memory as well (a
    :class:`HotExperts` on the layer's ``Experts``); a decode step then copies across the host link only the experts
    outside that set that its tokens chose. ``per_layer`` 0 removes the hot sets. Call it before building a
    ``Generator`` (which captures the model's state). Returns the hot expert ids per layer.

    Refused before anything moves: a model whose run does not offload experts, scanned layers, a mesh, a usage list
    that does not match the model's MoE layers."""
    if "experts" not in check_offload(model.run.offload):
        raise ValueError("keep_hot_experts: the model's experts are not offloaded (RunConfig(offload=('experts',)))")
    if model.run.scan_layers or model.run.parallel is not None:
        raise ValueError("keep_hot_experts: unscanned layers on one device only (as expert offload itself)")
    layers = routed_experts(model)
    if layers and not host_slices(jax.tree.leaves(layers[0].weights()), model.run.placement):
        raise ValueError("keep_hot_experts: on this target these experts move whole layers at a time (8-bit fields, "
                         "see kernels_pallas._dispatch.host_slices); a hot set would only add device bytes")
    E = model.cfg.moe.num_experts if layers else 0
    if not 0 <= per_layer <= E:
        raise ValueError(f"keep_hot_experts: per_layer={per_layer} must lie in [0, {E}] (experts per layer)")
    if len(usage) != len(layers) or any(np.shape(u) != (E,) for u in usage):
        raise ValueError(f"keep_hot_experts: usage must hold {len(layers)} count arrays of shape ({E},), one per MoE "
                         f"layer; got {[np.shape(u) for u in usage]}")
    chosen = []
    for experts, counts in zip(layers, usage):
        if per_layer == 0:
            experts.hot_cache = None
            chosen.append([])
            continue
        top = np.sort(np.argsort(-np.asarray(counts), kind="stable")[:per_layer])
        slot = np.full((E,), -1, np.int32)
        slot[top] = np.arange(per_layer, dtype=np.int32)
        rows, _ = jax.jit(fetch_slots)(experts.weights(), jnp.asarray(top[None], jnp.int32))  # only these cross
        experts.hot_cache = HotExperts({"slot": jax.device_put(slot, jax.local_devices()[0]), "rows": rows})
        chosen.append(top.tolist())
    return chosen
