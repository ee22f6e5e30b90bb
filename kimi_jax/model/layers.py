"""Building blocks shared by the three families: parameter declaration, linear, norms, GLUs, AttnRes.

Numerics follow the reference implementation's rounding points (K3_SPEC §4.9): matmuls accumulate in
float32 and round their output to the activation dtype; norms compute statistics in float32 and round the
normalised value to the activation dtype *before* the weight multiply; SiTU, AttnRes mixing, router and KDA
gating run in float32. In a float32 model every rounding point is a no-op. "float32" here is the run's
``compute_dtype`` (:class:`~kimi_jax.model.run.RunConfig`): float32 for bfloat16 and float32 runs, float64 for a
float64 run, whose every internal is then float64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kernels_pallas import matvec, packed
from kimi_jax.model.config import MLPConfig
from kimi_jax.model.run import RunConfig

F32 = jnp.float32


# -- parameter declaration -------------------------------------------------------------------------------


def param(rngs: nnx.Rngs | None, shape, axes, dtype, init="normal", std=0.02, packed: type | None = None) -> nnx.Param:
    """One declaration per parameter: shape, dtype, logical axes (for sharding rules) and initializer.

    ``packed``: a packed weight type (:mod:`kernels_pallas.packed`) holding ``shape`` logical values, filled with
    random codes of the type's own choosing (``packed.random``); ``dtype`` and ``init`` do not apply then."""
    shape = tuple(int(s) for s in shape)
    if len(axes) != len(shape):
        raise ValueError(f"parameter of shape {shape} declared with axes {axes}")
    if packed is not None:
        return nnx.Param(packed.random(rngs.params(), shape), axes=tuple(axes))
    dtype = jnp.dtype(dtype)
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    elif init == "normal":
        value = (std * jax.random.normal(rngs.params(), shape, F32)).astype(dtype)
    elif callable(init):
        value = init(rngs.params(), shape).astype(dtype)
    else:
        raise ValueError(f"unknown initializer {init!r}")
    return nnx.Param(value, axes=tuple(axes))


# -- math helpers ----------------------------------------------------------------------------------------


def cast(w, dtype):
    """A weight in ``dtype`` for a product: a packed weight stays packed (its kernel decodes it)."""
    return w if packed.is_packed(w) else w.astype(dtype)


def linear(x, w, run: RunConfig):
    """``x @ w.T`` for a checkpoint-layout weight ``w [out, in]``; f32 accumulate, output in the run dtype."""
    return linear_group([(x, w)], run)[0]


def linear_group(pairs, run: RunConfig) -> list:
    """``[linear(x, w, run) for x, w in pairs]`` as one call of the grouped-product op
    (:func:`kernels_pallas.matvec.group`), which may stream them together (decode on CPU). A calibration run
    (``run.linear_inputs``) is shown each pair first."""
    if run.linear_inputs is not None:
        for x, w in pairs:
            run.linear_inputs(x, w)
    items = [(x.reshape(-1, x.shape[-1]).astype(run.dtype), cast(w, run.dtype), None) for x, w in pairs]
    outs = matvec.group(items, implementation=run.implementation, precision=run.precision, placement=run.placement)
    return [y.reshape(*x.shape[:-1], -1).astype(run.dtype) for y, (x, _) in zip(outs, pairs)]


def embed(table, ids, run: RunConfig):
    """Rows ``ids`` of an embedding table ``[V, D]`` in the run dtype; a packed table decodes only those rows."""
    if packed.is_packed(table):
        return packed.as_dense(jax.tree.map(lambda f: f[ids], table), run.dtype)
    return table[ids].astype(run.dtype)


def rms_norm(x, w, eps, run: RunConfig):
    """KimiRMSNorm / LlamaRMSNorm: float32 statistics, normalised value rounded, then times the weight."""
    x32 = x.astype(run.compute_dtype)
    n = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (w.astype(run.dtype) * n.astype(run.dtype)).astype(run.dtype)


