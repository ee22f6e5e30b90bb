"""``from_pretrained``: an HF checkpoint directory (safetensors) or a converted kimi-jax (Orbax) directory."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
from flax import nnx

from kernels_pallas import quant
from kernels_pallas.mxfp4 import MXFP4Weight
from kimi_jax.checkpoint import hf
from kimi_jax.checkpoint import orbax as orbax_io
from kimi_jax.checkpoint.reader import NonFiniteError
from kimi_jax.model import config as config_lib
from kimi_jax.model import offload, params
from kimi_jax.model import quantize as quantize_lib
from kimi_jax.model.decoder import KimiModel, relayout
from kimi_jax.model.run import RunConfig
from kimi_jax.parallel import distributed, sharding

# The dtype a run gets when its user names none: bfloat16 on every platform. Accelerators run it natively; on the
# CPU the native decode products stream bfloat16 weights (widened in registers, float32 sums), so it decodes the
# shared benchmark model faster than float32 (52.0 vs 48.9 tok/s at batch 1, 184 vs 165 at batch 8, back to back),
# prefills 1.65x faster and holds half the bytes: README "CPU dtype" (benchmarks/decode.py --dtype).
AUTO_DTYPE = jnp.bfloat16


def auto_dtype(devices=None) -> tuple[jnp.dtype, str]:
    """``(dtype, why)`` for a run on ``devices`` (default: ``jax.devices()``) whose user named no dtype: bfloat16.
    ``why`` is one line a command prints beside the choice."""
    platform = (list(devices) if devices is not None else jax.devices())[0].platform
    if platform == "cpu":
        return jnp.dtype(AUTO_DTYPE), "bfloat16, which on the CPU decodes faster than float32 and holds half the bytes"
    return jnp.dtype(AUTO_DTYPE), f"bfloat16 on {platform}"


def resolve_dtype(dtype) -> jnp.dtype:
    """``dtype`` as asked, or the automatic choice (:data:`AUTO_DTYPE`) when it is None or ``"auto"``."""
    if dtype is None or (isinstance(dtype, str) and dtype == "auto"):
        return jnp.dtype(AUTO_DTYPE)
    return jnp.dtype(dtype)


def from_pretrained(path, *, dtype=None, implementation: str | None = None, strict: bool = True,
                    run: RunConfig | None = None, mesh=None, layout="tp_ep", scan_layers: bool = False,
                    check_finite: bool = True, progress: bool = True, quantize: str | None = None,
                    quantize_include=None, quantize_calibration=None) -> KimiModel:
    """Load a model from a directory, or the shipped demo model by its name ``"demo"``. ``dtype`` is the activation and parameter dtype (float32 tensors of the release -- conv
    kernels, decay parameters, ``o_norm``, router bias -- stay float32; MXFP4 experts stay packed); None (or
    ``"auto"``): bfloat16, on the CPU too (:func:`auto_dtype`); ``"float32"`` for oracle-grade numerics;
    ``"float64"`` (needs ``jax_enable_x64``; refused without) runs every internal in float64 too
    (:attr:`RunConfig.compute_dtype`), to compare with a float64 oracle. ``run``, when given, carries its own dtype.

    ``mesh`` (from :func:`kimi_jax.parallel.sharding.make_mesh`): read every parameter straight into its shards under
    ``layout`` (a :mod:`kimi_jax.parallel.sharding` table name); each process reads only its devices' slices.
    ``scan_layers`` (or ``run.scan_layers``): the repeating run of layers stacked and run as one scan
    (:mod:`kimi_jax.model.layer_plan`); the checkpoint is read per layer, then each parameter is stacked in turn.
    ``check_finite``: refuse weights holding NaN or Inf (MXFP4: the NaN scale byte), naming the tensor and its file;
    checked as each tensor is read (a converted checkpoint: on the loaded arrays). ``progress``: a byte counter on
    stderr for loads that take more than 2 s.

    ``quantize``: weight-only quantization at load (``"int8"``, ``"int4"`` = group 32, ``"int4:g64"``,
    ``"int4:g128:zero"``, ``"nf4"``; :mod:`kimi_jax.model.quantize`) of the module classes in ``quantize_include``
    (default: attention, MLP and latent projections and the lm_head; add ``"embed"`` for the embedding). The format
    and the selection are checked against the config before any weight is read. Each weight is quantized after the
    model is loaded (the float model is held once, then each weight is replaced in turn). ``quantize_calibration``:
    token ids ``[sequences, tokens]`` of text like the model's; the codes are then chosen by GPTQ on them
    (:func:`kimi_jax.model.quantize.quantize`), checked before anything is read.

    A checkpoint converted with ``kimi-jax convert --quantize`` loads as the quantized model it stores (the packed
    fields are read as they are; no float weight is built). Asking it for its own format and classes is a no-op;
    asking for another is refused, naming both (load the source, or convert again)."""
    path = config_lib.model_dir(path)  # "demo": the shipped demo model
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such model directory")

    converted = orbax_io.looks_converted(path)  # `kimi-jax convert` output (Orbax)
    stored = None
    if converted:
        stored = orbax_io.quantization(orbax_io.read_marker(path))  # refuses an unfinished conversion, naming why
    if stored is not None and quantize is not None:
        _check_stored(path, stored, quantize, quantize_include)
        quantize = None  # what it asks for is what is stored
    cfg = config_lib.load(path, strict=strict)  # the one read of config.json; everything below takes cfg
    # compressed-tensors int4 / int8: its weights load packed (kimi_jax.checkpoint.hf)
    ct = None if converted else hf.pack_quantized(cfg)
    if ct is not None and quantize is not None:
        raise ValueError(f"{path} stores its weights {ct.name()} (compressed-tensors); they load as stored, and "
                         f"quantize={quantize!r} would requantize them: load it without quantize=")
    run = run or RunConfig(dtype=resolve_dtype(dtype), implementation=implementation)
    if mesh is not None and "experts" in run.offload:  # refused before anything is read
        raise ValueError("offload=('experts',) runs on one device for now: the expert-parallel dispatch "
                         "(kernels_pallas/experts/expert_parallel.py) reads the weights where they live; load without mesh=")
    scan = scan_layers or run.scan_layers
    run = dataclasses.replace(run, scan_layers=False)  # read per layer, stacked below
    if mesh is not None:
        run = distributed.with_parallel(run, mesh, layout)
    if quantize_calibration is not None and quantize is None:
        raise ValueError("quantize_calibration without quantize= (or of a checkpoint stored quantized)")
    if quantize is not None:  # a bad format, selection or calibration is refused before anything is read
        abstract = nnx.eval_shape(lambda: KimiModel(cfg, run=run, rngs=nnx.Rngs(0)))
        todo = quantize_lib.plan(abstract, quantize, quantize_include)
        if quantize_calibration is not None:
            quantize_lib.check_calibration(quantize_calibration, cfg.vocab_size)
            quantize_lib.check_calibrated(abstract, todo)
    model = _load(path, cfg, run, converted, check_finite, progress)
    if quantize is not None:
        quantize_lib.quantize(model, quantize, quantize_include, calibration=quantize_calibration)
    offload.place_model(model)  # RunConfig(offload=("experts",)): the experts in host memory (loaded there already)
    return relayout(model, scan_layers=True, consume=True) if scan else model


def _check_stored(path: str, stored, quantize, include) -> None:
    """A converted checkpoint stores ``stored`` (format, classes): refuse a ``quantize`` request for anything else."""
    fmt, classes = stored
    asked = quant.Format.parse(quantize) if not isinstance(quantize, quant.Format) else quantize
    asked_classes = quantize_lib.DEFAULT if include is None else tuple(include)
    if asked != fmt or set(asked_classes) != set(classes):
        raise ValueError(f"{path} was converted with its weights quantized to {fmt.name()} (classes "
                         f"{', '.join(classes)}); cannot load it as {asked.name()} (classes "
                         f"{', '.join(asked_classes)}): packed weights are not requantized. Load it without "
                         "quantize=, load the source checkpoint with the format you want, or convert again with "
                         f"--quantize {asked.name()}")


def _load(path, cfg, run: RunConfig, converted: bool, check_finite: bool, progress: bool) -> KimiModel:
    factory = lambda: KimiModel(cfg, run=run, rngs=nnx.Rngs(0))  # noqa: E731
    place = None  # on one device: leaf path -> its sharding, or None for the default device
    if run.parallel is None and "experts" in run.offload:  # routed experts read straight into host memory
        host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=offload.HOST)
        place = lambda name: host if offload.is_expert_leaf(name) else None  # noqa: E731
    if converted:
        abstract = orbax_io.abstract_model(path, factory)  # quantized as the conversion quantized it
        shardings = None
        if run.parallel is not None:
            shardings = sharding.param_shardings(abstract, run.parallel.mesh, run.parallel.layout)
        elif place is not None:
            shardings = {name: place(name) for name in params.leaves(nnx.state(abstract))}
        model = orbax_io.load_converted(path, cfg, factory, shardings=shardings, abstract=abstract)
        if check_finite:
            _check_loaded(model, path)
        return model
    if run.parallel is not None:
        return hf.load_hf_sharded(path, cfg, run, factory, check_finite=check_finite, progress=progress)
    return hf.load_hf(path, cfg, factory, placement=place, check_finite=check_finite, progress=progress)


def _check_loaded(model: KimiModel, path: str) -> None:
    """NaN / Inf in the loaded float parameters of a converted checkpoint (a device-side reduction per leaf; a
    quantized weight: its float scales)."""
    count = jax.jit(lambda x: jnp.sum(~jnp.isfinite(x)))
    nan_scales = jax.jit(lambda s: jnp.sum(s == 255))
    for path_, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value, name = var.get_value(), ".".join(map(str, path_))
        if isinstance(value, MXFP4Weight):
            n, what = int(nan_scales(value.scale)), "E8M0 NaN scale bytes (0xFF)"
        elif isinstance(value, quant.TYPES):
            n = sum(int(count(f)) for f in value if jnp.issubdtype(f.dtype, jnp.floating))
            what = "NaN / Inf scales"
        elif jnp.issubdtype(value.dtype, jnp.floating):
            n, what = int(count(value)), "NaN / Inf values"
        else:
            continue
        if n:
            raise NonFiniteError(f"{path}: parameter {name} holds {n} {what}; a model loaded from it computes NaN. "
                                 "Pass check_finite=False to load it anyway")
