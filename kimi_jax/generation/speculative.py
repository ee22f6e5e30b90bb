"""Speculative decoding: a drafter proposes up to ``k`` tokens per sequence, one forward of the target over the
``k + 1`` positions checks them, and the accepted prefix (plus the target's own next token) is kept.

Everything runs inside one compiled ``lax.while_loop``, as the plain decode loop does (:func:`kimi_jax.generation.
generate.decode`): the drafter, the verify forward, the acceptance and the cache commit are traced, so the host is
not in the loop per step and a warm generator never recompiles.

* **Drafters.** Prompt lookup (:class:`NGram`): each sequence's history (prompt + output so far) lives on the
  device; the longest recent suffix of ``n`` tokens (``n`` from ``max_n`` down to ``min_n``) is looked up in it and
  the most recent earlier occurrence proposes the tokens that followed it; no weights. A DSpark drafter
  (:class:`DSpark`, :mod:`kimi_jax.model.dspark`): one forward of a small model drafts the whole block from the
  target's hidden states, whose context entries the target's prefill and verify calls write as they go. A draft
  model (:class:`DraftModel`): ``k`` greedy one-token steps of a smaller model of the family from its own cache,
  which then follows the kept tokens as the target's cache does. Every drafter's proposal is one token per position
  for certain (greedy), which is what the acceptance below assumes.
* **Verify.** The target runs over ``[last token, d_1 .. d_k]`` continuing the cache (``prefix=True``), with the KDA
  layers in verify mode (:func:`kimi_jax.model.cache.for_verify`): they run the decode recurrence over the positions
  but leave their state and conv tails as they were, recording the recurrence's inputs.
* **Acceptance** (:func:`accept_drafts`). Greedy rows: ``t_i`` is the target's argmax after position ``i``; drafts are
  accepted while ``d_{i+1} == t_i``, so the output equals plain greedy decoding token for token (up to the float
  rounding of a ``k + 1``-row forward against a one-row one). Sampled rows (temperature > 0): rejection sampling
  (Leviathan et al. 2023, Chen et al. 2023) against the distribution the plain sampler draws from (temperature, top-k,
  top-p: :func:`kimi_jax.generation.sampling.probabilities`). A draft is one token for certain (its proposal puts
  all its mass on it), so ``d_{i+1}`` is accepted with probability ``p_i(d_{i+1})``; at the first
  rejection the token is drawn from ``p_i`` without ``d_{i+1}`` (renormalised), and when every draft is accepted the
  next is drawn from ``p_a``: each kept token has exactly the plain sampler's distribution given the ones before
  it (not the same draws: the random numbers are used differently). The sequence gains ``t_0 .. t_a`` (``a``
  accepted drafts), cut at a stop id or the budget exactly as the plain loop cuts.
* **Commit.** The cache keeps exactly the positions of the kept tokens: the KDA entries replay the recurrence over
  the kept prefix from the recorded inputs (:func:`kimi_jax.model.attention.commit_verified`; the later positions
  made inert, which leaves the state bit for bit), the attention rows past the new length stay written but unread
  (the next call writes over them first), the lengths say where each sequence ends.
* **Pacing** (``adapt``, :func:`worth_verifying`). A step verifies only where a sequence drafted and, with
  ``adapt="cost"``, where the drafts are expected to repay what a verify step costs in plain steps on this device
  (``SpecState.cost``, measured by :class:`~kimi_jax.generation.generate.Generator` and by the engine's scheduler).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from kimi_jax.checkpoint.drafter import abstract_drafter, load_drafter
from kimi_jax.checkpoint.loading import from_pretrained
from kimi_jax.generation.sampling import DecodeState, Sampling, argmax, draw, merge, probabilities, step_keys
from kimi_jax.model import config as config_lib
from kimi_jax.model import dspark
from kimi_jax.model.attention import commit_verified
from kimi_jax.model.cache import for_verify

EMA = 0.3  # weight of the latest step in a row's acceptance rate
MIN_RATE = 0.15  # below this a row stops drafting ...
PROBE = 8  # ... except every PROBE-th step
# Pacing (``adapt``): "cost" (the default) measures what a verify step costs in plain steps and verifies only where
# the drafts are expected to repay it (:func:`worth_verifying`); "acceptance" verifies whenever a row drafted.
ADAPT = ("cost", "acceptance")
NEVER, ALWAYS = float("inf"), -1.0  # SpecState.cost that make every step plain / every step a verify step


def pacing(cost: float | None, adapt: str) -> float:
    """The ``SpecState.cost`` a loop runs with: the measured cost of a verify step in plain steps, or 1 (free: every
    step where a row drafted verifies) with ``adapt="acceptance"`` or when not measured."""
    return 1.0 if adapt == "acceptance" or cost is None else float(cost)


def can_pay(cost: float, k: int) -> bool:
    """Whether drafting ``k`` tokens can ever repay a verify step of ``cost`` plain steps (it adds at most k)."""
    return cost < k + 1


def probe_every(cost, xp=jnp):
    """How many steps apart a row that drafted probes (verifies although its drafts are not expected to pay, so that
    a rate left low is measured again): ``PROBE`` while a verify step is free (cost 1: the acceptance rule), else a
    multiple of it that keeps a failed probe's cost, ``cost - 1`` plain steps, under 1/32 of the steps between."""
    finite = xp.where(xp.isfinite(cost), cost, 1.0)
    return PROBE * xp.maximum(1, xp.ceil(4 * (finite - 1))).astype(xp.int32)


