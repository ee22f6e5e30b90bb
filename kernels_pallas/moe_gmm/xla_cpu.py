"""Expert matmuls in the forms XLA:CPU runs fastest (``implementation="xla_cpu"``, the automatic choice on CPU):
same contracts as :mod:`kernels_pallas.moe_gmm.reference`, the same float32 sums in other shapes.

``gmm``: XLA:CPU expands the reference's ``lax.ragged_dot`` into a dense product with every expert (15x slower for
16 experts at 1024 rows). Here each expert's weight is read once, by a capacity-batched product and a loop over row
tiles whose bounds are traced: fast forward, but reverse-mode differentiation cannot run it (training takes the
reference).

``dense_experts`` for a handful of tokens runs the products weight rows first (``W @ z^T``), which XLA:CPU
computes 2-3x faster than ``z @ W^T`` for a few rows (``kernels_pallas/matvec/xla_cpu.py``), with the down
projection batched over experts in the same orientation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import packed
from kernels_pallas._common import acc_dtype
from kernels_pallas.matvec.xla_cpu import skinny, w_xT
from kernels_pallas.moe_gmm import reference

_F32 = jnp.float32


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
        y = jnp.einsum("mi,ji->mj", jax.lax.dynamic_slice_in_dim(xp, r0, tile), reference.expert(w_EJI, e, dt),
                       preferred_element_type=acc_dtype(dt))
        keep = (r0 + jnp.arange(tile) < ends[e])[:, None]  # rows past the group belong to the next one
        cur = jax.lax.dynamic_slice_in_dim(out, r0, tile)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep, y, cur), r0, 0)

    return jax.lax.fori_loop(0, tile_end[-1], body, out)


def gmm(x_MI, w_EJI, group_sizes_E, *, compute_dtype=None, tile=32, capacity=None):
    """:func:`kernels_pallas.moe_gmm.reference.gmm` with each expert read once. For float weights, the first
    ``capacity`` rows of every group (default 1.25x the mean group, so usually all of them) go through one batched
    ``[E, cap, I] x [E, J, I]`` product; the rows past it, and packed weights (decoded one expert at a time), go
    through a loop over row tiles of ``tile``. Exact either way: nothing is dropped. Returns ``[M, J]`` float32."""
    dt = compute_dtype or x_MI.dtype
    M, I = x_MI.shape
    E, J = group_sizes_E.shape[0], w_EJI.shape[1]
    sizes = group_sizes_E.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    xp = jnp.concatenate([x_MI.astype(dt), jnp.zeros((tile, I), dt)])  # a tile may run past row M
    out = jnp.zeros((M + tile, J), acc_dtype(dt))
    cap = capacity or -(-(5 * M) // (4 * E) // 8) * 8 or 8
    take = jnp.zeros_like(sizes)
    if not packed.is_packed(w_EJI) and E * cap <= 2 * M:
        take = jnp.minimum(sizes, cap)
        rows = starts[:, None] + jnp.arange(cap)[None]  # [E, cap]
        valid = jnp.arange(cap)[None] < take[:, None]
        xe = jnp.where(valid[..., None], xp[jnp.where(valid, rows, M)], 0)
        ye = jnp.einsum("emi,eji->emj", xe, w_EJI.astype(dt), preferred_element_type=acc_dtype(dt))
        out = out.at[jnp.where(valid, rows, M + tile)].set(ye, mode="drop")
    return _tile_loop(out, xp, w_EJI, starts + take, sizes - take, tile, dt)[:M]


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
