"""Offload: KDA state, the MLA / KV cache and the routed experts kept in host memory, brought to the device per layer.

What is unusual here: placement is a *memory kind*, not a device. The offloaded arrays live with shardings whose
``memory_kind`` is ``"pinned_host"`` (same devices, same partition spec); inside the compiled step the model moves
each one to device memory right before its layer uses it (``jax.device_put(x, jax.memory.Space.Device)``) and moves a
layer's new cache entry back (``Space.Host``) before the layer returns. The copies are left to XLA's scheduler: the
TPU and GPU compilers turn them into asynchronous host <-> device copies. The TPU and GPU compilers account host
buffers apart (``host_argument_size_in_bytes`` ... of ``memory_analysis()``), which :func:`compile_step` reports
with the bytes one step copies host -> device (:func:`host_to_device_bytes`, read from the scheduled program);
XLA:CPU has one memory, so there the path runs (the moves are copies) and must give the non-offloaded logits bit
for bit.

Routed experts, two ways (:func:`fetch_experts`):
  * **decode** (the products gather: no more (token, expert) pairs than experts): only the chosen experts move. Each
    of the ``N*X`` slots is a dynamic slice ``[1, ...]`` of every field of the host array by the chosen id, moved to
    the device on its own and stacked there; the products run on that ``[N*X, ...]`` stack with ids ``0..N*X-1``.
    Both compilers copy just the slice (XLA:TPU ``dynamic-slice-start``, XLA:GPU an async ``fusion-start``, on the
    host operand): a K3 slice (4 layers, 32 experts, batch 1) copies 16 of 32 experts per layer, 0.84 of 1.68 GB
    (MXFP4, one H200) and 3.17 of 6.34 GB (bf16, TPU v5p). Not on TPU for 8-bit fields (MXFP4 codes and scales):
    libtpu gives the slice another tiling than the host array's and round-trips the whole array through the device
    to relayout it (2.46 GB per step on that slice, more than the whole layers), so there MXFP4 experts still move
    whole (:func:`slices_from_host`; a host array laid out ``(8,128)(4,1)`` slices directly, but the arrays are not
    placed that way).
  * **prefill** (more pairs): each MoE layer's local experts move whole.

Overlap (what the compilers did, deviceless, JAX 0.12). The routed copy depends on its own layer's router, so it
cannot start before that router has run; what runs while it flies is the rest of the MoE block that does not need
it: the latent down projection, the shared experts, and (TPU, up to 32 slices in flight) the ``w1`` product once its
slices have landed while ``w3`` / ``w2`` still stream. XLA:GPU runs the slices one or two at a time and puts the
independent matmuls beside the last ones. At decode the copies are the step: PCIe moves a K3 expert (17.5 MB MXFP4)
in ~0.27 ms, the shared experts read theirs from HBM in microseconds; nothing earlier can hide them without guessing
the routing. The whole-layer copy of layer ``i`` depends on nothing, so the decoder lets it start once layer
``i - 1`` has started (an ``optimization_barrier`` on the previous layer's input, :func:`to_device`'s ``after``):
XLA:GPU then issues each layer's copies one to two layers ahead, beside those layers' attention and MoE kernels (a
K3 prefill slice: device temporaries 0.64 -> 1.38 GB, about one layer's experts more), where with the copy tied to
its own MoE input it issued each right before that MoE, after the attention, with nothing to overlap. XLA:TPU moves the copies to the parameters and starts them at the top of the step when the step fits HBM
anyway, and spaces them out when it does not.

Kinds (``RunConfig.offload``):
  * ``"kda_state"``: every KDA cache entry (recurrent state ``[B, H, K, U]`` float32 and the three conv tails);
  * ``"cache"``: every MLA / GQA cache entry (``c``, ``kpe`` / ``k``, ``v``; int8 rows: every part);
  * ``"experts"``: every routed-expert weight (``w1``, ``w3``, ``w2``; a packed weight: every field).

The bytes moved (:func:`offload_bytes`) and what they do to a deployment (:func:`offload_plan`) are computed from the
same abstract shapes and partition specs as :mod:`kimi_jax.parallel.plan`. Each decode step copies the offloaded
cache entries host -> device and back, and of the experts ``N*X`` per MoE layer (at most the chip's local ones;
:func:`routed_slots`), or every local expert where the products do not gather or the compiler cannot slice them.
"""

from __future__ import annotations

import dataclasses
import re
import time

import jax
import jax.numpy as jnp
from flax import nnx

from kernels_pallas._dispatch import target_platform

KINDS = ("kda_state", "cache", "experts")
HOST = "pinned_host"
PCIE_GEN5 = 64e9  # bytes/s per GPU, one direction (x16)
HOST_PER_CHIP = 256e9  # host memory per accelerator: a DGX H200 node has 2 TB for its 8 GPUs (NVIDIA's datasheet)


