"""The OpenAI wire format for ``/v1/completions`` and ``/v1/chat/completions``: request bodies in (validated), response
objects, stream chunks and errors out, and the incremental split of a K3 chat reply.

What is unusual here:

* A field that would change the output if we honoured it but that we cannot honour (``n`` > 1, penalties,
  ``logit_bias``, ``echo``, ``best_of``, top-N alternative logprobs) is refused with a 400 naming the field, never
  silently ignored; so is a field we do not know.
* Structured outputs (:mod:`kimi_jax.text.grammar`): ``response_format`` (``json_object``, ``json_schema``),
  ``tool_choice`` ``"required"`` or a named function (the reply is one call in K3's tool-call format, its arguments
  constrained by the function's schema), and vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``,
  ``grammar``, ``json_object``): at most one per request, parsed here into :attr:`Params.constraint`.
  A few that cannot change the tokens (``user``, ``metadata``, ``store``, ``service_tier``,
  ``parallel_tool_calls``) are accepted and ignored.
* ``speculative: false``: no drafts for this request on a server that drafts (``kimi-jax serve --speculative``).
* Extensions, as vLLM spells them: ``top_k``, ``stop_token_ids``, ``ignore_eos``, ``return_token_ids``
  (adds ``prompt_token_ids`` and ``choices[i].token_ids``), and for chat ``chat_template_kwargs: {"thinking": bool,
  "thinking_effort": str}``.
* A chat reply is split as it streams (:class:`ChatStream`) by the marker *ids* of the K3 format, so text the
  model writes that merely looks like ``<|open|>`` stays text. Stop strings of a chat request are matched here on
  the reasoning and the answer text (not by the engine on the raw text, which holds the markers' names), by the
  same :class:`~kimi_jax.serving.detokenize.StopText` the engine uses for completions.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from typing import Any, Sequence

from kimi_jax.serving.detokenize import StopText
from kimi_jax.text import chat
from kimi_jax.text.grammar import Constraint, ConstraintError, ToolCall
from kimi_jax.text.tokenizer import Tokenizer


class ProtocolError(ValueError):
    """A request we refuse: an OpenAI error with its HTTP status."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.type = status, param, code, type

    def body(self) -> dict:
        return error_body(str(self), type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# -- requests -------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Params:
    """One validated request. ``prompt`` (completions): text or token ids; ``messages`` (chat)."""

    chat: bool
    model: str | None
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    max_tokens: int | None = None  # None: completions 16, chat what the cache has left
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    return_token_ids: bool = False
    tools: list[dict] | None = None
    thinking: bool = True  # the chat module's default
    thinking_effort: str | None = "max"
    constraint: Constraint | ToolCall | None = None  # structured outputs
    constraint_param: str | None = None  # the field it came from (for errors)
    speculative: bool = True  # False: no drafts for this request


_IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}
# accepted only at a value meaning "off"
_OFF = {"presence_penalty": (None, 0), "frequency_penalty": (None, 0), "repetition_penalty": (None, 1),
        "logit_bias": (None, {}), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
        "top_logprobs": (None, 0)}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos",
           "n", "stream", "stream_options", "logprobs", "return_token_ids", "response_format", "structured_outputs",
           "speculative"}