def situ(a, b, beta, linear_beta, dtype=F32):
    """SiTU-GLU in float32 (``dtype``: a run's compute dtype): [b1 tanh(a/b1) sigmoid(a)] * [b2 tanh(b/b2)]
    (|.| <= b1*b2)."""
    a, b = a.astype(dtype), b.astype(dtype)
    gate = beta * jnp.tanh(a / beta) * jax.nn.sigmoid(a)
    up = b if linear_beta is None else linear_beta * jnp.tanh(b / linear_beta)
    return gate * up


def glu(a, b, cfg_act: str, beta: float, linear_beta: float | None, run: RunConfig):
    if cfg_act == "situ":
        return situ(a, b, beta, linear_beta, run.compute_dtype).astype(run.dtype)
    cd = run.compute_dtype
    return (jax.nn.silu(a.astype(cd)) * b.astype(cd)).astype(run.dtype)


# -- modules ---------------------------------------------------------------------------------------------


class MLP(nnx.Module):
    """Gated MLP (dense layer 0, Llama MLP, shared experts): down(act(gate(x)) * up(x))."""

    def __init__(self, cfg: MLPConfig, *, param_dtype, rngs, axis="mlp"):
        self.cfg = cfg
        self.gate_proj = param(rngs, (cfg.intermediate, cfg.hidden), (axis, "embed"), param_dtype)
        self.up_proj = param(rngs, (cfg.intermediate, cfg.hidden), (axis, "embed"), param_dtype)
        self.down_proj = param(rngs, (cfg.hidden, cfg.intermediate), ("embed", axis), param_dtype)

    def __call__(self, x, run: RunConfig):
        c = self.cfg
        gate, up = linear_group([(x, self.gate_proj[...]), (x, self.up_proj[...])], run)
        h = glu(gate, up, c.act, c.situ_beta, c.situ_linear_beta, run)
        return linear(h, self.down_proj[...], run)


class AttnRes(nnx.Module):
    """Block Attention Residuals: a per-token softmax over depth sources.

    Score of source i = sum_d RMSNorm(v_i)[d] * w_eff[d] with w_eff = norm.weight * proj.weight (the
    reference's RMSNorm weight times its Linear(d->1)); the output mixes the *raw* sources. All float32,
    one rounding of the result.

    The max, the softmax denominator and the weighted sum run over the sources one by one, in order. A scanned
    model passes every block slot with a traced ``valid`` flag (slots not yet sealed are zeros): an invalid source
    scores -inf and adds exact zeros, so the result equals the unrolled model's, which passes the sealed sources only.
    """

    def __init__(self, hidden: int, eps: float, *, param_dtype, rngs):
        self.eps = eps
        self.norm = param(rngs, (hidden,), ("embed",), param_dtype, init="ones")
        self.proj = param(rngs, (hidden,), ("embed",), param_dtype, init="normal", std=0.1)

    def __call__(self, sources: list, run: RunConfig, return_weights=False, valid: list | None = None):
        """``sources``: ``[..., D]`` arrays; ``valid``: per source None (valid) or a traced bool. Returns the mix in
        the run dtype (and the weights ``[n_sources, ...]`` in the compute dtype: float32 but in a float64 run)."""
        cd = run.compute_dtype
        w_eff = self.norm[...].astype(cd) * self.proj[...].astype(cd)
        vs = [s.astype(cd) for s in sources]
        scores = []
        for i, v in enumerate(vs):
            r = jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + self.eps)
            s = jnp.sum(v * r * w_eff, axis=-1)
            ok = None if valid is None else valid[i]
            scores.append(s if ok is None else jnp.where(ok, s, -jnp.inf))
        top = scores[0]
        for s in scores[1:]:
            top = jnp.maximum(top, s)
        es = [jnp.exp(s - top) for s in scores]
        total = es[0]
        for e in es[1:]:
            total = total + e
        alpha = [e / total for e in es]
        out = alpha[0][..., None] * vs[0]
        for a, v in zip(alpha[1:], vs[1:]):
            out = out + a[..., None] * v
        out = out.astype(run.dtype)
        return (out, jnp.stack(alpha)) if return_weights else out