def check_kinds(kinds) -> tuple[str, ...]:
    """``kinds`` (a tuple of names, or ``"a,b"``) as a sorted tuple; a ValueError names unknown ones."""
    if isinstance(kinds, str):
        kinds = [k.strip() for k in kinds.split(",") if k.strip()]
    kinds = tuple(kinds or ())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"offload: unknown {unknown}; choose from {list(KINDS)}")
    return tuple(k for k in KINDS if k in kinds)


def entry_kind(entry) -> str:
    """The offload kind of a cache entry: ``"kda_state"`` for a KDA entry, else ``"cache"``."""
    from kimi_jax.model.cache import KDACache

    return "kda_state" if isinstance(entry, KDACache) else "cache"


# -- inside the model (traced) -----------------------------------------------------------------------------


def to_device(tree, after=None):
    """Every array of ``tree`` in device memory (a no-op copy for arrays already there). ``after``: arrays the copies
    wait for (an ``optimization_barrier``): without it the compilers start every layer's copy at the top of the step
    and hold them all in device memory at once."""
    if after is not None:
        tree, _ = jax.lax.optimization_barrier((tree, after))
    return jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Device), tree)


def to_host(tree):
    """Every array of ``tree`` in host memory."""
    return jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Host), tree)


def fetch_entry(entry, run, after=None):
    """A layer's cache entry (or None) in device memory when its kind is offloaded under ``run``; the copy waits for
    ``after`` (:func:`to_device`)."""
    if entry is None or entry_kind(entry) not in run.offload:
        return entry
    return to_device(entry, after)


def store_entry(entry, run):
    """A layer's new cache entry back in host memory when its kind is offloaded under ``run``."""
    if entry is None or entry_kind(entry) not in run.offload:
        return entry
    return to_host(entry)


class HotExperts(nnx.Variable):
    """The routed experts of one MoE layer that are also kept in device memory while the layer's weights live in host
    memory (:func:`keep_hot_experts`): ``{"slot": int32 [E] (the row of ``rows`` holding expert e, -1 where it is
    in host memory only), "rows": the weights' pytree with leading dimension H}``. Derived state, not a parameter:
    never saved, counted or trained."""


def fetch_experts(weights, idx_NX, run, *, routed: bool, after=None, hot=None):
    """Routed-expert weights (a pytree: arrays or packed weights, every leaf ``[E, ...]``) in device memory when
    ``run`` offloads them, and the expert ids ``[N, X]`` that index what comes back.

    ``routed`` (the caller's gather path: few pairs): only the chosen experts move, one ``[1, ...]`` slice of every
    leaf per (token, expert) slot, stacked on the device as ``[N*X, ...]`` (slot ``k`` holds expert
    ``idx_NX.flat[k]``; a repeated expert is moved once per slot), with the ids ``0 .. N*X-1``. The slices depend
    only on ``idx_NX``, so they start as soon as the router has chosen. Otherwise (or where the compiler cannot
    slice these leaves out of host memory, :func:`slices_from_host`) the whole layer moves, waiting for ``after``
    (:func:`to_device`).

    ``hot`` (the value of a :class:`HotExperts`, or None): on the routed path a slot whose expert is hot is read from
    the device copy and nothing crosses the host link for it; each slot's choice is a ``lax.cond``, so the copy of a
    cold expert runs only when one was chosen."""
    if "experts" not in run.offload:
        return weights, idx_NX
    if routed and slices_from_host(jax.tree.leaves(weights), target_platform(run.placement)):
        return _fetch_slots(weights, idx_NX, hot)
    return to_device(weights, after), idx_NX


def _fetch_slots(weights, idx_NX, hot=None):
    """(every leaf's rows ``idx_NX.flat`` as ``[N*X, ...]`` in device memory, ids ``arange(N*X)`` as ``[N, X]``).
    Each row is a dynamic slice of the host array moved on its own: the TPU and GPU compilers turn that into one
    asynchronous copy of the slice (``dynamic-slice-start`` / ``fusion-start`` on a host operand); a gather
    (``jnp.take``) of a host array is refused by JAX, and a stack built in host memory first becomes host compute
    on XLA:GPU. With ``hot`` (:class:`HotExperts`' value) a slot of a hot expert takes its row from the device copy
    instead, behind a ``lax.cond`` per slot (XLA:GPU keeps the slice copy inside the cold branch)."""
    N, X = idx_NX.shape
    ids = idx_NX.reshape(N * X)
    from_host = lambda e: jax.tree.map(  # noqa: E731
        lambda a: jax.device_put(jax.lax.dynamic_slice_in_dim(a, e, 1, 0), jax.memory.Space.Device), weights)
    if hot is None:
        rows = [from_host(ids[k]) for k in range(N * X)]
    else:
        slot = hot["slot"][ids]

        def one(e, s):
            from_device = lambda: jax.tree.map(  # noqa: E731
                lambda a: jax.lax.dynamic_slice_in_dim(a, jnp.maximum(s, 0), 1, 0), hot["rows"])
            return jax.lax.cond(s >= 0, from_device, lambda: from_host(e))

        rows = [one(ids[k], slot[k]) for k in range(N * X)]
    return (jax.tree.map(lambda *r: jnp.concatenate(r), *rows),
            jnp.arange(N * X, dtype=jnp.int32).reshape(N, X))


