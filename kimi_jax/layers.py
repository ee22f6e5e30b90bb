"""Building blocks shared by the three families: parameter declaration, linear, norms, GLUs, AttnRes.

Numerics follow the reference implementation's rounding points (K3_SPEC §4.9): matmuls accumulate in
float32 and round their output to the activation dtype; norms compute statistics in float32 and round the
normalised value to the activation dtype *before* the weight multiply; SiTU, AttnRes mixing, router and KDA
gating run in float32. In a float32 model every rounding point is a no-op.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from kernels_pallas import matvec
from kimi_jax.config import MLPConfig

F32 = jnp.float32


def _default_kda_chunk() -> int:
    # On XLA:CPU the recurrence beats the chunked form ~20x at 512 tokens (the chunk's [C, C, K] decay
    # tensors dominate) and compiles ~6x faster; accelerators want the matmul-shaped chunks.
    return 1 if jax.default_backend() == "cpu" else 64


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """How to run a model (not what it is): activation dtype and kernel choices. Hashable, static under jit.

    ``implementation`` applies to every kernel op (attention, mla, kda, moe); ``None`` = automatic (reference
    on CPU, Pallas on TPU/GPU), or one of the names the kernel packages offer (``"reference"``, ``"pallas"``).
    ``moe_path``: ``"auto"`` gathers the chosen experts' weights when there are fewer (token, expert) pairs than
    experts (decode) and sorts tokens into a grouped matmul otherwise (prefill); on the CPU reference path with
    float experts, batches in between run every expert on every token (``"dense"``, see ``Experts._auto_path``).
    ``parallel``: a :class:`kimi_jax.sharding.Parallel` (mesh + layout) for multi-device runs; None = one device.
    ``kda_chunk``: chunk of the reference (plain-jnp) KDA prefill; 1 runs the token-by-token recurrence. Default:
    1 on CPU, 64 elsewhere (the Pallas kernels tile time themselves and ignore it).
    """

    dtype: jnp.dtype = jnp.bfloat16
    implementation: str | None = None
    kda_chunk: int = dataclasses.field(default_factory=lambda: _default_kda_chunk())
    moe_path: str = "auto"  # "auto" | "gather" | "sorted" | "dense"
    parallel: object = None  # kimi_jax.sharding.Parallel | None

    @property
    def placement(self):
        """The kernel ops' placement on the mesh (:class:`kernels_pallas._dispatch.Placement`), or None."""
        return None if self.parallel is None else self.parallel.placement

    @property
    def precision(self):
        # float32 models are oracles: ask TPUs for true f32 matmuls instead of bf16 passes.
        return jax.lax.Precision.HIGHEST if jnp.dtype(self.dtype) == jnp.float32 else None


# -- parameter declaration -------------------------------------------------------------------------------


def param(rngs: nnx.Rngs | None, shape, axes, dtype, init="normal", std=0.02) -> nnx.Param:
    """One declaration per parameter: shape, dtype, logical axes (for sharding rules) and initializer."""
    shape = tuple(int(s) for s in shape)
    if len(axes) != len(shape):
        raise ValueError(f"parameter of shape {shape} declared with axes {axes}")
    dtype = jnp.dtype(dtype)
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    elif init == "bytes":  # packed MXFP4 nibbles: any byte is a valid pair of codes
        value = jax.random.randint(rngs.params(), shape, 0, 256, jnp.int32).astype(dtype)
    elif init == "scale":  # E8M0 bytes near 2**-6, a plausible expert weight scale
        value = jax.random.randint(rngs.params(), shape, 119, 123, jnp.int32).astype(dtype)
    elif init == "normal":
        value = (std * jax.random.normal(rngs.params(), shape, F32)).astype(dtype)
    elif callable(init):
        value = init(rngs.params(), shape).astype(dtype)
    else:
        raise ValueError(f"unknown initializer {init!r}")
    return nnx.Param(value, axes=tuple(axes))


# -- math helpers ----------------------------------------------------------------------------------------


# Up to this many rows, XLA:CPU computes ``x @ w.T`` faster as ``(w @ x.T).T`` (measured in float32: 2-3x for
# 2..16 rows, i.e. batched decode, where its GEMM packs the whole weight for a handful of rows; equal at 1 row and
# >= 64). Float32 only: XLA:CPU has no standalone bf16 x bf16 -> f32 dot to run the barrier-isolated product.
_CPU_SKINNY_ROWS = 32


def cpu_float32(run: "RunConfig") -> bool:
    """A single-device float32 run on XLA:CPU: where the CPU-specific product forms below apply."""
    return jnp.dtype(run.dtype) == F32 and run.parallel is None and jax.default_backend() == "cpu"


