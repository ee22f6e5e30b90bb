"""What offloading costs a deployment: the bytes each kind moves to host memory per chip, one decode step's
host <-> device copies, and the smallest fitting meshes with and without it. Computed from the same abstract shapes
and partition specs as :mod:`kimi_jax.deploy.plan`; :func:`kimi_jax.deploy.compile.compile_step` checks them
against the compilers (the bytes they move, read from the scheduled program). How the model moves them:
:mod:`kimi_jax.model.offload`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from kernels_pallas._dispatch import slices_from_host
from kimi_jax.deploy import plan as plan_lib
from kimi_jax.model import params
from kimi_jax.model.cache import cache_shapes
from kimi_jax.model.decoder import abstract_model
from kimi_jax.model.offload import entry_kind, fetches_routed
from kimi_jax.model.run import RunConfig, check_offload
from kimi_jax.parallel import sharding

PCIE_GEN5 = 64e9  # bytes/s per GPU, one direction (x16)
HOST_PER_CHIP = 256e9  # host memory per accelerator: a DGX H200 node has 2 TB for its 8 GPUs (NVIDIA's datasheet)


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
    compiler slices them out of host memory (:func:`kernels_pallas._dispatch.slices_from_host`), else every local expert. ``plan``: the
    :func:`kimi_jax.deploy.plan.make_plan` of the same arguments, when the caller has it already. ``hot``: experts
    per MoE layer kept in device memory as well (:func:`keep_hot_experts`; at most the chip's local ones); the
    per-step copies stay the worst case, every choice cold."""
    kinds = check_offload(kinds)
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
        if slices_from_host(p.expert_dtypes, platform):
            slots = routed_slots(cfg, batch, sizes, e_loc)
    h2d = whole - experts + experts // e_loc * slots if slots else whole  # every layer's local experts alike
    hot = min(int(hot), e_loc) if experts else 0
    return Offload(kinds, moved, h2d, back, whole, slots, e_loc, hot, experts * hot // e_loc if hot else 0)


def chip_platform(chip: str) -> str:
    """``"tpu"`` or ``"gpu"`` for a :data:`kimi_jax.deploy.plan_lib.CHIPS` key."""
    return "tpu" if plan_lib.CHIPS[chip].name.startswith("TPU") else "gpu"


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
    kinds = check_offload(kinds)
    c = plan_lib.CHIPS[chip]
    out = {}
    for name, ks in (("without", ()), ("with", kinds)):
        n, best = 1, None
        while n <= max_chips and best is None:
            for s in plan_lib.candidate_meshes(n):
                p = plan_lib.make_plan(cfg, s, layout, batch=batch, context=context, dtype=dtype, quantize=quantize)
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


def moved_bytes(cfg, kinds, mesh, *, batch: int, context: int, dtype="bfloat16") -> int:
    """Bytes per device of the arrays ``kinds`` place in host memory (from their shapes and specs on ``mesh``, or a
    ``{"data", "expert", "model"}`` dict of sizes): what :func:`compile_step`'s device arguments should drop by."""
    kinds = check_offload(kinds)
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
