"""The scheduler's books of device memory: the page pool (free list, reference counts) and the prefix cache (which
token prefixes are stored, where their KDA snapshots and cache pages are). Host bookkeeping only: every move of
device data is an op (:mod:`kimi_jax.serving.stepplan`) handed to ``emit``, for the executor to run in order.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Callable, Iterator, Sequence

import numpy as np

from kimi_jax.serving.stepplan import DropPages, DropState, Op, Snapshot, SpillPages, SpillState


def prefix_key(tokens) -> bytes:
    return hashlib.blake2b(np.asarray(tokens, np.int32).tobytes(), digest_size=16).digest()


class PagePool:
    """Free list and reference counts of the pool's pages."""

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


@dataclasses.dataclass
class PrefixEntry:
    """A stored prefix: its length, the pages holding its attention cache, its KDA snapshot (id ``snap``, in device
    memory or, ``on_host``, in host memory)."""

    length: int
    pages: list[int]
    snap: int
    nbytes: int
    on_host: bool = False
    host_pages: int | None = None  # the id of the pages' host copy while they are in host memory
    host_count: int = 0  # how many pages that copy holds
    page_nbytes: int = 0  # their bytes, counted in the host tier


class PrefixCache:
    """Stored prefixes in least-recently-used order. KDA snapshots live in device memory up to ``budget`` bytes;
    past it the oldest spill to host memory (up to ``host_budget``), past that they are dropped. Their pages stay in
    the pool until the pool needs pages: then the oldest entry's pages move to host memory too (:meth:`spill_pages`,
    within ``host_budget``), or the entry is dropped (:meth:`evict`). A hit on an entry whose pages are on the host
    takes new pages and writes them back (the scheduler's page-in). ``snap_bytes`` / ``page_bytes``: one snapshot's
    and one page's bytes; ``ids``: where snapshot and host-copy ids come from."""

    def __init__(self, pages: PagePool, budget: int, host_budget: int, snap_bytes: int, page_bytes: int,
                 emit: Callable[[Op], None], ids: Iterator[int]):
        self.pages, self.budget, self.host_budget = pages, budget, host_budget
        self.snap_bytes, self.page_bytes, self.emit, self.ids = snap_bytes, page_bytes, emit, ids
        self.entries: "collections.OrderedDict[bytes, PrefixEntry]" = collections.OrderedDict()
        self.nbytes = self.host_nbytes = 0
        self.evictions = self.spills = self.page_spills = self.page_restores = 0

    def lookup(self, prompt: list[int]) -> PrefixEntry | None:
        """The longest stored prefix of ``prompt`` shorter than it (so at least one token is left to prefill)."""
        for n in sorted({e.length for e in self.entries.values()}, reverse=True):
            key = prefix_key(prompt[:n])
            if n < len(prompt) and key in self.entries:
                self.entries.move_to_end(key)
                return self.entries[key]
        return None

    def insert(self, tokens: list[int], pages: list[int], slot: int) -> None:
        """Store ``tokens`` (their cache in ``pages``), snapshotting ``slot``'s KDA state now."""
        key = prefix_key(tokens)
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        if self.snap_bytes > max(self.budget, self.host_budget):
            return
        snap = next(self.ids)
        self.emit(Snapshot(slot, snap))
        self.pages.hold(pages)
        self.entries[key] = PrefixEntry(len(tokens), list(pages), snap, self.snap_bytes)
        self.nbytes += self.snap_bytes
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
                self.emit(SpillState(entry.snap))
                entry.on_host = True
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
        self.emit(DropState(entry.snap))
        if entry.host_pages is not None:
            self.emit(DropPages(entry.host_pages))
        self.host_nbytes -= entry.page_nbytes
        self.evictions += 1
        self.pages.release(entry.pages)

    def evict(self, keep: PrefixEntry | None = None) -> bool:
        """Drop the least recently used entry other than ``keep``; False when there is none."""
        key = next((k for k, e in self.entries.items() if e is not keep), None)
        if key is None:
            return False
        self._drop(key)
        return True

    def spill_pages(self, keep: PrefixEntry | None = None) -> bool:
        """Move the pages of the least recently used entry (other than ``keep``) that holds a page no one else does,
        and whose pages fit the host tier, to host memory, and give its pages back to the pool; False when none
        can."""
        for entry in self.entries.values():
            if entry is keep or not entry.pages or not any(self.pages.refs[p] == 1 for p in entry.pages):
                continue
            nbytes = len(entry.pages) * self.page_bytes
            if self.host_nbytes + nbytes > self.host_budget:
                continue
            entry.host_pages = next(self.ids)
            self.emit(SpillPages(entry.host_pages, tuple(entry.pages)))
            self.pages.release(entry.pages)
            entry.pages, entry.page_nbytes, entry.host_count = [], nbytes, len(entry.pages)
            self.host_nbytes += nbytes
            self.page_spills += 1
            return True
        return False

    def restored(self, entry: PrefixEntry, pages: list[int]) -> None:
        """``entry``'s pages are back in device memory, in ``pages`` (the caller emitted the copy)."""
        self.host_nbytes -= entry.page_nbytes
        entry.pages, entry.host_pages, entry.page_nbytes, entry.host_count = pages, None, 0, 0
        self.page_restores += 1

    def clear(self) -> None:
        while self.evict():
            pass
