"""Decode-shaped matrix-vector products, several per call: ``group([(x, w, ids), ...])``.

Each item is ``x [S, K]`` with ``w [N, K]`` (a plain weight, checkpoint layout ``[out, in]``) and ``ids=None``, or
``w [E, N, K]`` (an expert stack) with ``ids [S]`` choosing a matrix per row: ``out[s] = w[ids[s]] @ x[s]``. Each
result is ``[S, N]`` float32.

This is a CPU kernel. At a handful of rows (decode) every product streams its weight once, so the step's time is
memory bandwidth, and XLA:CPU leaves some of it unused: launched one by one, products of 0.5-1 MB ran at about half
the rate of the large ones, and a chosen expert is first copied out of its stack. The native kernel (``native.cc``,
built on first use by :mod:`kernels_pallas._native`) reads every weight in place and streams all the items of a
call as one piece of work split over the threads. It is the automatic choice on CPU for float32 operands when it
builds; elsewhere (and with ``implementation="reference"``) the items run one by one as plain-jnp products.
"""

from __future__ import annotations

from kernels_pallas import _native
from kernels_pallas._dispatch import NATIVE, KernelUnavailable, target_platform
from kernels_pallas.matvec import native, reference


def native_ready() -> bool:
    """Whether the automatic choice for float32 items is the native kernel here (on CPU, built, not turned off).
    Builds it on first use."""
    return target_platform() == "cpu" and _native.try_target(native.SOURCE, native.SYMBOL) is not None


def group(items, *, implementation=None, precision=None):
    """``[w @ x_s (or w[ids[s]] @ x_s) for each item]`` as float32 ``[S, N]`` arrays.

    ``implementation``: None (native kernel on CPU for float32 items when it builds, else reference),
    ``"reference"``, or ``"cpu_native"`` (raises :class:`KernelUnavailable` where it cannot run).
    ``precision`` applies to the reference products.
    """
    items = [(x, w, ids) for x, w, ids in items]
    if implementation == NATIVE:
        if target_platform() != "cpu":
            raise KernelUnavailable(f"matvec: implementation={NATIVE!r} runs on CPU only, not on {target_platform()!r}")
        return native.group(items)
    if implementation is None and native.unsupported(items) is None and native_ready():
        return native.group(items)
    if implementation not in (None, "reference"):
        raise KernelUnavailable(f"matvec: unknown implementation {implementation!r} (None, 'reference' or {NATIVE!r})")
    return reference.group(items, precision=precision)
