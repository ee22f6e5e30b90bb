"""How a model runs (not what it is): :class:`RunConfig`, static under ``jit``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from kernels_pallas._dispatch import compiler_options

OFFLOAD_KINDS = ("kda_state", "cache", "experts")  # what RunConfig.offload may name (kimi_jax.model.offload)


def check_offload(kinds) -> tuple[str, ...]:
    """``kinds`` (a tuple of names, or ``"a,b"``) as a tuple in :data:`OFFLOAD_KINDS` order; a ValueError names
    unknown ones."""
    if isinstance(kinds, str):
        kinds = [k.strip() for k in kinds.split(",") if k.strip()]
    kinds = tuple(kinds or ())
    unknown = [k for k in kinds if k not in OFFLOAD_KINDS]
    if unknown:
        raise ValueError(f"offload: unknown {unknown}; choose from {list(OFFLOAD_KINDS)}")
    return tuple(k for k in OFFLOAD_KINDS if k in kinds)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """How to run a model (not what it is): activation dtype and kernel choices. Hashable, static under jit.

    ``dtype``: the activation (and by default parameter) dtype; its :attr:`compute_dtype` (float32, or float64 for a
    float64 run, which needs ``jax_enable_x64``) is what norm statistics, gates, softmaxes and sums run in.

    ``implementation`` applies to every op of ``kernels_pallas`` (attention, mla, kda, moe, the products); ``None``
    = automatic (Pallas on TPU/GPU; on CPU the native and XLA:CPU-tuned forms where they apply, else the
    reference), or one of the names the ops offer (``"reference"`` runs every op's plain-jnp oracle, ``"pallas"``,
    ``"pallas_interpret"``; see ``kernels_pallas/_dispatch.py``).
    ``moe_path``: ``"auto"`` gathers the chosen experts' weights when there are fewer (token, expert) pairs than
    experts (decode) and sorts tokens into a grouped matmul otherwise (prefill); on XLA:CPU with float32 experts,
    batches in between run every expert on every token (``"dense"``, :func:`kernels_pallas.moe_gmm.expert_path`).
    ``parallel``: a :class:`kimi_jax.parallel.sharding.Parallel` (mesh + layout) for multi-device runs; None = one device.
    ``kda_chunk``: chunk of the reference (plain-jnp) KDA prefill; 1 runs the token-by-token recurrence; None (the
    default) leaves it to the op (the recurrence on CPU, 64 in the reference; the Pallas kernels tile time
    themselves).
    ``scan_layers``: build the model with the parameters of its longest repeating run of layers stacked and run
    that run as one ``lax.scan`` (:mod:`kimi_jax.model.layer_plan`: compile time falls by the repetition count; the
    compilers copy each iteration's weight slice, so off by default). The model's parameter layout follows it.
    ``offload``: what lives in host memory and moves to the device per layer (:mod:`kimi_jax.model.offload`):
    any of ``"kda_state"`` (KDA cache entries), ``"cache"`` (MLA / GQA cache entries), ``"experts"`` (routed experts:
    a decode step moves only the ones its tokens chose, a prefill each layer's whole stack).
    ``remat``: rematerialise each decoder layer (a scanned run: each repetition of its group) in the backward pass
    (``jax.checkpoint``): training keeps one residual stream per layer instead of every activation.
    ``linear_inputs``: called as ``linear_inputs(x, w)`` with the input and the weight (as the module holds it) of
    every linear product before it runs (:func:`kimi_jax.model.layers.linear_group`); the calibration pass reads
    what each weight multiplies this way (:func:`kimi_jax.model.quantize.hessians`). None in every other run.
    """

    dtype: jnp.dtype = jnp.bfloat16
    implementation: str | None = None
    kda_chunk: int | None = None
    moe_path: str = "auto"  # "auto" | "gather" | "sorted" | "dense"
    parallel: object = None  # kimi_jax.parallel.sharding.Parallel | None
    scan_layers: bool = False
    offload: tuple[str, ...] = ()  # of "kda_state", "cache", "experts"
    remat: bool = False
    linear_inputs: Callable | None = None

    def __post_init__(self):
        object.__setattr__(self, "offload", check_offload(self.offload))
        if jnp.dtype(self.dtype) == jnp.float64 and not jax.config.read("jax_enable_x64"):
            raise ValueError("dtype float64 needs jax_enable_x64 (JAX_ENABLE_X64=1, or jax.config.update("
                             "'jax_enable_x64', True) before any array is made): without it JAX makes float32 arrays")

    @property
    def placement(self):
        """The kernel ops' placement on the mesh (:class:`kernels_pallas._dispatch.Placement`), or None."""
        return None if self.parallel is None else self.parallel.placement

    def compiler_options(self) -> dict[str, str] | None:
        """Options for the XLA compiler of a program that runs this model (``jax.jit(..., compiler_options=...)``),
        or None: the dispatcher's choice for this placement (:func:`kernels_pallas._dispatch.compiler_options`;
        scanned layers on one chip want a flag that other compilers refuse)."""
        return compiler_options(self.placement, scanned=self.scan_layers)

    @property
    def compute_dtype(self) -> jnp.dtype:
        """What the float32 internals (norm statistics, SiTU, AttnRes, router, KDA gates and state, attention
        softmax, logits) compute in: float32 for bfloat16 and float32 runs, float64 for a float64 run (under
        ``jax_enable_x64``: the model then matches a float64 oracle to float64 rounding)."""
        return jnp.promote_types(self.dtype, jnp.float32)

    @property
    def precision(self):
        # float32 (and float64) models are oracles: ask TPUs for true f32 matmuls instead of bf16 passes.
        return jax.lax.Precision.HIGHEST if jnp.dtype(self.dtype) in (jnp.float32, jnp.float64) else None
