"""Serving on several processes (a multi-host mesh): process 0 schedules, every process executes the same plans.

JAX's multi-controller rule is that every process issues the same programs with the same inputs. Process 0 runs
the HTTP server and the scheduler; each of its :class:`~kimi_jax.serving.stepplan.StepPlan` s goes to every other
process before process 0 runs it itself, and each process's executor applies the plans in the same order. Sampled
tokens need no channel back: the compiled steps leave them replicated on every device, so process 0 reads them from
its own (:mod:`kimi_jax.serving.executor`).

**The channel** (:class:`PlanChannel`) is the key-value store of JAX's distributed runtime (the coordination service
:func:`jax.distributed.initialize` starts on process 0): plan ``n`` is written as bytes under
``kimi-jax/serve/plan/<n // 256>/<n>``, and every other process waits for that key. Measured on this repository's
CPU machine with two processes (``benchmarks/plan_channel.py``), a step's plan costs less through the store than
through a collective broadcast of a fixed-size buffer (``multihost_utils.broadcast_one_to_all``: a jitted psum
over every device), and the store adds no compiled program, does not wait on the device queue, and lets an idle
follower wait without a collective timing out. Old plans are deleted a directory at a time once every process has
run them (their progress rides on the heartbeats).

**Faults** (:class:`Watchdog`): every process writes a heartbeat to the store each second and reads everyone
else's. A process whose heartbeat stops for ``timeout`` seconds (dead, or stopped answering) is named on stderr and
every other process exits with status 1; process 0 first ends every request in flight with an error, so clients
get one instead of a hang. A step that fails on a collective (a peer died mid-step) waits for the watchdog's verdict
to name the peer. When process 0 itself dies, the distributed runtime ends the others at once ("the JAX distributed
service detected fatal errors ... another task died"). Every process starts watching at the same moment, after a
barrier that follows the warm-up (compile times differ between processes).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

import jax

from kimi_jax.serving.stepplan import StepPlan

KEY = "kimi-jax/serve"
DIRECTORY = 256  # plans per key-value directory (deleted in one call)


def _client():
    from jax._src.distributed import global_state  # the runtime's client: JAX's own checkpointing uses it too

    if global_state.client is None:
        raise RuntimeError("serving on several processes needs jax.distributed.initialize() first "
                           "(kimi_jax.parallel.distributed.initialize)")
    return global_state.client


def _timed_out(e: Exception) -> bool:
    return "DEADLINE_EXCEEDED" in str(e)


def say(message: str) -> None:
    print(f"kimi-jax serve: process {jax.process_index()}: {message}", file=sys.stderr, flush=True)


class PlanChannel:
    """Process 0's plans to every other process, in order (see the module docstring)."""

    def __init__(self):
        self.client = _client()
        self.deleted = 0  # directories below this one are gone

    @staticmethod
    def _key(step: int) -> str:
        return f"{KEY}/plan/{step // DIRECTORY}/{step}"

    def send(self, plan: StepPlan) -> None:
        self.client.key_value_set_bytes(self._key(plan.step), plan.to_bytes())

    def receive(self, step: int) -> StepPlan:
        """Plan ``step``, waiting as long as it takes (an idle server sends nothing; the watchdog ends a wait on a
        process that is gone)."""
        while True:
            try:
                data = self.client.blocking_key_value_get_bytes(self._key(step), 1000)
                break
            except Exception as e:  # noqa: BLE001 - the runtime raises one error type for every failure
                if not _timed_out(e):
                    raise
        plan = StepPlan.from_bytes(data)
        if plan.step != step:
            raise RuntimeError(f"plan {plan.step} arrived where plan {step} was due")
        return plan

    def forget(self, done: int) -> None:
        """Delete the plans every process has run (``done``: the lowest count of plans run)."""
        while (self.deleted + 1) * DIRECTORY <= done:
            self.client.key_value_delete(f"{KEY}/plan/{self.deleted}")
            self.deleted += 1


