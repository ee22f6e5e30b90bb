"""What goes into the serving engine and what comes out: :class:`Request`, :class:`Event`, :class:`Handle`."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
from typing import Callable, Iterator

import numpy as np

FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclasses.dataclass
class Request:
    """One generation request. ``stop_ids=None``: the model's default stop ids (the chat turn terminator); ``()``:
    none. ``seed=None``: a fresh random seed. ``logprobs``: report the log-probability of every chosen token (the
    model's, before any constraint). ``constraint``: a :class:`~kimi_jax.text.grammar.Grammar` the output must match
    (an engine started with ``structured=True``). ``speculative=False``: no drafts for this request on an engine
    that drafts (its other requests still draft)."""

    prompt: list[int]
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_ids: tuple[int, ...] | None = None
    stop_strings: tuple[str, ...] = ()
    logprobs: bool = False
    constraint: object = None  # a kimi_jax.text.grammar.Grammar: what the output must match (structured outputs)
    speculative: bool = True


@dataclasses.dataclass
class Event:
    """New output of a request since its previous event. ``tokens`` include a final stop id; ``text`` leaves stop ids
    and stop strings out ('' without a tokenizer). ``finish_reason``: None while running, else one of
    "stop" | "length" | "abort" (cancelled) | "error" (``error`` says what)."""

    tokens: list[int]
    logprobs: list[float] | None = None
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None


@dataclasses.dataclass
class Completion:
    """A finished request, gathered from its events (:meth:`Handle.result`)."""

    tokens: list[int]
    text: str
    finish_reason: str
    logprobs: list[float] | None
    logits: np.ndarray | None  # [n, V] float32 when the engine records logits
    prompt_tokens: int
    cached_tokens: int  # prompt tokens restored from the prefix cache
    timings: dict


_ids = itertools.count()


class Handle:
    """A submitted request: its events, readable from one thread (:meth:`events`) or one asyncio loop
    (:meth:`aevents`); :meth:`cancel` ends it (the engine frees its slot and pages)."""

    def __init__(self, request: Request, on_cancel: Callable[["Handle"], None]):
        self.id = f"req-{next(_ids)}"
        self.request = request
        self.prompt_tokens = len(request.prompt)
        self.cached_tokens = 0
        self.logits: list[np.ndarray] = []
        self.timings: dict = {}
        self.cancelled = False
        self._on_cancel = on_cancel
        self._events: list[Event] = []
        self._cond = threading.Condition()
        self._waker: tuple | None = None  # (loop, asyncio.Event) of an async reader
        self.finished = False

    # -- engine side
    def push(self, event: Event) -> None:
        with self._cond:
            self._events.append(event)
            if event.finish_reason is not None:
                self.finished = True
            self._cond.notify_all()
            waker = self._waker
        if waker is not None:
            loop, flag = waker
            try:
                loop.call_soon_threadsafe(flag.set)
            except RuntimeError:  # the reader's loop has closed
                pass

    # -- reader side
    def cancel(self) -> None:
        if not self.cancelled and not self.finished:
            self.cancelled = True
            self._on_cancel(self)

    def _take(self) -> list[Event]:
        with self._cond:
            out, self._events = self._events, []
            return out

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """Events as they come, ending after the one with a ``finish_reason``."""
        while True:
            with self._cond:
                if not self._events and not self._cond.wait_for(lambda: bool(self._events), timeout):
                    raise TimeoutError(f"{self.id}: no event in {timeout} s")
            for ev in self._take():
                yield ev
                if ev.finish_reason is not None:
                    return

    async def aevents(self):
        """The same as :meth:`events`, for an asyncio loop (never blocks it)."""
        flag = asyncio.Event()
        with self._cond:
            self._waker = (asyncio.get_running_loop(), flag)
        while True:
            batch = self._take()
            if not batch:
                await flag.wait()
                flag.clear()
                continue
            for ev in batch:
                yield ev
                if ev.finish_reason is not None:
                    return

    def result(self, timeout: float | None = None) -> Completion:
        """Wait for the end and gather every event."""
        tokens, logprobs, text, reason, error = [], [], "", None, None
        for ev in self.events(timeout):
            tokens += ev.tokens
            if ev.logprobs is not None:
                logprobs += ev.logprobs
            text += ev.text
            reason, error = ev.finish_reason, ev.error
        if reason == "error":
            raise RuntimeError(f"{self.id}: {error}")
        return Completion(tokens, text, reason, logprobs if self.request.logprobs else None,
                          np.stack(self.logits) if self.logits else None, self.prompt_tokens, self.cached_tokens,
                          dict(self.timings))
