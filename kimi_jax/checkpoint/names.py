"""The checkpoint name table: one row per tensor kind, from checkpoint names to model parameter leaves.

A row is (pattern over the checkpoint name with the family prefix stripped, parameter path template, transform).
Targets are parameter *leaves* by dotted path (:mod:`kimi_jax.model.params`): ``layers.3.self_attn.q_proj``, or a
field of a packed weight, ``layers.3.mlp.experts.w1.packed``. This table is the one place that knows how a packed
weight's fields are named in a file (compressed-tensors' ``weight_packed`` / ``weight_scale``; a ``pack-quantized``
int4 / int8 weight's fields follow the row of its float ``.weight``: :data:`CT_FIELDS`). Routed experts
``experts.{e}.w{1,2,3}`` land in slot ``e`` of a stacked parameter. The same checkpoint name can mean different
tensors on different layer kinds (``g_proj`` on KDA vs MLA layers, ``q_proj`` on KDA vs GQA vs low-rank-less MLA):
the path is resolved against the model built for the config, and the shape check tells them apart.

FP8 block-quantized weights (DeepSeek-V3.2's indexer ``wq_b`` / ``wk``): a row marked ``fp8`` also takes its weight
as float8_e4m3fn with a ``weight_scale_inv`` beside it (:data:`FP8_SCALE`); the scale joins the weight's placement
(:attr:`Destination.scale`) and the reader dequantizes the pair (:func:`fp8_dequantize`).

Every checkpoint tensor is consumed exactly once and every parameter is filled exactly once (or, for the few
:data:`OPTIONAL` leaves, left zero); anything else is an error that names the tensor, the file and the shapes. Every transform is a function ``(array, where, shape)`` that
checks its input and gets the shape of the slot it fills.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import jax
import ml_dtypes
import numpy as np

from kimi_jax.checkpoint.safetensors import CheckpointError
from kimi_jax.model.config import ModelConfig


class WeightError(CheckpointError):
    """A checkpoint that does not fit the model its config describes."""


# -- transforms: each checks its input shape -----------------------------------------------------------


def identity(x, where, shape):
    return x


def _conv(x, where, shape):
    """``[P, 1, W]`` depthwise conv kernel -> ``[P, W]``."""
    if x.ndim != 3 or x.shape[1] != 1:
        raise WeightError(f"{where}: expected a depthwise conv kernel [P, 1, W], got {list(x.shape)}")
    return x[:, 0, :]


def _row_vector(x, where, shape):
    """``[1, D]`` (a Linear(D -> 1)) -> ``[D]``."""
    if x.ndim != 2 or x.shape[0] != 1:
        raise WeightError(f"{where}: expected [1, D], got {list(x.shape)}")
    return x[0]


def _flat(x, where, shape):
    return x.reshape(-1)


def _a_log(x, where, shape):
    """A_log as released is zero-padded ([128] for 96 heads); HF Kimi Linear writes [1, 1, H, 1]."""
    heads = shape[0]
    flat = np.asarray(x, np.float32).reshape(-1)
    if flat.shape[0] < heads:
        raise WeightError(f"{where}: A_log has {flat.shape[0]} entries for {heads} heads")
    if np.any(flat[heads:] != 0):
        raise WeightError(f"{where}: A_log padding beyond the first {heads} entries must be zero, "
                          f"found {int(np.count_nonzero(flat[heads:]))} non-zero values")
    return flat[:heads]


# Transforms that must see the tensor's values to check it (read in the preflight, before anything is written).
CHECKS_VALUES = (_a_log,)


def _int32_words(x, where, per_word: int, columns: int):
    """compressed-tensors ``weight_packed``: ``per_word`` values per little-endian int32 word, element ``i`` of a row
    at bits ``(i % per_word) * 32 / per_word`` of word ``i // per_word``, each stored offset-binary (``q + 2**(b-1)``).
    Returns the words' bytes ``[..., J, 4 * words]`` (a zero-strided stand-in stays one). ``columns``: the
    parameter's logical input width (a width the words do not fill exactly was padded: refused)."""
    if np.dtype(x.dtype) != np.dtype(np.int32) or x.ndim < 2:
        raise WeightError(f"{where}: pack-quantized weight_packed must be int32 [..., rows, words], got "
                          f"{np.dtype(x.dtype).name} {list(x.shape)}")
    if x.shape[-1] * per_word != columns:
        raise WeightError(f"{where}: {x.shape[-1]} int32 words of {per_word} values per row do not hold the "
                          f"parameter's {columns} columns exactly (kimi-jax takes widths that are a multiple of "
                          f"{per_word})")
    out = (*x.shape[:-1], x.shape[-1] * 4)
    if all(st == 0 for st in x.strides):
        return np.broadcast_to(np.zeros((), np.uint8), out)
    return np.ascontiguousarray(x, dtype="<i4").view(np.uint8).reshape(out)


