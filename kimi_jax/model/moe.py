"""Mixture of experts: sigmoid router with bias-corrected top-k, routed experts (optionally behind K3's
latent projection, optionally MXFP4-packed), and shared experts.

Router (float32 end to end): ``s = sigmoid(x @ W_r^T)``; the correction bias only affects *which* experts are
chosen; their weights are the unbiased scores, renormalised and scaled. Expert outputs are combined in float32
with one rounding (the reference's ``moe_infer``). "float32": the run's compute dtype (float64 in a float64 run).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import kernels_pallas.experts as expert_ops
from kernels_pallas import packed as packed_types
from kernels_pallas.mxfp4 import MXFP4Weight
from kimi_jax.model import offload
from kimi_jax.model.config import MoEConfig
from kimi_jax.model.layers import F32, MLP, glu, linear, param, rms_norm
from kimi_jax.model.run import RunConfig


def route(x_ND, w_ED, bias_E, cfg: MoEConfig, dtype=F32):
    """Returns (idx [N, X] int32, weights [N, X] float32); ``dtype``: the compute dtype (a run's)."""
    logits = jnp.einsum("nd,ed->ne", x_ND.astype(dtype), w_ED.astype(dtype), precision=jax.lax.Precision.HIGHEST)
    scores = jax.nn.sigmoid(logits)
    choice = scores + bias_E.astype(dtype)
    if cfg.n_group > 1:
        # DeepSeek-style group limiting: keep the topk_group groups with the best top-2 sums.
        grouped = choice.reshape(choice.shape[0], cfg.n_group, -1)
        group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)
        keep = jax.lax.top_k(group_score, cfg.topk_group)[1]
        mask = jnp.zeros_like(group_score, bool).at[jnp.arange(choice.shape[0])[:, None], keep].set(True)
        choice = jnp.where(jnp.repeat(mask, grouped.shape[-1], axis=-1), choice, -jnp.inf)
    idx = jax.lax.top_k(choice, cfg.top_k)[1]
    w = jnp.take_along_axis(scores, idx, axis=-1)
    if cfg.renormalize:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return idx.astype(jnp.int32), w * cfg.scaling_factor


class Experts(nnx.Module):
    """Routed experts stacked per layer: w1 (gate) / w3 (up) ``[E, F, L]``, w2 (down) ``[E, L, F]``.

    With MXFP4 each weight is one :class:`~kernels_pallas.mxfp4.MXFP4Weight` (uint8 codes and scales), kept packed in
    device memory and decoded next to the matmul. With ``RunConfig(offload=("experts",))`` the weights live in host
    memory: a decode-sized call (the gather path) moves only the experts its tokens chose (every field), a larger one
    its layer's whole stack (:func:`kimi_jax.model.offload.fetch_experts`).
    """

    def __init__(self, cfg: MoEConfig, *, param_dtype, rngs):
        self.cfg = cfg
        E, F, L = cfg.num_experts, cfg.expert_intermediate, cfg.expert_in
        shapes = {"w1": ((E, F, L), ("expert", "expert_mlp", None)),
                  "w3": ((E, F, L), ("expert", "expert_mlp", None)),
                  "w2": ((E, L, F), ("expert", None, "expert_mlp"))}
        packed = MXFP4Weight if cfg.quant == "mxfp4" else None
        for name, (shape, axes) in shapes.items():
            setattr(self, name, param(rngs, shape, axes, param_dtype, packed=packed))
        self.hot_cache = nnx.data(None)  # offload.HotExperts: experts kept on the device too (hot_experts.py)

    def weight(self, name):
        """A float array or a packed weight (:mod:`kernels_pallas.packed`)."""
        return getattr(self, name).get_value()

    @property
    def packed(self) -> bool:
        """The expert weights are a packed type (MXFP4), not float arrays."""
        return packed_types.is_packed(self.weight("w1"))

    def path(self, pairs: int, run: RunConfig) -> str:
        """How ``pairs`` (token, expert) pairs run (:func:`kernels_pallas.experts.choose_path`)."""
        float32 = not self.packed and jnp.dtype(run.dtype) == F32
        return expert_ops.choose_path(pairs, self.cfg.num_experts, float32=float32,
                                      implementation=run.implementation,
                                      placement=run.placement, requested=run.moe_path)

    def fetch(self, idx_NX, run: RunConfig, after=None):
        """(the weights in device memory, the ids that index them): with experts offloaded, only the chosen ones
        when the products gather (no more pairs than experts), else the layer's whole stack once ``after`` is
        ready (:func:`kimi_jax.model.offload.fetch_experts`); unchanged otherwise."""
        pairs = idx_NX.size
        routed = offload.fetches_routed(pairs, self.cfg.num_experts, self.path(pairs, run))
        hot = None if self.hot_cache is None else self.hot_cache.get_value()
        return offload.fetch_experts(self.weights(), idx_NX, run, routed=routed, after=after, hot=hot)

    def act(self, a, b, run: RunConfig):
        c = self.cfg
        return glu(a.astype(run.dtype), b.astype(run.dtype), c.act, c.situ_beta, c.situ_linear_beta, run)

    def weights(self) -> dict:
        """``{"w1", "w3", "w2"}``: float arrays or :class:`MXFP4Weight`."""
        return {name: self.weight(name) for name in ("w1", "w3", "w2")}

    def __call__(self, z_NL, idx_NX, run: RunConfig):
        """Each token's chosen experts applied to it: ``[N, X, L]`` in the run dtype (on a mesh: the expert-parallel
        exchange)."""
        return self.with_shared(z_NL, idx_NX, run)[0]

    def with_shared(self, z_NL, idx_NX, run: RunConfig, shared=None, after=None):
        """:meth:`__call__`, and the shared experts' output ``[N, D]`` when the path ran them beside the routed ones
        (else None): :func:`kernels_pallas.experts.routed_experts` (``shared``: a
        :class:`kernels_pallas.experts.Shared`). ``after``: what a whole-layer copy of offloaded weights waits for
        (default ``z_NL``)."""
        if run.parallel is not None and "experts" in run.offload:
            raise ValueError("offload='experts' runs on one device for now: the expert-parallel dispatch "
                             "(kernels_pallas/experts/expert_parallel.py) reads the weights where they live")
        w, ids = self.fetch(idx_NX, run, after=z_NL if after is None else after)
        exchange = None
        if run.parallel is not None:
            par = run.parallel
            exchange = expert_ops.Exchange(par.param_value_specs(self), par.dispatch, par.capacity_factor)
        return expert_ops.routed_experts(z_NL, w, ids, act=lambda a, b: self.act(a, b, run), compute_dtype=run.dtype,
                                         precision=run.precision, implementation=run.implementation,
                                         path=run.moe_path, placement=run.placement, exchange=exchange,
                                         shared=shared)


