"""The one checkpoint reader: what fills each parameter leaf, checked before anything is read, read region by region.

Every path from an HF checkpoint to memory goes through here: the single-host loader and the sharded loader
(:mod:`kimi_jax.checkpoint.hf`) and the converter (``convert/converter.py``).

1. :func:`jobs` matches the checkpoint's tensor names to the model's parameter leaves (:mod:`kimi_jax.checkpoint.names`)
   and groups the placements by leaf once: a :class:`Job` is one leaf and the tensors that fill it (one, or one per
   expert of a stacked leaf), ordered by their position in the shard files so shards are read front to back.
2. :func:`preflight` runs every transform and the shape and dtype checks on zero-strided stand-ins (no memory, no
   data read), and on the real values only where a transform must see them (A_log's zero padding).
3. :meth:`Reader.read` reads any region of a leaf (``index``: one slice per dimension): the whole leaf for a
   single-host load or a conversion, a device's shard for a sharded load. An untransformed tensor read whole goes
   from the file straight into the output buffer (``preadv``, one copy); a region of one is read through the
   safetensors lazy slice; a transformed (small) tensor is read whole, transformed, then cut; so is an FP8
   block-quantized weight with its ``weight_scale_inv`` (dequantized: :func:`kimi_jax.checkpoint.names.fp8_dequantize`).
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import numpy as np

from kimi_jax.checkpoint import names
from kimi_jax.checkpoint.names import Destination, WeightError
from kimi_jax.checkpoint.safetensors import (
    DTYPES,
    Checkpoint,
    CheckpointError,
    TensorInfo,
    is_integer,
)
from kimi_jax.model.config import ModelConfig


@dataclasses.dataclass
class Job:
    """One parameter leaf and the tensors that fill it."""

    target: str  # leaf path, e.g. "layers.3.mlp.experts.w1.packed"
    sds: jax.ShapeDtypeStruct
    sources: list[Destination]  # one; one per expert (sorted) for a leaf that stacks experts; none: an optional
    # leaf the checkpoint leaves out (names.OPTIONAL), read as zeros
    rows: int | None = None  # keep only the first `rows` rows of the tensor (router rows of a --experts slice)

    @property
    def stacked(self) -> bool:
        return bool(self.sources) and self.sources[0].expert is not None

    @property
    def nbytes(self) -> int:
        return math.prod(self.sds.shape) * np.dtype(self.sds.dtype).itemsize


def jobs(ckpt: Checkpoint, cfg: ModelConfig, targets: dict[str, jax.ShapeDtypeStruct], *, tensors=None,
         rows=None) -> tuple[list[Job], list[str]]:
    """The jobs that fill every leaf of ``targets`` from ``ckpt`` (raises on any tensor or leaf left over), in file
    order, and the names of the ignored out-of-scope tensors. ``tensors``: the checkpoint tensors to use (default
    all); ``rows(target)``: rows to keep of that leaf's tensor (default all)."""
    files = {os.path.basename(i.file) for i in ckpt.tensors.values()}
    placements, ignored = names.assign(list(ckpt.tensors) if tensors is None else tensors, cfg, targets, files=files)
    by_target: dict[str, list[Destination]] = {}
    for p in placements:
        by_target.setdefault(p.target, []).append(p)
    out = [Job(t, targets[t], sorted(group, key=lambda p: -1 if p.expert is None else p.expert),
               None if rows is None else rows(t))
           for t, group in by_target.items()]
    out += [Job(t, sds, []) for t, sds in targets.items() if t not in by_target and names.optional(t)]
    out.sort(key=lambda j: min(((ckpt.tensors[p.tensor].file, ckpt.tensors[p.tensor].offset) for p in j.sources),
                               default=("", 0)))
    return out, ignored


def _slot(job: Job) -> jax.ShapeDtypeStruct:
    """What one source tensor fills: the whole leaf, or one expert's slice of it."""
    shape = tuple(job.sds.shape[1:]) if job.stacked else tuple(job.sds.shape)
    return jax.ShapeDtypeStruct(shape, job.sds.dtype)


def _where(p: Destination, info: TensorInfo) -> str:
    return f"tensor {p.tensor!r} in {os.path.basename(info.file)}"


