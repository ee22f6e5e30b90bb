"""A streaming safetensors writer: the header is computed from names, dtypes and shapes, then tensors are produced and
written one at a time, so a multi-gigabyte shard never has to exist in memory.

The bytes are the ones ``safetensors.torch.save_file`` writes (same tensor order -- dtype rank descending, then name --
same compact JSON header with ``{"format": "pt"}`` metadata, same space padding to 8 bytes); a test checks this
byte for byte against the safetensors library.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from typing import Callable, Iterable

import numpy as np

from kimi_jax.checkpoint.safetensors import DTYPES

# safetensors' Dtype enum order; files list larger ranks first.
_RANK = ["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64"]


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    dtype: str  # safetensors dtype name
    shape: tuple

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


def ordered(entries: Iterable[Entry]) -> list[Entry]:
    """The order safetensors lays tensors out in: dtype rank descending, then name."""
    return sorted(entries, key=lambda e: (-_RANK.index(e.dtype), e.name))


def header_bytes(entries: list[Entry], metadata: dict | None = None) -> bytes:
    """``u64 length`` + JSON header (padded with spaces to a multiple of 8) for ``entries`` in the given order."""
    header, offset = {}, 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for e in entries:
        header[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_file(path: str, entries: Iterable[Entry], produce: Callable[[Entry], np.ndarray],
               metadata: dict | None = None) -> int:
    """Write one safetensors file, calling ``produce(entry)`` for each tensor in file order. Written to a temporary
    name and renamed, so a crash never leaves a file that parses. Returns the number of data bytes."""
    entries = ordered(entries)
    tmp = path + ".partial"
    total = 0
    try:
        with open(tmp, "wb") as f:
            f.write(header_bytes(entries, {"format": "pt"} if metadata is None else metadata))
            for e in entries:
                arr = np.ascontiguousarray(produce(e))
                if arr.dtype != DTYPES[e.dtype] or tuple(arr.shape) != tuple(e.shape):
                    raise ValueError(f"{path}: tensor {e.name!r}: produced {arr.dtype}{list(arr.shape)}, "
                                     f"header says {e.dtype}{list(e.shape)}")
                f.write(memoryview(arr.reshape(-1).view(np.uint8)))
                total += e.nbytes
    except BaseException:
        os.unlink(tmp)
        raise
    os.replace(tmp, path)
    return total
