"""Constrained decoding's host half: a :class:`Constraint` (a JSON schema, any JSON object, a regex, a choice of
strings, a Lark grammar, or a forced tool call) compiled by llguidance into a grammar over one tokenizer's ids, and
per request a :class:`Guide` that writes the allowed-token bitmask of the next position and follows the tokens drawn.

Why llguidance (and not xgrammar, the other engine vLLM and SGLang use): its wheel needs only numpy (xgrammar's pulls
torch, transformers and triton), it reads a tiktoken vocabulary directly, computes a mask in well under a
millisecond on the vocabularies here, and rolls a matcher back by tokens (what speculative decoding needs).

The bitmask is one int32 word per 32 token ids, bit ``i % 32`` of word ``i // 32`` set when id ``i`` may come next
(llguidance's layout); a row is :func:`words` long for the *model's* vocabulary, its words past the tokenizer's
vocabulary zero. The device applies it (:func:`kimi_jax.generation.sampling.apply_bitmask`).

**Chat** (:func:`chat_grammar`): the constraint applies to the reply's answer, in the K3 format. The thinking
channel stays free: a :class:`Guide` for a thinking reply gives no mask until the model closes its thinking (the
``<|close|>`` marker), then the grammar forces ``think<|sep|>``, opens the response channel, constrains its body and
closes the message. A forced tool call closes an empty response channel and writes one ``tools`` block whose
``call`` names the function and whose arguments are the K3 format's ``argument`` elements, each value constrained by
its property's schema (raw text for strings, JSON for the rest, as :mod:`kimi_jax.text.chat` renders them). The
format's fixed pieces are forced as the exact ids :func:`kimi_jax.text.chat.encode` gives them (per-segment
tokenization), so the model sees the token sequences it was trained on.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
from typing import Sequence

import llguidance
import numpy as np

from kimi_jax.text import chat
from kimi_jax.text.tokenizer import HFTokenizer, KimiTokenizer, Tokenizer

KINDS = ("json", "json_object", "regex", "choice", "grammar")
COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}  # no runs of whitespace


class ConstraintError(ValueError):
    """A constraint that cannot be compiled (an invalid schema, regex or grammar; a tool whose parameters cannot be
    forced); the message names it."""


@dataclasses.dataclass(frozen=True)
class Constraint:
    """What the output (the answer, in chat) must match. ``kind``: one of :data:`KINDS`; ``value``: the JSON schema
    (``json``), the regex, the choices, or the Lark grammar text (llguidance's Lark dialect; a GBNF grammar, written
    with ``::=``, is converted)."""

    kind: str
    value: object = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConstraintError(f"constraint kind {self.kind!r}: choose from {KINDS}")

    def key(self) -> str:
        return json.dumps([self.kind, self.value], sort_keys=True, ensure_ascii=False)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A forced tool call: one call to one of ``tools`` (OpenAI function tools; one tool: that function)."""

    tools: tuple

    def key(self) -> str:
        return json.dumps(["tools", list(self.tools)], sort_keys=True, ensure_ascii=False)


def words(vocab_size: int) -> int:
    """Int32 words of one bitmask row for ``vocab_size`` ids."""
    return (int(vocab_size) + 31) // 32


# -- grammars -------------------------------------------------------------------------------------------------------


def _subgrammar(c: Constraint) -> dict:
    """``c`` as one entry of an llguidance multi-grammar (referenced as ``@body``)."""
    if c.kind in ("json", "json_object"):
        schema = {"type": "object"} if c.kind == "json_object" else c.value
        if not isinstance(schema, dict):
            raise ConstraintError(f"json schema: expected a JSON object, got {json.dumps(schema)[:80]}")
        return {"name": "body", "json_schema": {**schema, "x-guidance": {**COMPACT, **schema.get("x-guidance", {})}}}
    if c.kind == "regex":
        if not isinstance(c.value, str):
            raise ConstraintError("regex: expected a string")
        return {"name": "body", "lark_grammar": f"start: {_regex_literal(c.value)}"}
    if c.kind == "choice":
        ok = isinstance(c.value, (list, tuple)) and c.value and all(isinstance(s, str) for s in c.value)
        if not ok:
            raise ConstraintError("choice: expected a non-empty list of strings")
        return {"name": "body", "lark_grammar": "start: " + " | ".join(_literal(s) for s in c.value)}
    if not isinstance(c.value, str) or not c.value.strip():
        raise ConstraintError("grammar: expected a Lark (or GBNF) grammar as a string")
    text = llguidance.gbnf_to_lark(c.value) if "::=" in c.value else c.value
    return {"name": "body", "lark_grammar": text}


