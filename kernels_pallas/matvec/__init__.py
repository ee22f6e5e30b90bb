"""Decode-shaped products: ``group([(x, w, ids), ...])`` (several products per call) and ``per_head`` (absorbed
MLA's per-head products).

Each item of a group is ``x [M, I]`` with ``w [J, I]`` (a plain weight, checkpoint layout ``[out, in]``) and
``ids=None``, or ``w [E, J, I]`` (an expert stack) with ``ids [M]`` choosing a matrix per row:
``out[m] = w[ids[m]] @ x[m]``. ``w`` is a float array or a packed weight (:mod:`kernels_pallas.packed`: int8,
int4, int4 with a zero point, NF4 of :mod:`kernels_pallas.quant`; MXFP4). Each result is ``[M, J]`` float32,
accumulated in float32 from the operands' dtype (a packed weight's decoded values).

At a handful of rows (decode) every product streams its weight once, so the step's time is memory bandwidth, and
XLA:CPU leaves some of it unused. Two CPU implementations, the automatic choice on CPU:

* ``"cpu_native"`` (``native.cc``, built on first use by :mod:`kernels_pallas._native`; float32 or bfloat16
  weights, widened in registers, or int8 / int4 / NF4 codes decoded in registers; float32 sums; one weight format
  per call): reads every weight in place (a chosen expert too, where XLA copies it out of its stack first) and
  streams all the items of a call as one piece of work split over the threads (launched one by one, XLA:CPU's
  products of 0.5-1 MB ran at about half the rate of the large ones). Float weights: chosen when every plain item
  has one row (grouping at 8 rows gained nothing) and the call holds several items or an expert item (a single
  plain product streams as fast under XLA: measured on the output projections and the lm_head). Packed weights:
  chosen whenever every item has at most :data:`PACKED_ROWS` rows (the plain alternative decodes the whole weight
  to a dense copy first). The native products of a packed weight are those of its exactly decoded float32 values
  (with bfloat16 inputs the reference rounds the decoded weight to bfloat16 first, the kernel does not).
* ``"xla_cpu"`` (``xla_cpu.py``; float32 array operands, no packed weights): the few-row (2..32) products weight
  first.

Elsewhere, and with ``implementation="reference"``, each item is a plain-jnp product (a packed weight decoded first,
the chosen experts only). No partition rule: on a mesh of several devices the products are plain XLA that GSPMD
partitions (the weights' own shardings decide), and the CPU implementations are not chosen there. Float items have
no Pallas kernel: a run that asks for the Pallas kernels runs the reference for them. A plain integer-weight item
(:mod:`kernels_pallas.quant`) on one TPU / GPU device, or with ``"pallas_interpret"``, runs the Pallas matmul of
:mod:`kernels_pallas.qmatmul`, which decodes the codes per tile (an expert-stack item, and any on a mesh of several
devices, runs the reference).
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas import packed, qmatmul, quant
from kernels_pallas._dispatch import (
    INTERPRET,
    PALLAS,
    NATIVE,
    REFERENCE,
    XLA_CPU,
    CpuImpl,
    Op,
    target_platform,
)
from kernels_pallas.matvec import native, reference, xla_cpu

_F32 = jnp.float32
# Packed items up to this many rows run natively: each row decodes its part of the weight again (from cache), where
# the reference decodes the whole weight once and then multiplies. Measured at [4096, 1024] (int8, int4 g32, nf4 g64):
# native 1.4-3.5x faster at 16 rows, even to 1.5x slower at 32; at [32000, 1024] 3-7x faster at 16 rows.
PACKED_ROWS = 16


def native_ready() -> bool:
    """Whether the automatic choice for float32 items is the native kernel here (on CPU, and it builds)."""
    return target_platform() == "cpu" and native.KERNEL.ready()


def _float32(items) -> str | None:
    for x, w, _ in items:
        if packed.is_packed(w):
            return (f"{packed.format_name(w)} weights (the XLA:CPU forms reorient float32 products; a packed weight "
                    "runs the native kernel or the reference, which decodes it)")
        if jnp.dtype(w.dtype) != _F32 or jnp.dtype(x.dtype) != _F32:
            return "operands other than float32 (XLA:CPU has no fast bf16 x bf16 -> f32 product to reorient)"
    return None


def _native_automatic(items, **_) -> bool:
    if any(packed.is_packed(w) for _, w, _ in items):  # decode-shaped packed items: read the codes in place
        return all(x.shape[0] <= PACKED_ROWS for x, _, _ in items)
    if any(ids is None and x.shape[0] > 1 for x, _, ids in items):  # grouping plain products of 8 rows: no gain
        return False
    # one float32 product streams as fast under XLA (the output projections, the lm_head); one bfloat16 product
    # runs 6-20x slower there at one row (XLA:CPU has no fast one-row bf16 x bf16 -> f32 product; the benchmark
    # model's 32000 x 1024 lm_head: 45 ms against 2.3 ms native, 2026-12-04)
    return len(items) > 1 or items[0][2] is not None or jnp.dtype(items[0][1].dtype) != _F32


# TPU / GPU: the float items run the reference (XLA's products); plain packed items go to the Pallas matmul that
# decodes integer weights per tile (kernels_pallas/qmatmul), see group().
GROUP = Op("matvec", None, {REFERENCE: reference.group}, plain=True, cpu=(
    CpuImpl(NATIVE, lambda items, *, precision=None: native.group(items), ready=native.KERNEL.ready,
            unsupported=lambda items, **_: native.unsupported(items), automatic=_native_automatic),
    CpuImpl(XLA_CPU, xla_cpu.group, unsupported=lambda items, **_: _float32(items),
            automatic=lambda items, **_: any(ids is None and xla_cpu.skinny(x.shape[0]) for x, _, ids in items)),
))
PER_HEAD = Op("matvec_per_head", None, {REFERENCE: reference.per_head}, plain=True,
              cpu=(CpuImpl(XLA_CPU, xla_cpu.per_head),))


def fuses(items, *, implementation=None, placement=None) -> bool:
    """Whether :func:`group` would stream these items as one call (the native kernel): callers that could put
    more products into the same call ask first."""
    return GROUP.choose(implementation, ([(x, w, ids) for x, w, ids in items],), {}, placement) == NATIVE


def group(items, *, implementation=None, precision=None, placement=None):
    """``[w @ x_m (or w[ids[m]] @ x_m) for each item]`` as float32 ``[M, J]`` arrays.

    ``implementation``: None (automatic, see the module docstring), ``"reference"``, ``"xla_cpu"`` or
    ``"cpu_native"`` (these two raise :class:`KernelUnavailable` where they cannot run). ``precision`` applies to
    the XLA products.
    """
    items = [(x, w, ids) for x, w, ids in items]
    if not _qmatmul_here(implementation, placement):
        return GROUP(items, implementation=implementation, placement=placement, precision=precision)
    mine = [i for i, (_, w, ids) in enumerate(items) if ids is None and isinstance(w, quant.TYPES)]
    out = [None] * len(items)
    for i in mine:
        x, w, _ = items[i]
        out[i] = qmatmul.matmul(x, w, implementation=implementation, placement=placement)
    rest = [i for i in range(len(items)) if i not in mine]
    if rest:
        ys = GROUP([items[i] for i in rest], implementation=implementation, placement=placement, precision=precision)
        for i, y in zip(rest, ys):
            out[i] = y
    return out


def _qmatmul_here(implementation, placement) -> bool:
    """Whether plain integer-weight items go to :mod:`kernels_pallas.qmatmul`'s Pallas kernel: on one TPU / GPU
    device (automatically or with ``"pallas"``), or with ``"pallas_interpret"``. On a mesh of several devices they
    run the reference, which GSPMD partitions (the kernel has no partition rule yet)."""
    one_device = placement is None or placement.devices == 1
    if implementation == INTERPRET:
        return one_device
    return implementation in (None, PALLAS) and one_device and target_platform(placement) in ("tpu", "gpu")


def per_head(x_BTHI, w, *, transpose_w: bool, implementation=None, precision=None, placement=None):
    """``x_h @ w_h`` per head (``w [H, I, J]``), or ``x_h @ w_h.T`` with ``transpose_w`` (``w [H, J, I]``) ->
    ``[B, T, H, J]`` float32."""
    return PER_HEAD(x_BTHI, w, transpose_w=transpose_w, implementation=implementation, precision=precision,
                    placement=placement)
