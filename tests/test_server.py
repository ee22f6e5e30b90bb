"""``kimi-jax serve``: the OpenAI-compatible server, with the official ``openai`` client as the oracle client.

One server per model (module-scoped, uvicorn on a free loopback port in a thread, over the real engine): the demo
K3 (tokenizer, chat format), a tiny Kimi Linear, a tiny K3.1 and a tiny Llama-shaped GQA model (no tokenizer:
token-id prompts). Greedy token ids through the server equal :func:`kimi_jax.generate`'s. Chat parsing (reasoning, answer,
tool calls) is checked end to end over a scripted engine that replays chosen ids. SIGTERM runs the real command
in a subprocess.
"""

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import http.client
import urllib.parse
import numpy as np
import openai
import pytest

import kimi_jax
from kimi_jax.checkpoint.synthetic import write_checkpoint
from kimi_jax.cli.demo import build_demo_checkpoint
from kimi_jax.serving import protocol, server
from kimi_jax.serving.engine import Engine, Event, Handle
from kimi_jax.text import chat
from kimi_jax.text.tokenizer import load_tokenizer

# small static shapes: few programs to compile (prefill buckets 16 and 32, one decode step)
ENGINE = dict(slots=4, page_size=16, prefill_chunk=16, min_chunk=16)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


class Raw:
    """Plain HTTP (the standard library's), for what the ``openai`` client will not send: malformed bodies, other
    paths and methods, a client that walks away."""

    def __init__(self, url: str, timeout: float = 120):
        u = urllib.parse.urlsplit(url)
        self.host, self.port, self.timeout = u.hostname, u.port, timeout

    def request(self, method: str, path: str, body=None, content: bytes | None = None) -> "Reply":
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            data = content if content is not None else (None if body is None else json.dumps(body).encode())
            conn.request(method, path, body=data, headers={"content-type": "application/json"})
            r = conn.getresponse()
            return Reply(r.status, r.read().decode())
        finally:
            conn.close()

    def post(self, path, body=None, content=None):
        return self.request("POST", path, body, content)

    def get(self, path):
        return self.request("GET", path)


class Reply:
    def __init__(self, status: int, text: str):
        self.status_code, self.text = status, text

    def json(self):
        return json.loads(self.text)


class Served:
    """A running server: its engine, model and tokenizer, an ``openai`` client and a plain HTTP one."""

    def __init__(self, engine, model, tok, name, port):
        self.engine, self.model, self.tok, self.name = engine, model, tok, name
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=120)
        self.http = Raw(self.url)


@contextlib.contextmanager
def _running(app):
    """uvicorn serving ``app`` on a free loopback port in a thread; yields the port."""
    sock = server.bind("127.0.0.1", 0)
    srv = server.make_server(app, log_level="warning")
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        srv.should_exit = True
        thread.join(60)
        sock.close()


@contextlib.contextmanager
def _serve(path, tok, name, max_len):
    model = kimi_jax.from_pretrained(path, dtype="float32", progress=False)
    engine = Engine(model, tok, max_len=max_len, **ENGINE).start()
    with _running(server.build_app(engine, name)) as port:
        yield Served(engine, model, tok, name, port)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return build_demo_checkpoint(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def k3(demo_dir):
    with _serve(demo_dir, load_tokenizer(demo_dir), "demo", 256) as s:
        yield s


@pytest.fixture(scope="module")
def kimi_linear(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("kimi_linear"), "kimi_linear")
    with _serve(path, None, "kimi-linear-tiny", 128) as s:
        yield s


@pytest.fixture(scope="module")
def k31(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("k31"), "k3.1")  # K3.1: a DSA indexer in every MLA layer
    with _serve(path, None, "k3.1-tiny", 128) as s:
        yield s


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("llama"), "llama")
    with _serve(path, None, "llama-tiny", 128) as s:
        yield s


def _ids(s: Served, prompt, max_tokens=6, **kw):
    r = s.client.completions.create(model=s.name, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                    extra_body={"return_token_ids": True, **kw.pop("extra_body", {})}, **kw)
    return r