def worth_verifying(cost, rate_B, dlen_B, steps_B, active_B, xp=jnp, remaining_B=None):
    """Whether a step verifies: some row drafted, and what the drafts are expected to add (each row's acceptance rate
    times its draft length) repays the verify step's extra cost, ``cost - 1`` plain steps, or a row probes
    (:func:`probe_every`); always with ``cost < 0`` (ALWAYS), never with an infinite cost (NEVER). Where every row's
    tokens count (the engine's scheduler: a slot that finishes takes the next request) the tokens added, summed, must
    reach ``cost - 1`` per active row. Given ``remaining_B`` (the compiled loop: the tokens each row may still make)
    the loop ends with its last row, so what counts is the steps a verify step takes off the longest: ``max(R) -
    max(R - expected)``, at least ``cost - 1`` (the tokens of rows that would end sooner anyway gain the batch
    nothing: 8 different prompts at batch 8, the demo in float32, read 0.63-0.69x of plain with the summed rule).
    ``xp``: ``jax.numpy`` in the compiled loop, ``numpy`` in the engine's scheduler."""
    n = xp.sum(active_B.astype(xp.float32))
    expected = xp.where(active_B, rate_B * dlen_B, 0.0)
    if remaining_B is None:
        pays = xp.sum(expected) >= (cost - 1) * n
    else:
        left = xp.where(active_B, remaining_B, 0).astype(xp.float32)
        pays = xp.max(left) - xp.max(xp.maximum(left - expected, 0.0)) >= cost - 1
    drafted = active_B & (dlen_B > 0)
    probe = xp.any(drafted & (steps_B % probe_every(cost, xp) == 0))
    return (cost < 0) | (xp.any(drafted) & xp.isfinite(cost) & (pays | probe))


def _check_adapt(what: str, adapt: str) -> None:
    if adapt not in ADAPT:
        raise SpeculativeError(f"{what} adapt={adapt!r}: one of {', '.join(ADAPT)}")


class SpeculativeError(ValueError):
    """A speculative-decoding setting that cannot be used: names the setting and what would be valid."""


@dataclasses.dataclass(frozen=True)
class NGram:
    """Prompt-lookup drafting: up to ``k`` tokens that followed the most recent earlier occurrence of the history's
    last ``n`` tokens, ``n`` from ``max_n`` down to ``min_n``."""

    k: int = 4
    max_n: int = 3
    min_n: int = 1
    adapt: str = dataclasses.field(default="cost", compare=False)  # pacing (a host choice: one compiled loop for both)

    def __post_init__(self):
        _check_adapt("ngram", self.adapt)
        if not 1 <= self.k <= 16:
            raise SpeculativeError(f"ngram k={self.k}: draft 1 to 16 tokens per step")
        if not 1 <= self.min_n <= self.max_n <= 8:
            raise SpeculativeError(f"ngram min_n={self.min_n}, max_n={self.max_n}: need 1 <= min_n <= max_n <= 8")


