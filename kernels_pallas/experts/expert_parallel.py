"""Expert parallelism: routed experts sharded over mesh axes, (token, expert) pairs sent to the device that owns the
expert and the results sent back.

Inside one ``shard_map`` over the whole mesh, each device holds ``E_loc`` experts (the ``ep`` axes split the expert
dimension) and, with ``tp`` axes, a slice of every local expert's hidden width. Tokens arrive split over the batch
and ``ep`` axes (replicated over ``tp``). Per device:

1. sort its (token, expert) pairs by global expert id: pairs for one destination become contiguous;
2. exchange them over the ``ep`` axes -- ``ragged_all_to_all`` (TPU/GPU: exactly the rows needed) or a
   fixed-capacity ``all_to_all`` of ``[devices, cap, L]`` buffers (CPU, where XLA has no ragged all-to-all);
3. run the local experts as one grouped matmul over the received rows (rows sorted by local expert); with ``tp``
   the down projection's partial sums are ``psum``-ed in float32 before the one rounding, as the single-device
   path rounds once after its float32 accumulation;
4. send the rows back the way they came and unsort to ``[N, X, L]``.

All of it differentiates (training runs it, with the reference grouped matmul ``lax.ragged_dot``): each exchange
transposes into the reverse exchange. Padded token rows (``N`` rounded up to the number of token shards) never
leave their device. Experts that the mesh does not split (too few to divide) still run inside the map, on each
device's tokens with the single-device paths.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kernels_pallas import moe_gmm

_WEIGHTS = ("w1", "w3", "w2")


def _axes(part) -> tuple[str, ...]:
    return () if part is None else ((part,) if isinstance(part, str) else tuple(part))


def routed(z_NL, w, idx_NX, exchange, placement, local, *, ragged: str, act, compute_dtype, precision=None,
           implementation=None):
    """``[N, X, L]`` in ``compute_dtype`` on the placement's mesh. ``exchange``:
    :class:`kernels_pallas.experts.Exchange`; ``ragged``: its dispatch decided for the target; ``local(z, w, idx)``:
    the single-device paths, for experts the mesh leaves whole."""
    mesh = placement.mesh
    first = jax.tree.leaves(exchange.weight_specs["w1"], is_leaf=lambda x: isinstance(x, P))[0]
    ep, tp = _axes(first[0]), _axes(first[1])  # every field splits E and F alike
    sizes = dict(mesh.shape)
    batch = tuple(a for a in placement.mesh_axes("batch") if sizes[a] > 1)
    tok_axes = batch + tuple(a for a in ep if a not in batch)
    shards = math.prod(sizes[a] for a in tok_axes)
    N, X = idx_NX.shape
    Np = -(-N // shards) * shards
    z = jnp.pad(z_NL, ((0, Np - N), (0, 0)))
    idx = jnp.pad(idx_NX, ((0, Np - N), (0, 0)))
    valid = jnp.arange(Np) < N
    weights = {n: w[n] for n in _WEIGHTS}
    tok = P(tok_axes or None)
    kw = dict(act=act, compute_dtype=compute_dtype, implementation=implementation)

    def body(z, idx, valid, w):
        n_loc = idx.shape[0]
        e_loc = w["w1"].shape[0]
        run_local = lambda x, ids: _local_experts(x, ids, w, e_loc, tp, **kw)  # noqa: E731
        e = idx.reshape(-1)
        v = jnp.repeat(valid, X)
        if not ep and not tp:  # experts replicated: the single-device paths on each device's tokens
            return local(z, w, idx)  # padded rows route to expert 0, dropped by out[:N]
        if not ep:
            rows = run_local(jnp.repeat(z, X, axis=0), jnp.where(v, e, e_loc))
        else:
            n = math.prod(sizes[a] for a in ep)
            cap = n_loc * min(X, e_loc)  # lossless: every pair of this device to one destination
            if exchange.capacity_factor is not None and ragged == "capacity":  # ragged buffers stay lossless
                cap = max(1, min(cap, math.ceil(exchange.capacity_factor * n_loc * X / n)))
            fn = _capacity_dispatch if ragged == "capacity" else _ragged_dispatch
            rows = fn(z, e, v, X, e_loc, n, ep, cap, run_local, emulated=ragged == "ragged_emulated")
        return rows.reshape(n_loc, X, -1)

    in_specs = (P(tok_axes or None, None), P(tok_axes or None, None), tok,
                {n: exchange.weight_specs[n] for n in _WEIGHTS})
    out = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=P(tok_axes or None, None, None),
                        check_vma=False)(z, idx, valid, weights)
    return out[:N]


def _local_experts(x_ML, ids_M, w, e_loc, tp, *, act, compute_dtype, implementation):
    """Rows ``x`` through local expert ``ids`` (``e_loc`` = empty row, output 0): ``[M, L]`` compute dtype, in
    order."""
    order = jnp.argsort(ids_M, stable=True)
    group = jnp.zeros((e_loc,), jnp.int32).at[ids_M].add(1, mode="drop")
    # Weights do not depend on the tokens, so XLA may schedule every layer's expert decode (the jnp reference
    # dequantises all local experts) at the start of the step, all live at once. Tie them to this layer's rows.
    xs, w = jax.lax.optimization_barrier((x_ML[order], w))
    kw = dict(compute_dtype=compute_dtype, implementation=implementation)
    h = act(moe_gmm.gmm(xs, w["w1"], group, **kw), moe_gmm.gmm(xs, w["w3"], group, **kw))
    ys = moe_gmm.gmm(h, w["w2"], group, **kw)  # float32; partial over the tp slice of the hidden width
    if tp:
        ys = jax.lax.psum(ys, tp)
    ys = ys.astype(compute_dtype)
    return jnp.zeros_like(ys).at[order].set(ys)


def _sort_pairs(e_M, v_M, e_loc, n):
    """Pairs sorted by destination chip (then local expert); invalid pairs last. Returns order, dest, local id."""
    dest = jnp.where(v_M, e_M // e_loc, n)
    order = jnp.argsort(dest * e_loc + e_M % e_loc, stable=True)
    return order, dest[order], (e_M % e_loc)[order]


def _capacity_dispatch(z, e, v, X, e_loc, n, axes, cap, local, emulated=False):
    """Fixed-capacity exchange: ``[n, cap, L]`` buffers through ``all_to_all`` (pairs past ``cap`` dropped)."""
    order, dest, lid = _sort_pairs(e, v, e_loc, n)
    M = e.shape[0]
    counts = jnp.zeros((n + 1,), jnp.int32).at[dest].add(1)
    start = jnp.cumsum(counts) - counts
    rank = jnp.arange(M) - start[dest]
    keep = (dest < n) & (rank < cap)
    d, s = jnp.where(keep, dest, n), jnp.where(keep, rank, cap)
    buf = jnp.zeros((n, cap, z.shape[-1]), z.dtype).at[d, s].set(z[order // X], mode="drop")
    ids = jnp.full((n, cap), e_loc, jnp.int32).at[d, s].set(lid, mode="drop")
    got = jax.lax.all_to_all(buf, axes, 0, 0, tiled=True)  # [senders, cap, L]
    got_ids = jax.lax.all_to_all(ids, axes, 0, 0, tiled=True)
    y = local(got.reshape(n * cap, -1), got_ids.reshape(-1)).reshape(n, cap, -1)
    back = jax.lax.all_to_all(y, axes, 0, 0, tiled=True)  # [destinations, cap, L]: my pairs' results
    res = jnp.where(keep[:, None], back[jnp.minimum(dest, n - 1), jnp.minimum(rank, cap - 1)], 0)
    return jnp.zeros_like(res).at[order].set(res)


def _ragged_dispatch(z, e, v, X, e_loc, n, axes, cap, local, emulated=False):
    """Exactly-sized exchange with ``ragged_all_to_all`` (``emulated``: the same offsets over ``all_gather``)."""
    a2a = _ragged_all_to_all_emulated if emulated else jax.lax.ragged_all_to_all
    order, dest, lid = _sort_pairs(e, v, e_loc, n)
    me = jax.lax.axis_index(axes)
    send = jnp.zeros((n + 1,), jnp.int32).at[dest].add(1)[:n]
    in_off = jnp.cumsum(send) - send
    sizes = jax.lax.all_gather(send, axes)  # [sender, destination]
    recv = sizes[:, me]
    out_off = (jnp.cumsum(sizes, axis=0) - sizes)[me]  # where my rows start in each destination's buffer
    M = n * cap  # receive buffer rows: every sender's worst case
    xs = z[order // X]
    got = a2a(xs, jnp.zeros((M, z.shape[-1]), z.dtype), in_off, send, out_off, recv, axis_name=axes)
    got_ids = a2a(lid.astype(jnp.int32), jnp.full((M,), e_loc, jnp.int32), in_off, send, out_off, recv, axis_name=axes)
    y = local(got, got_ids)
    recv_off = jnp.cumsum(recv) - recv
    back_off = (jnp.cumsum(sizes, axis=1) - sizes)[:, me]  # where each sender's rows for me started
    back = a2a(y, jnp.zeros((e.shape[0], y.shape[-1]), y.dtype), recv_off, recv, back_off, send, axis_name=axes)
    return jnp.zeros_like(back).at[order].set(back)


def _ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """``jax.lax.ragged_all_to_all`` semantics built from ``all_gather`` (for CPU, where XLA lacks the op).

    Sender s's rows ``operand_s[input_offsets_s[r] : + send_sizes_s[r]]`` land in receiver r's
    ``output[output_offsets_s[r] : + ...]``; other output rows keep their value.
    """
    me = jax.lax.axis_index(axis_name)
    ops = jax.lax.all_gather(operand, axis_name)  # [senders, rows_in, ...]
    io = jax.lax.all_gather(input_offsets, axis_name)[:, me]
    ss = jax.lax.all_gather(send_sizes, axis_name)[:, me]
    oo = jax.lax.all_gather(output_offsets, axis_name)[:, me]
    r = jnp.arange(output.shape[0])
    inside = (r[None] >= oo[:, None]) & (r[None] < (oo + ss)[:, None])  # [senders, rows_out]
    src = jnp.argmax(inside, axis=0)
    row = jnp.clip(io[src] + r - oo[src], 0, operand.shape[0] - 1)
    vals = ops[src, row]
    hit = jnp.any(inside, axis=0).reshape((-1,) + (1,) * (operand.ndim - 1))
    return jnp.where(hit, vals, output)
