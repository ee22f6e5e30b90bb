"""The checkpoint name table: one row per tensor kind, mapping checkpoint names to model parameters.

A row is (pattern over the checkpoint name with the family prefix stripped, parameter path template,
transform). Routed experts ``experts.{e}.w{1,2,3}`` land in slot ``e`` of a stacked parameter. The same
checkpoint name can mean different tensors on different layer kinds (``g_proj`` on KDA vs MLA layers,
``q_proj`` on KDA vs GQA vs low-rank-less MLA): the parameter path is resolved against the model built for the
config, and the shape check tells them apart.

Every checkpoint tensor is consumed exactly once and every parameter is filled exactly once; anything else is
an error that names the tensor, the file and the shapes.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kimi_jax.checkpoint.safetensors import Checkpoint, CheckpointError, TensorInfo
from kimi_jax.model.config import ModelConfig


class WeightError(CheckpointError):
    """A checkpoint that does not fit the model its config describes."""


# -- transforms: each checks its input shape -----------------------------------------------------------


def _identity(x, name):
    return x


def _conv(x, name):
    """``[P, 1, W]`` depthwise conv kernel -> ``[P, W]``."""
    if x.ndim != 3 or x.shape[1] != 1:
        raise WeightError(f"{name}: expected a depthwise conv kernel [P, 1, W], got {list(x.shape)}")
    return x[:, 0, :]


def _row_vector(x, name):
    """``[1, D]`` (a Linear(D -> 1)) -> ``[D]``."""
    if x.ndim != 2 or x.shape[0] != 1:
        raise WeightError(f"{name}: expected [1, D], got {list(x.shape)}")
    return x[0]


def _flat(x, name):
    return x.reshape(-1)


@dataclasses.dataclass(frozen=True)
class Rule:
    pattern: str
    target: str  # format string over the pattern's named groups
    transform: Callable = _identity
    stacked: bool = False  # fills slot `expert` of a stacked parameter

    def match(self, name):
        return re.fullmatch(self.pattern, name)


L = r"model\.layers\.(?P<layer>\d+)\."
E = r"block_sparse_moe\.experts\.(?P<expert>\d+)\.(?P<w>w[123])\."
RULES = (
    Rule(r"model\.embed_tokens\.weight", "embed_tokens"),
    Rule(r"model\.norm\.weight", "norm"),
    Rule(r"lm_head\.weight", "lm_head"),
    Rule(r"model\.output_attn_res_norm\.weight", "output_attn_res.norm"),
    Rule(r"model\.output_attn_res_proj\.weight", "output_attn_res.proj", _row_vector),
    Rule(L + r"(?P<n>input_layernorm|post_attention_layernorm)\.weight", "layers.{layer}.{n}"),
    Rule(L + r"(?P<site>self_attention|mlp)_res_norm\.weight", "layers.{layer}.{site}_res.norm"),
    Rule(L + r"(?P<site>self_attention|mlp)_res_proj\.weight", "layers.{layer}.{site}_res.proj", _row_vector),
    # Attention (KDA / MLA / GQA share the `self_attn.` prefix; the layer's kind decides what exists).
    Rule(L + r"self_attn\.(?P<n>[qkv]_conv1d)\.weight", "layers.{layer}.self_attn.{n}", _conv),
    Rule(L + r"self_attn\.A_log", "layers.{layer}.self_attn.A_log", "a_log"),
    Rule(L + r"self_attn\.dt_bias", "layers.{layer}.self_attn.dt_bias", _flat),
    Rule(L + r"self_attn\.(?P<n>[a-z_]+_proj|[a-z_]+_proj_with_mqa|o_norm|q_a_layernorm|kv_a_layernorm)\.weight",
         "layers.{layer}.self_attn.{n}"),
    # Dense MLP (layer 0 of Kimi models; every Llama layer). HF transformers writes Kimi Linear's dense layer
    # under `block_sparse_moe.` too (its save-time rename maps every `.mlp.` back).
    Rule(L + r"(?:mlp|block_sparse_moe)\.(?P<n>gate_proj|up_proj|down_proj)\.weight", "layers.{layer}.mlp.{n}"),
    # MoE.
    Rule(L + r"block_sparse_moe\.gate\.weight", "layers.{layer}.mlp.gate"),
    Rule(L + r"block_sparse_moe\.gate\.e_score_correction_bias", "layers.{layer}.mlp.e_score_correction_bias"),
    Rule(L + r"block_sparse_moe\.(?P<n>routed_expert_down_proj|routed_expert_up_proj|routed_expert_norm)\.weight",
         "layers.{layer}.mlp.{n}"),
    Rule(L + r"block_sparse_moe\.shared_experts\.(?P<n>gate_proj|up_proj|down_proj)\.weight",
         "layers.{layer}.mlp.shared_experts.{n}"),
    Rule(L + E + r"weight", "layers.{layer}.mlp.experts.{w}", stacked=True),
    Rule(L + E + r"weight_packed", "layers.{layer}.mlp.experts.{w}_packed", stacked=True),
    Rule(L + E + r"weight_scale", "layers.{layer}.mlp.experts.{w}_scale", stacked=True),
)
# Tensors of the release that are deliberately not part of the text model.
IGNORED = (r"vision_tower\..*", r"mm_projector\..*")


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one checkpoint tensor goes."""

    tensor: str
    target: str
    expert: int | None
    transform: Callable | str