def _ct_int4(x, where, shape):
    """``pack-quantized`` 4-bit words ``int32 [..., J, I/8]`` -> our nibble pairs ``uint8 [..., J, I/2]``: the byte
    order already puts element 2k in the low nibble, and flipping each nibble's top bit turns offset-binary
    (``q + 8``) into two's complement (:class:`kernels_pallas.quant.Int4Weight`)."""
    b = _int32_words(x, where, 8, 2 * shape[-1])
    return b if b.strides and b.strides[-1] == 0 else b ^ np.uint8(0x88)


def _ct_int8(x, where, shape):
    """``pack-quantized`` 8-bit words ``int32 [..., J, I/4]`` -> codes ``int8 [..., J, I]`` (``q + 128`` stored)."""
    b = _int32_words(x, where, 4, shape[-1])
    if b.strides and b.strides[-1] == 0:
        return np.broadcast_to(np.zeros((), np.int8), b.shape)
    return (b ^ np.uint8(0x80)).view(np.int8)


# -- value checks: what a tensor's bytes must not hold ---------------------------------------------------------


# A float is non-finite when its exponent bits are all ones: (mask over the bits as unsigned, of the same width).
_EXPONENT = {np.dtype(ml_dtypes.bfloat16): (np.uint16, 0x7F80), np.dtype(np.float16): (np.uint16, 0x7C00),
             np.dtype(np.float32): (np.uint32, 0x7F800000), np.dtype(np.float64): (np.uint64, 0x7FF0000000000000),
             np.dtype(ml_dtypes.float8_e5m2): (np.uint8, 0x7C)}


def _first(bad) -> tuple[int, tuple | None]:
    n = int(np.count_nonzero(bad))
    return n, (tuple(int(i) for i in np.argwhere(bad)[0]) if n else None)


_CHUNK = 1 << 20  # elements tested at a time: the temporaries stay in cache (3-7 GB/s here, no full-size copy)


def finite(x) -> tuple[int, tuple | None]:
    """(count, first index) of NaN / Inf values in a float array, from the bits; integers have none.
    float8_e4m3fn has no infinity, only NaN (0x7F / 0xFF). Clean arrays are scanned in chunks with no full-size
    temporary; only an array that holds a bad value is counted whole."""
    dt = np.dtype(x.dtype)
    if dt == np.dtype(np.float32) or dt == np.dtype(np.float64):
        flat = x.reshape(-1)
        if all(np.isfinite(flat[i:i + _CHUNK]).all() for i in range(0, flat.size, _CHUNK)):
            return 0, None
        return _first(~np.isfinite(x))
    if dt == np.dtype(ml_dtypes.float8_e4m3fn):
        bits, mask, full = np.uint8, 0x7F, 0x7F
    elif dt in _EXPONENT:
        bits, mask = _EXPONENT[dt]
        full = mask
    else:
        return 0, None
    flat = x.reshape(-1).view(bits)
    if not any(((flat[i:i + _CHUNK] & mask) == full).any() for i in range(0, flat.size, _CHUNK)):
        return 0, None
    return _first((x.view(bits) & mask) == full)


def e8m0(x) -> tuple[int, tuple | None]:
    """(count, first index) of the E8M0 NaN byte (0xFF) in MXFP4 scale bytes."""
    flat = x.reshape(-1)
    if not any((flat[i:i + _CHUNK] == 255).any() for i in range(0, flat.size, _CHUNK)):
        return 0, None
    return _first(x == 255)


