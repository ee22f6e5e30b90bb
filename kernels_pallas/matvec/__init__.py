"""Decode-shaped products: ``group([(x, w, ids), ...])`` (several products per call) and ``per_head`` (absorbed
MLA's per-head products).

Each item of a group is ``x [M, I]`` with ``w [J, I]`` (a plain weight, checkpoint layout ``[out, in]``) and
``ids=None``, or ``w [E, J, I]`` (an expert stack) with ``ids [M]`` choosing a matrix per row:
``out[m] = w[ids[m]] @ x[m]``. ``w`` is a float array or a packed weight (:mod:`kernels_pallas.packed`). Each
result is ``[M, J]`` float32, accumulated in float32 from the operands' dtype (a packed weight's decoded values).

Implementations: ``"reference"`` (each item a plain-jnp product, a packed weight decoded first); ``"pallas"`` (the
plain integer-weight items through :mod:`kernels_pallas.qmatmul`'s kernel, which decodes per tile; the others as
the reference); on CPU ``"cpu_native"`` (``native.cc``: every item of a call streamed as one piece of work over
the threads, weights read in place, integer codes decoded in registers) and ``"xla_cpu"`` (float32 few-row
products written weight first, the form XLA:CPU runs fastest). When the automatic choice takes the native kernel
is :func:`_native_automatic`. No partition rule: on a mesh of several devices the products are plain XLA that
GSPMD partitions (the weights' own shardings decide).
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas import packed, qmatmul, quant
from kernels_pallas._dispatch import INTERPRET, NATIVE, PALLAS, REFERENCE, XLA_CPU, CpuImpl, Op
from kernels_pallas.matvec import native, reference, xla_cpu

_F32 = jnp.float32
# Packed plain items up to this many rows run natively (expert stacks at any: their callers gather a few
# pairs, experts.GATHER_PAIRS): every 5 rows decode the weight's blocks again (from cache), where
# the reference decodes the whole weight once and then multiplies. Measured at [4096, 1024] (int8, int4 g32, nf4 g64):
# native 1.4-3.5x faster at 16 rows, even to 1.5x slower at 32; at [32000, 1024] 3-7x faster at 16 rows (both when
# each row decoded alone; up to 5 rows of one matrix now share the decoded blocks: the benchmark model's products
# in int4 g32, 7.4 -> 5.4 ms at 5 rows, 11.7 -> 7.2 at 8, 1.7 at 1; XLA's 79-87).
PACKED_ROWS = 16
# Rows of x that use one matrix share each read of a weight block, up to this many at a time (native.cc's kShared:
# a verify step's k + 1 = 5 positions at batch 1). Same-bit rows: a row's result does not depend on the rows it
# shares the call with, so a verify step's products equal the one-position steps' bit for bit.
SHARED_ROWS = 5
# Plain bfloat16 items up to this many rows run natively (blocks of SHARED_ROWS rows each read the weight once),
# float32 ones up to SHARED_ROWS. The benchmark model's decode products (12 x [3072|1024|1536, 1024] and the
# [32000, 1024] head, ms per chain, native / XLA): bfloat16 3.3 / 72 at 1 row, 5.0 / 7.3 at 4, 5.5-6.1 / 7.9-8.3 at 5,
# 6.1 / 8.0 at 6, 8.6 / 8.7 at 8, 9.9 / 9.0 at 10; float32 6.6 / 6.3 at 1, 8.2 / 12.9 at 4, 9.0 / 13.4 at 5. One
# float32 product alone too (the lm_head, the output projections): [32000, 1024] 3.9 / 5.3 ms at 1 row, 4.6 / 5.2 at
# 4; [1024, 1024] 26 / 52 us at 1 row, 58 / 95 at 4. Past 5 rows XLA's bfloat16 products, each faster alone on
# cache-resident weights (the demo's KDA layer: 43 against 63 us for its six products at 8 rows), cost more in a
# whole forward than they save (each converts its weight on every call): a verify forward over 9 positions (k = 8)
# with them native (``python benchmarks/verify_cost.py --compare 5,16``, results/verify_cost.json: 20 forwards in a
# loop, medians of 15 alternated with the old rule, 5 rows and experts sorted past their count), bfloat16: the demo
# 6.6 -> 2.6 ms, the benchmark model 50.7 -> 30.4 ms (with experts.GATHER_PAIRS); at 1 and 5 positions unchanged
# (0.62 / 0.63 and 1.74 / 1.73 ms; 9.4 / 9.1 and 19.1 / 19.3), batch-8 decode within noise (an earlier run: the demo
# 3.27 -> 2.67, the benchmark model 35.5 / 37.0). Float32 stays at 5: 8 rows native made the benchmark model's
# batch-8 decode 42.3 -> 46.2 ms.
PLAIN_ROWS = 16


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
        return all(ids is not None or x.shape[0] <= PACKED_ROWS for x, _, ids in items)
    rows = lambda w: SHARED_ROWS if jnp.dtype(w.dtype) == _F32 else PLAIN_ROWS  # noqa: E731
    return all(ids is not None or x.shape[0] <= rows(w) for x, w, ids in items)


def _group_pallas(items, *, precision=None, platform=None, interpret=False):
    """The plain integer-weight items through the Pallas matmul that decodes them per tile (:mod:`kernels_pallas.qmatmul`;
    an expert stack has no kernel yet), the others as the reference (XLA's products)."""
    mine = [i for i, (_, w, ids) in enumerate(items) if ids is None and isinstance(w, quant.TYPES)]
    rest = [i for i in range(len(items)) if i not in mine]
    out = dict(zip(rest, reference.group([items[i] for i in rest], precision=precision) if rest else []))
    for i in mine:
        out[i] = qmatmul.matmul(items[i][0], items[i][1], implementation=INTERPRET if interpret else PALLAS)
    return [out[i] for i in range(len(items))]


GROUP = Op("matvec", None, {REFERENCE: reference.group, PALLAS: _group_pallas}, plain=True, cpu=(
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

    ``implementation``: None (automatic, see the module docstring) or one of the op's names
    (:class:`KernelUnavailable` where it cannot run). ``precision`` applies to the XLA products.
    """
    return GROUP([(x, w, ids) for x, w, ids in items], implementation=implementation, placement=placement,
                 precision=precision)


def per_head(x_BTHI, w, *, transpose_w: bool, implementation=None, precision=None, placement=None):
    """``x_h @ w_h`` per head (``w [H, I, J]``), or ``x_h @ w_h.T`` with ``transpose_w`` (``w [H, J, I]``) ->
    ``[B, T, H, J]`` float32."""
    return PER_HEAD(x_BTHI, w, transpose_w=transpose_w, implementation=implementation, precision=precision,
                    placement=placement)
