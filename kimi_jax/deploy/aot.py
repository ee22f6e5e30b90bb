"""Deviceless compile targets: the real TPU and NVIDIA GPU compilers, run on a machine that has neither.

libtpu (Mosaic included) compiles for a TPU topology and XLA:GPU (Triton -> PTX -> cubin) for a GPU target config
with no chip attached. Nothing runs; what the chip's compiler checks is
checked: Mosaic layouts and VMEM budgets, Triton shapes, SPMD partitioning, and HBM fit. The runtime stays on the
CPU (``JAX_PLATFORMS=cpu``): otherwise JAX would initialise the TPU / CUDA runtimes and fail without a device.

Targets are text: ``tpu:TOPOLOGY`` (``tpu:v5p:4x4x4``; TPU7x exposes 2 devices per chip) or ``gpu:NAME:SxHxD``
(``gpu:h200:1x2x8`` = 1 slice, 2 hosts, 8 GPUs each).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import re

import jax
import numpy as np
from jax._src import xla_bridge
from jax.experimental import topologies

from kimi_jax.deploy.compile import compile_prefill_tapped, compile_serve, compile_speculative, compile_step
from kimi_jax.generation.speculative import DSpark
from kimi_jax.parallel import sharding

GIB = 2**30
EXTRA = 'pip install "kimi-jax[aot]"'

# HBM per TPU device. libtpu's deviceless devices report no memory (``memory_stats`` needs an addressable device),
# so these are the datasheet figures; the compiler itself checks fit too (CompileTimeHbmOom). TPU7x: 192 GB per
# chip, exposed as 2 devices of 96 GB.
TPU_HBM = {"v4": 32 * GIB, "v5e": 16 * GIB, "v6e": 32 * GIB, "v5p": 95e9, "tpu7x": 96e9}
# GPU names -> the GpuTargetConfigProto XLA ships (its device_description_str). Their HBM is read from the
# config's device_memory_size (H200: 141 GiB).
# The MIG slices are the configs' smallest GPUs: a 1g.23gb slice of a B200 (22.0 GB) stands for the 24 GB cards
# XLA ships no config for; a 1g.10gb slice of an H100 holds 10.5 GB.
GPU_NAMES = {"h100": "NVIDIA H100 80GB HBM3", "h200": "NVIDIA H200 141GB HBM3e", "b200": "NVIDIA B200",
             "b200-1g.23gb": "NVIDIA B200 MIG 1g.23gb", "h100-1g.10gb": "NVIDIA H100 80GB HBM3 MIG 1g.10gb"}


class TargetError(ValueError):
    """A target text that names no known TPU topology or GPU."""


class CompilerMissing(RuntimeError):
    """The deviceless compiler for a target is not installed."""


@dataclasses.dataclass(frozen=True)
class Target:
    text: str  # as given: "tpu:v5e:2x2", "gpu:h200:1x2x8"
    platform: str  # "tpu" or "gpu"
    chip: str  # a TPU_HBM or GPU_NAMES key
    topology: str  # libtpu's topology name ("v5e:2x2") or the GPU's "SxHxD"

    @property
    def marker(self) -> str:
        """The custom call a compiled Pallas kernel leaves in the program text."""
        return "tpu_custom_call" if self.platform == "tpu" else "__gpu$xla.gpu.triton"


def parse_target(text: str) -> Target:
    """``"tpu:v5e:2x2"`` / ``"gpu:h200:1x2x8"`` -> :class:`Target` (raises :class:`TargetError`)."""
    kind, _, rest = text.partition(":")
    chip, _, dims = rest.partition(":")
    if kind == "tpu":
        if chip not in TPU_HBM or not re.fullmatch(r"\d+(x\d+){1,2}", dims):
            raise TargetError(f"target {text!r}: expected tpu:CHIP:AxB[xC] with CHIP one of {sorted(TPU_HBM)} "
                              "(e.g. tpu:v5e:2x2, tpu:v5p:4x4x4, tpu:tpu7x:4x4x2)")
        return Target(text, "tpu", chip, rest)
    if kind == "gpu":
        if chip not in GPU_NAMES or not re.fullmatch(r"\d+x\d+x\d+", dims):
            raise TargetError(f"target {text!r}: expected gpu:NAME:SLICESxHOSTSxGPUS with NAME one of "
                              f"{sorted(GPU_NAMES)} (e.g. gpu:h200:1x2x8)")
        return Target(text, "gpu", chip, dims)
    raise TargetError(f"target {text!r}: expected tpu:TOPOLOGY (tpu:v5p:4x4x4) or gpu:NAME:SxHxD (gpu:h200:1x2x8)")


def _require(module: str, what: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise CompilerMissing(f"{what} is not installed ({module}); {EXTRA} brings it")


def cpu_runtime() -> None:
    """Keep JAX's runtime on the CPU unless the user chose platforms: the TPU / CUDA runtimes cannot start here,
    but their compilers still run. Only effective before the first backend is initialised."""
    if not jax.config.jax_platforms and not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")


@functools.lru_cache(maxsize=None)
def gpu_target_config(chip: str) -> str:
    """The GpuTargetConfigProto text XLA ships for ``chip`` (read out of the CUDA plugin library)."""
    _require("jax_plugins.xla_cuda12", "the CUDA PJRT plugin (jax-cuda12-plugin)")
    _require("nvidia.cuda_nvcc", "ptxas (nvidia-cuda-nvcc-cu12)")
    spec = importlib.util.find_spec("jax_plugins.xla_cuda12")
    path = os.path.join(os.path.dirname(spec.origin), "xla_cuda_plugin.so")
    with open(path, "rb") as f:
        data = f.read()
    i = data.find(f'device_description_str: "{GPU_NAMES[chip]}"'.encode())
    if i < 0:
        raise CompilerMissing(f"{path} has no target config for {GPU_NAMES[chip]!r} (another plugin version?)")
    start, end = data.rfind(b"\0", 0, i) + 1, data.find(b"\0", i)
    text = data[start:end].decode()
    if "gpu_device_info" not in text:
        raise CompilerMissing(f"{path}: the text around {GPU_NAMES[chip]!r} is not a GpuTargetConfigProto")
    return text


@functools.lru_cache(maxsize=None)
def target_devices(target: Target) -> tuple:
    """The target's (deviceless) devices, in topology order."""
    cpu_runtime()

    if target.platform == "tpu":
        _require("libtpu", "the TPU compiler (libtpu)")
        # libtpu takes a machine-wide lock so two processes never drive one chip; a deviceless compile drives none,
        # and without this a second process (a test beside a CLI run) fails with "libtpu multi-process lockfile".
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        kw = dict(topology_name=target.topology, platform="tpu")
    else:
        kw = dict(platform="cuda", topology=target.topology, target_config=gpu_target_config(target.chip))
    try:
        return tuple(topologies.get_topology_desc(**kw).devices)
    except Exception as e:  # libtpu / the plugin refuse unknown topologies with assorted runtime errors
        raise TargetError(f"target {target.text!r}: the {target.platform.upper()} compiler refused the topology: "
                          f"{str(e).splitlines()[0]}") from e


