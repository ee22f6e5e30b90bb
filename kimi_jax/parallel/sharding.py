"""Parallel layouts: the mesh axes, one table from logical axis names to mesh axes, and the partition specs of
every parameter and cache array derived from it.

Mesh axes: ``data`` (independent sequences), ``expert`` (routed experts; attention and caches run
data-parallel over it: "DP attention + EP MoE"), ``model`` (tensor parallelism: heads, MLP width, vocab).
A layout is one table ``logical axis -> mesh axes``; another parallel layout is another table.

Parameters declare logical axes in their metadata (``nnx.Param(..., axes=(...))``); caches declare them here
(:func:`cache_specs`). Two rules turn a table into specs, each for a reason:

* **Divisibility.** A dimension takes the longest prefix of its mesh axes whose product divides it; the rest
  is replicated (4 heads cannot be split 8 ways). For packed weights (MXFP4) the input dimension counts in units
  of one 32-value scale group, so a packed shard and its scale shard always cover the same columns.
* **One module, one decision.** Within a module, every array carrying a logical axis shards it the same way
  (the shortest prefix any of them allows). Attention modules add a virtual ``[num_heads]`` array, so heads are
  never split mid-head: a flattened ``q_proj [H*K, D]`` is sharded only if ``H`` itself divides.

And one check: no array may map two of its logical axes to the same mesh axis (:class:`ShardingError`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from kernels_pallas import packed
from kernels_pallas._dispatch import Placement, dividing_prefix
from kernels_pallas.cache_quant import Int8Rows
from kimi_jax.model import dspark, params
from kimi_jax.model.cache import Cache, KDACache, KVCache, MLACache
from kimi_jax.model.config import ModelConfig

MESH_AXES = ("data", "expert", "model")


class ShardingError(ValueError):
    """A layout table or mesh that cannot shard the given arrays."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """One table: logical axis name -> mesh axes (a tuple; the order is the order of the split)."""

    name: str
    rules: tuple[tuple[str, tuple[str, ...]], ...]

    def __post_init__(self):
        for logical, axes in self.rules:
            bad = [a for a in axes if a not in MESH_AXES]
            if bad:
                raise ShardingError(f"layout {self.name!r}: logical axis {logical!r} maps to unknown mesh axes {bad} "
                                    f"(mesh axes are {MESH_AXES})")

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        if logical is None:
            return ()
        for name, axes in self.rules:
            if name == logical:
                return axes
        raise ShardingError(f"layout {self.name!r} has no rule for logical axis {logical!r}")


def _table(name: str, **rules) -> Layout:
    return Layout(name, tuple((k, tuple(v)) for k, v in rules.items()))


# The default: attention heads / MLP width / vocab / LatentMoE projections split over `model`, routed experts
# over `expert` and each expert's hidden width over `model`, sequences over `data` and `expert`. The MLA latent
# cache has no head axis: its positions split over `model` instead (`mla_seq`; the MLA kernel op merges the
# per-device partial attention, kernels_pallas/mla_decode). GQA caches keep their positions whole (`cache_seq`).
# A DSpark drafter's context projection takes the target's tapped streams (`taps`) split over `model`, as an output
# projection takes its heads: partial sums added.
TP_EP = _table(
    "tp_ep",
    batch=("data", "expert"), cache_seq=(), mla_seq=("model",),
    vocab=("model",), embed=(), heads=("model",), kv_heads=("model",), mlp=("model",), latent=("model",),
    expert=("expert",), expert_mlp=("model",), taps=("model",),
)
# Wide expert parallelism (SGLang's TP16/EP16 on 16 H200s is `--mesh model=16`): experts over every chip of
# `expert` x `model`, each expert whole on one chip; attention as in TP_EP.
WIDE_EP = _table(
    "wide_ep",
    batch=("data", "expert"), cache_seq=(), mla_seq=("model",),
    vocab=("model",), embed=(), heads=("model",), kv_heads=("model",), mlp=("model",), latent=("model",),
    expert=("expert", "model"), expert_mlp=(), taps=("model",),
)
LAYOUTS = {t.name: t for t in (TP_EP, WIDE_EP)}


def layout(name_or_layout) -> Layout:
    if isinstance(name_or_layout, Layout):
        return name_or_layout
    if name_or_layout not in LAYOUTS:
        raise ShardingError(f"unknown layout {name_or_layout!r}; available: {sorted(LAYOUTS)}")
    return LAYOUTS[name_or_layout]


@dataclasses.dataclass(frozen=True)
class Parallel:
    """How a model runs on many devices (hashable: lives in :class:`~kimi_jax.model.run.RunConfig`, static under jit).

    ``dispatch``: expert-parallel token exchange. ``"auto"`` = ``"ragged"`` (``ragged_all_to_all``) on TPU/GPU and
    ``"capacity"`` (fixed-capacity ``all_to_all``) on CPU, where XLA has no ragged all-to-all;
    ``"ragged_emulated"`` runs the ragged path's offset arithmetic over ``all_gather`` (CPU tests of that path).
    ``capacity_factor``: None = lossless buffers (worst case: every pair of a shard to one destination); a number
    sizes buffers at that multiple of the mean load and *drops* overflowing (token, expert) pairs.
    """

    mesh: object  # jax.sharding.Mesh or AbstractMesh
    layout: Layout = TP_EP
    dispatch: str = "auto"
    capacity_factor: float | None = None

    def __post_init__(self):
        if self.dispatch not in ("auto", "ragged", "capacity", "ragged_emulated"):
            raise ShardingError(f"Parallel.dispatch={self.dispatch!r}; choose auto, ragged, capacity or ragged_emulated")
        missing = [a for a in MESH_AXES if a not in self.mesh.shape]
        if missing:
            raise ShardingError(f"mesh axes {tuple(self.mesh.shape)} lack {missing}; build meshes with make_mesh()")

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.mesh.shape)

    def param_value_specs(self, module) -> dict:
        """The partition specs of ``module``'s own parameters on this mesh, shaped like their values
        (:func:`param_value_specs`): what an op that places itself needs of the weights it is given."""
        return param_value_specs(module, self.sizes, self.layout)

    @property
    def placement(self) -> Placement:
        """What the kernel ops need to place themselves on this mesh: the mesh and this layout's table."""
        return Placement(self.mesh, self.layout.rules)


