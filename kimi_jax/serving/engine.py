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
  at the prompt's end, the slot's KDA state and conv tails are copied and stored with the pages covering the
  prefix, keyed by the prefix's tokens. A new request restores the longest stored prefix of its prompt (leaving at
  least one token to prefill, which gives the first logits), copies the partly filled last page if the prefix ends
  inside one (copy on write), and prefills only the rest, chunks aligned to the same boundaries. Snapshots past
  ``prefix_cache_bytes`` spill to host memory (up to ``prefix_host_bytes``), oldest first; when the pool needs
  pages, the oldest entry's pages spill there too (their contents copied out, the pages given back; a later hit
  takes new pages and writes them back); entries are dropped least recently used past that budget, or when the pool
  needs pages and none can spill. A finished request is snapshotted too (its prompt and reply, but the last token):
  the prefix of the conversation's next turn.
* **Compiled shapes.** Decode programs per row bucket (powers of 4 up to all slots: a few active slots run a small
  batch) and page-table width (powers of 4 pages covering the longest active sequence: short contexts do not read
  max_len's table), and one prefill program per chunk bucket, fresh and continued; :meth:`Engine.warmup` compiles
  them all, and :meth:`Engine.stats` reports any compile after that.

The engine is cut in two along the line between deciding and running. The :class:`~kimi_jax.serving.scheduler.
Scheduler` makes every host decision and writes each step down as a small serializable
:class:`~kimi_jax.serving.stepplan.StepPlan`; the :class:`~kimi_jax.serving.executor.Executor` applies plans to the
device state with the compiled functions of :mod:`kimi_jax.serving.steps`. On several processes (a multi-host mesh)
process 0 schedules and sends each plan to the others before running it (:mod:`kimi_jax.serving.multihost`); they
run :meth:`Engine.follow`. One process is the same code without the sending.

This class is the facade: request checks (:mod:`kimi_jax.serving.validate`), the engine thread, warm-up and stats.
:meth:`Engine.submit` is thread-safe and returns a :class:`Handle` whose events can be read from any thread
(:meth:`Handle.events`) or from an asyncio loop (:meth:`Handle.aevents`).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Sequence

import jax
import numpy as np

from kimi_jax.generation import speculative as speculative_mod
from kimi_jax.generation.generate import default_stop_ids
from kimi_jax.serving import multihost, steps
from kimi_jax.serving.events import Completion, Event, Handle, Request
from kimi_jax.serving.executor import CacheTooLarge, Executor
from kimi_jax.serving.multihost import PlanChannel
from kimi_jax.serving.scheduler import Scheduler
from kimi_jax.serving.stepplan import StepPlan, Stop
from kimi_jax.serving.validate import EngineError, EngineStopped, check_request
from kimi_jax.serving.validate import shapes as engine_shapes
from kimi_jax.text.tokenizer import Tokenizer

__all__ = ["Engine", "EngineError", "EngineStopped", "Request", "Event", "Handle", "Completion"]


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
    ``batch_invariant``: each request's numbers independent of the others in flight: one decode program over every
    slot and the whole page table (the programs for fewer rows or a narrower table round differently in bfloat16),
    and prefix hits only from snapshots on chunk boundaries taken by prefills (a hit then continues with the chunks
    a cold prefill runs). Greedy output is then the same alone or under load, in any dtype; its cost is every
    decode step at full width (``benchmarks/serve.py --batch-invariant``). With a drafter every decode step is a
    verify step over every slot (one program; what a request drafts depends on its own text alone).
    ``record_logits``: keep every step's float32 logits on the handles (tests). ``peer_timeout``: on several
    processes, seconds without a heartbeat after which a process counts as gone (:mod:`kimi_jax.serving.multihost`).
    ``speculative``: a drafter (:mod:`kimi_jax.generation.speculative`): ``"ngram[:k=4,max_n=3,min_n=1]"``, the
    scheduler drafts each decoding slot's next tokens from its prompt and reply (prompt lookup); or
    ``"dspark:PATH[,k=N]"`` (or a :class:`~kimi_jax.generation.speculative.DSpark`), a DSpark drafter on the device
    whose context pools share the cache's pages (prefix hits and spills carry them): every compute step also drafts
    each row's next block (:func:`kimi_jax.serving.steps.draft_step`); or ``"draft:PATH[,k=N]"`` (or a
    :class:`~kimi_jax.generation.speculative.DraftModel`), a smaller model of the family with its own paged cache on
    the same page table (prefix snapshots and pages carry its state): it prefills what the target prefills, follows
    the kept tokens and drafts greedily after every step (:func:`kimi_jax.serving.steps.model_draft_step`). A step
    in which some slot has drafts is one verify forward over the decoding slots
    (:func:`kimi_jax.serving.steps.verify_step`); greedy replies are the plain engine's, sampled ones have its
    distribution (rejection sampling).
    ``structured``: requests may carry a constraint (:attr:`Request.constraint`): each step's allowed-token bitmasks
    are computed on the host (:mod:`kimi_jax.text.grammar`) and applied on the device before sampling: every compute
    program takes one bitmask per row (a row without a constraint allows every id, which leaves its logits as they
    are, bit for bit), so the programs are as many as without and none compiles under load.
    ``kv_cache``: the page pools' row format (:mod:`kimi_jax.model.cache`): None (the model dtype), ``"int8"`` or,
    for K3.1, ``"int8-index"`` (only the DSA indexer keys in int8).
    """

    def __init__(self, model, tokenizer: Tokenizer | None = None, *, slots: int = 8, max_len: int = 2048,
                 page_size: int = 64, pages: int | None = None, prefill_chunk: int = 256, min_chunk: int = 64,
                 prefix_cache_bytes: int = 1 << 30, prefix_host_bytes: int = 0, snapshot_every: int | None = None,
                 compact_decode: bool = True, batch_invariant: bool = False, record_logits: bool = False,
                 peer_timeout: float = 20.0, speculative=None, structured: bool = False, kv_cache: str | None = None):
        drafter = _drafter(speculative, model)
        self.shapes = engine_shapes(slots=slots, max_len=max_len, page_size=page_size, pages=pages,
                                    prefill_chunk=prefill_chunk, min_chunk=min_chunk, snapshot_every=snapshot_every,
                                    compact_decode=compact_decode, batch_invariant=batch_invariant,
                                    spec_k=0 if drafter is None else drafter.k, structured=structured)
        if not peer_timeout > 0:
            raise EngineError(f"peer_timeout must be > 0 seconds, got {peer_timeout}")
        sh = self.shapes
        self.cfg, self.tokenizer = model.cfg, tokenizer
        self.slots, self.max_len, self.page_size, self.n_pages = sh.slots, sh.max_len, sh.page_size, sh.n_pages
        try:
            self.executor = Executor(model, sh, record=record_logits, kv_cache=kv_cache,
                                     drafter=None if isinstance(drafter, speculative_mod.NGram) else drafter)
        except CacheTooLarge as e:
            raise EngineError(str(e)) from None
        self.scheduler = Scheduler(sh, tokenizer, prefix_cache_bytes=prefix_cache_bytes,
                                   prefix_host_bytes=prefix_host_bytes, snap_bytes=self.executor.snap_bytes,
                                   page_bytes=self.executor.page_bytes, drafter=drafter)
        # several processes: process 0 schedules and sends its plans; the others follow (see `follow`)
        self.leader = jax.process_index() == 0
        self.channel = self.watchdog = None
        self.peer_timeout = float(peer_timeout)
        if jax.process_count() > 1:
            self.channel = PlanChannel()
        self.plans_run = 0
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._accepting, self._thread, self._drain = self.leader, None, True
        self._warm_compiles = None

    # what the tests and the server read
    @property
    def running(self):
        return self.scheduler.running

    @property
    def prefix(self):
        return self.scheduler.prefix

    @property
    def cache(self):
        return self.executor.cache

    @property
    def row_buckets(self) -> tuple[int, ...]:
        return self.shapes.row_buckets

    def default_stop_ids(self) -> list[int]:
        return default_stop_ids(self.tokenizer, self.cfg)

    # -- requests ---------------------------------------------------------------------------------------------

    def check(self, request: Request) -> Request:
        """``request`` validated and normalised (stop ids resolved, seed drawn); raises :class:`EngineError`."""
        return check_request(request, self.cfg, self.shapes, self.tokenizer)

    def submit(self, request: Request) -> Handle:
        """Queue a request (thread-safe); raises :class:`EngineError` on bad input or when the engine stops."""
        if not self.leader:
            raise EngineError(f"process {jax.process_index()} follows process 0's plans: submit requests there")
        if not self._accepting:
            raise EngineStopped("the engine is shutting down and takes no new requests")
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

    # -- the loop (process 0) -------------------------------------------------------------------------------------

    def start(self, warmup: bool = True) -> "Engine":
        """Compile every program (``warmup``) and start the engine thread (on several processes, once every process
        has warmed up; the others call :meth:`follow`)."""
        if not self.leader:
            raise EngineError("only process 0 runs the engine thread; the others call follow()")
        if warmup:
            self.warmup()
        self._watch()
        self._thread = threading.Thread(target=self._run, name="kimi-jax-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; with ``drain`` finish those in flight and queued, else abort them; join the thread
        (on several processes the others return from :meth:`follow`)."""
        self._accepting, self._drain = False, drain
        self._inbox.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        while True:
            busy = self.scheduler.busy
            if not self._accepting and (not busy or not self._drain):
                self.scheduler.abort_all("abort", None)
                break
            try:
                self._read_inbox(block=not busy)
                self.step()
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests; one process lives on
                error = f"{type(e).__name__}: {e}"
                if self.channel is not None:  # the others may be anywhere in their plans: no way back
                    self._lost(f"a step failed: {error}")
                    self.watchdog.failed(error)
                    return
                self.scheduler.abort_all("error", error)
                self._reset()
        if self.channel is not None:  # the others return from follow()
            self._execute(self.scheduler.stop_plan())
            self.watchdog.stop()

    def _read_inbox(self, block: bool) -> None:
        while True:
            try:
                kind, handle = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if kind == "submit":
                self.scheduler.add(handle)
            elif kind == "cancel":
                self.scheduler.cancel(handle)

    def step(self) -> None:
        """One iteration: read new requests (when no thread runs), admit, one prefill chunk, one decode step."""
        if self._thread is None:
            self._read_inbox(block=False)
        sched = self.scheduler
        sched.admit()
        plan = sched.prefill_plan()
        if plan is not None:
            sched.prefilled(plan, *self._execute(plan))
        plan = sched.decode_plan()
        if plan is not None:
            t = time.perf_counter()
            out = self._execute(plan)
            sched.timed(plan, time.perf_counter() - t)
            sched.decoded(plan, *out)
        if not sched.busy:  # idle: what finishing left to do (snapshots of the replies) does not wait for the next
            plan = sched.pending()
            if plan is not None:
                self._execute(plan)

    def _execute(self, plan: StepPlan):
        """Run ``plan`` here (after sending it to the other processes); its compute op's results as numpy."""
        if self.channel is not None:
            self.channel.send(plan)
        out = self.executor.run(plan)
        self.plans_run += 1
        return None if out is None else tuple(None if x is None else np.asarray(x) for x in out)

    def _reset(self) -> None:
        """After a failed step the donated cache may be gone: fresh device state, an empty pool and prefix cache."""
        self.executor.reset()
        self.scheduler.reset()

    # -- the other processes ----------------------------------------------------------------------------------

    def follow(self, warmup: bool = True) -> None:
        """On every process but 0: compile every program (``warmup``, in step with process 0's), then apply process
        0's plans in order until it stops. Returns when process 0's engine stopped."""
        if self.leader or self.channel is None:
            raise EngineError("follow() runs on the processes other than 0 of a multi-process job")
        if warmup:
            self.warmup()
        self._watch()
        step = 0
        while True:
            plan = self.channel.receive(step)
            try:
                self.executor.run(plan)
            except Exception as e:  # noqa: BLE001 - a collective with a process that went away, or a bug
                self.watchdog.failed(f"{type(e).__name__}: {e}")
                threading.Event().wait()  # the watchdog names the process and exits
            step += 1
            self.plans_run = step
            if any(isinstance(op, Stop) for op in plan.ops):
                self.watchdog.stop()
                return

    def _watch(self) -> None:
        """Several processes: wait until all have warmed up, then watch each other (:mod:`~.multihost`)."""
        if self.channel is None:
            return

        multihost.ready_barrier()
        self.watchdog = multihost.Watchdog(self.peer_timeout, self._progress, self._lost, self.channel).start()

    def _progress(self) -> tuple[int, int]:
        compiles = steps.backend_compiles() - (self._warm_compiles or 0)
        return self.plans_run, compiles

    def _lost(self, message: str) -> None:
        """A process went away (or a step failed across processes): end every request here with an error (the
        server answers it), and give the server a moment to send the answers before the process exits."""
        self._accepting = False
        if not self.leader:
            return
        error = f"the serving job lost a process: {message}"
        handles = []
        for _ in range(100):  # read beside the engine thread, which may be changing them (or stuck in a step)
            try:
                handles = list(self.scheduler.waiting) + [s.handle for s in list(self.scheduler.running) if s]
                break
            except RuntimeError:
                time.sleep(0.001)
        while True:
            try:
                kind, handle = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                handles.append(handle)
        for h in handles:
            if not h.finished:
                h.push(Event([], finish_reason="error", error=error))
        time.sleep(1.0)

    # -- compiled programs ----------------------------------------------------------------------------------------

    def warmup(self, progress=None) -> None:
        """Compile every program the engine runs (each prefill bucket fresh and continued, each decode shape, the
        snapshot and page functions) on an idle engine, so serving never compiles. ``progress(what, n, m)``: called
        before each of the ``m`` programs (the n-th), to say what a long start waits for."""
        if self.scheduler.busy:
            raise EngineError("warmup needs an idle engine")
        self.executor.warmup(progress)
        self._warm_compiles = steps.backend_compiles()

    def stats(self) -> dict:
        """Slots in use, queue length, pages free, prefix-cache counts, and XLA compilations in this process since
        :meth:`warmup` (any jitted function's: run nothing else beside the engine to read it as the engine's); on
        several processes, every other process's compilations since its warm-up as its last heartbeat said."""
        compiled = steps.backend_compiles()
        out = {**self.scheduler.stats(),
               "compiles_after_warmup": None if self._warm_compiles is None else compiled - self._warm_compiles}
        if self.channel is not None:
            out["processes"] = jax.process_count()
            peers = {} if self.watchdog is None else dict(self.watchdog.peers)
            out["peer_compiles_after_warmup"] = {str(p): c for p, (_, c) in sorted(peers.items())}
        return out


def _drafter(speculative, model):
    """The engine's drafter from ``speculative`` (:func:`kimi_jax.generation.speculative.parse`), checked against
    ``model`` and in its dtype; refused where the engine cannot run it."""
    drafter = speculative_mod.parse(speculative, dtype=model.run.dtype, parallel=model.run.parallel)
    if isinstance(drafter, speculative_mod.DraftModel) and drafter.model.cfg.vocab_size != model.cfg.vocab_size:
        raise EngineError(f"the draft model's vocabulary ({drafter.model.cfg.vocab_size} ids) is not the target's "
                          f"({model.cfg.vocab_size})")
    if isinstance(drafter, speculative_mod.DSpark):
        try:
            drafter.model.cfg.check_target(model.cfg)
        except ValueError as e:
            raise EngineError(str(e)) from None
        drafter = drafter.astype(model.run.dtype, model.run.parallel)
    return drafter

