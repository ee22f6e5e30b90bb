"""Checkpoint conversion, HF safetensors -> Orbax (``convert.convert_checkpoint``), and ``kimi-jax convert``.

Built on kimi_jax (its checkpoint reader, name table and Orbax writer); kimi_jax never imports it. Attributes are
imported on first use, so ``import convert`` stays light (no Orbax, no JAX).
"""

_EXPORTS = {"convert_checkpoint": "convert.converter", "verify_checkpoint": "convert.converter"}


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'convert' has no attribute {name!r}")