def canonical(name: str, cfg: ModelConfig) -> str | None:
    """Strip the family prefix (``language_model.`` for the K3 release); None for out-of-scope tensors."""
    if cfg.checkpoint_prefix:
        if name.startswith(cfg.checkpoint_prefix):
            return name[len(cfg.checkpoint_prefix):]
        if any(re.fullmatch(p, name) for p in IGNORED):
            return None
        return name  # reported as unmatched below
    return name


def plan(names, cfg: ModelConfig, targets: dict[str, jax.ShapeDtypeStruct]) -> tuple[list[Placement], list[str]]:
    """Match checkpoint tensor names to parameters. Returns (placements, ignored names); raises on any mismatch."""
    placements, ignored, unmatched = [], [], []
    for name in names:
        cname = canonical(name, cfg)
        if cname is None:
            ignored.append(name)
            continue
        hits = [(rule, m) for rule in RULES if (m := rule.match(cname))]
        if len(hits) > 1:
            raise WeightError(f"tensor {name!r} matches {len(hits)} name-table rows: {[h[0].pattern for h in hits]}")
        if not hits:
            unmatched.append(name)
            continue
        rule, m = hits[0]
        groups = m.groupdict()
        target = rule.target.format(**groups)
        if target not in targets:
            unmatched.append(name)
            continue
        expert = int(groups["expert"]) if rule.stacked else None
        placements.append(Placement(name, target, expert, rule.transform))
    if unmatched:
        raise WeightError(
            f"{len(unmatched)} checkpoint tensor(s) match no parameter of this {cfg.family} model "
            f"(attention kinds {_kinds(cfg)}): {unmatched[:8]}{' ...' if len(unmatched) > 8 else ''}")
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
        if target in experts:
            n = sds.shape[0]
            bad = sorted(e for e in experts[target] if e >= n)
            if bad:
                raise WeightError(f"checkpoint has experts {bad[:5]} for {target}, but the config has {n} experts")
            missing = sorted(set(range(n)) - experts[target])
            if missing:
                raise WeightError(f"parameter {target}: checkpoint is missing experts {missing[:8]}")
        elif (target, None) not in seen:
            raise WeightError(f"parameter {target} {list(sds.shape)} has no tensor in the checkpoint")
    return placements, ignored


def _kinds(cfg):
    return sorted(set(cfg.attn_types))