_COMPLETION = _COMMON | {"prompt", "echo", "suffix", "best_of"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                   "chat_template_kwargs", "reasoning_effort", "response_format"}
_PENALTIES = {"presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"}
REASONING_EFFORTS = {"minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "max", "max": "max"}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:  # json.loads reads NaN and Infinity: refused here
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _typed(body: dict, name: str, default, check, what: str):
    v = body.get(name)
    if v is None:
        return default
    if not check(v):
        raise ProtocolError(f"{name}: expected {what}, got {json.dumps(v)[:80]}", param=name)
    return v


def _int(body, name, default=None):
    return _typed(body, name, default, _is_int, "an integer")


def _float(body, name, default):
    return float(_typed(body, name, default, _is_number, "a finite number"))


def _bool(body, name, default=False):
    return _typed(body, name, default, lambda v: isinstance(v, bool), "true or false")


def _check_fields(body: dict, allowed: set[str]) -> None:
    for name, value in body.items():
        if name in _IGNORED or (name in allowed and name not in _OFF):
            continue
        if name in _OFF and (name in allowed or name in _PENALTIES):
            if value not in _OFF[name]:
                raise ProtocolError(f"{name}={json.dumps(value)[:80]} is not supported (only "
                                    f"{json.dumps(_OFF[name][1])} or null)", param=name, code="unsupported_parameter")
            continue
        raise ProtocolError(f"unknown or unsupported field {name!r}", param=name, code="unsupported_parameter")


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise ProtocolError("stop: expected a string or a list of strings", param="stop")
    return tuple(s for s in v if s)


def _token_ids(v, name: str) -> list[int]:
    if not isinstance(v, list) or not all(_is_int(t) for t in v):
        raise ProtocolError(f"{name}: expected a list of token ids", param=name)
    return list(v)


def _common(body: dict, chat_request: bool) -> Params:
    """The fields both endpoints share."""
    n = _int(body, "n", 1)
    if n != 1:
        raise ProtocolError(f"n={n} is not supported (only 1): send one request per completion", param="n",
                            code="unsupported_parameter")
    opts = _typed(body, "stream_options", {}, lambda v: isinstance(v, dict), "an object")
    unknown = set(opts) - {"include_usage"}
    if unknown:
        raise ProtocolError(f"stream_options: unsupported field(s) {sorted(unknown)} (only include_usage)",
                            param="stream_options", code="unsupported_parameter")
    top_k = _int(body, "top_k", 0)
    return Params(
        chat=chat_request, model=_typed(body, "model", None, lambda v: isinstance(v, str), "a string"),
        max_tokens=_int(body, "max_tokens"), temperature=_float(body, "temperature", 1.0),
        top_p=_float(body, "top_p", 1.0), top_k=0 if top_k == -1 else top_k, seed=_int(body, "seed"),
        stop=_stop(body), stop_token_ids=tuple(_token_ids(body.get("stop_token_ids") or [], "stop_token_ids")),
        ignore_eos=_bool(body, "ignore_eos"), stream=_bool(body, "stream"),
        include_usage=_bool(opts, "include_usage"),
        return_token_ids=_bool(body, "return_token_ids"), speculative=_bool(body, "speculative", True))


def _as_object(body) -> dict:
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    return body


def _prompt(v):
    """A string or a list of ids; a list holding one of those is unwrapped, a longer list refused."""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        if v and all(_is_int(t) for t in v):
            return list(v)
        if len(v) == 1 and isinstance(v[0], (str, list)):
            return _prompt(v[0])
        if len(v) > 1 and all(isinstance(p, (str, list)) for p in v):
            raise ProtocolError(f"prompt: a batch of {len(v)} prompts is not supported; send one request per "
                                "prompt", param="prompt", code="unsupported_parameter")
        if not v:
            raise ProtocolError("prompt is empty", param="prompt")
    raise ProtocolError("prompt: expected a string or a list of token ids", param="prompt")


def parse_completion(body) -> Params:
    """A ``/v1/completions`` body."""
    body = _as_object(body)
    _check_fields(body, _COMPLETION)
    if "prompt" not in body:
        raise ProtocolError("prompt is required", param="prompt")
    p = _common(body, False)
    p.prompt = _prompt(body["prompt"])
    logprobs = _int(body, "logprobs")
    if logprobs not in (None, 0):
        raise ProtocolError(f"logprobs={logprobs} is not supported: only 0 (the chosen tokens' log-probabilities, "
                            "no alternatives)", param="logprobs", code="unsupported_parameter")
    p.logprobs = logprobs == 0
    _constraint(body, p, None)
    return p


def _tools(body: dict) -> tuple[list[dict] | None, ToolCall | None]:
    """(the tools declared to the model, a forced call or None)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    named = isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
    if choice not in (None, "auto", "none", "required") and not named:
        raise ProtocolError(f"tool_choice={json.dumps(choice)[:80]}: expected 'auto', 'none', 'required' or "
                            '{"type": "function", "function": {"name": ...}}', param="tool_choice")
    if tools is None or choice == "none":
        if choice == "required" or named:
            raise ProtocolError("tool_choice forces a call but the request declares no tools", param="tool_choice")
        return None, None
    ok = isinstance(tools, list) and all(
        isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str) for t in tools)
    if not ok:
        raise ProtocolError('tools: expected a list of {"type": "function", "function": {"name": ..., '
                            '"parameters": ...}}', param="tools")
    if not tools and (choice == "required" or named):
        raise ProtocolError("tool_choice forces a call but the request declares no tools", param="tool_choice")
    forced = None
    if choice == "required":
        forced = ToolCall(tuple(tools))
    elif named:
        name = choice["function"].get("name")
        match = [t for t in tools if t["function"]["name"] == name]
        if not match:
            raise ProtocolError(f"tool_choice names the function {name!r}, which is not among the tools "
                                f"({', '.join(t['function']['name'] for t in tools)})", param="tool_choice")
        forced = ToolCall((match[0],))
    return tools or None, forced


_SO_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _response_format(body: dict) -> Constraint | None:
    rf = body.get("response_format")
    if rf is None:
        return None
    kinds = ("text", "json_object", "json_schema")
    if not isinstance(rf, dict) or rf.get("type") not in kinds:
        raise ProtocolError(f"response_format: expected {{\"type\": one of {list(kinds)}, ...}}, got "
                            f"{json.dumps(rf)[:80]}", param="response_format")
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return Constraint("json_object")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise ProtocolError('response_format.json_schema: expected {"name": ..., "schema": {...}}',
                            param="response_format")
    return Constraint("json", spec.get("schema", {}))


def _structured_outputs(body: dict) -> Constraint | None:
    so = body.get("structured_outputs")
    if so is None:
        return None
    if not isinstance(so, dict):
        raise ProtocolError("structured_outputs: expected an object", param="structured_outputs")
    given = {k: v for k, v in so.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(_SO_KINDS))
    if unknown:
        raise ProtocolError(f"structured_outputs: unsupported field(s) {unknown} (supported: {list(_SO_KINDS)})",
                            param="structured_outputs", code="unsupported_parameter")
    if len(given) != 1:
        raise ProtocolError(f"structured_outputs: give exactly one of {list(_SO_KINDS)}", param="structured_outputs")
    (kind, value), = given.items()
    if kind == "json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ProtocolError(f"structured_outputs.json: not valid JSON ({e})", param="structured_outputs") from None
    try:
        return Constraint("json_object") if kind == "json_object" else Constraint(kind, value)
    except ConstraintError as e:
        raise ProtocolError(f"structured_outputs: {e}", param="structured_outputs") from None


def _constraint(body: dict, p: Params, forced: ToolCall | None) -> None:
    """At most one of ``response_format``, ``structured_outputs`` and a forced tool call."""
    found = [(name, c) for name, c in (("response_format", _response_format(body)),
                                       ("structured_outputs", _structured_outputs(body)), ("tool_choice", forced))
             if c is not None]
    if len(found) > 1:
        raise ProtocolError(f"{' and '.join(n for n, _ in found)} both constrain the reply: give one",
                            param=found[1][0])
    if found:
        p.constraint_param, p.constraint = found[0]


def _thinking(body: dict, p: Params) -> None:
    kw = _typed(body, "chat_template_kwargs", {}, lambda v: isinstance(v, dict), "an object")
    unknown = set(kw) - {"thinking", "enable_thinking", "thinking_effort"}
    if unknown:
        raise ProtocolError(f"chat_template_kwargs: unsupported key(s) {sorted(unknown)} (thinking, "
                            "thinking_effort)", param="chat_template_kwargs")
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort == "none":
            p.thinking = False
        elif effort in REASONING_EFFORTS:
            p.thinking_effort = REASONING_EFFORTS[effort]
        else:
            raise ProtocolError(f"reasoning_effort={json.dumps(effort)[:40]}: choose from none, "
                                f"{', '.join(REASONING_EFFORTS)}", param="reasoning_effort")
    thinking = kw.get("thinking", kw.get("enable_thinking", p.thinking))
    if not isinstance(thinking, bool):
        raise ProtocolError("chat_template_kwargs.thinking: expected true or false", param="chat_template_kwargs")
    p.thinking = thinking
    if "thinking_effort" in kw:
        if kw["thinking_effort"] not in chat.THINKING_EFFORTS:
            raise ProtocolError(f"chat_template_kwargs.thinking_effort: choose from {chat.THINKING_EFFORTS}",
                                param="chat_template_kwargs")
        p.thinking_effort = kw["thinking_effort"]


def parse_chat(body) -> Params:
    """A ``/v1/chat/completions`` body."""
    body = _as_object(body)
    _check_fields(body, _CHAT)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise ProtocolError("messages: expected a non-empty list of message objects", param="messages")
    p = _common(body, True)
    p.messages = messages
    if body.get("max_completion_tokens") is not None:
        p.max_tokens = _int(body, "max_completion_tokens")
    p.logprobs = _bool(body, "logprobs")
    p.tools, forced = _tools(body)
    _constraint(body, p, forced)
    _thinking(body, p)
    return p


def encode_chat(tokenizer: Tokenizer | None, p: Params) -> list[int]:
    """The prompt ids of a chat request (K3 chat format)."""
    if tokenizer is None:
        raise ProtocolError("chat needs a tokenizer and this model has none: use /v1/completions with token ids",
                            param="messages")
    missing = [m for m in (chat.OPEN, chat.CLOSE, chat.SEP, chat.END_OF_MSG) if m not in tokenizer.specials]
    if missing:
        raise ProtocolError(f"the K3 chat format needs the Kimi tokenizer's markers; this tokenizer lacks {missing}:"
                            " use /v1/completions", param="messages")
    try:
        return chat.encode(tokenizer, p.messages, tools=p.tools, thinking=p.thinking,
                           thinking_effort=p.thinking_effort)
    except (ValueError, KeyError, TypeError) as e:
        raise ProtocolError(f"messages: {e}", param="messages") from None


def encode_completion(tokenizer: Tokenizer | None, p: Params) -> list[int]:
    if not isinstance(p.prompt, str):
        return p.prompt
    if tokenizer is None:
        raise ProtocolError("this model has no tokenizer: send the prompt as a list of token ids", param="prompt")
    try:
        return tokenizer.encode(p.prompt)
    except ValueError as e:
        raise ProtocolError(f"prompt: {e}", param="prompt") from None


# -- the chat reply, incrementally ----------------------------------------------------------------------------------


class ChatStream:
    """Generated ids of a K3 chat reply -> (reasoning, answer) text as it arrives; tool calls at the end.

    Follows the channel stack of :func:`kimi_jax.text.chat.parse_reply`: a marker id (open / close) starts a
    tag name that ends at ``<|sep|>``; text goes to the channel on top (``think`` or ``response``); tool-call
    arguments are left to :func:`~kimi_jax.text.chat.parse_reply` over all ids at the end."""

    def __init__(self, tokenizer: Tokenizer, *, thinking: bool, stops: Sequence[str] = ()):
        sp = tokenizer.specials
        self.tok, self.thinking = tokenizer, thinking
        self.open, self.close, self.sep, self.end = sp[chat.OPEN], sp[chat.CLOSE], sp[chat.SEP], sp[chat.END_OF_MSG]
        self.stack = ["message", "think" if thinking else "response"]
        self.marker: tuple[int, list[int]] | None = None  # (open or close id, tag ids so far)
        self.decoders = {"think": tokenizer.stream_decoder(), "response": tokenizer.stream_decoder()}
        self.stops = {"think": StopText(stops), "response": StopText(stops)}
        self.ids: list[int] = []
        self.ended = self.stopped = False

    def _marker(self, kind: int, tag_ids: list[int]) -> None:
        tag = self.tok.decode(tag_ids).strip().partition(" ")[0]
        if kind == self.open:
            self.stack.append(tag)
        elif tag in self.stack:
            del self.stack[len(self.stack) - 1 - self.stack[::-1].index(tag):]

    def push(self, ids: Sequence[int]) -> tuple[str, str]:
        """New (reasoning, answer) text; after a stop string (:attr:`stopped`) nothing more."""
        raw = {"think": "", "response": ""}
        for t in ids:
            if self.stopped:
                break
            self.ids.append(int(t))
            if self.ended or t == self.end:
                self.ended = True
            elif self.marker is not None:
                if t == self.sep:
                    self._marker(*self.marker)
                    self.marker = None
                else:
                    self.marker[1].append(int(t))
            elif t in (self.open, self.close):
                self.marker = (int(t), [])
            elif self.stack and self.stack[-1] in raw:
                ch = self.stack[-1]
                text, hit = self.stops[ch].push(self.decoders[ch].push([t]))
                raw[ch] += text
                self.stopped = hit
        return raw["think"], raw["response"]

    def finish(self) -> tuple[str, str]:
        """The text held back at the end (partial characters, a possible stop-string start)."""
        if self.stopped:
            return "", ""
        out = []
        for ch in ("think", "response"):
            text, hit = self.stops[ch].push(self.decoders[ch].flush())
            out.append(text + ("" if hit else self.stops[ch].flush()))
        return out[0], out[1]

    def tool_calls(self) -> list[dict]:
        """The reply's tool calls, OpenAI-shaped (arguments as a JSON string)."""
        if self.stopped:
            return []
        calls = chat.parse_reply(self.tok, self.ids, thinking=self.thinking).tool_calls
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
                for c in calls]