def _reference(s: Served, prompts, max_new: int):
    """:func:`kimi_jax.generate`'s (tokens, finish reasons) for ``prompts``, padded with filler prompts to a batch
    of 4 so that each model compiles one decode program for all the tests."""
    n = len(prompts)
    r = kimi_jax.generate(s.model, list(prompts) + [[1] * 40] * (4 - n), max_new, stop=s.engine.default_stop_ids(),
                          tokenizer=s.tok)
    return r.tokens[:n], r.finish_reason[:n]


# -- completions: greedy ids equal generate's, several requests in flight ---------------------------------------


@pytest.mark.parametrize("family", [pytest.param("k3", marks=pytest.mark.slow),
                                    pytest.param("kimi_linear", marks=pytest.mark.slow),
                                    pytest.param("k31", marks=pytest.mark.slow), "llama"])
def test_greedy_ids_match_generate(family, request):
    s = request.getfixturevalue(family)
    V = s.engine.cfg.vocab_size
    prompts = [[(7 * i + 3) % V for i in range(n)] for n in (5, 23, 40, 9)]  # 23, 40: prefilled in 16-token chunks
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:  # all in flight at once
        replies = list(pool.map(lambda p: _ids(s, p, 6), prompts))
    for p, r, want, why in zip(prompts, replies, *_reference(s, prompts, 6)):
        c = r.choices[0]
        assert r.prompt_token_ids == p and c.token_ids == want and c.finish_reason == why
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(p), len(want))
        assert r.usage.total_tokens == len(p) + len(want) and r.object == "text_completion" and r.model == s.name
        if s.tok is not None:
            assert c.text == s.tok.decode(want[:-1] if why == "stop" else want)


