"""Reading Hugging Face safetensors checkpoints lazily, with errors that name the file and the tensor.

A checkpoint is one ``model.safetensors`` or shards listed by ``model.safetensors.index.json`` (K3 names its
96 shards ``model-000NN-of-000096.safetensors``: 5-digit index, 6-digit total). Headers are parsed and
checked up front (JSON, dtypes, shapes against byte ranges, ranges inside the file and not overlapping), so a
truncated or corrupt shard fails before any tensor is read; tensors are then read one at a time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct

import ml_dtypes
import numpy as np
from safetensors import safe_open

# The dtype table: safetensors dtype names and the numpy dtypes they read as (reader, writer and loaders use it).
DTYPES = {"BOOL": np.dtype(bool), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8), "I16": np.dtype(np.int16),
          "U16": np.dtype(np.uint16), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
          "I32": np.dtype(np.int32), "U32": np.dtype(np.uint32), "F32": np.dtype(np.float32), "F64": np.dtype(np.float64),
          "I64": np.dtype(np.int64), "U64": np.dtype(np.uint64), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
          "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn)}


def is_integer(dtype: str) -> bool:
    """A safetensors dtype of integers or booleans (which can fill integer parameters, never float ones)."""
    return DTYPES[dtype].kind in "biu"
# read from the file's bytes: safetensors' numpy reader has no float8 dtypes
_RAW = ("F8_E4M3", "F8_E5M2")
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint file or index that cannot be read as promised."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str  # absolute path
    dtype: str  # safetensors dtype name
    shape: tuple
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


def read_header(path: str) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors file's header. Raises :class:`CheckpointError` naming the file."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
            (n,) = struct.unpack("<Q", head)
            if 8 + n > size:
                raise CheckpointError(f"{path}: truncated or corrupt: header claims {n} bytes, file has {size}")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header (not JSON: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    data_start, data_size = 8 + n, size - 8 - n
    out, spans = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r}: malformed header entry {info!r}") from None
        if dtype not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r}: unknown dtype {dtype!r}")
        if not all(isinstance(s, int) and s >= 0 for s in shape):
            raise CheckpointError(f"{path}: tensor {name!r}: bad shape {list(shape)}")
        want = math.prod(shape) * DTYPES[dtype].itemsize
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
            raise CheckpointError(f"{path}: tensor {name!r}: bad data_offsets {[begin, end]}")
        if end - begin != want:
            raise CheckpointError(
                f"{path}: tensor {name!r}: data_offsets span {end - begin} bytes but {dtype}{list(shape)} needs {want}")
        if end > data_size:
            raise CheckpointError(
                f"{path}: truncated: tensor {name!r} ends at byte {end} of the data section, which has {data_size} bytes")
        spans.append((begin, end, name))
        out[name] = TensorInfo(name, path, dtype, shape, data_start + begin, want)
    spans.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointError(f"{path}: corrupt header: tensors {n0!r} and {n1!r} overlap")
    return out


class Checkpoint:
    """All tensors of an HF checkpoint directory, by name, validated; data read on demand."""

    def __init__(self, directory: str):
        self.dir = os.path.abspath(os.fspath(directory))
        if not os.path.isdir(self.dir):
            raise FileNotFoundError(f"{self.dir}: not a directory")
        index = os.path.join(self.dir, INDEX)
        if os.path.exists(index):
            files = self._files_from_index(index)
        elif os.path.exists(os.path.join(self.dir, SINGLE)):
            files, self.weight_map = [SINGLE], None
        else:
            found = sorted(f for f in os.listdir(self.dir) if f.endswith(".safetensors"))
            if not found:
                raise CheckpointError(f"{self.dir}: no {SINGLE}, no {INDEX}, no *.safetensors files")
            if len(found) > 1:
                raise CheckpointError(f"{self.dir}: {len(found)} safetensors files but no {INDEX} to say which to use")
            files, self.weight_map = found, None
        self.tensors: dict[str, TensorInfo] = {}
        for fname in files:
            for name, info in read_header(os.path.join(self.dir, fname)).items():
                if name in self.tensors:
                    raise CheckpointError(
                        f"tensor {name!r} is defined twice: in {os.path.basename(self.tensors[name].file)} and {fname}")
                self.tensors[name] = info
        if self.weight_map is not None:
            for name, fname in self.weight_map.items():
                if name not in self.tensors:
                    raise CheckpointError(f"{INDEX} maps {name!r} to {fname}, but no shard contains it")
                if os.path.basename(self.tensors[name].file) != fname:
                    raise CheckpointError(
                        f"{INDEX} maps {name!r} to {fname}, but it is in {os.path.basename(self.tensors[name].file)}")
            extra = sorted(set(self.tensors) - set(self.weight_map))
            if extra:
                raise CheckpointError(f"shards contain tensors that {INDEX} does not list: {extra[:5]}")
        self._open: dict[str, object] = {}

    def _files_from_index(self, index: str) -> list[str]:
        try:
            with open(index) as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{index}: not valid JSON ({e})") from None
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict) or not wm:
            raise CheckpointError(f"{index}: no weight_map")
        self.weight_map = wm
        files = sorted(set(wm.values()))
        for fname in files:
            if os.path.basename(fname) != fname:
                raise CheckpointError(f"{index}: shard name {fname!r} is not a plain file name")
            if not os.path.exists(os.path.join(self.dir, fname)):
                raise CheckpointError(f"{index}: shard {fname} is missing from {self.dir}")
        return files

    def __contains__(self, name):
        return name in self.tensors

    def __iter__(self):
        return iter(self.tensors)

    def _handle(self, file: str):
        f = self._open.get(file)
        if f is None:
            try:
                f = self._open[file] = safe_open(file, framework="numpy")
            except Exception as e:  # safetensors raises its own error type
                raise CheckpointError(f"{file}: cannot open ({e})") from None
        return f

    def get(self, name: str) -> np.ndarray:
        """Read one tensor into host memory (bfloat16 arrives as ml_dtypes.bfloat16, float8 as ml_dtypes' float8)."""
        info = self.tensors[name]
        if info.dtype in _RAW:
            return self._raw(info)
        try:
            return self._handle(info.file).get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{info.file}: cannot read tensor {name!r} ({e})") from None

    def _raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes read from its file, as ``DTYPES[info.dtype]`` (the dtypes safetensors' numpy reader
        does not know)."""
        try:
            with open(info.file, "rb") as f:
                f.seek(info.offset)
                data = f.read(info.nbytes)
        except OSError as e:
            raise CheckpointError(f"{info.file}: cannot read tensor {info.name!r} ({e.strerror or e})") from None
        if len(data) != info.nbytes:
            raise CheckpointError(f"{info.file}: tensor {info.name!r}: file ended after {len(data)} of its "
                                  f"{info.nbytes} bytes")
        return np.frombuffer(data, DTYPES[info.dtype]).reshape(info.shape).copy()

    def get_slice(self, name: str):
        """A lazy slice handle (``handle[idx]`` reads only that region)."""
        return self._handle(self.tensors[name].file).get_slice(name)

    def close(self):
        self._open.clear()
