"""A trained model written back in its family's released layout (K3: Moonshot's release; Kimi Linear and Llama: HF
transformers' ``save_pretrained``), so :func:`kimi_jax.from_pretrained`, the converter and transformers read it.

The tensor list, names, shapes and dtypes come from the same inventories the synthetic checkpoints use
(:mod:`kimi_jax.checkpoint.synthetic`); each tensor's value comes from the parameter leaf the loader's name table
(:mod:`kimi_jax.checkpoint.names`) fills from it, so export and load are inverse by construction. MXFP4 experts,
trained as float, are re-quantized with the host codec (:func:`kernels_pallas.mxfp4.quantize_np`, compressed-tensors'
rounding) when the config ships them packed; LoRA adapters are already merged in ``trainer.model(state)``.
"""

from __future__ import annotations

import copy
import json
import os

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from kernels_pallas import mxfp4
from kimi_jax.checkpoint import names
from kimi_jax.checkpoint.safetensors import DTYPES
from kimi_jax.checkpoint.safetensors_write import write_file
from kimi_jax.checkpoint.synthetic import INVENTORIES
from kimi_jax.model import params as params_lib
from kimi_jax.model.decoder import KimiModel, relayout

FAMILY = {"kimi_k3": "k3", "kimi_linear": "kimi_linear", "dense": "llama"}
PACKED_FIELDS = (".packed", ".scale")


def _value(x, shape, where):
    """A parameter slot in the file's shape: a reshape (conv ``[P, W]`` -> ``[P, 1, W]``, a ``[D]`` AttnRes
    projection -> ``[1, D]``, HF's ``A_log [1, 1, H, 1]``) or the release's zero padding of ``A_log``."""
    x = np.asarray(x)
    if x.size == int(np.prod(shape)):
        return x.reshape(shape)
    if where.endswith("A_log") and x.ndim == 1 and len(shape) == 1 and shape[0] > x.shape[0]:
        return np.concatenate([x, np.zeros(shape[0] - x.shape[0], x.dtype)])
    raise ValueError(f"{where}: parameter of shape {list(x.shape)} cannot fill a tensor of shape {list(shape)}")


def export_hf(model: KimiModel, config: dict, path, *, dtype: str = "bfloat16") -> str:
    """Write ``model`` with ``config`` (the raw config.json dict it was built from) to directory ``path`` as one
    ``model.safetensors`` + config.json in the family's released layout; tensors the release keeps in F32 / U8 stay
    so, the rest are written in ``dtype``. Returns ``path``."""
    path = os.fspath(path)
    cfg = model.cfg
    family = FAMILY[cfg.family]
    if model.plan.count:
        model = relayout(model, scan_layers=False)
    leaves = {k: v for k, v in params_lib.leaves(nnx.state(model, nnx.Param)).items()}
    config = copy.deepcopy(config)
    for c in (config, config.get("text_config")):
        if isinstance(c, dict):
            c.pop("torch_dtype", None)
            c["dtype"] = dtype
    specs = INVENTORIES[family](config, dtype)
    targets = {}
    for name, v in leaves.items():
        targets[name] = jax.ShapeDtypeStruct(v.shape, v.dtype)
        if ".experts." in name and v.ndim == 3:  # float experts fill the release's packed fields too
            for f in PACKED_FIELDS:
                targets[name + f] = targets[name]
    placements = _place([s.name for s in specs], cfg, targets)
    by_name = {p.tensor: p for p in placements}
    host = {}

    def leaf(name):
        if name not in host:
            host[name] = np.asarray(jax.device_get(leaves[name]), np.float32)
        return host[name]

    def produce(entry):
        p = by_name[entry.name]
        if p.target.endswith(PACKED_FIELDS):
            base, field = p.target.rsplit(".", 1)
            packed, scale = mxfp4.quantize_np(leaf(base)[p.expert].astype(ml_dtypes.bfloat16))
            return packed if field == "packed" else scale
        x = leaf(p.target)
        x = x[p.expert] if p.expert is not None else x
        return _value(x, entry.shape, entry.name).astype(DTYPES[entry.dtype])

    os.makedirs(path, exist_ok=True)
    write_file(os.path.join(path, "model.safetensors"), [s.entry for s in specs], produce)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return path


def _place(tensor_names, cfg, targets):
    """The name table's placements for the export: every file tensor matched, float experts standing in for the
    packed fields they are quantized into (so the completeness check runs on the file's side only)."""
    placements = []
    for name in tensor_names:
        cname = names.canonical(name, cfg)
        p = names.match(name, cname, targets)
        if p is None:
            raise names.WeightError(f"export: tensor {name!r} of the released layout fills no parameter of the model")
        placements.append(p)
    return placements