# -- meshes ------------------------------------------------------------------------------------------------


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=1,expert=64,model=8"`` -> {"data": 1, "expert": 64, "model": 8} (missing axes are 1)."""
    sizes = dict.fromkeys(MESH_AXES, 1)
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, val = part.partition("=")
        if key not in MESH_AXES or not val.isdigit() or int(val) < 1:
            raise ShardingError(f"--mesh {text!r}: {part!r} is not AXIS=N with AXIS in {MESH_AXES} and N >= 1")
        sizes[key] = int(val)
    return sizes


def check_expert_split(cfg: ModelConfig, sizes: Mapping[str, int], lay: Layout | str = "tp_ep") -> None:
    """A mesh whose expert split cannot divide the routed experts would replicate them on every device: refused,
    naming the axes (``--mesh``)."""
    if cfg.moe is None:
        return
    axes = layout(lay).mesh_axes("expert")
    n = math.prod(int(sizes.get(a, 1)) for a in axes)
    if cfg.moe.num_experts % n:
        raise ShardingError(f"--mesh: {'x'.join(f'{a}={sizes.get(a, 1)}' for a in axes)} = {n} does not divide the "
                            f"{cfg.moe.num_experts} routed experts (they would be replicated on every chip)")


def make_mesh(data: int = 1, expert: int = 1, model: int = 1, *, devices=None) -> jax.sharding.Mesh:
    """A (data, expert, model) mesh over ``devices`` (default: all global devices), Auto axis types (GSPMD)."""
    n = data * expert * model
    devices = jax.devices() if devices is None else list(devices)
    if n != len(devices):
        raise ShardingError(f"mesh data={data} x expert={expert} x model={model} = {n} devices, "
                            f"but {len(devices)} are available")
    try:
        return jax.make_mesh((data, expert, model), MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)
    except NotImplementedError:
        # A TPU torus whose sides the mesh axes cannot be built from (model=8 on a v5p 4x4x4): let an axis span
        # parts of two physical axes (``allow_split_physical_axes``) instead of refusing the mesh.

        grid = mesh_utils.create_device_mesh((data, expert, model), devices, allow_split_physical_axes=True)
        return jax.sharding.Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def abstract_mesh(data: int = 1, expert: int = 1, model: int = 1) -> jax.sharding.AbstractMesh:
    """Sizes only (no devices): enough for specs and plans."""
    return jax.sharding.AbstractMesh((data, expert, model), MESH_AXES, axis_types=(AxisType.Auto,) * 3)