@dataclasses.dataclass(frozen=True)
class Row:
    pattern: str
    target: str  # format string over the pattern's named groups
    transform: Callable = identity
    stacked: bool = False  # fills slot `expert` of a stacked parameter
    check: Callable = finite  # what the values must not hold (NaN / Inf; MXFP4 scales: the NaN byte)
    fp8: bool = False  # may be stored FP8 in 128 x 128 blocks with its ``weight_scale_inv`` beside it (FP8_SCALE)

    def match(self, name):
        return re.fullmatch(self.pattern, name)

    def name_for(self, target: str) -> str | None:
        """The checkpoint name (family prefix stripped) this row expects for parameter leaf ``target`` (one expert
        slot: ``{expert}`` left in), or None when the row fills other leaves."""
        fields = re.findall(r"{(\w+)}", self.target)
        regex = re.escape(self.target)
        for f in fields:
            regex = regex.replace(re.escape("{" + f + "}"), f"(?P<{f}>[\\w]+)", 1)
        m = re.fullmatch(regex, target)
        if m is None:
            return None
        groups = {**m.groupdict(), "expert": "{expert}"}
        # the pattern as a template: named groups become fields, (?:a|b) its first choice, escapes dropped
        template = re.sub(r"\(\?P<(\w+)>[^)]*\)", r"{\1}", self.pattern)
        template = re.sub(r"\(\?:([^|)]*)[^)]*\)", r"\1", template).replace("\\.", ".")
        name = template.format(**groups)
        hit = self.match(name.replace("{expert}", "0"))
        return name if hit and self.target.format(**hit.groupdict()) == target else None


# compressed-tensors' field names of a stored weight ``X``: ``X.weight_packed`` (codes), ``X.weight_scale``, and for
# pack-quantized int4 / int8 weights ``X.weight_shape`` (the logical shape)
PACKED, SCALE, SHAPE = "weight_packed", "weight_scale", "weight_shape"
LAYER = r"model\.layers\.(?P<layer>\d+)\."
EXPERT = r"block_sparse_moe\.experts\.(?P<expert>\d+)\.(?P<w>w[123])\."
RULES = (
    Row(r"model\.embed_tokens\.weight", "embed_tokens"),
    Row(r"model\.norm\.weight", "norm"),
    Row(r"lm_head\.weight", "lm_head"),
    Row(r"model\.output_attn_res_norm\.weight", "output_attn_res.norm"),
    Row(r"model\.output_attn_res_proj\.weight", "output_attn_res.proj", _row_vector),
    Row(LAYER + r"(?P<n>input_layernorm|post_attention_layernorm)\.weight", "layers.{layer}.{n}"),
    Row(LAYER + r"(?P<site>self_attention|mlp)_res_norm\.weight", "layers.{layer}.{site}_res.norm"),
    Row(LAYER + r"(?P<site>self_attention|mlp)_res_proj\.weight", "layers.{layer}.{site}_res.proj", _row_vector),
    # Attention (KDA / MLA / GQA share the `self_attn.` prefix; the layer's kind decides what exists).
    Row(LAYER + r"self_attn\.(?P<n>[qkv]_conv1d)\.weight", "layers.{layer}.self_attn.{n}", _conv),
    Row(LAYER + r"self_attn\.A_log", "layers.{layer}.self_attn.A_log", _a_log),
    Row(LAYER + r"self_attn\.dt_bias", "layers.{layer}.self_attn.dt_bias", _flat),
    Row(LAYER + r"self_attn\.(?P<n>[a-z_]+_proj|[a-z_]+_proj_with_mqa|o_norm|q_a_layernorm|kv_a_layernorm)\.weight",
         "layers.{layer}.self_attn.{n}"),
    # K3.1's DSA indexer in each MLA layer (k_norm.bias optional: OPTIONAL below). DeepSeek-V3.2 stores wq_b and
    # wk FP8-block-quantized (dequantized at load: FP8_SCALE) and weights_proj unquantized.
    Row(LAYER + r"self_attn\.indexer\.(?P<n>wq_b|wk)\.weight", "layers.{layer}.self_attn.indexer.{n}", fp8=True),
    Row(LAYER + r"self_attn\.indexer\.(?P<n>weights_proj|k_norm)\.weight", "layers.{layer}.self_attn.indexer.{n}"),
    Row(LAYER + r"self_attn\.indexer\.k_norm\.bias", "layers.{layer}.self_attn.indexer.k_norm_bias"),
    # Dense MLP (layer 0 of Kimi models; every Llama layer). HF transformers writes Kimi Linear's dense layer
    # under `block_sparse_moe.` too (its save-time rename maps every `.mlp.` back).
    Row(LAYER + r"(?:mlp|block_sparse_moe)\.(?P<n>gate_proj|up_proj|down_proj)\.weight", "layers.{layer}.mlp.{n}"),
    # MoE.
    Row(LAYER + r"block_sparse_moe\.gate\.weight", "layers.{layer}.mlp.gate"),
    Row(LAYER + r"block_sparse_moe\.gate\.e_score_correction_bias", "layers.{layer}.mlp.e_score_correction_bias"),
    Row(LAYER + r"block_sparse_moe\.(?P<n>routed_expert_down_proj|routed_expert_up_proj|routed_expert_norm)\.weight",
         "layers.{layer}.mlp.{n}"),
    Row(LAYER + r"block_sparse_moe\.shared_experts\.(?P<n>gate_proj|up_proj|down_proj)\.weight",
         "layers.{layer}.mlp.shared_experts.{n}"),
    Row(LAYER + EXPERT + r"weight", "layers.{layer}.mlp.experts.{w}", stacked=True),
    # compressed-tensors MXFP4 (kernels_pallas/mxfp4.py): the two fields of one MXFP4Weight
    Row(LAYER + EXPERT + PACKED, "layers.{layer}.mlp.experts.{w}.packed", stacked=True),
    Row(LAYER + EXPERT + SCALE, "layers.{layer}.mlp.experts.{w}.scale", stacked=True, check=e8m0),
)
# Parameter leaves a checkpoint may leave out: they stay zero (a LayerNorm bias the format leaves open).
OPTIONAL = (r"(?:stack\.)?layers\.\d+\.self_attn\.indexer\.k_norm_bias",)