def transform(p: Placement, arr: np.ndarray, info: TensorInfo, sds: jax.ShapeDtypeStruct) -> np.ndarray:
    """Apply the row's transform, check shape and dtype class, cast to the parameter dtype."""
    where = f"tensor {p.tensor!r} in {os.path.basename(info.file)}"
    if p.transform == "a_log":
        arr = _a_log(arr, sds.shape[0], where)
    else:
        arr = p.transform(arr, where)
    want = tuple(sds.shape[1:]) if p.expert is not None else tuple(sds.shape)
    if tuple(arr.shape) != want:
        raise WeightError(f"{where}: shape {list(info.shape)} -> {list(arr.shape)} does not fit parameter "
                          f"{p.target} {list(want)}")
    target_int = jnp.issubdtype(sds.dtype, jnp.integer)
    if target_int != (info.dtype in ("U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64", "BOOL")):
        raise WeightError(f"{where}: dtype {info.dtype} cannot fill parameter {p.target} of dtype {sds.dtype}")
    if target_int and np.dtype(arr.dtype) != np.dtype(sds.dtype):
        raise WeightError(f"{where}: dtype {info.dtype} but parameter {p.target} is {sds.dtype}")
    return np.asarray(arr).astype(sds.dtype, copy=False)


def _a_log(arr, heads, where):
    """A_log as released is zero-padded ([128] for 96 heads); HF Kimi Linear writes [1, 1, H, 1]."""
    flat = np.asarray(arr, np.float32).reshape(-1)
    if flat.shape[0] < heads:
        raise WeightError(f"{where}: A_log has {flat.shape[0]} entries for {heads} heads")
    if np.any(flat[heads:] != 0):
        raise WeightError(f"{where}: A_log padding beyond the first {heads} entries must be zero, "
                          f"found {int(np.count_nonzero(flat[heads:]))} non-zero values")
    return flat[:heads]


def flat_targets(abstract_state) -> dict[str, jax.ShapeDtypeStruct]:
    """Parameter paths ("layers.3.self_attn.q_proj") -> ShapeDtypeStruct."""
    out = {}
    for path, var in nnx.to_flat_state(abstract_state):
        out[".".join(str(k) for k in path)] = var.get_value() if hasattr(var, "get_value") else var.value
    return out


def read_params(ckpt: Checkpoint, cfg: ModelConfig, targets: dict[str, jax.ShapeDtypeStruct], *, progress=None,
                put: Callable[[str, np.ndarray], object] | None = None) -> dict[str, object]:
    """Read every parameter (host numpy, or whatever ``put(path, array)`` returns), one tensor at a time."""
    placements, _ = plan(list(ckpt.tensors), cfg, targets)
    by_target: dict[str, list[Placement]] = {}
    for p in placements:
        by_target.setdefault(p.target, []).append(p)
    out = {}
    # Read in file order: sequential I/O over shards.
    order = sorted(by_target, key=lambda t: min((ckpt.tensors[p.tensor].file, ckpt.tensors[p.tensor].offset)
                                                for p in by_target[t]))
    for target in order:
        sds = targets[target]
        group = by_target[target]
        if group[0].expert is None:
            (p,) = group
            value = transform(p, ckpt.get(p.tensor), ckpt.tensors[p.tensor], sds)
        else:
            value = np.empty(sds.shape, sds.dtype)
            for p in sorted(group, key=lambda p: p.expert):
                value[p.expert] = transform(p, ckpt.get(p.tensor), ckpt.tensors[p.tensor], sds)
        out[target] = put(target, value) if put else value
        if progress is not None:
            progress(target, value)
    return out


def load_hf(path, cfg: ModelConfig, model_factory, *, shardings=None):
    """Build the model for ``cfg`` and fill it from the HF checkpoint at ``path``.

    ``model_factory()`` builds the (small or abstract) model; ``shardings``: optional dict path -> Sharding.
    """
    ckpt = Checkpoint(path)
    abstract = nnx.eval_shape(model_factory)
    graphdef, state = nnx.split(abstract)
    targets = flat_targets(state)

    def put(target, value):
        sharding = None if shardings is None else shardings.get(target)
        return jax.device_put(value, sharding) if sharding is not None else jnp.asarray(value)

    values = read_params(ckpt, cfg, targets, put=put)
    ckpt.close()
    for path_, var in nnx.to_flat_state(state):
        var.set_value(values[".".join(str(k) for k in path_)])
    return nnx.merge(graphdef, state)
