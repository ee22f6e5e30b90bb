"""The serving engine's compiled functions over the paged cache (:func:`kimi_jax.model.cache.paged_cache`).

* :func:`prefill_chunk`: one chunk of one slot's prompt (``[1, T]`` right-padded, T a chunk bucket), written
  through the slot's page-table row; the chunk's last logits and a sampled token. ``fresh``: the chunk starts the
  sequence (no cache read: the plain prefill form); otherwise it continues what the cache holds for the slot.
* :func:`decode_step`: one token for every slot at once; inactive slots (``active`` False) feed length 0, which
  leaves their KDA state, conv tails and pages untouched.
* :func:`verify_step`: speculative decoding's step: each slot's drafted tokens checked in one forward, the accepted
  ones and the next token kept, the cache committed over exactly those (the engine's ``speculative=``).
* :func:`draft_step`: a DSpark drafter after any of those: the context entries of the positions the step kept into
  its page pools (the target's page table), then every row's next block of drafts (the engine's
  ``speculative="dspark:PATH"``); :func:`copy_draft_page` / :func:`take_draft_page` / :func:`put_draft_page`: its
  pools' pages, alongside the cache's.
* :func:`model_draft_step`: a draft model after any compute step: its own paged cache (the target's page table)
  follows the kept tokens, then ``k`` greedy steps draft each row's next block (``speculative="draft:PATH"``).
* :func:`take_state` / :func:`put_state`: a slot's KDA state and conv tails out of the cache (a prefix snapshot) and
  back in; :func:`copy_page`: copy-on-write of one page in every attention layer's pool; :func:`take_page` /
  :func:`put_page`: one page of every pool out (to host memory) and back.

The cache is donated to every function that writes it. Every shape is static (slots, pages, chunk buckets), so a
warm engine never recompiles; sampling values are traced per slot. :func:`programs` jits them for one model and one
cache sharding (on a mesh every written cache leaves with the sharding it came in with, so the next call does not
recompile); engines of the same model and sharding share them.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx, struct

from kimi_jax.generation import speculative
from kimi_jax.generation.generate import sample
from kimi_jax.generation.sampling import apply_bitmask
from kimi_jax.model.attention import commit_verified
from kimi_jax.model.cache import Cache, KDACache, for_verify
from kimi_jax.model.dspark import DraftCache, target_taps


@struct.dataclass
class SlotSampling:
    temperature: jax.Array  # [B] float32; <= 0: greedy
    top_k: jax.Array  # [B] int32; 0: off
    top_p: jax.Array  # [B] float32; 1: off
    seed: jax.Array  # [B] uint32: the request's seed
    count: jax.Array  # [B] int32: tokens the request has drawn so far (the PRNG stream position)


def request_keys(samp: SlotSampling, offset=0):
    """Each row's PRNG key for its request's ``count + offset``-th token: fold_in(key(seed), n), reproducible
    whichever slot or step it runs in."""
    return jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(samp.seed, samp.count + offset)


def choose(logits_BV, samp: SlotSampling, mask_BW=None):
    """(token [B] int32, its log-probability under the model's distribution [B] float32), keyed by
    :func:`request_keys`. ``mask`` (int32 ``[B, ceil(V / 32)]``, or None): the ids each row may draw (structured
    outputs, :func:`kimi_jax.generation.sampling.apply_bitmask`); the log-probability stays the model's."""
    drawn = logits_BV if mask_BW is None else apply_bitmask(logits_BV, mask_BW)
    tok = sample(drawn, request_keys(samp), samp.temperature, samp.top_k, samp.top_p)
    logp = jax.nn.log_softmax(logits_BV, axis=-1)
    return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]


def _entries(cache: Cache):
    """(entry, slot axis) of every layer entry: unrolled layers' on axis 0, stacked ones' after the repetitions."""
    return [(e, 0) for e in cache.layers if e is not None] + [(e, 1) for e in cache.stack]


