"""``from_pretrained``: an HF checkpoint directory (safetensors) or a converted kimi-jax (Orbax) directory."""

from __future__ import annotations

import os

import jax.numpy as jnp
from flax import nnx

from kimi_jax import config as config_lib
from kimi_jax.layers import RunConfig
from kimi_jax.model import KimiModel
from kimi_jax.weights import load_hf


def from_pretrained(path, *, dtype="bfloat16", implementation: str | None = None, strict: bool = True,
                    run: RunConfig | None = None) -> KimiModel:
    """Load a model. ``dtype`` is the activation and parameter dtype (float32 tensors of the release -- conv
    kernels, decay parameters, ``o_norm``, router bias -- stay float32; MXFP4 experts stay packed)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such model directory")
    cfg = config_lib.load(path, strict=strict)
    run = run or RunConfig(dtype=jnp.dtype(dtype), implementation=implementation)
    return load_hf(path, cfg, lambda: KimiModel(cfg, run=run, rngs=nnx.Rngs(0)))