@dataclasses.dataclass(frozen=True, eq=False)
class DSpark:
    """A DSpark drafter (:mod:`kimi_jax.model.dspark`): ``k`` tokens per step (at most its block size), drafted from
    the target's hidden states. Load one with :func:`kimi_jax.checkpoint.drafter.load_drafter` or give
    ``"dspark:PATH[,k=N]"``."""

    model: object  # kimi_jax.model.dspark.DSparkModel
    k: int
    adapt: str = "cost"  # pacing: see ADAPT

    def astype(self, dtype, parallel=None) -> "DSpark":
        """The drafter with its weights and products in ``dtype`` (the target's), run on ``parallel`` (the target's
        mesh and layout, :class:`~kimi_jax.parallel.sharding.Parallel`, or None: one device): its products and its
        context attention place themselves there as the target's do."""
        dtype = jnp.dtype(dtype)
        run = dataclasses.replace(self.model.run, dtype=dtype, parallel=parallel)
        if self.model.run == run:
            return self
        model = dspark.abstract(self.model.cfg, dtype, run)
        nnx.update(model, jax.tree.map(lambda a: a.astype(dtype), nnx.state(self.model, nnx.Param)))
        return DSpark(model, self.k, self.adapt)

    def __post_init__(self):
        _check_adapt("dspark", self.adapt)
        n = self.model.cfg.block_size
        if not 1 <= self.k <= n:
            raise SpeculativeError(f"dspark k={self.k}: this drafter drafts 1 to {n} tokens per step (its block size)")


@dataclasses.dataclass(frozen=True, eq=False)
class DraftModel:
    """A smaller model of the family as the drafter (any :class:`~kimi_jax.model.decoder.KimiModel` with the target's
    vocabulary): ``k`` greedy one-token steps of it per step, from its own cache, which then follows the kept tokens
    exactly as the target's does (one forward over the verified positions in verify mode, committed over the kept
    ones). ``"draft:PATH[,k=N]"`` loads one with :func:`~kimi_jax.checkpoint.loading.from_pretrained`."""

    model: object  # kimi_jax.model.decoder.KimiModel
    k: int = 4
    adapt: str = "cost"  # pacing: see ADAPT

    def __post_init__(self):
        _check_adapt("draft model", self.adapt)
        if not 1 <= self.k <= 16:
            raise SpeculativeError(f"draft model k={self.k}: draft 1 to 16 tokens per step")


def parse(spec, *, dtype=None, weights: bool = True, parallel=None) -> NGram | DSpark | DraftModel | None:
    """``speculative=`` as given to ``generate``: None, an :class:`NGram`, :class:`DSpark` or :class:`DraftModel`,
    or a string ``"ngram"`` / ``"ngram:k=4,max_n=3,min_n=1"`` / ``"dspark:PATH[,k=N]"`` / ``"draft:PATH[,k=N]"``,
    each of which also takes ``adapt=cost|acceptance`` (:data:`ADAPT`) (``dtype``: the drafter's, when it is loaded
    here; ``dspark:demo``: the drafter shipped for the demo model). ``weights=False``: a DSpark drafter from its
    ``config.json`` alone, abstract (:func:`kimi_jax.checkpoint.drafter.abstract_drafter`: for planning and
    deviceless compiles). ``parallel``: the target's mesh and layout (:class:`~kimi_jax.parallel.sharding.Parallel`):
    a draft model named here is read straight into its shards on it and runs there, as the target does (a DSpark
    drafter is placed on it by ``generate`` and the engine)."""
    if spec is None or isinstance(spec, (NGram, DSpark, DraftModel)):
        return spec
    if not isinstance(spec, str):
        raise SpeculativeError(f"speculative={spec!r}: give 'ngram[:k=N,max_n=N,min_n=N,adapt=A]', "
                               "'dspark:PATH[,k=N,adapt=A]', 'draft:PATH[,k=N,adapt=A]', an NGram, a DSpark or a "
                               "DraftModel")
    name, _, rest = spec.partition(":")
    if name in ("dspark", "draft"):
        return _parse_model(spec, name, rest, dtype, weights, parallel)
    if name != "ngram":
        raise SpeculativeError(f"speculative={spec!r}: unknown drafter {name!r}; known: 'ngram', 'dspark', 'draft'")
    kw = _options(spec, rest, ("k", "max_n", "min_n"))
    return NGram(**kw)


