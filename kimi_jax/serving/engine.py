"""The serving engine: continuous batching over a paged cache, chunked prefill, and prefix caching that
snapshots KDA state.

* **Slots.** A fixed number of sequences in flight. A request waits in the queue until a slot is free and the page
  pool can hold its prompt plus ``max_tokens``; it leaves when it finishes (stop id, stop string, ``max_tokens``,
  cancelled). Every engine iteration runs at most one prefill chunk (of the oldest slot still prefilling) and then
  one decode step over every decoding slot, so a long prompt never stalls the others' tokens for more than a chunk.
* **Paged cache.** MLA latent / GQA key-value pages come from one pool per layer with a page table per slot
  (:func:`kimi_jax.model.cache.paged_cache`); KDA state and conv tails are per slot. Pages are reference counted:
  a slot and any number of prefix entries may hold the same page.
* **Prefix cache.** After every prefill chunk that ends on a snapshot boundary (multiples of ``snapshot_every``) or
  at the prompt's end, the slot's KDA state and conv tails are copied (:func:`kimi_jax.serving.steps.take_state`)
  and stored with the pages covering the prefix, keyed by the prefix's tokens. A new request restores the longest
  stored prefix of its prompt (leaving at least one token to prefill, which gives the first logits), copies the
  partly filled last page if the prefix ends inside one (copy on write), and prefills only the rest, chunks
  aligned to the same boundaries. Snapshots past ``prefix_cache_bytes`` spill to host memory (up to
  ``prefix_host_bytes``), oldest first; when the pool needs pages, the oldest entry's pages spill there too (their
  contents copied out, the pages given back; a later hit takes new pages and writes them back); entries are dropped
  least recently used past that budget, or when the pool needs pages and none can spill. A finished request is
  snapshotted too (its prompt and reply, but the last token): the prefix of the conversation's next turn.
* **Compiled shapes.** Decode programs per row bucket (powers of 4 up to all slots: a few active slots run a small
  batch) and page-table width (powers of 4 pages) (the longest active
  sequence's pages: short contexts do not read max_len's table), and one prefill program per chunk bucket, fresh
  and continued; :meth:`Engine.warmup` compiles them all, and :meth:`Engine.stats` reports any compile after that.

The engine runs on one thread; :meth:`Engine.submit` is thread-safe and returns a :class:`Handle` whose events can
be read from any thread (:meth:`Handle.events`) or from an asyncio loop (:meth:`Handle.aevents`).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
import queue
import threading
import time
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from kimi_jax.generation.generate import default_stop_ids, free_memory
from kimi_jax.model.cache import KDACache, paged_cache, paged_cache_shapes
from kimi_jax.parallel.sharding import paged_cache_shardings
from kimi_jax.serving import steps
from kimi_jax.serving.events import Completion, Event, Handle, Request
from kimi_jax.text.tokenizer import Tokenizer

__all__ = ["Engine", "EngineError", "Request", "Event", "Handle", "Completion"]


class EngineError(ValueError):
    """A request the engine refuses (named field, offending value, what would be valid), or an engine that stopped."""


def _prefix_key(tokens) -> bytes:
    return hashlib.blake2b(np.asarray(tokens, np.int32).tobytes(), digest_size=16).digest()


@dataclasses.dataclass
class _Entry:
    """A stored prefix: its length, the pages holding its attention cache, the KDA state after it (device arrays, or
    numpy arrays once spilled to host memory)."""

    length: int
    pages: list[int]
    state: tuple
    nbytes: int
    on_host: bool = False
    host_pages: list | None = None  # the pages' contents (numpy, per page) while they are in host memory
    page_nbytes: int = 0  # their bytes, counted in the host tier


class _Pages:
    """Host bookkeeping of the page pool: free list and reference counts."""

    def __init__(self, n: int):
        self.free = list(range(n - 1, -1, -1))
        self.refs = np.zeros((n,), np.int64)

    def take(self) -> int:
        page = self.free.pop()
        self.refs[page] = 1
        return page

    def hold(self, pages: Sequence[int]) -> None:
        for p in pages:
            self.refs[p] += 1

    def release(self, pages: Sequence[int]) -> None:
        for p in pages:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free.append(p)


class _PrefixCache:
    """Stored prefixes in least-recently-used order. KDA snapshots live in device memory up to ``budget`` bytes;
    past it the oldest spill to host memory (up to ``host_budget``), past that they are dropped. Their pages stay in
    the pool until the pool needs pages: then the oldest entry's pages move to host memory too
    (:meth:`spill_pages`, within ``host_budget``, through ``read_page``), or the entry is dropped (:meth:`evict`).
    A hit on an entry whose pages are on the host takes new pages and writes them back (the engine's ``_page_in``)."""

    def __init__(self, pages: _Pages, budget: int, host_budget: int = 0, read_page=None, page_bytes: int = 0):
        self.pages, self.budget, self.host_budget = pages, budget, host_budget
        self.read_page, self.page_bytes = read_page, page_bytes
        self.entries: "collections.OrderedDict[bytes, _Entry]" = collections.OrderedDict()
        self.nbytes = self.host_nbytes = 0
        self.evictions = self.spills = self.page_spills = self.page_restores = 0

    def lookup(self, prompt: list[int]) -> _Entry | None:
        """The longest stored prefix of ``prompt`` shorter than it (so at least one token is left to prefill)."""
        for n in sorted({e.length for e in self.entries.values()}, reverse=True):
            key = _prefix_key(prompt[:n])
            if n < len(prompt) and key in self.entries:
                self.entries.move_to_end(key)
                return self.entries[key]
        return None

    def insert(self, tokens: list[int], pages: list[int], state: tuple) -> None:
        key = _prefix_key(tokens)
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        nbytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(state))
        if nbytes > max(self.budget, self.host_budget):
            return
        self.pages.hold(pages)
        self.entries[key] = _Entry(len(tokens), list(pages), state, nbytes)
        self.nbytes += nbytes
        self._fit()

    def _fit(self) -> None:
        """Spill (or drop) the oldest device snapshots until the device tier fits, then drop the oldest spilled ones
        until the host tier fits."""
        for key in list(self.entries):
            if self.nbytes <= self.budget:
                break
            entry = self.entries[key]
            if entry.on_host:
                continue
            if entry.nbytes <= self.host_budget:
                entry.state, entry.on_host = jax.device_get(entry.state), True
                self.nbytes -= entry.nbytes
                self.host_nbytes += entry.nbytes
                self.spills += 1
            else:
                self._drop(key)
        for key in list(self.entries):
            if self.host_nbytes <= self.host_budget:
                break
            if self.entries[key].on_host or self.entries[key].host_pages is not None:
                self._drop(key)

    def _drop(self, key: bytes) -> None:
        entry = self.entries.pop(key)
        if entry.on_host:
            self.host_nbytes -= entry.nbytes
        else:
            self.nbytes -= entry.nbytes
        self.host_nbytes -= entry.page_nbytes
        entry.state = entry.host_pages = None
        self.evictions += 1
        self.pages.release(entry.pages)

    def evict(self, keep: _Entry | None = None) -> bool:
        """Drop the least recently used entry other than ``keep``; False when there is none."""
        key = next((k for k, e in self.entries.items() if e is not keep), None)
        if key is None:
            return False
        self._drop(key)
        return True

    def spill_pages(self, keep: _Entry | None = None) -> bool:
        """Move the pages of the least recently used entry (other than ``keep``) that holds a page no one else does,
        and whose pages fit the host tier, to host memory, and give its pages back to the pool; False when none
        can."""
        if self.read_page is None:
            return False
        for entry in self.entries.values():
            if entry is keep or not entry.pages or not any(self.pages.refs[p] == 1 for p in entry.pages):
                continue
            nbytes = len(entry.pages) * self.page_bytes
            if self.host_nbytes + nbytes > self.host_budget:
                continue
            entry.host_pages = [self.read_page(p) for p in entry.pages]
            self.pages.release(entry.pages)
            entry.pages, entry.page_nbytes = [], nbytes
            self.host_nbytes += nbytes
            self.page_spills += 1
            return True
        return False

    def clear(self) -> None:
        while self.evict():
            pass


