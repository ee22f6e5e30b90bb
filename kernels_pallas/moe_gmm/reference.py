"""MoE expert matmuls in plain jnp: the oracle for the grouped-matmul kernels and the CPU path.

Weights are ``[E, J, I]`` (checkpoint layout ``[out, in]`` per expert), either a float array or a packed weight
(:mod:`kernels_pallas.packed`: MXFP4, int8, int4, NF4) that is decoded here (the kernels decode per tile instead).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import packed

_F32 = jnp.float32


def _expert(w_EJI, e, dt):
    """Expert ``e``'s weight ``[J, I]`` in ``dt`` (a packed expert, MXFP4 or an integer format, is decoded here,
    only this one)."""
    if packed.is_packed(w_EJI):
        return packed.as_dense(type(w_EJI)(*(f[e] for f in w_EJI)), dt)
    return w_EJI[e].astype(dt)


def _tile_loop(out, xp, w_EJI, starts_E, counts_E, tile, dt):
    """Rows ``starts[e] .. starts[e] + counts[e]`` of ``xp`` times expert ``e``, written into ``out``: the
    rows are cut into tiles of ``tile`` and one loop runs over the tiles in use."""
    E = starts_E.shape[0]
    ends = starts_E + counts_E
    tiles = (counts_E + tile - 1) // tile
    tile_end = jnp.cumsum(tiles)  # tiles of groups 0..e

    def body(t, out):
        e = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), E - 1)
        r0 = starts_E[e] + (t - (tile_end[e] - tiles[e])) * tile
        y = jnp.einsum("mi,ji->mj", jax.lax.dynamic_slice_in_dim(xp, r0, tile), _expert(w_EJI, e, dt),
                       preferred_element_type=_F32)
        keep = (r0 + jnp.arange(tile) < ends[e])[:, None]  # rows past the group belong to the next one
        cur = jax.lax.dynamic_slice_in_dim(out, r0, tile)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep, y, cur), r0, 0)

    return jax.lax.fori_loop(0, tile_end[-1], body, out)


def gmm(x_MI, w_EJI, group_sizes_E, *, compute_dtype=None, tile=32, capacity=None):
    """Grouped matmul: rows of ``x`` are sorted by expert, ``group_sizes[e]`` rows use expert ``e``.

    Rows past ``sum(group_sizes)`` produce zeros. Returns ``[M, J]`` float32.

    ``lax.ragged_dot`` is this product, but XLA:CPU expands it into a dense product with every expert (15x
    slower for 16 experts at 1024 rows). Here, for float weights, the first ``capacity`` rows of every group
    (default 1.25x the mean group, so usually all of them) go through one batched ``[E, cap, I] x [E, J, I]``
    product that reads each expert once; the rows past it, and MXFP4 weights (decoded one expert at a time),
    go through a loop over row tiles of ``tile``. Exact either way: nothing is dropped.
    """
    dt = compute_dtype or x_MI.dtype
    M, I = x_MI.shape
    E, J = group_sizes_E.shape[0], w_EJI.shape[1]
    sizes = group_sizes_E.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    xp = jnp.concatenate([x_MI.astype(dt), jnp.zeros((tile, I), dt)])  # a tile may run past row M
    out = jnp.zeros((M + tile, J), _F32)
    cap = capacity or -(-(5 * M) // (4 * E) // 8) * 8 or 8
    take = jnp.zeros_like(sizes)
    if not packed.is_packed(w_EJI) and E * cap <= 2 * M:
        take = jnp.minimum(sizes, cap)
        rows = starts[:, None] + jnp.arange(cap)[None]  # [E, cap]
        valid = jnp.arange(cap)[None] < take[:, None]
        xe = jnp.where(valid[..., None], xp[jnp.where(valid, rows, M)], 0)
        ye = jnp.einsum("emi,eji->emj", xe, w_EJI.astype(dt), preferred_element_type=_F32)
        out = out.at[jnp.where(valid, rows, M + tile)].set(ye, mode="drop")
    return _tile_loop(out, xp, w_EJI, starts + take, sizes - take, tile, dt)[:M]


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
    product = lambda m: jnp.dot(_expert(w_EJI, ids[m], dt), xs[m], preferred_element_type=_F32)
    if N * X <= unroll_slots:
        return jnp.stack([product(m) for m in range(N * X)]).reshape(N, X, -1)
    out = jax.lax.fori_loop(0, N * X, lambda m, out: out.at[m].set(product(m)),
                            jnp.zeros((N * X, w_EJI.shape[1]), _F32))
    return out.reshape(N, X, -1)


def dense_experts(z_NL, w1_EFL, w3_EFL, w2_ELF, *, act, compute_dtype=None, precision=None):
    """Every expert on every token: ``[E, N, L]`` float32 (the caller picks each token's experts out of it).

    ``act(a, b)`` is the GLU on the two up projections (float32 in, compute dtype out)."""
    dt = compute_dtype or z_NL.dtype
    mm = lambda spec, a, b: jnp.einsum(spec, a.astype(dt), b.astype(dt), preferred_element_type=_F32,
                                       precision=precision)
    h = act(mm("nl,efl->enf", z_NL, w1_EFL), mm("nl,efl->enf", z_NL, w3_EFL))  # [E, N, F]
    return mm("enf,elf->enl", h, w2_ELF)
