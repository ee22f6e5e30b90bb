"""Mixture of experts: sigmoid router with bias-corrected top-k, routed experts (optionally behind K3's
latent projection, optionally MXFP4-packed), and shared experts.

Router (float32 end to end): ``s = sigmoid(x @ W_r^T)``; the correction bias only affects *which* experts are
chosen; their weights are the unbiased scores, renormalised and scaled. Expert outputs are combined in float32
with one rounding (the reference's ``moe_infer``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import kernels_pallas.moe_gmm as gmm_kernels
from kernels_pallas import matvec
from kernels_pallas import packed as packed_types
from kernels_pallas.mxfp4 import MXFP4Weight
from kimi_jax.model.config import MoEConfig
from kimi_jax.model.layers import F32, MLP, cast, glu, linear, param, rms_norm
from kimi_jax.model.run import RunConfig
from kimi_jax.model import offload
from kimi_jax.parallel import expert_parallel


def route(x_ND, w_ED, bias_E, cfg: MoEConfig):
    """Returns (idx [N, X] int32, weights [N, X] float32)."""
    logits = jnp.einsum("nd,ed->ne", x_ND.astype(F32), w_ED.astype(F32), precision=jax.lax.Precision.HIGHEST)
    scores = jax.nn.sigmoid(logits)
    choice = scores + bias_E.astype(F32)
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
        self.hot_cache = nnx.data(None)  # offload.HotExperts: experts kept on the device too (offload.keep_hot_experts)

    def weight(self, name):
        """A float array or a packed weight (:mod:`kernels_pallas.packed`)."""
        return getattr(self, name).get_value()

    @property
    def packed(self) -> bool:
        """The expert weights are a packed type (MXFP4), not float arrays."""
        return packed_types.is_packed(self.weight("w1"))

    def _auto_path(self, pairs: int, run: RunConfig) -> str:
        float32 = not self.packed and jnp.dtype(run.dtype) == F32
        return gmm_kernels.expert_path(pairs, self.cfg.num_experts, float32=float32, implementation=run.implementation,
                                       placement=run.placement)

    def path(self, pairs: int, run: RunConfig) -> str:
        return run.moe_path if run.moe_path != "auto" else self._auto_path(pairs, run)

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
        """Each token's chosen experts applied to it: returns ``[N, X, L]`` in the run dtype."""
        w, ids = self.fetch(idx_NX, run, after=z_NL)
        return self.apply(w, z_NL, ids, run)

    def apply(self, w, z_NL, idx_NX, run: RunConfig):
        """:meth:`__call__` with the weights given (``w`` as :meth:`weights` returns them, or the compact stack of
        :meth:`fetch` with its ids; expert parallelism passes each device's replica)."""
        c = self.cfg
        N, X = idx_NX.shape
        path = self.path(N * X, run)
        act = lambda a, b: self.act(a, b, run)
        kw = dict(compute_dtype=run.dtype, implementation=run.implementation)
        if path == "dense":
            if self.packed:
                raise ValueError("moe_path='dense' needs float expert weights (MXFP4 experts use 'gather' or 'sorted')")
            # every expert on every token, each expert read once
            y = gmm_kernels.dense_experts(z_NL.astype(run.dtype), w["w1"], w["w3"], w["w2"], act=act,
                                          compute_dtype=run.dtype, precision=run.precision,
                                          implementation=run.implementation)  # [E, N, L]
            return y[idx_NX, jnp.arange(N)[:, None]].astype(run.dtype)  # [N, X, L]
        if path == "gather":
            zx = jnp.broadcast_to(z_NL[:, None], (N, X, z_NL.shape[-1]))
            h = act(gmm_kernels.gather_matmul(zx, w["w1"], idx_NX, **kw),
                    gmm_kernels.gather_matmul(zx, w["w3"], idx_NX, **kw))
            return gmm_kernels.gather_matmul(h, w["w2"], idx_NX, **kw).astype(run.dtype)
        if path != "sorted":
            raise ValueError(f"unknown moe_path {run.moe_path!r}")
        flat = idx_NX.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        sizes = jnp.bincount(flat, length=c.num_experts).astype(jnp.int32)
        xs = z_NL[order // X]  # [M, L] rows sorted by expert
        h = act(gmm_kernels.gmm(xs, w["w1"], sizes, **kw), gmm_kernels.gmm(xs, w["w3"], sizes, **kw))
        ys = gmm_kernels.gmm(h, w["w2"], sizes, **kw).astype(run.dtype)
        return jnp.zeros_like(ys).at[order].set(ys).reshape(N, X, -1)


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
        idx, w = route(x, self.gate[...], self.e_score_correction_bias[...], c)
        shared = None
        if run.parallel is not None:  # experts sharded over a mesh: token dispatch (kimi_jax/parallel/expert_parallel.py)
            if "experts" in run.offload:
                raise ValueError("offload='experts' runs on one device for now: the expert-parallel dispatch "
                                 "(kimi_jax/parallel/expert_parallel.py) reads the weights where they live")
            z = self._latent(x, run)
            out = expert_parallel.routed_experts(self.experts, z, idx, run)
        else:
            # Offloaded experts start moving here (the routed ones once the router has chosen); the latent
            # projection and the shared experts need none of them and run while they move.
            ew, ids = self.experts.fetch(idx, run, after=x if after is None else after)
            z = self._latent(x, run)
            out, shared = self._grouped_decode(x, z, ids, ew, run) or (self.experts.apply(ew, z, ids, run), None)
        u = jnp.einsum("nxl,nx->nl", out.astype(F32), w).astype(run.dtype)
        if c.latent is not None:
            if c.latent_norm:
                u = rms_norm(u, self.routed_expert_norm[...], c.norm_eps, run)
            u = linear(u, self.routed_expert_up_proj[...], run)
        if c.num_shared:
            shared = self.shared_experts(x, run) if shared is None else shared
            u = (u + shared).astype(run.dtype)
        return u.reshape(B, T, D), (idx.reshape(B, T, -1), w.reshape(B, T, -1))

    def _latent(self, x_ND, run: RunConfig):
        """The routed experts' input ``[N, L]``: K3's latent down projection, else ``x`` in the run dtype."""
        c = self.cfg
        return linear(x_ND, self.routed_expert_down_proj[...], run) if c.latent is not None else x_ND.astype(run.dtype)

    def _grouped_decode(self, x_ND, z_NL, idx_NX, w, run: RunConfig):
        """Gathered float experts whose products the grouped-product op runs as one native call (decode on CPU):
        the chosen experts and the shared experts as two such calls, up projections then down projections
        (:mod:`kernels_pallas.matvec`); ``w``: the routed experts' weights in device memory (``idx_NX`` indexes
        them: the compact stack of :meth:`Experts.fetch` and its ids, when they were offloaded). Returns (routed
        ``[N, X, L]``, shared ``[N, D]`` or None), or None when the op would not run them that way (then each part
        runs on its own)."""
        N, X = idx_NX.shape
        ex, sh = self.experts, (self.shared_experts if self.cfg.num_shared else None)
        if isinstance(ex.weight("w1"), MXFP4Weight) or ex.path(N * X, run) != "gather":
            return None
        dt, ids = run.dtype, idx_NX.reshape(N * X)
        zx = jnp.broadcast_to(z_NL.astype(dt)[:, None], (N, X, z_NL.shape[-1])).reshape(N * X, -1)
        items = [(zx, cast(w["w1"], dt), ids), (zx, cast(w["w3"], dt), ids)]
        if sh is not None:
            xs = x_ND.astype(dt)
            items += [(xs, cast(sh.gate_proj[...], dt), None), (xs, cast(sh.up_proj[...], dt), None)]
        kw = dict(implementation=run.implementation, placement=run.placement)
        if not matvec.fuses(items, **kw):
            return None
        up = matvec.group(items, **kw)
        items = [(ex.act(up[0], up[1], run).astype(dt), cast(w["w2"], dt), ids)]
        if sh is not None:
            hs = glu(up[2], up[3], sh.cfg.act, sh.cfg.situ_beta, sh.cfg.situ_linear_beta, run)
            items.append((hs.astype(dt), cast(sh.down_proj[...], dt), None))
        down = matvec.group(items, **kw)
        routed = down[0].reshape(N, X, -1).astype(dt)
        return routed, (down[1].astype(dt) if sh is not None else None)
