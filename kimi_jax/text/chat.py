"""The Kimi K3 chat format ("XTML", K3_SPEC §6): rendering a conversation to token ids and parsing a reply.

A message is ``<|open|>message role="user"<|sep|> ... <|close|>message<|sep|><|end_of_msg|>``; an assistant
message holds a ``think`` channel (thinking mode), a ``response`` channel and optional ``tools`` calls.

What is unusual: tokenization is **per segment**. Control markers become their special ids; every text piece
(tag name, `` role``, ``="``, the value, ``"``, the content) is BPE-encoded on its own with special-token
parsing off. Rendering one string and tokenizing it once gives different ids at segment boundaries, and would
let user text forge markers. The turn terminator (stop token) is ``<|end_of_msg|>``, not ``[EOS]``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Sequence

from kimi_jax.text.tokenizer import Tokenizer

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
THINKING_EFFORTS = ("low", "medium", "high", "max")
ROLES = ("system", "user", "assistant", "tool")


@dataclasses.dataclass(frozen=True)
class Segment:
    text: str
    control: bool = False  # a marker: encoded as one special id


def _text(s) -> list[Segment]:
    s = str(s)
    return [Segment(s)] if s else []


def _escape(value) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def _open(tag: str, attrs: Sequence[tuple[str, Any]] = ()) -> list[Segment]:
    segs = [Segment(OPEN, True), *_text(tag)]
    for key, value in attrs:  # each attribute piece is its own segment
        segs += [*_text(f" {key}"), *_text('="'), *_text(_escape(value)), *_text('"')]
    return segs + [Segment(SEP, True)]


def _close(tag: str) -> list[Segment]:
    return [Segment(CLOSE, True), *_text(tag), Segment(SEP, True)]


def _message(attrs, body: list[Segment]) -> list[Segment]:
    return _open("message", attrs) + body + _close("message") + [Segment(END_OF_MSG, True)]


def _content(content) -> list[Segment]:
    if content is None:
        return []
    if isinstance(content, str):
        return _text(content)
    segs = []
    for part in content:  # OpenAI-style parts; only text is supported (the vision tower is out of scope)
        if not isinstance(part, dict) or part.get("type") != "text":
            raise ValueError(f"unsupported message content part {part!r} (only text parts)")
        segs += _text(part["text"])
    return segs


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def _tool_declare(tools) -> list[Segment]:
    body = f"# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{_json(tools)}\n```"
    return _message([("role", "system"), ("type", "tool-declare")], _text(body))


def _thinking_effort(effort: str) -> list[Segment]:
    body = ("`thinking_effort` guides on how much to think in your thinking channel (not including the response "
            "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
            f"Now the system is invoked with `thinking_effort={effort}`.")
    return _message([("role", "system"), ("type", "thinking-effort")], _text(body))


def _value_type(v) -> str:
    if isinstance(v, bool):
        return "boolean"
    if v is None:
        return "null"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    return "object" if isinstance(v, dict) else "array"


def _tool_calls(calls) -> list[Segment]:
    segs = _open("tools")
    for index, call in enumerate(calls, 1):
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            args = json.loads(args) if args.strip() else {}
        if not isinstance(args, dict):
            raise ValueError(f"tool call {fn.get('name')!r}: arguments must be a JSON object")
        segs += _open("call", [("tool", fn["name"]), ("index", index)])
        for key, value in args.items():
            segs += _open("argument", [("key", key), ("type", _value_type(value))])
            segs += _text(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
            segs += _close("argument")
        segs += _close("call")
    return segs + _close("tools")


def render(messages: Sequence[dict], *, tools: Sequence[dict] | None = None, thinking: bool = True,
           thinking_effort: str | None = "max", add_generation_prompt: bool = True) -> list[Segment]:
    """A conversation as segments. ``messages``: dicts with ``role`` (system/user/assistant/tool) and
    ``content``; assistant messages may carry ``reasoning_content`` and ``tool_calls``; tool messages ``name``.

    Thinking mode (default, effort ``max`` as the release) adds an internal ``thinking-effort`` system
    message and a ``think`` channel to every assistant message; the generation prompt opens the assistant
    message and its first channel (``think``, or ``response`` with thinking off).
    """
    if thinking and thinking_effort is not None and thinking_effort not in THINKING_EFFORTS:
        raise ValueError(f"thinking_effort {thinking_effort!r}: choose from {THINKING_EFFORTS}")
    segs: list[Segment] = []
    if tools:
        segs += _tool_declare(list(tools))
    if thinking and thinking_effort is not None:
        segs += _thinking_effort(thinking_effort)
    tool_index, last_calls = 0, []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ROLES:
            raise ValueError(f"message {i}: role {role!r} is not one of {ROLES}")
        named = [("name", m["name"])] if m.get("name") and role in ("user", "system", "assistant") else []
        if role in ("user", "system"):
            segs += _message([("role", role), *named], _content(m.get("content")))
        elif role == "assistant":
            tool_index, last_calls = 0, list(m.get("tool_calls") or [])
            body = []
            if thinking:  # the channel is structural: present even when empty
                reasoning = m.get("reasoning_content") or m.get("reasoning") or ""
                body += _open("think") + (_text(reasoning) if str(reasoning).strip() else []) + _close("think")
            body += _open("response") + _content(m.get("content")) + _close("response")
            if last_calls:
                body += _tool_calls(last_calls)
            segs += _message([("role", "assistant"), *named], body)
        else:
            tool_index += 1
            name = m.get("tool") or m.get("name")
            if name is None and tool_index <= len(last_calls):
                name = last_calls[tool_index - 1].get("function", last_calls[tool_index - 1])["name"]
            if name is None:
                raise ValueError(f"message {i}: a tool message needs `name` (or a preceding assistant tool call)")
            segs += _message([("role", "tool"), ("tool", name), ("index", tool_index)], _content(m.get("content")))
    if add_generation_prompt:
        segs += _open("message", [("role", "assistant")]) + _open("think" if thinking else "response")
    return segs


def segment_ids(tokenizer: Tokenizer, segments: Sequence[Segment]) -> list[int]:
    """Token ids of ``segments``: a marker's special id, each text piece BPE-encoded on its own."""
    ids: list[int] = []
    for seg in segments:
        ids += [tokenizer.special_id(seg.text)] if seg.control else tokenizer.encode(seg.text)
    return ids