def _literal(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _regex_literal(r: str) -> str:
    return "/" + r.replace("/", "\\/") + "/"


def _segments(tok: Tokenizer, segs) -> str:
    """A Lark sequence forcing exactly the ids of ``segs`` (:func:`kimi_jax.text.chat.segment_ids`)."""
    return " ".join(f"<[{t}]>" for t in chat.segment_ids(tok, segs))


def _opening(tok: Tokenizer, thinking: bool) -> str:
    """What follows the free thinking (from the ``<|close|>`` the model wrote) up to the response channel's body;
    without thinking, nothing (the prompt opened the response channel)."""
    if not thinking:
        return ""
    return _segments(tok, chat._text("think") + [chat.Segment(chat.SEP, True)] + chat._open("response"))


def _closing(tok: Tokenizer) -> str:
    return _segments(tok, chat._close("response"))


def _ending(tok: Tokenizer) -> str:
    return _segments(tok, chat._close("message") + [chat.Segment(chat.END_OF_MSG, True)])


def chat_grammar(tok: Tokenizer, c: Constraint | ToolCall, *, thinking: bool) -> str:
    """The llguidance grammar of a K3 chat reply's constrained part (see the module docstring)."""
    if isinstance(c, ToolCall):
        calls = " | ".join(f"call_{i}" for i in range(len(c.tools)))
        rules = [f"start: {_opening(tok, thinking)} {_closing(tok)} "
                 f"{_segments(tok, chat._open('tools'))} ({calls}) {_segments(tok, chat._close('tools'))} "
                 f"{_ending(tok)}"]
        rules += [_call_rules(tok, i, t) for i, t in enumerate(c.tools)]
        return json.dumps({"grammars": [{"lark_grammar": "\n".join(rules)}]})
    main = f"start: {_opening(tok, thinking)} @body {_closing(tok)} {_ending(tok)}"
    return json.dumps({"grammars": [{"lark_grammar": main}, _subgrammar(c)]})


def completion_grammar(c: Constraint) -> str:
    """The grammar of a completion: the constrained text from the first token, then an end-of-sequence id."""
    return json.dumps({"grammars": [{"lark_grammar": "start: @body"}, _subgrammar(c)]})


# -- forced tool calls ----------------------------------------------------------------------------------------------

_JSON_TYPES = {"number": "number", "integer": "number", "boolean": "boolean", "null": "null", "object": "object",
               "array": "array", "string": "string"}


def _branches(schema: dict) -> list[tuple[str, dict]]:
    """(the K3 format's ``type`` attribute, the schema of values of that type) for each way a value may be."""
    if not isinstance(schema, dict):
        raise ConstraintError(f"a property schema must be an object, got {json.dumps(schema)[:60]}")
    for key in ("anyOf", "oneOf"):
        if key in schema:
            rest = {k: v for k, v in schema.items() if k != key}
            return [b for sub in schema[key] for b in _branches({**rest, **sub})]
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        return [(chat._value_type(v), {"const": v}) for v in values]
    types = schema.get("type")
    if types is None:  # any JSON value
        types = ["string", "number", "boolean", "null", "object", "array"]
    types = types if isinstance(types, list) else [types]
    out = []
    for t in types:
        if t not in _JSON_TYPES:
            raise ConstraintError(f"unknown JSON type {t!r}")
        out.append((_JSON_TYPES[t], {**schema, "type": t}))
    return out


def _value_rule(sub: dict, kind: str) -> str:
    """A Lark expression for one argument value (a raw string, or JSON)."""
    if kind != "string":
        return "%json " + json.dumps({**sub, "x-guidance": COMPACT}, ensure_ascii=False)
    if "const" in sub:
        return _literal(sub["const"])
    if "pattern" in sub:
        return _regex_literal(sub["pattern"].removeprefix("^").removesuffix("$"))
    lo, hi = int(sub.get("minLength", 0)), sub.get("maxLength")
    return f"/(.|\\n){{{lo},{'' if hi is None else int(hi)}}}/" if lo or hi is not None else "/(.|\\n)*/"


def _call_rules(tok: Tokenizer, i: int, tool: dict) -> str:
    fn = tool["function"]
    name, params = fn["name"], fn.get("parameters") or {"type": "object", "properties": {}}
    if params.get("type", "object") != "object" or not isinstance(params.get("properties", {}), dict):
        raise ConstraintError(f"tool {name!r}: to force a call its parameters must be an object schema with "
                              "properties")
    required = set(params.get("required", ()))
    head = _segments(tok, chat._open("call", [("tool", name), ("index", 1)]))
    rules, parts = [], []
    for j, (key, sub) in enumerate(params.get("properties", {}).items()):
        alts = []
        for kind, branch in _branches(sub):
            open_ = _segments(tok, chat._open("argument", [("key", key), ("type", kind)]))
            alts.append(f"{open_} {_value_rule(branch, kind)} {_segments(tok, chat._close('argument'))}")
        rules.append(f"arg_{i}_{j}: " + " | ".join(alts))
        parts.append(f"arg_{i}_{j}" + ("" if key in required else "?"))
    body = " ".join(parts)
    return "\n".join([f"call_{i}: {head} {body} {_segments(tok, chat._close('call'))}", *rules])


# -- tokenizers and compiled grammars -------------------------------------------------------------------------------

_LOCK = threading.Lock()


@functools.lru_cache(maxsize=16)
def lltokenizer(tok: Tokenizer, eos: tuple[int, ...]) -> llguidance.LLTokenizer:
    """llguidance's view of ``tok``, with ``eos`` the ids that may end a finished grammar (built once: ~20 ms for a
    small vocabulary, about a second for K3's)."""
    if isinstance(tok, KimiTokenizer):
        enc = tok._enc
        return llguidance.LLTokenizer.from_tiktoken(encoder=enc._mergeable_ranks, special_tokens=enc._special_tokens,
                                                    pattern=enc._pat_str, eos_token=list(eos), n_vocab=tok.vocab_size)
    if isinstance(tok, HFTokenizer):
        return llguidance.LLTokenizer(tok._tok.to_str(), n_vocab=tok.vocab_size, eos_token=list(eos))
    raise ConstraintError(f"constrained decoding needs a Kimi (tiktoken) or tokenizer.json tokenizer, not "
                          f"{type(tok).__name__}")


@dataclasses.dataclass(frozen=True)
class Grammar:
    """A grammar checked against one tokenizer: makes a :class:`Guide` per request. ``free_until``: the id that ends
    the free part (a thinking chat reply's ``<|close|>``), or None (constrained from the first token)."""

    text: str
    tok: llguidance.LLTokenizer
    free_until: int | None
    vocab_words: int  # words of the model's vocabulary (the device row)

    def guide(self) -> "Guide":
        return Guide(self)


_GRAMMARS: dict = {}


def compile_grammar(tok: Tokenizer, c: Constraint | ToolCall, *, chat_reply: bool, thinking: bool, eos: Sequence[int],
                    vocab_size: int) -> Grammar:
    """``c`` compiled for ``tok`` (cached by constraint, format and tokenizer); raises :class:`ConstraintError`
    naming what is wrong. ``chat_reply``: the K3 chat reply format (:func:`chat_grammar`); else a completion."""
    if isinstance(c, ToolCall) and not chat_reply:
        raise ConstraintError("a forced tool call needs the chat format")
    if tok.vocab_size > vocab_size:
        raise ConstraintError(f"the tokenizer has {tok.vocab_size} ids, more than the model's {vocab_size}")
    key = (tok, c.key(), chat_reply, thinking, tuple(eos), vocab_size)  # the tokenizer itself: no id reuse
    with _LOCK:
        if key in _GRAMMARS:
            return _GRAMMARS[key]
    ll = lltokenizer(tok, tuple(int(e) for e in eos))
    text = chat_grammar(tok, c, thinking=thinking) if chat_reply else completion_grammar(c)
    error = llguidance.LLMatcher.validate_grammar(text, ll)
    if error and not error.startswith("WARNING"):
        raise ConstraintError(f"{_what(c)}: {error.strip()}")
    g = Grammar(text, ll, tok.specials[chat.CLOSE] if chat_reply and thinking else None, words(vocab_size))
    with _LOCK:
        if len(_GRAMMARS) > 256:
            _GRAMMARS.clear()
        _GRAMMARS[key] = g
    return g


def _what(c) -> str:
    return "tool_choice" if isinstance(c, ToolCall) else {"json": "json schema", "json_object": "json object"}.get(
        c.kind, c.kind)


# -- one request ----------------------------------------------------------------------------------------------------


class Guide:
    """One request's constraint state: :meth:`fill` the next position's mask, :meth:`advance` over each token drawn.
    While a thinking reply is still thinking (:attr:`free`), there is no mask."""

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        self.matcher = llguidance.LLMatcher(grammar.tok, grammar.text, log_level=0)
        if self.matcher.is_error():
            raise ConstraintError(self.matcher.get_error())
        self.free = grammar.free_until is not None
        self.n_tok = words(grammar.tok.vocab_size)

    @property
    def done(self) -> bool:
        """The grammar has ended (its last token drawn, an end-of-sequence id included): nothing may follow."""
        return not self.free and self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None

    def fill(self, row: np.ndarray) -> bool:
        """Write the allowed ids of the next position into ``row`` (contiguous int32 ``[vocab_words]``); False (row
        untouched) while free. Raises :class:`ConstraintError` if nothing is allowed (the matcher failed)."""
        if self.free:
            return False
        if row.dtype != np.int32 or not row.flags["C_CONTIGUOUS"]:
            raise ValueError("a mask row is a contiguous int32 array")  # llguidance writes through its pointer
        part = row[: self.n_tok]
        self.matcher.unsafe_compute_mask_ptr(part.ctypes.data, part.nbytes)
        row[self.n_tok:] = 0
        if self.matcher.is_error() or not part.any():
            raise ConstraintError(f"the constraint allows no next token ({self.error or 'grammar finished'})")
        return True

    def advance(self, token: int) -> bool:
        """``token`` was drawn; False if the grammar refused it (a token the mask did not allow)."""
        if self.free:
            self.free = int(token) != self.grammar.free_until
            return True
        if self.matcher.is_stopped():
            return True  # the grammar ended on its last token; the stop id ends the request
        return self.matcher.consume_token(int(token))

    def fill_drafts(self, drafts: Sequence[int], rows: np.ndarray) -> int:
        """Masks for a verify step: ``rows[j]`` for the position after ``drafts[:j]`` (``rows`` int32
        ``[len(drafts) + 1, vocab_words]``; a free position, or one past the grammar's end, all ones), computed on a
        copy (this guide is left as it was: llguidance's rollback does not undo a token that ended the grammar).
        Returns how many drafts the grammar allows in a row (the caller drops the rest: they would be rejected
        anyway)."""
        probe = Guide.__new__(Guide)
        probe.__dict__.update(self.__dict__, matcher=self.matcher.deep_copy())
        n = 0
        for j in range(len(drafts) + 1):
            done = probe.free or probe.matcher.is_stopped()
            if done:
                rows[j] = -1
            else:
                probe.fill(rows[j])
            if j == len(drafts):
                break
            t = int(drafts[j])
            if not done and not (int(rows[j][t >> 5]) >> (t & 31)) & 1:
                break  # consuming a refused token would leave the matcher failed
            probe.advance(t)
            n += 1
        return n
