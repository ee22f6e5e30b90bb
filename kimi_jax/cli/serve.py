"""``kimi-jax serve``: an OpenAI-compatible HTTP server (:mod:`kimi_jax.serving.server`) over the continuous-batching
engine, for one model directory or the embedded demo model.

The port is bound before the model loads (a taken port fails at once), the engine compiles every program it runs
before the first request is accepted, and SIGTERM drains the requests in flight, then exits with status 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from kimi_jax.cli import generate as generate_cli


def add_serve_arguments(p: argparse.ArgumentParser):
    p.add_argument("--model", help="HF or converted checkpoint directory; 'demo' (the default): the embedded tiny K3")
    p.add_argument("--served-model-name", help="the model's name in the API (default: the directory's base name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (the one taken is printed)")
    p.add_argument("--slots", type=int, default=8, help="sequences decoded together")
    p.add_argument("--max-len", type=int, default=2048, help="prompt + new tokens of one request (cache length)")
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
    generate_cli._dtype_argument(p)
    generate_cli.quantize_argument(p)
    p.add_argument("--no-check-finite", action="store_true",
                   help="load weights holding NaN / Inf instead of refusing them")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    generate_cli._compile_cache_arguments(p)
    p.set_defaults(func=run_serve)


def _name(args, path: str, demo: bool) -> str:
    if args.served_model_name:
        return args.served_model_name
    return "demo" if demo else os.path.basename(os.path.normpath(os.path.abspath(path)))


def run_serve(args):
    generate_cli._setup_compile_cache(args)
    from kimi_jax.serving import server
    from kimi_jax.serving.engine import Engine

    demo = args.model in (None, "demo")
    try:  # before the model: a taken port fails at once
        sock = server.bind(args.host, args.port)
    except OSError as e:
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    try:
        with generate_cli._model_dir(None if demo else args.model) as path:
            model, tok, load_s, dtype = generate_cli._load(path, args.dtype, not args.no_check_finite, args.quantize)
            name = _name(args, path, demo)
            engine = Engine(model, tok, slots=args.slots, max_len=args.max_len, prefill_chunk=args.prefill_chunk,
                            page_size=args.page_size, pages=args.pages,
                            prefix_cache_bytes=int(args.prefix_cache_gb * 1e9),
                            prefix_host_bytes=int(args.prefix_host_gb * 1e9), snapshot_every=args.snapshot_every)
            t0 = time.perf_counter()
            print(f"kimi-jax serve: {name} loaded in {load_s:.1f}s ({dtype}); compiling the engine's programs "
                  f"({args.slots} slots, max_len {args.max_len})...", file=sys.stderr, flush=True)
            engine.start()
            host, port = sock.getsockname()[:2]
            print(f"kimi-jax serve: compiled in {time.perf_counter() - t0:.1f}s; serving {name!r} on "
                  f"http://{host}:{port}/v1 (tokenizer: {'yes' if tok is not None else 'none: token-id prompts only'})",
                  file=sys.stderr, flush=True)
            try:
                server.serve(server.build_app(engine, name), sock, log_level=args.log_level)
            finally:
                engine.stop(drain=False)  # after a graceful shutdown already stopped (a no-op then)
    finally:
        sock.close()
    print("kimi-jax serve: stopped", file=sys.stderr, flush=True)
    return 0
