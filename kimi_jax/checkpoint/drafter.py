"""DSpark drafters in the released ``k3_dspark`` layout: ``config.json`` + safetensors, read with the one reader
(:class:`~kimi_jax.checkpoint.safetensors.Checkpoint`) and the name table's drafter rows
(:func:`~kimi_jax.checkpoint.names.dspark_target`); written back in the same layout (training exports one).

Every drafter tensor must fill exactly one parameter of the shape the config gives, every parameter must be filled,
values must be finite; the error names the tensor, the file and the shapes. The target's embedding and lm_head
(shared, usually not stored) are checked against the target's shape when the target is given, then dropped.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kimi_jax.checkpoint.names import DSPARK_SHARED, WeightError, dspark_target, finite
from kimi_jax.checkpoint.safetensors import DTYPES, Checkpoint
from kimi_jax.checkpoint.safetensors_write import Entry, write_file
from kimi_jax.model.config import drafter_dir, read_json
from kimi_jax.model.dspark import DSparkModel, abstract, config_from_dict
from kimi_jax.model.params import fill, leaves

CONFIG = "config.json"


def abstract_drafter(path, dtype=None, *, target_cfg=None) -> DSparkModel:
    """The drafter that ``path``'s ``config.json`` describes, abstract (``nnx.eval_shape``: its parameters are
    ``jax.ShapeDtypeStruct`` in ``dtype``, default float32; nothing allocated, no weights read): what planning and
    deviceless compiles need (``kimi-jax plan --compile ... --speculative dspark:PATH``). ``target_cfg``: checked as
    :func:`load_drafter` checks it. ``path`` ``"demo"``: the drafter shipped for the demo model."""
    cfg = config_from_dict(read_json(drafter_dir(path)))
    if target_cfg is not None:
        cfg.check_target(target_cfg)
    return abstract(cfg, dtype)


def load_drafter(path, *, dtype=None, target_cfg=None) -> DSparkModel:
    """The drafter in ``path``, its weights in ``dtype`` (default: float32). ``target_cfg``: the target's
    :class:`~kimi_jax.model.config.ModelConfig`, checked against the drafter (vocabulary, hidden size, tapped layers,
    stored shared tensors). ``path`` ``"demo"``: the drafter shipped for the demo model."""
    path = drafter_dir(path)
    model = abstract_drafter(path, dtype, target_cfg=target_cfg)
    cfg, dtype = model.cfg, model.run.dtype
    slots = leaves(nnx.state(model, nnx.Param))
    ckpt = Checkpoint(path)
    filled: dict[str, np.ndarray] = {}
    for name in sorted(ckpt):
        info = ckpt.tensors[name]
        where = f"{os.path.basename(info.file)}: {name} {list(info.shape)}"
        target = dspark_target(name)
        if target is None:
            _check_shared(name, info.shape, target_cfg, where)
            continue
        if target not in slots:
            raise WeightError(f"{where}: no drafter parameter {target!r} (config: {cfg.num_layers} layers)")
        if target in filled:
            raise WeightError(f"{where}: parameter {target!r} is filled twice (aliases of one tensor)")
        want = tuple(slots[target].shape)
        if tuple(info.shape) != want:
            raise WeightError(f"{where}: parameter {target!r} has shape {list(want)} for this config")
        value = ckpt.get(name)
        bad, at = finite(value)
        if bad:
            raise WeightError(f"{where}: {bad} non-finite values (first at {at})")
        filled[target] = np.asarray(value).astype(dtype)
    ckpt.close()
    missing = sorted(set(slots) - set(filled))
    if missing:
        raise WeightError(f"{path}: the drafter checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}")
    nnx.update(model, fill(nnx.state(model, nnx.Param), {k: jnp.asarray(v) for k, v in filled.items()}))
    return model


def _check_shared(name: str, shape, target_cfg, where: str) -> None:
    stem = name.removeprefix("model.")
    if target_cfg is not None and stem in DSPARK_SHARED:
        want = (target_cfg.vocab_size, target_cfg.hidden_size)
        if tuple(shape) != want:
            raise WeightError(f"{where}: the drafter stores the target's {stem} as {list(shape)}, but the target's "
                              f"is {list(want)}: a drafter for another model")


def save_drafter(model: DSparkModel, config: dict, path, *, dtype="BF16") -> None:
    """Write ``model`` as a ``k3_dspark`` checkpoint: ``config.json`` (``config``, checked to describe ``model``) and
    ``model.safetensors`` with the released tensor names, in ``dtype`` (a safetensors dtype name)."""
    if config_from_dict(config) != model.cfg:
        raise ValueError("save_drafter: the config does not describe this drafter")
    os.makedirs(path, exist_ok=True)
    arrays = {k + ".weight": np.asarray(jax.device_get(v.astype(jnp.float32))).astype(DTYPES[dtype])
              for k, v in leaves(nnx.state(model, nnx.Param)).items()}
    write_file(os.path.join(path, "model.safetensors"),
               [Entry(n, dtype, a.shape) for n, a in arrays.items()], lambda e: arrays[e.name])
    with open(os.path.join(path, CONFIG), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
