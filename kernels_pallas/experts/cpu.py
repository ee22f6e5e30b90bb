"""The gathered routed experts and the shared experts as one native call per projection (decode on CPU).

A decode step's routed products (each slot reads its expert's rows in place) and the shared experts' products are
streamed together by the grouped-product op (:mod:`kernels_pallas.matvec`): the up projections of both as one call,
then the down projections as another, instead of six calls of a few hundred kilobytes each.
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas import matvec, packed


def _cast(w, dt):
    return w if packed.is_packed(w) else w.astype(dt)


def grouped_gather(z_NL, w, idx_NX, shared=None, *, act, compute_dtype, implementation=None, placement=None):
    """(routed ``[N, X, L]``, shared ``[N, D]`` or None) in ``compute_dtype``, or None where the grouped-product op
    would not stream these items as one call (then each part runs on its own). ``shared``:
    :class:`kernels_pallas.experts.Shared` or None; its output is None (the caller runs the shared experts) when
    their weights are in another format than the routed ones (MXFP4 experts beside float shared experts: one
    format per native call)."""
    N, X = idx_NX.shape
    dt, ids = compute_dtype, idx_NX.reshape(N * X)
    zx = jnp.broadcast_to(z_NL.astype(dt)[:, None], (N, X, z_NL.shape[-1])).reshape(N * X, -1)
    items = [(zx, _cast(w["w1"], dt), ids), (zx, _cast(w["w3"], dt), ids)]
    kw = dict(implementation=implementation, placement=placement)
    if shared is not None:
        xs = shared.x.astype(dt)
        both = items + [(xs, _cast(shared.gate, dt), None), (xs, _cast(shared.up, dt), None)]
        items, shared = (both, shared) if matvec.fuses(both, **kw) else (items, None)
    if not matvec.fuses(items, **kw):
        return None
    up = matvec.group(items, **kw)
    items = [(act(up[0], up[1]).astype(dt), _cast(w["w2"], dt), ids)]
    if shared is not None:
        items.append((shared.act(up[2], up[3]).astype(dt), _cast(shared.down, dt), None))
    down = matvec.group(items, **kw)
    return down[0].reshape(N, X, -1).astype(dt), (down[1].astype(dt) if shared is not None else None)