def cpu_skinny(rows: int, run: "RunConfig") -> bool:
    return 1 < rows <= _CPU_SKINNY_ROWS and cpu_float32(run)


# Up to this many rows, float32 products on XLA:CPU run through the grouped native kernel (kernels_pallas.matvec)
# where the model has several products to run at once: decode at batch 1.
_NATIVE_ROWS = 1


def native_products(rows: int, run: "RunConfig") -> bool:
    """Whether products of ``rows`` rows run as grouped native calls: decode-shaped, float32, one CPU device, the
    automatic kernel choice, and the native kernel builds here."""
    return rows <= _NATIVE_ROWS and cpu_float32(run) and run.implementation is None and matvec.native_ready()


def w_xT(w_FD, x_ND, run: "RunConfig"):
    """``w @ x.T`` -> ``[F, N]`` float32, kept in that orientation (the barrier stops XLA from folding a later
    transpose back into an ``x @ w.T`` product)."""
    y = jnp.einsum("fd,nd->fn", w_FD, x_ND, preferred_element_type=F32, precision=run.precision)
    return jax.lax.optimization_barrier(y)


def linear(x, w, run: RunConfig):
    """``x @ w.T`` for a checkpoint-layout weight ``w [out, in]``; f32 accumulate, output in the run dtype."""
    x, w = x.astype(run.dtype), w.astype(run.dtype)
    rows = x.size // x.shape[-1]
    if cpu_skinny(rows, run):
        return w_xT(w, x.reshape(rows, -1), run).T.reshape(*x.shape[:-1], w.shape[0]).astype(run.dtype)
    y = jnp.einsum("...d,fd->...f", x, w, preferred_element_type=F32, precision=run.precision)
    return y.astype(run.dtype)


def linear_group(pairs, run: RunConfig) -> list:
    """``[linear(x, w, run) for x, w in pairs]``. In decode on XLA:CPU (:func:`native_products`) one native call
    streams all the weights: launched one by one, XLA:CPU's products of 0.5-1 MB ran at half the rate of the large
    ones (``kernels_pallas/matvec``)."""
    rows = {x.size // x.shape[-1] for x, _ in pairs}
    if len(rows) == 1 and native_products(next(iter(rows)), run):
        outs = matvec.group([(x.reshape(-1, x.shape[-1]).astype(F32), w.astype(F32), None) for x, w in pairs])
        return [y.reshape(*x.shape[:-1], -1).astype(run.dtype) for y, (x, _) in zip(outs, pairs)]
    return [linear(x, w, run) for x, w in pairs]


def rms_norm(x, w, eps, run: RunConfig):
    """KimiRMSNorm / LlamaRMSNorm: float32 statistics, normalised value rounded, then times the weight."""
    x32 = x.astype(F32)
    n = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (w.astype(run.dtype) * n.astype(run.dtype)).astype(run.dtype)


def situ(a, b, beta, linear_beta):
    """SiTU-GLU in float32: [b1 tanh(a/b1) sigmoid(a)] * [b2 tanh(b/b2)] (|.| <= b1*b2)."""
    a, b = a.astype(F32), b.astype(F32)
    gate = beta * jnp.tanh(a / beta) * jax.nn.sigmoid(a)
    up = b if linear_beta is None else linear_beta * jnp.tanh(b / linear_beta)
    return gate * up


def glu(a, b, cfg_act: str, beta: float, linear_beta: float | None, run: RunConfig):
    if cfg_act == "situ":
        return situ(a, b, beta, linear_beta).astype(run.dtype)
    return (jax.nn.silu(a.astype(F32)) * b.astype(F32)).astype(run.dtype)


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
    """

    def __init__(self, hidden: int, eps: float, *, param_dtype, rngs):
        self.eps = eps
        self.norm = param(rngs, (hidden,), ("embed",), param_dtype, init="ones")
        self.proj = param(rngs, (hidden,), ("embed",), param_dtype, init="normal", std=0.1)

    def __call__(self, sources: list, run: RunConfig, return_weights=False):
        v = jnp.stack([s.astype(F32) for s in sources])  # [n, ..., D]
        r = jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + self.eps)
        w_eff = self.norm[...].astype(F32) * self.proj[...].astype(F32)
        scores = jnp.sum(v * r * w_eff, axis=-1)  # [n, ...]
        alpha = jax.nn.softmax(scores, axis=0)
        out = jnp.sum(alpha[..., None] * v, axis=0).astype(run.dtype)
        return (out, alpha) if return_weights else out
