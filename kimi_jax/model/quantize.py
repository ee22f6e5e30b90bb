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
asked). One whose width the group does not divide falls back, as llama.cpp's quantizer does, to the first format
that fits it: the same kind with a halved group (down to 16 columns, where the scales still cost less than int8's
extra nibble), then int8 (a scale per row fits any width). What fell back is logged as a warning (:func:`summary`);
a request that most of the selected weights do not take is refused, naming one, before anything is changed.

Never quantized: norms, biases, convolution kernels, KDA's decay parameters, the router (``gate``, run in float32),
and K3's routed experts, MXFP4 as released.

**Calibrated (GPTQ).** ``quantize(model, "int4", calibration=ids)`` runs the float model once over the token ids
``ids [B, T]`` (text like what the model will see), sums ``x x^T`` over the inputs of every selected weight
(:func:`hessians`) and lets GPTQ (:func:`kernels_pallas.quant.gptq`) choose the codes that keep each product's
output close on those inputs, instead of rounding each weight to its nearest code. The stored format is the same;
only the codes and scales differ. Calibration holds one ``[in, in]`` float32 matrix per selected weight.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels_pallas import packed, quant

log = logging.getLogger(__name__)

CLASSES = ("attention", "mlp", "latent", "lm_head", "embed", "experts")
MIN_FALLBACK_GROUP = 16  # int4 / nf4 groups a fallback may halve down to (4 scale bytes per 16 values: 0.25 / value)
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


def fallbacks(fmt: quant.Format) -> list[quant.Format]:
    """The formats a weight that ``fmt`` does not fit falls back to, in order: ``fmt``'s kind with its group halved
    while it stays a power of two of at least :data:`MIN_FALLBACK_GROUP` columns (what the GPU kernels block), then
    int8."""
    if fmt.kind == "int8":
        return []
    out, group = [], fmt.group // 2
    while group >= MIN_FALLBACK_GROUP and group & (group - 1) == 0 and fmt.group % group == 0:
        out.append(dataclasses.replace(fmt, group=group))
        group //= 2
    return out + [quant.Format("int8")]


def choose(fmt: quant.Format, shape) -> tuple[quant.Format | None, str | None]:
    """(the format a weight of ``shape`` gets, why it is not ``fmt`` -- None when ``fmt`` fits it). The format is None
    when no fallback fits either."""
    why = fmt.fits(shape)
    if why is None:
        return fmt.fitted(shape), None
    return next((f.fitted(shape) for f in fallbacks(fmt) if f.fits(shape) is None), None), why


@dataclasses.dataclass(frozen=True)
class Fallback:
    """A weight that got another format than the one asked for."""

    name: str
    shape: tuple
    format: quant.Format
    why: str


def _plan(model, fmt, include=None) -> tuple[dict[str, quant.Format], list[Fallback]]:
    fmt = fmt if isinstance(fmt, quant.Format) else quant.Format.parse(fmt)
    include = _parse_classes(include)
    out, fell = {}, []
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = ".".join(map(str, path))
        value = var.get_value()
        if packed.is_packed(value) or module_class(name) not in include:
            continue
        chosen, why = choose(fmt, value.shape)
        if chosen is None:
            raise ValueError(f"cannot quantize {name} {tuple(value.shape)} to {fmt.name()}: {why}")
        out[name] = chosen
        if why is not None:
            fell.append(Fallback(name, tuple(value.shape), chosen, why))
    # Falling back is for the odd few (a head width no group divides); a format most weights do not take is a mistaken
    # request, and a model quietly built mostly of the fallback would not be what was asked for.
    if 2 * len(fell) > len(out):
        f = fell[0]
        raise ValueError(f"cannot quantize {f.name} {f.shape} to {fmt.name()}: {f.why}, nor {len(fell) - 1} more of "
                         f"the {len(out)} selected weights (a format falls back per weight only for a minority): "
                         "choose a group that divides their input columns")
    return out, fell


def plan(model, fmt, include=None) -> dict[str, quant.Format]:
    """``{parameter path: format}`` of what :func:`quantize` would replace (nothing is changed): ``fmt`` fitted to
    each weight, or the format it falls back to (:func:`choose`). Raises on a weight no format fits, or a request
    that most selected weights do not take (naming one), before anything is quantized."""
    return _plan(model, fmt, include)[0]


def summary(model, fmt, include=None) -> str | None:
    """One line saying which selected weights of ``model`` do not take ``fmt`` and what they get instead (None when
    all do): what :func:`quantize` logs."""
    fmt = fmt if isinstance(fmt, quant.Format) else quant.Format.parse(fmt)
    return _summary(fmt, *_plan(model, fmt, include))


def _summary(fmt: quant.Format, todo: dict, fell: list[Fallback]) -> str | None:
    if not fell:
        return None
    by_target: dict[str, list[Fallback]] = {}
    for f in fell:
        by_target.setdefault(f.format.name(), []).append(f)
    parts = []
    for target, fs in by_target.items():
        names = ", ".join(f"{f.name} {f.shape}" for f in fs[:4]) + (f" and {len(fs) - 4} more" if len(fs) > 4 else "")
        parts.append(f"{len(fs)} to {target} ({names})")
    return (f"{fmt.name()}: {len(fell)} of {len(todo)} weights fell back, their input columns not a multiple of the "
            f"group {fmt.group}: " + "; ".join(parts))


