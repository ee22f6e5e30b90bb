"""MoE expert matmuls with bf16/f32 or MXFP4-packed weights.

``gmm(x [M, K], w [E, N, K], group_sizes [E])`` for expert-sorted rows (prefill-shaped) and
``gather_matmul(x [N, X, K], w [E, N_out, K], idx [N, X])`` for few tokens (decode-shaped). Both return float32.
``w`` is a float array or a :class:`kernels_pallas.mxfp4.MXFP4Weight` (kept packed; the kernels decode per tile).

``gather_matmul`` has a third implementation, ``"cpu_native"`` (:mod:`kernels_pallas.matvec`): on XLA:CPU with float32
weights it reads the chosen experts in place, where the reference copies each one out of the stacked array first
(batch-1 decode of the benchmark model spent about a fifth of its step on those copies). It is the automatic choice
there when it builds (``kernels_pallas/_native.py``); ``implementation="reference"`` keeps the plain-jnp path.
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas import matvec
from kernels_pallas._dispatch import INTERPRET, NATIVE, PALLAS, KernelUnavailable, pallas_platform, resolve, \
    target_platform
from kernels_pallas.matvec import native
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


def native_gather_ready() -> bool:
    """Whether the automatic choice of :func:`gather_matmul` for float32 operands is the native kernel here (on
    CPU, built, not turned off). Builds it on first use."""
    return matvec.native_ready()


def _native_item(x, w, idx, compute_dtype):
    """(the (x, w, ids) item of the native grouped product, why it cannot run or None)."""
    if jnp.dtype(compute_dtype or x.dtype) != jnp.float32:
        return None, f"{jnp.dtype(compute_dtype or x.dtype).name} compute (the native kernel runs float32)"
    item = (x.reshape(-1, x.shape[-1]).astype(jnp.float32), w, idx.reshape(-1))
    return item, native.unsupported([item])


def gather_matmul(x, w, idx, *, compute_dtype=None, implementation=None):
    if implementation == NATIVE or (implementation is None and target_platform() == "cpu"):
        if target_platform() != "cpu":
            raise KernelUnavailable(f"moe_gather_matmul: implementation={NATIVE!r} runs on CPU only, "
                                    f"not on {target_platform()!r}")
        item, why = _native_item(x, w, idx, compute_dtype)
        if implementation == NATIVE and why is not None:
            raise KernelUnavailable(f"moe_gather_matmul: {why}")
        if why is None and (implementation == NATIVE or native_gather_ready()):
            return native.group([item])[0].reshape(*x.shape[:2], -1)
    impl = resolve("moe_gather_matmul", implementation, _GATHER, accelerated=(PALLAS,))
    return _GATHER[impl](x, w, idx, compute_dtype=compute_dtype, **_kernel_kw(impl))