def check(spec: str) -> None:
    """A ``speculative=`` string checked without loading weights (a command's flag, before anything starts): its
    form; a DSpark drafter's config (as :func:`parse` with ``weights=False``); a draft model's directory holding a
    ``config.json`` (``"demo"``: the shipped model). Raises :class:`SpeculativeError`."""
    name, _, rest = spec.partition(":")
    if name != "draft":
        parse(spec, weights=False)
        return
    path, _ = _model_spec(spec, name, rest)
    if not os.path.isfile(os.path.join(config_lib.model_dir(path), "config.json")):
        raise SpeculativeError(f"speculative={spec!r}: no draft model at {path!r} (no config.json there)")


def _options(spec: str, text: str, numbers: tuple[str, ...]) -> dict:
    """``'name=value,...'``: the integer options ``numbers`` and ``adapt`` (one of :data:`ADAPT`)."""
    kw = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name in numbers and value.isdigit():
            kw[name] = int(value)
        elif name == "adapt" and value in ADAPT:
            kw[name] = value
        else:
            shown = ", ".join([f"{n}=N" for n in numbers] + [f"adapt={'|'.join(ADAPT)}"])
            raise SpeculativeError(f"speculative={spec!r}: {part!r} is not one of {shown}")
    return kw


def _model_spec(spec: str, name: str, rest: str) -> tuple[str, dict]:
    """(the drafter's directory, its options ``k`` and ``adapt`` as given) of ``'{name}:PATH[,k=N,adapt=A]'``."""
    path, _, opts = rest.partition(",")
    if not path:
        raise SpeculativeError(f"speculative={spec!r}: give the drafter's directory, '{name}:PATH[,k=N]'")
    return path, _options(spec, opts, ("k",))


def _parse_model(spec: str, name: str, rest: str, dtype, weights: bool = True, parallel=None) -> DSpark | DraftModel:
    path, kw = _model_spec(spec, name, rest)
    if name == "draft":
        on = {} if parallel is None else dict(mesh=parallel.mesh, layout=parallel.layout)
        return DraftModel(from_pretrained(path, dtype=dtype, progress=False, **on), **kw)
    model = load_drafter(path, dtype=dtype) if weights else abstract_drafter(path, dtype)
    return DSpark(model, **{"k": model.cfg.block_size, **kw})


@struct.dataclass
class SpecState:
    """The plain loop's state plus what drafting and its statistics need."""

    dec: DecodeState
    hist: jax.Array  # [B, L] int32: prompt then new tokens; row b valid up to hlen[b]
    hlen: jax.Array  # [B] int32
    steps: jax.Array  # [B] int32: loop steps (verify or plain) that sequence took part in
    drafted: jax.Array  # [B] int32: draft tokens proposed
    accepted: jax.Array  # [B] int32: draft tokens accepted
    verified: jax.Array  # [B] int32: verify steps in which the sequence had drafts
    rate: jax.Array  # [B] float32: recent share of drafted tokens accepted (moving average)
    cost: jax.Array  # [] float32: a verify step's cost in plain steps, as :func:`worth_verifying` weighs it
    dcache: object = None  # a DSpark drafter's context entries (DraftCache) or a draft model's cache


def ngram_draft(hist_BL, hlen_B, room_B, drafter: NGram):
    """(drafts ``[B, k]`` int32, draft lengths ``[B]``): for each row, the tokens after the most recent earlier
    occurrence of its last ``n`` tokens (largest ``n`` that matches), at most ``room`` of them and only tokens the
    history holds."""
    B, L = hist_BL.shape
    k = drafter.k
    pos = jnp.arange(L)[None, :]  # candidate start j of an earlier occurrence
    best_start = jnp.full((B,), -1, jnp.int32)
    found = jnp.zeros((B,), bool)
    for n in range(drafter.max_n, drafter.min_n - 1, -1):
        ok = (pos + n < hlen_B[:, None]) & (hlen_B[:, None] >= n + 1)  # continuation exists, suffix is not itself
        for i in range(n):
            want = jnp.take_along_axis(hist_BL, jnp.clip(hlen_B - n + i, 0, L - 1)[:, None], axis=1)  # [B, 1]
            got = jnp.take_along_axis(hist_BL, jnp.clip(pos + i, 0, L - 1), axis=1)  # [B, L]
            ok &= got == want
        last = jnp.max(jnp.where(ok, pos, -1), axis=1).astype(jnp.int32)  # the most recent occurrence
        take = ~found & (last >= 0)
        best_start = jnp.where(take, last + n, best_start)  # where the proposal starts
        found |= take
    idx = best_start[:, None] + jnp.arange(k)[None, :]
    drafts = jnp.take_along_axis(hist_BL, jnp.clip(idx, 0, L - 1), axis=1)
    avail = jnp.where(found, jnp.clip(hlen_B - best_start, 0, k), 0)
    return drafts, jnp.minimum(avail, room_B).astype(jnp.int32)