def expert_usage(model, ids, batch: int = 8) -> list:
    """How often each routed expert of each MoE layer is chosen while ``model`` runs on the token ids ``ids [B, T]``
    (padding counts like any token): one int64 array ``[E]`` per MoE layer, in layer order."""
    import numpy as np

    from kimi_jax.model.quantize import check_calibration

    ids = check_calibration(ids, model.cfg.vocab_size)
    routers = nnx.jit(lambda m, x: m(x, return_router=True).router)
    counts = None
    for i in range(0, len(ids), batch):
        r = routers(model, jnp.asarray(ids[i:i + batch]))
        c = [np.bincount(np.asarray(idx).ravel(), minlength=model.cfg.moe.num_experts) for idx, _ in r]
        counts = c if counts is None else [a + b for a, b in zip(counts, c)]
    return counts


def _moe_layers(model) -> list:
    """The routed-expert modules (:class:`kimi_jax.model.moe.Experts`) of an unscanned model, in layer order."""
    from kimi_jax.model.moe import MoE

    return [layer.mlp.experts for layer in getattr(model, "layers", ()) if isinstance(getattr(layer, "mlp", None), MoE)]


def keep_hot_experts(model, per_layer: int, usage) -> list:
    """Keep, of each MoE layer's host-resident routed experts, the ``per_layer`` most used (``usage``: counts per
    layer as :func:`expert_usage` returns them; ties go to the lower id) in device memory as well (a
    :class:`HotExperts` on the layer's ``Experts``); a decode step then copies across the host link only the experts
    outside that set that its tokens chose. ``per_layer`` 0 removes the hot sets. Call it before building a
    ``Generator`` (which captures the model's state). Returns the hot expert ids per layer.

    Refused before anything moves: a model whose run does not offload experts, scanned layers, a mesh, a usage list
    that does not match the model's MoE layers."""
    import numpy as np

    if "experts" not in check_kinds(model.run.offload):
        raise ValueError("keep_hot_experts: the model's experts are not offloaded (RunConfig(offload=('experts',)))")
    if model.run.scan_layers or model.run.parallel is not None:
        raise ValueError("keep_hot_experts: unscanned layers on one device only (as expert offload itself)")
    layers = _moe_layers(model)
    platform = target_platform(model.run.placement)
    if layers and not slices_from_host(jax.tree.leaves(layers[0].weights()), platform):
        raise ValueError(f"keep_hot_experts: on {platform} these experts move whole layers at a time (8-bit fields, "
                         "see slices_from_host); a hot set would only add device bytes")
    E = model.cfg.moe.num_experts if layers else 0
    if not 0 <= per_layer <= E:
        raise ValueError(f"keep_hot_experts: per_layer={per_layer} must lie in [0, {E}] (experts per layer)")
    if len(usage) != len(layers) or any(np.shape(u) != (E,) for u in usage):
        raise ValueError(f"keep_hot_experts: usage must hold {len(layers)} count arrays of shape ({E},), one per MoE "
                         f"layer; got {[np.shape(u) for u in usage]}")
    chosen = []
    for experts, counts in zip(layers, usage):
        if per_layer == 0:
            experts.hot_cache = None
            chosen.append([])
            continue
        top = np.sort(np.argsort(-np.asarray(counts), kind="stable")[:per_layer])
        slot = np.full((E,), -1, np.int32)
        slot[top] = np.arange(per_layer, dtype=np.int32)
        rows, _ = jax.jit(_fetch_slots)(experts.weights(), jnp.asarray(top[None], jnp.int32))  # only these cross
        experts.hot_cache = HotExperts({"slot": jax.device_put(slot, jax.local_devices()[0]), "rows": rows})
        chosen.append(top.tolist())
    return chosen