class MoE(nnx.Module):
    def __init__(self, cfg: MoEConfig, *, param_dtype, rngs):
        self.cfg = cfg
        D, E = cfg.hidden, cfg.num_experts
        self.gate = param(rngs, (E, D), (None, "embed"), param_dtype)
        self.e_score_correction_bias = param(rngs, (E,), (None,), F32, std=0.1)
        if cfg.latent is not None:
            self.routed_expert_down_proj = param(rngs, (cfg.latent, D), ("latent", "embed"), param_dtype)
            if cfg.latent_norm:
                self.routed_expert_norm = param(rngs, (cfg.latent,), ("latent",), param_dtype, init="ones")
            self.routed_expert_up_proj = param(rngs, (D, cfg.latent), ("embed", "latent"), param_dtype)
        self.experts = Experts(cfg, param_dtype=param_dtype, rngs=rngs)
        if cfg.num_shared:
            self.shared_experts = MLP(cfg.shared_mlp(), param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x_BTD, run: RunConfig, after=None):
        """Returns (y_BTD, (idx [B,T,X], weights [B,T,X])). ``after``: what a whole-layer copy of host-offloaded
        experts waits for (the decoder passes the previous layer's input, so the copy overlaps that layer; default:
        ``x_BTD``)."""
        c = self.cfg
        B, T, D = x_BTD.shape
        x = x_BTD.reshape(B * T, D)
        idx, w = route(x, self.gate[...], self.e_score_correction_bias[...], c, run.compute_dtype)
        shared = None
        if c.num_shared:
            sh = self.shared_experts
            act = lambda a, b: glu(a, b, sh.cfg.act, sh.cfg.situ_beta, sh.cfg.situ_linear_beta, run)  # noqa: E731
            shared = expert_ops.Shared(x, sh.gate_proj[...], sh.up_proj[...], sh.down_proj[...], act)
        # Offloaded experts start moving in Experts (the routed ones once the router has chosen); the latent
        # projection and the shared experts need none of them and run while they move.
        out, shared_out = self.experts.with_shared(self._latent(x, run), idx, run, shared=shared,
                                                   after=x if after is None else after)
        u = jnp.einsum("nxl,nx->nl", out.astype(run.compute_dtype), w).astype(run.dtype)
        if c.latent is not None:
            if c.latent_norm:
                u = rms_norm(u, self.routed_expert_norm[...], c.norm_eps, run)
            u = linear(u, self.routed_expert_up_proj[...], run)
        if c.num_shared:
            shared_out = self.shared_experts(x, run) if shared_out is None else shared_out
            u = (u + shared_out).astype(run.dtype)
        return u.reshape(B, T, D), (idx.reshape(B, T, -1), w.reshape(B, T, -1))

    def _latent(self, x_ND, run: RunConfig):
        """The routed experts' input ``[N, L]``: K3's latent down projection, else ``x`` in the run dtype."""
        c = self.cfg
        return linear(x_ND, self.routed_expert_down_proj[...], run) if c.latent is not None else x_ND.astype(run.dtype)
