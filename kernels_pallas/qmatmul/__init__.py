"""Matmul with a weight-only integer weight: ``matmul(x [M, I], w) -> [M, J]`` float32, ``x @ dequantize(w)^T``.

``w`` is one of :data:`kernels_pallas.quant.TYPES` (logical ``[J, I]``, checkpoint layout ``[out, in]``): int8 with
a scale per row, int4 with a scale per group of input columns (symmetric or with a zero point), or NF4. It stays
packed in memory; the Pallas kernels decode it tile by tile next to the multiply (``pallas.py``) and never write a
dense copy. ``x`` is bfloat16 or float32: the dtype of the products, summed in float32.

Implementations: ``"reference"`` (``reference.py``: the whole weight decoded to float32, one full-precision
product; the oracle and the CPU path), ``"pallas"`` (TPU: Mosaic, an (M, J, I) grid with a VMEM accumulator; GPU:
Triton, an (M, J) grid with the I blocks looped inside) and ``"pallas_interpret"`` (the GPU kernel's source run by
Pallas's interpreter). Rows that do not fill a row tile are padded by the kernel's wrapper, outside the kernel.

No partition rule yet: on a mesh the caller runs it inside its own ``shard_map`` (Mosaic refuses to be partitioned
by GSPMD; Triton would be given whole operands). Rows split freely; splitting J would need the weight's rows split
the same way, and splitting I a reduction, so a rule waits for the model's sharding of quantized projections.
"""

from __future__ import annotations

from kernels_pallas._dispatch import PALLAS, REFERENCE, Op
from kernels_pallas.qmatmul import pallas, reference

# groups the GPU kernel cannot block (not a power of two): the automatic choice runs the reference, an explicit
# request raises
OP = Op("qmatmul", None, {REFERENCE: reference.matmul, PALLAS: pallas.matmul},
        pallas_unsupported=lambda platform, x, w, **_: pallas.unsupported(platform, w))


def matmul(x, w, *, implementation=None, placement=None):
    """``x [M, I] @ dequantize(w)^T`` -> ``[M, J]`` float32 (see the module docstring). ``implementation``: None
    (automatic: the Pallas kernel on TPU/GPU, the reference on CPU), ``"reference"``, ``"pallas"`` or
    ``"pallas_interpret"``; an explicit one that cannot run raises :class:`kernels_pallas.KernelUnavailable`."""
    return OP(x, w, implementation=implementation, placement=placement)