# -- specs -------------------------------------------------------------------------------------------------


class Arr(NamedTuple):
    """One array as the spec rules see it: logical axes per dimension, shape, and the divisibility unit of its last
    dimension (a packed weight's field counts in quantization groups, :mod:`kernels_pallas.packed`)."""

    axes: tuple
    shape: tuple
    unit: int = 1
    dtype: object = None


def _check_conflicts(where: str, axes, lay: Layout):
    seen: dict[str, str] = {}
    for logical in axes:
        for m in lay.mesh_axes(logical):
            if m in seen:
                raise ShardingError(f"{where}: layout {lay.name!r} maps logical axes {seen[m]!r} and {logical!r} "
                                    f"of one array to the same mesh axis {m!r}")
            seen[m] = logical


def _allowed(logical: str, size: int, sizes: Mapping[str, int], lay: Layout) -> tuple[str, ...]:
    """Longest prefix of the logical axis's mesh axes (size-1 axes left out) whose product divides ``size``: the rule
    the kernel ops apply to their operands too (:func:`kernels_pallas._dispatch.dividing_prefix`)."""
    return dividing_prefix(lay.mesh_axes(logical), sizes, [size])


def _common_prefix(a: tuple, b: tuple) -> tuple:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def _broadcast(a: Arr, d: int) -> bool:
    """A packed field's last dimension broadcast over the logical one (unit 0: int8's per-row scale), never split."""
    return a.unit == 0 and d == len(a.shape) - 1


def group_specs(arrays: Mapping[str, Arr | tuple], sizes: Mapping[str, int], lay: Layout,
                virtual: Mapping[str, int] | None = None, where: str = "") -> dict[str, PartitionSpec]:
    """Specs for the arrays of one module: ``{name: Arr(axes, shape[, unit])}``; ``virtual``: extra {logical: size}
    constraints (a module's head count). Applies the conflict check and both rules of the module docstring."""
    decided: dict[str, tuple[str, ...]] = {}

    def narrow(logical, size):
        allowed = _allowed(logical, size, sizes, lay)
        decided[logical] = allowed if logical not in decided else _common_prefix(decided[logical], allowed)

    arrays = {name: Arr(*a) for name, a in arrays.items()}
    for name, a in arrays.items():
        _check_conflicts(f"{where}{name}", a.axes, lay)
        for d, (logical, size) in enumerate(zip(a.axes, a.shape)):
            if logical is not None and not _broadcast(a, d):
                narrow(logical, int(size) // (a.unit if d == len(a.shape) - 1 else 1))
    for logical, size in (virtual or {}).items():
        if logical in decided:
            narrow(logical, size)
    out = {}
    for name, a in arrays.items():
        parts = []
        for d, logical in enumerate(a.axes):
            m = decided.get(logical, ()) if logical is not None and not _broadcast(a, d) else ()
            parts.append(None if not m else (m[0] if len(m) == 1 else m))
        out[name] = PartitionSpec(*parts)
    return out


def _module_virtual(module) -> dict[str, int]:
    cfg = getattr(module, "cfg", None)
    out = {}
    if hasattr(cfg, "num_heads"):
        out["heads"] = cfg.num_heads
    if hasattr(cfg, "num_kv_heads"):
        out["kv_heads"] = cfg.num_kv_heads
    return out


def _param_arrays(module) -> dict[str, Arr]:
    """Every parameter leaf of ``module`` (not of its submodules): ``name`` for an array, ``name.field`` for each
    field of a packed weight, all under the parameter's logical axes."""
    out = {}
    for name, var in vars(module).items():
        if isinstance(var, nnx.Param):
            axes = var.get_metadata().get("axes")
            if axes is None:
                raise ShardingError(f"parameter {type(module).__name__}.{name} declares no logical axes")
            value = var.get_value()
            if packed.is_packed(value):
                for field, leaf, unit in zip(value._fields, value, packed.group_units(value)):
                    out[f"{name}.{field}"] = Arr(tuple(axes), tuple(leaf.shape), unit, leaf.dtype)
            else:
                out[name] = Arr(tuple(axes), tuple(value.shape), 1, value.dtype)
    return out


def module_specs(module, sizes: Mapping[str, int], lay: Layout, prefix: str = "") -> dict[str, PartitionSpec]:
    """Specs of one module's own parameter leaves (``name``, or ``name.field`` of a packed weight)."""
    return group_specs(_param_arrays(module), sizes, lay, _module_virtual(module), prefix)


def param_value_specs(module, sizes: Mapping[str, int], lay: Layout) -> dict:
    """Specs of one module's own parameters shaped like their values: a ``PartitionSpec`` for an array, the packed
    type holding one spec per field for a packed weight (what ``shard_map`` takes for that value)."""
    leaves = module_specs(module, sizes, lay)
    out = {}
    for name, var in vars(module).items():
        if isinstance(var, nnx.Param):
            value = var.get_value()
            out[name] = (type(value)(*(leaves[f"{name}.{f}"] for f in value._fields)) if packed.is_packed(value)
                         else leaves[name])
    return out


@dataclasses.dataclass(frozen=True)
class ModuleParams:
    """One module's parameters as the spec rules see them (computed once per model, reused for every mesh)."""

    prefix: str  # "layers.3.self_attn."
    arrays: dict  # leaf name -> Arr
    virtual: dict  # logical axis -> size (head counts)
    dtypes: dict  # name -> dtype


def module_table(model) -> list[ModuleParams]:
    """Every module that owns parameters. Modules of a scanned layer stack (``stack.``, :mod:`kimi_jax.model.layer_plan`)
    hold their parameters stacked over the repetitions: that leading dimension is never split."""
    out = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module):
            arrays = _param_arrays(node)
            if arrays and path and path[0] == "stack":
                arrays = {n: a._replace(axes=(None, *a.axes)) for n, a in arrays.items()}
            if arrays:
                dtypes = {n: a.dtype for n, a in arrays.items()}
                out.append(ModuleParams("".join(f"{p}." for p in path), arrays, _module_virtual(node), dtypes))
    return out


