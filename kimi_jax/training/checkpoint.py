"""Train checkpoints (Orbax): the whole :class:`~kimi_jax.training.train.TrainState` -- parameters, router biases,
optimizer moments, step -- plus a small JSON dict the caller chooses (``kimi-jax train`` stores the unigram entropy;
its batches are a function of (seed, step), so the step is the data position).

The state is saved as a flat dict keyed by each leaf's pytree path (``.params['layers']...``), restored into the
shapes and shardings of a freshly initialised state. A checkpoint whose leaves differ -- names missing or extra,
another shape or dtype -- is refused from its metadata, naming them, before anything is read.
"""

from __future__ import annotations

import os

import jax
import numpy as np


def _flat(state) -> dict:
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}


def manager(directory, keep: int = 2):
    import orbax.checkpoint as ocp  # 0.3-0.6 s to import; train checkpoints only

    # the handlers named up front, so a manager opened on an existing directory reads the items' metadata
    handlers = {"state": ocp.StandardCheckpointHandler(), "extra": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(os.path.abspath(os.fspath(directory)), item_handlers=handlers,
                                 options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))


def save(mgr, state, extra: dict, *, wait: bool = True):
    """Save ``state`` at its step with ``extra`` (small JSON-able run metadata)."""
    import orbax.checkpoint as ocp  # 0.3-0.6 s to import; train checkpoints only

    step = int(state.step)
    mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_flat(state)),
                                           extra=ocp.args.JsonSave(extra)))
    if wait:
        mgr.wait_until_finished()
    return step


def restore_latest(mgr, like):
    """(state shaped and sharded like ``like``, extra) from the newest checkpoint, or None when there is none."""
    import orbax.checkpoint as ocp  # 0.3-0.6 s to import; train checkpoints only

    step = mgr.latest_step()
    if step is None:
        return None
    leaves = jax.tree_util.tree_flatten_with_path(like)[0]
    abstract = {jax.tree_util.keystr(p): jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
                for p, x in leaves}
    _check_matches(mgr, step, abstract)
    got = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                     extra=ocp.args.JsonRestore()))
    flat = got["state"]
    values = [flat[jax.tree_util.keystr(p)] for p, _ in leaves]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), values), got["extra"]


def _check_matches(mgr, step: int, abstract: dict) -> None:
    """Refuse a checkpoint whose stored leaves are not ``abstract``'s: names, shapes and dtypes (from its metadata)."""
    stored = dict(mgr.item_metadata(step)["state"].tree)
    missing, extra = sorted(set(abstract) - set(stored)), sorted(set(stored) - set(abstract))
    if missing or extra:
        raise ValueError(f"train checkpoint step {step} in {mgr.directory}: lacks {missing[:4]} and has {extra[:4]} "
                         f"({len(missing)} missing, {len(extra)} extra): it was written for another model or training "
                         "setup")
    for k, want in abstract.items():
        got = stored[k]
        if tuple(got.shape) != tuple(want.shape) or np.dtype(got.dtype) != np.dtype(want.dtype):
            raise ValueError(f"train checkpoint step {step} {k}: stored {tuple(got.shape)} {np.dtype(got.dtype)}, "
                             f"this run has {tuple(want.shape)} {np.dtype(want.dtype)}")