def _rebuild(cache: Cache, fn) -> Cache:
    """``cache`` with each entry replaced by ``fn(entry, axis)`` (None entries kept)."""
    layers = tuple(None if e is None else fn(e, 0) for e in cache.layers)
    return Cache(layers, cache.lengths, tuple(fn(e, 1) for e in cache.stack))


def prefill_chunk(graphdef, params, cache: Cache, page_row, slot, ids_BT, n_valid, samp: SlotSampling, mask_BW=None,
                  *, fresh: bool, record: bool = False, tap=None, constrain=lambda c: c, replicate=lambda x: x):
    """One chunk of slot ``slot``'s prompt: ``ids [1, T]`` with ``n_valid`` tokens, at positions from the slot's
    cache length (0 when ``fresh``); ``mask [1, W]``: the ids the token may be (:func:`choose`). Returns (cache,
    token [1], logprob [1], logits [1, V] or None, taps [1, T, X] or None: :func:`taps`)."""
    model = nnx.merge(graphdef, params)
    rows = jnp.reshape(slot, (1,))  # the slot's KDA entries as a batch of one row
    view = _rows_view(cache, rows)
    res = model(ids_BT, cache=view, lengths=n_valid[None], prefix=not fresh, last_only=True, page_table=page_row,
                return_hidden=tap is not None)
    cache = constrain(_rows_merge(cache, res.cache, rows))
    logits = res.logits[:, 0]
    tok, logp = choose(logits, samp, mask_BW)
    return cache, *replicate((tok, logp, logits if record else None)), taps(model, res, tap)


def decode_step(graphdef, params, cache: Cache, page_table, tokens_B, active_B, samp: SlotSampling, rows_B=None,
                mask_BW=None, *, record: bool = False, tap=None, constrain=lambda c: c, replicate=lambda x: x):
    """One decode step. ``rows`` None: over every slot (``B`` = slots). ``rows [B]``: over those slots only (indices
    past the last slot pad the bucket; they are inactive), their KDA entries gathered and written back, so a few
    active slots do not pay for all (the MoE of an idle slot's row still routes and reads experts). Every other
    operand is per row (``mask [B, W]``: the ids each row may draw, :func:`choose`). Returns (cache, token [B],
    logprob [B], logits [B, V] or None, taps [B, 1, X] or None)."""
    model = nnx.merge(graphdef, params)
    view = cache if rows_B is None else _rows_view(cache, rows_B)
    res = model(tokens_B[:, None], cache=view, lengths=active_B.astype(jnp.int32), prefix=True, last_only=True,
                page_table=page_table, return_hidden=tap is not None)
    new = res.cache if rows_B is None else _rows_merge(cache, res.cache, rows_B)
    logits = res.logits[:, 0]
    tok, logp = choose(logits, samp, mask_BW)
    return constrain(new), *replicate((tok, logp, logits if record else None)), taps(model, res, tap)


