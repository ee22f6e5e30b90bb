"""Generation: bucketed prefill and a compiled multi-step decode loop over the static cache, with sampling.

How it is built (and why):

* The model is split once (``nnx.split``) into a static graph definition and a parameter pytree; the jitted
  functions below merge them inside, so parameters are ordinary (non-donated) inputs.
* Compile-time constants: batch slots ``B`` (bucketed), prompt bucket ``T``, cache length ``S``, output
  capacity ``N`` (= S), the number of stop-id slots and whether logits are recorded. Everything a request
  varies -- prompt lengths, token budgets, temperature / top-k / top-p, seed, stop ids -- is a traced value,
  so a warm generator never recompiles.
* Prefill (fresh, right-padded prompts with per-sequence lengths) writes the cache and samples the first
  token. Prompts longer than ``prefill_chunk`` tokens (or whose one-call prefill would not fit in memory) are
  prefilled in chunks, each continuing from the cache (KDA state and conv tails carried from a zeroed start,
  attention reading the rows written so far), so the working memory is one chunk's whatever the prompt's length.
* Decode runs many steps inside one ``lax.while_loop`` (each sequence stops on a stop id or its budget;
  finished sequences feed length 0, which leaves their cache untouched), with the loop state -- cache included --
  donated. The host is not in the loop per token.
* Before anything is allocated, the cache and the prefill's working memory (XLA's count for the compiled programs:
  temporaries and outputs), with a DSpark drafter or a draft model its cache and the copy of its weights the generator
  makes, are checked against the memory budget (default: 90% of what the device has free); a prefill that does not
  fit is re-planned in smaller chunks, and what cannot fit even then is refused, naming the limit. The prefill
  programs are therefore compiled ahead of time, from shapes (:func:`jax.jit`'s ``lower``).
* Streaming calls the same compiled decode function with a traced step limit (``stream_every`` steps per
  call) and hands the new tokens to the callback in between. We chose this over ``io_callback`` because it
  keeps the loop free of host round-trips (a callback would sync device and host every token), needs no
  ordered effects inside ``while_loop``, and costs nothing when not streaming.
* The cache of each batch bucket is kept and donated from request to request: a fresh prefill never reads
  old contents (KDA state and conv tails restart from zero; attention only sees positions written by this
  request).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
import weakref
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kimi_jax.model import dspark, offload
from kimi_jax.model.cache import Cache, KDACache, cache_shapes, init_cache
from kimi_jax.model.config import model_dir
from kimi_jax.generation.sampling import (  # noqa: F401 (re-exported: the engine and tests import them from here)
    DecodeState,
    Graph,
    Sampling,
    accept,
    argmax,
    merge,
    sample,
)
from kimi_jax.generation import speculative as speculative_mod
from kimi_jax.parallel import distributed, sharding
from kimi_jax.text.tokenizer import END_OF_MSG, Tokenizer, load_tokenizer

F32 = jnp.float32
EXPLORE = 8  # a batch bucket whose requests have not drafted for this many drafts again (Generator._drafting) ...
EXPLORE_MAX = 64  # ... the count doubled, up to this, after each such try whose drafts did not repay their cost
MEASURE = 8  # the steps a longer timed call adds when a verify step's cost is measured (:meth:`Generator._measure`)
COST_SAMPLES = 5  # the measures of a batch bucket whose medians pacing weighs (_Timed) ...
MEASURES = 3  # ... of which the first requests of a bucket take this many (one each)
STOP_SLOTS = 8  # stop ids are padded to a multiple of this (-1 = unused) so stop lists do not recompile
PREFILL_CHUNK = 2048  # the most prompt tokens one prefill call takes by default (vLLM's chunked-prefill default too)
MIN_CHUNK = 16  # the smallest chunk a memory budget may ask for (the smallest prompt bucket)
FREE_SHARE = 0.9  # of the device's free memory, what one request may use when no memory_budget says otherwise


class GenerationError(ValueError):
    """Bad input to generation: named argument, offending value, what would be valid."""


# -- the two compiled functions -----------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("graphdef", "out_len", "record_logits"), donate_argnames=("cache",))
def prefill(graphdef, params, cache: Cache, ids_BT, lengths_B, samp: Sampling, *, out_len: int,
            record_logits: bool = False) -> DecodeState:
    """Fresh prefill of right-padded prompts (``lengths`` valid tokens each; 0 = unused slot) and the first
    sampled token. Returns the decode state; ``cache`` is donated."""
    model = nnx.merge(graphdef, params)
    res = model(ids_BT, cache=cache, lengths=lengths_B, last_only=True)
    return _first_token(res.cache, res.logits[:, 0], samp, out_len, record_logits)


def _first_token(cache: Cache | None, logits_BV, samp: Sampling, out_len: int, record_logits: bool) -> DecodeState:
    """The decode state after a prefill whose last prompt positions gave ``logits [B, V]``: the first token sampled."""
    B, V = logits_BV.shape
    st = DecodeState(
        cache=cache,
        token=jnp.zeros((B,), jnp.int32),
        out=jnp.zeros((B, out_len), jnp.int32),
        count=jnp.zeros((B,), jnp.int32),
        done=samp.budget <= 0,
        logits=jnp.zeros((B, out_len, V), F32) if record_logits else None,
    )
    return accept(st, logits_BV, samp, ~st.done)


def restart(cache: Cache) -> Cache:
    """``cache`` ready for a new request prefilled in chunks: lengths 0, KDA states and conv tails zero (what a fresh
    prefill starts from; attention rows need no clearing, a query never sees positions not yet written)."""
    def zero(e):
        return jax.tree.map(jnp.zeros_like, e) if isinstance(e, KDACache) else e

    return Cache(tuple(None if e is None else zero(e) for e in cache.layers), jnp.zeros_like(cache.lengths),
                 tuple(zero(e) for e in cache.stack))


def _prefill_chunk(graphdef, params, cache: Cache, ids_BC, lengths_B, last_BV):
    """One chunk of right-padded prompts, continuing what the cache holds (after :func:`restart` for the first): KDA
    states and conv tails carried, attention over the rows written so far. ``lengths`` valid tokens each (0: the
    prompt ended in an earlier chunk; that row's cache is left untouched, as for a finished sequence in
    :func:`decode`). Returns (cache, ``last [B, V]`` float32: each row's logits at its last prompt token so far);
    ``cache`` and ``last`` are donated. One program serves every chunk: the fresh form would be a second compile."""
    model = nnx.merge(graphdef, params)
    res = model(ids_BC, cache=cache, lengths=lengths_B, prefix=True, last_only=True)
    return res.cache, jnp.where((lengths_B > 0)[:, None], res.logits[:, 0], last_BV)


CHUNK_JIT = dict(static_argnames=("graphdef",), donate_argnames=("cache", "last_BV"))
prefill_chunk = jax.jit(_prefill_chunk, **CHUNK_JIT)


# keep_unused: a DSpark chunk reads only the drafter's context projections, but every drafter weight is an input (and
# resident): so the program that ``kimi-jax plan --compile`` reports (:mod:`kimi_jax.deploy.compile`) is this one
@functools.partial(jax.jit, static_argnames=("graphdef", "drafter", "dgraph"),
                   donate_argnames=("cache", "last_BV", "dcache"), keep_unused=True)
def prefill_chunk_drafted(graphdef, params, cache: Cache, ids_BC, lengths_B, last_BV, drafter, dgraph, dparams,
                          dcache):
    """:func:`_prefill_chunk` that also brings a drafter's cache along (:func:`~kimi_jax.generation.speculative.
    follow_prefill`: a DSpark drafter's context entries from the target's hidden states at its tapped layers, a draft
    model's own prefill). A whole prompt in one call is one chunk after :func:`restart`. Returns (cache, last,
    dcache); ``cache``, ``last`` and ``dcache`` are donated."""
    model = merge(graphdef, params)
    tapped = isinstance(drafter, speculative_mod.BlockDraft)
    res = model(ids_BC, cache=cache, lengths=lengths_B, prefix=True, last_only=True, return_hidden=tapped)
    dcache = speculative_mod.follow_prefill(drafter, dgraph, dparams, dcache, ids_BC, model, res, cache.lengths,
                                            lengths_B)
    return res.cache, jnp.where((lengths_B > 0)[:, None], res.logits[:, 0], last_BV), dcache


@functools.partial(jax.jit, static_argnames=("out_len", "record_logits"))
def first_token(last_BV, samp: Sampling, *, out_len: int, record_logits: bool = False) -> DecodeState:
    """The decode state after a chunked prefill (:func:`prefill_chunk`'s ``last``), the first token sampled, without
    its cache (None: the caller puts the chunks' cache in, so that it stays where it lives -- host memory under
    offload -- without this program copying it)."""
    return _first_token(None, last_BV, samp, out_len, record_logits)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("state",))
def decode(graphdef, params, state: DecodeState, samp: Sampling, max_steps) -> DecodeState:
    """Up to ``max_steps`` (traced) decode steps in one ``while_loop``; stops early when every sequence is
    done. ``state`` is donated. ``graphdef``: a :class:`~kimi_jax.generation.sampling.Graph` (or a bare one)."""
    model = merge(graphdef, params)

    def cond(carry):
        i, st = carry
        return (i < max_steps) & ~jnp.all(st.done)

    def body(carry):
        i, st = carry
        active = ~st.done
        res = model(st.token[:, None], cache=st.cache, lengths=active.astype(jnp.int32), prefix=True,
                    last_only=True)
        st = accept(st.replace(cache=res.cache), res.logits[:, 0], samp, active)
        return i + 1, st

    return jax.lax.while_loop(cond, body, (jnp.int32(0), state))[1]


# -- host side ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Generation:
    tokens: list[list[int]]  # new tokens per prompt (a final stop id included)
    text: list[str] | None  # decoded new tokens (stop id excluded), when a tokenizer is known
    prompt_tokens: list[list[int]]
    finish_reason: list[str]  # "stop" (a stop id) | "length" (budget)
    logits: list[np.ndarray] | None = None  # per prompt [n_new, V] float32 (record_logits=True)
    timings: dict = dataclasses.field(default_factory=dict)  # seconds: prefill (incl. first token), decode


def _bucket(n: int, buckets: Sequence[int], what: str) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise GenerationError(f"{what} {n} exceeds the largest bucket {buckets[-1]}")


NAMED_KEPT = 4  # drafters named by a string that a generator keeps read (Generator._parse)


def _pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return tuple(out) + (hi,)


def _per_seq(value, n: int, name: str, dtype):
    arr = np.asarray(value, dtype)
    if arr.ndim == 0:
        return np.full((n,), arr, dtype)
    if arr.shape != (n,):
        raise GenerationError(f"{name}: give one value or one per prompt ({n}), got shape {arr.shape}")
    return arr


def _per_prompt_values(n: int, max_new_tokens, temperature, top_k, top_p):
    """The per-prompt arguments of :meth:`Generator.generate` as checked ``[n]`` arrays: (budget int64,
    temperature float32, top_k int64, top_p float32)."""
    budget = _per_seq(max_new_tokens, n, "max_new_tokens", np.int64)
    if np.any(budget <= 0):
        raise GenerationError(f"max_new_tokens must be positive, got {_shown(budget)}")
    return (budget, *check_sampling(n, temperature, top_k, top_p))


def _shown(arr: np.ndarray):
    return arr.tolist() if arr.size != 1 else arr.reshape(()).item()


def check_sampling(n: int, temperature, top_k, top_p, seed=None):
    """Sampling values checked once for every caller (:func:`generate` and the serving engine): one value or one
    per sequence each, as ``[n]`` arrays (temperature float32, top_k int64, top_p float32); ``seed`` (one, or None
    to skip) must fit a uint32. Raises :class:`GenerationError` naming the field and the value."""
    temp = _per_seq(temperature, n, "temperature", np.float32)
    if np.any(~np.isfinite(temp)) or np.any(temp < 0):
        raise GenerationError(f"temperature must be >= 0 (0 = greedy), got {_shown(temp)}")
    topk = _per_seq(top_k, n, "top_k", np.int64)
    if np.any(topk < 0):
        raise GenerationError(f"top_k must be >= 0 (0 = off), got {_shown(topk)}")
    topp = _per_seq(top_p, n, "top_p", np.float32)
    if np.any(~(topp > 0)) or np.any(topp > 1):
        raise GenerationError(f"top_p must be in (0, 1], got {_shown(topp)}")
    if seed is not None and not 0 <= int(seed) < 2**32:
        raise GenerationError(f"seed must be in [0, 2**32), got {seed}")
    return temp, topk, topp


def encode_prompts(prompts, tokenizer: Tokenizer | None, vocab_size: int) -> list[list[int]]:
    """Prompts (a string, a list of ids, or a list of either) as lists of ids, validated."""
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                    and all(isinstance(p, (int, np.integer)) for p in prompts)):
        prompts = [prompts]
    elif isinstance(prompts, np.ndarray):
        prompts = [prompts] if prompts.ndim == 1 else list(prompts)
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise GenerationError("prompts: give a string, a list of token ids, or a non-empty list of either")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise GenerationError(f"prompt {i} is text but no tokenizer is known: pass tokenizer= (an "
                                      "object or a model directory with tiktoken.model / tokenizer.json)")
            ids = tokenizer.encode(p)
        else:
            try:
                ids = [int(t) for t in np.asarray(p).reshape(-1)]
            except (TypeError, ValueError):
                raise GenerationError(f"prompt {i}: not a string or a sequence of token ids") from None
        if not ids:
            raise GenerationError(f"prompt {i} is empty (0 tokens)")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise GenerationError(f"prompt {i}: token ids {bad[:5]} outside the vocabulary 0..{vocab_size - 1}")
        out.append(ids)
    return out


def default_stop_ids(tokenizer: Tokenizer | None, cfg) -> list[int]:
    """The chat turn terminator when the tokenizer has one, else its EOS, else the config's ``eos_token_id``."""
    if tokenizer is not None and END_OF_MSG in tokenizer.specials:
        return [tokenizer.specials[END_OF_MSG]]
    if tokenizer is not None and tokenizer.eos_id is not None:
        return [tokenizer.eos_id]
    return [] if cfg.eos_token_id is None else [cfg.eos_token_id]


def free_memory(device) -> int | None:
    """Bytes free on ``device``: what the runtime reports (TPU / GPU: ``bytes_limit - bytes_in_use``); on the CPU,
    the host's available memory (Linux ``MemAvailable``). None where neither is known."""
    try:
        stats = device.memory_stats()
    except Exception:  # backends without memory statistics
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    if device.platform == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
    """How a request's prompts are prefilled, and the memory it takes per device (bytes)."""

    chunk: int  # tokens per compiled call (the prompt bucket when one call takes the whole prompt)
    calls: int  # calls for the longest prompt
    cache_bytes: int  # the cache of this batch bucket (what lives in host memory not counted)
    working_bytes: int  # the largest call's temporaries and new outputs, as XLA counts them for the compiled program
    limit: int | None  # the memory budget it was checked against (None: unknown, not checked)
    drafter_bytes: int = 0  # a DSpark drafter's or a draft model's cache and new copy of its weights (counted too)
    programs: tuple = dataclasses.field(default=(), repr=False, compare=False)  # compiled: (prefill,) or
    # (restart, chunk, first token)


@dataclasses.dataclass
class _Timed:
    """A batch bucket's measures (:meth:`Generator._measure`), the last ``COST_SAMPLES``: each a plain step of the
    speculative loop and a verify step's cost in plain steps (timed in one request, or in two where the first ended
    before its verify steps were timed: ``pending``, its plain step). Their medians are what pacing weighs: one
    measure alone read the same drafter's verify step as 2.8 and 4.7 plain steps in two runs on a busy machine, and
    the first after the loop compiled timed the demo's plain step at 2.7x what it takes warm."""

    plain: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=COST_SAMPLES))
    ratio: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=COST_SAMPLES))
    pending: float | None = None

    def times(self) -> tuple[float, float]:
        """(a plain step, a verify step) in seconds: the median plain step, and that times the median cost."""
        plain = float(np.median(self.plain))
        return plain, plain * float(np.median(self.ratio))


@dataclasses.dataclass(frozen=True)
class _Drafter:
    """A drafter as a :class:`Generator` runs it: the loop's static drafter (:func:`~kimi_jax.generation.speculative.
    static`) and, for a DSpark drafter or a draft model, its graph, its weights placed where the programs take them
    (replicated over the model's mesh) and the model they belong to (a DSpark drafter in the model's dtype)."""

    kind: object
    graph: object = None
    params: object = None
    model: object = None
    costs: dict = dataclasses.field(default_factory=dict, compare=False)  # batch bucket -> (the loop's plain
    # step, its verify step) in seconds: the medians of its _Timed samples
    timed: dict = dataclasses.field(default_factory=dict, compare=False)  # batch bucket -> _Timed
    warm: set = dataclasses.field(default_factory=set, compare=False)  # the loop shapes a measure has run (warmed)
    gains: dict = dataclasses.field(default_factory=dict, compare=False)  # batch bucket -> drafts accepted per
    # sequence and verify step in its last request that drafted or measured; skipped: requests since it last drafted;
    # explore: how many it skips before it drafts again (EXPLORE, doubled by each try that did not pay)
    skipped: dict = dataclasses.field(default_factory=dict, compare=False)
    explore: dict = dataclasses.field(default_factory=dict, compare=False)

    def exploring(self, B: int) -> bool:
        """Whether bucket ``B``'s next request drafts again to measure anew (:meth:`Generator._drafting`)."""
        return self.skipped.get(B, 0) >= self.explore.get(B, EXPLORE)

    def sample(self, B: int, plain: float, verify: float | None) -> None:
        """A measure of bucket ``B`` (seconds: the loop's plain step and its verify step, or None where the request
        ended before the verify step was timed: kept pending for the next measure); ``costs[B]``: the medians."""
        timed = self.timed.setdefault(B, _Timed())
        timed.pending = None if verify is not None else plain
        if verify is not None:
            timed.plain.append(plain)
            timed.ratio.append(verify / plain)
            self.costs[B] = timed.times()

    def learn(self, B: int, timings: dict) -> dict:
        """What a request of batch bucket ``B`` showed (its ``timings["speculative"]``, returned), for the next one's
        choice. The gain of one that measured and then decoded plainly counts too: the next request weighs that, not
        the optimistic ``k``, before its prefill (a bucket whose drafts never paid prefilled every request for the
        drafter and then decoded plainly: the demo's repeating prompt at 0.73-0.80x of plain). A request that drafted
        sets how many plain ones the bucket waits before it tries again: ``EXPLORE`` where its drafts paid, twice the
        last wait where it was such a try and they did not."""
        if timings["drafting"] or timings["verify_steps"]:  # (it drafted, or its measuring steps verified)
            self.gains[B] = _gain(timings["accepted"], timings["verified"])
        if not timings["drafting"]:
            self.skipped[B] = self.skipped.get(B, 0) + 1
            return timings
        cost, gain = timings["verify_cost"], self.gains.get(B)
        if cost is None or gain is None or cost <= 1 + gain:  # (its drafts paid)
            self.explore[B] = EXPLORE
        elif self.exploring(B):  # a try after EXPLORE or more plain requests that did not pay: wait longer next time
            self.explore[B] = min(EXPLORE_MAX, 2 * self.explore.get(B, EXPLORE))
        self.skipped[B] = 0
        return timings


def _on_mesh(drafter) -> bool:
    """A draft model that runs on a mesh (read into its shards there): its weights stay where they are."""
    return isinstance(drafter, speculative_mod.DraftModel) and drafter.model.run.parallel is not None


class Generator:
    """A model ready to generate: split once, caches kept per batch bucket, compiled functions reused.

    ``max_len``: cache length S (prompt + new tokens must fit). ``batch_buckets`` / ``prompt_buckets``:
    static shapes requests are padded to (defaults: powers of two; prompts from 16 up to ``max_len``).
    ``kv_cache`` (None, ``"int8"`` or, K3.1, ``"int8-index"``) and ``kda_state`` (None = float32, or bfloat16): how the
    cache stores its rows and the KDA state (:mod:`kimi_jax.model.cache`).
    ``prefill_chunk``: the most prompt tokens one prefill call takes; longer prompts are prefilled in chunks of it
    (or of less, when the memory budget asks for it). ``memory_budget``: bytes per device a request may use for its
    cache and its prefill's working memory; 90% of the device's free memory is a limit too, the only one by default.
    """

    def __init__(self, model, tokenizer: Tokenizer | str | None = None, *, max_len: int = 1024,
                 batch_buckets: Sequence[int] = (1, 2, 4, 8, 16, 32, 64), prompt_buckets: Sequence[int] | None = None,
                 min_prompt_bucket: int = 16, kv_cache: str | None = None, kda_state=None,
                 prefill_chunk: int = PREFILL_CHUNK, memory_budget: int | None = None):
        if max_len < 2:
            raise GenerationError(f"max_len must be >= 2, got {max_len}")
        if int(prefill_chunk) < 1:
            raise GenerationError(f"prefill_chunk must be >= 1 token, got {prefill_chunk}")
        if memory_budget is not None and int(memory_budget) <= 0:
            raise GenerationError(f"memory_budget must be a positive number of bytes (or None: the free memory), "
                                  f"got {memory_budget}")
        cache_shapes(model.cfg, 1, 2, kv_cache=kv_cache, kda_state=kda_state)  # unknown options fail here
        self.cache_options = dict(kv_cache=kv_cache, kda_state=kda_state)
        self.cfg = model.cfg
        self.dtype = model.run.dtype
        offload.place_model(model)  # RunConfig(offload=("experts",)): its expert weights into host memory
        self.graphdef, self.params = nnx.split(model)
        self.graph = Graph(self.graphdef)  # the loops' static argument (hashed once)
        self.tokenizer = load_tokenizer(model_dir(tokenizer)) if isinstance(tokenizer, str) else tokenizer
        if self.tokenizer is not None and self.tokenizer.vocab_size > self.cfg.vocab_size:
            raise GenerationError(f"tokenizer has {self.tokenizer.vocab_size} ids but the model only "
                                  f"{self.cfg.vocab_size}")
        self.max_len = int(max_len)
        self.prefill_chunk = int(prefill_chunk)
        self.memory_budget = None if memory_budget is None else int(memory_budget)
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.prompt_buckets = tuple(sorted(prompt_buckets)) if prompt_buckets else _pow2_buckets(
            min(min_prompt_bucket, self.max_len), self.max_len)
        self._caches: dict[int, Cache] = {}
        # a drafter model split and placed once (:meth:`_drafter`), kept while the drafter object lives; an n-gram
        # drafter's record (its measured costs) per setting
        self._drafters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._ngrams: dict = {}
        self._named: dict[str, object] = {}  # drafters named by a string, read once (:meth:`_parse`)
        self._plain_steps: dict[int, float] = {}  # batch bucket -> the least seconds per step of a plain request
        # what the compiled prefill programs depend on besides the request's shapes (:meth:`_compiled`)
        self._signature = (self.graph, tuple((a.shape, a.dtype, getattr(a, "sharding", None))
                                                for a in jax.tree.leaves(self.params)),
                           self.max_len, kv_cache, str(kda_state))
        self.parallel = model.run.parallel  # a sharded model gets a cache sharded the same way
        # where a chunked prefill keeps each row's last logits between chunks: replicated over the model's mesh
        self._last_sharding = (jax.sharding.SingleDeviceSharding(jax.local_devices()[0]) if self.parallel is None
                               else jax.sharding.NamedSharding(self.parallel.mesh, jax.sharding.PartitionSpec()))
        self.scan = model.run.scan_layers  # and laid out as its layers are (stacked when scanned)
        self.offload = model.run.offload

    def default_stop(self) -> list[int]:
        return default_stop_ids(self.tokenizer, self.cfg)

    def _layout(self, B: int) -> tuple[Cache, Cache | None]:
        """The cache of batch bucket ``B``: (shapes, shardings or None on one device without offload)."""
        shapes = cache_shapes(self.cfg, B, self.max_len, self.dtype, scan=self.scan, **self.cache_options)
        shardings = None
        if self.parallel is not None:
            shardings = sharding.cache_shardings(self.cfg, shapes, self.parallel.mesh, self.parallel.layout)
        if self.offload:  # RunConfig(offload=...): those entries are allocated in host memory, never on the device
            if shardings is None:
                one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
                shardings = jax.tree.map(lambda _: one, shapes)
            shardings = offload.cache_host_shardings(shardings, shapes, self.offload)
        return shapes, shardings

    def _cache(self, B: int) -> Cache:
        cache = self._caches.pop(B, None)  # popped: if a call fails after donating it, we reallocate
        if cache is not None:
            return cache
        _, shardings = self._layout(B)
        return init_cache(self.cfg, B, self.max_len, self.dtype, sharding=shardings, scan=self.scan,
                          **self.cache_options)

    def _device_bytes(self, B: int) -> tuple[int, list]:
        """(bytes per device of the cache of bucket ``B`` -- what lives in host memory takes none --, the devices)."""
        shapes, shardings = self._layout(B)
        leaves = jax.tree.leaves(shapes)
        if shardings is None:
            return sum(s.size * s.dtype.itemsize for s in leaves), [jax.local_devices()[0]]
        shards = jax.tree.leaves(shardings)
        need = sum(math.prod(sh.shard_shape(s.shape)) * s.dtype.itemsize for s, sh in zip(leaves, shards)
                   if sh.memory_kind != offload.HOST)
        return need, jax.local_devices()

    def _limit(self, B: int, cache_bytes: int, devices) -> tuple[int | None, str]:
        """(bytes per device a request of bucket ``B`` may use for its cache and prefill, how to name that limit):
        the memory free on the device that has the least (plus the cache of ``B`` when one is held already: it is
        reused, not allocated again), or ``memory_budget`` when that is smaller. (None, "") when neither is known."""
        free = [(f, d) for d in devices if (f := free_memory(d)) is not None]
        limit, name = None, ""
        if free:
            f, d = min(free, key=lambda fd: fd[0])
            # a margin for what XLA's count leaves out (the runtime's own buffers, fragmentation) and for the
            # other users of the memory
            limit = int(FREE_SHARE * f) + (cache_bytes if B in self._caches else 0)
            name = f"{d.platform}:{d.id} has {f / 1e9:.2f} GB free and a request takes at most {FREE_SHARE:.0%} of it"
        if self.memory_budget is not None and (limit is None or self.memory_budget < limit):
            limit, name = self.memory_budget, f"the memory budget is {self.memory_budget / 1e9:.2f} GB (memory_budget)"
        return limit, name

    def _cache_format(self) -> str:
        rows = self.cache_options["kv_cache"] or jnp.dtype(self.dtype).name
        state = jnp.dtype(self.cache_options["kda_state"] or jnp.float32).name
        out = f"{rows} rows" + (f", {state} KDA state" if "kda" in self.cfg.attn_types else "")
        return out + (f", {'/'.join(self.offload)} in host memory" if self.offload else "")

    def plan(self, prompts, max_new_tokens: int | Sequence[int] = 32, *, stop: Sequence[int] | None = None,
             record_logits: bool = False, speculative=None) -> PrefillPlan:
        """How :meth:`generate` would prefill these prompts and the memory it would take, checked against the limit
        (a :class:`GenerationError` names it when even the smallest chunk does not fit; a DSpark drafter's or a draft
        model's cache and weights counted, ``speculative`` as :meth:`generate` takes it). Compiles the prefill
        programs (they are kept for :meth:`generate`); allocates nothing (a ``"dspark:PATH"`` drafter is read from
        its ``config.json`` alone)."""
        ids = encode_prompts(prompts, self.tokenizer, self.cfg.vocab_size)
        budget, temp, topk, topp = _per_prompt_values(len(ids), max_new_tokens, 0.0, 0, 1.0)
        stop = self._check_request(ids, budget, stop, 0, 1)
        drafter = speculative_mod.parse(speculative, dtype=self.dtype, weights=False, parallel=self.parallel)
        self._check_drafter(drafter)
        B, T, _, _, samp = self._batch(ids, budget, temp, topk, topp, stop, 0)
        return self._plan(B, T, max(len(p) for p in ids), samp, record_logits, drafter)

    def _plan(self, B: int, T: int, longest: int, samp: Sampling, record_logits: bool, drafter=None) -> PrefillPlan:
        """Choose the prefill chunk for a batch bucket ``B`` of prompts padded to ``T`` (the longest has ``longest``
        tokens): one call when the prompt bucket fits in ``prefill_chunk`` and the budget, else the longest chunk
        whose compiled programs fit. Refuses, before allocating, a cache or a prefill that cannot fit, a DSpark
        ``drafter``'s or a draft model's cache and weights (:meth:`_drafter_bytes`) counted with the cache."""
        cache_bytes, devices = self._device_bytes(B)
        limit, name = self._limit(B, cache_bytes, devices)
        who, parts = self._drafter_bytes(drafter, B)
        extra = sum(parts.values())
        drafted, undrafted = "", ""  # what the errors say of the drafter
        if extra:
            shown = ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in parts.items())
            drafted, undrafted = f" and {who} {extra / 1e9:.2f} GB more ({shown})", f" or without {who}"
        if limit is not None and cache_bytes + extra > limit:
            raise GenerationError(
                f"the cache for {B} sequence(s) x {self.max_len} tokens needs {cache_bytes / 1e9:.2f} GB per device "
                f"({self._cache_format()}){drafted}, but {name}: lower max_len (the cache length; prompt + new "
                f"tokens must fit in it) or generate for fewer prompts at once{undrafted}")
        floor = min(MIN_CHUNK, self.prefill_chunk)
        chunk = min(T, self.prefill_chunk)
        while True:
            programs, working = self._compiled(B, T, chunk, samp, record_logits)
            if limit is None or cache_bytes + extra + working <= limit:
                return PrefillPlan(chunk, -(-longest // chunk), cache_bytes, working, limit, extra, programs)
            if chunk <= floor:
                raise GenerationError(
                    f"prefilling {B} sequence(s) of up to {longest} tokens needs "
                    f"{(cache_bytes + extra + working) / 1e9:.2f} GB per device even in chunks of {chunk} tokens (the "
                    f"cache of {self.max_len} tokens, {cache_bytes / 1e9:.2f} GB, plus {working / 1e9:.2f} GB of "
                    f"working memory{drafted}), but {name}: lower max_len (the cache length), shorten the prompts or "
                    f"generate for fewer at once{undrafted}")
            # a chunk's working memory grows about linearly with its length (its attention reads the whole cache):
            # aim at what the budget leaves, a power of two so that requests share the programs
            fit = chunk * max(limit - cache_bytes - extra, 0) / working
            chunk = max(floor, min(chunk // 2, 1 << max(int(fit), 1).bit_length() - 1))

    def _check_drafter(self, drafter) -> None:
        """Refuse a drafter this model cannot use (before anything is compiled or allocated)."""
        if drafter is None:
            return
        if isinstance(drafter, speculative_mod.DSpark):
            drafter.model.cfg.check_target(self.cfg)
        if isinstance(drafter, speculative_mod.DraftModel) and drafter.model.cfg.vocab_size != self.cfg.vocab_size:
            raise GenerationError(f"the draft model's vocabulary has {drafter.model.cfg.vocab_size} ids, the "
                                  f"model's {self.cfg.vocab_size}: a draft model must share the tokenizer")

    def _drafter_bytes(self, drafter, B: int) -> tuple[str, dict[str, int]]:
        """(what to call it, bytes per device by part) that a DSpark drafter or a draft model adds to a request of
        bucket ``B`` (an n-gram drafter or none: nothing): its cache, made for each request (a DSpark drafter's
        context cache split over the model's mesh as the deployment plan counts it,
        :func:`kimi_jax.parallel.sharding.draft_cache_bytes`; a draft model's split on its own mesh, else whole on
        every device), and the copy of its weights that :meth:`_drafter` makes (in the model's dtype; a DSpark
        drafter's split over the mesh): none once this generator holds it, none of a draft model read onto a mesh,
        and none of a weight already in that dtype and place."""
        split = False
        if isinstance(drafter, speculative_mod.DSpark):
            dcfg = drafter.model.cfg
            context = dspark.cache_bytes(dcfg, B, self.max_len, self.dtype)
            if self.parallel is not None:  # split over the mesh as the target's sequences and latent cache
                mesh, lay = self.parallel.mesh, self.parallel.layout
                context = sharding.draft_cache_bytes(dcfg, B, self.max_len, self.dtype, mesh, lay)
                split = True
            who, parts = "the DSpark drafter", {"context cache": context}
            dtype = None if drafter.model.run.dtype == self.dtype else jnp.dtype(self.dtype)  # DSpark.astype
        elif isinstance(drafter, speculative_mod.DraftModel):
            run = drafter.model.run
            shapes = cache_shapes(drafter.model.cfg, B, self.max_len, run.dtype, scan=run.scan_layers)
            cache = (sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(shapes)) if run.parallel is None else
                     sharding.cache_bytes(drafter.model.cfg, shapes, run.parallel.mesh, run.parallel.layout))
            who, parts = "the draft model", {"cache": cache}
            dtype = None
        else:
            return "", {}
        weights = 0
        if drafter not in self._drafters and split:  # split on the mesh: every shard a new copy
            weights = sharding.param_bytes(drafter.model, self.parallel.mesh, self.parallel.layout, dtype)
        elif drafter not in self._drafters and not _on_mesh(drafter):  # (one on a mesh stays where it was read)
            for a in jax.tree.leaves(nnx.state(drafter.model)):
                placed = isinstance(a, jax.Array) and a.sharding.is_equivalent_to(self._last_sharding, a.ndim)
                if dtype not in (None, a.dtype) or not placed:
                    weights += a.size * jnp.dtype(dtype or a.dtype).itemsize
        return who, {**parts, "weights": weights}

    def _place(self, x):
        """``x`` where the programs take what is not sharded: replicated over the model's mesh; on one device the
        default one, uncommitted as the single-call prefill's outputs are (a committed input would give the
        programs after it, the decode loops, another compiled variant: seconds when a request first falls back from
        a drafter's loop to the plain one)."""
        return jax.device_put(x) if self.parallel is None else jax.device_put(x, self._last_sharding)

    def _parse(self, speculative):
        """``speculative`` as :func:`~kimi_jax.generation.speculative.parse` reads it, except that a drafter named by
        its directory (``"dspark:PATH"``, ``"draft:PATH"``) is read once and kept while this generator lives (the
        last :data:`NAMED_KEPT` named): each call would otherwise read its weights, place them and measure its cost
        afresh (:meth:`_drafter` keeps all three per drafter object)."""
        if not isinstance(speculative, str) or speculative.partition(":")[0] == "ngram":
            return speculative_mod.parse(speculative, dtype=self.dtype, parallel=self.parallel)
        got = self._named.pop(speculative, None)
        if got is None:
            got = speculative_mod.parse(speculative, dtype=self.dtype, parallel=self.parallel)
        self._named[speculative] = got  # the most recent last
        while len(self._named) > NAMED_KEPT:
            del self._named[next(iter(self._named))]
        return got

    def _drafter(self, drafter) -> _Drafter | None:
        """``drafter`` as the compiled loops take it: a DSpark drafter (in the model's dtype) or a draft model split
        and its weights placed once, kept for the next request while ``drafter`` lives."""
        if not isinstance(drafter, (speculative_mod.DSpark, speculative_mod.DraftModel)):
            return None if drafter is None else self._ngrams.setdefault(drafter, _Drafter(drafter))
        got = self._drafters.get(drafter)
        if got is None:  # (the value must not hold ``drafter`` itself: the key would never be dropped)
            split = self.parallel is not None and isinstance(drafter, speculative_mod.DSpark)
            use = (drafter.astype(self.dtype, self.parallel) if isinstance(drafter, speculative_mod.DSpark)
                   else drafter)
            kind, graph, weights = speculative_mod.static(use)
            if split:  # a DSpark drafter on the model's mesh: its weights split by their logical axes
                mesh = self.parallel.mesh
                weights = sharding.put_params(weights, sharding.param_specs(use.model, mesh, self.parallel.layout),
                                              mesh)
            got = _Drafter(kind, Graph(graph), weights if split or _on_mesh(use) else self._place(weights), use.model)
            self._drafters[drafter] = got
        return got

    def _compiled(self, B: int, T: int, chunk: int, samp: Sampling, record_logits: bool) -> tuple[tuple, int]:
        """The compiled prefill programs of a bucket (one call when ``chunk == T``, else the restart of the cache, a
        chunk and the first token) and the largest one's working memory per device: temporaries plus the outputs
        not aliased to a donated input (XLA's count). Compiled ahead of time, from shapes: nothing is allocated."""
        shapes, shardings = self._layout(B)
        if shardings is not None:
            shapes = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        samp_shape = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), samp)
        sampled = dict(out_len=self.max_len, record_logits=record_logits)
        base = (self._signature, None if shardings is None else tuple(jax.tree.leaves(shardings)), B)
        if chunk == T:
            programs = [_compile(("prefill", *base, T, samp.stop.shape[0], record_logits), lambda: prefill.lower(
                self.graphdef, self.params, shapes, i32(B, T), i32(B), samp_shape, **sampled))]
        else:
            last = jax.ShapeDtypeStruct((B, self.cfg.vocab_size), F32, sharding=self._last_sharding)
            # Every chunk hands the next its cache and ``last`` where it took them (the layout's shardings, host
            # memory under offload): a program compiled ahead of time takes its inputs only as it was compiled for.
            placed = {} if shardings is None else {"out_shardings": shardings}
            chunked = prefill_chunk if shardings is None else jax.jit(
                _prefill_chunk, out_shardings=(shardings, self._last_sharding), **CHUNK_JIT)
            programs = [
                _compile(("restart", *base), lambda: jax.jit(restart, donate_argnums=0, **placed).lower(shapes)),
                _compile(("chunk", *base, chunk), lambda: chunked.lower(
                    self.graphdef, self.params, shapes, i32(B, chunk), i32(B), last)),
                _compile(("first", *base, samp.stop.shape[0], record_logits), lambda: first_token.lower(
                    last, samp_shape, **sampled))]
        return tuple(p for p, _ in programs), max(w for _, w in programs)

    def _prefill(self, plan: PrefillPlan, cache: Cache, tokens, lengths, samp: Sampling) -> DecodeState:
        """Run ``plan``'s prefill of ``tokens [B, T]`` (``lengths [B]`` valid tokens each) over ``cache``."""
        if len(plan.programs) == 1:
            return plan.programs[0](self.params, cache, tokens, lengths, samp)
        clear, chunk, start = plan.programs
        C, B = plan.chunk, tokens.shape[0]
        tokens = np.pad(tokens, [(0, 0), (0, max(0, plan.calls * C - tokens.shape[1]))])
        cache, last = clear(cache), self._place(np.zeros((B, self.cfg.vocab_size), np.float32))
        for i in range(plan.calls):
            n = np.clip(lengths - i * C, 0, C).astype(np.int32)
            cache, last = chunk(self.params, cache, tokens[:, i * C:(i + 1) * C], n, last)
        return start(last, samp).replace(cache=cache)

    def _prefill_drafted(self, plan: PrefillPlan, cache: Cache, tokens, lengths, samp: Sampling,
                         drafter: _Drafter, record_logits: bool = False) -> tuple[DecodeState, object]:
        """:meth:`_prefill` for a DSpark ``drafter`` or a draft model (:meth:`_drafter`): the prompts' chunks (one
        when the plan has one call) also bring the drafter's cache along. Returns (decode state, its cache)."""
        B = tokens.shape[0]
        C = plan.chunk if len(plan.programs) > 1 else tokens.shape[1]
        calls = -(-tokens.shape[1] // C)
        tokens = np.pad(tokens, [(0, 0), (0, calls * C - tokens.shape[1])])
        place = self._place
        dmodel = drafter.model
        if isinstance(drafter.kind, speculative_mod.BlockDraft) and self.parallel is not None:
            dcache = dmodel.empty_cache(B, self.max_len, sharding=sharding.draft_cache_shardings(
                dmodel.cfg, B, self.max_len, self.parallel.mesh, self.parallel.layout))
        elif isinstance(drafter.kind, speculative_mod.BlockDraft):
            dcache = place(dmodel.empty_cache(B, self.max_len))
        elif dmodel.run.parallel is not None:  # a draft model on a mesh: its cache split as a model's is
            shapes = cache_shapes(dmodel.cfg, B, self.max_len, dmodel.run.dtype, scan=dmodel.run.scan_layers)
            dcache = init_cache(dmodel.cfg, B, self.max_len, dmodel.run.dtype, scan=dmodel.run.scan_layers,
                                sharding=sharding.cache_shardings(dmodel.cfg, shapes, dmodel.run.parallel.mesh,
                                                                  dmodel.run.parallel.layout))
        else:
            dcache = place(init_cache(dmodel.cfg, B, self.max_len, dmodel.run.dtype, scan=dmodel.run.scan_layers))
        cache, last = restart(cache), place(np.zeros((B, self.cfg.vocab_size), np.float32))
        for i in range(calls):
            n = np.clip(lengths - i * C, 0, C).astype(np.int32)
            cache, last, dcache = prefill_chunk_drafted(self.graph, self.params, cache,
                                                        tokens[:, i * C:(i + 1) * C], n, last, drafter.kind,
                                                        drafter.graph, drafter.params, dcache)
        return first_token(last, samp, out_len=self.max_len, record_logits=record_logits).replace(cache=cache), dcache

    def generate(self, prompts, max_new_tokens: int | Sequence[int] = 32, *, temperature=0.0, top_k=0, top_p=1.0,
                 stop: Sequence[int] | None = None, seed: int = 0,
                 stream: Callable[[list[list[int]], list[str] | None], None] | None = None, stream_every: int = 8,
                 record_logits: bool = False, speculative=None) -> Generation:
        """Generate for one prompt or a batch of prompts of different lengths.

        ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``: one value or one per prompt. ``stop``: ids
        that end a sequence (default :meth:`default_stop`; ``()`` for none). ``stream(new_tokens, new_text)``
        is called every ``stream_every`` decode steps with each sequence's new tokens (and text).
        ``speculative``: a drafter (``"ngram[:k=4,max_n=3,min_n=1]"`` or :class:`~kimi_jax.generation.speculative.
        NGram`): drafted tokens checked by one forward per step (:mod:`kimi_jax.generation.speculative`); greedy
        output is plain greedy output token for token, sampled output has the plain sampler's distribution
        (rejection sampling). With the drafter's ``adapt="cost"`` (the default) drafts are verified only where they
        repay a verify step's cost as measured here (:meth:`_paced`, :meth:`_drafting`). ``timings["speculative"]``
        has the acceptance, the measured cost and whether the request drafted.
        """
        ids = encode_prompts(prompts, self.tokenizer, self.cfg.vocab_size)
        budget, temp, topk, topp = _per_prompt_values(len(ids), max_new_tokens, temperature, top_k, top_p)
        stop = self._check_request(ids, budget, stop, seed, stream_every)
        user = self._parse(speculative)
        self._check_drafter(user)
        B, T, tokens, lengths, samp = self._batch(ids, budget, temp, topk, topp, stop, seed)
        # refuses what cannot fit, a drafter's cache and weights counted
        plan = self._plan(B, T, max(len(p) for p in ids), samp, record_logits, user)
        drafter = self._drafter(user)
        cost = None if drafter is None else self._cost(drafter, B, user.adapt)
        if drafter is not None and not self._drafting(drafter, B, cost):  # known not to pay: the plain request
            drafter, spec = None, drafter.learn(B, _spec_timings(None, 0, cost, False))

        t0 = time.perf_counter()
        dcache = None
        if drafter is not None and drafter.model is not None:
            st, dcache = self._prefill_drafted(plan, self._cache(B), tokens, lengths, samp, drafter, record_logits)
        else:
            st = self._prefill(plan, self._cache(B), tokens, lengths, samp)
        st.count.block_until_ready()
        t1 = time.perf_counter()
        if drafter is not None:
            spec = speculative_mod.start(st, tokens, lengths, st.out.shape[1], dcache)
            spec, cost = self._paced(spec, samp, drafter, B, user.adapt)
            drafting = self._drafting(drafter, B, cost, spec, len(ids))
            if drafting:  # else the plain loop from here
                spec = (self._decode_spec(spec, samp, int(budget.max()), drafter) if stream is None else
                        self._decode_streaming(spec, samp, len(ids), stop, stream, stream_every, drafter))
            st = spec.dec
            spec = drafter.learn(B, _spec_timings(spec, len(ids), cost, drafting))  # (before the plain loop takes st)
        if not bool(np.all(_host(st.done))):
            st = (decode(self.graph, self.params, st, samp, np.int32(budget.max())) if stream is None else
                  self._decode_streaming(st, samp, len(ids), stop, stream, stream_every))
        st.count.block_until_ready()
        t2 = time.perf_counter()
        out = self._result(st, ids, stop, record_logits, B, T, t1 - t0, t2 - t1)
        out.timings.update(prefill_chunk=plan.chunk, prefill_calls=plan.calls)
        if user is not None:
            out.timings["speculative"] = spec
        # a plain request's step time (one a drafter's request known not to pay became too), for _paced
        if drafter is None and stream is None and out.timings["decode_steps"] >= MEASURE:
            step = out.timings["decode"] / out.timings["decode_steps"]
            if step > 0:
                self._plain_steps[B] = min(self._plain_steps.get(B, math.inf), step)
        return out

    def _paced(self, spec, samp: Sampling, drafter: _Drafter, B: int, adapt: str):
        """(``spec`` with its pacing set, a verify step's cost in plain steps or None: not measured). With
        ``adapt="cost"`` the first ``MEASURES`` speculative requests of a batch bucket time a verify step and the
        loop's plain step on their own first steps (:meth:`_measure`), and so does one that drafts again after
        ``EXPLORE`` requests that did not (or more: :meth:`_Drafter.learn`); the others reuse the medians of those
        measures. The loop weighs drafts against its own plain step (:func:`~kimi_jax.generation.speculative.
        worth_verifying`; a DSpark drafter's or a draft model's includes keeping the drafter's cache); the cost
        returned, which decides whether to draft at all, is against the cheaper of that and the plain loop's step
        where a plain request of the bucket was timed."""
        timed = drafter.timed.get(B)
        if adapt == "cost" and (timed is None or len(timed.ratio) < MEASURES or drafter.exploring(B)):
            spec = self._measure(spec, samp, drafter, B)
        times = drafter.costs.get(B) if adapt == "cost" else None
        spec = spec.replace(cost=jnp.float32(speculative_mod.pacing(times and times[1] / times[0], adapt)))
        return spec, self._cost(drafter, B, adapt)

    def _cost(self, drafter: _Drafter, B: int, adapt: str) -> float | None:
        """A verify step's measured cost in plain steps for bucket ``B`` against the cheaper of the speculative loop's
        plain step and the plain loop's (None: not measured, or ``adapt="acceptance"``)."""
        times = drafter.costs.get(B) if adapt == "cost" else None
        return None if times is None else times[1] / min(times[0], self._plain_steps.get(B, math.inf))

    def _drafting(self, drafter: _Drafter, B: int, cost: float | None, spec=None, n: int = 0) -> bool:
        """Whether a request drafts, where a verify step costs ``cost`` plain steps (None: not measured, yes). A
        verify step in which a sequence's drafts gain ``g`` accepted tokens gives it ``1 + g``, so drafting pays while
        ``cost <= 1 + g``: ``g`` of the bucket's last request that drafted or measured, else of ``spec``'s measuring
        steps (``n`` sequences; 0 where they drafted nothing; neither: k, all accepted). A bucket that has not drafted
        for ``EXPLORE`` requests drafts again (the gain changes with the prompts), and after each such try whose
        drafts did not pay it waits twice as many, up to ``EXPLORE_MAX`` (a try measures anew: ~20 forced steps, 20 ms
        of a 35 ms request of the demo's in bfloat16, where a verify step costs more than k + 1 plain steps)."""
        if cost is None:
            return True
        gain = drafter.gains.get(B)
        if gain is None and spec is None:
            gain = drafter.kind.k
        elif gain is None:
            gain = _gain(*(int(_host(a)[:n].sum()) for a in (spec.accepted, spec.verified)))
        return cost <= 1 + gain or drafter.exploring(B)

    def _measure(self, spec, samp: Sampling, drafter: _Drafter, B: int):
        """``spec`` after the steps that time bucket ``B``'s plain and verify steps (a measure: the drafter's sample,
        :meth:`_Drafter.sample`). Where the loop's shapes are new, a plain step that compiles it and a verify step
        that warms its other branch come first; then calls of 1 and ``1 + MEASURE`` plain steps (unless the last
        request timed them and ended before its verify steps), then of 1 and ``1 + MEASURE`` verify steps (drafts
        where the drafter has them): a step's time is the difference of the two calls over the steps the second one
        adds (a call's own cost, a few plain steps' worth on a small model, cancels). A call runs its steps while
        some sequence has not ended (a sequence that has ended still takes part in the batch's forward); the second
        call times at least ``MEASURE // 2`` added steps, or the request ended before the measure did (a verify step
        whose drafts are accepted ends a short request fast: a batch of 8 asking for 32 tokens never finished one
        before and drafted unmeasured, at 0.36-0.42x of plain). A request that ends first keeps its plain step for the
        next, so short requests complete a measure between them rather than each paying for one. The tokens they make
        are the request's (greedy: the plain ones)."""
        real = np.asarray(samp.budget) > 0  # (a batch bucket's padding rows are done from the start)
        never, always = speculative_mod.NEVER, speculative_mod.ALWAYS

        def call(spec, mode, n: int):
            """(``spec`` after up to ``n`` steps paced by ``mode``, their seconds, how many ran)."""
            before = int(_host(spec.steps).max())
            t = time.perf_counter()
            spec = self._decode_spec(spec.replace(cost=jnp.float32(mode)), samp, n, drafter)
            ran = int(_host(spec.steps).max()) - before  # (the loop runs while a sequence has not ended)
            return spec, time.perf_counter() - t, ran

        def ended(spec) -> bool:
            return bool(np.all(_host(spec.dec.done)[real]))

        shapes = tuple(a.shape for a in jax.tree.leaves((spec.hist, spec.dec.out, spec.dec.logits, samp.stop)))
        if shapes not in drafter.warm:  # compile the loop, warm its verify branch
            for mode in (never, always):
                spec, _, _ = call(spec, mode, 1)
                if ended(spec):
                    return spec
            drafter.warm.add(shapes)
        timed = drafter.timed.get(B)
        plain = None if timed is None else timed.pending
        for mode in ([never] if plain is None else []) + [always]:
            spec, one, _ = call(spec, mode, 1)
            spec, more, ran = (spec, 0.0, 0) if ended(spec) else call(spec, mode, 1 + MEASURE)
            if ran - 1 < MEASURE // 2:  # the request ended: a plain step timed waits for the next one's verify steps
                if plain is not None:
                    drafter.sample(B, plain, None)
                return spec
            step = (more - one) / (ran - 1)
            if step <= 0:  # the clock did not resolve it
                return spec
            if mode == never:
                plain = step
            else:
                drafter.sample(B, plain, step)
        return spec

    def _check_request(self, ids: list[list[int]], budget, stop: Sequence[int] | None, seed: int,
                       stream_every: int) -> list[int]:
        """Checks what :func:`_per_prompt_values` does not (before anything is compiled or a cache donated).

        ``budget`` [n] int64. Returns the stop ids (the default ones when ``stop`` is None).
        """
        if stream_every < 1:
            raise GenerationError(f"stream_every must be >= 1, got {stream_every}")
        context = self.cfg.max_position_embeddings
        for i, p in enumerate(ids):
            if context is not None and len(p) + budget[i] > context:
                raise GenerationError(f"prompt {i} ({len(p)} tokens) + max_new_tokens ({budget[i]}) = "
                                      f"{len(p) + budget[i]} tokens exceeds the model's context of {context} "
                                      "(max_position_embeddings in its config.json): shorten the prompt or ask "
                                      "for fewer new tokens")
            if len(p) >= self.max_len:
                raise GenerationError(f"prompt {i} has {len(p)} tokens; the cache holds {self.max_len} "
                                      "(raise max_len)")
            if len(p) + budget[i] > self.max_len:
                raise GenerationError(f"prompt {i} ({len(p)} tokens) + max_new_tokens ({budget[i]}) exceeds the "
                                      f"cache length {self.max_len} (raise max_len)")
        stop = self.default_stop() if stop is None else [int(s) for s in stop]
        bad = [s for s in stop if not 0 <= s < self.cfg.vocab_size]
        if bad:
            raise GenerationError(f"stop ids {bad} outside the vocabulary 0..{self.cfg.vocab_size - 1}")
        check_sampling(1, 0.0, 0, 1.0, seed)
        return stop

    def _batch(self, ids: list[list[int]], budget, temp, topk, topp, stop: list[int],
               seed: int) -> tuple[int, int, np.ndarray, np.ndarray, Sampling]:
        """The request padded to the compiled shapes: (B, T, tokens ``[B, T]`` int32 right-padded, lengths ``[B]``
        int32 (0 for unused slots), :class:`Sampling` with ``[B]`` values and the stop ids padded with -1)."""
        n = len(ids)
        B = _bucket(n, self.batch_buckets, "batch size")
        T = _bucket(max(len(p) for p in ids), self.prompt_buckets, "prompt length")
        tokens = np.zeros((B, T), np.int32)
        lengths = np.zeros((B,), np.int32)
        for i, p in enumerate(ids):
            tokens[i, : len(p)] = p
            lengths[i] = len(p)
        pad = lambda a, fill, dt: np.concatenate([a.astype(dt), np.full((B - n,), fill, dt)])
        stop_arr = np.full((-(-max(len(stop), 1) // STOP_SLOTS) * STOP_SLOTS,), -1, np.int32)
        stop_arr[: len(stop)] = stop
        samp = Sampling(pad(temp, 0, np.float32), pad(topk, 0, np.int32), pad(topp, 1, np.float32),
                        pad(budget, 0, np.int32), stop_arr, np.uint32(seed))
        return B, T, tokens, lengths, samp

    def _decode_streaming(self, st, samp: Sampling, n: int, stop: list[int], stream, stream_every: int,
                          drafter: _Drafter | None = None):
        """Decode ``stream_every`` steps per compiled call until every sequence is done, handing each call's new
        tokens (and text, stop ids left out) of the ``n`` real sequences to ``stream``. With a ``drafter``, ``st`` is
        a :class:`~kimi_jax.generation.speculative.SpecState` and each step a verify step."""
        decoders = [self.tokenizer.stream_decoder() for _ in range(n)] if self.tokenizer else None
        sent = np.zeros((n,), np.int64)

        def emit(st, final=False):
            count, out = _host(st.count)[:n], _host(st.out)[:n]
            new = [out[i, sent[i] : count[i]].tolist() for i in range(n)]
            sent[:] = count
            text = None
            if decoders is not None:
                text = [decoders[i].push([t for t in new[i] if t not in stop]) + (decoders[i].flush() if final else "")
                        for i in range(n)]
            if any(new) or (final and text and any(text)):
                stream(new, text)

        dec = (lambda s: s.dec) if drafter is not None else (lambda s: s)
        emit(dec(st))
        while not bool(np.all(_host(dec(st).done))):
            if drafter is not None:
                st = self._decode_spec(st, samp, stream_every, drafter)
            else:
                st = decode(self.graph, self.params, st, samp, np.int32(stream_every))
            emit(dec(st), final=bool(np.all(_host(dec(st).done))))
        return st

    def _decode_spec(self, st, samp: Sampling, steps: int, drafter: _Drafter):
        """Up to ``steps`` verify steps of the speculative loop (:func:`kimi_jax.generation.speculative.decode`)."""
        return speculative_mod.decode(self.graph, self.params, st, samp, np.int32(steps), drafter=drafter.kind,
                                      dgraph=drafter.graph, dparams=drafter.params)

    def _result(self, st: DecodeState, ids: list[list[int]], stop: list[int], record_logits: bool, B: int, T: int,
                prefill_s: float, decode_s: float) -> Generation:
        """The finished decode state as a :class:`Generation`; keeps its cache for the next request of bucket B."""
        n = len(ids)
        count, out, done = _host(st.count), _host(st.out), _host(st.done)
        logits = _host(st.logits) if record_logits else None
        self._caches[B] = st.cache
        new = [out[i, : count[i]].tolist() for i in range(n)]
        reasons = ["stop" if (toks and toks[-1] in stop) else "length" for toks in new]
        if not bool(np.all(done[:n])):  # cannot happen: the loop runs max(budget) steps
            raise RuntimeError("decode loop ended before every sequence finished")
        text = None
        if self.tokenizer is not None:
            text = [self.tokenizer.decode(t[:-1] if r == "stop" else t) for t, r in zip(new, reasons)]
        return Generation(
            tokens=new, text=text, prompt_tokens=ids, finish_reason=reasons,
            logits=None if logits is None else [logits[i, : count[i]] for i in range(n)],
            timings={"prefill": prefill_s, "decode": decode_s, "new_tokens": int(count[:n].sum()),
                     "decode_steps": int(count[:n].max()) - 1, "batch_bucket": B, "prompt_bucket": T},
        )


# Compiled prefill programs shared by the generators of one model (as jit's cache would share them): compiled ahead
# of time because their memory is checked before the cache is allocated.
_PROGRAMS: dict = {}


def _gain(accepted: int, verified: int) -> float:
    """Drafts accepted per sequence and verify step with drafts; 0 where no verify step had drafts (the drafter
    found nothing to propose: random text, nothing repeated)."""
    return accepted / verified if verified else 0.0


def _spec_timings(spec, n: int, cost: float | None, drafting: bool) -> dict:
    """``timings["speculative"]`` of a request's ``n`` sequences from the speculative loop's final state (None: the
    request decoded plainly, the drafter known not to pay)."""
    if spec is None:
        return {"verify_steps": 0, "drafted": 0, "accepted": 0, "verified": 0, "tokens_per_step": 0.0,
                "verify_cost": cost, "drafting": False}
    steps, drafted, accepted, verified = (_host(a)[:n] for a in (spec.steps, spec.drafted, spec.accepted,
                                                                 spec.verified))
    return {"verify_steps": int(steps.max()), "drafted": int(drafted.sum()), "accepted": int(accepted.sum()),
            "verified": int(verified.sum()),  # (sequence, verify step) pairs with drafts
            # new tokens per loop step (1: no draft ever accepted), over the part the speculative loop decoded
            "tokens_per_step": float((_host(spec.dec.count)[:n] - 1).sum() / max(1, steps.sum())),
            # a verify step's cost in plain steps as measured on this device (None: not measured); drafting: whether
            # the request drafted past the measurement (Generator._drafting: where the drafts repay that cost)
            "verify_cost": cost, "drafting": drafting}


def _compile(key, lower: Callable) -> tuple:
    """(the compiled program, its working memory in bytes per device) of ``lower()``, compiled once per ``key``."""
    if key not in _PROGRAMS:
        compiled = lower().compile()
        _PROGRAMS[key] = compiled, _working_bytes(compiled)
    return _PROGRAMS[key]


def _working_bytes(compiled) -> int:
    """Device bytes a compiled call allocates while it runs: temporaries and outputs not aliased to a donated input."""
    m = compiled.memory_analysis()
    if m is None:  # a backend that does not say: nothing to check against
        return 0
    return int(m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)


_GENERATORS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_TOKENIZERS: dict[str, Tokenizer] = {}


def _host(x) -> np.ndarray:
    """A result on the host; arrays spread over several processes are gathered on every process."""
    return np.asarray(x) if getattr(x, "is_fully_addressable", True) else distributed.process_allgather(x)


def _auto_max_len(longest_prompt: int, max_new: int) -> int:
    """Power of two >= 256: varying requests reuse a few cache sizes instead of compiling one each."""
    need = longest_prompt + max_new
    size = 256
    while size < need:
        size *= 2
    return size


def tokenizer_of(tokenizer: Tokenizer | str | None) -> Tokenizer | None:
    """A tokenizer object as given, or the one in a model directory (``"demo"``: the shipped demo model's), loaded
    once per path."""
    if isinstance(tokenizer, str):
        if tokenizer not in _TOKENIZERS:
            _TOKENIZERS[tokenizer] = load_tokenizer(model_dir(tokenizer))
        tokenizer = _TOKENIZERS[tokenizer]
    return tokenizer


def generate(model, prompts, max_new_tokens: int | Sequence[int] = 32, *, temperature=0.0, top_k=0, top_p=1.0,
             stop: Sequence[int] | None = None, seed: int = 0, tokenizer: Tokenizer | str | None = None,
             stream=None, stream_every: int = 8, max_len: int | None = None, record_logits: bool = False,
             kv_cache: str | None = None, kda_state=None, prefill_chunk: int = PREFILL_CHUNK,
             memory_budget: int | None = None, speculative=None) -> Generation:
    """Generate from a :class:`~kimi_jax.model.KimiModel`: see :meth:`Generator.generate`.

    ``prompts``: a string, a list of token ids, or a list of either (different lengths are fine). ``tokenizer``:
    a :class:`~kimi_jax.text.tokenizer.Tokenizer` or a model directory holding tokenizer files, or ``"demo"`` (needed
    for text).
    ``max_len``: cache length; by default the smallest power of two >= 256 that fits. ``kv_cache`` /
    ``kda_state``: the cache's storage options; ``prefill_chunk`` / ``memory_budget``: the longest prefill call and
    the bytes per device a request may use (:class:`Generator`). The generator (and its compiled functions and
    caches) is kept per model, so repeated calls do not recompile.
    """
    tokenizer = tokenizer_of(tokenizer)
    if max_len is None:
        longest = max(len(p) for p in encode_prompts(prompts, tokenizer, model.cfg.vocab_size))
        max_len = _auto_max_len(longest, int(np.max(max_new_tokens)))
    per_model = _GENERATORS.setdefault(model, {})
    key = (id(tokenizer), int(max_len), kv_cache, str(kda_state), int(prefill_chunk), memory_budget)
    gen = per_model.get(key)
    if gen is None or gen.tokenizer is not tokenizer:
        gen = per_model[key] = Generator(model, tokenizer, max_len=max_len, kv_cache=kv_cache, kda_state=kda_state,
                                         prefill_chunk=prefill_chunk, memory_budget=memory_budget)
    return gen.generate(prompts, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, stop=stop,
                        seed=seed, stream=stream, stream_every=stream_every, record_logits=record_logits,
                        speculative=speculative)
