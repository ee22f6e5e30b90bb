"""The OpenAI-compatible HTTP server (``kimi-jax serve``): a Starlette app over a running
:class:`~kimi_jax.serving.engine.Engine`.

    POST /v1/completions       prompt: text or token ids
    POST /v1/chat/completions  messages in the K3 chat format; reasoning_content / content / tool_calls
    GET  /v1/models            the one served model
    GET  /health               200 while serving (with the engine's stats); 503 while starting (``{"status":
                               "starting", "stage": "loading" | "compiling", "detail", "elapsed_s"}``) and once
                               shutting down

The model runs on the engine's thread. A handler parses the body, tokenizes in a worker thread, submits, and
only awaits the handle's events (:meth:`Handle.aevents`), so the event loop never waits on the model. A client
that goes away -- mid-stream or while waiting for a whole reply -- cancels its request, which frees its slot.
Shutdown (SIGTERM, SIGINT): uvicorn stops accepting connections and waits for the requests in flight, then the
lifespan handler stops the engine with ``drain=True``.

A server can answer before its engine exists (:func:`build_app` without one, :meth:`_Server.ready` when it is up):
``kimi-jax serve`` listens while the model loads and the engine compiles, so a probe learns the server is starting
(503) instead of waiting on a connection nobody answers; every other endpoint answers 503 then too.

Every answer is made inside the endpoints (:func:`_answers`): a refusal is an OpenAI error, a body too deep or
holding an integer past 64 bits a 400 naming it, a client that left (mid-body or while waiting) a 499 nobody reads,
a bug a 500 whose traceback is logged here. Nothing escapes to uvicorn as an exception of the application.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import signal
import socket
import threading
import time

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kimi_jax.serving import protocol
from kimi_jax.serving.engine import EngineError, EngineStopped, Request
from kimi_jax.serving.protocol import Params, ProtocolError
from kimi_jax.serving.validate import max_model_len
from kimi_jax.text import chat, grammar
from kimi_jax.text.grammar import ConstraintError

log = logging.getLogger("kimi_jax.serving.server")
MAX_DEPTH = 64  # JSON nesting a request body may have (the deepest valid one, a tool schema, is far shallower)


class EngineFailure(RuntimeError):
    """The engine failed a request while running it (a bug or a device error): a 500."""


@dataclasses.dataclass
class _Piece:
    """What one engine event adds, after the chat split and chat stop strings."""

    tokens: list[int]
    logprobs: list[float] | None
    reasoning: str
    text: str  # completions: the text; chat: the answer channel
    finish_reason: str | None


async def _pieces(h, stream: protocol.ChatStream | None):
    """The handle's events as :class:`_Piece` s; a chat stop string cancels the request and ends it as "stop"."""
    async for ev in h.aevents():
        if ev.finish_reason == "error":
            raise EngineFailure(getattr(ev, "error", None) or "the engine failed this request")
        if stream is None:
            yield _Piece(list(ev.tokens), ev.logprobs, "", ev.text, ev.finish_reason)
            continue
        before = len(stream.ids)
        reasoning, text = stream.push(ev.tokens)
        used = len(stream.ids) - before  # tokens after a stop string are dropped
        reason = ev.finish_reason
        if stream.stopped:
            h.cancel()
            reason = "stop"
        elif reason is not None:
            more = stream.finish()
            reasoning, text = reasoning + more[0], text + more[1]
        yield _Piece(list(ev.tokens[:used]), None if ev.logprobs is None else list(ev.logprobs[:used]), reasoning,
                     text, reason)
        if reason is not None:
            return


