"""Checkpoint conversion (``convert.convert_checkpoint``), synthetic checkpoints in the released layouts
(``convert.write_checkpoint``) and reading converted checkpoints back (``convert.restore``).

Attributes are imported on first use, so ``kimi_jax.checkpoint.synthetic`` stays light (no Orbax, no torch).
"""

_EXPORTS = {"convert_checkpoint": "convert.converter", "verify_checkpoint": "convert.converter",
            "write_checkpoint": "kimi_jax.checkpoint.synthetic", "restore": "kimi_jax.checkpoint.orbax", "load_converted": "kimi_jax.checkpoint.orbax"}


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'convert' has no attribute {name!r}")
