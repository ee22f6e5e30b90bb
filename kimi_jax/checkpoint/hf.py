"""Loading an HF safetensors checkpoint into a model: on one host, or straight into a mesh's shards.

Both go through the one reader (:mod:`kimi_jax.checkpoint.reader`): the jobs (which tensors fill which parameter
leaf), the preflight (every shape and dtype checked before any data is read), then region reads.

* :func:`load_hf`: each leaf read whole, in file order, and put on the default device (or given shardings).
* :func:`load_hf_sharded`: no parameter is ever materialised on one device or one host. Every leaf is built with
  ``jax.make_array_from_callback``, whose callback runs only for this process's devices and reads only that
  device's region of the checkpoint tensor; routed experts are read one expert at a time, only the experts of the
  region. A region needed by several local devices (replicated over some mesh axis) is read once per process.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import NamedSharding

from kimi_jax.checkpoint import reader as reader_lib
from kimi_jax.checkpoint.safetensors import Checkpoint
from kimi_jax.model import params
from kimi_jax.parallel import sharding

# What this process read in its last load_hf_sharded (parameter bytes after dtype conversion), for tests and logs.
LAST_LOAD = {"bytes_read": 0, "bytes_total": 0, "expert_bytes_read": 0, "expert_bytes_total": 0}


def _prepare(path, cfg, model_factory):
    """(graphdef, abstract state, checkpoint, jobs): everything checked, nothing read."""
    abstract = nnx.eval_shape(model_factory)
    graphdef, state = nnx.split(abstract)
    ckpt = Checkpoint(path)
    try:
        jobs, _ = reader_lib.jobs(ckpt, cfg, params.leaves(state))
        reader_lib.preflight(ckpt, jobs)
    except BaseException:
        ckpt.close()
        raise
    return graphdef, state, ckpt, jobs


def _bar(jobs, progress: bool):
    """A byte counter on stderr for loads that last: shown only after 2 s (tiny models never see it)."""
    from tqdm import tqdm

    return tqdm(total=sum(j.nbytes for j in jobs), unit="B", unit_scale=True, unit_divisor=1024, desc="loading",
                delay=2.0, disable=not progress, dynamic_ncols=True, leave=False)


def load_hf(path, cfg, model_factory, *, shardings=None, check_finite: bool = True, progress: bool = True):
    """Build the model ``model_factory()`` describes and fill it from the HF checkpoint at ``path``.

    ``shardings``: optional {leaf path: Sharding} (default: the default device). ``check_finite``: refuse NaN / Inf
    weights (:class:`~kimi_jax.checkpoint.reader.Reader`). ``progress``: a byte counter for loads over 2 s."""
    graphdef, state, ckpt, jobs = _prepare(path, cfg, model_factory)
    reader = reader_lib.Reader(ckpt, check_finite=check_finite)
    values = {}
    bar = _bar(jobs, progress)
    try:
        for job in jobs:
            value = reader.read(job)  # 64-byte aligned: on the CPU, device_put adopts it without a copy
            values[job.target] = jax.device_put(value, None if shardings is None else shardings.get(job.target))
            bar.update(job.nbytes)
    finally:
        bar.close()
        reader.close()
        ckpt.close()
    return nnx.merge(graphdef, params.fill(state, values))


class _RegionCache:
    """``make_array_from_callback``'s callback for one leaf: each distinct region read once per process."""

    def __init__(self, reader: reader_lib.Reader, job: reader_lib.Job):
        self.reader, self.job, self.cache = reader, job, {}

    def __call__(self, index):
        key = tuple((s.start, s.stop, s.step) if isinstance(s, slice) else s for s in index)
        if key not in self.cache:
            self.cache[key] = self.reader.read(self.job, tuple(index))
            n = self.cache[key].nbytes
            LAST_LOAD["bytes_read"] += n
            if self.job.stacked:
                LAST_LOAD["expert_bytes_read"] += n
        return self.cache[key]


def load_hf_sharded(path, cfg, run, model_factory, *, check_finite: bool = True, progress: bool = True):
    """Build the model for ``cfg`` with every parameter leaf read straight into its sharding (``run.parallel``)."""
    par: sharding.Parallel = run.parallel
    graphdef, state, ckpt, jobs = _prepare(path, cfg, model_factory)
    specs = sharding.param_specs(nnx.merge(graphdef, state), par.mesh, par.layout)
    LAST_LOAD.update(bytes_read=0, bytes_total=sum(j.nbytes for j in jobs), expert_bytes_read=0,
                     expert_bytes_total=sum(j.nbytes for j in jobs if j.stacked))
    reader = reader_lib.Reader(ckpt, check_finite=check_finite)
    values = {}
    bar = _bar(jobs, progress)
    try:
        for job in jobs:
            values[job.target] = jax.make_array_from_callback(
                tuple(job.sds.shape), NamedSharding(par.mesh, specs[job.target]), _RegionCache(reader, job))
            bar.update(job.nbytes)
    finally:
        bar.close()
        reader.close()
        ckpt.close()
    return nnx.merge(graphdef, params.fill(state, values))
