"""Offload: KDA state, the MLA / KV cache and the routed experts kept in host memory, brought to the device per layer.

What is unusual here: placement is a *memory kind*, not a device. The offloaded arrays live with shardings whose
``memory_kind`` is ``"pinned_host"`` (same devices, same partition spec); inside the compiled step the model moves
each one to device memory right before its layer uses it (``jax.device_put(x, jax.memory.Space.Device)``) and moves a
layer's new cache entry back (``Space.Host``) before the layer returns. The copies are left to XLA's scheduler: the
TPU and GPU compilers turn them into asynchronous host <-> device copies that the latency-hiding scheduler may start
while earlier layers run. The TPU and GPU compilers account host buffers apart (``host_argument_size_in_bytes`` ...
of ``memory_analysis()``), which :func:`compile_step` reports; XLA:CPU has one memory, so there the path runs (the
moves are copies) and must give the non-offloaded logits bit for bit.

Scheduling, as the compilers did it (deviceless, JAX 0.12): XLA:GPU starts each copy shortly before its layer (device
temporaries grow by about one layer's experts); XLA:TPU starts them all at the top of the step when the step fits
HBM anyway (temporaries grow by everything moved, the peak stays) and spaces them out when it does not (a K3 slice
that is out of HBM on one v5e compiles with its experts on host). The ``optimization_barrier`` that ties a copy to
its layer's input (:func:`to_device`'s ``after``) is a hint: TPU's host-offload pass moves the copy to the parameter.

Kinds (``RunConfig.offload``):
  * ``"kda_state"``: every KDA cache entry (recurrent state ``[B, H, K, U]`` float32 and the three conv tails);
  * ``"cache"``: every MLA / GQA cache entry (``c``, ``kpe`` / ``k``, ``v``; int8 rows: every part);
  * ``"experts"``: every routed-expert weight (``w1``, ``w3``, ``w2``; a packed weight: every field).

The bytes moved (:func:`offload_bytes`) and what they do to a deployment (:func:`offload_plan`) are computed from the
same abstract shapes and partition specs as :mod:`kimi_jax.parallel.plan`. Each decode step copies every offloaded
byte host -> device once (a layer's local experts whole, not only the routed ones) and the cache entries back.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
from flax import nnx

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


def fetch_experts(weights, run, after=None):
    """Routed-expert weights (a pytree: arrays or packed weights) in device memory when ``run`` offloads them; the
    copy waits for ``after`` (:func:`to_device`)."""
    return to_device(weights, after) if "experts" in run.offload else weights


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

    @property
    def total(self) -> int:
        return sum(self.moved.values())

    def step_seconds(self, bandwidth: float = PCIE_GEN5) -> float:
        """Seconds of one decode step's copies at ``bandwidth`` bytes/s each way (the two directions overlap)."""
        return max(self.h2d_per_step, self.d2h_per_step) / bandwidth


def offload_bytes(cfg, kinds, sizes: dict, layout="tp_ep", *, batch: int, context: int, dtype="bfloat16",
                  quantize: str | None = None) -> Offload:
    """Per-chip bytes the offload ``kinds`` move to host memory for ``cfg`` on a mesh of ``sizes`` (the plan's
    figures by category: ``routed experts``, the KDA state + conv tails, the MLA / KV cache)."""
    from kimi_jax.parallel import plan

    kinds = check_kinds(kinds)
    p = plan.make_plan(cfg, sizes, layout, batch=batch, context=context, dtype=dtype, quantize=quantize)
    per = {"experts": p.params.get("routed experts", 0),
           "kda_state": p.cache["kda_state"] + p.cache["kda_conv"],
           "cache": p.cache["mla"] + p.cache["kv"]}
    moved = {k: per[k] for k in kinds}
    back = sum(moved[k] for k in kinds if k != "experts")  # a new cache entry is written back whole
    return Offload(kinds, moved, sum(moved.values()), back)