def mesh_sizes(mesh_or_sizes) -> dict[str, int]:
    """``{axis: size}`` of a :class:`jax.sharding.Mesh` (or anything with a ``shape`` mapping), or a copy of a sizes
    dict as given."""
    return dict(mesh_or_sizes.shape) if hasattr(mesh_or_sizes, "shape") else dict(mesh_or_sizes)


def param_specs(model, mesh_or_sizes, lay: Layout | str = TP_EP, *, table=None) -> dict[str, PartitionSpec]:
    """Partition spec of every parameter leaf of ``model`` (real or abstract), keyed as
    :func:`kimi_jax.model.params.leaves` keys them: "layers.3.self_attn.q_proj", "layers.3.mlp.experts.w1.packed"
    (``table``: a :func:`module_table` of the model, to skip walking it again)."""
    lay = layout(lay)
    sizes = mesh_sizes(mesh_or_sizes)
    out = {}
    for m in table if table is not None else module_table(model):
        for name, spec in group_specs(m.arrays, sizes, lay, m.virtual, m.prefix).items():
            out[m.prefix + name] = spec
    return out


def param_bytes(model, mesh_or_sizes, lay: Layout | str = TP_EP, dtype=None) -> int:
    """Bytes per device of ``model``'s parameters (real or abstract) split by :func:`param_specs`, each in ``dtype``
    where given (a copy cast to it), else its own."""
    sizes = mesh_sizes(mesh_or_sizes)
    specs = param_specs(model, sizes, lay)
    return sum(shard_bytes(v.shape, dtype or v.dtype, specs[k], sizes)
               for k, v in params.leaves(nnx.state(model, nnx.Param)).items())


def param_shardings(model, mesh, lay: Layout | str = TP_EP) -> dict[str, NamedSharding]:
    return {k: NamedSharding(mesh, s) for k, s in param_specs(model, mesh, lay).items()}


# -- caches ------------------------------------------------------------------------------------------------

CACHE_AXES = {
    KDACache: {"conv_q": ("batch", None, "heads"), "conv_k": ("batch", None, "heads"),
               "conv_v": ("batch", None, "heads"), "state": ("batch", "heads", None, None)},
    MLACache: {"c": ("batch", "mla_seq", None), "kpe": ("batch", "mla_seq", None), "ik": ("batch", "mla_seq", None)},
    KVCache: {"k": ("batch", "cache_seq", "kv_heads", None), "v": ("batch", "cache_seq", "kv_heads", None)},
}