def ngram_draft_host(hist, room: int, drafter: NGram) -> list[int]:
    """:func:`ngram_draft` for one sequence on the host (the serving scheduler drafts there: the drafts travel in
    its step plans): the tokens after the most recent earlier occurrence of the history's last ``n`` tokens (largest
    ``n`` that matches), at most ``room`` and ``k`` of them."""
    h = np.asarray(hist, np.int64)
    L, room = len(h), min(int(room), drafter.k)
    if room <= 0:
        return []
    for n in range(drafter.max_n, drafter.min_n - 1, -1):
        if L < n + 1:
            continue
        windows = np.lib.stride_tricks.sliding_window_view(h[: L - 1], n)  # occurrences with a continuation
        hit = np.flatnonzero((windows == h[L - n:]).all(axis=1))
        if hit.size:
            start = int(hit[-1]) + n
            return h[start: start + room].tolist()
    return []


def accept_drafts(logits_BKV, drafts_BK, dlen_B, samp: Sampling, count_B):
    """(tokens ``[B, k + 1]``, accepted drafts ``[B]``) of one verify forward: ``logits[:, i]`` is the target after
    position ``i`` (the last token, then the drafts); the row gains ``tokens[:, :a + 1]``. Greedy rows take the
    argmax and accept the drafts that equal it; rows with temperature > 0 accept by rejection sampling (module
    docstring), keyed by (seed, row, the index of the new token) as the plain sampler is."""
    K1 = logits_BKV.shape[1]
    keys = lambda: jax.vmap(lambda i: step_keys(samp.seed, count_B + i), out_axes=1)(jnp.arange(K1))  # noqa: E731
    return accept(logits_BKV, drafts_BK, dlen_B, samp.temperature, samp.top_k, samp.top_p, keys)


def accept(logits_BKV, drafts_BK, dlen_B, temperature_B, top_k_B, top_p_B, keys):
    """:func:`accept_drafts` with the sampling values per row and ``keys()`` giving the ``[B, k + 1]`` PRNG keys of
    the positions' new tokens (called only when some row samples): the serving engine keys by request."""
    B, K1, V = logits_BKV.shape
    k = K1 - 1
    j = jnp.arange(k)[None]
    t = argmax(logits_BKV.reshape(-1, V)).reshape(B, K1)
    agree = (drafts_BK == t[:, :k]) & (j < dlen_B[:, None])
    a = jnp.sum(jnp.cumprod(agree.astype(jnp.int32), axis=1), axis=1)
    temp = temperature_B

    def rejection():
        probs = jax.vmap(jax.vmap(probabilities, (0, None, None, None)))(logits_BKV, temp, top_k_B, top_p_B)
        keys_BK = keys()
        u = jax.vmap(jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1))))(keys_BK[:, :k])
        p_draft = jnp.take_along_axis(probs[:, :k], drafts_BK[..., None], axis=-1)[..., 0]  # [B, k]
        ok = (u < p_draft) & (j < dlen_B[:, None])
        a_s = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
        rows = jnp.arange(B)
        p_a = probs[rows, a_s]  # [B, V]: the distribution after the accepted drafts
        rejected = jnp.take_along_axis(drafts_BK, jnp.minimum(a_s, k - 1)[:, None], axis=1)[:, 0]
        p_a = jnp.where((a_s < dlen_B)[:, None] & (jnp.arange(V)[None] == rejected[:, None]), 0.0, p_a)
        # the residual's mass is p_a(not the draft) > 0 whenever the draft was rejected (u < 1 accepts p = 1)
        last = jax.vmap(lambda key, p: jax.random.categorical(key, jnp.log(p)))(keys_BK[rows, a_s], p_a)
        drafted = jnp.concatenate([drafts_BK, jnp.zeros((B, 1), jnp.int32)], axis=1)
        t_s = jnp.where(jnp.arange(K1)[None] < a_s[:, None], drafted, last[:, None].astype(jnp.int32))
        sampled = temp > 0
        return jnp.where(sampled[:, None], t_s, t), jnp.where(sampled, a_s, a)

    return jax.lax.cond(jnp.any(temp > 0), rejection, lambda: (t, a))