def verify_step(graphdef, params, cache: Cache, page_table, tokens_BK, dlen_B, active_B, samp: SlotSampling,
                rows_B=None, mask_BKW=None, *, record: bool = False, tap=None, constrain=lambda c: c,
                replicate=lambda x: x):
    """One speculative step over every slot (``rows`` None) or over ``rows`` (as :func:`decode_step`'s): ``tokens
    [B, k + 1]`` is each row's last token then up to ``k`` drafted ones (``dlen [B]`` of them real), checked by one
    forward over the ``k + 1`` positions, written through the page table (the scheduler allocates pages for all of
    them), with the KDA layers in verify mode; the accepted drafts and the target's next token are kept (greedy
    rows: the drafts equal to the argmax; sampled rows: rejection sampling, keyed by :func:`request_keys` as
    :func:`choose` is) and the cache committed over exactly those positions
    (:func:`kimi_jax.model.attention.commit_verified`). Inactive rows feed nothing and keep everything. Returns
    (cache, tokens [B, k + 1], kept [B]: the row gains ``tokens[b, :kept[b]]``, accepted [B], the tokens'
    log-probabilities [B, k + 1], logits [B, k + 1, V] (``record``; position j's drew token j) or None, taps
    [B, k + 1, X] or None) -- stop ids and budgets are the scheduler's to apply.
    ``mask [B, k + 1, W]``: the ids each position may be (structured outputs): the target distribution is the
    masked one, so a draft the constraint refuses is rejected and the kept tokens obey it."""
    model = nnx.merge(graphdef, params)
    K1 = tokens_BK.shape[1]
    view = cache if rows_B is None else _rows_view(cache, rows_B)
    res = model(tokens_BK, cache=for_verify(view, K1), lengths=jnp.where(active_B, dlen_B + 1, 0), prefix=True,
                page_table=page_table, return_hidden=tap is not None)
    keys = lambda: jax.vmap(lambda i: request_keys(samp, i), out_axes=1)(jnp.arange(K1))  # noqa: E731
    logits = res.logits.astype(jnp.float32)
    target = logits if mask_BKW is None else apply_bitmask(logits, mask_BKW)
    t, a = speculative.accept(target, tokens_BK[:, 1:], dlen_B, samp.temperature, samp.top_k, samp.top_p, keys)
    kept = jnp.where(active_B, a + 1, 0)
    new = commit_verified(res.cache, view.lengths, kept, model.run)
    new = new if rows_B is None else _rows_merge(cache, new, rows_B)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), t[..., None], axis=-1)
    out = (t, kept, jnp.where(active_B, a, 0), logp[..., 0], logits if record else None)
    return constrain(new), *replicate(out), taps(model, res, tap)


def taps(model, res, tap):
    """A DSpark drafter's input from a model call with ``return_hidden`` (``tap``: its ``(target_layer_ids,
    aux_hidden_stream)``, :func:`kimi_jax.model.dspark.target_taps`); None without one."""
    return None if tap is None else target_taps(model, res, *tap)


def draft_step(dgraph, dparams, pools: DraftCache, embed_VD, head_VD, taps_BTX, page_table, lengths, rows_B, tokens_BK,
               written_B, want, *, k: int, constrain=lambda c: c, replicate=lambda x: x):
    """A DSpark drafter after a compute step over rows ``rows`` (their page-table rows ``page_table``; ``lengths``:
    every slot's cache length after the step): the context entries of the ``written`` positions the step kept,
    from its ``taps``, into the drafter's page pools; then, where ``want`` (a bool), each row's next block of ``k``
    drafts, anchored on the last token the row kept (``tokens[b, written[b] - 1]``, the next one it feeds) at its
    cache length (else zeros: the next step is not expected to verify, and the block's forward is skipped). Returns
    (pools, drafts [B, k]); rows that kept nothing write nothing (their drafts are not used)."""
    dmodel = nnx.merge(dgraph, dparams)
    ctx_len = jnp.take(lengths, rows_B, mode="clip")
    pools = dmodel.write_pages(pools, taps_BTX, page_table, ctx_len - written_B, written_B)
    at = jnp.clip(written_B - 1, 0, tokens_BK.shape[1] - 1)
    anchor = jnp.take_along_axis(tokens_BK, at[:, None], axis=1)[:, 0]
    drafts = jax.lax.cond(
        want, lambda: dmodel.draft(dmodel.page_view(pools, page_table), embed_VD, head_VD, anchor, ctx_len,
                                   k).astype(jnp.int32),
        lambda: jnp.zeros((anchor.shape[0], k), jnp.int32))
    return constrain(pools), replicate(drafts)