@dataclasses.dataclass
class _Slot:
    """A request in a slot: where its prompt stands, its pages, what it has produced."""

    handle: Handle
    prompt: list[int]
    pos: int = 0  # tokens of this sequence in the cache
    pages: list[int] = dataclasses.field(default_factory=list)
    reserved: int = 0  # pages it may still take
    decoding: bool = False
    last: int = 0  # last sampled token: the next decode input
    out: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of ``text`` already handed out
    decoder: object = None


def _buckets(lo: int, hi: int, factor: int = 2) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= factor
    return (*out, hi)


class Engine:
    """Continuous batching for one :class:`~kimi_jax.model.KimiModel` (see the module docstring).

    ``slots``: sequences decoded together. ``max_len``: prompt + ``max_tokens`` of one request. ``page_size``:
    tokens per cache page (64 for MLA, as the peers use). ``pages``: pool size (default: every slot at ``max_len``,
    plus half as much again for the prefix cache). ``prefill_chunk``: the longest prefill call; shorter chunks run in
    power-of-two buckets from ``min_chunk``, each bucket two programs (fresh and continued) compiled at start.
    ``prefix_cache_bytes``: KDA-state bytes the prefix cache may keep in device memory, ``prefix_host_bytes`` in host
    memory (snapshots spill there, oldest first, and so do the cache pages of stored prefixes when the pool needs
    pages; both 0 turn prefix caching off). ``snapshot_every``: tokens between
    snapshots inside a prompt (a multiple of ``prefill_chunk``, the default; a K3 snapshot is ~0.43 GB of KDA state,
    so long system prompts may want fewer); every prompt's end and every finished reply are snapshotted too.
    ``compact_decode``: when few slots decode, run a decode batch of just those (row buckets of powers of 4).
    ``record_logits``: keep every step's float32 logits on the handles (tests).
    """

    def __init__(self, model, tokenizer: Tokenizer | None = None, *, slots: int = 8, max_len: int = 2048,
                 page_size: int = 64, pages: int | None = None, prefill_chunk: int = 256, min_chunk: int = 64,
                 prefix_cache_bytes: int = 1 << 30, prefix_host_bytes: int = 0, snapshot_every: int | None = None,
                 compact_decode: bool = True, record_logits: bool = False):
        for name, v in (("slots", slots), ("max_len", max_len), ("page_size", page_size),
                        ("prefill_chunk", prefill_chunk), ("min_chunk", min_chunk)):
            if int(v) < 1:
                raise EngineError(f"{name} must be >= 1, got {v}")
        snapshot_every = int(snapshot_every or prefill_chunk)
        if snapshot_every % prefill_chunk:
            raise EngineError(f"snapshot_every ({snapshot_every}) must be a multiple of prefill_chunk "
                              f"({prefill_chunk})")
        if prefill_chunk % page_size:
            raise EngineError(f"prefill_chunk ({prefill_chunk}) must be a multiple of page_size ({page_size}), so "
                              "that prefix snapshots fall on page boundaries")
        self.cfg, self.tokenizer, self.dtype = model.cfg, tokenizer, model.run.dtype
        self.graphdef, self.params = nnx.split(model)
        self.slots, self.max_len, self.page_size = int(slots), int(max_len), int(page_size)
        self.chunk, self.snapshot_every = int(prefill_chunk), snapshot_every
        self.buckets = _buckets(min(min_chunk, self.chunk), self.chunk)
        self.pages_per_seq = -(-self.max_len // self.page_size)
        # decode reads the page table up to a width (powers of 4 pages) covering the longest active sequence, so a
        # short context does not pay for max_len (a few decode programs); a fresh chunk's table covers one chunk
        self.widths = _buckets(1, self.pages_per_seq, 4)
        # decode rows: a few active slots run a smaller batch (off: every step runs all slots, so a request's numerics
        # do not depend on how many others decode beside it)
        self.row_buckets = _buckets(1, self.slots, 4) if compact_decode else (self.slots,)
        self.fresh_width = self._width(-(-self.chunk // self.page_size))
        self.n_pages = int(pages) if pages else self.slots * self.pages_per_seq * 3 // 2
        self.record = bool(record_logits)
        self.scan = model.run.scan_layers
        self.parallel = model.run.parallel
        self.shardings = None if self.parallel is None else paged_cache_shardings(
            self.cfg, self._shapes(), self.parallel.mesh, self.parallel.layout)
        self._check_fits()
        self.programs = steps.programs(self.graphdef, self.shardings)
        self.cache = self._new_cache()
        self.pool = _Pages(self.n_pages)
        page_bytes = sum(math.prod(a.shape) // self.n_pages * a.dtype.itemsize
                         for e, _ in steps._entries(self._shapes()) if not isinstance(e, KDACache)
                         for a in jax.tree.leaves(e))
        read_page = lambda p: jax.device_get(self.programs.take_page(self.cache, np.int32(p)))  # noqa: E731
        self.prefix = (_PrefixCache(self.pool, int(prefix_cache_bytes), int(prefix_host_bytes), read_page, page_bytes)
                       if prefix_cache_bytes or prefix_host_bytes else None)
        self.table = np.zeros((self.slots, self.pages_per_seq), np.int32)
        self.running: list[_Slot | None] = [None] * self.slots
        self.waiting: collections.deque[Handle] = collections.deque()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._accepting, self._thread, self._drain = True, None, True
        self._warm_compiles = None
        self.counters = collections.Counter(dict.fromkeys(
            ("prefix_hits", "prefix_misses", "prefix_hit_tokens", "prefill_chunks", "prefill_tokens", "decode_steps",
             "finished"), 0))

    def _shapes(self):
        return paged_cache_shapes(self.cfg, self.slots, self.n_pages, self.page_size, self.dtype, scan=self.scan)

    def _new_cache(self):
        if self.shardings is None:
            return paged_cache(self.cfg, self.slots, self.n_pages, self.page_size, self.dtype, scan=self.scan)
        zeros = lambda: jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), self._shapes())  # noqa: E731
        return jax.jit(zeros, out_shardings=self.shardings)()

    def _check_fits(self) -> None:
        """Refuse, before allocating, a cache larger than the memory free on the device holding the most of it."""
        leaves = jax.tree.leaves(self._shapes())
        if self.shardings is None:
            need, devices = sum(s.size * s.dtype.itemsize for s in leaves), jax.local_devices()[:1]
        else:
            shards = jax.tree.leaves(self.shardings)
            need = sum(math.prod(sh.shard_shape(s.shape)) * s.dtype.itemsize for s, sh in zip(leaves, shards))
            devices = jax.local_devices()
        free = min((f for f in map(free_memory, devices) if f is not None), default=None)
        if free is not None and need > free:
            raise EngineError(f"the paged cache ({self.slots} slots, {self.n_pages} pages of {self.page_size} tokens) "
                              f"needs {need / 1e9:.2f} GB per device but {free / 1e9:.2f} GB are free: lower slots, "
                              "max_len or pages")

    def default_stop_ids(self) -> list[int]:
        return default_stop_ids(self.tokenizer, self.cfg)

    # -- requests ---------------------------------------------------------------------------------------------

    def check(self, request: Request) -> Request:
        """``request`` validated and normalised (stop ids resolved, seed drawn); raises :class:`EngineError`."""
        V = self.cfg.vocab_size
        try:
            prompt = [int(t) for t in request.prompt]
        except (TypeError, ValueError):
            raise EngineError("prompt: must be a list of token ids") from None
        if not prompt:
            raise EngineError("prompt is empty (0 tokens)")
        bad = [t for t in prompt if not 0 <= t < V]
        if bad:
            raise EngineError(f"prompt: token ids {bad[:5]} outside the vocabulary 0..{V - 1}")
        if int(request.max_tokens) < 1:
            raise EngineError(f"max_tokens must be >= 1, got {request.max_tokens}")
        total = len(prompt) + int(request.max_tokens)
        context = self.cfg.max_position_embeddings
        if context is not None and total > context:
            raise EngineError(f"prompt ({len(prompt)} tokens) + max_tokens ({request.max_tokens}) = {total} exceeds "
                              f"the model's context of {context} tokens")
        if total > self.max_len:
            raise EngineError(f"prompt ({len(prompt)} tokens) + max_tokens ({request.max_tokens}) = {total} exceeds "
                              f"the engine's max_len of {self.max_len} tokens")
        if -(-total // self.page_size) > self.n_pages:
            raise EngineError(f"prompt + max_tokens = {total} tokens needs more pages than the pool holds "
                              f"({self.n_pages} of {self.page_size} tokens)")
        if not request.temperature >= 0 or request.temperature != request.temperature:
            raise EngineError(f"temperature must be >= 0, got {request.temperature}")
        if not 0 < request.top_p <= 1:
            raise EngineError(f"top_p must be in (0, 1], got {request.top_p}")
        if int(request.top_k) < 0:
            raise EngineError(f"top_k must be >= 0 (0: off), got {request.top_k}")
        seed = request.seed
        if seed is None:
            seed = int(np.random.default_rng().integers(0, 2**32))
        if not 0 <= int(seed) < 2**32:
            raise EngineError(f"seed must be in [0, 2**32), got {seed}")
        stop = self.default_stop_ids() if request.stop_ids is None else [int(s) for s in request.stop_ids]
        bad = [s for s in stop if not 0 <= s < V]
        if bad:
            raise EngineError(f"stop ids {bad} outside the vocabulary 0..{V - 1}")
        strings = tuple(str(s) for s in request.stop_strings if s)
        if strings and self.tokenizer is None:
            raise EngineError("stop strings need a tokenizer; this model has none (use stop ids)")
        return dataclasses.replace(request, prompt=prompt, max_tokens=int(request.max_tokens), seed=int(seed),
                                   stop_ids=tuple(stop), stop_strings=strings, top_k=int(request.top_k))

    def submit(self, request: Request) -> Handle:
        """Queue a request (thread-safe); raises :class:`EngineError` on bad input or when the engine stops."""
        if not self._accepting:
            raise EngineError("the engine is shutting down and takes no new requests")
        req = self.check(request)
        handle = Handle(req, lambda h: self._inbox.put(("cancel", h)))
        handle.timings["submitted"] = time.perf_counter()
        self._inbox.put(("submit", handle))
        return handle

    def generate(self, prompts: Sequence[Sequence[int]], timeout: float | None = None, **kw) -> list[Completion]:
        """Submit every prompt at once (``kw``: :class:`Request` fields) and wait for all: the engine's batch API."""
        handles = [self.submit(Request(prompt=list(p), **kw)) for p in prompts]
        if self._thread is None:
            while not all(h.finished for h in handles):
                self.step()
        return [h.result(timeout) for h in handles]

    # -- the loop -----------------------------------------------------------------------------------------------

    def start(self, warmup: bool = True) -> "Engine":
        """Compile every program (``warmup``) and start the engine thread."""
        if warmup:
            self.warmup()
        self._thread = threading.Thread(target=self._run, name="kimi-jax-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; with ``drain`` finish those in flight and queued, else abort them; join the thread."""
        self._accepting, self._drain = False, drain
        self._inbox.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        while True:
            busy = any(self.running) or self.waiting
            if not self._accepting and (not busy or not self._drain):
                self._abort_all("abort", None)
                return
            try:
                self._read_inbox(block=not busy)
                self.step()
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, the engine lives on
                self._abort_all("error", f"{type(e).__name__}: {e}")
                self._reset()

    def _read_inbox(self, block: bool) -> None:
        while True:
            try:
                kind, handle = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if kind == "submit":
                self.waiting.append(handle)
            elif kind == "cancel":
                self._cancel(handle)

    def step(self) -> None:
        """One iteration: read new requests (when no thread runs), admit, one prefill chunk, one decode step."""
        if self._thread is None:
            self._read_inbox(block=False)
        self._admit()
        pending = [i for i, s in enumerate(self.running) if s is not None and not s.decoding]
        if pending:
            self._prefill(min(pending, key=lambda i: self.running[i].handle.timings["submitted"]))
        if any(s is not None and s.decoding for s in self.running):
            self._decode()

    def _cancel(self, handle: Handle) -> None:
        if handle in self.waiting:
            self.waiting.remove(handle)
            handle.push(Event([], finish_reason="abort"))
            return
        for i, s in enumerate(self.running):
            if s is not None and s.handle is handle:
                self._finish(i, "abort")

    def _abort_all(self, reason: str, error: str | None) -> None:
        while self.waiting:
            self.waiting.popleft().push(Event([], finish_reason=reason, error=error))
        for i, s in enumerate(self.running):
            if s is not None:
                self._finish(i, reason, error)

    def _reset(self) -> None:
        """After a failed step the donated cache may be gone: a fresh cache, an empty pool and prefix cache."""
        self.cache = self._new_cache()
        self.pool = _Pages(self.n_pages)
        if self.prefix is not None:
            self.prefix = _PrefixCache(self.pool, self.prefix.budget, self.prefix.host_budget)

    # -- admission ----------------------------------------------------------------------------------------------

    def _available(self) -> int:
        return len(self.pool.free) - sum(s.reserved for s in self.running if s is not None)

    def _admit(self) -> None:
        """Move queued requests into free slots, oldest first, while the pool can hold them (evicting prefix entries
        when it must); a prefix hit restores its snapshot into the slot."""
        ps = self.page_size
        while self.waiting and None in self.running:
            handle = self.waiting[0]
            req = handle.request
            entry = self.prefix.lookup(req.prompt) if self.prefix is not None else None
            if entry is not None and entry.host_pages is not None and not self._page_in(entry):
                entry = None  # its pages would not fit now: a miss
            hit = entry.length if entry is not None else 0
            held = entry.pages[: -(-hit // ps)] if entry is not None else []
            self.pool.hold(held)  # kept through any eviction below
            need = -(-(len(req.prompt) + req.max_tokens) // ps) - hit // ps
            if not self._make_room(need, keep=entry):
                self.pool.release(held)
                return  # wait for a slot to finish
            self.waiting.popleft()
            i = self.running.index(None)
            s = self.running[i] = _Slot(handle, req.prompt, reserved=need)
            s.decoder = self.tokenizer.stream_decoder() if self.tokenizer is not None else None
            s.pages = held[: hit // ps]
            if entry is not None:
                self._restore(i, s, entry, held)
            handle.cached_tokens = s.pos
            handle.timings["admitted"] = time.perf_counter()
            self.counters["prefix_hits" if entry is not None else "prefix_misses"] += 1
            self.counters["prefix_hit_tokens"] += s.pos

    def _make_room(self, n: int, keep: _Entry | None) -> bool:
        """Whether ``n`` pages are free to take, after spilling (else dropping) stored prefixes other than ``keep``,
        least recently used first, as far as needed."""
        while self._available() < n and self.prefix is not None and (
                self.prefix.spill_pages(keep=keep) or self.prefix.evict(keep=keep)):
            pass
        return self._available() >= n

    def _page_in(self, entry: _Entry) -> bool:
        """Pages for ``entry``'s cache, spilled to host memory, written back from there; False when the pool cannot
        give that many (other entries spilled or dropped first)."""
        n = len(entry.host_pages)
        if not self._make_room(n, keep=entry):
            return False
        pages = [self.pool.take() for _ in range(n)]
        for page, data in zip(pages, entry.host_pages):
            self.cache = self.programs.put_page(self.cache, np.int32(page), data)
        self.prefix.host_nbytes -= entry.page_nbytes
        entry.pages, entry.host_pages, entry.page_nbytes = pages, None, 0
        self.prefix.page_restores += 1
        return True

    def _restore(self, i: int, s: _Slot, entry: _Entry, held: list[int]) -> None:
        """Slot ``i`` continues from ``entry``: its KDA state, its full pages shared, its partial page copied."""
        ps = self.page_size
        state = jax.device_put(entry.state) if entry.on_host else entry.state
        self.cache = self.programs.put_state(self.cache, np.int32(i), state, np.int32(entry.length))
        if entry.length % ps:
            page = self._take(s)
            self.cache = self.programs.copy_page(self.cache, np.int32(held[-1]), np.int32(page))
            self.pool.release(held[-1:])  # the copy is the slot's; the shared page stays with the entry
        s.pos = entry.length
        self._table_row(i, s)

    def _take(self, s: _Slot) -> int:
        page = self.pool.take()
        s.pages.append(page)
        s.reserved -= 1
        return page

    def _table_row(self, i: int, s: _Slot) -> None:
        self.table[i] = 0
        self.table[i, : len(s.pages)] = s.pages

    def _cover(self, i: int, s: _Slot, end: int) -> None:
        """Pages for slot ``i``'s positions ``[0, end)``."""
        grew = False
        while len(s.pages) * self.page_size < end:
            self._take(s)
            grew = True
        if grew:
            self._table_row(i, s)

    def _sampling(self, slots: Sequence[int | None]) -> steps.SlotSampling:
        reqs = [None if i is None or self.running[i] is None else self.running[i] for i in slots]
        f = lambda get, fill, dt: np.array([fill if s is None else get(s) for s in reqs], dt)  # noqa: E731
        return steps.SlotSampling(
            temperature=f(lambda s: s.handle.request.temperature, 0.0, np.float32),
            top_k=f(lambda s: s.handle.request.top_k, 0, np.int32),
            top_p=f(lambda s: s.handle.request.top_p, 1.0, np.float32),
            seed=f(lambda s: s.handle.request.seed, 0, np.uint32),
            count=f(lambda s: len(s.out), 0, np.int32))

    # -- running --------------------------------------------------------------------------------------------------

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if n <= b)

    def _width(self, pages: int) -> int:
        return next(w for w in self.widths if pages <= w)

    def _rows(self, n: int) -> int:
        return next(b for b in self.row_buckets if n <= b)

    def _prefill(self, i: int) -> None:
        """The next chunk of slot ``i``'s prompt: up to the next multiple of ``prefill_chunk`` (or the prompt's end)."""
        s = self.running[i]
        start, L = s.pos, len(s.prompt)
        end = min(L, (start // self.chunk + 1) * self.chunk)
        n = end - start
        self._cover(i, s, end)
        ids = np.zeros((1, self._bucket(n)), np.int32)
        ids[0, :n] = s.prompt[start:end]
        width = self.fresh_width if start == 0 else self.pages_per_seq
        self.cache, tok, logp, logits = self.programs.prefill_chunk(
            self.params, self.cache, self.table[i : i + 1, :width], np.int32(i), ids, np.int32(n),
            self._sampling([i]), fresh=start == 0, record=self.record)
        s.pos = end
        self.counters["prefill_chunks"] += 1
        self.counters["prefill_tokens"] += n
        if self.prefix is not None and (end % self.snapshot_every == 0 or end == L):
            pages = s.pages[: -(-end // self.page_size)]
            self.prefix.insert(s.prompt[:end], pages, self.programs.take_state(self.cache, np.int32(i)))
        if end == L:
            s.decoding = True
            s.handle.timings["first_token"] = time.perf_counter()
            self._accept(i, int(np.asarray(tok)[0]), float(np.asarray(logp)[0]),
                         None if logits is None else np.asarray(logits)[0])

    def _decode(self) -> None:
        """One decode step for the decoding slots: over all slots, or, when few decode, over a bucket of rows (powers
        of 4) holding just them."""
        active = [i for i, s in enumerate(self.running) if s is not None and s.decoding]
        for i in active:
            self._cover(i, self.running[i], self.running[i].pos + 1)
        b = self._rows(len(active))
        rows = list(range(self.slots)) if b == self.slots else active + [self.slots] * (b - len(active))
        live = np.array([r < self.slots and self.running[r] is not None and self.running[r].decoding for r in rows])
        tokens = np.array([self.running[r].last if ok else 0 for r, ok in zip(rows, live)], np.int32)
        width = self._width(max(len(self.running[i].pages) for i in active))
        table = np.zeros((b, width), np.int32)
        table[live] = self.table[[r for r, ok in zip(rows, live) if ok], :width]
        self.cache, tok, logp, logits = self.programs.decode_step(
            self.params, self.cache, table, tokens, live,
            self._sampling([r if ok else None for r, ok in zip(rows, live)]),
            None if b == self.slots else np.array(rows, np.int32), record=self.record)
        tok, logp = np.asarray(tok), np.asarray(logp)
        logits = None if logits is None else np.asarray(logits)
        self.counters["decode_steps"] += 1
        for k in np.flatnonzero(live):
            i = rows[k]
            self.running[i].pos += 1
            self._accept(i, int(tok[k]), float(logp[k]), None if logits is None else logits[k])

    def _accept(self, i: int, tok: int, logp: float, logits) -> None:
        """Slot ``i`` drew ``tok``: hand it out (with its text, stop strings held back until they cannot match),
        and finish the request on a stop id, a stop string or its token budget."""
        s = self.running[i]
        req = s.handle.request
        s.out.append(tok)
        s.last = tok
        if logits is not None:
            s.handle.logits.append(logits)
        reason = "stop" if tok in req.stop_ids else None
        if reason is None and s.decoder is not None:
            s.text += s.decoder.push([tok])
        if reason is None and len(s.out) >= req.max_tokens:
            reason = "length"
        if reason is not None and s.decoder is not None:
            s.text += s.decoder.flush()
        hold = 0
        if req.stop_strings:
            cut = _find_stop(s.text, req.stop_strings, max(0, s.sent - max(map(len, req.stop_strings))))
            if cut is not None:
                s.text, reason = s.text[:cut], "stop"
            hold = max(map(len, req.stop_strings)) - 1
        upto = len(s.text) if reason is not None else max(s.sent, len(s.text) - hold)
        delta, s.sent = s.text[s.sent : upto], upto
        s.handle.push(Event([tok], [logp] if req.logprobs else None, delta, reason))
        if reason is not None:
            if self.prefix is not None and len(s.out) > 1:  # the conversation so far: a follow-up turn's prefix
                fed = s.prompt + s.out[:-1]  # the last token drawn never entered the cache
                self.prefix.insert(fed, s.pages[: -(-len(fed) // self.page_size)],
                                   self.programs.take_state(self.cache, np.int32(i)))
            self._release(i)

    def _finish(self, i: int, reason: str, error: str | None = None) -> None:
        self.running[i].handle.push(Event([], finish_reason=reason, error=error))
        self._release(i)

    def _release(self, i: int) -> None:
        s = self.running[i]
        s.handle.timings["finished"] = time.perf_counter()
        self.pool.release(s.pages)
        self.running[i] = None
        self.table[i] = 0
        self.counters["finished"] += 1

    # -- compiled programs ------------------------------------------------------------------------------------

    def warmup(self) -> None:
        """Compile every program the engine runs (one decode step, each prefill bucket fresh and continued, the
        snapshot functions) on an idle slot, so serving never compiles."""
        if any(self.running):
            raise EngineError("warmup needs an idle engine")
        samp = self._sampling([None])
        for T in self.buckets:
            for width, fresh in ((self.fresh_width, True), (self.pages_per_seq, False)):
                self.cache, *_ = self.programs.prefill_chunk(
                    self.params, self.cache, self.table[:1, :width], np.int32(0),
                    np.zeros((1, T), np.int32), np.int32(0), samp, fresh=fresh, record=self.record)
        for b in self.row_buckets:
            rows = None if b == self.slots else np.full((b,), self.slots, np.int32)
            for width in self.widths:
                self.cache, *_ = self.programs.decode_step(
                    self.params, self.cache, np.zeros((b, width), np.int32), np.zeros((b,), np.int32),
                    np.zeros((b,), bool), self._sampling([None] * b), rows, record=self.record)
        state = self.programs.take_state(self.cache, np.int32(0))
        self.cache = self.programs.put_state(self.cache, np.int32(0), state, np.int32(0))
        self.cache = self.programs.copy_page(self.cache, np.int32(0), np.int32(0))
        self.cache = self.programs.put_page(self.cache, np.int32(0),
                                            jax.device_get(self.programs.take_page(self.cache, np.int32(0))))
        jax.block_until_ready(self.cache)
        self._warm_compiles = steps.backend_compiles()

    def stats(self) -> dict:
        """Slots in use, queue length, pages free, prefix-cache counts, and XLA compilations in this process since
        :meth:`warmup` (any jitted function's: run nothing else beside the engine to read it as the engine's)."""
        compiled = steps.backend_compiles()
        return {
            "slots": self.slots, "slots_busy": sum(s is not None for s in self.running), "waiting": len(self.waiting),
            "pages": self.n_pages, "pages_free": len(self.pool.free),
            "prefix_entries": 0 if self.prefix is None else len(self.prefix.entries),
            "prefix_bytes": 0 if self.prefix is None else self.prefix.nbytes,
            "prefix_evictions": 0 if self.prefix is None else self.prefix.evictions,
            "prefix_host_bytes": 0 if self.prefix is None else self.prefix.host_nbytes,
            "prefix_spills": 0 if self.prefix is None else self.prefix.spills,
            "prefix_page_spills": 0 if self.prefix is None else self.prefix.page_spills,
            "prefix_page_restores": 0 if self.prefix is None else self.prefix.page_restores,
            "compiles_after_warmup": None if self._warm_compiles is None else compiled - self._warm_compiles,
            **self.counters,
        }


def _find_stop(text: str, stops: Sequence[str], start: int) -> int | None:
    """Index of the earliest stop string in ``text`` at or after ``start``, or None."""
    hits = [j for j in (text.find(st, start) for st in stops) if j >= 0]
    return min(hits) if hits else None