def slices_from_host(leaves, platform: str) -> bool:
    """Whether the compiler for ``platform`` copies a dynamic slice of these host arrays as just the slice. XLA:TPU
    (libtpu 0.0.50, v5e / v5p / v6e) does not for 8-bit arrays (MXFP4 codes and scales): it gives the slice a
    different tiling than the host array's and copies the whole array to the device and back to relayout it,
    every step; 16- and 32-bit arrays slice directly. XLA:GPU slices any dtype; XLA:CPU has one memory."""
    return platform != "tpu" or all(jnp.dtype(a.dtype).itemsize >= 2 for a in leaves)


# -- placing arrays ----------------------------------------------------------------------------------------


def host_sharding(sharding):
    """``sharding`` with host memory: same devices and spec, ``memory_kind="pinned_host"``."""
    return sharding.with_memory_kind(HOST)


def _is_expert_path(path) -> bool:
    names = [str(getattr(k, "key", k)) for k in path]
    return "experts" in names and any(w in names for w in ("w1", "w2", "w3"))


def is_expert_leaf(name: str) -> bool:
    """Whether a parameter leaf (``"layers.3.mlp.experts.w1.packed"``, :func:`kimi_jax.model.params.leaves`) belongs to
    a routed-expert weight: what ``offload=("experts",)`` keeps in host memory."""
    return _is_expert_path(name.split("."))


def place_model(model, kinds=None):
    """Move ``model``'s routed-expert weights (every field of a packed weight) to host memory, in place, when
    ``kinds`` (default: the model's ``run.offload``) holds ``"experts"``. Returns the model."""
    kinds = check_kinds(model.run.offload if kinds is None else kinds)
    if "experts" not in kinds:
        return model
    state = nnx.state(model)
    flat = []
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        if _is_expert_path(path):
            value = jax.tree.map(lambda a: a if a.sharding.memory_kind == HOST
                                 else jax.device_put(a, host_sharding(a.sharding)), value)
        flat.append((path, var.replace(value)))
    nnx.update(model, nnx.from_flat_state(flat))
    return model


def place_cache(cache, kinds):
    """``cache`` with the entries of the offloaded ``kinds`` in host memory (unrolled and stacked entries)."""
    kinds = check_kinds(kinds)
    if not kinds:
        return cache
    move = lambda e: (jax.tree.map(lambda a: jax.device_put(a, host_sharding(a.sharding)), e)  # noqa: E731
                      if e is not None and entry_kind(e) in kinds else e)
    return cache.replace(layers=tuple(move(e) for e in cache.layers), stack=tuple(move(e) for e in cache.stack))


def cache_host_shardings(cache_shardings, cache_shapes, kinds):
    """The cache's shardings (a :class:`~kimi_jax.model.cache.Cache` of them, matching ``cache_shapes``) with the
    offloaded kinds' entries in host memory."""
    kinds = check_kinds(kinds)

    def move(e, s):
        if e is None or entry_kind(e) not in kinds:
            return s
        return jax.tree.map(host_sharding, s)

    return cache_shardings.replace(layers=tuple(map(move, cache_shapes.layers, cache_shardings.layers)),
                                   stack=tuple(map(move, cache_shapes.stack, cache_shardings.stack)))


# -- planning ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Offload:
    """What an offload choice moves, per chip: bytes taken off device memory by kind (they live in host memory
    instead), and the host <-> device traffic of one decode step."""

    kinds: tuple
    moved: dict  # kind -> bytes per chip moved from device to host memory
    h2d_per_step: int  # bytes per chip copied host -> device per decode step
    d2h_per_step: int  # bytes per chip copied device -> host per decode step (new cache entries)
    h2d_whole_layers: int = 0  # the same step were every MoE layer's local experts copied whole (prefill does)
    expert_slots: int = 0  # experts one MoE layer fetches per decode step (0: whole layers, or no experts moved)
    local_experts: int = 0  # experts one chip holds per MoE layer
    hot_experts: int = 0  # of those, kept in device memory as well (keep_hot_experts)
    hot_bytes: int = 0  # their device bytes per chip (in addition to the host copy of every expert)

    @property
    def total(self) -> int:
        return sum(self.moved.values())

    @property
    def device_freed(self) -> int:
        """Device bytes per chip this choice frees: what moved, less the hot experts' device copies."""
        return self.total - self.hot_bytes

    def step_seconds(self, bandwidth: float = PCIE_GEN5, whole_layers: bool = False) -> float:
        """Seconds of one decode step's copies at ``bandwidth`` bytes/s each way (the two directions overlap);
        ``whole_layers``: with every local expert copied, not only the routed ones."""
        return max(self.h2d_whole_layers if whole_layers else self.h2d_per_step, self.d2h_per_step) / bandwidth