def cache_specs(cfg: ModelConfig, cache: Cache, mesh_or_sizes, lay: Layout | str = TP_EP) -> Cache:
    """A :class:`Cache` of PartitionSpecs matching ``cache`` (real or ``cache_shapes``), heads split only when the
    layer's head count divides (the same decision as its parameters). Stacked entries of scanned layers keep their
    repetition dimension whole. An int8 field (``Int8Rows``) gets one spec per part, codes and scales split alike
    (the scales' trailing 1 whole)."""
    lay = layout(lay)
    sizes = mesh_sizes(mesh_or_sizes)
    virtual = {KDACache: {"heads": cfg.kda.num_heads} if cfg.kda else {},
               MLACache: {},
               KVCache: {"heads": cfg.gqa.num_heads, "kv_heads": cfg.gqa.num_kv_heads} if cfg.gqa else {}}

    def parts(value):  # {suffix: leaf}: a plain field, or the codes and scales of an int8 one
        return {f".{k}": v for k, v in value._asdict().items()} if isinstance(value, Int8Rows) else {"": value}

    def specs(entry, where, stacked):
        fields = {f: axes for f, axes in CACHE_AXES[type(entry)].items() if getattr(entry, f) is not None}
        lead = (None,) if stacked else ()
        arrays = {f + k: ((*lead, *axes), tuple(leaf.shape)) for f, axes in fields.items()
                  for k, leaf in parts(getattr(entry, f)).items()}
        got = group_specs(arrays, sizes, lay, virtual[type(entry)], where)
        out = {}
        for f in fields:
            value = getattr(entry, f)
            out[f] = Int8Rows(got[f + ".q"], got[f + ".scale"]) if isinstance(value, Int8Rows) else got[f]
        return type(entry)(**out)

    layers = tuple(None if e is None else specs(e, f"cache layer {i} ", False) for i, e in enumerate(cache.layers))
    stack = tuple(specs(e, f"cache stack {j} ", True) for j, e in enumerate(cache.stack))
    lengths = group_specs({"lengths": (("batch",), tuple(cache.lengths.shape))}, sizes, lay)["lengths"]
    return Cache(layers, lengths, stack)


def cache_shardings(cfg: ModelConfig, cache: Cache, mesh, lay: Layout | str = TP_EP) -> Cache:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), cache_specs(cfg, cache, mesh, lay),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def paged_cache_specs(cfg: ModelConfig, cache: Cache, mesh_or_sizes, lay: Layout | str = TP_EP) -> Cache:
    """Specs of the serving engine's paged cache (:func:`kimi_jax.model.cache.paged_cache_shapes`): KDA entries as
    in the static cache (slots over the batch axes, heads split); the MLA / GQA page pools whole over the batch axes
    (a page table names pages of the whole pool), GQA kv heads split as in the static cache."""
    specs = cache_specs(cfg, cache, mesh_or_sizes, lay)

    def whole_pages(spec_entry, stacked):
        if isinstance(spec_entry, KDACache):
            return spec_entry
        lead = 1 if stacked else 0
        return jax.tree.map(lambda sp: PartitionSpec(*[None if d in (lead, lead + 1) else p
                                                      for d, p in enumerate(sp)]),
                            spec_entry, is_leaf=lambda x: isinstance(x, PartitionSpec))

    return Cache(tuple(None if e is None else whole_pages(e, False) for e in specs.layers), PartitionSpec(),
                 tuple(whole_pages(e, True) for e in specs.stack))