def start(dec: DecodeState, prompt_BT, lengths_B, out_len: int, dcache=None) -> SpecState:
    """The speculative loop's state after a prefill: the history holds each prompt and its first new token, in
    ``max(T, out_len)`` positions (prompt and output fit the cache, whose length ``out_len`` is: one loop program
    whatever the prompt's bucket ``T``); ``dcache``: the drafter's cache after the prompts (:func:`follow_prefill`);
    the cost 1 (:func:`pacing`'s unmeasured value; the generator sets the measured one)."""
    return SpecState(dec, *_start_rows(prompt_BT, lengths_B, dec.token, dec.count, out_len), dcache)


@functools.partial(jax.jit, static_argnames=("out_len",))
def _start_rows(prompt_BT, lengths_B, token_B, count_B, out_len: int):
    """:func:`start`'s new fields (history, its lengths, the statistics, the cost) in one compiled call: its dozen
    operations one at a time took ~3 ms of a 64-token demo request's 40 ms decode here."""
    B, T = prompt_BT.shape
    L = max(T, out_len)
    hist = jnp.zeros((B, L), jnp.int32).at[:, :T].set(prompt_BT.astype(jnp.int32))
    hist = hist.at[jnp.arange(B), lengths_B].set(token_B, mode="drop")
    zeros = jnp.zeros((B,), jnp.int32)
    return (hist, (lengths_B + count_B).astype(jnp.int32), zeros, zeros, zeros, zeros, jnp.ones((B,), jnp.float32),
            jnp.float32(1.0))


@dataclasses.dataclass(frozen=True)
class BlockDraft:
    """The compiled loop's static view of a :class:`DSpark` drafter (its weights go in as arguments)."""

    k: int


@dataclasses.dataclass(frozen=True)
class ModelDraft:
    """The compiled loop's static view of a :class:`DraftModel`."""

    k: int


def static(drafter):
    """(the loop's static drafter, the drafter model's graph, its weights): what :func:`decode` takes."""
    if isinstance(drafter, (DSpark, DraftModel)):
        graph, weights = nnx.split(drafter.model)
        return (BlockDraft if isinstance(drafter, DSpark) else ModelDraft)(drafter.k), graph, weights
    return drafter, None, None


def shared_head(model):
    """The target's (embedding table, lm_head) that a DSpark drafter shares."""
    table = model.embed_tokens[...]
    return table, (table if model.cfg.tie_word_embeddings else model.lm_head[...])


def follow_prefill(drafter, dgraph, dparams, dcache, ids_BT, target, out, start_B, lengths_B):
    """(Traced.) The drafter's cache after a ``target`` prefill call (or chunk) over ``ids`` at positions ``start
    ..`` (``lengths`` valid each): a DSpark drafter writes its context entries from the call's ``return_hidden``
    outputs ``out``; a draft model prefills the same tokens into its own cache."""
    dmodel = merge(dgraph, dparams)
    if isinstance(drafter, BlockDraft):
        return dmodel.write_context(dcache, dmodel.taps(target, out), start_B, lengths_B)
    return dmodel(ids_BT, cache=dcache, lengths=lengths_B, prefix=True, last_only=True).cache


def _model_drafts(dmodel, dcache, token_B, want_B, k: int):
    """A draft model's ``k`` greedy tokens after ``token`` (rows with ``want`` 0 feed nothing), from its cache; the
    cache they leave is dropped (:func:`_follow` advances it over the kept tokens)."""
    active = (want_B > 0).astype(jnp.int32)
    tok, out = token_B, []
    for _ in range(k):
        res = dmodel(tok[:, None], cache=dcache, lengths=active, prefix=True, last_only=True)
        tok, dcache = argmax(res.logits[:, 0].astype(jnp.float32)), res.cache
        out.append(tok.astype(jnp.int32))
    return jnp.stack(out, axis=1)


def _follow(dmodel, dcache, x_BK, n_new_B):
    """A draft model's cache advanced over the first ``n_new`` of the positions ``x`` (the step's last token and
    drafts): one forward in verify mode, committed over the kept positions, as the target's cache is."""
    res = dmodel(x_BK, cache=for_verify(dcache, x_BK.shape[1]), lengths=n_new_B, prefix=True, last_only=True)
    return commit_verified(res.cache, dcache.lengths, n_new_B, dmodel.run)