def transform(p: Destination, arr: np.ndarray, info: TensorInfo, slot: jax.ShapeDtypeStruct) -> np.ndarray:
    """Apply the row's transform, check shape and dtype class, cast to the parameter dtype."""
    where = _where(p, info)
    if p.scale is None and info.dtype in names.FP8_RAW:
        raise WeightError(f"{where}: a float8 weight ({info.dtype}) without its block scales "
                          f"{p.tensor.removesuffix('weight') + names.FP8_SCALE!r} (parameter {p.target}); FP8 "
                          "weights load only with their scales, dequantized (the name table's fp8 rows)")
    arr = p.transform(arr, where, tuple(slot.shape))
    if tuple(arr.shape) != tuple(slot.shape):
        raise WeightError(f"{where}: shape {list(info.shape)} -> {list(arr.shape)} does not fit parameter "
                          f"{p.target} {list(slot.shape)}")
    target_int = np.issubdtype(np.dtype(slot.dtype), np.integer)
    if target_int != is_integer(info.dtype):
        raise WeightError(f"{where}: dtype {info.dtype} cannot fill parameter {p.target} of dtype {slot.dtype}")
    if target_int and np.dtype(arr.dtype) != np.dtype(slot.dtype):
        raise WeightError(f"{where}: dtype {info.dtype} but parameter {p.target} is {slot.dtype}")
    return np.asarray(arr).astype(slot.dtype, copy=False)


def _stand_in(info: TensorInfo, rows: int | None) -> np.ndarray:
    """A zero-strided array of the tensor's shape and dtype (no memory), for the checks."""
    shape = tuple(info.shape)
    if rows is not None:
        shape = (min(rows, shape[0]),) + shape[1:]
    return np.broadcast_to(np.zeros((), DTYPES[info.dtype]), shape)


def preflight(ckpt: Checkpoint, jobs: list[Job]) -> None:
    """Every transform, shape and dtype against the model before anything is read (A_log's padding on its values)."""
    for job in jobs:
        slot = _slot(job)
        for p in job.sources:
            info = ckpt.tensors[p.tensor]
            if p.scale is not None:  # FP8 blocks: checked from the headers; the rest as the float32 it becomes
                scale = ckpt.tensors[p.scale]
                names.fp8_check(_where(p, info), info.dtype, info.shape, p.scale, scale.dtype, scale.shape)
                info = dataclasses.replace(info, dtype="F32")
            if p.transform in names.CHECKS_VALUES:
                transform(p, ckpt.get(p.tensor), info, slot)
            else:
                transform(p, _stand_in(info, job.rows), info, slot)


def _check_values(p: Destination, info: TensorInfo, values: np.ndarray, index) -> None:
    n, first = p.check(values)
    if n:
        at = tuple((s.start or 0) + i for s, i in zip(index, first))  # the region's offset in the tensor
        what = "E8M0 NaN scale bytes (0xFF)" if p.check is names.e8m0 else "NaN / Inf values"
        raise NonFiniteError(f"{_where(p, info)}: {n} {what}, the first at {list(at)} (parameter {p.target}); "
                             "a model loaded from it computes NaN. Pass check_finite=False (kimi-jax: "
                             "--no-check-finite) to load it anyway")


def aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialised array at a 64-byte boundary: ``jax.device_put`` on the CPU device adopts it without a copy."""
    dtype = np.dtype(dtype)
    n = math.prod(shape) * dtype.itemsize
    raw = np.empty(n + 64, np.uint8)
    off = (-raw.ctypes.data) % 64
    return raw[off:off + n].view(dtype).reshape(shape)


def _full(index, shape) -> bool:
    return all(s == slice(None) or s.indices(n) == (0, n, 1) for s, n in zip(index, shape))


def _region_shape(index, shape) -> tuple:
    return tuple(len(range(*s.indices(n))) for s, n in zip(index, shape))


class NonFiniteError(WeightError):
    """A tensor holding NaN or Inf (or MXFP4's NaN scale byte): loading it would give a model that computes NaN."""


class Reader:
    """Reads regions of parameter leaves from one checkpoint; keeps its shard files open until :meth:`close`.
    ``bytes_in`` / ``tensors`` count what was read.

    ``check_finite``: every region read is checked for NaN / Inf (and MXFP4 scale bytes for E8M0's NaN, 0xFF),
    from the bits, as the loaded dtype holds them: :class:`NonFiniteError` names the tensor and its file. The check
    costs one pass over bytes that were just read (``benchmarks/load.py`` measures it)."""

    def __init__(self, ckpt: Checkpoint, *, check_finite: bool = True):
        self.ckpt = ckpt
        self.check_finite = check_finite
        self.files: dict[str, object] = {}
        self.bytes_in = 0
        self.tensors = 0

    def close(self):
        for f in self.files.values():
            f.close()
        self.files.clear()

    def read(self, job: Job, index=None, out: np.ndarray | None = None) -> np.ndarray:
        """The region ``index`` (a tuple of slices, default the whole leaf) of ``job``'s leaf, into ``out`` when
        given (its shape must be the region's)."""
        shape = tuple(job.sds.shape)
        index = tuple(index or ()) + (slice(None),) * (len(shape) - len(tuple(index or ())))
        region = _region_shape(index, shape)
        out = aligned_empty(region, job.sds.dtype) if out is None else out
        if not job.sources:  # an optional leaf the checkpoint leaves out
            out[...] = 0
            return out
        if not job.stacked:
            self._fill(job.sources[0], _slot(job), index, out, job.rows)
            return out
        by_expert = {p.expert: p for p in job.sources}
        for k, e in enumerate(range(*index[0].indices(shape[0]))):
            self._fill(by_expert[e], _slot(job), index[1:], out[k], None)
        return out

    def _fill(self, p: Destination, slot, index, out: np.ndarray, rows: int | None):
        """Region ``index`` of source tensor ``p.tensor`` (transformed, cast) into ``out``."""
        info = self.ckpt.tensors[p.tensor]
        direct = p.transform is names.identity and rows is None and DTYPES[info.dtype] == out.dtype
        if p.scale is not None:  # FP8 blocks: the weight and its scales whole, dequantized, cast, then cut
            w, s = self.ckpt.get(p.tensor), self.ckpt.get(p.scale)
            out[...] = transform(p, names.fp8_dequantize(w, s), info, slot)[index]
            nbytes = w.nbytes + s.nbytes
        elif direct and _full(index, slot.shape) and tuple(info.shape) == tuple(slot.shape) and out.flags.c_contiguous:
            self._raw_into(info, out)  # the bulk of the bytes: one copy, file -> output array
            nbytes = info.nbytes
        elif direct or (p.transform is names.identity and rows is None):
            part = np.asarray(self.ckpt.get_slice(p.tensor)[index])  # only the region's rows and columns
            if tuple(info.shape) != tuple(slot.shape):
                transform(p, _stand_in(info, None), info, slot)  # names the misfit
            out[...] = part.astype(out.dtype, copy=False)
            nbytes = part.nbytes
        else:  # small transformed tensors (conv kernels, row vectors, A_log, dt_bias) and router rows: whole, then cut
            raw = self.ckpt.get_slice(p.tensor)[:rows] if rows is not None else self.ckpt.get(p.tensor)
            out[...] = transform(p, np.asarray(raw), info, slot)[index]
            nbytes = raw.nbytes
        self.bytes_in += nbytes
        self.tensors += 1
        if self.check_finite:
            _check_values(p, info, out, index)

    def _raw_into(self, info: TensorInfo, out: np.ndarray):
        """Copy the tensor's bytes from its shard straight into ``out`` (same dtype and element count)."""
        f = self.files.get(info.file)
        if f is None:
            try:
                f = self.files[info.file] = open(info.file, "rb", buffering=0)
            except OSError as e:
                raise CheckpointError(f"{info.file}: cannot open ({e.strerror or e})") from None
        view = memoryview(out.reshape(-1).view(np.uint8))
        done = 0
        while done < info.nbytes:
            n = os.preadv(f.fileno(), [view[done:]], info.offset + done)
            if n <= 0:
                raise CheckpointError(f"{info.file}: tensor {info.name!r}: file ended after {done} of its "
                                      f"{info.nbytes} bytes (truncated while reading?)")
            done += n
