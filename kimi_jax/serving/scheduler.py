"""The serving engine's host half: which requests run, where their cache lives, what each step computes.

The scheduler owns the queue, the slots, the page pool and the prefix cache (:mod:`kimi_jax.serving.pages`), and
writes each decision down as ops of a :class:`~kimi_jax.serving.stepplan.StepPlan`; it never touches a device
array. An engine iteration is up to two plans, because the second depends on the first's sampled token:

1. admission's ops (prefix restores, page-ins, copies) and one prefill chunk of the oldest slot still prefilling,
   with the prefix snapshot after it;
2. one decode step over every decoding slot.

A request with a constraint (structured outputs) has a :class:`~kimi_jax.text.grammar.Guide`: before a compute op
that draws its next token (the prompt's last chunk, a decode or verify step) the plan gets a :class:`Mask` op with
its allowed-token bitmask (per drafted position in a verify step), and every token it keeps advances the guide.

The tokens each plan samples come back (:meth:`Scheduler.prefilled`, :meth:`Scheduler.decoded`) and are handed out:
detokenised, matched against stop strings (:mod:`kimi_jax.serving.detokenize`), finished on a stop id, a stop string
or the token budget. A finished request's snapshot (its prompt and reply: the next turn's prefix) is an op of the
next plan, ahead of anything that reuses its slot.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time

import numpy as np

from kimi_jax.generation import speculative
from kimi_jax.serving.detokenize import TextStream
from kimi_jax.serving.events import Event, Handle
from kimi_jax.serving.pages import PagePool, PrefixCache, PrefixEntry
from kimi_jax.serving.stepplan import (Admit, ClearRow, CopyPage, Decode, Mask, Op, Prefill, PutState,
                                       RestorePages, SetPages, Shapes, StepPlan, Stop, Verify)
from kimi_jax.text.grammar import ConstraintError, Guide

TIMED = 16  # step times kept per kind and row count (:meth:`Scheduler.timed`)
PRIOR = 0.5  # weight of a finished request's acceptance rate in the rate new requests start at (Scheduler.prior)
COUNTERS = ("prefix_hits", "prefix_misses", "prefix_hit_tokens", "prefill_chunks", "prefill_tokens", "decode_steps",
            "finished", "spec_steps", "spec_drafted", "spec_accepted")


@dataclasses.dataclass
class Slot:
    """A request in a slot: where its prompt stands, its pages, what it has produced."""

    handle: Handle
    prompt: list[int]
    text: TextStream
    pos: int = 0  # tokens of this sequence in the cache
    pages: list[int] = dataclasses.field(default_factory=list)
    reserved: int = 0  # pages it may still take
    decoding: bool = False
    last: int = 0  # last sampled token: the next decode input
    out: list[int] = dataclasses.field(default_factory=list)
    extra: int = 0  # positions the cache holds past the tokens handed out (a verify step's, after a stop)
    rate: float = 1.0  # recent share of its drafts accepted (speculative decoding)
    tried: bool = False  # whether a verify step checked some of its drafts
    steps: int = 0  # decode and verify steps it took part in
    guide: Guide | None = None  # its constraint's state (structured outputs)
    drafts: list[int] = dataclasses.field(default_factory=list)  # a DSpark drafter's block after its last step


class Scheduler:
    """See the module docstring. ``snap_bytes`` / ``page_bytes``: the size of one KDA snapshot and of one cache page
    (for the prefix cache's budgets); both budgets 0: no prefix cache."""

    def __init__(self, shapes: Shapes, tokenizer, *, prefix_cache_bytes: int, prefix_host_bytes: int,
                 snap_bytes: int, page_bytes: int, drafter=None):
        self.shapes, self.tokenizer, self.drafter = shapes, tokenizer, drafter
        self.budgets = (int(prefix_cache_bytes), int(prefix_host_bytes))
        self.snap_bytes, self.page_bytes = snap_bytes, page_bytes
        self.waiting: collections.deque[Handle] = collections.deque()
        self.running: list[Slot | None] = [None] * shapes.slots
        self.counters = collections.Counter(dict.fromkeys(COUNTERS, 0))
        self._steps = itertools.count()
        # recent wall times of decode and verify steps per row count (:meth:`timed`), for a verify step's cost
        self._times: dict[tuple[str, int], collections.deque] = {}
        # the acceptance rate a new request starts at: a moving average of the last rates of finished requests whose
        # drafts were checked (1 before any; always 1 with adapt="acceptance", whose verify steps depend on each
        # request's own drafts only). A request's first decode step may verify whatever the rate (a probe)
        self.prior = 1.0
        self.reset()

    def reset(self) -> None:
        """An empty pool and prefix cache (after a failed step the executor's device state is new too); the prefix
        cache keeps spilling pages to host memory as before."""
        self._ops: list[Op] = []
        self._ids = itertools.count(1)
        self.pool = PagePool(self.shapes.n_pages)
        self.prefix = None
        if any(self.budgets):
            self.prefix = PrefixCache(self.pool, *self.budgets, self.snap_bytes, self.page_bytes, self._emit,
                                      self._ids)

    def _emit(self, op: Op) -> None:
        self._ops.append(op)

    def _plan(self) -> StepPlan:
        ops, self._ops = tuple(self._ops), []
        return StepPlan(next(self._steps), ops)

    def pending(self) -> StepPlan | None:
        """The ops decided but not yet in a plan (a finished request's snapshot, evictions), as a plan of their own."""
        return self._plan() if self._ops else None

    def stop_plan(self) -> StepPlan:
        """The last plan: what is pending, then :class:`Stop` (the other processes return)."""
        self._emit(Stop())
        return self._plan()

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.running)

    # -- requests in and out --------------------------------------------------------------------------------------

    def add(self, handle: Handle) -> None:
        self.waiting.append(handle)

    def cancel(self, handle: Handle) -> None:
        if handle in self.waiting:
            self.waiting.remove(handle)
            handle.push(Event([], finish_reason="abort"))
            return
        for i, s in enumerate(self.running):
            if s is not None and s.handle is handle:
                self._finish(i, "abort")

    def abort_all(self, reason: str, error: str | None) -> None:
        while self.waiting:
            self.waiting.popleft().push(Event([], finish_reason=reason, error=error))
        for i, s in enumerate(self.running):
            if s is not None:
                self._finish(i, reason, error)

    # -- admission ------------------------------------------------------------------------------------------------

    def _available(self) -> int:
        return len(self.pool.free) - sum(s.reserved for s in self.running if s is not None)

    def admit(self) -> None:
        """Move queued requests into free slots, oldest first, while the pool can hold them (spilling or evicting
        prefix entries when it must); a prefix hit restores its snapshot into the slot."""
        ps = self.shapes.page_size
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
            s = self.running[i] = Slot(handle, req.prompt, TextStream(self.tokenizer, req.stop_strings),
                                       reserved=need, guide=None if req.constraint is None else req.constraint.guide(),
                                       rate=self.prior)
            self._emit(Admit(i, req.temperature, req.top_k, req.top_p, req.seed))
            s.pages = held[: hit // ps]
            if entry is not None:
                self._restore(i, s, entry, held)
            handle.cached_tokens = s.pos
            handle.timings["admitted"] = time.perf_counter()
            self.counters["prefix_hits" if entry is not None else "prefix_misses"] += 1
            self.counters["prefix_hit_tokens"] += s.pos

    def _make_room(self, n: int, keep: PrefixEntry | None) -> bool:
        """Whether ``n`` pages are free to take, after spilling (else dropping) stored prefixes other than ``keep``,
        least recently used first, as far as needed."""
        while self._available() < n and self.prefix is not None and (
                self.prefix.spill_pages(keep=keep) or self.prefix.evict(keep=keep)):
            pass
        return self._available() >= n

    def _page_in(self, entry: PrefixEntry) -> bool:
        """Pages for ``entry``'s cache, spilled to host memory, written back from there; False when the pool cannot
        give that many (other entries spilled or dropped first)."""
        n = entry.host_count
        if not self._make_room(n, keep=entry):
            return False
        pages = [self.pool.take() for _ in range(n)]
        self._emit(RestorePages(entry.host_pages, tuple(pages)))
        self.prefix.restored(entry, pages)
        return True

    def _restore(self, i: int, s: Slot, entry: PrefixEntry, held: list[int]) -> None:
        """Slot ``i`` continues from ``entry``: its KDA state, its full pages shared, its partial page copied."""
        ps = self.shapes.page_size
        self._emit(PutState(i, entry.snap, entry.length))
        if entry.length % ps:
            page = self._take(s)
            self._emit(CopyPage(held[-1], page))
            self.pool.release(held[-1:])  # the copy is the slot's; the shared page stays with the entry
        s.pos = entry.length
        self._emit(SetPages(i, 0, tuple(s.pages)))

    def _take(self, s: Slot) -> int:
        page = self.pool.take()
        s.pages.append(page)
        s.reserved -= 1
        return page

    def _cover(self, i: int, s: Slot, end: int) -> None:
        """Pages for slot ``i``'s positions ``[0, end)``, and with a draft model for the ``k`` after (its drafting
        steps write there; within the request's budget, which its reservation holds)."""
        ahead = self.drafter.k if isinstance(self.drafter, speculative.DraftModel) else 0
        if ahead and (s.decoding or end == len(s.prompt)):
            end = max(end, min(end + ahead, len(s.prompt) + s.handle.request.max_tokens))
        start = len(s.pages)
        while len(s.pages) * self.shapes.page_size < end:
            self._take(s)
        if len(s.pages) > start:
            self._emit(SetPages(i, start, tuple(s.pages[start:])))

    # -- the plans ------------------------------------------------------------------------------------------------

    def prefill_plan(self) -> StepPlan | None:
        """Admission's ops and the next chunk of the oldest slot still prefilling: up to the next multiple of
        ``chunk`` (or the prompt's end), then the snapshot of a chunk ending on a snapshot boundary or the prompt."""
        sh = self.shapes
        pending = [i for i, s in enumerate(self.running) if s is not None and not s.decoding]
        if not pending:
            return None
        i = min(pending, key=lambda k: self.running[k].handle.timings["submitted"])
        s = self.running[i]
        start, L = s.pos, len(s.prompt)
        end = min(L, (start // sh.chunk + 1) * sh.chunk)
        if end == L:  # the chunk draws the first token: under the request's constraint, if any
            masks = self._guided([i])
            if self.running[i] is None:
                return None
            if masks:
                self._emit(Mask.make([0], [[masks[i]]]))
        self._cover(i, s, end)
        self._emit(Prefill(i, start, sh.bucket(end - start), sh.fresh_width if start == 0 else sh.pages_per_seq,
                           tuple(s.prompt[start:end]), ends=int(end == L)))
        s.pos = end
        self.counters["prefill_chunks"] += 1
        self.counters["prefill_tokens"] += end - start
        # batch-invariant: only on chunk boundaries, where a cold prefill of the same tokens has the same chunks
        if self.prefix is not None and (end % sh.snapshot_every == 0 or (end == L and not sh.batch_invariant)):
            self.prefix.insert(s.prompt[:end], s.pages[: -(-end // sh.page_size)], i)
        return self._plan()

    def prefilled(self, plan: StepPlan, tok, logp, logits, drafts=None) -> None:
        """``plan``'s chunk ran and drew ``tok [1]``: the first token when it ended the prompt (``drafts [1, k]``: a
        DSpark drafter's block after it)."""
        i = plan.compute.slot
        s = self.running[i]
        if s is not None and s.pos == len(s.prompt):
            s.decoding = True
            s.handle.timings["first_token"] = time.perf_counter()
            self._drafted(s, drafts, 0)
            self._accept(i, int(tok[0]), float(logp[0]), None if logits is None else logits[0])

    @staticmethod
    def _drafted(s: Slot, drafts, row: int) -> None:
        """Keep row ``row`` of a model drafter's ``drafts`` as slot ``s``'s next block (None: no such drafter, or it
        drafted no block after this step)."""
        s.drafts = [] if drafts is None else [int(t) for t in drafts[row]]

    def decode_plan(self) -> StepPlan | None:
        """One decode step for the decoding slots: over all slots, or, when few decode, over a bucket of rows
        (powers of 4) holding just them."""
        sh = self.shapes
        active = [i for i, s in enumerate(self.running) if s is not None and s.decoding]
        if not active:
            return None
        if self.drafter is not None:
            plan = self._verify_plan(active)
            if plan is not None:
                return plan
        masks = self._guided(active)
        active = [i for i in active if self.running[i] is not None]
        if not active:
            return None
        for i in active:
            self._cover(i, self.running[i], self.running[i].pos + 1)
        b = sh.rows(len(active))
        rows = list(range(sh.slots)) if b == sh.slots else active + [sh.slots] * (b - len(active))
        live = [r < sh.slots and self.running[r] is not None and self.running[r].decoding for r in rows]
        tokens = [self.running[r].last if ok else 0 for r, ok in zip(rows, live)]
        counts = [len(self.running[r].out) if ok else 0 for r, ok in zip(rows, live)]
        width = sh.width(max(len(self.running[i].pages) for i in active))
        if masks:
            at = [k for k, r in enumerate(rows) if r in masks]
            self._emit(Mask.make(at, [[masks[rows[k]]] for k in at]))
        self._emit(Decode.make(width, rows, tokens, counts, live, all_rows=b == sh.slots,
                               draft=self._draft_next(active)))
        self.counters["decode_steps"] += 1
        return self._plan()

    def _draft_next(self, active: list[int]) -> bool:
        """Whether a model drafter (DSpark, a draft model) drafts a block after this plain step of ``active``: whether
        the next step may verify (:meth:`_pays`, one step ahead: each slot's rate as it stands, a plain step changes
        none, and the room it will have). A step that drafts no block saves the drafter's k-position work (it follows
        the step either way); a step that did not expect to verify and drafted nothing leaves the next one plain.
        n-gram drafts are looked up on the host when a step is planned: always (True)."""
        if self.drafter is None or isinstance(self.drafter, speculative.NGram):
            return True
        slots = [self.running[i] for i in active]
        return self._pays(active, [self._room(s, 1) if self._hopeful(s, 1) else 0 for s in slots], ahead=1)

    def _hopeful(self, s: Slot, ahead: int) -> bool:
        """Whether slot ``s`` drafts for the step ``ahead`` steps from now (0: the one being planned): it asked for
        speculation and its drafts were mostly accepted lately, or that step is one of its probes (every ``PROBE``-th
        of its steps)."""
        return s.handle.request.speculative and (s.rate >= speculative.MIN_RATE or
                                                 (s.steps + ahead) % speculative.PROBE == 0)

    def _room(self, s: Slot, ahead: int) -> int:
        """How many drafts slot ``s`` may verify ``ahead`` steps from now: k, or fewer near its token budget (the
        step's own token and the ``ahead`` tokens before it come first)."""
        return max(min(self.shapes.spec_k, s.handle.request.max_tokens - len(s.out) - 1 - ahead), 0)

    def _verify_plan(self, active: list[int]) -> StepPlan | None:
        """A verify step over the decoding slots (one row for a lone one, else every slot) when some has drafts
        (n-gram: its prompt and reply looked up; DSpark: the block the device drafted after its last step; a slot
        whose drafts were mostly rejected lately drafts only every ``PROBE``-th step), else None (a plain step).
        Batch-invariant shapes: every step is a verify step over every slot, drafts or none, and no timed cost
        decides (each request's numbers then come from one program, whatever else runs: what it drafts depends on
        its own text and acceptance alone)."""
        sh, k = self.shapes, self.shapes.spec_k
        drafts = {}
        for i in active:
            s = self.running[i]
            if self._hopeful(s, 0):
                if isinstance(self.drafter, speculative.NGram):
                    d = speculative.ngram_draft_host(s.prompt + s.out, self._room(s, 0), self.drafter)
                else:  # the device drafted it after the slot's last step
                    d = s.drafts[:self._room(s, 0)]
                if d:
                    drafts[i] = d
        if not sh.batch_invariant and (not drafts or not self._pays(active, [len(drafts.get(i, ())) for i in active])):
            return None
        masks = self._draft_masks(active, drafts)
        active = [i for i in active if self.running[i] is not None]
        if not active:
            return None
        b = sh.verify_rows(len(active))  # every slot, or the one row of a lone request
        rows = list(range(sh.slots)) if b == sh.slots else active + [sh.slots] * (b - len(active))
        tokens = np.zeros((b, k + 1), np.int64)
        dlen, counts, live = (np.zeros((b,), np.int64) for _ in range(3))
        for j, i in enumerate(rows):
            if i not in active:
                continue
            s, d = self.running[i], drafts.get(i, [])
            self._cover(i, s, s.pos + 1 + len(d))  # within its reservation: room leaves the budget's last token
            tokens[j, 0], tokens[j, 1:1 + len(d)] = s.last, d
            dlen[j], counts[j], live[j] = len(d), len(s.out), 1
        width = sh.width(max(len(self.running[i].pages) for i in active))
        if masks:
            at = [j for j, i in enumerate(rows) if i in masks]
            self._emit(Mask.make(at, [masks[rows[j]] for j in at]))
        self._emit(Verify.make(width, rows, tokens, dlen, counts, live, all_rows=b == sh.slots))
        self.counters["decode_steps"] += 1
        self.counters["spec_steps"] += 1
        self.counters["spec_drafted"] += int(dlen.sum())
        return self._plan()

    def _guided(self, slots) -> dict[int, np.ndarray]:
        """The next position's bitmask of each slot among ``slots`` whose constraint applies now; a slot whose
        constraint allows nothing more ends with an error."""
        out = {}
        for i in slots:
            s = self.running[i]
            if s is None or s.guide is None:
                continue
            row = np.empty((s.guide.grammar.vocab_words,), np.int32)
            try:
                if s.guide.fill(row):
                    out[i] = row
            except ConstraintError as e:
                self._finish(i, "error", str(e))
        return out

    def _draft_masks(self, active: list[int], drafts: dict[int, list[int]]) -> dict[int, np.ndarray]:
        """The bitmasks ``[k + 1, W]`` of each constrained slot's verify positions (its drafts cut at the first the
        constraint refuses: they would be rejected anyway); as :meth:`_guided` for errors."""
        out = {}
        for i in active:
            s = self.running[i]
            if s.guide is None:
                continue
            d = drafts.get(i, [])
            rows = np.full((self.shapes.spec_k + 1, s.guide.grammar.vocab_words), -1, np.int32)
            try:
                n = s.guide.fill_drafts(d, rows)
            except ConstraintError as e:
                drafts.pop(i, None)
                self._finish(i, "error", str(e))
                continue
            if d:
                drafts[i] = d[:n]
            out[i] = rows
        return out

    def decoded(self, plan: StepPlan, *out) -> None:
        """``plan``'s decode step drew ``tok [B]`` for its rows (``out``: tokens, log-probabilities, logits, drafts), or
        its verify step kept ``tokens[b, :kept[b]]`` (``out``: tokens, kept, accepted, log-probabilities, drafts,
        logits ``[B, k + 1, V]`` or None);
        ``drafts [B, k]``: a DSpark drafter's next block of each row, or None."""
        if isinstance(plan.compute, Verify):
            return self._verified(plan, *out)
        tok, logp, logits, drafts = out
        drafts = drafts if plan.compute.draft else None  # (zeros where the drafter drafted no block)
        rows, _, _, live = plan.compute.columns()
        for k in np.flatnonzero(live):
            i = int(rows[k])
            self.running[i].pos += 1
            self.running[i].steps += 1
            self._drafted(self.running[i], drafts, k)
            self._accept(i, int(tok[k]), float(logp[k]), None if logits is None else logits[k])

    def timed(self, plan: StepPlan, seconds: float) -> None:
        """The wall time of ``plan``'s decode or verify step, as the engine measured it (sent, run, results back);
        the first of each kind and row count is left out (it may have compiled its program)."""
        c = plan.compute
        key = ("verify" if isinstance(c, Verify) else "decode", len(c.columns()[0]))
        if key not in self._times:
            self._times[key] = collections.deque(maxlen=TIMED)
        else:
            self._times[key].append(float(seconds))

    def _cost(self, n: int) -> float | None:
        """A verify step's cost in plain steps with ``n`` decoding slots (the medians of the recent steps of each
        kind with their row counts), None until both were timed."""
        sh = self.shapes
        v, d = (self._times.get(key) for key in (("verify", sh.verify_rows(n)), ("decode", sh.rows(n))))
        return None if not v or not d else float(np.median(v) / np.median(d))

    def _pays(self, active: list[int], dlen: list[int], ahead: int = 0) -> bool:
        """Whether a verify step of ``active`` with ``dlen`` drafts each, ``ahead`` steps from now (0: the step being
        planned, 1: the next), is worth it: :func:`~kimi_jax.generation.speculative.worth_verifying` with the verify
        step's cost as timed here (always with batch-invariant shapes or the drafter's ``adapt="acceptance"``). Until
        a plain step of these rows was timed the steps are plain (two: the first is left out), then a verify step
        times its kind; while a verify step costs k + 1 plain steps or more, one decode step in PROBE**2 verifies (the
        cost is measured again: it changes with the rows decoding)."""
        if self.shapes.batch_invariant or self.drafter.adapt == "acceptance":
            return True
        step, cost = self.counters["decode_steps"] + ahead, self._cost(len(active))
        if cost is None:
            return ahead > 0 or bool(self._times.get(("decode", self.shapes.rows(len(active)))))
        if not speculative.can_pay(cost, self.shapes.spec_k):
            return step % speculative.PROBE ** 2 == 0
        # probes on the engine's step count (one verify step for all slots, not one per slot's own count), and a
        # request's first step (it starts at the rate of the requests before it, which may not be its own)
        slots = [self.running[i] for i in active]
        return bool(speculative.worth_verifying(
            cost, np.array([s.rate for s in slots]), np.array(dlen),
            np.array([0 if s.steps + ahead == 0 else step for s in slots]), np.ones(len(active), bool), xp=np))

    def _verified(self, plan: StepPlan, tok, kept, accepted, logp, drafts, logits=None) -> None:
        rows, _, dlen, _, live = plan.compute.columns()
        for r in np.flatnonzero(live):
            i = int(rows[r])
            s, n = self.running[i], int(kept[r])
            s.steps += 1
            self._drafted(s, drafts, r)
            if dlen[r]:
                s.rate = (1 - speculative.EMA) * s.rate + speculative.EMA * float(accepted[r]) / float(dlen[r])
                s.tried = True
            self.counters["spec_accepted"] += int(accepted[r])
            for j in range(n):
                s.pos += 1
                s.extra = n - 1 - j
                self._accept(i, int(tok[r, j]), float(logp[r, j]), None if logits is None else logits[r, j])
                if self.running[i] is not s:  # finished (a stop, the budget): the rest is dropped
                    break

    # -- tokens out -----------------------------------------------------------------------------------------------

    def _accept(self, i: int, tok: int, logp: float, logits) -> None:
        """Slot ``i`` drew ``tok``: hand it out (its text; stop strings held back until they cannot match), and
        finish the request on a stop id, a stop string or its token budget."""
        s = self.running[i]
        req = s.handle.request
        if s.guide is not None and not s.guide.advance(tok):
            return self._finish(i, "error", f"the constraint refused token {tok} ({s.guide.error})")
        s.out.append(tok)
        s.last = tok
        if logits is not None:
            s.handle.logits.append(logits)
        reason = "stop" if tok in req.stop_ids or (s.guide is not None and s.guide.done) else None
        if reason is None and len(s.out) >= req.max_tokens:
            reason = "length"
        text, hit = s.text.push(() if tok in req.stop_ids else (tok,), last=reason is not None)
        if hit:
            reason = "stop"
        s.handle.push(Event([tok], [logp] if req.logprobs else None, text, reason))
        if reason is not None:
            # the conversation so far: a follow-up turn's prefix (not batch-invariant: decode steps computed it)
            if self.prefix is not None and len(s.out) > 1 and not self.shapes.batch_invariant and not s.extra:
                fed = s.prompt + s.out[:-1]  # the last token drawn never entered the cache
                self.prefix.insert(fed, s.pages[: -(-len(fed) // self.shapes.page_size)], i)
            self._release(i)

    def _finish(self, i: int, reason: str, error: str | None = None) -> None:
        self.running[i].handle.push(Event([], finish_reason=reason, error=error))
        self._release(i)

    def _release(self, i: int) -> None:
        s = self.running[i]
        s.handle.timings["finished"] = time.perf_counter()
        if s.tried and self.drafter.adapt == "cost":  # (adapt="acceptance": each request on its own drafts alone)
            self.prior = (1 - PRIOR) * self.prior + PRIOR * s.rate
        self.pool.release(s.pages)
        self.running[i] = None
        self._emit(ClearRow(i))
        self.counters["finished"] += 1

    def stats(self) -> dict:
        p = self.prefix
        return {
            "slots": self.shapes.slots, "slots_busy": sum(s is not None for s in self.running),
            "waiting": len(self.waiting), "pages": self.shapes.n_pages, "pages_free": len(self.pool.free),
            "prefix_entries": 0 if p is None else len(p.entries), "prefix_bytes": 0 if p is None else p.nbytes,
            "prefix_evictions": 0 if p is None else p.evictions,
            "prefix_host_bytes": 0 if p is None else p.host_nbytes, "prefix_spills": 0 if p is None else p.spills,
            "prefix_page_spills": 0 if p is None else p.page_spills,
            "prefix_page_restores": 0 if p is None else p.page_restores,
            **self.counters,
        }