def _drafts(model, dmodel, drafter, st: SpecState, want_B):
    """A DSpark drafter's or a draft model's drafts ``[B, k]`` for one step of :func:`decode`: all ``want`` tokens
    of each row, the drafter run only where some row asks."""
    d, k = st.dec, drafter.k
    if isinstance(drafter, ModelDraft):
        make = lambda: _model_drafts(dmodel, st.dcache, d.token, want_B, k)  # noqa: E731
    else:
        table, head = shared_head(model)
        make = lambda: dmodel.draft(st.dcache, table, head, d.token, d.cache.lengths, k)  # noqa: E731
    return jax.lax.cond(jnp.any(want_B > 0), make, lambda: jnp.zeros((d.token.shape[0], k), jnp.int32))


@functools.partial(jax.jit, static_argnames=("graphdef", "drafter", "dgraph"), donate_argnames=("state",))
def decode(graphdef, params, state: SpecState, samp: Sampling, max_steps, *,
           drafter: NGram | BlockDraft | ModelDraft, dgraph=None, dparams=None) -> SpecState:
    """Up to ``max_steps`` (traced) verify steps in one ``while_loop``; stops early when every sequence is done.
    ``state`` is donated. A DSpark drafter or a draft model: ``drafter``, ``dgraph``, ``dparams`` from
    :func:`static`."""
    model = merge(graphdef, params)
    dmodel = None if dgraph is None else merge(dgraph, dparams)
    k = drafter.k

    taps = functools.partial(_taps, model, dmodel if isinstance(drafter, BlockDraft) else None, k)
    def cond(carry):
        i, st = carry
        return (i < max_steps) & ~jnp.all(st.dec.done)

    def verify(d: DecodeState, drafts, dlen, active):
        """One forward over [last token, drafts]: (cache committed over the kept positions, targets [B, k + 1],
        accepted drafts [B], kept tokens [B, k + 1] bool)."""
        x = jnp.concatenate([d.token[:, None], drafts], axis=1)  # [B, k + 1]
        res = model(x, cache=for_verify(d.cache, k + 1), lengths=jnp.where(active, dlen + 1, 0), prefix=True,
                    return_hidden=isinstance(drafter, BlockDraft))
        logits = res.logits.astype(jnp.float32)
        t, a = accept_drafts(logits, drafts, dlen, samp, d.count)
        keep = _kept(d, t, a, active, samp)
        n_new = jnp.sum(keep.astype(jnp.int32), axis=1)
        return (commit_verified(res.cache, d.cache.lengths, n_new, model.run), t, a, keep, taps(res, k + 1),
                recorded(logits))

    def plain(d: DecodeState, drafts, dlen, active):
        """No row drafted: the plain loop's one-position step (the same program as :func:`generate.decode`'s)."""
        B = drafts.shape[0]
        res = model(d.token[:, None], cache=d.cache, lengths=active.astype(jnp.int32), prefix=True, last_only=True,
                    return_hidden=isinstance(drafter, BlockDraft))
        logits = res.logits.astype(jnp.float32)
        first = draw(logits[:, 0], samp, d.count)
        t = jnp.concatenate([first[:, None], jnp.full((B, k), -1, jnp.int32)], axis=1)
        a = jnp.zeros((B,), jnp.int32)
        return res.cache, t, a, _kept(d, t, a, active, samp), taps(res, 1), recorded(logits)

    def recorded(logits_BTV):
        """The step's logits for ``record_logits`` (``[B, k + 1, V]``: position j's drew t_j), else None."""
        if state.dec.logits is None:
            return None
        return jnp.pad(logits_BTV, [(0, 0), (0, k + 1 - logits_BTV.shape[1]), (0, 0)])

    def body(carry):
        i, st = carry
        d, active = st.dec, ~st.dec.done
        # drafting beyond the budget or the cache is wasted (the decode state's output capacity is the cache length)
        room = jnp.clip(jnp.minimum(samp.budget - d.count - 1, d.out.shape[1] - d.cache.lengths - 1), 0, k)
        # a row whose drafts were mostly rejected lately drafts nothing (probing every PROBE steps), and a step whose
        # drafts do not repay a verify forward is the plain one-position step: a bad drafter, or a dear verify step,
        # costs little
        hopeful = (st.rate >= MIN_RATE) | (st.steps % PROBE == 0)
        want = jnp.where(active & hopeful, room, 0)
        if dmodel is None:  # prompt lookup: what it finds decides (and costs little)
            drafts, found = ngram_draft(st.hist, st.hlen, want, drafter)
            now = worth_verifying(st.cost, st.rate, found, st.steps, active, remaining_B=samp.budget - d.count)
            dlen = jnp.where(now, found, 0)
        else:  # a drafter model drafts all it is asked for: decided first, and run only for a verify step
            now = worth_verifying(st.cost, st.rate, want, st.steps, active, remaining_B=samp.budget - d.count)
            dlen = jnp.where(now, want, 0)
            drafts = _drafts(model, dmodel, drafter, st, dlen)
        cache, t, a, keep, x, logits = jax.lax.cond(now, verify, plain, d, drafts, dlen, active)
        n_new = jnp.sum(keep.astype(jnp.int32), axis=1)
        if isinstance(drafter, BlockDraft):
            dcache = dmodel.write_context(st.dcache, x, d.cache.lengths, n_new)
        elif isinstance(drafter, ModelDraft):
            dcache = _follow(dmodel, st.dcache, jnp.concatenate([d.token[:, None], drafts], axis=1), n_new)
        else:
            dcache = None
        return i + 1, _advance(st, cache, t, a, keep, dlen, dcache, samp, logits)

    return jax.lax.while_loop(cond, body, (jnp.int32(0), state))[1]