def offload_plan(cfg, kinds, layout="tp_ep", *, batch: int, context: int, dtype="bfloat16", chip: str = "h200",
                 reserve: float = 0.1, max_chips: int = 512, quantize: str | None = None,
                 bandwidth: float = PCIE_GEN5, host_bytes: float = HOST_PER_CHIP) -> dict:
    """The smallest fitting mesh for ``chip`` with and without offloading ``kinds``: device bytes per chip are the
    plan's total minus what is moved (:func:`offload_bytes`), which must fit ``host_bytes`` of host memory per chip
    (with the same ``reserve``). Returns ``{"without": row, "with": row}``; each row
    has ``chips``, ``sizes``, ``device`` (bytes per chip), ``host`` (bytes per chip in host memory),
    ``h2d_per_step``, ``copy_seconds`` (per decode step at ``bandwidth``) and ``hbm_seconds`` (the plan's roofline
    step), or is None when nothing up to ``max_chips`` fits."""
    from kimi_jax.parallel import plan

    kinds = check_kinds(kinds)
    c = plan.CHIPS[chip]
    out = {}
    for name, ks in (("without", ()), ("with", kinds)):
        n, best = 1, None
        while n <= max_chips and best is None:
            for s in plan.candidate_meshes(n):
                p = plan.make_plan(cfg, s, layout, batch=batch, context=context, dtype=dtype, quantize=quantize)
                o = offload_bytes(cfg, ks, s, layout, batch=batch, context=context, dtype=dtype, quantize=quantize)
                device = p.total - o.total
                fits = device <= c.hbm_bytes * (1 - reserve) and o.total <= host_bytes * (1 - reserve)
                if fits and (best is None or device < best["device"]):
                    best = {"chips": n, "sizes": s, "device": device, "host": o.total, "moved": o.moved,
                            "h2d_per_step": o.h2d_per_step, "d2h_per_step": o.d2h_per_step,
                            "copy_seconds": o.step_seconds(bandwidth), "hbm_seconds": p.step_seconds(c.hbm_bandwidth)}
            n *= 2
        out[name] = best
    return out


# -- the compiler's view -----------------------------------------------------------------------------------


def compile_step(cfg, mesh, kinds=(), *, batch: int, context: int, tokens: int = 1, dtype="bfloat16",
                 implementation: str | None = None, parallel: bool = True, scan_layers: bool = False) -> dict:
    """Compile one decode step (``tokens == 1``) or fresh prefill chunk on ``mesh`` (CPU devices or a deviceless TPU
    / GPU topology, :mod:`kimi_jax.parallel.aot`) with abstract parameters and cache, the ``kinds`` offloaded.

    ``parallel=False`` runs the single-device model (no ``Parallel`` in the run config; ``mesh`` of one device).
    ``scan_layers``: the repeating run of layers as one ``lax.scan`` (its stacked host arrays sliced per iteration).
    The host-memory arguments carry shardings over ``mesh.abstract_mesh``: the deviceless GPU client reports no
    memory kinds, so a concrete GPU mesh would drop ``pinned_host`` silently. Returns the device ``argument`` /
    ``output`` / ``alias`` / ``temp`` bytes and their ``host_*`` counterparts (per device), ``peak`` (device) and
    ``compile_seconds``."""
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
    graphdef, state = nnx.split(model)
    specs = sharding.param_specs(model, mesh, lay)
    am = mesh.abstract_mesh

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

    def step(state, ids, cache):
        out = nnx.merge(graphdef, state)(ids, cache=cache, prefix=tokens == 1, last_only=True)
        return out.logits, out.cache

    t0 = time.perf_counter()
    with jax.sharding.use_abstract_mesh(am), jax.set_mesh(mesh):
        compiled = jax.jit(step, donate_argnums=(2,), out_shardings=(None, cshard),
                           keep_unused=True).lower(state, ids, cache).compile()
    m = compiled.memory_analysis()
    keys = ("argument", "output", "alias", "temp")
    out = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in keys}
    out.update({f"host_{k}": int(getattr(m, f"host_{k}_size_in_bytes")) for k in keys})
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    out["compile_seconds"] = time.perf_counter() - t0
    return out


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
    lines.append(f"  per decode step: {o.h2d_per_step / 1e9:.2f} GB host->device, {o.d2h_per_step / 1e9:.2f} GB "
                 f"device->host = {o.step_seconds(bandwidth) * 1e3:.1f} ms at {bandwidth / 1e9:.0f} GB/s")
    return "\n".join(lines)


__all__ = ["KINDS", "Offload", "check_kinds", "compile_step", "fetch_entry", "fetch_experts", "format_offload",
           "moved_bytes", "offload_bytes", "offload_plan", "place_cache", "place_model", "store_entry", "to_device",
           "to_host"]
