"""MoE expert matmuls with bf16/f32 or MXFP4-packed weights.

``gmm(x [M, K], w [E, N, K], group_sizes [E])`` for expert-sorted rows (prefill-shaped) and
``gather_matmul(x [N, X, K], w [E, N_out, K], idx [N, X])`` for few tokens (decode-shaped). Both return float32.
"""

from __future__ import annotations

from kernels_pallas._dispatch import resolve
from kernels_pallas.moe_gmm import reference

_GMM = {"reference": reference.gmm}
_GATHER = {"reference": reference.gather_matmul}


def gmm(x, w, group_sizes, *, compute_dtype=None, implementation=None):
    impl = resolve("moe_gmm", implementation, _GMM, accelerated=("pallas",))
    return _GMM[impl](x, w, group_sizes, compute_dtype=compute_dtype)


def gather_matmul(x, w, idx, *, compute_dtype=None, implementation=None):
    impl = resolve("moe_gather_matmul", implementation, _GATHER, accelerated=("pallas",))
    return _GATHER[impl](x, w, idx, compute_dtype=compute_dtype)