def fetches_routed(pairs: int, num_experts: int, path: str = "gather") -> bool:
    """The one rule for moving only the chosen experts (the model's :meth:`~kimi_jax.model.moe.Experts.fetch` and
    the plan's :func:`routed_slots`): the products gather (``path``, one expert read per (token, expert) pair) and
    the pairs do not outnumber the layer's experts. On TPU and GPU the products gather exactly then
    (:func:`kernels_pallas.moe_gmm.expert_path`); a forced gather of more pairs would move more than the layer."""
    return path == "gather" and pairs <= num_experts


def routed_slots(cfg, batch: int, sizes: dict, local_experts: int) -> int:
    """Experts one MoE layer fetches per decode step on a chip (:func:`fetch_experts`): one per (token, expert) pair
    of the chip's tokens (``batch`` over the data axis), at most the experts it holds; 0 when the whole layer moves
    (:func:`fetches_routed` says no)."""
    data = int(sizes.get("data", 1))
    pairs = (batch // data if batch % data == 0 else batch) * cfg.moe.top_k
    return min(pairs, local_experts) if fetches_routed(pairs, cfg.moe.num_experts) else 0


def offload_bytes(cfg, kinds, sizes: dict, layout="tp_ep", *, batch: int, context: int, dtype="bfloat16",
                  quantize: str | None = None, platform: str = "gpu", plan=None, hot: int = 0) -> Offload:
    """Per-chip bytes the offload ``kinds`` move to host memory for ``cfg`` on a mesh of ``sizes`` (the plan's
    figures by category: ``routed experts``, the KDA state + conv tails, the MLA / KV cache), and one decode step's
    copies: the routed experts only (:func:`routed_slots` of each MoE layer's local experts) where ``platform``'s
    compiler slices them out of host memory (:func:`slices_from_host`), else every local expert. ``plan``: the
    :func:`kimi_jax.parallel.plan.make_plan` of the same arguments, when the caller has it already. ``hot``: experts
    per MoE layer kept in device memory as well (:func:`keep_hot_experts`; at most the chip's local ones); the
    per-step copies stay the worst case, every choice cold."""
    from kimi_jax.parallel import plan as plan_lib

    kinds = check_kinds(kinds)
    p = plan or plan_lib.make_plan(cfg, sizes, layout, batch=batch, context=context, dtype=dtype, quantize=quantize)
    per = {"experts": p.params.get("routed experts", 0),
           "kda_state": p.cache["kda_state"] + p.cache["kda_conv"],
           "cache": p.cache["mla"] + p.cache["kv"]}
    moved = {k: per[k] for k in kinds}
    back = sum(moved[k] for k in kinds if k != "experts")  # a new cache entry is written back whole
    whole = sum(moved.values())
    slots = e_loc = 0
    experts = moved.get("experts", 0)
    if experts:
        e_loc = p.local_experts
        if slices_from_host([jax.ShapeDtypeStruct((), d) for d in p.expert_dtypes], platform):
            slots = routed_slots(cfg, batch, sizes, e_loc)
    h2d = whole - experts + experts // e_loc * slots if slots else whole  # every layer's local experts alike
    hot = min(int(hot), e_loc) if experts else 0
    return Offload(kinds, moved, h2d, back, whole, slots, e_loc, hot, experts * hot // e_loc if hot else 0)


def chip_platform(chip: str) -> str:
    """``"tpu"`` or ``"gpu"`` for a :data:`kimi_jax.parallel.plan.CHIPS` key."""
    from kimi_jax.parallel import plan

    return "tpu" if plan.CHIPS[chip].name.startswith("TPU") else "gpu"


def offload_plan(cfg, kinds, layout="tp_ep", *, batch: int, context: int, dtype="bfloat16", chip: str = "h200",
                 reserve: float = 0.1, max_chips: int = 512, quantize: str | None = None,
                 bandwidth: float = PCIE_GEN5, host_bytes: float = HOST_PER_CHIP, hot: int = 0) -> dict:
    """The smallest fitting mesh for ``chip`` with and without offloading ``kinds``: device bytes per chip are the
    plan's total minus what is moved (:func:`offload_bytes`), which must fit ``host_bytes`` of host memory per chip
    (with the same ``reserve``). Returns ``{"without": row, "with": row}``; each row
    has ``chips``, ``sizes``, ``device`` (bytes per chip), ``host`` (bytes per chip in host memory),
    ``h2d_per_step`` and ``copy_seconds`` (per decode step at ``bandwidth``: the routed experts only, where the
    chip's compiler slices them), ``h2d_whole_layers`` and ``whole_layer_seconds`` (every local expert instead),
    ``expert_slots`` / ``local_experts`` (per MoE layer) and ``hbm_seconds`` (the plan's roofline step), or is None
    when nothing up to ``max_chips`` fits. ``hot``: experts per MoE layer also kept on the device
    (:func:`offload_bytes`)."""
    from kimi_jax.parallel import plan

    kinds = check_kinds(kinds)
    c = plan.CHIPS[chip]
    out = {}
    for name, ks in (("without", ()), ("with", kinds)):
        n, best = 1, None
        while n <= max_chips and best is None:
            for s in plan.candidate_meshes(n):
                p = plan.make_plan(cfg, s, layout, batch=batch, context=context, dtype=dtype, quantize=quantize)
                o = offload_bytes(cfg, ks, s, layout, batch=batch, context=context, dtype=dtype, quantize=quantize,
                                  platform=chip_platform(chip), plan=p, hot=hot if ks else 0)
                device = p.total - o.device_freed
                fits = device <= c.hbm_bytes * (1 - reserve) and o.total <= host_bytes * (1 - reserve)
                if fits and (best is None or device < best["device"]):
                    best = {"chips": n, "sizes": s, "device": device, "host": o.total, "moved": o.moved,
                            "h2d_per_step": o.h2d_per_step, "d2h_per_step": o.d2h_per_step,
                            "copy_seconds": o.step_seconds(bandwidth), "h2d_whole_layers": o.h2d_whole_layers,
                            "whole_layer_seconds": o.step_seconds(bandwidth, whole_layers=True),
                            "expert_slots": o.expert_slots, "local_experts": o.local_experts,
                            "hbm_seconds": p.step_seconds(c.hbm_bandwidth)}
            n *= 2
        out[name] = best
    return out


# -- the compiler's view -----------------------------------------------------------------------------------


def compile_step(cfg, mesh, kinds=(), *, batch: int, context: int, tokens: int = 1, dtype="bfloat16",
                 implementation: str | None = None, parallel: bool = True, scan_layers: bool = False,
                 hot_experts: int = 0) -> dict:
    """Compile one decode step (``tokens == 1``) or fresh prefill chunk on ``mesh`` (CPU devices or a deviceless TPU
    / GPU topology, :mod:`kimi_jax.parallel.aot`) with abstract parameters and cache, the ``kinds`` offloaded.

    ``parallel=False`` runs the single-device model (no ``Parallel`` in the run config; ``mesh`` of one device).
    ``scan_layers``: the repeating run of layers as one ``lax.scan`` (its stacked host arrays sliced per iteration).
    The host-memory arguments carry shardings over ``mesh.abstract_mesh``: the deviceless GPU client reports no
    memory kinds, so a concrete GPU mesh would drop ``pinned_host`` silently. Returns the device ``argument`` /
    ``output`` / ``alias`` / ``temp`` bytes and their ``host_*`` counterparts (per device), ``peak`` (device),
    ``h2d`` (bytes one step copies host -> device, :func:`host_to_device_bytes`; None where it cannot tell) and
    ``compile_seconds``. ``hot_experts``: with ``"experts"`` offloaded, that many experts per MoE layer also held
    in device memory (:func:`keep_hot_experts`; abstract here), the routed slots behind a ``lax.cond`` each."""
    from jax.sharding import NamedSharding

    from kimi_jax.model import params
    from kimi_jax.model.cache import cache_shapes
    from kimi_jax.model.decoder import abstract_model
    from kimi_jax.model.run import RunConfig
    from kimi_jax.parallel import sharding

    kinds = check_kinds(kinds)
    dt = jnp.dtype(dtype)
    lay = sharding.layout("tp_ep")
    run = RunConfig(dtype=dt, implementation=implementation, offload=kinds,
                    parallel=sharding.Parallel(mesh, lay) if parallel else None, scan_layers=scan_layers)
    model = abstract_model(cfg, run)
    am = mesh.abstract_mesh
    if hot_experts:
        if "experts" not in kinds or parallel or scan_layers:
            raise ValueError("compile_step: hot_experts needs the experts offloaded on one device (parallel=False), "
                             "unscanned layers")
        one = NamedSharding(am, jax.sharding.PartitionSpec(), memory_kind="device")
        for experts in _moe_layers(model):
            rows = jax.tree.map(lambda v: jax.ShapeDtypeStruct((hot_experts, *v.shape[1:]), v.dtype, sharding=one),
                                experts.weights())
            experts.hot_cache = HotExperts({"slot": jax.ShapeDtypeStruct((cfg.moe.num_experts,), jnp.int32,
                                                                         sharding=one), "rows": rows})
    graphdef, hot, state = nnx.split(model, HotExperts, ...)
    specs = sharding.param_specs(model, mesh, lay)

    def leaf(key, v):
        host = "experts" in kinds and ".experts.w" in key
        return jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(am, specs[key],
                                                                             memory_kind=HOST if host else "device"))

    state = params.fill(state, {k: leaf(k, v) for k, v in params.leaves(state).items()})
    shapes = cache_shapes(cfg, batch, context, dt, scan=scan_layers)
    cspecs = sharding.cache_specs(cfg, shapes, mesh, lay)
    P = jax.sharding.PartitionSpec
    cdev = jax.tree.map(lambda s: NamedSharding(am, s, memory_kind="device"), cspecs,
                        is_leaf=lambda x: isinstance(x, P))
    cshard = cache_host_shardings(cdev, shapes, kinds)
    cache = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, cshard)
    bspec = sharding.batch_spec((batch, tokens), mesh, lay)
    ids = jax.ShapeDtypeStruct((batch, tokens), jnp.int32, sharding=NamedSharding(am, bspec, memory_kind="device"))

    def step(hot, state, ids, cache):
        out = nnx.merge(graphdef, hot, state)(ids, cache=cache, prefix=tokens == 1, last_only=True)
        return out.logits, out.cache

    t0 = time.perf_counter()
    with jax.sharding.use_abstract_mesh(am), jax.set_mesh(mesh):
        compiled = jax.jit(step, donate_argnums=(3,), out_shardings=(None, cshard),
                           keep_unused=True).lower(hot, state, ids, cache).compile()
    m = compiled.memory_analysis()
    keys = ("argument", "output", "alias", "temp")
    out = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in keys}
    out.update({f"host_{k}": int(getattr(m, f"host_{k}_size_in_bytes")) for k in keys})
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    out["compile_seconds"] = time.perf_counter() - t0
    copies = _host_copies(compiled.as_text())
    try:
        out["h2d"] = copies(True)
        out["h2d_always"] = copies(False)  # less the cold-expert copies' branches
    except ValueError:  # copies inside a scan on TPU: the program does not say how often they run
        out["h2d"] = out["h2d_always"] = None
    return out


