"""The serving engine's device half: the paged cache and everything derived from it, changed only by applying
:class:`~kimi_jax.serving.stepplan.StepPlan` s.

The executor holds the model's parameters, the cache (donated to every compiled function that writes it:
:mod:`kimi_jax.serving.steps`), the page table and per-slot sampling values the plans set, the prefix snapshots in
device memory, and the snapshots and pages spilled to host memory. It decides nothing: the same plans in the same
order give the same state, which is what lets every process of a multi-host job run its own executor from process
0's plans. Host copies keep each process's own shards (:class:`HostArray`), so a spill moves no data between
processes, and a restore rebuilds the array with the sharding it left with (the program compiled at warm-up).

Sampled tokens, their log-probabilities and recorded logits come out replicated on every device, so the process
that schedules reads them whole whichever devices computed them.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kimi_jax.generation import speculative
from kimi_jax.generation.generate import free_memory
from kimi_jax.model import params as params_mod
from kimi_jax.model.cache import KDACache, paged_cache, paged_cache_shapes
from kimi_jax.parallel import sharding
from kimi_jax.parallel.sharding import paged_cache_shardings
from kimi_jax.serving import steps
from kimi_jax.serving.stepplan import (Admit, ClearRow, CopyPage, Decode, DropPages, DropState, Prefill, PutState,
                                       RestorePages, SetPages, Shapes, Snapshot, SpillPages, SpillState, StepPlan,
                                       Mask, Stop, Verify)


class CacheTooLarge(ValueError):
    """The paged cache would not fit the free device memory."""


@dataclasses.dataclass
class HostArray:
    """One array in host memory as this process holds it: its addressable shards (each distinct index once), the
    devices they came from, and the sharding to rebuild it with."""

    shape: tuple
    sharding: object
    data: dict  # shard index (hashable) -> numpy array
    where: list  # (device, shard index) per addressable shard

    @classmethod
    def of(cls, a: jax.Array) -> "HostArray":
        data, where = {}, []
        for shard in a.addressable_shards:
            key = tuple((s.start, s.stop) for s in shard.index)
            if key not in data:
                data[key] = np.asarray(shard.data)
            where.append((shard.device, key))
        return cls(a.shape, a.sharding, data, where)

    def to_device(self) -> jax.Array:
        return jax.make_array_from_single_device_arrays(
            self.shape, self.sharding, [jax.device_put(self.data[key], device) for device, key in self.where])

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes for d in self.data.values())


def to_host(tree):
    return jax.tree.map(HostArray.of, tree)


def to_device(tree):
    return jax.tree.map(lambda h: h.to_device(), tree, is_leaf=lambda x: isinstance(x, HostArray))


class Executor:
    """The device state of one engine (see the module docstring): ``model`` (on one device, or on a mesh through its
    ``run.parallel``), the cache of ``shapes``. ``record``: every compute op also returns its float32 logits.
    ``drafter``: a DSpark drafter (:class:`~kimi_jax.generation.speculative.DSpark`, in the model's dtype, on its
    mesh): its weights (split on a mesh by their logical axes) and its context pools (pages of the cache's page
    table; replicated on a mesh, as the target's latent pools are) join the state; every compute op also writes the
    context of the positions it kept and drafts each row's next block (:func:`kimi_jax.serving.steps.draft_step`),
    returned last. Or a draft model (:class:`~kimi_jax.generation.speculative.DraftModel`): its weights (where they
    were read when it runs on a mesh, its own cache then split as a model's; else replicated on a mesh) and its own
    paged cache on the same page table join the state (prefix snapshots and pages carry its KDA states and pools beside
    the target's); it prefills each chunk the target does, and every compute op ending a prompt or decoding also
    has it follow the kept tokens and draft each row's next block (:func:`kimi_jax.serving.steps.model_draft_step`).
    ``kv_cache``: the pools' row format (:func:`kimi_jax.model.cache.paged_cache`: None, ``"int8"`` or
    ``"int8-index"``); snapshots, spills and page copies move every field of a pool alike."""

    def __init__(self, model, shapes: Shapes, *, record: bool = False, drafter=None, kv_cache: str | None = None):
        self.shapes, self.record, self.kv_cache = shapes, bool(record), kv_cache
        self.cfg, self.dtype, self.scan = model.cfg, model.run.dtype, model.run.scan_layers
        self.graphdef, self.params = nnx.split(model)
        parallel = model.run.parallel
        self.cache_shapes = paged_cache_shapes(self.cfg, shapes.slots, shapes.n_pages, shapes.page_size, self.dtype,
                                               scan=self.scan, kv_cache=kv_cache)
        self.shardings = None if parallel is None else paged_cache_shardings(
            self.cfg, self.cache_shapes, parallel.mesh, parallel.layout)
        self.replicated = None if parallel is None else jax.sharding.NamedSharding(parallel.mesh,
                                                                                  jax.sharding.PartitionSpec())
        self._drafter(model, drafter)
        self.check_fits()
        self.programs = steps.programs(self.graphdef, self.shardings, self.replicated,
                                       compiler_options=model.run.compiler_options())
        entries = steps._entries(self.cache_shapes) + ([] if self.dcache_shapes is None else
                                                        steps._entries(self.dcache_shapes))
        kda = [e for e, _ in entries if isinstance(e, KDACache)]
        attn = [e for e, _ in entries if not isinstance(e, KDACache)]
        # one slot's KDA state and conv tails, one page of every attention pool (a draft model's too, and a DSpark
        # drafter's context pools): the prefix cache's units
        self.snap_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(kda)) // shapes.slots
        self.page_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves((attn, self.pool_shapes))
                              ) // shapes.n_pages
        self._ones: dict[tuple[int, int], np.ndarray] = {}  # (rows, positions) -> masks allowing every id
        self.reset()

    def _drafter(self, model, drafter) -> None:
        """A drafter's weights placed (a DSpark drafter's split on a mesh; a draft model's where it was read when it
        runs on the mesh, else replicated) and its programs; a DSpark drafter's context pools' shapes, a draft
        model's cache's (split as a model's cache when it runs on the mesh)."""
        self.drafter = drafter
        self.tap = self.dparams = self.pool_shapes = self.dcache_shapes = self.dsharding = None
        if drafter is None:
            return
        self.dgraph, dparams = nnx.split(drafter.model)
        if isinstance(drafter, speculative.DraftModel):
            sh, dmodel = self.shapes, drafter.model
            self.dcache_shapes = paged_cache_shapes(dmodel.cfg, sh.slots, sh.n_pages, sh.page_size, dmodel.run.dtype,
                                                    scan=dmodel.run.scan_layers)
            on = dmodel.run.parallel  # a draft model read into its shards on a mesh: its cache split as a model's
            dsharding = (paged_cache_shardings(dmodel.cfg, self.dcache_shapes, on.mesh, on.layout) if on is not None
                         else None if self.replicated is None else
                         jax.tree.map(lambda _: self.replicated, self.dcache_shapes))
            self.dsharding = dsharding
            self.dprograms = steps.programs(self.dgraph, dsharding, self.replicated)
            self.dstep = steps.model_draft_program(self.dgraph, drafter.k, dsharding, self.replicated)
        else:
            dcfg = drafter.model.cfg
            self.tap = (tuple(dcfg.target_layer_ids), dcfg.aux_hidden_stream)
            self.pool_shapes = jax.eval_shape(lambda: drafter.model.empty_pages(self.shapes.n_pages,
                                                                               self.shapes.page_size, self.dtype))
        parallel = model.run.parallel
        if getattr(drafter.model.run, "parallel", None) is not None and self.pool_shapes is None:
            self.dparams = dparams  # a draft model on a mesh: its weights where they were read
        elif parallel is None:
            device = next(iter(jax.tree.leaves(self.params)[0].devices()))
            self.dparams = jax.device_put(dparams, device)
        else:  # every process holds the same drafter: each fills its own devices
            # a DSpark drafter runs on the target's mesh (DSpark.astype): split by its weights' logical axes; a
            # draft model read for one device: replicated
            specs = (sharding.param_specs(drafter.model, parallel.mesh, parallel.layout)
                     if self.pool_shapes is not None else
                     {k: jax.sharding.PartitionSpec() for k in params_mod.leaves(dparams)})
            self.dparams = sharding.put_params(dparams, specs, parallel.mesh)
        if self.pool_shapes is not None:
            self.head = speculative.shared_head(model)
            self.dprograms = steps.draft_programs(self.dgraph, drafter.k, self.replicated, self.replicated)

    def check_fits(self) -> None:
        """Refuse, before allocating, a cache (and a drafter's weights and context pools) larger than the memory free
        on the device holding the most of it."""
        sh = self.shapes
        leaves = jax.tree.leaves(self.cache_shapes)
        drafter = sum(math.prod(a.sharding.shard_shape(a.shape) if isinstance(a, jax.Array) else a.shape)
                      * a.dtype.itemsize for a in jax.tree.leaves((self.dparams, self.pool_shapes)))
        if self.dcache_shapes is not None:  # a draft model's cache: split where it runs on the mesh
            where = jax.tree.leaves(self.dsharding) if self.dsharding is not None else [None] * len(
                jax.tree.leaves(self.dcache_shapes))
            drafter += sum(math.prod(s.shape if h is None else h.shard_shape(s.shape)) * s.dtype.itemsize
                           for s, h in zip(jax.tree.leaves(self.dcache_shapes), where))
        if self.shardings is None:
            need, devices = sum(s.size * s.dtype.itemsize for s in leaves), jax.local_devices()[:1]
        else:
            shards = jax.tree.leaves(self.shardings)
            need = sum(math.prod(sh_.shard_shape(s.shape)) * s.dtype.itemsize for s, sh_ in zip(leaves, shards))
            devices = jax.local_devices()
        free = min((f for f in map(free_memory, devices) if f is not None), default=None)
        if free is not None and need + drafter > free:
            what = "" if not drafter else (f" and the drafter ({drafter / 1e9:.2f} GB: weights, "
                                           f"{'cache' if self.dcache_shapes is not None else 'context pools'})")
            raise CacheTooLarge(f"the paged cache ({sh.slots} slots, {sh.n_pages} pages of {sh.page_size} tokens)"
                                f"{what} need {(need + drafter) / 1e9:.2f} GB per device but {free / 1e9:.2f} GB are "
                                "free: lower slots, max_len or pages")

    def reset(self) -> None:
        """A fresh cache and empty tables (at start, and after a failed step: a donated cache may be gone)."""
        sh = self.shapes
        self.cache = None  # the old one's memory goes first
        if self.shardings is None:
            # committed to the parameters' device, as every array the executor makes is (a host copy comes back
            # committed): a program compiled for an uncommitted cache would compile again for a committed one
            device = next(iter(jax.tree.leaves(self.params)[0].devices()))
            self.cache = jax.device_put(paged_cache(self.cfg, sh.slots, sh.n_pages, sh.page_size, self.dtype,
                                                    scan=self.scan, kv_cache=self.kv_cache), device)
        else:
            self.cache = _zeros(self.cache_shapes, self.shardings)
        self.pools = self.dcache = None
        if self.pool_shapes is not None:
            self.pools = _zeros(self.pool_shapes, self._drafter_place())
        if self.dcache_shapes is not None:
            self.dcache = _zeros(self.dcache_shapes, self.dsharding or self._drafter_place())
        self.covered = np.zeros((sh.slots,), np.int64)  # pages each slot's table row holds
        self.table = np.zeros((sh.slots, sh.pages_per_seq), np.int32)
        self.temperature = np.zeros((sh.slots,), np.float32)
        self.top_k = np.zeros((sh.slots,), np.int32)
        self.top_p = np.ones((sh.slots,), np.float32)
        self.seed = np.zeros((sh.slots,), np.uint32)
        self.snaps: dict[int, object] = {}  # snapshot id -> its device arrays
        self.host_snaps: dict[int, object] = {}  # snapshot id -> HostArray leaves, once spilled
        self.host_pages: dict[int, object] = {}  # host copy id -> HostArray leaves of its pages
        self.mask: Mask | None = None  # the next compute op's bitmasks (structured outputs)

    def _drafter_place(self):
        """Where the drafter's arrays live: beside its weights (replicated on a mesh, else their device)."""
        if self.replicated is not None:
            return self.replicated
        return next(iter(jax.tree.leaves(self.dparams)[0].devices()))

    # -- plans ----------------------------------------------------------------------------------------------------

    def run(self, plan: StepPlan):
        """Apply ``plan``'s ops in order. Returns its compute op's (tokens, log-probabilities, logits or None, drafts
        or None) as device arrays (replicated) -- a verify step's (tokens, kept, accepted, log-probabilities, drafts
        or None, logits or None) -- or None. Drafts ``[B, k]``: a DSpark drafter's next block for each row after the
        step."""
        out = None
        for op in plan.ops:
            got = self._apply[type(op)](self, op)
            if got is not None:
                out = got
        return out

    def _admit(self, op: Admit):
        i = op.slot
        self.temperature[i], self.top_k[i], self.top_p[i], self.seed[i] = (op.temperature, op.top_k, op.top_p,
                                                                           op.seed)

    def _set_pages(self, op: SetPages):
        self.table[op.slot, op.start : op.start + len(op.pages)] = op.pages
        self.covered[op.slot] = max(self.covered[op.slot], op.start + len(op.pages))

    def _clear_row(self, op: ClearRow):
        self.table[op.slot] = 0
        self.covered[op.slot] = 0

    def _snapshot(self, op: Snapshot):
        slot = np.int32(op.slot)
        self.snaps[op.snap] = (self.programs.take_state(self.cache, slot),
                               None if self.dcache is None else self.dprograms.take_state(self.dcache, slot))

    def _put_state(self, op: PutState):
        if op.snap in self.snaps:
            state, dstate = self.snaps[op.snap]
        else:  # a spilled snapshot stays in host memory; this hit reads a copy
            state, dstate = to_device(self.host_snaps[op.snap])
        slot, length = np.int32(op.slot), np.int32(op.length)
        self.cache = self.programs.put_state(self.cache, slot, state, length)
        if self.dcache is not None:
            self.dcache = self.dprograms.put_state(self.dcache, slot, dstate, length)

    def _spill_state(self, op: SpillState):
        self.host_snaps[op.snap] = to_host(self.snaps.pop(op.snap))

    def _drop_state(self, op: DropState):
        self.snaps.pop(op.snap, None)
        self.host_snaps.pop(op.snap, None)

    def _copy_page(self, op: CopyPage):
        self.cache = self.programs.copy_page(self.cache, np.int32(op.src), np.int32(op.dst))
        if self.pools is not None:
            self.pools = self.dprograms.copy_page(self.pools, np.int32(op.src), np.int32(op.dst))
        if self.dcache is not None:
            self.dcache = self.dprograms.copy_page(self.dcache, np.int32(op.src), np.int32(op.dst))

    def _take_page(self, page: int):
        """Page ``page`` of the cache's pools and of a drafter's (a DSpark drafter's context pools or a draft
        model's cache; None without one)."""
        take = self.programs.take_page(self.cache, np.int32(page))
        draft = next((x for x in (self.pools, self.dcache) if x is not None), None)
        return take, None if draft is None else self.dprograms.take_page(draft, np.int32(page))

    def _put_page(self, page: int, data) -> None:
        self.cache = self.programs.put_page(self.cache, np.int32(page), data[0])
        if self.pools is not None:
            self.pools = self.dprograms.put_page(self.pools, np.int32(page), data[1])
        if self.dcache is not None:
            self.dcache = self.dprograms.put_page(self.dcache, np.int32(page), data[1])

    def _spill_pages(self, op: SpillPages):
        self.host_pages[op.key] = [to_host(self._take_page(p)) for p in op.pages]

    def _restore_pages(self, op: RestorePages):
        for page, data in zip(op.pages, self.host_pages.pop(op.key)):
            self._put_page(page, to_device(data))

    def _drop_pages(self, op: DropPages):
        del self.host_pages[op.key]

    def _sampling(self, slots, counts) -> steps.SlotSampling:
        """Per-row sampling values: slot ``slots[k]``'s (None: an idle row, greedy) at stream position ``counts[k]``."""
        def col(values, fill, dtype):
            return np.array([fill if s is None else values[s] for s in slots], dtype)
        return steps.SlotSampling(temperature=col(self.temperature, 0.0, np.float32),
                                  top_k=col(self.top_k, 0, np.int32), top_p=col(self.top_p, 1.0, np.float32),
                                  seed=col(self.seed, 0, np.uint32), count=np.asarray(counts, np.int32))

    def _mask(self, op: Mask):
        self.mask = op

    def _take_mask(self, n_rows: int, k1: int = 0):
        """The pending bitmasks for ``n_rows`` rows (``[n_rows, W]``, or ``[n_rows, k1, W]`` for a verify step).
        Without structured outputs, None (the programs take no mask); with them every step is masked, a step without a
        constrained row by masks allowing every id (which leave the logits as they are, bit for bit)."""
        op, self.mask = self.mask, None
        if not self.shapes.structured:
            if op is not None:
                raise ValueError("a Mask op for an engine without structured outputs")
            return None
        full = self._all_ids(n_rows, max(k1, 1)) if op is None else op.full(n_rows)
        return full if k1 else full[:, 0]

    def _all_ids(self, n_rows: int, k1: int) -> np.ndarray:
        """Masks allowing every id (read-only, made once per shape: the unconstrained steps' masks)."""
        if (n_rows, k1) not in self._ones:
            out = np.full((n_rows, k1, (self.cfg.vocab_size + 31) // 32), -1, np.int32)
            out.setflags(write=False)
            self._ones[n_rows, k1] = out
        return self._ones[n_rows, k1]

    def _prefill(self, op: Prefill):
        ids = np.zeros((1, op.bucket), np.int32)
        ids[0, : len(op.ids)] = op.ids
        table = self.table[op.slot : op.slot + 1, : op.width]
        slot, n, samp = np.int32(op.slot), np.int32(len(op.ids)), self._sampling([op.slot], [0])
        self.cache, tok, logp, logits, taps = self.programs.prefill_chunk(
            self.params, self.cache, table, slot, ids, n, samp, self._take_mask(1), fresh=op.start == 0,
            record=self.record, tap=self.tap)
        return tok, logp, logits, self._prefill_drafts(taps, table, slot, ids, n, samp, op.start == 0, tok,
                                                       bool(op.ends))

    def _prefill_drafts(self, taps, table, slot, ids, n, samp, fresh, tok, ends):
        """The drafter after a prefill chunk: a DSpark drafter's step, or the draft model's prefill of the same
        chunk and, when it ends the prompt, its drafts after the first token; None without a drafter."""
        rows = np.array([slot], np.int32)
        if self.dcache is None:
            return self._draft(taps, table, rows, tok[:, None], n[None], True)
        self.dcache, *_ = self.dprograms.prefill_chunk(self.dparams, self.dcache, table, slot, ids, n, samp, None,
                                                       fresh=fresh)
        # its cache holds the chunk already: it follows nothing, and drafts from the token the target drew
        return self._model_draft(rows, np.zeros((1, 1), np.int32), np.zeros((1,), np.int32), tok[:, None],
                                 np.ones((1,), bool), True) if ends else None

    def _draft(self, taps, table, rows, tokens, written, want: bool):
        """A DSpark drafter's step after a compute op (:func:`kimi_jax.serving.steps.draft_step`): its drafts
        ``[B, k]`` (zeros where not ``want``: its context written, no block drafted), or None without one."""
        if self.pools is None:
            return None
        self.pools, drafts = self.dprograms.draft_step(self.dparams, self.pools, *self.head, taps, table,
                                                       self.cache.lengths, rows, tokens, written, np.bool_(want))
        return drafts

    def _model_draft(self, rows, fed, kept, out, start, want: bool):
        """:func:`kimi_jax.serving.steps.model_draft_step` over ``rows`` (their table rows as wide as the widest
        row's pages, which the scheduler has allocated k positions ahead): the draft model's cache follows ``fed
        [B, K1]`` (the step's input tokens) over ``kept`` positions; where ``want``, rows that kept some, or
        ``start``, draft k tokens after the last token the step kept of ``out [B, K1]`` (its output tokens: the next
        input)."""
        sh = self.shapes
        rows = np.asarray(rows, np.int32)
        live = rows < sh.slots
        width = sh.width(max(1, int(self.covered[rows[live]].max(initial=1))))
        table = np.zeros((len(rows), width), np.int32)
        table[live] = self.table[rows[live], :width]
        fed = np.pad(np.asarray(fed, np.int32), [(0, 0), (0, sh.spec_k + 1 - fed.shape[1])])
        if out.shape[1] < sh.spec_k + 1:  # a decode step's or a prefill's one token
            out = jnp.pad(out, [(0, 0), (0, sh.spec_k + 1 - out.shape[1])])
        return self._dstep(table, rows, fed, kept, out, start, np.bool_(want))

    def _dstep(self, *args):
        """The draft model's step on ``args`` (numpy or device arrays alike: each is placed beside the drafter's
        weights first, so the warm-up's program is the one every step runs)."""
        where = self._drafter_place()
        self.dcache, drafts = self.dstep(self.dparams, self.dcache, *jax.device_put(args, where))
        return drafts

    def _decode(self, op: Decode):
        rows, tokens, counts, live = op.columns()
        table = np.zeros((len(rows), op.width), np.int32)
        table[live] = self.table[rows[live], : op.width]
        samp = self._sampling([int(r) if ok else None for r, ok in zip(rows, live)], counts)
        self.cache, tok, logp, logits, taps = self.programs.decode_step(
            self.params, self.cache, table, tokens, live, samp, None if op.all_rows else rows,
            self._take_mask(len(rows)), record=self.record, tap=self.tap)
        return tok, logp, logits, self._decode_drafts(taps, table, rows, tokens, live, tok, bool(op.draft))

    def _decode_drafts(self, taps, table, rows, tokens, live, tok, want: bool):
        """The drafter after a decode step that fed ``tokens`` and drew ``tok`` (None without one; its block only
        where ``want``: the plan's :class:`~kimi_jax.serving.stepplan.Decode` ``draft``)."""
        if self.dcache is not None:
            return self._model_draft(rows, tokens[:, None], live.astype(np.int32), tok[:, None],
                                     np.zeros(live.shape, bool), want)
        return self._draft(taps, table, rows, tok[:, None], live.astype(np.int32), want)

    def _verify(self, op: Verify):
        rows, tokens, dlen, counts, live = op.columns()
        table = np.zeros((len(rows), op.width), np.int32)
        table[live] = self.table[rows[live], : op.width]
        samp = self._sampling([int(r) if ok else None for r, ok in zip(rows, live)], counts)
        self.cache, tok, kept, accepted, logp, logits, taps = self.programs.verify_step(
            self.params, self.cache, table, tokens, dlen, live, samp, None if op.all_rows else rows,
            self._take_mask(len(live), tokens.shape[1]), record=self.record, tap=self.tap)
        return tok, kept, accepted, logp, self._verify_drafts(taps, table, rows, tokens, kept, tok), logits

    def _verify_drafts(self, taps, table, rows, tokens, kept, tok):
        """The drafter after a verify step that fed ``tokens`` and kept ``tok[b, :kept[b]]`` (None without one)."""
        if self.dcache is not None:
            return self._model_draft(rows, tokens, kept, tok, np.zeros(kept.shape, bool), True)
        return self._draft(taps, table, rows, tok, kept, True)

    def _stop(self, op: Stop):
        pass

    _apply = {Admit: _admit, SetPages: _set_pages, ClearRow: _clear_row, Snapshot: _snapshot, PutState: _put_state,
              SpillState: _spill_state, DropState: _drop_state, CopyPage: _copy_page, SpillPages: _spill_pages,
              RestorePages: _restore_pages, DropPages: _drop_pages, Prefill: _prefill, Decode: _decode, Verify: _verify,
              Stop: _stop, Mask: _mask}

    # -- compiled programs ----------------------------------------------------------------------------------------

    def warmup(self, progress=None) -> None:
        """Compile every program a plan can run (each prefill bucket fresh and continued, each decode row bucket and
        table width, the snapshot and page functions, host round trips included) on slot 0 and page 0, leaving the
        state as it was. Every process runs the same warm-up: the programs hold collectives on a mesh.
        ``progress(what, n, m)``, when given, is called before each of the ``m`` programs runs (the n-th)."""
        steps_ = self._warmup_steps()
        for n, (what, run) in enumerate(steps_, 1):
            if progress is not None:
                progress(what, n, len(steps_))
            run()
        jax.block_until_ready(self.cache)

    def _warmup_steps(self) -> list:
        """(what it compiles, a call that runs it) for every program of :meth:`warmup`, in order."""
        sh = self.shapes
        samp = self._sampling([None], [0])
        out = []
        n_words = (self.cfg.vocab_size + 31) // 32

        def mask(*lead):  # structured outputs: every program takes a mask
            return np.full((*lead, n_words), -1, np.int32) if sh.structured else None

        # every row inactive or of no length: nothing is written (a drafter's step runs on the same shapes)
        def prefill(T, width, fresh):
            table = self.table[:1, :width]
            ids, n = np.zeros((1, T), np.int32), np.int32(0)
            self.cache, tok, _, _, taps = self.programs.prefill_chunk(
                self.params, self.cache, table, np.int32(0), ids, n, samp, mask(1), fresh=fresh, record=self.record,
                tap=self.tap)
            self._prefill_drafts(taps, table, np.int32(0), ids, n, samp, fresh, tok, True)

        def decode(b, width):
            rows = None if b == sh.slots else np.full((b,), sh.slots, np.int32)
            table = np.zeros((b, width), np.int32)
            self.cache, tok, _, _, taps = self.programs.decode_step(
                self.params, self.cache, table, np.zeros((b,), np.int32),
                np.zeros((b,), bool), self._sampling([None] * b, [0] * b), rows, mask(b),
                record=self.record, tap=self.tap)
            rows = np.arange(b, dtype=np.int32) if rows is None else rows
            self._decode_drafts(taps, table, rows, np.zeros((b,), np.int32), np.zeros((b,), bool), tok, True)

        def verify(b, width):
            k1 = sh.spec_k + 1
            rows = None if b == sh.slots else np.full((b,), sh.slots, np.int32)
            table = np.zeros((b, width), np.int32)
            self.cache, tok, kept, _, _, _, taps = self.programs.verify_step(
                self.params, self.cache, table, np.zeros((b, k1), np.int32), np.zeros((b,), np.int32),
                np.zeros((b,), bool), self._sampling([None] * b, [0] * b), rows, mask(b, k1), record=self.record,
                tap=self.tap)
            rows = np.arange(b, dtype=np.int32) if rows is None else rows
            self._verify_drafts(taps, table, rows, np.zeros((b, k1), np.int32), kept, tok)  # kept: all 0

        def snapshots():
            self._snapshot(Snapshot(0, -1))
            snap = self.snaps.pop(-1)
            for copy in (snap, to_device(to_host(snap))):
                self.snaps[-1] = copy
                self._put_state(PutState(0, -1, 0))
            self.snaps.pop(-1)

        def pages():
            self._copy_page(CopyPage(0, 0))
            self._put_page(0, to_device(to_host(self._take_page(0))))

        for T in sh.buckets:
            for width, fresh in ((sh.fresh_width, True), (sh.pages_per_seq, False)):
                out.append((f"prefill of {T} tokens ({'fresh' if fresh else 'continued'})",
                            lambda T=T, width=width, fresh=fresh: prefill(T, width, fresh)))
        for b in sh.row_buckets:
            for width in sh.widths:
                out.append((f"decode step of {b} rows x {width} pages", lambda b=b, width=width: decode(b, width)))
        if sh.spec_k:
            for b in sh.verify_buckets:
                for width in sh.widths:
                    out.append((f"speculative verify step of {b} rows x {sh.spec_k} drafts x {width} pages",
                                lambda b=b, width=width: verify(b, width)))
        return out + self._warmup_draft_model() + [("prefix snapshots", snapshots), ("page copies", pages)]

    def _warmup_draft_model(self) -> list:
        """A draft model's follow-and-draft step for :meth:`warmup` at each row bucket and table width (rows of
        padding: nothing is written; its prefills run with the target's)."""
        if self.dcache is None:
            return []
        sh, out = self.shapes, []

        def step(b, width):
            zeros, k1 = np.zeros((b,), np.int32), np.zeros((b, sh.spec_k + 1), np.int32)
            self._dstep(np.zeros((b, width), np.int32), np.full((b,), sh.slots, np.int32), k1, zeros, k1, zeros > 0,
                        np.bool_(True))

        for b in sorted({1, *sh.row_buckets, *sh.verify_buckets}):
            for width in sh.widths:
                out.append((f"draft model: follow and draft, {b} rows x {width} pages",
                            lambda b=b, width=width: step(b, width)))
        return out


def _zeros(shapes, where):
    """Zeros of ``shapes`` (``ShapeDtypeStruct`` leaves) made where they live: on a device, or by one program under
    ``where``'s sharding(s) (no unsharded copy first)."""
    zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)  # noqa: E731
    if isinstance(where, jax.Device):
        return jax.device_put(zeros(), where)
    return jax.jit(zeros, out_shardings=where)()
