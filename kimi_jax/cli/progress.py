"""What a command says while it waits: loading a model, compiling its programs (which one, n of m, how long so far).

A cold start compiles several XLA programs, each for seconds (the demo model on a CPU) to minutes (a K3 slice on a
pod), and a command that prints nothing meanwhile looks hung. :class:`Status` keeps one line on stderr: on a terminal
it is rewritten every second with the elapsed time; in a log or a pipe it is printed when the stage changes and
again every ``every`` seconds of a long wait, so a log shows progress without a line per second.

:func:`watch_compiles` names the programs as JAX compiles them. Generation compiles lazily inside ``jax.jit`` on the
first request, so it is told from JAX's own monitoring events (a function traced, then compiled by the backend),
not from hooks inside :mod:`kimi_jax.generation`: any program a jitted function of that name compiles is reported,
however the generator is arranged. The serving engine compiles a known list of programs up front and reports each
itself (:meth:`kimi_jax.serving.engine.Engine.warmup`'s ``progress``).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Sequence

from jax import monitoring

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"  # a function traced (lowering and compiling come next)
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # the backend compiled it (or read it from the cache)
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"

# generation's jitted functions (kimi_jax.generation.generate), as a user reads them; other jitted helpers (array
# creation, small reductions) compile in milliseconds and are not reported
GENERATION_PROGRAMS = {"prefill": "prefill", "prefill_chunk": "prefill chunk", "restart": "cache restart",
                       "first_token": "first token", "decode": "decode loop"}


def _elapsed(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds < 60 else f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


class Status:
    """One status line on ``stream`` (default stderr) for a wait, prefixed with ``prefix``. :meth:`set` starts a
    stage, :meth:`close` ends the line. On a terminal a thread rewrites the line every second with the stage's
    elapsed time; elsewhere each stage is printed once, and again every ``every`` seconds while it lasts."""

    def __init__(self, prefix: str, stream=None, every: float = 30.0, tty: bool | None = None):
        self.prefix, self.stream, self.every = prefix, stream or sys.stderr, every
        self.tty = self.stream.isatty() if tty is None else tty
        self.text, self.since, self.shown = "", time.monotonic(), 0.0
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._tick, daemon=True, name="kimi-jax-status")
        self._thread.start()

    def set(self, text: str) -> None:
        with self._lock:
            self.text, self.since = text, time.monotonic()
            self._show()

    def _show(self) -> None:  # under the lock
        waited = time.monotonic() - self.since
        line = f"{self.prefix}{self.text}" + (f" {_elapsed(waited)}" if waited >= 1 else "")
        if self.tty:
            self.stream.write("\r\x1b[K" + line)  # back to the line's start, clear it, write
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self.shown = time.monotonic()

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            with self._lock:
                if self.text and (self.tty or time.monotonic() - self.shown >= self.every):
                    self._show()

    def close(self, final: str | None = None) -> None:
        """Stop the ticking; print ``final`` (a line of its own) if given."""
        self._stop.set()
        self._thread.join()
        with self._lock:
            if self.tty and self.text:
                self.stream.write("\r\x1b[K")
            if final:
                self.stream.write(f"{self.prefix}{final}\n")
            self.stream.flush()
            self.text = ""


class CompileWatch:
    """Counts and names the programs compiled while it is active (see :func:`watch_compiles`)."""

    def __init__(self, status: Status, names: dict[str, str], expected: int):
        self.status, self.names, self.expected = status, names, expected
        self.done: list[tuple[str, float]] = []  # (program, seconds from traced to compiled)
        self.cache_hits = 0
        self._current: tuple[str, float] | None = None

    def _traced(self, event: str, duration: float, fun_name: str = "", **_) -> None:
        if event == TRACE_EVENT and fun_name in self.names:
            self._current = (self.names[fun_name], time.monotonic())
            n = len(self.done) + 1
            self.status.set(f"compiling {self._current[0]} (program {n} of {max(self.expected, n)})...")
        elif event == COMPILE_EVENT and self._current is not None and fun_name.removeprefix("jit(").rstrip(")") \
                in self.names:
            name, start = self._current
            self.done.append((name, time.monotonic() - start))
            self._current = None

    def _event(self, event: str, **_) -> None:
        if event == CACHE_HIT_EVENT and self._current is not None:
            self.cache_hits += 1

    def summary(self) -> str:
        if not self.done:
            return ""
        each = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in self.done)
        hits = f"; {self.cache_hits} read from the compilation cache" if self.cache_hits else ""
        return f"compiled {len(self.done)} program(s) in {sum(s for _, s in self.done):.1f}s ({each}{hits})"


@contextlib.contextmanager
def watch_compiles(status: Status, names: dict[str, str] | None = None, expected: Sequence[str] = ()):
    """Report on ``status`` each program of ``names`` (jitted function name -> what to call it; default: generation's)
    that JAX compiles inside the block, numbered ``n of m`` (m: the ``expected`` programs, or more as they come).
    Yields the :class:`CompileWatch` (its :meth:`~CompileWatch.summary` says what was compiled)."""
    watch = CompileWatch(status, GENERATION_PROGRAMS if names is None else names, len(expected))
    monitoring.register_event_duration_secs_listener(watch._traced)
    monitoring.register_event_listener(watch._event)
    try:
        yield watch
    finally:
        monitoring.unregister_event_duration_listener(watch._traced)
        monitoring.unregister_event_listener(watch._event)
