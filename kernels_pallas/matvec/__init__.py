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

No partition rule: on a mesh of several devices the items run as plain-jnp products that GSPMD partitions (the
weights' own shardings decide), and the native kernel is not chosen there.
"""

from __future__ import annotations

from kernels_pallas import _native
from kernels_pallas._dispatch import REFERENCE, Native, Op, target_platform
from kernels_pallas.matvec import native, reference


def native_built() -> bool:
    """Whether the native kernel is built and turned on (builds it on first use)."""
    return _native.try_target(native.SOURCE, native.SYMBOL) is not None


def native_ready() -> bool:
    """Whether the automatic choice for float32 items is the native kernel here (on CPU, built, not turned off)."""
    return target_platform() == "cpu" and native_built()


OP = Op("matvec", None, {REFERENCE: lambda items, *, precision=None: reference.group(items, precision=precision)},
        native=Native(lambda items, *, precision=None: native.group(items),
                      unsupported=lambda items, **_: native.unsupported(items), ready=native_built))


def group(items, *, implementation=None, precision=None, placement=None):
    """``[w @ x_s (or w[ids[s]] @ x_s) for each item]`` as float32 ``[S, N]`` arrays.

    ``implementation``: None (native kernel on CPU for float32 items when it builds, else reference),
    ``"reference"``, or ``"cpu_native"`` (raises :class:`KernelUnavailable` where it cannot run).
    ``precision`` applies to the reference products.
    """
    items = [(x, w, ids) for x, w, ids in items]
    return OP(items, implementation=implementation, placement=placement, precision=precision)
