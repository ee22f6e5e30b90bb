"""Choosing an implementation for a kernel call."""

from __future__ import annotations

import jax


class KernelUnavailable(RuntimeError):
    """An explicitly requested kernel implementation cannot run here."""


def resolve(op: str, implementation: str | None, available: dict, *, accelerated: tuple[str, ...] = ()) -> str:
    """Return the implementation name to use for ``op``.

    ``available`` maps names to callables. ``None`` means automatic: the first of ``accelerated`` that is
    available on TPU/GPU, else ``"reference"``. An explicit name that is unknown raises.
    """
    if implementation is None:
        if jax.default_backend() in ("tpu", "gpu", "cuda", "rocm"):
            for name in accelerated:
                if name in available:
                    return name
        return "reference"
    if implementation not in available:
        raise KernelUnavailable(
            f"{op}: implementation={implementation!r} is not available (choose from {sorted(available)})"
        )
    return implementation