def paged_cache_shardings(cfg: ModelConfig, cache: Cache, mesh, lay: Layout | str = TP_EP) -> Cache:
    """:func:`paged_cache_specs` as shardings on ``mesh``."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), paged_cache_specs(cfg, cache, mesh, lay),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def draft_cache_specs(dcfg, batch: int, length: int, mesh_or_sizes, lay: Layout | str = TP_EP):
    """A :class:`~kimi_jax.model.dspark.DraftCache` of the specs of a DSpark drafter's (``dcfg``) context cache of
    ``batch`` rows and ``length`` positions: its fields' :data:`~kimi_jax.model.dspark.CACHE_AXES` (rows as the
    target's sequences, positions as its MLA latent cache's), by the rules of the module docstring."""
    sizes = mesh_sizes(mesh_or_sizes)
    shapes = dspark.cache_shapes(dcfg, batch, length, jnp.float32)
    got = group_specs({f: (dspark.CACHE_AXES[f], getattr(shapes, f).shape) for f in dspark.CACHE_AXES}, sizes,
                      layout(lay), where="draft cache ")
    return dspark.DraftCache(got["c"], got["kpe"])


def draft_cache_bytes(dcfg, batch: int, length: int, dtype, mesh_or_sizes, lay: Layout | str = TP_EP) -> int:
    """Bytes per device of that context cache in ``dtype``, split by :func:`draft_cache_specs`."""
    sizes = mesh_sizes(mesh_or_sizes)
    specs, shapes = draft_cache_specs(dcfg, batch, length, sizes, lay), dspark.cache_shapes(dcfg, batch, length, dtype)
    return sum(shard_bytes(getattr(shapes, f).shape, dtype, getattr(specs, f), sizes) for f in dspark.CACHE_AXES)


def cache_bytes(cfg: ModelConfig, cache: Cache, mesh_or_sizes, lay: Layout | str = TP_EP) -> int:
    """Bytes per device of ``cache`` (real or ``cache_shapes``) split by :func:`cache_specs`."""
    sizes = mesh_sizes(mesh_or_sizes)
    specs = jax.tree.leaves(cache_specs(cfg, cache, sizes, lay), is_leaf=lambda x: isinstance(x, PartitionSpec))
    return sum(shard_bytes(a.shape, a.dtype, spec, sizes) for a, spec in zip(jax.tree.leaves(cache), specs))


def draft_cache_shardings(dcfg, batch: int, length: int, mesh, lay: Layout | str = TP_EP):
    """:func:`draft_cache_specs` as shardings on ``mesh``."""
    specs = draft_cache_specs(dcfg, batch, length, mesh, lay)
    return type(specs)(NamedSharding(mesh, specs.c), NamedSharding(mesh, specs.kpe))


def put_params(state, specs: Mapping[str, PartitionSpec], mesh):
    """A copy of the parameter ``state`` (an ``nnx`` state, the same values in every process) with each leaf (keyed
    as :func:`kimi_jax.model.params.leaves` keys them) placed on ``mesh`` by ``specs``: each process fills its own
    devices from its values."""
    state = jax.tree.map(lambda a: a, state)  # new variables: the caller's model keeps its arrays
    placed = {k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, specs[k]),
                                              lambda index, a=np.asarray(v): a[index])
              for k, v in params.leaves(state).items()}
    return params.fill(state, placed)


def batch_spec(shape, mesh_or_sizes, lay: Layout | str = TP_EP) -> PartitionSpec:
    """Spec for a batch-major activation (token ids ``[B, T]``, lengths ``[B]``)."""
    lay = layout(lay)
    sizes = mesh_sizes(mesh_or_sizes)
    return group_specs({"x": (("batch",) + (None,) * (len(shape) - 1), tuple(shape))}, sizes, lay)["x"]


# -- accounting --------------------------------------------------------------------------------------------


def shard_shape(shape, spec: PartitionSpec, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """Per-device shape of an array of ``shape`` under ``spec`` (specs from this module always divide)."""
    out = []
    for d, size in enumerate(shape):
        part = spec[d] if d < len(spec) else None
        axes = () if part is None else ((part,) if isinstance(part, str) else tuple(part))
        out.append(int(size) // math.prod(sizes[a] for a in axes))
    return tuple(out)


def shard_bytes(shape, dtype, spec: PartitionSpec, sizes: Mapping[str, int]) -> int:
    return math.prod(shard_shape(shape, spec, sizes)) * jnp.dtype(dtype).itemsize


def replicated_over(spec: PartitionSpec, sizes: Mapping[str, int]) -> tuple[str, ...]:
    """Mesh axes (size > 1) an array under ``spec`` is replicated over."""
    used = set()
    for part in spec:
        if part is not None:
            used.update((part,) if isinstance(part, str) else part)
    return tuple(a for a in MESH_AXES if sizes.get(a, 1) > 1 and a not in used)