def optional(target: str) -> bool:
    """Whether parameter leaf ``target`` may be missing from a checkpoint (then zero): :data:`OPTIONAL`."""
    return any(re.fullmatch(p, target) for p in OPTIONAL)


# Tensors of the release that are deliberately not part of the text model.
IGNORED = (r"vision_tower\..*", r"mm_projector\..*")

# A DSpark drafter (``k3_dspark``, kimi_jax/model/dspark.py): checkpoint names are the parameter paths plus
# ``.weight``, after an optional ``model.`` prefix. Producers name three tensors differently (docs/generation.md (DSpark drafters)):
DSPARK_ALIASES = {"fc": "context_proj", "hidden_norm": "context_norm", "fc_norm": "context_norm",
                  "norm": "final_norm"}
# What a drafter file may hold that is not the drafter's: the target's own embedding and lm_head (shared, checked
# against the target's shape), the training-only confidence head.
DSPARK_SHARED = ("embed_tokens.weight", "lm_head.weight")
DSPARK_IGNORED = (r"confidence_head\..*",)


def dspark_target(name: str) -> str | None:
    """The drafter parameter path a ``k3_dspark`` checkpoint tensor fills; None for a shared or ignored tensor."""
    name = name.removeprefix("model.")
    if name in DSPARK_SHARED or any(re.fullmatch(p, name) for p in DSPARK_IGNORED):
        return None
    stem = name.removesuffix(".weight")
    return DSPARK_ALIASES.get(stem, stem)


# compressed-tensors ``pack-quantized`` (int4 / int8, weight-only, symmetric): a dense weight ``X.weight`` stored as
# ``X.weight_packed`` + ``X.weight_scale`` + ``X.weight_shape``. The row that places ``X.weight`` names the parameter;
# the fields go to its packed type's leaves (:class:`~kernels_pallas.quant.Int4Weight` ``packed`` /
# :class:`~kernels_pallas.quant.Int8Weight` ``q``, ``scale``; whichever the model holds). ``weight_shape`` is no
# parameter: the loader checks it against the parameter's shape (kimi_jax.checkpoint.hf).
CT_FIELDS = {PACKED: (("packed", _ct_int4), ("q", _ct_int8)), SCALE: (("scale", identity),)}


def ct_tensors(weight_name: str) -> tuple[str, str]:
    """(codes, logical shape): the tensors that store the pack-quantized weight ``X.weight`` (``{expert}`` kept)."""
    stem = weight_name[:-len("weight")]
    return stem + PACKED, stem + SHAPE


# FP8 block quantization (DeepSeek-V3 / V3.2's ``quant_method: fp8``, ``weight_block_size [128, 128]``): a weight
# ``X.weight`` float8_e4m3fn ``[J, I]`` with ``X.weight_scale_inv`` float32 ``[ceil(J/128), ceil(I/128)]``, one scale
# per 128 x 128 block (the last ones partial), ``w = float(fp8) * scale_inv`` of its block. Only rows marked ``fp8``
# take it; the weight is dequantized at load to the parameter's dtype (:func:`fp8_dequantize`).
FP8_SCALE, FP8_BLOCK = "weight_scale_inv", 128
FP8_DTYPES = ("F8_E4M3",)  # the safetensors dtypes of a block-quantized weight
FP8_RAW = ("F8_E4M3", "F8_E5M2")  # float8 tensors: never loaded as plain floats (they mean nothing unscaled)