async def _disconnected(request: HTTPRequest) -> None:
    """Returns when the client has gone (the body is read by then: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _parse_body(raw: bytes):
    """The request body as JSON, refused (400) when it is not JSON, nests deeper than :data:`MAX_DEPTH`, or holds
    an integer past 64 bits (Python reads any size, and a 5,000-digit one would fail far from here)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"the request body is not valid JSON ({e})") from None
    except RecursionError:
        raise ProtocolError(f"the request body nests too deeply (at most {MAX_DEPTH} levels)") from None
    except ValueError as e:  # an integer past the interpreter's digit limit (4300)
        raise ProtocolError(f"the request body holds an integer too large to read ({str(e).split(';')[0]})") from None
    todo = [(body, "", 1)]
    while todo:  # iterative: a deep body must not recurse here either
        v, where, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise ProtocolError(f"the request body nests more than {MAX_DEPTH} levels deep (at {where[:60]}...)")
        if isinstance(v, dict):
            todo += [(x, f"{where}.{k}" if where else str(k), depth + 1) for k, x in v.items()]
        elif isinstance(v, list):
            todo += [(x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)]
        elif isinstance(v, int) and not isinstance(v, bool) and not -2**63 <= v < 2**63:
            raise ProtocolError(f"{where or 'the request body'}: the integer {str(v)[:12]}... ({len(str(abs(v)))} "
                                "digits) is out of range (64-bit integers only)",
                                param=where.split(".")[0].split("[")[0] or None)
    return body


def _answers(endpoint):
    """``endpoint`` with every outcome turned into a response here (see the module docstring)."""
    @functools.wraps(endpoint)
    async def run(self, request: HTTPRequest) -> Response:
        try:
            return await endpoint(self, request)
        except ProtocolError as e:
            return JSONResponse(e.body(), status_code=e.status)
        except EngineError as e:
            if isinstance(e, EngineStopped) or self.stopping:
                return JSONResponse(protocol.error_body(str(e), type="service_unavailable"), status_code=503)
            return JSONResponse(protocol.error_body(str(e)), status_code=400)
        except ClientDisconnect:  # left before sending the whole body: nobody reads an answer
            return Response(status_code=499)
        except EngineFailure as e:
            return JSONResponse(protocol.error_body(str(e), type="server_error"), status_code=500)
        except Exception as e:  # noqa: BLE001 - a bug: a 500 for the client, the traceback for the log
            log.exception("%s %s failed", request.method, request.url.path)
            return JSONResponse(protocol.error_body(f"internal error: {type(e).__name__}: {e}", type="server_error"),
                                status_code=500)
    return run


class Startup:
    """What a server without its engine yet is doing, for ``/health`` and the 503s of the other endpoints: the stage
    (``loading``, ``compiling``) and a detail (which program, n of m), set from the thread that starts the engine."""

    def __init__(self):
        self.t0 = time.monotonic()
        self.stage, self.detail = "loading", ""
        self._lock = threading.Lock()

    def set(self, stage: str, detail: str = "") -> None:
        with self._lock:
            self.stage, self.detail = stage, detail

    def body(self) -> dict:
        with self._lock:
            return {"status": "starting", "stage": self.stage, "detail": self.detail,
                    "elapsed_s": round(time.monotonic() - self.t0, 1)}