# -- responses ------------------------------------------------------------------------------------------------------


def new_id(chat_request: bool) -> str:
    return f"{'chatcmpl' if chat_request else 'cmpl'}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def token_text(tokenizer: Tokenizer | None, t: int) -> str:
    return tokenizer.decode([t]) if tokenizer is not None else f"token_id:{t}"


def completion_logprobs(tokenizer, ids: Sequence[int], logprobs: Sequence[float], offset: int = 0) -> dict:
    """The legacy completions shape (no alternatives: ``top_logprobs`` null); ``offset``: text already sent."""
    tokens = [token_text(tokenizer, t) for t in ids]
    starts, pos = [], offset
    for s in tokens:
        starts.append(pos)
        pos += len(s)
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": None, "text_offset": starts}


def chat_logprobs(tokenizer, ids: Sequence[int], logprobs: Sequence[float]) -> dict:
    def entry(t, lp):
        raw = tokenizer.decode_bytes([t]) if tokenizer is not None else token_text(None, t).encode()
        return {"token": token_text(tokenizer, t), "logprob": lp, "bytes": list(raw), "top_logprobs": []}
    return {"content": [entry(t, lp) for t, lp in zip(ids, logprobs)]}


def _choice_extras(p: Params, token_ids: Sequence[int] | None) -> dict:
    return {"token_ids": list(token_ids)} if p.return_token_ids and token_ids is not None else {}