@functools.lru_cache(maxsize=None)
def quantizer(fmt: quant.Format, calibrated: bool = False, damp: float = 0.01):
    """The compiled ``quant.quantize`` for one fitted format: the one computation that turns a loaded weight into its
    packed fields (at load, in :func:`quantize`, and in ``kimi-jax convert --quantize``), so both give the same bits.
    ``calibrated``: the function takes ``(w, hessian)`` and runs GPTQ."""
    if calibrated:
        return jax.jit(lambda w, h: quant.quantize(w, fmt, hessian=h, damp=damp))
    return jax.jit(lambda w: quant.quantize(w, fmt))


def _named_params(model):
    return [(".".join(map(str, path)), var) for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))]


def check_calibration(ids, vocab: int) -> np.ndarray:
    """Calibration token ids as an int32 ``[sequences, tokens]`` array; a ValueError says what is wrong with them."""
    ids = np.asarray(ids)
    if ids.ndim != 2 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"calibration ids must be a non-empty integer [sequences, tokens] array, got "
                         f"{ids.dtype} {ids.shape}")
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"calibration ids must lie in [0, {vocab}): found {ids.min()}..{ids.max()}")
    return ids.astype(np.int32)


def hessians(model, ids, names, batch: int = 8) -> dict:
    """``{name: sum of x x^T}`` (float32 ``[in, in]``) over the inputs ``x`` that each weight in ``names`` multiplies
    while ``model`` runs on the token ids ``ids [B, T]``, ``batch`` sequences per compiled forward pass. Raises,
    naming them, when some weight saw no input (a model with scanned layers, whose weights are slices of stacks)."""
    ids = check_calibration(ids, model.cfg.vocab_size)
    names = frozenset(names)
    graphdef, state = nnx.split(model)

    @jax.jit
    def one(state, ids):
        m = nnx.merge(graphdef, state)
        # the products are shown their weights as the modules hold them: the same tracers as the parameters' values
        by_id = {id(var.get_value()): name for name, var in _named_params(m) if name in names}
        sums = {}

        def add(x, w):
            name = by_id.get(id(w))
            if name is not None:
                x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
                h = jnp.matmul(x2.T, x2, precision=jax.lax.Precision.HIGHEST)
                sums[name] = sums[name] + h if name in sums else h

        m.run = dataclasses.replace(m.run, linear_inputs=add)  # this traced copy only: the model keeps its own run
        m(ids)
        return sums

    total = {}
    for i in range(0, len(ids), batch):
        for name, h in one(state, jnp.asarray(ids[i:i + batch])).items():
            total[name] = total[name] + h if name in total else h
    unseen = sorted(names - set(total))
    if unseen:
        raise ValueError(f"calibration saw no input for {unseen[:4]}{' ...' if len(unseen) > 4 else ''} "
                         f"({len(unseen)} weights): load the model without scan_layers to calibrate it")
    return total


def quantize(model, fmt="int8", include=None, calibration=None, damp: float = 0.01):
    """Replace the selected weights of ``model`` (in place) by ``fmt``; returns the model. Each weight is quantized
    by one compiled call and its float copy released before the next (peak: the model plus one weight). An abstract
    model (:func:`kimi_jax.model.decoder.abstract_model`) gets the packed fields' shapes (for plans).

    ``calibration``: token ids ``[B, T]``; the codes are then chosen by GPTQ on the inputs the model sees on them
    (module docstring), ``damp`` the Hessian damping (a fraction of its mean diagonal)."""
    fmt = fmt if isinstance(fmt, quant.Format) else quant.Format.parse(fmt)
    todo, fell = _plan(model, fmt, include)
    if not todo:
        return model
    note = _summary(fmt, todo, fell)
    abstract = any(isinstance(v.get_value(), jax.ShapeDtypeStruct) for _, v in _named_params(model))
    if note is not None and not abstract:  # an abstract model (a plan, a restore) quantizes no weight of the user's
        log.warning("quantize %s", note)
    state = nnx.state(model, nnx.Param)
    chosen = {".".join(map(str, path)): var for path, var in nnx.to_flat_state(state)
              if ".".join(map(str, path)) in todo}
    hs = None
    if calibration is not None:
        if any(isinstance(var.get_value(), jax.ShapeDtypeStruct) for var in chosen.values()):
            raise ValueError("an abstract model has no weights to calibrate")
        check_calibrated(model, todo)
        hs = hessians(model, calibration, todo)
    for name, var in chosen.items():
        w = var.get_value()  # an abstract model's ShapeDtypeStruct gets the packed fields' shapes
        if hs is not None:
            var.set_value(quantizer(todo[name], True, damp)(w, hs.pop(name)))
        else:
            one = quantizer(todo[name])
            var.set_value(jax.eval_shape(one, w) if isinstance(w, jax.ShapeDtypeStruct) else one(w))
    nnx.update(model, state)
    return model


def check_calibrated(model, todo) -> None:
    """Refuse calibrated (GPTQ) quantization of the planned weights ``todo`` (:func:`plan`) that are stacks rather
    than ``[out, in]`` matrices, naming the first (``model`` may be abstract)."""
    flat = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    for name in todo:
        if len(flat[name].shape) != 2:
            fix = ("leave 'experts' out of the classes" if module_class(name) == "experts" else
                   "calibrate the model without scan_layers; from_pretrained(..., scan_layers=True) quantizes "
                   "before it stacks the layers")
            raise ValueError(f"calibrated (GPTQ) quantization takes [out, in] matrices; {name} is a stack "
                             f"{tuple(flat[name].shape)}: {fix}, or quantize without calibration")