def fp8_scale_shape(shape) -> tuple:
    """The ``weight_scale_inv`` shape of an FP8 weight of ``shape [J, I]``: ``[ceil(J/128), ceil(I/128)]``."""
    return tuple(-(-int(n) // FP8_BLOCK) for n in shape)


def fp8_check(where: str, dtype: str, shape, scale_name: str, scale_dtype: str, scale_shape) -> None:
    """Refuse, from the headers alone, an FP8 weight whose dtype or ``weight_scale_inv`` does not fit it."""
    if dtype not in FP8_DTYPES or len(shape) != 2:
        raise WeightError(f"{where}: a weight with a {FP8_SCALE} beside it must be float8_e4m3fn [J, I] "
                          f"(FP8 blocks of {FP8_BLOCK} x {FP8_BLOCK}), got {dtype} {list(shape)}")
    want = fp8_scale_shape(shape)
    if tuple(scale_shape) != want or scale_dtype not in ("F32", "BF16", "F16"):
        raise WeightError(f"{where}: its block scales {scale_name!r} are {scale_dtype} {list(scale_shape)}, but an "
                          f"FP8 weight {list(shape)} in {FP8_BLOCK} x {FP8_BLOCK} blocks needs float32 {list(want)}")


def fp8_dequantize(w, scale_inv) -> np.ndarray:
    """``w`` float8 ``[J, I]`` times each 128 x 128 block's ``scale_inv`` -> float32 ``[J, I]`` (one rounding: the
    float32 product; every float8 value is exact in float32)."""
    J, I = w.shape
    s = np.asarray(scale_inv, np.float32)
    return np.asarray(w).astype(np.float32) * np.repeat(np.repeat(s, FP8_BLOCK, 0)[:J], FP8_BLOCK, 1)[:, :I]


@dataclasses.dataclass(frozen=True)
class Destination:
    """Where one checkpoint tensor goes: parameter leaf ``target``, at ``expert`` of its leading dimension when the
    leaf stacks experts."""

    tensor: str
    target: str
    expert: int | None
    transform: Callable
    check: Callable = finite
    scale: str | None = None  # an FP8 weight's block scales (the ``weight_scale_inv`` tensor beside it)


def canonical(name: str, cfg: ModelConfig) -> str | None:
    """Strip the family prefix (``language_model.`` for the K3 release); None for out-of-scope tensors."""
    if cfg.checkpoint_prefix:
        if name.startswith(cfg.checkpoint_prefix):
            return name[len(cfg.checkpoint_prefix):]
        if any(re.fullmatch(p, name) for p in IGNORED):
            return None
        return name  # reported as unmatched below
    return name


def _match_packed(name: str, cname: str, targets) -> Destination | None:
    """A compressed-tensors ``pack-quantized`` field (:data:`CT_FIELDS`), placed by the row of its ``.weight``."""
    stem, _, field = cname.rpartition(".")
    if field not in CT_FIELDS:
        return None
    base = match(name, stem + ".weight", targets=None)
    if base is None or base.expert is not None or base.transform is not identity:
        return None
    for leaf, transform in CT_FIELDS[field]:
        if f"{base.target}.{leaf}" in targets:
            return Destination(name, f"{base.target}.{leaf}", None, transform, finite)
    return None


def match(name: str, cname: str, targets) -> Destination | None:
    """The placement of one tensor, ``name`` canonicalised to ``cname`` (:func:`canonical`), or None when no leaf of
    ``targets`` takes it (``targets=None``: the row's target without checking that the model has it). :func:`assign`
    matches a whole checkpoint and checks it is complete; the export matches the file's side alone."""
    hits = [(rule, m) for rule in RULES if (m := rule.match(cname))]
    if len(hits) > 1:
        raise WeightError(f"tensor {name!r} matches {len(hits)} name-table rows: {[h[0].pattern for h in hits]}")
    if not hits:
        return _match_packed(name, cname, targets) if targets is not None else None
    rule, m = hits[0]
    groups = m.groupdict()
    target = rule.target.format(**groups)
    if targets is not None and target not in targets:
        return None
    return Destination(name, target, int(groups["expert"]) if rule.stacked else None, rule.transform, rule.check)


def assign(names, cfg: ModelConfig, targets: dict[str, jax.ShapeDtypeStruct], *,
          files=()) -> tuple[list[Destination], list[str]]:
    """Match checkpoint tensor names to parameter leaves. Returns (placements, ignored names); raises on any tensor
    that fits nothing, any leaf (or expert slot) filled twice or not at all. ``files``: the checkpoint's file names,
    for the messages about tensors that are missing."""
    placements, ignored, unmatched, shapes, scales = [], [], [], [], []
    for name in names:
        cname = canonical(name, cfg)
        if cname is None:
            ignored.append(name)
            continue
        if cname.endswith("." + SHAPE):
            shapes.append(name)  # consumed by its weight_packed's placement, below
            continue
        if cname.endswith("." + FP8_SCALE):
            scales.append((name, cname))  # joins its FP8 weight's placement, below
            continue
        p = match(name, cname, targets)
        if p is None:
            unmatched.append(name)
        else:
            placements.append(p)
    placed = {p.tensor for p in placements}
    for name in shapes:
        (ignored if name[:-len(SHAPE)] + PACKED in placed else unmatched).append(name)
    placements = _with_scales(placements, scales, unmatched)
    if unmatched:
        raise WeightError(
            f"{len(unmatched)} checkpoint tensor(s) match no parameter of this {cfg.family} model "
            f"(attention kinds {sorted(set(cfg.attn_types))}): {unmatched[:8]}{' ...' if len(unmatched) > 8 else ''}")
    _check_complete(placements, targets, cfg, files)
    return placements, ignored


def _with_scales(placements: list[Destination], scales, unmatched: list[str]) -> list[Destination]:
    """``placements`` with each FP8 block scale ``X.weight_scale_inv`` (``scales``: (name, canonical name)) joined to
    the placement of its ``X.weight``, when that weight's row takes FP8 blocks (:data:`FP8_SCALE`); any other scale
    goes to ``unmatched``."""
    at = {p.tensor: i for i, p in enumerate(placements)}
    out = list(placements)
    for name, cname in scales:
        weight_cname = cname[:-len(FP8_SCALE)] + "weight"
        i = at.get(name[:-len(FP8_SCALE)] + "weight")
        if i is None or not any(rule.fp8 and rule.match(weight_cname) for rule in RULES):
            unmatched.append(name)
        else:
            out[i] = dataclasses.replace(out[i], scale=name)
    return out


def expected_tensor(target: str, cfg: ModelConfig) -> str | None:
    """The checkpoint name the table expects for parameter leaf ``target`` (``{expert}`` where a leaf stacks
    experts), with the family's prefix; None when no row fills it."""
    for rule in RULES:
        name = rule.name_for(target)
        if name is not None:
            return (cfg.checkpoint_prefix or "") + name
    return None


def _searched(files) -> str:
    files = sorted(files)
    if not files:
        return "the checkpoint"
    return ", ".join(files) if len(files) <= 3 else f"{len(files)} files ({files[0]} ... {files[-1]})"


def _check_complete(placements: list[Destination], targets: dict[str, jax.ShapeDtypeStruct], cfg: ModelConfig, files):
    seen: dict[tuple, str] = {}
    experts: dict[str, set] = {}
    for p in placements:
        key = (p.target, p.expert)
        if key in seen:
            raise WeightError(f"tensors {seen[key]!r} and {p.tensor!r} both fill parameter {p.target}"
                              + (f" expert {p.expert}" if p.expert is not None else ""))
        seen[key] = p.tensor
        if p.expert is not None:
            experts.setdefault(p.target, set()).add(p.expert)
    for target, sds in targets.items():
        want = expected_tensor(target, cfg) or "(no name-table row)"
        if target in experts:
            n = sds.shape[0]
            bad = sorted(e for e in experts[target] if e >= n)
            if bad:
                raise WeightError(f"checkpoint has experts {bad[:5]} for {target}, but the config has {n} experts")
            missing = sorted(set(range(n)) - experts[target])
            if missing:
                raise WeightError(f"checkpoint tensor {want.format(expert=missing[0])!r}"
                                  + (f" (and {len(missing) - 1} more experts: {missing[1:8]})" if len(missing) > 1
                                     else "")
                                  + f" is in none of {_searched(files)}; it fills parameter {target}")
        elif (target, None) not in seen and not optional(target):
            raise WeightError(f"checkpoint tensor {want!r} is in none of {_searched(files)}; it fills parameter "
                              f"{target} {list(sds.shape)}")