def model_draft_step(dgraph, dparams, dcache: Cache, page_table, rows_B, tokens_BK, kept_B, out_BK, start_B, want, *,
                     k: int, constrain=lambda c: c, replicate=lambda x: x):
    """A draft model (a smaller model of the family, its own paged cache on the target's page table) after a
    compute step over rows ``rows``: its cache follows the first ``kept[b]`` of ``tokens [B, K1]`` (the positions
    the target kept: one forward in verify mode, committed over those, :func:`verify_step`'s rule), then, where
    ``want`` (a bool; else the drafts are zeros and the steps skipped), rows that kept some (or with ``start``: a
    prompt's end, whose tokens its own prefill wrote) take ``k`` greedy one-token steps from ``out[b, kept[b] - 1]``
    (the last token the target kept, the next input) -- their drafts. The drafting steps' KDA states are dropped (the
    cache keeps the followed ones) and their attention entries lie past every row's length, where nothing reads them
    before a step overwrites them (the scheduler allocates the pages they land in). Returns (cache, drafts [B, k])."""
    dmodel = nnx.merge(dgraph, dparams)
    view = _rows_view(dcache, rows_B)
    res = dmodel(tokens_BK, cache=for_verify(view, tokens_BK.shape[1]), lengths=kept_B, prefix=True, last_only=True,
                 page_table=page_table)
    followed = commit_verified(res.cache, view.lengths, kept_B, dmodel.run)
    draft_B = start_B | (kept_B > 0)
    at = jnp.clip(kept_B - 1, 0, out_BK.shape[1] - 1)
    tok = jnp.take_along_axis(out_BK, at[:, None], axis=1)[:, 0].astype(jnp.int32)

    def one(i, carry):  # one greedy step of every drafting row (a loop: one copy of the model to compile)
        tok, c, drafts = carry
        r = dmodel(tok[:, None], cache=c, lengths=draft_B.astype(jnp.int32), prefix=True, last_only=True,
                   page_table=page_table)
        tok = jnp.argmax(r.logits[:, 0].astype(jnp.float32), axis=-1).astype(jnp.int32)
        return tok, r.cache, drafts.at[:, i].set(tok)

    none = jnp.zeros((tok.shape[0], k), jnp.int32)
    c, drafts = jax.lax.cond(want, lambda: jax.lax.fori_loop(0, k, one, (tok, followed, none))[1:],
                             lambda: (followed, none))
    # the drafting steps' attention pools (a superset of the followed ones), the followed KDA states and lengths
    states = iter([e for e, _ in _entries(followed) if isinstance(e, KDACache)])
    part = _rebuild(c, lambda e, axis: next(states) if isinstance(e, KDACache) else e).replace(
        lengths=followed.lengths)
    return constrain(_rows_merge(dcache, part, rows_B)), replicate(drafts)


DRAFT_PAGE_AXIS = 1  # a drafter's pools: [layers, pages, page_size, ...]


def copy_draft_page(pools: DraftCache, src, dst, *, constrain=lambda c: c):
    """:func:`copy_page` for a drafter's page pools."""
    return constrain(jax.tree.map(lambda a: _copy_page_of(a, DRAFT_PAGE_AXIS, src, dst), pools))


def take_draft_page(pools: DraftCache, page):
    """:func:`take_page` for a drafter's page pools."""
    return jax.tree.map(lambda a: _take_page_of(a, DRAFT_PAGE_AXIS, page), pools)


def put_draft_page(pools: DraftCache, page, data, *, constrain=lambda c: c):
    """:func:`put_page` for a drafter's page pools."""
    return constrain(jax.tree.map(lambda f, p: _put_page_of(f, DRAFT_PAGE_AXIS, page, p), pools, data))


# one pool array's page operations, shared by the cache's pools and a drafter's (``axis``: the pool's page axis)


def _copy_page_of(a, axis, src, dst):
    m = jnp.moveaxis(a, axis, 0)
    return jnp.moveaxis(m.at[dst].set(m[src]), 0, axis)


def _take_page_of(a, axis, page):
    return jax.lax.dynamic_slice_in_dim(a, page, 1, axis)


def _put_page_of(a, axis, page, data):
    return jax.lax.dynamic_update_slice_in_dim(a, data, page, axis)


def _rows_view(cache: Cache, rows):
    def view(e, axis):
        if isinstance(e, KDACache):
            return jax.tree.map(lambda a: jnp.take(a, rows, axis=axis, mode="clip"), e)
        return e
    return _rebuild(cache, view).replace(lengths=jnp.take(cache.lengths, rows, mode="clip"))


