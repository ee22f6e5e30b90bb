"""What the serving scheduler decides for one engine step, as data: a :class:`StepPlan` of ops, and the static
:class:`Shapes` both sides agree on.

The scheduler (:mod:`kimi_jax.serving.scheduler`) makes every host decision -- admission, prefix-cache lookup,
eviction and spills, chunk choice, page allocation, sampling values and seeds -- and writes them down as ops; the
executor (:mod:`kimi_jax.serving.executor`) applies the ops in order to the device state and makes no decision of its
own. So the same plans, in the same order, give every process of a multi-host job the same programs with the same
inputs (JAX's multi-controller rule), and a plan is all process 0 has to send the others
(:mod:`kimi_jax.serving.multihost`).

A plan holds only ints (float sampling values travel as their float32 bits) and round-trips through one int32
buffer (:meth:`StepPlan.to_words` / :meth:`StepPlan.from_words`, or bytes): ``[MAGIC, step, n_words, op...]``, each
op ``[code, n_words, fields..., tail...]`` where the tail is the op's one variable-length list (a chunk's ids, pages,
decode rows, the constrained rows' token bitmasks of structured outputs). Snapshots and spilled pages are named by ids the scheduler hands out; the executor keeps what they
name (device arrays, or each process's own shards in host memory), so no array ever travels in a plan.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

MAGIC = 0x4B4A5350  # "KJSP"


class PlanError(ValueError):
    """A buffer that is not a well-formed plan (a bug, or two processes running different code)."""


def _buckets(lo: int, hi: int, factor: int = 2) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= factor
    return (*out, hi)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The engine's static shapes (every compiled program is one of them). ``buckets``: prefill chunk lengths
    (powers of two from ``min_chunk`` to ``chunk``); ``widths``: page-table widths a decode step reads (powers of 4
    pages up to ``pages_per_seq``); ``row_buckets``: decode batch sizes (powers of 4 up to ``slots``, or only
    ``slots`` when decode is not compacted); ``fresh_width``: the table width of a chunk that starts a sequence.
    ``batch_invariant``: one decode program (every slot, the whole page table) and prefix snapshots only on chunk
    boundaries, so that a request's numbers do not depend on what else runs (see the engine's docstring)."""

    slots: int
    max_len: int
    page_size: int
    n_pages: int
    chunk: int
    min_chunk: int
    snapshot_every: int
    compact_decode: bool = True
    batch_invariant: bool = False
    spec_k: int = 0  # speculative decoding: up to this many drafted tokens per slot and step (0: off)
    structured: bool = False  # structured outputs: every compute program also in its masked form

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_len // self.page_size)

    @property
    def buckets(self) -> tuple[int, ...]:
        return _buckets(min(self.min_chunk, self.chunk), self.chunk)

    @property
    def widths(self) -> tuple[int, ...]:
        return (self.pages_per_seq,) if self.batch_invariant else _buckets(1, self.pages_per_seq, 4)

    @property
    def row_buckets(self) -> tuple[int, ...]:
        return _buckets(1, self.slots, 4) if self.compact_decode and not self.batch_invariant else (self.slots,)

    @property
    def fresh_width(self) -> int:
        return self.width(-(-self.chunk // self.page_size))

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if n <= b)

    def width(self, pages: int) -> int:
        return next(w for w in self.widths if pages <= w)

    def rows(self, n: int) -> int:
        return next(b for b in self.row_buckets if n <= b)

    @property
    def verify_buckets(self) -> tuple[int, ...]:
        """Verify steps' batch sizes: one row (a lone request, speculative decoding's main case) or every slot (fewer
        programs to compile than the decode steps' buckets: each verify program is k + 1 positions wide)."""
        return (1, self.slots) if self.compact_decode and not self.batch_invariant and self.slots > 1 else \
            (self.slots,)

    def verify_rows(self, n: int) -> int:
        return next(b for b in self.verify_buckets if n <= b)


# -- ops ------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Op:
    code: ClassVar[int]
    tail: ClassVar[str | None] = None  # the name of the op's variable-length int field, if any


@dataclasses.dataclass(frozen=True)
class Admit(Op):
    """A request enters ``slot``: the sampling values every later chunk and decode step of the slot use."""

    code: ClassVar[int] = 1
    slot: int
    temperature: float
    top_k: int
    top_p: float
    seed: int


@dataclasses.dataclass(frozen=True)
class SetPages(Op):
    """Page-table entries ``[start, start + len(pages))`` of ``slot``'s row."""

    code: ClassVar[int] = 2
    tail: ClassVar[str] = "pages"
    slot: int
    start: int
    pages: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ClearRow(Op):
    """``slot`` left: its page-table row back to zeros."""

    code: ClassVar[int] = 3
    slot: int


@dataclasses.dataclass(frozen=True)
class Snapshot(Op):
    """Keep a copy of ``slot``'s KDA state and conv tails as snapshot ``snap`` (a prefix-cache entry)."""

    code: ClassVar[int] = 4
    slot: int
    snap: int


@dataclasses.dataclass(frozen=True)
class PutState(Op):
    """``slot`` continues from snapshot ``snap`` (device or host memory) at ``length`` tokens."""

    code: ClassVar[int] = 5
    slot: int
    snap: int
    length: int


@dataclasses.dataclass(frozen=True)
class SpillState(Op):
    """Move snapshot ``snap`` to host memory."""

    code: ClassVar[int] = 6
    snap: int


@dataclasses.dataclass(frozen=True)
class DropState(Op):
    code: ClassVar[int] = 7
    snap: int


@dataclasses.dataclass(frozen=True)
class CopyPage(Op):
    """Page ``src`` copied to ``dst`` in every attention layer's pool (copy on write of a shared partial page)."""

    code: ClassVar[int] = 8
    src: int
    dst: int


@dataclasses.dataclass(frozen=True)
class SpillPages(Op):
    """Copy ``pages`` to host memory as ``key`` (the scheduler then gives the pages back to the pool)."""

    code: ClassVar[int] = 9
    tail: ClassVar[str] = "pages"
    key: int
    pages: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class RestorePages(Op):
    """Write host copy ``key`` (from :class:`SpillPages`) into ``pages`` and forget it."""

    code: ClassVar[int] = 10
    tail: ClassVar[str] = "pages"
    key: int
    pages: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class DropPages(Op):
    code: ClassVar[int] = 11
    key: int


@dataclasses.dataclass(frozen=True)
class Prefill(Op):
    """One chunk of ``slot``'s prompt: ``ids`` at positions from ``start`` (0: the chunk starts the sequence),
    padded to ``bucket``, reading ``width`` entries of the slot's page-table row. ``ends``: the chunk ends the
    prompt (a draft model then drafts from the token it draws)."""

    code: ClassVar[int] = 12
    tail: ClassVar[str] = "ids"
    slot: int
    start: int
    bucket: int
    width: int
    ids: tuple[int, ...]
    ends: int = 0


@dataclasses.dataclass(frozen=True)
class Decode(Op):
    """One decode step over ``rows`` (slot indices; past the last slot: padding) or, with ``all_rows``, over every
    slot in order. Per row: the input token, the tokens its request has drawn (its sampling stream position) and
    whether it is live. ``width``: page-table entries read. ``draft``: whether a model drafter (a DSpark drafter, a
    draft model) drafts the next block after the step (it follows the step either way); 0 where the scheduler does
    not expect the next step to verify."""

    code: ClassVar[int] = 13
    tail: ClassVar[str] = "table"
    width: int
    all_rows: int
    draft: int
    table: tuple[int, ...]  # [4, B] flattened: rows, tokens, counts, live

    @classmethod
    def make(cls, width: int, rows, tokens, counts, live, all_rows: bool, draft: bool = True) -> "Decode":
        table = np.stack([np.asarray(rows), np.asarray(tokens), np.asarray(counts), np.asarray(live)]).astype(np.int64)
        return cls(width, int(all_rows), int(draft), tuple(table.reshape(-1).tolist()))

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(rows, tokens, counts int32 ``[B]``, live bool ``[B]``)."""
        t = np.asarray(self.table, np.int64).reshape(4, -1)
        return t[0].astype(np.int32), t[1].astype(np.int32), t[2].astype(np.int32), t[3].astype(bool)


@dataclasses.dataclass(frozen=True)
class Verify(Op):
    """One speculative step over ``rows`` (slot indices; past the last slot: padding) or, with ``all_rows``, over
    every slot in order: per row its ``k + 1`` input tokens (the last drawn, then the drafts), how many of the drafts
    are real, the tokens its request has drawn and whether it is live. ``width``: page-table entries read."""

    code: ClassVar[int] = 15
    tail: ClassVar[str] = "table"
    width: int
    k1: int
    all_rows: int
    table: tuple[int, ...]  # [k1 + 4, B] flattened: tokens (k1 rows), draft lengths, counts, live, rows

    @classmethod
    def make(cls, width: int, rows, tokens, dlen, counts, live, all_rows: bool) -> "Verify":
        tokens = np.asarray(tokens, np.int64)  # [B, k1]
        table = np.concatenate([tokens.T, np.stack([np.asarray(dlen), np.asarray(counts), np.asarray(live),
                                                    np.asarray(rows)])])
        return cls(width, tokens.shape[1], int(all_rows), tuple(table.astype(np.int64).reshape(-1).tolist()))

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(rows, tokens int32 ``[B, k1]``, draft lengths, counts int32 ``[B]``, live bool ``[B]``)."""
        t = np.asarray(self.table, np.int64).reshape(self.k1 + 4, -1)
        return (t[self.k1 + 3].astype(np.int32), t[: self.k1].T.astype(np.int32).copy(), t[self.k1].astype(np.int32),
                t[self.k1 + 1].astype(np.int32), t[self.k1 + 2].astype(bool))


@dataclasses.dataclass(frozen=True)
class Mask(Op):
    """The allowed-token bitmasks (structured outputs) of the compute op that follows in the plan: for each of
    ``rows`` of its rows (a position in a prefill's one row, a decode's rows, a verify's slots), ``k1`` masks (one per
    position: 1, or a verify's ``k + 1``) of ``n_words`` int32 words; rows it does not name are unconstrained."""

    code: ClassVar[int] = 16
    tail: ClassVar[str] = "data"
    rows: int
    k1: int
    n_words: int
    data: bytes  # int32 words, little-endian: the row indices, then the masks [rows, k1, n_words] (bytes, not a
    # tuple of ints: a K3 step's masks are ~5,000 words per row, which Python ints would make milliseconds to move)

    @classmethod
    def make(cls, rows, masks) -> "Mask":
        masks = np.asarray(masks, np.int32)  # [rows, k1, n_words]
        data = np.concatenate([np.asarray(rows, np.int32), masks.reshape(-1)]).astype("<i4").tobytes()
        return cls(len(rows), masks.shape[1], masks.shape[2], data)

    def full(self, n_rows: int) -> np.ndarray:
        """The masks of all ``n_rows`` rows, ``[n_rows, k1, n_words]`` (unnamed rows: every id allowed)."""
        data = np.frombuffer(self.data, "<i4")
        out = np.full((n_rows, self.k1, self.n_words), -1, np.int32)
        out[data[: self.rows]] = data[self.rows:].reshape(self.rows, self.k1, self.n_words)
        return out


@dataclasses.dataclass(frozen=True)
class Stop(Op):
    """The engine stopped: followers return."""

    code: ClassVar[int] = 14


OPS = {cls.code: cls for cls in (Admit, SetPages, ClearRow, Snapshot, PutState, SpillState, DropState, CopyPage,
                                 SpillPages, RestorePages, DropPages, Prefill, Decode, Verify, Stop, Mask)}
COMPUTE = (Prefill, Decode, Verify)  # the ops that run the model (at most one per plan: its result is the plan's)


def _f32_bits(x: float) -> int:
    return int(np.float32(x).view(np.int32))


def _bits_f32(w: int) -> float:
    return float(np.int32(w).view(np.float32))


def _encode(op: Op) -> np.ndarray:
    words = []
    for f in dataclasses.fields(op):
        if f.name == op.tail:
            continue
        v = getattr(op, f.name)
        if f.type in ("float", float):
            words.append(_f32_bits(v))
        elif f.name == "seed":  # a uint32
            words.append(int(np.uint32(v).view(np.int32)))
        else:
            words.append(int(v))
    tail = getattr(op, op.tail) if op.tail else ()
    tail = np.frombuffer(tail, "<i4") if isinstance(tail, bytes) else np.asarray(tail, np.int64)
    return np.concatenate([np.asarray([op.code, 2 + len(words) + len(tail), *words], np.int64), tail.astype(np.int64)])


def _decode(words: np.ndarray) -> Op:
    code = int(words[0])
    if code not in OPS:
        raise PlanError(f"unknown op code {code}")
    cls = OPS[code]
    fields = [f for f in dataclasses.fields(cls) if f.name != cls.tail]
    body = words[2:]
    if len(body) < len(fields):
        raise PlanError(f"{cls.__name__}: {len(body)} words, needs at least {len(fields)}")
    kw = {}
    for f, w in zip(fields, body):
        if f.type in ("float", float):
            kw[f.name] = _bits_f32(int(w))
        elif f.name == "seed":
            kw[f.name] = int(np.int32(w).view(np.uint32))
        else:
            kw[f.name] = int(w)
    if cls.tail:
        tail = body[len(fields):]
        raw = next(f for f in dataclasses.fields(cls) if f.name == cls.tail).type in ("bytes", bytes)
        kw[cls.tail] = tail.astype("<i4").tobytes() if raw else tuple(int(w) for w in tail)
    elif len(body) != len(fields):
        raise PlanError(f"{cls.__name__}: {len(body)} words, expected {len(fields)}")
    return cls(**kw)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """The ops of one engine step, applied in order; ``step`` numbers the plans (followers check the sequence)."""

    step: int
    ops: tuple[Op, ...]

    @property
    def compute(self) -> Op | None:
        return next((op for op in self.ops if isinstance(op, COMPUTE)), None)

    def to_words(self) -> np.ndarray:
        body = np.concatenate([np.zeros((0,), np.int64), *map(_encode, self.ops)])
        out = np.concatenate([np.asarray([MAGIC, self.step, 3 + len(body)], np.int64), body])
        if np.any(out > np.iinfo(np.int32).max) or np.any(out < np.iinfo(np.int32).min):
            raise PlanError("a plan value does not fit int32")
        return out.astype(np.int32)

    @classmethod
    def from_words(cls, words) -> "StepPlan":
        words = np.asarray(words, np.int32).reshape(-1)
        if len(words) < 3 or int(words[0]) != MAGIC:
            raise PlanError("not a step plan (bad magic)")
        n = int(words[2])
        if n > len(words) or n < 3:
            raise PlanError(f"step plan of {n} words in a buffer of {len(words)}")
        ops, i = [], 3
        while i < n:
            size = int(words[i + 1]) if i + 1 < n else 0
            if size < 2 or i + size > n:
                raise PlanError(f"op at word {i} claims {size} words (plan of {n})")
            ops.append(_decode(words[i : i + size]))
            i += size
        return cls(int(words[1]), tuple(ops))

    def to_bytes(self) -> bytes:
        return self.to_words().astype("<i4").tobytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> "StepPlan":
        if len(data) % 4:
            raise PlanError(f"a step plan is whole int32 words; got {len(data)} bytes")
        return cls.from_words(np.frombuffer(data, "<i4"))
