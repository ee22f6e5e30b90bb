"""Loading an HF safetensors checkpoint into a model: on one host, or straight into a mesh's shards.

Both go through the one reader (:mod:`kimi_jax.checkpoint.reader`): the jobs (which tensors fill which parameter
leaf), the preflight (every shape and dtype checked before any data is read), then region reads.

* :func:`load_hf`: each leaf read whole, in file order, and put on the default device (or given shardings).
* :func:`load_hf_sharded`: no parameter is ever materialised on one device or one host. Every leaf is built with
  ``jax.make_array_from_callback``, whose callback runs only for this process's devices and reads only that
  device's region of the checkpoint tensor; routed experts are read one expert at a time, only the experts of the
  region. A region needed by several local devices (replicated over some mesh axis) is read once per process.

A compressed-tensors ``pack-quantized`` checkpoint (weight-only int4 / int8, symmetric, group or channel scales:
:func:`pack_quantized`) loads into the packed types of :mod:`kernels_pallas.quant`: every weight the files store as
``weight_packed`` becomes an :class:`~kernels_pallas.quant.Int4Weight` / :class:`~kernels_pallas.quant.Int8Weight`
parameter whose fields the name table fills (:data:`kimi_jax.checkpoint.names.CT_FIELDS`); the others stay float.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from tqdm import tqdm

from kernels_pallas import quant
from kimi_jax.checkpoint import names
from kimi_jax.checkpoint import reader as reader_lib
from kimi_jax.checkpoint.names import WeightError
from kimi_jax.checkpoint.safetensors import Checkpoint
from kimi_jax.model import params
from kimi_jax.parallel import sharding

# What this process read in its last load_hf_sharded (parameter bytes after dtype conversion), for tests and logs.
LAST_LOAD = {"bytes_read": 0, "bytes_total": 0, "expert_bytes_read": 0, "expert_bytes_total": 0}


@dataclasses.dataclass(frozen=True)
class PackQuantized:
    """A compressed-tensors ``pack-quantized`` checkpoint: ``kind`` "int4" | "int8", ``group`` input columns per
    scale (None: one scale per row, the ``channel`` strategy), as the config parser read them
    (:func:`kimi_jax.model.config.pack_quantized_format`)."""

    kind: str
    group: int | None

    def format_for(self, shape) -> quant.Format:
        """Our format of one weight ``[..., J, I]``."""
        if self.kind == "int8":
            return quant.Format("int8")
        return quant.Format("int4", self.group if self.group is not None else int(shape[-1]))

    def name(self) -> str:
        return f"{self.kind} pack-quantized ({'channel' if self.group is None else f'group {self.group}'})"


def pack_quantized(cfg) -> PackQuantized | None:
    """The compressed-tensors ``pack-quantized`` weight format the config parser read from the checkpoint's
    quantization_config (:attr:`kimi_jax.model.config.ModelConfig.packed_weights`), or None."""
    return None if cfg.packed_weights is None else PackQuantized(*cfg.packed_weights)


def _adopt_pack_quantized(spec: PackQuantized, ckpt: Checkpoint, cfg, state) -> None:
    """Give each parameter the checkpoint stores ``pack-quantized`` its packed type (abstract, in ``state``), after
    checking the file's ``weight_shape`` against the parameter's shape."""
    for path, var in nnx.to_flat_state(state):
        value, leaf = var.get_value(), ".".join(map(str, path))
        name = names.expected_tensor(leaf, cfg)
        if name is None or not name.endswith(".weight"):
            continue
        packed_name, shape_name = names.ct_tensors(name)
        if "{expert}" in packed_name:
            if packed_name.format(expert=0) in ckpt.tensors:
                raise WeightError(f"tensor {packed_name.format(expert=0)!r}: pack-quantized routed "
                                  f"experts are not supported (parameter {leaf})")
            continue
        if packed_name not in ckpt.tensors:
            continue
        if shape_name not in ckpt.tensors:
            raise WeightError(f"tensor {packed_name!r} has no {shape_name!r} beside it")
        stored = tuple(int(x) for x in np.asarray(ckpt.get(shape_name)).reshape(-1))
        if stored != tuple(value.shape):
            raise WeightError(f"tensor {shape_name!r} says {list(stored)}, parameter {leaf} is {list(value.shape)}")
        fmt = spec.format_for(value.shape)
        why = fmt.fits(value.shape)
        if why is not None:
            raise WeightError(f"tensor {packed_name!r}: {spec.name()} cannot fill parameter {leaf} "
                              f"{list(value.shape)}: {why}")
        var.set_value(jax.eval_shape(functools.partial(quant.quantize, fmt=fmt.fitted(value.shape)), value))


def _prepare(path, cfg, model_factory):
    """(graphdef, abstract state, checkpoint, jobs): everything checked, nothing read."""
    abstract = nnx.eval_shape(model_factory)
    graphdef, state = nnx.split(abstract)
    ckpt = Checkpoint(path)
    try:
        spec = pack_quantized(cfg)
        if spec is not None:
            _adopt_pack_quantized(spec, ckpt, cfg, state)
        jobs, _ = reader_lib.jobs(ckpt, cfg, params.leaves(state))
        reader_lib.preflight(ckpt, jobs)
    except BaseException:
        ckpt.close()
        raise
    return graphdef, state, ckpt, jobs


def _bar(jobs, progress: bool):
    """A byte counter on stderr for loads that last: shown only after 2 s (tiny models never see it)."""
    return tqdm(total=sum(j.nbytes for j in jobs), unit="B", unit_scale=True, unit_divisor=1024, desc="loading",
                delay=2.0, disable=not progress, dynamic_ncols=True, leave=False)


def load_hf(path, cfg, model_factory, *, placement=None, check_finite: bool = True, progress: bool = True):
    """Build the model ``model_factory()`` describes and fill it from the HF checkpoint at ``path``.

    ``placement``: optional ``leaf path -> Sharding or None`` (None: the default device), e.g. the routed experts
    into host memory. ``check_finite``: refuse NaN / Inf
    weights (:class:`~kimi_jax.checkpoint.reader.Reader`). ``progress``: a byte counter for loads over 2 s."""
    graphdef, state, ckpt, jobs = _prepare(path, cfg, model_factory)
    reader = reader_lib.Reader(ckpt, check_finite=check_finite)
    values = {}
    bar = _bar(jobs, progress)
    try:
        for job in jobs:
            value = reader.read(job)  # 64-byte aligned: on the CPU, device_put adopts it without a copy
            values[job.target] = jax.device_put(value, None if placement is None else placement(job.target))
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