def _taps(model, dmodel, k: int, res, T: int):
    """A DSpark drafter's context input ``[B, k + 1, X]`` from a target call over ``T`` positions (None: no
    DSpark drafter)."""
    if dmodel is None:
        return None
    return jnp.pad(dmodel.taps(model, res), [(0, 0), (0, k + 1 - T), (0, 0)])


def _kept(d: DecodeState, t, a, active, samp: Sampling):
    """Which of t_0 .. t_k the sequence gains: t_0 .. t_a, cut after a stop id or at the budget, as the plain loop
    cuts."""
    j = jnp.arange(t.shape[1])[None]
    is_stop = jnp.any(t[..., None] == samp.stop[None, None, :], axis=-1).astype(jnp.int32)
    stop_before = jnp.cumsum(is_stop, axis=1) - is_stop
    keep = (j <= a[:, None]) & (stop_before == 0) & (d.count[:, None] + j < samp.budget[:, None])
    return keep & active[:, None]


def _advance(st: SpecState, cache, t, a, keep, dlen, dcache, samp: Sampling, logits=None) -> SpecState:
    """The loop's state after a step that kept ``t[keep]`` (the new cache and drafter context given; ``logits``
    ``[B, k + 1, V]``: what each ``t`` was drawn from, recorded beside the kept tokens when the state records)."""
    d = st.dec
    B, out_len = d.out.shape
    active = ~d.done
    n_new = jnp.sum(keep.astype(jnp.int32), axis=1)
    rows = jnp.arange(B)[:, None]
    j = jnp.arange(t.shape[1])[None]
    slots = jnp.where(keep, d.count[:, None] + j, out_len)  # out_len: out of range, dropped
    out = d.out.at[rows, slots].set(t, mode="drop")
    recorded = d.logits if logits is None else d.logits.at[rows, slots].set(logits, mode="drop")
    hist = st.hist.at[rows, jnp.where(keep, st.hlen[:, None] + j, st.hist.shape[1])].set(t, mode="drop")
    last = jnp.take_along_axis(t, jnp.maximum(n_new - 1, 0)[:, None], axis=1)[:, 0]
    token = jnp.where(n_new > 0, last, d.token)
    count = d.count + n_new
    is_stop = jnp.any(t[..., None] == samp.stop[None, None, :], axis=-1)
    done = d.done | (active & (jnp.any(keep & is_stop, axis=1) | (count >= samp.budget)))
    rate = jnp.where(dlen > 0, (1 - EMA) * st.rate + EMA * a / jnp.maximum(dlen, 1), st.rate)
    return SpecState(DecodeState(cache, token, out, count, done, recorded), hist, st.hlen + n_new,
                     st.steps + active.astype(jnp.int32), st.drafted + dlen, st.accepted + jnp.minimum(a, n_new),
                     st.verified + (dlen > 0).astype(jnp.int32),
                     rate, st.cost, dcache)