class _Server:
    def __init__(self, engine, model_name: str, startup: Startup | None = None):
        self.engine, self.name = engine, model_name
        self.startup = startup or Startup()
        self.created = protocol.now()
        self.stopping = False

    def ready(self, engine) -> None:
        """The engine is up (started, compiled): from now on requests go to it."""
        self.engine = engine

    def _starting(self) -> None:
        """Refuse a request while there is no engine yet (503, saying what the start is doing)."""
        if self.engine is None:
            b = self.startup.body()
            raise ProtocolError(f"the server is starting ({b['stage']}{': ' + b['detail'] if b['detail'] else ''}, "
                                f"{b['elapsed_s']:.0f}s so far); retry when GET /health answers 200", status=503,
                                type="service_unavailable")

    # -- plumbing -------------------------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        yield
        self.stopping = True  # uvicorn has drained the connections by now; stop the engine the same way
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop, True)

    async def _params(self, request: HTTPRequest, parse) -> Params:
        self._starting()
        p = parse(_parse_body(await request.body()))
        if p.model is not None and p.model != self.name:
            raise ProtocolError(f"the model {p.model!r} does not exist; this server serves {self.name!r}",
                                status=404, param="model", code="model_not_found")
        if self.stopping:
            raise ProtocolError("the server is shutting down", status=503, type="service_unavailable")
        return p

    def _stop_ids(self, p: Params):
        if p.ignore_eos:
            return p.stop_token_ids
        return (*self.engine.default_stop_ids(), *p.stop_token_ids) if p.stop_token_ids else None

    def _grammar(self, p: Params):
        """``p``'s constraint compiled for this model (cached by constraint), or None; a 400 naming the field when it
        cannot be, before any slot is taken."""
        if p.constraint is None:
            return None
        eng = self.engine
        if eng.tokenizer is None:
            raise ProtocolError(f"{p.constraint_param}: structured outputs need a tokenizer; this model has none",
                                param=p.constraint_param)
        shapes = getattr(eng, "shapes", None)
        if shapes is None or not shapes.structured:
            raise ProtocolError(f"{p.constraint_param}: structured outputs are off on this server (kimi-jax serve "
                                "--structured-outputs on)", param=p.constraint_param, code="unsupported_parameter")
        eos = [eng.tokenizer.special_id(chat.END_OF_MSG)] if p.chat else (self._stop_ids(p) or eng.default_stop_ids())
        try:
            return grammar.compile_grammar(eng.tokenizer, p.constraint, chat_reply=p.chat, thinking=p.thinking,
                                           eos=eos, vocab_size=eng.cfg.vocab_size)
        except ConstraintError as e:
            raise ProtocolError(f"{p.constraint_param}: {e}", param=p.constraint_param) from None

    def _submit(self, p: Params, prompt: list[int], stop_strings, constraint=None):
        eng = self.engine
        stop_ids = self._stop_ids(p)
        max_tokens = p.max_tokens
        if max_tokens is None:  # completions: OpenAI's 16; chat: what the cache (and the context) has left
            room = max_model_len(eng.cfg, eng.max_len) - len(prompt)
            max_tokens = max(1, room) if p.chat else 16
        return eng.submit(Request(prompt=list(prompt), max_tokens=max_tokens, temperature=p.temperature,
                                  top_k=p.top_k, top_p=p.top_p, seed=p.seed, stop_ids=stop_ids,
                                  stop_strings=tuple(stop_strings), logprobs=p.logprobs, constraint=constraint,
                                  speculative=p.speculative))

    def _usage(self, h, n: int) -> dict:
        return protocol.usage(h.prompt_tokens, n, getattr(h, "cached_tokens", 0))

    # -- endpoints ------------------------------------------------------------------------------------------------

    @_answers
    async def completions(self, request: HTTPRequest) -> Response:
        p = await self._params(request, protocol.parse_completion)
        prompt = await asyncio.to_thread(protocol.encode_completion, self.engine.tokenizer, p)
        h = self._submit(p, prompt, p.stop, await asyncio.to_thread(self._grammar, p))
        return await self._respond(request, p, h, prompt, None)

    @_answers
    async def chat_completions(self, request: HTTPRequest) -> Response:
        p = await self._params(request, protocol.parse_chat)
        tok = self.engine.tokenizer
        prompt = await asyncio.to_thread(protocol.encode_chat, tok, p)
        constraint = await asyncio.to_thread(self._grammar, p)
        h = self._submit(p, prompt, (), constraint)  # chat stop strings: matched on the channels' text (ChatStream)
        return await self._respond(request, p, h, prompt, protocol.ChatStream(tok, thinking=p.thinking, stops=p.stop))

    @_answers
    async def models(self, request: HTTPRequest) -> Response:
        self._starting()
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    @_answers
    async def model(self, request: HTTPRequest) -> Response:
        self._starting()
        name = request.path_params["name"]
        if name != self.name:
            raise ProtocolError(f"the model {name!r} does not exist; this server serves {self.name!r}", status=404,
                                param="model", code="model_not_found")
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "kimi-jax",
                "max_model_len": max_model_len(self.engine.cfg, self.engine.max_len)}

    @_answers
    async def health(self, request: HTTPRequest) -> Response:
        if self.engine is None:
            return JSONResponse({**self.startup.body(), "model": self.name}, status_code=503)
        status = "stopping" if self.stopping else "ok"
        return JSONResponse({"status": status, "model": self.name, **self.engine.stats()},
                            status_code=503 if self.stopping else 200)

    # -- answers ----------------------------------------------------------------------------------------------------

    async def _respond(self, request, p: Params, h, prompt, stream) -> Response:
        if p.stream:
            return StreamingResponse(self._events(p, h, prompt, stream), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        gather = asyncio.ensure_future(self._gather(h, stream))
        watch = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({gather, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not gather.done():  # the client left (or this handler was cancelled): free the slot
                gather.cancel()
                h.cancel()
        if not gather.done() or gather.cancelled():  # a cancelled task is done only once it has run again
            return Response(status_code=499)  # nobody reads it
        return JSONResponse(self._whole(p, h, prompt, stream, *gather.result()))

    async def _gather(self, h, stream) -> tuple:
        tokens, logprobs, reasoning, text, reason = [], [], "", "", None
        async for piece in _pieces(h, stream):
            tokens += piece.tokens
            logprobs += piece.logprobs or []
            reasoning, text, reason = reasoning + piece.reasoning, text + piece.text, piece.finish_reason
        return tokens, logprobs, reasoning, text, reason

    def _whole(self, p: Params, h, prompt, stream, tokens, logprobs, reasoning, text, reason) -> dict:
        rid, created, tok = protocol.new_id(p.chat), protocol.now(), self.engine.tokenizer
        use = self._usage(h, len(tokens))
        if not p.chat:
            lp = protocol.completion_logprobs(tok, tokens, logprobs) if p.logprobs else None
            return protocol.completion_response(p, rid, created, self.name, text=text, finish_reason=reason,
                                                token_ids=tokens, prompt_ids=prompt, logprobs=lp, use=use)
        calls = stream.tool_calls()
        if calls and reason == "stop":
            reason = "tool_calls"
        lp = protocol.chat_logprobs(tok, tokens, logprobs) if p.logprobs else None
        return protocol.chat_response(p, rid, created, self.name, message=protocol.chat_message(reasoning, text, calls),
                                      finish_reason=reason, token_ids=tokens, prompt_ids=prompt, logprobs=lp, use=use)

    async def _events(self, p: Params, h, prompt, stream):
        """The server-sent events of a streamed request; a client that goes away cancels the request."""
        rid, created = protocol.new_id(p.chat), protocol.now()
        make = functools.partial(protocol.chat_chunk if p.chat else protocol.completion_chunk, p, rid, created,
                                 self.name)
        first = {"prompt_token_ids": list(prompt)} if p.return_token_ids else {}
        finished, n, sent = False, 0, 0
        try:
            if p.chat:
                yield _sse({**make(delta={"role": "assistant", "content": ""}), **first})
                first = {}
            async for piece in _pieces(h, stream):
                n += len(piece.tokens)
                finished = piece.finish_reason is not None
                for chunk in self._chunks(p, make, stream, piece, sent):
                    yield _sse({**chunk, **first})
                    first = {}
                sent += len(piece.text)
            if p.include_usage:
                yield _sse(protocol.usage_chunk(p, rid, created, self.name, self._usage(h, n)))
        except EngineFailure as e:
            finished = True
            yield _sse(protocol.error_body(str(e), type="server_error"))
        except Exception as e:  # noqa: BLE001 - a bug, after the 200 went out: an error event, the traceback logged
            log.exception("streaming %s failed", rid)
            yield _sse(protocol.error_body(f"internal error: {type(e).__name__}: {e}", type="server_error"))
        finally:
            if not finished:
                h.cancel()
        yield "data: [DONE]\n\n"

    def _chunks(self, p: Params, make, stream, piece: _Piece, sent: int) -> list[dict]:
        tok, reason = self.engine.tokenizer, piece.finish_reason
        if not p.chat:
            lp = protocol.completion_logprobs(tok, piece.tokens, piece.logprobs, sent) if p.logprobs else None
            if not (piece.tokens or piece.text or reason):
                return []
            return [make(text=piece.text, finish_reason=reason, token_ids=piece.tokens, logprobs=lp)]
        lp = protocol.chat_logprobs(tok, piece.tokens, piece.logprobs) if p.logprobs else None
        delta = {k: v for k, v in (("reasoning_content", piece.reasoning), ("content", piece.text)) if v}
        out = []
        if delta or piece.tokens:
            out.append(make(delta=delta, token_ids=piece.tokens, logprobs=lp))
        if reason is not None:
            calls = stream.tool_calls()
            if calls:
                out.append(make(delta={"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}))
                reason = "tool_calls" if reason == "stop" else reason
            out.append(make(delta={}, finish_reason=reason))
        return out


# -- errors ---------------------------------------------------------------------------------------------------------


async def _http_error(request, e: HTTPException) -> Response:
    kind = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    return JSONResponse(protocol.error_body(f"{request.method} {request.url.path}: {e.detail}", code=kind),
                        status_code=e.status_code)


def build_app(engine, model_name: str, startup: Startup | None = None) -> Starlette:
    """The app for a started ``engine``, or (None) for one still starting: ``app.state.server.ready(engine)`` hands
    it over, ``startup`` says meanwhile what the start is doing. Its shutdown stops the engine (draining what is in
    flight)."""
    srv = _Server(engine, model_name, startup)
    routes = [
        Route("/v1/completions", srv.completions, methods=["POST"]),
        Route("/v1/chat/completions", srv.chat_completions, methods=["POST"]),
        Route("/v1/models", srv.models, methods=["GET"]),
        Route("/v1/models/{name:path}", srv.model, methods=["GET"]),
        Route("/health", srv.health, methods=["GET"]),
    ]
    # the endpoints answer everything themselves (_answers); the router's 404 / 405 come here
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error}, lifespan=srv.lifespan)
    app.state.server = srv
    return app


# -- running --------------------------------------------------------------------------------------------------------


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: a free one), so a taken port fails before the model loads;
    connections made before uvicorn runs wait in its backlog."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def make_server(app, *, log_level: str = "info"):
    return uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_keep_alive=5))


def serve(app, sock: socket.socket, *, log_level: str = "info", start=None) -> None:
    """Serve on ``sock`` until SIGINT / SIGTERM; returns after the graceful shutdown (requests in flight finish).

    ``start``: a callable run on a thread of its own while the server already answers (loading the model and
    compiling the engine, then ``app.state.server.ready(engine)``). If it raises, the server shuts down and the
    exception is raised here; a shutdown before it finished leaves it behind (a daemon thread: the process exits)."""
    server = make_server(app, log_level=log_level)
    failed: list[BaseException] = []
    if start is not None:
        def starting():
            try:
                start()
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread, which reports it
                failed.append(e)
                server.should_exit = True
        threading.Thread(target=starting, name="kimi-jax-start", daemon=True).start()
    _run(server, sock)
    if failed:
        raise failed[0]


def _run(server, sock: socket.socket) -> None:
    if threading.current_thread() is not threading.main_thread():
        server.run(sockets=[sock])
        return
    # uvicorn re-raises the signal it caught once it has shut down; a no-op SIGTERM handler lets that land here,
    # so a SIGTERM ends the command normally (exit status 0) instead of killing it mid-cleanup.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
