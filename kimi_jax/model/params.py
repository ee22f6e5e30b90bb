"""A model's parameters as leaves by dotted path, the form every checkpoint reader and writer works in.

A parameter holding a plain array is one leaf (``layers.3.self_attn.q_proj``); one holding a packed weight
(:mod:`kernels_pallas.packed`, e.g. an MXFP4 expert stack) is one leaf per field (``layers.3.mlp.experts.w1.packed``,
``...w1.scale``). :func:`leaves` lists them (arrays or ``ShapeDtypeStruct`` of an abstract model), :func:`fill` puts
values back, rebuilding packed weights from their fields.
"""

from __future__ import annotations

from typing import Mapping

from flax import nnx

from kernels_pallas import packed


def _name(path) -> str:
    return ".".join(str(k) for k in path)


def leaves(state) -> dict:
    """Dotted leaf path -> value (array or ShapeDtypeStruct) of every variable in an ``nnx`` state."""
    out = {}
    for path, var in nnx.to_flat_state(state):
        value, name = var.get_value(), _name(path)
        if packed.is_packed(value):
            out.update({f"{name}.{f}": v for f, v in zip(value._fields, value)})
        else:
            out[name] = value
    return out


def fill(state, values: Mapping[str, object]):
    """Set every variable of ``state`` (in place) from ``values`` keyed as :func:`leaves` keys them; a packed weight
    keeps the type its variable holds. Returns ``state``."""
    for path, var in nnx.to_flat_state(state):
        value, name = var.get_value(), _name(path)
        if packed.is_packed(value):
            var.set_value(type(value)(*(values[f"{name}.{f}"] for f in value._fields)))
        else:
            var.set_value(values[name])
    return state


def count(model, logical: bool = True) -> int:
    """Number of parameters; with ``logical`` a packed weight counts the values it encodes, else its stored
    elements (an MXFP4 byte pair is two values, its scale bytes none)."""
    total = 0
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = var.get_value()
        if packed.is_packed(value):
            total += packed.logical_size(value) if logical else sum(packed.logical_size(f) for f in value)
        else:
            total += packed.logical_size(value)
    return total