def _rows_merge(cache: Cache, new: Cache, rows):
    def put(full, part, axis):
        if not isinstance(full, KDACache):
            return part
        index = (slice(None),) * axis + (rows,)
        return jax.tree.map(lambda f, p: f.at[index].set(p.astype(f.dtype), mode="drop"), full, part)
    merged = [put(f, p, axis) for (f, axis), (p, _) in zip(_entries(cache), _entries(new))]
    it = iter(merged)
    layers = tuple(None if e is None else next(it) for e in cache.layers)
    stack = tuple(next(it) for _ in cache.stack)
    return Cache(layers, cache.lengths.at[rows].set(new.lengths, mode="drop"), stack)


def take_state(cache: Cache, slot):
    """A copy of slot ``slot``'s KDA entries (state and conv tails of every KDA layer), each ``[1, ...]``."""
    return tuple(jax.tree.map(lambda a, ax=axis: jax.lax.dynamic_slice_in_dim(a, slot, 1, ax), e)
                 for e, axis in _entries(cache) if isinstance(e, KDACache))


def put_state(cache: Cache, slot, state, length, *, constrain=lambda c: c):
    """``cache`` with slot ``slot``'s KDA entries set to ``state`` (from :func:`take_state`) and its length set."""
    it = iter(state)

    def put(e, axis):
        if not isinstance(e, KDACache):
            return e
        return jax.tree.map(lambda f, p: jax.lax.dynamic_update_slice_in_dim(f, p, slot, axis), e, next(it))

    out = _rebuild(cache, put)
    return constrain(out.replace(lengths=cache.lengths.at[slot].set(length)))


def copy_page(cache: Cache, src, dst, *, constrain=lambda c: c):
    """Page ``src`` copied to page ``dst`` in every attention layer's pool (copy-on-write of a shared page)."""
    def copy(e, axis):
        if isinstance(e, KDACache):
            return e
        return jax.tree.map(lambda a: _copy_page_of(a, axis, src, dst), e)
    return constrain(_rebuild(cache, copy))


def take_page(cache: Cache, page):
    """Page ``page`` of every attention layer's pool, each ``[1, ...]`` on the page axis (a prefix entry's cache,
    kept in host memory while its pages serve others)."""
    return tuple(jax.tree.map(lambda a, ax=axis: _take_page_of(a, ax, page), e)
                 for e, axis in _entries(cache) if not isinstance(e, KDACache))


def put_page(cache: Cache, page, data, *, constrain=lambda c: c):
    """``cache`` with page ``page`` of every attention layer's pool set to ``data`` (from :func:`take_page`)."""
    it = iter(data)

    def put(e, axis):
        if isinstance(e, KDACache):
            return e
        return jax.tree.map(lambda f, p: _put_page_of(f, axis, page, p), e, next(it))

    return constrain(_rebuild(cache, put))


class Programs(NamedTuple):
    """The functions above jitted for one model (graphdef bound) and one cache sharding."""

    prefill_chunk: Callable
    decode_step: Callable
    take_state: Callable
    put_state: Callable
    copy_page: Callable
    take_page: Callable
    put_page: Callable
    verify_step: Callable


_compiles = [0]


def _count(event: str, *_, **__) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compiles[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count)


def backend_compiles() -> int:
    """XLA compilations run by this process so far (every jitted function, not only the engine's): what a warm
    engine must not add to."""
    return _compiles[0]


_PROGRAMS: dict = {}