class Watchdog:
    """Heartbeats of every process through the distributed runtime's store (see the module docstring).

    ``progress()``: (plans run, compiles since warm-up) of this process, published with each heartbeat.
    ``on_lost(message)``: what this process does before it exits (process 0: fail the requests in flight).
    """

    def __init__(self, timeout: float, progress: Callable[[], tuple[int, int]], on_lost: Callable[[str], None],
                 channel: PlanChannel | None = None, interval: float = 1.0):
        self.client = _client()
        self.me, self.n = jax.process_index(), jax.process_count()
        self.timeout, self.interval = float(timeout), float(interval)
        self.progress, self.on_lost, self.channel = progress, on_lost, channel
        self.peers: dict[int, tuple[int, int]] = {}  # process -> (plans run, compiles since warm-up)
        self._seen: dict[int, tuple[str, float]] = {}  # process -> (last heartbeat value, when it changed)
        self._ok = time.monotonic()  # the last time the store answered
        self._beats = 0
        self._cause: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def start(self) -> "Watchdog":
        now = time.monotonic()
        self._ok = now
        self._seen = {p: ("", now) for p in range(self.n) if p != self.me}
        for target, name in ((self._poll, "beat"), (self._clock, "clock")):
            threading.Thread(target=target, name=f"kimi-jax-watchdog-{name}", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def failed(self, cause: str) -> None:
        """This process's step failed (``cause``): exit once the watchdog names the process that went away, or
        after ``timeout`` when none did."""
        with self._lock:
            self._cause = self._cause or cause
            self._failed_at = time.monotonic()

    def _poll(self) -> None:
        while not self._stop.wait(self.interval):
            self._beats += 1
            run, compiles = self.progress()
            try:
                self.client.key_value_set(f"{KEY}/beat/{self.me}", f"{self._beats} {run} {compiles}",
                                          allow_overwrite=True)
                values = dict(self.client.key_value_dir_get(f"{KEY}/beat/"))
            except Exception:  # noqa: BLE001 - judged by the clock: no answer for `timeout` seconds
                continue
            now = time.monotonic()
            self._ok = now
            for p in list(self._seen):
                value = values.get(f"{KEY}/beat/{p}")
                if value is not None and value != self._seen[p][0]:
                    self._seen[p] = (value, now)
                    _, run_p, compiles_p = (int(v) for v in value.split())
                    self.peers[p] = (run_p, compiles_p)
            if self.me == 0 and self.channel is not None and len(self.peers) == self.n - 1:
                try:
                    self.channel.forget(min(min(r for r, _ in self.peers.values()), run))
                except Exception:  # noqa: BLE001 - old plans kept one more second
                    pass

    def _clock(self) -> None:
        while not self._stop.wait(min(self.interval, 0.5)):
            now = time.monotonic()
            silent = [(p, now - t) for p, (_, t) in self._seen.items() if now - t > self.timeout]
            if silent:
                names = ", ".join(f"process {p}" for p, _ in silent)
                self._exit(f"{names} stopped answering (no heartbeat for {max(s for _, s in silent):.0f} s)")
            elif now - self._ok > self.timeout:
                self._exit(f"the distributed runtime's coordinator (process 0) has not answered for "
                           f"{now - self._ok:.0f} s")
            with self._lock:
                cause, since = self._cause, getattr(self, "_failed_at", now)
            if cause is not None and now - since > self.timeout:
                self._exit(f"a step failed and every process still answers: {cause}")

    def _exit(self, message: str) -> None:
        with self._lock:
            cause = self._cause
        if cause is not None and not message.startswith("a step failed"):
            message += f" (this process's step failed: {cause})"
        say(f"{message}; exiting")
        try:
            self.on_lost(message)
        finally:
            os._exit(1)


def ready_barrier(timeout_s: float = 3600) -> None:
    """Every process has warmed up (its compile time is its own): they start watching each other together."""
    _client().wait_at_barrier(f"{KEY}/ready", int(timeout_s * 1000))
