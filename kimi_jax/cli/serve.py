"""``kimi-jax serve``: an OpenAI-compatible HTTP server (:mod:`kimi_jax.serving.server`) over the continuous-batching
engine, for one model directory or the embedded demo model; on one device, a mesh, or a mesh over several processes.

The port is bound and answered before the model loads (a taken port fails at once): while the model loads and the
engine compiles every program it runs, ``/health`` answers 503 ``{"status": "starting", ...}`` naming the program
being compiled (n of m) and every other endpoint 503; stderr says the same. SIGTERM drains the requests in flight,
then exits with status 0.

On several processes (``--coordinator HOST:PORT --num-processes N --process-id I``, the same command on every host,
``--mesh`` over all their devices) process 0 binds the port, schedules and answers; the others bind nothing and
apply process 0's plans (:mod:`kimi_jax.serving.multihost`). SIGTERM to process 0 drains and stops them all with
status 0; a SIGTERM that reaches the others too (a job manager stopping every pod) waits for process 0's stop. A
process that dies or stops answering for ``--peer-timeout`` seconds ends every other with status 1, naming it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import jax

from kimi_jax.cli import common, progress
from kimi_jax.generation import speculative
from kimi_jax.serving import server, validate
from kimi_jax.serving.engine import Engine


def add_serve_arguments(p: argparse.ArgumentParser):
    p.formatter_class = common.HelpFormatter
    p.add_argument("--model", help="HF or converted checkpoint directory; 'demo' (the default): the shipped demo model")
    p.add_argument("--served-model-name", help="the model's name in the API (default: the directory's base name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port; 0: any free port (the one taken is printed)")
    p.add_argument("--slots", type=int, default=8, help="sequences decoded together")
    p.add_argument("--max-len", type=int, default=2048,
                   help="prompt + new tokens of one request (the cache length; the model's context, when shorter, "
                        "sets the limit instead)")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="longest prefill step (a multiple of the 64-token page): shorter keeps other streams "
                        "flowing during a long prompt")
    p.add_argument("--page-size", type=int, default=64, help="tokens per page of the attention cache")
    p.add_argument("--pages", type=int, default=None,
                   help="pages in the pool (default: every slot at --max-len, plus half again for the prefix cache)")
    p.add_argument("--prefix-cache-gb", type=float, default=1.0,
                   help="device memory for prefix snapshots (KDA state); 0 with --prefix-host-gb 0 turns prefix "
                        "caching off")
    p.add_argument("--prefix-host-gb", type=float, default=0.0,
                   help="host memory snapshots spill to when the device budget is full")
    p.add_argument("--snapshot-every", type=int, default=None,
                   help="tokens between snapshots inside a prompt (a multiple of --prefill-chunk; default: each chunk)")
    common.dtype_argument(p)
    common.quantize_argument(p)
    common.kv_cache_argument(p)
    p.add_argument("--no-check-finite", action="store_true",
                   help="load weights holding NaN / Inf instead of refusing them")
    p.add_argument("--speculative", default=None, metavar="SPEC",
                   help="speculative decoding: 'ngram[:k=4,max_n=3,min_n=1]' drafts each reply's next tokens from its "
                        "prompt and reply so far; 'dspark:PATH[,k=N]' runs a DSpark drafter (the released k3_dspark "
                        "layout; 'dspark:demo': the one shipped for the demo model) on the device beside the model; "
                        "'draft:PATH[,k=N]' a smaller model of the family (same vocabulary) with its own paged cache; "
                        "a step where some request drafted checks every slot's drafts in one forward (greedy replies "
                        "unchanged; default: off)")
    p.add_argument("--structured-outputs", choices=["auto", "on", "off"], default="auto",
                   help="constrained decoding (response_format, a forced tool_choice, structured_outputs): every "
                        "compiled step takes a token bitmask per row; auto (default): on when the model has a "
                        "tokenizer")
    p.add_argument("--batch-invariant", action="store_true",
                   help="each request's output independent of the others in flight (one decode program over every "
                        "slot and the whole page table; prefix hits on chunk boundaries only): greedy replies are the "
                        "same alone or under load in bfloat16 too, at the cost of full-width decode steps")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (its access log at info)")
    common.compile_cache_arguments(p)
    common.parallel_arguments(p)
    common.scan_argument(p)
    p.add_argument("--peer-timeout", type=float, default=20.0, metavar="SECONDS",
                   help="on several processes: a process silent this long counts as gone (every other exits 1)")
    p.set_defaults(func=run_serve)


def _name(args, path: str, demo: bool) -> str:
    if args.served_model_name:
        return args.served_model_name
    return "demo" if demo else os.path.basename(os.path.normpath(os.path.abspath(path)))


def _say(text: str) -> None:
    print(f"kimi-jax serve: {text}", file=sys.stderr, flush=True)


def run_serve(args):
    # the port, the engine's shapes and the fault timeout refused before anything starts or loads
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port}: a TCP port is 0 to 65535 (0: any free port)")
    with common.flag_names():
        validate.shapes(slots=args.slots, max_len=args.max_len, page_size=args.page_size, pages=args.pages,
                        prefill_chunk=args.prefill_chunk, min_chunk=64, snapshot_every=args.snapshot_every,
                        compact_decode=True, batch_invariant=args.batch_invariant)
    if not args.peer_timeout > 0:
        raise ValueError(f"--peer-timeout must be > 0 seconds, got {args.peer_timeout}")
    if args.speculative:
        speculative.check(args.speculative)  # a wrong spec is named before anything loads
    common.setup_compile_cache(args)
    common.setup_processes(args)

    demo = args.model in (None, "demo")
    lead, where = common.leader(), ""
    if jax.process_count() > 1:
        where = f"process {jax.process_index()} of {jax.process_count()}: "
    sock = None
    if lead:
        try:  # before the model: a taken port fails at once
            sock = server.bind(args.host, args.port)
        except OSError as e:
            raise ValueError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    try:
        with common.model_dir(None if demo else args.model) as path:
            name = _name(args, path, demo)
            if not lead:
                _follow(lambda: _start_engine(args, path, name, where, None), where)
                return 0
            host, port = sock.getsockname()[:2]
            startup = server.Startup()
            app = server.build_app(None, name, startup)
            _say(f"listening on http://{host}:{port}/v1 (GET /health answers 503 until the model is loaded and "
                 "compiled)")

            def start():
                engine = _start_engine(args, path, name, where, startup)
                app.state.server.ready(engine)
                _say(f"serving {name!r} on http://{host}:{port}/v1 (tokenizer: "
                     f"{'yes' if engine.tokenizer is not None else 'none: token-id prompts only'})")

            try:
                server.serve(app, sock, log_level=args.log_level, start=start)
            finally:
                if app.state.server.engine is not None:
                    app.state.server.engine.stop(drain=False)  # after a graceful shutdown already stopped (a no-op)
    finally:
        if sock is not None:
            sock.close()
    _say(f"{where}stopped")
    return 0


def _structured(args, tokenizer) -> bool:
    if args.structured_outputs == "on" and tokenizer is None:
        raise ValueError("--structured-outputs on: the model has no tokenizer (constraints are over its text)")
    return args.structured_outputs == "on" or (args.structured_outputs == "auto" and tokenizer is not None)


def _start_engine(args, path: str, name: str, where: str, startup):
    """Load the model, build the engine and compile its programs, saying so on stderr (and on ``startup``, what
    ``/health`` reports); process 0's engine is started (its thread runs), the others' only compiled."""
    dtype = common.resolve_dtype(args.dtype)
    mesh = common.make_mesh(args, path, batch=args.slots, context=args.max_len, dtype=dtype, quantize=args.quantize)
    got = common.load_model(path, dtype, not args.no_check_finite, args.quantize, mesh=mesh, layout=args.layout,
                            scan_layers=args.scan_layers)
    with common.flag_names():
        engine = Engine(got.model, got.tokenizer, slots=args.slots, max_len=args.max_len,
                        prefill_chunk=args.prefill_chunk, page_size=args.page_size, pages=args.pages,
                        prefix_cache_bytes=int(args.prefix_cache_gb * 1e9),
                        prefix_host_bytes=int(args.prefix_host_gb * 1e9), snapshot_every=args.snapshot_every,
                        batch_invariant=args.batch_invariant, peer_timeout=args.peer_timeout,
                        speculative=args.speculative, structured=_structured(args, got.tokenizer),
                        kv_cache=args.kv_cache)
    on = "one device" if mesh is None else ",".join(f"{k}={v}" for k, v in mesh.shape.items())
    _say(f"{where}{name} loaded in {got.seconds:.1f}s ({dtype}, {on}); compiling the engine's programs "
         f"({args.slots} slots, max_len {args.max_len})")
    status = progress.Status(f"kimi-jax serve: {where}")
    t0 = time.perf_counter()

    def compiling(what: str, n: int, m: int):
        status.set(f"compiling {what} (program {n} of {m})...")
        if startup is not None:
            startup.set("compiling", f"{what} (program {n} of {m})")

    try:
        engine.warmup(progress=compiling)
    finally:
        status.close()
    if startup is not None:
        engine.start(warmup=False)
    _say(f"{where}compiled in {time.perf_counter() - t0:.1f}s")
    return engine


def _follow(make_engine, where: str) -> None:
    """A process other than 0: compile (``make_engine()``: :func:`_start_engine`), then apply process 0's plans
    until it stops. A SIGTERM here (a job manager stopping every host at once) waits for process 0, which drains its
    requests and then stops everyone."""
    def wait_for_process_0(*_):
        _say(f"{where}SIGTERM: waiting for process 0 to drain and stop")

    previous = signal.signal(signal.SIGTERM, wait_for_process_0)
    try:
        engine = make_engine()
        _say(f"{where}following process 0")
        engine.follow(warmup=False)
    finally:
        signal.signal(signal.SIGTERM, previous)
    _say(f"{where}stopped")
