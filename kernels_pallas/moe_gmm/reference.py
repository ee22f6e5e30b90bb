"""MoE expert matmuls in plain jnp: the oracle for the grouped-matmul kernels and what training differentiates
(``implementation="reference"``). On CPU the automatic choice of ``gmm`` is the tuned form of
:mod:`kernels_pallas.moe_gmm.xla_cpu`; ``gather_matmul`` and ``dense_experts`` here are CPU paths too.

Weights are ``[E, J, I]`` (checkpoint layout ``[out, in]`` per expert), either a float array or a packed weight
(:mod:`kernels_pallas.packed`: MXFP4, int8, int4, NF4) that is decoded here (the kernels decode per tile instead).
"float32" results: float64 with a float64 compute dtype (:func:`kernels_pallas._common.acc_dtype`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import packed
from kernels_pallas._common import acc_dtype


def expert(w_EJI, e, dt):
    """Expert ``e``'s weight ``[J, I]`` in ``dt`` (a packed expert, MXFP4 or an integer format, is decoded here,
    only this one)."""
    if packed.is_packed(w_EJI):
        return packed.as_dense(type(w_EJI)(*(f[e] for f in w_EJI)), dt)
    return w_EJI[e].astype(dt)


def gmm(x_MI, w_EJI, group_sizes_E, *, compute_dtype=None):
    """Grouped matmul: rows of ``x`` are sorted by expert, ``group_sizes[e]`` rows use expert ``e``.

    Rows past ``sum(group_sizes)`` produce zeros. Returns ``[M, J]`` float32.

    ``lax.ragged_dot`` on the whole weight (a packed one decoded first), so it differentiates (training runs it).
    XLA:CPU expands it into a dense product with every expert (15x slower for 16 experts at 1024 rows): the
    automatic choice there is :func:`kernels_pallas.moe_gmm.xla_cpu.gmm`.
    """
    dt = compute_dtype or x_MI.dtype
    w_EIJ = jnp.swapaxes(packed.as_dense(w_EJI, dt), 1, 2)
    y = jax.lax.ragged_dot(x_MI.astype(dt), w_EIJ, group_sizes_E.astype(jnp.int32),
                           preferred_element_type=acc_dtype(dt))
    # the contract, whatever a backend's ragged_dot leaves in rows that belong to no group
    used = jnp.arange(x_MI.shape[0]) < jnp.sum(group_sizes_E)
    return jnp.where(used[:, None], y, 0.0)


def gather_matmul(x_NXI, w_EJI, idx_NX, *, compute_dtype=None, unroll_slots=16):
    """Decode-shaped expert matmul: token n's slot x uses expert ``idx[n, x]``. Returns ``[N, X, J]`` f32.

    Only the chosen experts' weights are read (and, for MXFP4, decoded): at small batch this is the
    bandwidth-optimal form. Each of the N*X slots is one matrix-vector product with its expert's weight; gathering
    the weights into one ``[N, X, J, I]`` array first would copy them (2x slower on XLA:CPU). Up to
    ``unroll_slots`` slots are written out as independent products, which XLA:CPU may run concurrently and without
    loop bookkeeping (batch-1 decode of the benchmark model, in-process A/B of 9 runs each: median 30.3 vs 31.2 ms
    per step; one profiled run 27.9 vs 31.8); more slots run in a loop, so the program stays small.
    """
    dt = compute_dtype or x_NXI.dtype
    N, X, I = x_NXI.shape
    xs = x_NXI.reshape(N * X, I).astype(dt)
    ids = idx_NX.reshape(N * X)
    product = lambda m: jnp.dot(expert(w_EJI, ids[m], dt), xs[m], preferred_element_type=acc_dtype(dt))
    if N * X <= unroll_slots:
        return jnp.stack([product(m) for m in range(N * X)]).reshape(N, X, -1)
    out = jax.lax.fori_loop(0, N * X, lambda m, out: out.at[m].set(product(m)),
                            jnp.zeros((N * X, w_EJI.shape[1]), acc_dtype(dt)))
    return out.reshape(N, X, -1)


def dense_experts(z_NL, w1_EFL, w3_EFL, w2_ELF, *, act, compute_dtype=None, precision=None):
    """Every expert on every token: ``[E, N, L]`` float32 (the caller picks each token's experts out of it).

    ``act(a, b)`` is the GLU on the two up projections (float32 in, compute dtype out)."""
    dt = compute_dtype or z_NL.dtype
    mm = lambda spec, a, b: jnp.einsum(spec, a.astype(dt), b.astype(dt), preferred_element_type=acc_dtype(dt),
                                       precision=precision)
    h = act(mm("nl,efl->enf", z_NL, w1_EFL), mm("nl,efl->enf", z_NL, w3_EFL))  # [E, N, F]
    return mm("enf,elf->enl", h, w2_ELF)
