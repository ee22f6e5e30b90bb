"""What the serving engine refuses, before anything is queued or allocated: engine options and requests, each
refusal naming the field, the value and what would be valid."""

from __future__ import annotations

import dataclasses

import numpy as np

from kimi_jax.generation.generate import check_sampling, default_stop_ids
from kimi_jax.serving.events import Request
from kimi_jax.serving.stepplan import Shapes
from kimi_jax.text.grammar import Grammar, words


class EngineError(ValueError):
    """A request the engine refuses (named field, offending value, what would be valid), or an engine that stopped."""


class EngineStopped(EngineError):
    """The engine takes no more requests (shutting down, or it lost a process): a 503, not the request's fault."""


def shapes(*, slots: int, max_len: int, page_size: int, pages: int | None, prefill_chunk: int, min_chunk: int,
           snapshot_every: int | None, compact_decode: bool, batch_invariant: bool = False,
           spec_k: int = 0, structured: bool = False) -> Shapes:
    """The engine's static shapes from its options (default pool: every slot at ``max_len``, plus half again for the
    prefix cache)."""
    for name, v in (("slots", slots), ("max_len", max_len), ("page_size", page_size),
                    ("prefill_chunk", prefill_chunk), ("min_chunk", min_chunk)):
        if int(v) < 1:
            raise EngineError(f"{name} must be >= 1, got {v}")
    if pages is not None and int(pages) < 1:
        raise EngineError(f"pages must be >= 1, got {pages}")
    snapshot_every = int(snapshot_every or prefill_chunk)
    if snapshot_every % prefill_chunk:
        raise EngineError(f"snapshot_every ({snapshot_every}) must be a multiple of prefill_chunk ({prefill_chunk})")
    if prefill_chunk % page_size:
        raise EngineError(f"prefill_chunk ({prefill_chunk}) must be a multiple of page_size ({page_size}), so that "
                          "prefix snapshots fall on page boundaries")
    pages_per_seq = -(-int(max_len) // int(page_size))
    return Shapes(slots=int(slots), max_len=int(max_len), page_size=int(page_size),
                  n_pages=int(pages) if pages else int(slots) * pages_per_seq * 3 // 2, chunk=int(prefill_chunk),
                  min_chunk=int(min_chunk), snapshot_every=snapshot_every, compact_decode=bool(compact_decode),
                  batch_invariant=bool(batch_invariant), spec_k=int(spec_k), structured=bool(structured))


def max_model_len(cfg, max_len: int) -> int:
    """The most tokens (prompt + max_tokens) one request may have: the engine's cache length, or the model's context
    (``max_position_embeddings``) where that is shorter. One number, so every refusal and ``/v1/models`` name the
    same limit whichever of the two sets it."""
    context = cfg.max_position_embeddings
    return int(max_len) if context is None else min(int(max_len), int(context))


def check_request(request: Request, cfg, shapes: Shapes, tokenizer) -> Request:
    """``request`` validated and normalised (stop ids resolved, seed drawn); raises :class:`EngineError`."""
    V = cfg.vocab_size
    try:
        prompt = [int(t) for t in request.prompt]
    except (TypeError, ValueError):
        raise EngineError("prompt: must be a list of token ids") from None
    if not prompt:
        raise EngineError("prompt is empty (0 tokens)")
    bad = [t for t in prompt if not 0 <= t < V]
    if bad:
        raise EngineError(f"prompt: token ids {bad[:5]} outside the vocabulary 0..{V - 1}")
    if int(request.max_tokens) < 1:
        raise EngineError(f"max_tokens must be >= 1, got {request.max_tokens}")
    total = len(prompt) + int(request.max_tokens)
    limit = max_model_len(cfg, shapes.max_len)
    if total > limit:
        raise EngineError(f"prompt ({len(prompt)} tokens) + max_tokens ({request.max_tokens}) = {total} exceeds the "
                          f"maximum context length of {limit} tokens (max_model_len): shorten the prompt or lower "
                          "max_tokens")
    if -(-total // shapes.page_size) > shapes.n_pages:
        raise EngineError(f"prompt + max_tokens = {total} tokens needs more pages than the pool holds "
                          f"({shapes.n_pages} of {shapes.page_size} tokens)")
    seed = request.seed
    if seed is None:  # drawn here, on the scheduling process: the plans carry it to every other
        seed = int(np.random.default_rng().integers(0, 2**32))
    try:
        check_sampling(1, request.temperature, request.top_k, request.top_p, seed)
    except (TypeError, ValueError) as e:  # GenerationError is a ValueError
        raise EngineError(str(e)) from None
    stop = default_stop_ids(tokenizer, cfg) if request.stop_ids is None else [int(s) for s in request.stop_ids]
    bad = [s for s in stop if not 0 <= s < V]
    if bad:
        raise EngineError(f"stop ids {bad} outside the vocabulary 0..{V - 1}")
    _check_constraint(request, cfg, shapes)
    strings = tuple(str(s) for s in request.stop_strings if s)
    if strings and tokenizer is None:
        raise EngineError("stop strings need a tokenizer; this model has none (use stop ids)")
    return dataclasses.replace(request, prompt=prompt, max_tokens=int(request.max_tokens), seed=int(seed),
                               stop_ids=tuple(stop), stop_strings=strings, top_k=int(request.top_k),
                               # as float32 holds them: what every process's executor samples with
                               temperature=float(np.float32(request.temperature)),
                               top_p=float(np.float32(request.top_p)))


def _check_constraint(request: Request, cfg, shapes: Shapes) -> None:
    c = request.constraint
    if c is None:
        return
    if not shapes.structured:
        raise EngineError("this engine runs without structured outputs: start it with structured=True (kimi-jax "
                          "serve: on by default) to constrain a request")
    if not isinstance(c, Grammar):
        raise EngineError(f"constraint: expected a compiled grammar (kimi_jax.text.grammar.compile_grammar), got "
                          f"{type(c).__name__}")
    if c.vocab_words != words(cfg.vocab_size):
        raise EngineError(f"constraint: compiled for a vocabulary of {c.vocab_words * 32} ids, the model has "
                          f"{cfg.vocab_size}")
