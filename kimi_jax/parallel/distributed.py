"""Multi-device and multi-process runs: JAX's distributed runtime, a run config placed on a mesh, gathering results.

Loading a checkpoint straight into a mesh's shards is :func:`kimi_jax.checkpoint.hf.load_hf_sharded`.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
from jax.experimental import multihost_utils

from kimi_jax.parallel import sharding


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


def process_allgather(x) -> np.ndarray:
    """The full value of a (possibly multi-process) sharded array on every process, as numpy."""
    if jax.process_count() == 1:
        return np.asarray(x)

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
