"""MoE expert matmuls with bf16/f32 or MXFP4-packed weights.

``gmm(x [M, K], w [E, N, K], group_sizes [E])`` for expert-sorted rows (prefill-shaped) and
``gather_matmul(x [N, X, K], w [E, N_out, K], idx [N, X])`` for few tokens (decode-shaped). Both return float32.
``w`` is a float array or a :class:`kernels_pallas.mxfp4.MXFP4Weight` (kept packed; the kernels decode per tile).

``gather_matmul`` has a third implementation, ``"cpu_native"`` (:mod:`kernels_pallas.matvec`): on XLA:CPU with float32
weights it reads the chosen experts in place, where the reference copies each one out of the stacked array first
(batch-1 decode of the benchmark model spent about a fifth of its step on those copies). It is the automatic choice
there when it builds (``kernels_pallas/_native.py``); ``implementation="reference"`` keeps the plain-jnp path.

On a mesh: expert parallelism (``kimi_jax/expert_parallel.py``) runs these inside its own ``shard_map`` on each
device's local experts, with no placement. Given a placement, ``gmm`` runs whole on every device (its rows
are sorted over all tokens) and ``gather_matmul`` splits tokens over ``batch`` with every expert on each device.
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas import matvec
from kernels_pallas._dispatch import PALLAS, REFERENCE, Native, Op, Rule
from kernels_pallas.matvec import native
from kernels_pallas.moe_gmm import pallas, reference

GMM_RULE = Rule(args=("MK", "ENK", "E"), out="MN")
GATHER_RULE = Rule(args=("NXK", "ENK", "NX"), out="NXO", split=(("N", "batch"),))


def _native_item(x, w, idx, compute_dtype):
    """(the (x, w, ids) item of the native grouped product, why it cannot run or None)."""
    if jnp.dtype(compute_dtype or x.dtype) != jnp.float32:
        return None, f"{jnp.dtype(compute_dtype or x.dtype).name} compute (the native kernel runs float32)"
    item = (x.reshape(-1, x.shape[-1]).astype(jnp.float32), w, idx.reshape(-1))
    return item, native.unsupported([item])


def _native_gather(x, w, idx, *, compute_dtype=None):
    item, _ = _native_item(x, w, idx, compute_dtype)
    return native.group([item])[0].reshape(*x.shape[:2], -1)


GMM = Op("moe_gmm", GMM_RULE, {REFERENCE: reference.gmm, PALLAS: pallas.gmm})
GATHER = Op("moe_gather_matmul", GATHER_RULE, {REFERENCE: reference.gather_matmul, PALLAS: pallas.gather_matmul},
            native=Native(_native_gather, unsupported=lambda x, w, idx, *, compute_dtype=None:
                          _native_item(x, w, idx, compute_dtype)[1], ready=matvec.native_built))


def gmm(x, w, group_sizes, *, compute_dtype=None, implementation=None, placement=None):
    return GMM(x, w, group_sizes, compute_dtype=compute_dtype, implementation=implementation, placement=placement)


def native_gather_ready() -> bool:
    """Whether the automatic choice of :func:`gather_matmul` for float32 operands is the native kernel here (on
    CPU, built, not turned off). Builds it on first use."""
    return matvec.native_ready()


def gather_matmul(x, w, idx, *, compute_dtype=None, implementation=None, placement=None):
    return GATHER(x, w, idx, compute_dtype=compute_dtype, implementation=implementation, placement=placement)