_HLO_BITS = {"pred": 8, "s4": 4, "u4": 4, "f4e2m1fn": 4, "s8": 8, "u8": 8, "bf16": 16, "f16": 16, "s16": 16,
             "u16": 16, "f32": 32, "s32": 32, "u32": 32, "f64": 64, "s64": 64, "u64": 64}
_HLO_SHAPE = re.compile(r"\b([a-z]+[0-9]+[a-z0-9]*|pred)\[([0-9,]*)\](\{[^}]*\})?")
_HLO_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{$")


def host_to_device_bytes(hlo_text: str, conditional: bool = True) -> int:
    """Bytes one run of a compiled program copies host -> device, read from its scheduled HLO
    (``compiled.as_text()``): the result bytes of every asynchronous copy (``copy-start``) or slice / fusion
    (``dynamic-slice-start`` on TPU, ``fusion-start`` on GPU) or host computation (``custom-call-start``) whose
    first operand lives in host memory (layout ``S(5)``) and whose result does not, times the trip count of the while loops around it. Logical bytes: TPU tile padding
    is not counted. Raises ValueError for a host read inside a loop whose trip count the program does not state
    (XLA:TPU drops ``known_trip_count``). Copies inside a branch of a ``conditional`` (the cold experts of
    :func:`keep_hot_experts`) are counted as if their branch ran, unless ``conditional`` is False: then only the
    copies every run makes are."""
    return _host_copies(hlo_text)(conditional)


def _host_copies(hlo_text: str):
    """The scheduled program read once (:func:`host_to_device_bytes`): a function of ``conditional`` -> bytes."""
    def shapes(line):
        return [(t, dims, "S(5)" in (lay or "")) for t, dims, lay in _HLO_SHAPE.findall(line)]

    def nbytes(t, dims):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        return n * _HLO_BITS[t] // 8

    computation, reads, loops, branches = None, {}, {}, {}
    for line in hlo_text.splitlines():
        m = _HLO_COMPUTATION.match(line)
        if m:
            computation = m.group(1)
            continue
        rhs = line.partition(" = ")[2]
        if " while(" in rhs:
            body = re.search(r"body=%?([\w.\-]+)", rhs).group(1)
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', rhs)
            loops[body] = (computation, int(trips.group(1)) if trips else None)
        if " conditional(" in rhs:
            named = re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", rhs)
            listed = re.search(r"branch_computations=\{([^}]*)\}", rhs)
            for b in named + (re.findall(r"%?([\w.\-]+)", listed.group(1)) if listed else []):
                branches[b] = computation
        op = re.search(r"\s(copy-start|dynamic-slice-start|fusion-start|custom-call-start)\(", rhs)
        if not op:
            continue
        sh = shapes(rhs[: op.start()])
        if op.group(1) == "copy-start":
            (dt, dd, dh), (_, _, sh_host) = sh[0], sh[1]
            moved = nbytes(dt, dd) if sh_host and not dh else 0
        else:
            rt, rd, rh = sh[-2]
            moved = nbytes(rt, rd) if sh[0][2] and not rh else 0
        reads[computation] = reads.get(computation, 0) + moved

    def total(conditional: bool) -> int:
        def times(computation):
            if computation in branches:
                return int(conditional) * times(branches[computation])
            if computation not in loops:
                return 1
            parent, trips = loops[computation]
            if trips is None:
                raise ValueError(f"host -> device copies in loop body {computation} whose trip count is not stated")
            return trips * times(parent)

        return sum(b * times(c) for c, b in reads.items() if b)

    return total


def moved_bytes(cfg, kinds, mesh, *, batch: int, context: int, dtype="bfloat16") -> int:
    """Bytes per device of the arrays ``kinds`` place in host memory (from their shapes and specs on ``mesh``, or a
    ``{"data", "expert", "model"}`` dict of sizes): what :func:`compile_step`'s device arguments should drop by."""
    from kimi_jax.model import params
    from kimi_jax.model.cache import cache_shapes
    from kimi_jax.model.decoder import abstract_model
    from kimi_jax.model.run import RunConfig
    from kimi_jax.parallel import sharding

    kinds = check_kinds(kinds)
    lay = sharding.layout("tp_ep")
    sizes = {a: int(dict(getattr(mesh, "shape", mesh)).get(a, 1)) for a in sharding.MESH_AXES}
    dt = jnp.dtype(dtype)
    model = abstract_model(cfg, RunConfig(dtype=dt))
    specs = sharding.param_specs(model, sizes, lay)
    total = 0
    if "experts" in kinds:
        total += sum(sharding.shard_bytes(v.shape, v.dtype, specs[k], sizes)
                     for k, v in params.leaves(nnx.state(model)).items() if ".experts.w" in k)
    shapes = cache_shapes(cfg, batch, context, dt)
    cspecs = sharding.cache_specs(cfg, shapes, sizes, lay)
    P = jax.sharding.PartitionSpec
    for e, s in zip(shapes.layers, cspecs.layers):
        if e is not None and entry_kind(e) in kinds:
            total += sum(sharding.shard_bytes(a.shape, a.dtype, sp, sizes) for a, sp in
                         zip(jax.tree.leaves(e), jax.tree.leaves(s, is_leaf=lambda x: isinstance(x, P))))
    return total


def format_offload(o: Offload, bandwidth: float = PCIE_GEN5) -> str:
    """Lines for ``kimi-jax plan --offload``: bytes moved by kind and the per-step copy traffic."""
    lines = [f"offload {','.join(o.kinds) or '(none)'}: per chip, moved to host memory"]
    lines += [f"  {k:<34}{v / 1e9:9.2f} GB" for k, v in o.moved.items()]
    lines.append(f"  {'total':<34}{o.total / 1e9:9.2f} GB")
    routed = (f" (routed experts only: {o.expert_slots} of {o.local_experts} local experts per MoE layer)"
              if o.expert_slots else "")
    lines.append(f"  per decode step: {o.h2d_per_step / 1e9:.2f} GB host->device{routed}, "
                 f"{o.d2h_per_step / 1e9:.2f} GB device->host = {o.step_seconds(bandwidth) * 1e3:.1f} ms at "
                 f"{bandwidth / 1e9:.0f} GB/s")
    if o.hot_experts:
        lines.append(f"  hot experts: {o.hot_experts} of {o.local_experts} per MoE layer also on the device, "
                     f"+{o.hot_bytes / 1e9:.2f} GB; the copies above are the worst case (every choice cold): a choice "
                     f"of a hot expert copies nothing (uniform routing: {o.hot_experts / o.local_experts:.0%} of them)")
    if o.h2d_whole_layers != o.h2d_per_step:
        lines.append(f"  every local expert instead (prefill; TPU with 8-bit experts): {o.h2d_whole_layers / 1e9:.2f} "
                     f"GB host->device = {o.step_seconds(bandwidth, whole_layers=True) * 1e3:.1f} ms")
    return "\n".join(lines)


__all__ = ["KINDS", "HotExperts", "Offload", "check_kinds", "chip_platform", "compile_step", "expert_usage",
           "fetch_entry", "fetch_experts", "fetches_routed", "format_offload", "host_to_device_bytes",
           "keep_hot_experts", "moved_bytes", "offload_bytes", "offload_plan", "place_cache", "place_model",
           "routed_slots", "slices_from_host", "store_entry", "to_device", "to_host"]