def hbm_bytes(target: Target) -> float:
    """HBM per device: the GPU target config's ``device_memory_size``; the TPU_HBM table for TPUs."""
    if target.platform == "gpu":
        m = re.search(r"device_memory_size:\s*(\d+)", gpu_target_config(target.chip))
        if m:
            return float(m.group(1))
        raise CompilerMissing(f"the {target.chip} target config has no device_memory_size")
    return TPU_HBM[target.chip]


def target_mesh(target: Target, data: int = 1, expert: int = 1, model: int = 1):
    """A ``(data, expert, model)`` :class:`jax.sharding.Mesh` over the target's devices (Auto axes)."""
    devices = target_devices(target)
    n = data * expert * model
    if n != len(devices):
        raise TargetError(f"mesh data={data} x expert={expert} x model={model} = {n} devices, but target "
                          f"{target.text!r} has {len(devices)}")
    return sharding.make_mesh(data, expert, model, devices=devices)


# -- compiling ---------------------------------------------------------------------------------------------


def is_hbm_oom(error: Exception) -> bool:
    """The compiler's own "does not fit HBM" (as opposed to a kernel that fails to compile, e.g. VMEM)."""
    msg = str(error)
    return "CompileTimeHbmOom" in msg or ("RESOURCE_EXHAUSTED" in msg and "hbm" in msg.lower()
                                          and "space=vmem" not in msg)


