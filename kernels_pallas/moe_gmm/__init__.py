"""Expert matmuls: ``gmm(x [M, I], w [E, J, I], group_sizes [E]) -> [M, J]`` for expert-sorted rows (prefill) and
``gather_matmul(x [N, X, I], w [E, J, I], idx [N, X]) -> [N, X, J]`` for few tokens (decode), float32 results;
``dense_experts`` runs every expert on every token. ``w`` is a float array or a packed weight (MXFP4 in the Pallas
kernels, which decode per tile; the integer formats of :mod:`kernels_pallas.quant` too in the reference and the CPU
gather). How a layer's routed experts combine these is :mod:`kernels_pallas.experts`.

CPU forms: ``gmm``'s ``"xla_cpu"`` (the reference ``lax.ragged_dot`` runs on XLA:CPU as a dense product with every
expert; the tuned form reads each expert once but loops with traced bounds, which reverse mode cannot differentiate,
so training runs the reference); ``gather_matmul``'s ``"cpu_native"`` (reads the chosen experts in place, where the
reference copies each one out of the stack first). Given a placement, ``gmm`` runs whole on every device (its rows
are sorted over all tokens) and ``gather_matmul`` splits tokens over ``batch``.
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas import packed
from kernels_pallas._dispatch import (
    NATIVE,
    PALLAS,
    REFERENCE,
    XLA_CPU,
    CpuImpl,
    Op,
    Rule,
)
from kernels_pallas.matvec import native
from kernels_pallas.moe_gmm import pallas, reference, xla_cpu

GMM_RULE = Rule(args=("MI", "EJI", "E"), out="MJ")
GATHER_RULE = Rule(args=("NXI", "EJI", "NX"), out="NXJ", split=(("N", "batch"),))


def _native_item(x, w, idx, compute_dtype):
    """(the (x, w, ids) item of the native grouped product, why it cannot run or None)."""
    dt = jnp.dtype(compute_dtype or x.dtype)
    if dt not in native.SYMBOLS:
        return None, f"{dt.name} compute (the native kernel runs float32 or bfloat16)"
    if not packed.is_packed(w) and jnp.dtype(w.dtype) != dt:
        return None, f"{jnp.dtype(w.dtype).name} experts with {dt.name} compute (the reference rounds them first)"
    # x rounded to the compute dtype as the reference does, then widened (exactly) for the kernel
    item = (x.reshape(-1, x.shape[-1]).astype(dt).astype(jnp.float32), w, idx.reshape(-1))
    return item, native.unsupported([item])


def _native_gather_unsupported(x, w, idx, *, compute_dtype=None):
    return _native_item(x, w, idx, compute_dtype)[1]


def _native_gather(x, w, idx, *, compute_dtype=None):
    item, _ = _native_item(x, w, idx, compute_dtype)
    return native.group([item])[0].reshape(*x.shape[:2], -1)


GMM = Op("moe_gmm", GMM_RULE, {REFERENCE: reference.gmm, PALLAS: pallas.gmm},
         cpu=(CpuImpl(XLA_CPU, xla_cpu.gmm),))
GATHER = Op("moe_gather_matmul", GATHER_RULE, {REFERENCE: reference.gather_matmul, PALLAS: pallas.gather_matmul},
            cpu=(CpuImpl(NATIVE, _native_gather, ready=native.KERNEL.ready, unsupported=_native_gather_unsupported),))


def gmm(x, w, group_sizes, *, compute_dtype=None, implementation=None, placement=None):
    return GMM(x, w, group_sizes, compute_dtype=compute_dtype, implementation=implementation, placement=placement)


def gather_matmul(x, w, idx, *, compute_dtype=None, implementation=None, placement=None):
    return GATHER(x, w, idx, compute_dtype=compute_dtype, implementation=implementation, placement=placement)


def _float32_weights(z, w1, w3, w2, *, compute_dtype=None, **_):
    dts = {jnp.dtype(compute_dtype or z.dtype), *(jnp.dtype(getattr(w, "dtype", jnp.uint8)) for w in (w1, w3, w2))}
    return None if dts == {jnp.dtype(jnp.float32)} else "operands other than float32"


DENSE = Op("moe_dense_experts", None, {REFERENCE: reference.dense_experts}, plain=True,
           cpu=(CpuImpl(XLA_CPU, xla_cpu.dense_experts, unsupported=_float32_weights),))


def dense_experts(z, w1, w3, w2, *, act, compute_dtype=None, precision=None, implementation=None, placement=None):
    """Every expert on every token (float expert weights): ``[E, N, L]`` float32. ``act(a, b)``: the GLU."""
    return DENSE(z, w1, w3, w2, act=act, compute_dtype=compute_dtype, precision=precision,
                 implementation=implementation, placement=placement)
