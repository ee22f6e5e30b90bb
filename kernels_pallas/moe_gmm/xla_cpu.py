"""Expert matmuls in the forms XLA:CPU runs fastest (``implementation="xla_cpu"``): same contracts as
:mod:`kernels_pallas.moe_gmm.reference`, the same float32 sums in another orientation.

``dense_experts`` for a handful of tokens runs the products weight rows first (``W @ z^T``), which XLA:CPU
computes 2-3x faster than ``z @ W^T`` for a few rows (``kernels_pallas/matvec/xla_cpu.py``), with the down
projection batched over experts in the same orientation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.matvec.xla_cpu import skinny, w_xT
from kernels_pallas.moe_gmm import reference

_F32 = jnp.float32


def dense_experts(z_NL, w1_EFL, w3_EFL, w2_ELF, *, act, compute_dtype=None, precision=None):
    N = z_NL.shape[0]
    if not skinny(N):
        return reference.dense_experts(z_NL, w1_EFL, w3_EFL, w2_ELF, act=act, compute_dtype=compute_dtype,
                                       precision=precision)
    E, F, L = w1_EFL.shape
    z = z_NL.astype(_F32)
    up = lambda w: w_xT(w.astype(_F32).reshape(E * F, L), z, precision).reshape(E, F, N)
    h = act(up(w1_EFL), up(w3_EFL))  # [E, F, N]
    y = jax.lax.optimization_barrier(jnp.einsum("elf,enf->eln", w2_ELF.astype(_F32), jnp.swapaxes(h, 1, 2).astype(_F32),
                                                preferred_element_type=_F32, precision=precision))  # [E, L, N]
    return jnp.swapaxes(y, 1, 2)  # [E, N, L]
