"""Multi-device and multi-process runs: JAX's distributed runtime, a run config placed on a mesh, gathering results.

Loading a checkpoint straight into a mesh's shards is :func:`kimi_jax.checkpoint.hf.load_hf_sharded`.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
from jax._src.distributed import global_state
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


def env_configured() -> bool:
    """Whether ``KIMI_JAX_COORDINATOR`` (or the process count / index) asks for several processes."""
    return any(k in os.environ for k in ("KIMI_JAX_COORDINATOR", "KIMI_JAX_NUM_PROCESSES", "KIMI_JAX_PROCESS_ID"))


def launched_by_slurm() -> bool:
    """Whether ``srun`` started this process as one task of several (JAX detects the rest from SLURM's variables)."""
    return "SLURM_JOB_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1


def with_parallel(run, mesh, layout="tp_ep", **kw):
    """``run`` (a RunConfig) with ``parallel`` set for ``mesh``."""
    return dataclasses.replace(run, parallel=sharding.Parallel(mesh, sharding.layout(layout), **kw))


def process_allgather(x) -> np.ndarray:
    """The full value of a (possibly multi-process) sharded array on every process, as numpy."""
    if jax.process_count() == 1:
        return np.asarray(x)

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


_shared = [0]


def share_text(text: str | None) -> str:
    """``text`` as process 0 has it, on every process (one process: ``text`` itself). Process 0 passes it, the
    others None; every process calls this in the same order (an interactive command reading its input on process 0).
    Through the distributed runtime's key-value store: waiting for a person to type needs no collective."""
    if jax.process_count() == 1:
        return text

    key = f"kimi-jax/text/{_shared[0]}"
    _shared[0] += 1
    if jax.process_index() == 0:
        global_state.client.key_value_set(key, text)
        return text
    while True:
        try:
            return global_state.client.blocking_key_value_get(key, 60_000)
        except Exception as e:  # noqa: BLE001 - one error type for every failure: wait on, unless it is not a timeout
            if "DEADLINE_EXCEEDED" not in str(e):
                raise
