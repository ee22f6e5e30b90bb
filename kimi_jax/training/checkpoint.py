"""Train checkpoints (Orbax): the whole :class:`~kimi_jax.training.train.TrainState` -- parameters, router biases,
optimizer moments, step -- plus the data position, so an interrupted run resumes where it stopped.

The state is saved as a flat dict keyed by each leaf's pytree path (``.params['layers']...``), restored into the
shapes and shardings of a freshly initialised state; a checkpoint whose leaves differ is refused by name.
"""

from __future__ import annotations

import os

import jax
import numpy as np


def _flat(state) -> dict:
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}


def manager(directory, keep: int = 2):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(os.path.abspath(os.fspath(directory)),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))


def save(mgr, state, extra: dict, *, wait: bool = True):
    """Save ``state`` at its step with ``extra`` (small JSON-able run metadata: data position, losses)."""
    import orbax.checkpoint as ocp

    step = int(state.step)
    mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_flat(state)),
                                           extra=ocp.args.JsonSave(extra)))
    if wait:
        mgr.wait_until_finished()
    return step


def restore_latest(mgr, like):
    """(state shaped and sharded like ``like``, extra) from the newest checkpoint, or None when there is none."""
    import orbax.checkpoint as ocp

    step = mgr.latest_step()
    if step is None:
        return None
    leaves = jax.tree_util.tree_flatten_with_path(like)[0]
    abstract = {jax.tree_util.keystr(p): jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
                for p, x in leaves}
    got = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                     extra=ocp.args.JsonRestore()))
    flat = got["state"]
    missing = sorted(set(abstract) - set(flat))
    if missing:
        raise ValueError(f"train checkpoint step {step} lacks {missing[:4]}: it was written for another model or "
                         "training setup")
    values = [flat[jax.tree_util.keystr(p)] for p, _ in leaves]
    for (p, x), v in zip(leaves, values):
        if tuple(np.shape(v)) != tuple(x.shape):
            raise ValueError(f"train checkpoint {jax.tree_util.keystr(p)}: shape {np.shape(v)} != {x.shape}")
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), values), got["extra"]
