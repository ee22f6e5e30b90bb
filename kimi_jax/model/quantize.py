"""Weight-only quantization of a loaded model: chosen linear weights replaced by packed integer weights.

``quantize(model, "int8")`` (or ``"int4"``, ``"int4:g64"``, ``"int4:g128:zero"``, ``"nf4"``; the formats of
:mod:`kernels_pallas.quant`) replaces, in place, each selected ``nnx.Param`` by its packed form, which stays packed in
device memory: the products decode it inside their kernels (:mod:`kernels_pallas.matvec`), the embedding decodes the
rows it looks up. Selection is by module class (:data:`CLASSES`):

* ``attention``: every projection of KDA, MLA and GQA (``q_proj``, ``kv_a_proj_with_mqa``, ``o_proj``, ...) except
  MLA's ``kv_b_proj``, which absorbed decode splits per head (kept in the model dtype; 1-4% of an MLA layer);
* ``mlp``: the dense layers' and the shared experts' gate / up / down projections;
* ``latent``: LatentMoE's ``routed_expert_down_proj`` / ``routed_expert_up_proj``;
* ``lm_head`` and ``embed`` (a tied head is the embedding: it follows ``embed``);
* ``experts`` (opt-in): float routed-expert stacks ``[E, out, in]`` (Kimi Linear's), decoded by the CPU products and
  the reference; the TPU / GPU grouped-matmul kernels refuse them for now (MXFP4 experts are unaffected).

A weight whose rows are narrower than the format's group is quantized with one group per row (never coarser than
asked); one whose width the group does not divide is refused, by name, before anything is changed.

Never quantized: norms, biases, convolution kernels, KDA's decay parameters, the router (``gate``, run in float32),
and K3's routed experts, MXFP4 as released.
"""

from __future__ import annotations

import functools
import re

import jax
from flax import nnx

from kernels_pallas import packed, quant

CLASSES = ("attention", "mlp", "latent", "lm_head", "embed", "experts")
DEFAULT = ("attention", "mlp", "latent", "lm_head")

_RULES = (  # (class, pattern over the dotted parameter path)
    ("attention", re.compile(r"(^|\.)self_attn\.(?!kv_b_proj$)[a-z_]*proj[a-z_]*$")),
    ("mlp", re.compile(r"(^|\.)mlp\.(shared_experts\.)?(gate|up|down)_proj$")),
    ("latent", re.compile(r"(^|\.)mlp\.routed_expert_(down|up)_proj$")),
    ("lm_head", re.compile(r"^lm_head$")),
    ("embed", re.compile(r"^embed_tokens$")),
    ("experts", re.compile(r"(^|\.)mlp\.experts\.w[123]$")),
)


def module_class(path: str) -> str | None:
    """The class (:data:`CLASSES`) of a parameter path, or None for one that is never quantized."""
    for cls, pattern in _RULES:
        if pattern.search(path):
            return cls
    return None


def _parse_classes(include) -> tuple[str, ...]:
    include = DEFAULT if include is None else tuple(include)
    bad = [c for c in include if c not in CLASSES]
    if bad:
        raise ValueError(f"unknown module classes {bad} (choose from {', '.join(CLASSES)})")
    return include


def plan(model, fmt, include=None) -> dict[str, quant.Format]:
    """``{parameter path: format}`` of what :func:`quantize` would replace (nothing is changed). Raises on a weight
    the format cannot take (naming it) before anything is quantized."""
    fmt = fmt if isinstance(fmt, quant.Format) else quant.Format.parse(fmt)
    include = _parse_classes(include)
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = ".".join(map(str, path))
        value = var.get_value()
        if packed.is_packed(value) or module_class(name) not in include:
            continue
        why = fmt.fits(value.shape)
        if why is not None:
            raise ValueError(f"cannot quantize {name} {tuple(value.shape)} to {fmt.name()}: {why}")
        out[name] = fmt.fitted(value.shape)
    return out


@functools.lru_cache(maxsize=None)
def quantizer(fmt: quant.Format):
    """The compiled ``quant.quantize`` for one fitted format: the one computation that turns a loaded weight into its
    packed fields (at load, in :func:`quantize`, and in ``kimi-jax convert --quantize``), so both give the same bits."""
    return jax.jit(lambda w: quant.quantize(w, fmt))


def quantize(model, fmt="int8", include=None):
    """Replace the selected weights of ``model`` (in place) by ``fmt``; returns the model. Each weight is quantized
    by one compiled call and its float copy released before the next (peak: the model plus one weight). An abstract
    model (:func:`kimi_jax.model.decoder.abstract_model`) gets the packed fields' shapes (for plans)."""
    todo = plan(model, fmt, include)
    if not todo:
        return model
    state = nnx.state(model, nnx.Param)
    for path, var in nnx.to_flat_state(state):
        name = ".".join(map(str, path))
        if name in todo:
            one = quantizer(todo[name])
            w = var.get_value()  # an abstract model's ShapeDtypeStruct gets the packed fields' shapes
            var.set_value(jax.eval_shape(one, w) if isinstance(w, jax.ShapeDtypeStruct) else one(w))
    nnx.update(model, state)
    return model
