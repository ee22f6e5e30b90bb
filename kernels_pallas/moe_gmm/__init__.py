"""MoE expert matmuls with bf16/f32 or MXFP4-packed weights.

``gmm(x [M, K], w [E, N, K], group_sizes [E])`` for expert-sorted rows (prefill-shaped) and
``gather_matmul(x [N, X, K], w [E, N_out, K], idx [N, X])`` for few tokens (decode-shaped). Both return float32.
``w`` is a float array or a :class:`kernels_pallas.mxfp4.MXFP4Weight` (kept packed; the kernels decode per tile).
"""

from __future__ import annotations

from kernels_pallas._dispatch import INTERPRET, PALLAS, pallas_platform, resolve
from kernels_pallas.moe_gmm import pallas, reference

_GMM = {"reference": reference.gmm, PALLAS: pallas.gmm, INTERPRET: pallas.gmm}
_GATHER = {"reference": reference.gather_matmul, PALLAS: pallas.gather_matmul, INTERPRET: pallas.gather_matmul}


def _kernel_kw(impl):
    if impl not in (PALLAS, INTERPRET):
        return {}
    platform, interpret = pallas_platform(impl)
    return dict(platform=platform, interpret=interpret)


def gmm(x, w, group_sizes, *, compute_dtype=None, implementation=None):
    impl = resolve("moe_gmm", implementation, _GMM, accelerated=(PALLAS,))
    return _GMM[impl](x, w, group_sizes, compute_dtype=compute_dtype, **_kernel_kw(impl))


def gather_matmul(x, w, idx, *, compute_dtype=None, implementation=None):
    impl = resolve("moe_gather_matmul", implementation, _GATHER, accelerated=(PALLAS,))
    return _GATHER[impl](x, w, idx, compute_dtype=compute_dtype, **_kernel_kw(impl))