def encode(tokenizer: Tokenizer, messages: Sequence[dict], **kw) -> list[int]:
    """Token ids of :func:`render` (per-segment tokenization)."""
    return segment_ids(tokenizer, render(messages, **kw))


def to_text(segments: Sequence[Segment]) -> str:
    """The rendered conversation as one string (for display; never tokenize this)."""
    return "".join(s.text for s in segments)


# -- parsing a generated reply ------------------------------------------------------------------------------

_ATTR = re.compile(r'([\w-]+)="([^"]*)"')


def _attrs(s: str) -> tuple[str, dict]:
    tag, _, rest = s.strip().partition(" ")
    return tag, {k: v.replace("&quot;", '"').replace("&amp;", "&") for k, v in _ATTR.findall(rest)}


@dataclasses.dataclass
class Reply:
    reasoning: str  # the think channel
    content: str  # the response channel
    tool_calls: list[dict]  # [{"name": ..., "arguments": {...}}]
    finished: bool  # reached <|end_of_msg|>


def parse_reply(tokenizer: Tokenizer, ids: Sequence[int], *, thinking: bool = True) -> Reply:
    """Split generated ids (continuing the generation prompt of :func:`render`) into reasoning, answer and
    tool calls. Markers are matched by id, so text that merely looks like a marker stays text."""
    sp = tokenizer.specials
    open_id, close_id, sep_id, end_id = sp[OPEN], sp[CLOSE], sp[SEP], sp[END_OF_MSG]
    stack = ["message", "think" if thinking else "response"]
    buffers = {"think": [], "response": []}
    calls: list[dict] = []
    arg: dict | None = None
    finished, i = False, 0
    ids = [int(t) for t in ids]
    while i < len(ids):
        t = ids[i]
        if t == end_id:
            finished = True
            break
        if t in (open_id, close_id):
            j = i + 1
            while j < len(ids) and ids[j] != sep_id:
                j += 1
            tag, attrs = _attrs(tokenizer.decode(ids[i + 1 : j]))
            if t == open_id:
                stack.append(tag)
                if tag == "call":
                    calls.append({"name": attrs.get("tool"), "arguments": {}})
                elif tag == "argument" and calls:
                    arg = {"key": attrs.get("key"), "type": attrs.get("type", "string"), "ids": []}
            else:
                if tag == "argument" and arg is not None:
                    raw = tokenizer.decode(arg["ids"])
                    try:
                        value = raw if arg["type"] == "string" else json.loads(raw)
                    except json.JSONDecodeError:
                        value = raw
                    calls[-1]["arguments"][arg["key"]] = value
                    arg = None
                if tag in stack:
                    del stack[len(stack) - 1 - stack[::-1].index(tag) :]
            i = j + 1
            continue
        if arg is not None:
            arg["ids"].append(t)
        elif stack and stack[-1] in buffers:
            buffers[stack[-1]].append(t)
        i += 1
    return Reply(tokenizer.decode(buffers["think"]), tokenizer.decode(buffers["response"]), calls, finished)