def compile_steps(cfg, target: Target, sizes: dict, layout="tp_ep", *, batch: int, context: int,
                  dtype="bfloat16", prefill_chunk: int = 0, implementation: str | None = None,
                  scan_layers: bool = False, quantize: str | None = None, kv_cache: str | None = None,
                  kda_state=None, serve=None, speculative=None) -> dict:
    """Compile one decode step and (``prefill_chunk`` > 0) one fresh prefill of ``[batch, prefill_chunk]`` ids
    for ``target`` on a mesh of ``sizes``, with abstract sharded weights and cache (``kv_cache`` / ``kda_state``:
    its storage options, :func:`kimi_jax.model.cache.cache_shapes`). ``serve``: the serving engine's programs over
    its paged cache instead (a :class:`kimi_jax.serving.stepplan.Shapes`; :func:`compile.compile_serve`), with
    ``speculative`` its verify step (and a DSpark drafter's step) too, as ``"verify"`` (and ``"draft"``).
    ``speculative``: a drafter (:class:`kimi_jax.generation.speculative.NGram` or ``DSpark``, which may be abstract):
    ``generate``'s speculative decode loop too, as ``"speculative"`` (:func:`compile.compile_speculative`); for a
    DSpark drafter and ``prefill_chunk`` > 0 also the prefill chunk that writes its context, as ``"prefill_tapped"``
    (:func:`compile.compile_prefill_tapped`).

    Returns ``{"decode": r, "prefill": r}``; each ``r`` holds the per-device ``argument`` / ``output`` / ``alias`` /
    ``temp`` / ``peak`` bytes, ``compile_seconds``, ``hbm`` (bytes per device) and ``fits``. A program the compiler
    refuses has ``fits`` False and ``error`` (its message) instead of the bytes; ``oom`` says whether the refusal
    was the compiler's own HBM out-of-memory ("does not fit") rather than a failure to compile at all.
    """
    mesh = target_mesh(target, **{a: int(sizes.get(a, 1)) for a in sharding.MESH_AXES})
    hbm = hbm_bytes(target)
    kw = dict(dtype=dtype, implementation=implementation, scan_layers=scan_layers, quantize=quantize)
    if serve is not None:
        try:
            res = compile_serve(cfg, mesh, layout, shapes=serve, drafter=speculative, **kw)
        except Exception as e:  # every refusal is a result here; compile_serve raises for callers who want it
            names = ("decode", "prefill") + (() if speculative is None else ("verify",)) + (
                ("draft",) if isinstance(speculative, DSpark) else ())
            res = {name: _refused(e, hbm) for name in names}
        return {name: _fit(r, hbm) for name, r in res.items()}
    out = {}
    for name, tokens in (("decode", 1), ("prefill", prefill_chunk)):
        if not tokens:
            continue
        try:
            r = compile_step(cfg, mesh, layout, batch=batch, context=context, tokens=tokens, kv_cache=kv_cache,
                             kda_state=kda_state, **kw)
        except Exception as e:  # every refusal is a result here; compile_step raises for callers who want it
            r = _refused(e, hbm)
        out[name] = _fit(r, hbm)
    if speculative is not None:
        try:
            r = compile_speculative(cfg, mesh, layout, batch=batch, context=context, drafter=speculative,
                                    kv_cache=kv_cache, kda_state=kda_state, **kw)
        except Exception as e:  # a refusal is a result, as above
            r = _refused(e, hbm)
        out["speculative"] = _fit(r, hbm)
    if isinstance(speculative, DSpark) and prefill_chunk:
        try:
            r = compile_prefill_tapped(cfg, mesh, layout, batch=batch, context=context, tokens=prefill_chunk,
                                       drafter=speculative, kv_cache=kv_cache, kda_state=kda_state, **kw)
        except Exception as e:  # a refusal is a result, as above
            r = _refused(e, hbm)
        out["prefill_tapped"] = _fit(r, hbm)
    return out


def _refused(error: Exception, hbm: float) -> dict:
    return {"fits": False, "hbm": hbm, "oom": is_hbm_oom(error), "error": _error_line(error)}


def _fit(r: dict, hbm: float) -> dict:
    if "error" not in r:
        r["hbm"], r["fits"] = hbm, r["peak"] <= hbm
    return r


def _error_line(error: Exception) -> str:
    """The line of the compiler's message that says what went wrong (for an HBM OOM: what exceeded it)."""
    lines = [s.strip() for s in str(error).splitlines() if s.strip()]
    first = next((s for s in lines if "exceed" in s), lines[0] if lines else "")
    return f"{type(error).__name__}: {first}"


def device_array(target: Target, shape: tuple[int, ...]) -> np.ndarray:
    """The first ``prod(shape)`` target devices, reshaped (for hand-built meshes in tests)."""
    devices = target_devices(target)
    return np.array(devices[: int(np.prod(shape))]).reshape(shape)