def _response(p: Params, obj: str, rid: str, created: int, model: str, choice: dict, prompt_ids, use: dict) -> dict:
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice], "usage": use}
    if p.return_token_ids:
        out["prompt_token_ids"] = list(prompt_ids)
    return out


def completion_response(p: Params, rid: str, created: int, model: str, *, text: str, finish_reason: str,
                        token_ids: list[int], prompt_ids: list[int], logprobs: dict | None, use: dict) -> dict:
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
              **_choice_extras(p, token_ids)}
    return _response(p, "text_completion", rid, created, model, choice, prompt_ids, use)


def completion_chunk(p: Params, rid: str, created: int, model: str, *, text: str, finish_reason: str | None = None,
                     token_ids: list[int] | None = None, logprobs: dict | None = None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
              **_choice_extras(p, token_ids)}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def chat_message(reasoning: str, content: str, tool_calls: list[dict]) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": content if content or not tool_calls else None,
                           "reasoning_content": reasoning or None}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def chat_response(p: Params, rid: str, created: int, model: str, *, message: dict, finish_reason: str,
                  token_ids: list[int], prompt_ids: list[int], logprobs: dict | None, use: dict) -> dict:
    choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
              **_choice_extras(p, token_ids)}
    return _response(p, "chat.completion", rid, created, model, choice, prompt_ids, use)


def chat_chunk(p: Params, rid: str, created: int, model: str, *, delta: dict, finish_reason: str | None = None,
               token_ids: list[int] | None = None, logprobs: dict | None = None) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
              **_choice_extras(p, token_ids)}
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}


def usage_chunk(p: Params, rid: str, created: int, model: str, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if p.chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": use}
