"""Checkpoint conversion (``convert.convert_checkpoint``), synthetic checkpoints in the released layouts
(``convert.write_checkpoint``) and reading converted checkpoints back (``convert.restore``).

Attributes are imported on first use, so ``convert.synthetic`` stays light (no Orbax, no torch).
"""

_EXPORTS = {"convert_checkpoint": "convert.converter", "verify_checkpoint": "convert.converter",
            "write_checkpoint": "convert.synthetic", "restore": "convert.orbax_io", "load_converted": "convert.orbax_io"}


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'convert' has no attribute {name!r}")
