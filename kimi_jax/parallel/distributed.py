"""Multi-device and multi-process runs: JAX's distributed runtime, sharded loading, sharded models.

Loading (:func:`load_hf_sharded`) never materialises a parameter on one device or one host: every parameter is
built with ``jax.make_array_from_callback``, whose callback runs only for this process's devices and reads
only that device's slice of the checkpoint tensor through the safetensors lazy slice (``get_slice``). Routed
experts are read one expert at a time, only the experts of the requested slice. A slice needed by several local
devices (replicated over some mesh axis) is read once per process. Shapes and dtypes of every tensor are checked
against the model from the headers before any data is read.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from kimi_jax.checkpoint import names as weights
from kimi_jax.checkpoint.safetensors import Checkpoint
from kimi_jax.parallel import sharding

_INT_DTYPES = {"U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16, "U32": np.uint32, "I32": np.int32,
               "U64": np.uint64, "I64": np.int64, "BOOL": np.bool_}


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_ids=None) -> None:
    """Start JAX's distributed runtime once per process (a no-op for a single process with no arguments).

    On Cloud TPU pod slices, SLURM and Open MPI every argument is detected from the environment: call it with
    none. Elsewhere (plain multi-node GPU, localhost tests) pass all three, or set ``KIMI_JAX_COORDINATOR``,
    ``KIMI_JAX_NUM_PROCESSES`` and ``KIMI_JAX_PROCESS_ID``.
    """
    env = os.environ
    coordinator_address = coordinator_address or env.get("KIMI_JAX_COORDINATOR")
    if num_processes is None and "KIMI_JAX_NUM_PROCESSES" in env:
        num_processes = int(env["KIMI_JAX_NUM_PROCESSES"])
    if process_id is None and "KIMI_JAX_PROCESS_ID" in env:
        process_id = int(env["KIMI_JAX_PROCESS_ID"])
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, local_device_ids=local_device_ids)


def with_parallel(run, mesh, layout="tp_ep", **kw):
    """``run`` (a RunConfig) with ``parallel`` set for ``mesh``."""
    return dataclasses.replace(run, parallel=sharding.Parallel(mesh, sharding.layout(layout), **kw))


def _fake(info, sds):
    """A zero-strided stand-in of the tensor's shape (no memory) to run the name table's checks before reading."""
    dt = _INT_DTYPES.get(info.dtype, sds.dtype)
    return np.broadcast_to(np.zeros((), dt), info.shape)


def _index_key(index) -> tuple:
    return tuple((s.start, s.stop, s.step) if isinstance(s, slice) else s for s in index)


# What this process read in its last load_hf_sharded (parameter bytes after dtype conversion), for tests and logs.
LAST_LOAD = {"bytes_read": 0, "bytes_total": 0, "expert_bytes_read": 0, "expert_bytes_total": 0}


class _TensorReader:
    """The callback for one parameter: reads the region a device needs, once per process."""

    def __init__(self, ckpt: Checkpoint, group, sds):
        self.ckpt, self.group, self.sds = ckpt, group, sds
        self.stacked = group[0].expert is not None
        self.cache: dict[tuple, np.ndarray] = {}

    def __call__(self, index):
        key = _index_key(index)
        if key not in self.cache:
            self.cache[key] = self._read(tuple(index))
            LAST_LOAD["bytes_read"] += self.cache[key].nbytes
            if self.stacked:
                LAST_LOAD["expert_bytes_read"] += self.cache[key].nbytes
        return self.cache[key]

    def _read(self, index):
        sds, ckpt = self.sds, self.ckpt
        index = index + (slice(None),) * (len(sds.shape) - len(index))
        if not self.stacked:
            (p,) = self.group
            if p.transform is weights._identity:  # the large tensors: read only the slice
                return np.asarray(ckpt.get_slice(p.tensor)[index]).astype(sds.dtype, copy=False)
            # conv kernels, row vectors, A_log, dt_bias: small; read whole, transform (with its checks), slice
            full = weights.transform(p, ckpt.get(p.tensor), ckpt.tensors[p.tensor], sds)
            return np.ascontiguousarray(full[index])
        by_expert = {p.expert: p for p in self.group}
        experts = range(*index[0].indices(sds.shape[0]))
        rows = [np.asarray(ckpt.get_slice(by_expert[e].tensor)[index[1:]]).astype(sds.dtype, copy=False)
                for e in experts]
        return np.stack(rows) if rows else np.zeros((0,) + tuple(sds.shape[1:]), sds.dtype)


def load_hf_sharded(path, cfg, run, model_factory):
    """Build the model for ``cfg`` with parameters read straight into their shardings (``run.parallel``)."""
    par: sharding.Parallel = run.parallel
    abstract = nnx.eval_shape(model_factory)
    graphdef, state = nnx.split(abstract)
    targets = weights.flat_targets(state)
    specs = sharding.param_specs(abstract, par.mesh, par.layout)
    ckpt = Checkpoint(path)
    placements, _ = weights.plan(list(ckpt.tensors), cfg, targets)
    by_target: dict[str, list] = {}
    for p in placements:
        weights.transform(p, _fake(ckpt.tensors[p.tensor], targets[p.target]), ckpt.tensors[p.tensor],
                          targets[p.target])
        by_target.setdefault(p.target, []).append(p)
    values = {}
    nbytes = {t: math.prod(targets[t].shape) * targets[t].dtype.itemsize for t in by_target}
    LAST_LOAD.update(bytes_read=0, bytes_total=sum(nbytes.values()), expert_bytes_read=0,
                     expert_bytes_total=sum(n for t, n in nbytes.items() if by_target[t][0].expert is not None))
    try:
        for target, group in by_target.items():
            sds = targets[target]
            values[target] = jax.make_array_from_callback(
                sds.shape, NamedSharding(par.mesh, specs[target]), _TensorReader(ckpt, group, sds))
    finally:
        ckpt.close()
    for p, var in nnx.to_flat_state(state):
        var.set_value(values[".".join(str(k) for k in p)])
    return nnx.merge(graphdef, state)


def process_allgather(x) -> np.ndarray:
    """The full value of a (possibly multi-process) sharded array on every process, as numpy."""
    if jax.process_count() == 1:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