def test_text_prompt_and_streaming(k3):
    text = "The capital of France is"
    whole = _ids(k3, text, 8)
    assert whole.prompt_token_ids == k3.tok.encode(text)
    (want,), (why,) = _reference(k3, [k3.tok.encode(text)], 8)
    assert whole.choices[0].token_ids == want and whole.choices[0].finish_reason == why
    assert whole.choices[0].text == k3.tok.decode(want[:-1] if why == "stop" else want)
    chunks = list(k3.client.completions.create(model=k3.name, prompt=text, max_tokens=8, temperature=0, stream=True,
                                               stream_options={"include_usage": True},
                                               extra_body={"return_token_ids": True}))
    assert chunks[0].prompt_token_ids == whole.prompt_token_ids
    assert [t for c in chunks if c.choices for t in c.choices[0].token_ids] == whole.choices[0].token_ids
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(whole.choices[0].token_ids)
    assert all(c.usage is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1


def test_stop_strings_and_stop_ids(k3):
    text = "The capital of France is"
    free = _ids(k3, text, 12, extra_body={"ignore_eos": True})
    out = free.choices[0].text
    assert free.choices[0].finish_reason == "length" and len(free.choices[0].token_ids) == 12
    stop = out[3:5]
    cut = _ids(k3, text, 12, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == out[: out.index(stop)] and cut.choices[0].finish_reason == "stop"
    ids = free.choices[0].token_ids
    by_id = _ids(k3, text, 12, extra_body={"stop_token_ids": [ids[2]]})  # besides the default <|end_of_msg|>
    assert by_id.choices[0].token_ids == ids[: ids.index(ids[2]) + 1] and by_id.choices[0].finish_reason == "stop"


def test_logprobs_are_the_chosen_tokens(llama):
    prompt = [5, 6, 7, 8]
    r = llama.client.completions.create(model=llama.name, prompt=prompt, max_tokens=5, temperature=0, logprobs=0,
                                        extra_body={"return_token_ids": True})
    ref = kimi_jax.generate(llama.model, [prompt], 5, stop=llama.engine.default_stop_ids(), record_logits=True)
    logits = ref.logits[0]
    want = [float(row[t] - np.log(np.exp(row - row.max()).sum()) - row.max()) for row, t in zip(logits, ref.tokens[0])]
    lp = r.choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in ref.tokens[0]]
    np.testing.assert_allclose(lp.token_logprobs, want, atol=1e-3)


# -- chat ----------------------------------------------------------------------------------------------------------


def test_chat_matches_generate_and_parse_reply(k3):
    r = k3.client.chat.completions.create(model=k3.name, messages=QUESTION, max_tokens=12, temperature=0,
                                          extra_body={"return_token_ids": True})
    prompt = chat.encode(k3.tok, QUESTION)  # thinking on by default, as the chat module
    assert r.prompt_token_ids == prompt and r.object == "chat.completion"
    ids = r.choices[0].token_ids
    assert ids == _reference(k3, [prompt], 12)[0][0]
    reply = chat.parse_reply(k3.tok, ids)
    msg = r.choices[0].message
    assert (msg.reasoning_content or "", msg.content or "") == (reply.reasoning, reply.content)
    chunks = list(k3.client.chat.completions.create(model=k3.name, messages=QUESTION, max_tokens=12, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == (msg.reasoning_content or "")
    assert "".join(d.content or "" for d in deltas) == (msg.content or "")
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens == len(ids)


def test_chat_thinking_off(k3):
    r = k3.client.chat.completions.create(model=k3.name, messages=QUESTION, max_tokens=4, temperature=0,
                                          extra_body={"return_token_ids": True,
                                                      "chat_template_kwargs": {"thinking": False}})
    assert r.prompt_token_ids == chat.encode(k3.tok, QUESTION, thinking=False)
    reply = chat.parse_reply(k3.tok, r.choices[0].token_ids, thinking=False)
    assert r.choices[0].message.content == reply.content and r.choices[0].message.reasoning_content is None


def _reply_ids(tok, message, thinking=True):
    """Ids a model would generate for ``message`` (the rendered assistant turn after the generation prompt)."""
    def ids(segs):
        return [t for seg in segs for t in ([tok.special_id(seg.text)] if seg.control else tok.encode(seg.text))]
    full = ids(chat.render([message], add_generation_prompt=False, thinking=thinking, thinking_effort=None))
    prefix = ids(chat.render([], thinking=thinking, thinking_effort=None))
    assert full[: len(prefix)] == prefix
    return full[len(prefix):]


TOOL_REPLY = {"role": "assistant", "reasoning_content": "The user wants weather.", "content": "Checking.",
              "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]}


def test_chat_stream_parser(demo_dir):
    tok = load_tokenizer(demo_dir)
    ids = _reply_ids(tok, TOOL_REPLY)
    s = protocol.ChatStream(tok, thinking=True)
    parts = [s.push([t]) for t in ids]
    tail = s.finish()
    assert "".join(p[0] for p in parts) + tail[0] == "The user wants weather."
    assert "".join(p[1] for p in parts) + tail[1] == "Checking."
    (call,) = s.tool_calls()
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}
    s = protocol.ChatStream(tok, thinking=True, stops=["wants"])
    assert s.push(ids) == ("The user ", "") and s.stopped and s.tool_calls() == []


class ScriptedEngine:
    """Replays fixed ids (one event per token) for every request: the HTTP layer's chat split end to end."""

    def __init__(self, demo_dir, ids, error=None):
        from kimi_jax.model import config

        self.tokenizer, self.cfg = load_tokenizer(demo_dir), config.load(demo_dir)
        self.max_len, self.ids, self.error = 512, ids, error
        self.cancelled = []

    def default_stop_ids(self):
        return [self.tokenizer.specials[chat.END_OF_MSG]]

    def submit(self, req):
        h = Handle(req, self.cancelled.append)  # no ids: a request that never ends until cancelled
        for i, t in enumerate(self.ids):
            last = i == len(self.ids) - 1
            h.push(Event([t], [-0.5] if req.logprobs else None, "", "stop" if last else None))
        if self.error:
            h.push(Event([], finish_reason="error", error=self.error))
        return h

    def stop(self, drain=True):
        pass

    def stats(self):
        return {}


def test_chat_reasoning_content_and_tool_calls_over_http(demo_dir):
    tok = load_tokenizer(demo_dir)
    ids = _reply_ids(tok, TOOL_REPLY) + [tok.specials[chat.END_OF_MSG]]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with _running(server.build_app(ScriptedEngine(demo_dir, ids), "scripted")) as port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(model="scripted", messages=QUESTION, tools=tools, logprobs=True)
        msg, c = r.choices[0].message, r.choices[0]
        assert (msg.reasoning_content, msg.content, c.finish_reason) == ("The user wants weather.", "Checking.",
                                                                         "tool_calls")
        assert msg.tool_calls[0].function.name == "get_weather"
        assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris", "days": 3}
        assert [e.logprob for e in c.logprobs.content] == [-0.5] * len(ids)
        chunks = list(client.chat.completions.create(model="scripted", messages=QUESTION, tools=tools, stream=True))
        deltas = [ch.choices[0].delta for ch in chunks]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == msg.reasoning_content
        assert "".join(d.content or "" for d in deltas) == msg.content
        (streamed,) = [tc for d in deltas for tc in d.tool_calls or []]
        assert streamed.index == 0 and streamed.function.arguments == msg.tool_calls[0].function.arguments
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        cut = client.chat.completions.create(model="scripted", messages=QUESTION, stop=["weather"])
        assert (cut.choices[0].message.reasoning_content, cut.choices[0].message.content) == ("The user wants ", "")
        assert cut.choices[0].finish_reason == "stop" and not cut.choices[0].message.tool_calls


def test_engine_failure_is_a_500_and_an_error_event(demo_dir):
    with _running(server.build_app(ScriptedEngine(demo_dir, [], error="device lost"), "scripted")) as port:
        http = Raw(f"http://127.0.0.1:{port}")
        r = http.post("/v1/completions", {"prompt": "hi", "max_tokens": 4})
        assert r.status_code == 500 and "device lost" in r.json()["error"]["message"]
        lines = http.post("/v1/completions", {"prompt": "hi", "stream": True}).text.split("\n\n")
        assert "device lost" in json.loads(lines[0][len("data: "):])["error"]["message"]
        assert lines[1] == "data: [DONE]"
        assert http.get("/v1/models").status_code == 200


def test_a_starting_server_answers_503_with_its_stage(demo_dir):
    """Before its engine is up the server answers: /health 503 ``{"status": "starting"}`` with the stage and the
    program being compiled, every other endpoint 503 saying the same; once the engine is handed over, 200s. (The
    command's start, with a real model compiling: test_serve_command_starts_answered.)"""
    startup = server.Startup()
    app = server.build_app(None, "scripted", startup)
    with _running(app) as port:
        http = Raw(f"http://127.0.0.1:{port}")
        r = http.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "starting" and r.json()["stage"] == "loading"
        startup.set("compiling", "decode step of 1 rows x 4 pages (program 3 of 6)")
        body = http.get("/health").json()
        assert body["detail"] == "decode step of 1 rows x 4 pages (program 3 of 6)" and body["elapsed_s"] >= 0
        for method, path in [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models")]:
            r = http.request(method, path, {"messages": QUESTION, "prompt": "hi"} if method == "POST" else None)
            err = r.json()["error"]
            assert r.status_code == 503 and err["type"] == "service_unavailable", r.text
            assert "the server is starting (compiling: decode step of 1 rows x 4 pages (program 3 of 6)" in \
                err["message"]
        tok = load_tokenizer(demo_dir)
        app.state.server.ready(ScriptedEngine(demo_dir, _reply_ids(tok, TOOL_REPLY)))
        assert http.get("/health").status_code == 200
        assert http.post("/v1/chat/completions", {"messages": QUESTION}).status_code == 200


class Recorder:
    """The app as uvicorn calls it, keeping every exception that escapes it (uvicorn logs each as a crash of the
    application) and counting the HTTP requests it has finished."""

    def __init__(self, app):
        self.app, self.escaped, self.done = app, [], 0

    async def __call__(self, scope, receive, send):
        try:
            await self.app(scope, receive, send)
        except BaseException as e:
            self.escaped.append(e)
            raise
        finally:
            self.done += scope["type"] == "http"


def _until(cond, what, timeout=30):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_faults_are_answered_not_crashes(demo_dir):
    """The fault corpus's leftovers: a body with a 5,000-digit integer or nested 2,000 deep is a 400 naming it; a
    client that gives up waiting for a whole reply, and one that leaves mid-body, end their requests quietly (the
    first cancels its request); nothing escapes the app as an exception."""
    engine = ScriptedEngine(demo_dir, [])
    app = Recorder(server.build_app(engine, "scripted"))
    with _running(app) as port:
        http = Raw(f"http://127.0.0.1:{port}")
        for raw, fragment in [
                (b'{"prompt": [1], "max_tokens": 1' + b"0" * 5000 + b"}", "integer too large to read"),
                (b'{"prompt": [1], "stop": ' + b"[" * 2000 + b"]" * 2000 + b"}", "nests too deeply"),
                (b'{"prompt": [1], "stop": ' + b"[" * 100 + b"]" * 100 + b"}", "nests more than 64 levels"),
                (b'{"prompt": [1], "temperature": 1' + b"0" * 400 + b"}", "temperature: the integer 100000"),
                (b'{"prompt": [1], "top_k": 99999999999999999999}', "top_k: the integer")]:
            r = http.post("/v1/completions", content=raw)
            assert r.status_code == 400 and fragment in r.json()["error"]["message"], (raw[:60], r.text[:300])
        with pytest.raises(TimeoutError):  # gives up on a whole reply
            Raw(http_url := f"http://127.0.0.1:{port}", timeout=0.3).post("/v1/completions",
                                                                          {"prompt": [1, 2], "max_tokens": 4})
        _until(lambda: len(engine.cancelled) == 1, "the abandoned request was not cancelled")
        done = app.done
        with socket.create_connection(("127.0.0.1", port)) as sock:  # leaves mid-body
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"prompt\": [1,")
        _until(lambda: app.done > done, "the half-sent request did not end")
        assert Raw(http_url).get("/v1/models").status_code == 200
    assert app.escaped == [], app.escaped


# -- errors: OpenAI-shaped, the right status, the server keeps answering -------------------------------------------

ERRORS = [
    ({"prompt": [1, 2], "model": "gpt-4"}, 404, "does not exist"),
    ({"prompt": [1, 2], "temperature": -1}, 400, "temperature"),
    ({"prompt": [1, 2], "temperature": "hot"}, 400, "temperature: expected a finite number"),
    ({"prompt": [1, 2], "top_p": 0}, 400, "top_p"),
    ({"prompt": [1, 2], "top_k": -3}, 400, "top_k"),
    ({"prompt": [1, 2], "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": list(range(120)), "max_tokens": 16}, 400, "maximum context length of 128 tokens (max_model_len)"),
    ({"prompt": [1, 100000]}, 400, "outside the vocabulary"),
    ({"prompt": []}, 400, "empty"),
    ({"prompt": "hello"}, 400, "no tokenizer"),
    ({"prompt": [[1, 2], [3, 4]]}, 400, "batch of 2 prompts"),
    ({"prompt": [1, 2], "n": 2}, 400, "n=2"),
    ({"prompt": [1, 2], "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"prompt": [1, 2], "logprobs": 3}, 400, "logprobs=3"),
    ({"prompt": [1, 2], "echo": True}, 400, "echo"),
    ({"prompt": [1, 2], "min_p": 0.1}, 400, "unknown or unsupported field 'min_p'"),
    ({"prompt": [1, 2], "stop": ["x"]}, 400, "stop strings need a tokenizer"),
    ({"prompt": [1, 2], "seed": -1}, 400, "seed"),
    ({"prompt": [1, 2], "speculative": "no"}, 400, "speculative: expected true or false"),
    ({}, 400, "prompt is required"),
]


@pytest.mark.parametrize("body,status,fragment", ERRORS, ids=[f"{e[2]}" for e in ERRORS])
def test_completion_errors(llama, body, status, fragment):
    r = llama.http.post("/v1/completions", {"model": llama.name, **body} if "model" not in body else body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and set(err) == {"message", "type", "param", "code"}
    assert _ids(llama, [1, 2, 3], 2).choices[0].finish_reason in ("stop", "length")  # still serving


def test_other_errors(llama):
    r = llama.http.post("/v1/completions", content=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = llama.http.post("/v1/completions", content=b'{"prompt": [1], "top_p": NaN}')
    assert r.status_code == 400 and "top_p: expected a finite number" in r.json()["error"]["message"]
    assert llama.http.post("/v1/completions", [1, 2]).status_code == 400
    chat_body = {"model": llama.name, "messages": QUESTION}
    r = llama.http.post("/v1/chat/completions", chat_body)
    assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"]
    assert llama.http.get("/v1/nothing").status_code == 404
    assert llama.http.get("/v1/completions").status_code == 405
    with pytest.raises(openai.NotFoundError):
        llama.client.completions.create(model="other", prompt=[1], max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="no tokenizer"):
        llama.client.completions.create(model=llama.name, prompt="hello", max_tokens=1)
    assert [m.id for m in llama.client.models.list()] == [llama.name]
    assert llama.http.get("/health").json()["status"] == "ok"


def test_chat_errors(k3):
    base = {"model": k3.name, "messages": QUESTION, "max_tokens": 2}
    for extra, fragment in [({"messages": [{"role": "robot", "content": "x"}]}, "role"), ({"messages": []}, "messages"),
                            ({"tool_choice": "required"}, "tool_choice"), ({"tools": [{"type": "x"}]}, "tools"),
                            ({"chat_template_kwargs": {"thinking": "yes"}}, "thinking"),
                            ({"response_format": {"type": "json_object"}}, "response_format"),
                            ({"messages": [{"role": "user", "content": "word " * 400}]}, "max_model_len")]:
        r = k3.http.post("/v1/chat/completions", {**base, **extra})
        assert r.status_code == 400 and fragment in r.json()["error"]["message"], (extra, r.text)
    assert k3.http.post("/v1/chat/completions", base).status_code == 200


# -- a client that goes away frees its slot --------------------------------------------------------------------


def _watch_cancels(engine, monkeypatch):
    cancelled = []
    submit = engine.submit

    def watched(req):
        h = submit(req)
        cancel = h.cancel
        h.cancel = lambda: (cancelled.append(h.id), cancel())
        return h

    monkeypatch.setattr(engine, "submit", watched)
    return cancelled


def _idle(engine, timeout=30):
    deadline = time.monotonic() + timeout
    while engine.stats()["slots_busy"] or engine.stats()["waiting"]:
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.02)


def test_disconnect_mid_stream_frees_the_slot(k3, monkeypatch):
    cancelled = _watch_cancels(k3.engine, monkeypatch)
    body = {"model": k3.name, "prompt": [5, 6, 7], "max_tokens": 240, "temperature": 0, "stream": True,
            "ignore_eos": True}
    conn = http.client.HTTPConnection("127.0.0.1", k3.http.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.readline().startswith(b"data: ")
    assert k3.engine.stats()["slots_busy"] == 1
    conn.close()  # mid-stream
    _idle(k3.engine)
    assert len(cancelled) == 1
    with pytest.raises(TimeoutError):  # a whole (non-streamed) reply the client stops waiting for
        Raw(k3.url, timeout=0.3).post("/v1/completions", {**body, "stream": False})
    _idle(k3.engine)
    assert len(cancelled) == 2
    assert _ids(k3, [5, 6, 7], 3).choices[0].token_ids  # and the server goes on


# -- SIGTERM: the command drains what is in flight and exits 0 ----------------------------------------------------


def _serve_command(path, *args):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-c", "import sys; from kimi_jax.cli import main; sys.exit(main())", "serve", "--model",
           path, "--port", "0", *args]
    proc = subprocess.Popen(cmd, cwd=root, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if "serving '" in line:
            return proc, line.split(" on ")[1].split()[0]
    raise AssertionError(f"the server did not come up (exit status {proc.wait()})")


def test_sigterm_drains_and_exits_zero(tmp_path):
    """SIGTERM in the middle of a stream: no new connections, the stream runs to its end, exit status 0."""
    from kimi_jax.checkpoint.synthetic import llama_config_dict

    config = {**llama_config_dict(), "max_position_embeddings": 2048}  # room for a 1000-token stream
    path = write_checkpoint(tmp_path / "llama", "llama", config=config)
    proc, url = _serve_command(path, "--slots", "2", "--max-len", "1024", "--prefill-chunk", "64", "--dtype",
                               "float32", "--log-level", "warning", "--no-compile-cache")
    try:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        stream = iter(client.completions.create(model="llama", prompt=[1, 2, 3], max_tokens=1000, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True, "return_token_ids": True}))
        got = [next(stream)]
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.1)
        with pytest.raises(openai.APIConnectionError):  # the listening socket is closed
            client.models.list()
        got += list(stream)
        assert time.monotonic() - signalled > 0.2  # the stream was still being generated when the signal came
        assert sum(len(c.choices[0].token_ids) for c in got) == 1000 and got[-1].choices[0].finish_reason == "length"
        assert proc.wait(60) == 0
        assert "kimi-jax serve: stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_command_starts_answered_and_chats():
    """``kimi-jax serve`` on the shipped demo model: /health answers 503 "starting" (naming the stage) from the moment
    the port is bound, stderr numbers the programs it compiles, and once up the README's ``openai`` chat example --
    defaults, thinking on, 64 tokens, sampled -- gets a reply with non-empty ``content`` (the demo model is trained on
    K3-format chats: it closes its thinking channel and answers). Was: a connection nobody answered for the whole
    compile."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-c", "import sys; from kimi_jax.cli import main; sys.exit(main())", "serve", "--port", "0",
           "--slots", "1", "--max-len", "512", "--prefill-chunk", "64", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=root, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any("listening on" in x for x in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.05)
        url = next(x for x in lines if "listening on" in x).split(" on ")[1].split()[0]
        http = Raw(url.removesuffix("/v1"), timeout=30)
        seen = []
        deadline = time.monotonic() + 600
        while (r := http.get("/health")).status_code == 503:
            body = r.json()
            assert body["status"] == "starting" and body["model"] == "demo", body
            seen.append(body["stage"])
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        assert r.status_code == 200 and r.json()["status"] == "ok" and seen and seen[0] == "loading", (seen, r.text)
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
        got = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=64)
        print(f"\nthe README's openai example: {got.choices[0].message}")
        message = got.choices[0].message
        assert (message.content or "").strip(), message
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        reader.join(10)
        err = "".join(lines)
        programs = re.findall(r"compiling (.+?) \(program (\d+) of (\d+)\)", err)
        assert programs and programs[0][0] == "prefill of 64 tokens (fresh)" and programs[0][1:] == ("1", programs[0][2])
        assert {int(m) for _, _, m in programs} == {int(programs[0][2])} and int(programs[-1][1]) == int(programs[0][2])
        assert "serving 'demo'" in err and "kimi-jax serve: stopped" in err
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_command_errors(capsys):
    from kimi_jax import cli

    with server.bind("127.0.0.1", 0) as taken:
        port = taken.getsockname()[1]
        taken.listen()
        assert cli.main(["serve", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    assert cli.main(["serve", "--model", "/nonexistent/dir", "--port", "0"]) == 2
    assert "no such model directory" in capsys.readouterr().err
    for argv, fragment in [(["--slots", "0"], "--slots must be >= 1, got 0"),
                           (["--prefill-chunk", "100"], "--prefill-chunk (100) must be a multiple of --page-size (64)"),
                           (["--peer-timeout", "0"], "--peer-timeout must be > 0"),
                           (["--num-processes", "2"], "without --coordinator, --process-id")]:
        assert cli.main(["serve", "--port", "0", *argv]) == 2  # refused before any model loads
        assert fragment in capsys.readouterr().err
