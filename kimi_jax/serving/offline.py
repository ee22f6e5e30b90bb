"""Constrained generation from Python (``kimi_jax.generate(..., constraint=...)``): the prompts run through a serving
:class:`~kimi_jax.serving.engine.Engine` with structured outputs on, stepped on the calling thread (no server, no
engine thread), because a constraint needs the host between every two tokens (:mod:`kimi_jax.text.grammar`) while
:func:`kimi_jax.generation.generate.generate`'s decode loop runs whole on the device.

A prompt that ends with the K3 chat format's generation prompt (``<|open|>response<|sep|>``, or ``think`` with
thinking on: what :func:`kimi_jax.text.chat.encode` writes) is a chat reply: the constraint applies to its answer,
the thinking stays free. Any other prompt is a completion: constrained from its first token, ended by a stop id.
Sampling is the engine's (each prompt's seed is ``seed + i``); engines are kept per model and shape, compiled on first
use.
"""

from __future__ import annotations

import time
from typing import Sequence

from kimi_jax.generation.generate import Generation, GenerationError, encode_prompts, tokenizer_of
from kimi_jax.serving.engine import Engine, EngineError, Request
from kimi_jax.text import chat
from kimi_jax.text.grammar import Constraint, ConstraintError, Grammar, ToolCall, compile_grammar

_ENGINES: dict = {}
SHORTHANDS = ("json", "json_object", "regex", "choice", "grammar")


def as_constraint(c) -> Constraint | ToolCall | Grammar:
    """``c`` as given (a :class:`Constraint`, :class:`ToolCall` or compiled :class:`Grammar`), or from a one-key dict
    (``{"json": schema}``, ``{"regex": r}``, ``{"choice": [...]}``, ``{"grammar": lark}``, ``{"json_object": True}``)."""
    if isinstance(c, (Constraint, ToolCall, Grammar)):
        return c
    if isinstance(c, dict) and len(c) == 1 and next(iter(c)) in SHORTHANDS:
        (kind, value), = c.items()
        return Constraint("json_object") if kind == "json_object" else Constraint(kind, value)
    raise GenerationError(f"constraint: give a kimi_jax.text.grammar.Constraint, ToolCall or Grammar, or one of "
                          f"{{key: value}} with key in {SHORTHANDS}; got {c!r:.80}")


def chat_mode(tok, ids: Sequence[int]) -> tuple[bool, bool]:
    """(a chat reply, with thinking) from the prompt's end."""
    sp = tok.specials
    if chat.OPEN not in sp or chat.SEP not in sp or not ids or ids[-1] != sp[chat.SEP]:
        return False, False
    for channel in ("response", "think"):
        tail = chat.segment_ids(tok, chat._open(channel))
        if list(ids[-len(tail):]) == tail:
            return True, channel == "think"
    return False, False


def _engine(model, tok, n: int, max_len: int) -> Engine:
    slots = 1 << max(0, (n - 1).bit_length())
    key = (id(model), id(tok), slots, max_len)
    if key not in _ENGINES:
        _ENGINES[key] = Engine(model, tok, slots=min(slots, 8), max_len=max_len, structured=True,
                               prefix_cache_bytes=0)
    return _ENGINES[key]


def generate(model, prompts, max_new_tokens: int = 32, *, constraint, tokenizer=None, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, stop: Sequence[int] | None = None, seed: int = 0,
             max_len: int | None = None) -> Generation:
    """Generate with every output (every answer, for chat prompts) matching ``constraint``; see the module
    docstring. Returns a :class:`~kimi_jax.generation.generate.Generation` (``text`` without the stop id)."""
    tok = tokenizer_of(tokenizer)
    if tok is None:
        raise GenerationError("constraint: constrained generation needs a tokenizer (pass tokenizer=)")
    c = as_constraint(constraint)
    ids = encode_prompts(prompts, tok, model.cfg.vocab_size)
    longest = max(len(p) for p in ids) + int(max_new_tokens)
    max_len = max_len or max(256, 1 << (longest - 1).bit_length())
    eng = _engine(model, tok, len(ids), int(max_len))
    grammars = []
    for p in ids:
        is_chat, thinking = chat_mode(tok, p)
        eos = [tok.special_id(chat.END_OF_MSG)] if is_chat else (list(stop) if stop else eng.default_stop_ids())
        try:
            grammars.append(c if isinstance(c, Grammar) else compile_grammar(
                tok, c, chat_reply=is_chat, thinking=thinking, eos=eos, vocab_size=model.cfg.vocab_size))
        except ConstraintError as e:
            raise GenerationError(f"constraint: {e}") from None
    t0 = time.perf_counter()
    try:
        handles = [eng.submit(Request(prompt=p, max_tokens=int(max_new_tokens), temperature=temperature, top_k=top_k,
                                      top_p=top_p, seed=seed + i, stop_ids=None if stop is None else tuple(stop),
                                      constraint=g)) for i, (p, g) in enumerate(zip(ids, grammars))]
        while not all(h.finished for h in handles):
            eng.step()
        done = [h.result() for h in handles]
    except EngineError as e:
        raise GenerationError(str(e)) from None
    stops = set(eng.default_stop_ids() if stop is None else stop)
    return Generation(tokens=[d.tokens for d in done], prompt_tokens=ids,
                      text=[tok.decode([t for t in d.tokens if t not in stops]) for d in done],
                      finish_reason=[d.finish_reason for d in done],
                      timings={"total": time.perf_counter() - t0, "new_tokens": sum(len(d.tokens) for d in done)})