def programs(graphdef, cache_sharding=None, replicated=None, compiler_options=None) -> Programs:
    """:class:`Programs` for ``graphdef``; ``cache_sharding`` (a :class:`Cache` of shardings, or None on one device)
    is the sharding every written cache is constrained to. ``replicated`` (a sharding over every device of the mesh,
    or None): what the sampled tokens, log-probabilities and logits are constrained to, so that every process holds
    them whole (process 0 reads them; on a multi-process mesh a token computed on another process's devices could
    not be read otherwise). ``compiler_options``: the model's (:meth:`kimi_jax.model.run.RunConfig.compiler_options`),
    for the programs that run it."""
    opts = dict(compiler_options or {})
    key = (graphdef, None if cache_sharding is None else tuple(jax.tree.leaves(cache_sharding)), replicated,
           tuple(sorted(opts.items())))
    if key not in _PROGRAMS:
        kw, out = {}, {}
        if cache_sharding is not None:
            kw["constrain"] = lambda c: jax.lax.with_sharding_constraint(c, cache_sharding)
        if replicated is not None:
            out["replicate"] = lambda xs: jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, replicated), xs)
        cached = dict(donate_argnames=("cache",))
        model = dict(cached, compiler_options=opts or None)  # the programs that run the model
        _PROGRAMS[key] = Programs(
            jax.jit(functools.partial(prefill_chunk, graphdef, **kw, **out), static_argnames=("fresh", "record", "tap"),
                    **model),
            jax.jit(functools.partial(decode_step, graphdef, **kw, **out), static_argnames=("record", "tap"),
                    **model),
            jax.jit(take_state),
            jax.jit(functools.partial(put_state, **kw), **cached),
            jax.jit(functools.partial(copy_page, **kw), **cached),
            jax.jit(take_page),
            jax.jit(functools.partial(put_page, **kw), **cached),
            jax.jit(functools.partial(verify_step, graphdef, **kw, **out), static_argnames=("record", "tap"), **model))
    return _PROGRAMS[key]


class DraftPrograms(NamedTuple):
    """A DSpark drafter's functions jitted (graphdef and block bound; the page pools donated)."""

    draft_step: Callable
    copy_page: Callable
    take_page: Callable
    put_page: Callable


def model_draft_program(dgraph, k: int, cache_sharding=None, replicated=None) -> Callable:
    """:func:`model_draft_step` jitted for a draft model's ``dgraph`` drafting ``k`` tokens (its cache donated;
    ``cache_sharding`` / ``replicated`` as :func:`programs`)."""
    key = ("draft_model", dgraph, k, None if cache_sharding is None else tuple(jax.tree.leaves(cache_sharding)),
           replicated)
    if key not in _PROGRAMS:
        kw = {}
        if cache_sharding is not None:
            kw["constrain"] = lambda c: jax.lax.with_sharding_constraint(c, cache_sharding)
        if replicated is not None:
            kw["replicate"] = lambda x: jax.lax.with_sharding_constraint(x, replicated)
        _PROGRAMS[key] = jax.jit(functools.partial(model_draft_step, dgraph, k=k, **kw), donate_argnames=("dcache",))
    return _PROGRAMS[key]


def draft_programs(dgraph, k: int, pool_sharding=None, replicated=None) -> DraftPrograms:
    """:class:`DraftPrograms` for a drafter's ``dgraph`` drafting ``k`` tokens; ``pool_sharding``: what its page
    pools are constrained to (None: one device), ``replicated``: what the drafts are (as :func:`programs`)."""
    key = ("draft", dgraph, k, pool_sharding, replicated)
    if key not in _PROGRAMS:
        kw, out = {}, {}
        if pool_sharding is not None:
            kw["constrain"] = lambda c: jax.lax.with_sharding_constraint(c, pool_sharding)
        if replicated is not None:
            out["replicate"] = lambda x: jax.lax.with_sharding_constraint(x, replicated)
        pools = dict(donate_argnames=("pools",))
        _PROGRAMS[key] = DraftPrograms(
            jax.jit(functools.partial(draft_step, dgraph, k=k, **kw, **out), **pools),
            jax.jit(functools.partial(copy_draft_page, **kw), **pools),
            jax.jit(take_draft_page),
            jax.jit(functools.partial(put_draft_page, **kw), **pools))
    return _PROGRAMS[key]
