"""Serving benchmark: `kimi-jax serve`'s engine behind its HTTP server, loaded by concurrent streaming clients (the
official ``openai`` client) on loopback, next to static-batch ``generate`` on the same requests.

    python benchmarks/serve.py [--weights DIR] [--clients 32] [--requests 64] [--slots 16] [--dtype float32]
                               [--batch-invariant]

The shared Kimi Linear benchmark model (``benchmarks/configs``; token ids only, it has no tokenizer). Reports:

* **load**: ``--requests`` requests with mixed prompt lengths (32-1024 tokens) and budgets (16-64 new tokens), sent by
  ``--clients`` streaming clients at once: wall time, output tokens/s, time to first token and time per output token
  (p50 / p99), errors, and programs compiled after warm-up (must be 0);
* **static**: the same requests, in the same order, through ``Generator.generate`` in batches of ``--slots`` (each
  batch waits for the previous one; a request's first token comes with its batch's prefill);
* **prefix**: time to first token of a request behind a shared 2048-token system prompt, on a miss (a system prompt
  never seen) and on a hit (the same system prompt, a new question), through the server, medians of 3.
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a CPU benchmark (see decode.py)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
sys.path.insert(0, os.path.dirname(HERE))
from benchmarks.decode import BENCH_CONFIG, build_weights  # noqa: E402

SYSTEM, QUESTION = 2048, 32


def workload(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) per request: prompt lengths log-uniform in 32..1024, budgets 16..64."""
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.uniform(np.log(32), np.log(1024), n)).astype(int)
    return [(rng.integers(3, vocab, int(L)).tolist(), int(rng.integers(16, 65))) for L in lengths]


def start_server(engine, name: str):
    """The app on a free loopback port, uvicorn on a thread. Returns (base url, uvicorn server)."""
    from kimi_jax.serving import server

    sock = server.bind("127.0.0.1", 0)
    srv = server.make_server(server.build_app(engine, name), log_level="warning")
    thread = threading.Thread(target=srv.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.05)
    srv.thread = thread  # joined at the end: its shutdown stops the engine
    return f"http://127.0.0.1:{sock.getsockname()[1]}/v1", srv


def stream_one(client, name: str, prompt: list[int], max_tokens: int) -> dict:
    """One streaming completion; (ttft, tpot, tokens) measured at the client."""
    t0 = time.perf_counter()
    first = last = None
    n = 0
    stream = client.completions.create(model=name, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
                                       extra_body={"return_token_ids": True, "stop_token_ids": [], "ignore_eos": True})
    for chunk in stream:
        got = len(getattr(chunk.choices[0], "token_ids", None) or []) if chunk.choices else 0
        if got:
            now = time.perf_counter()
            first = first or now
            last = now
            n += got
    return {"ttft": first - t0, "tpot": (last - first) / max(n - 1, 1), "tokens": n}


def run_load(url: str, name: str, requests, clients: int) -> dict:
    import openai

    todo: queue.Queue = queue.Queue()
    for r in requests:
        todo.put(r)
    results, errors, lock = [], [], threading.Lock()

    def client_loop():
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
        while True:
            try:
                prompt, budget = todo.get_nowait()
            except queue.Empty:
                return
            try:
                r = stream_one(client, name, prompt, budget)
                with lock:
                    results.append(r)
            except Exception as e:  # noqa: BLE001 - counted and reported
                with lock:
                    errors.append(repr(e))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"wall": wall, "results": results, "errors": errors}


def run_static(model, requests, batch: int, max_len: int) -> dict:
    from kimi_jax.generation.generate import Generator

    gen = Generator(model, max_len=max_len, batch_buckets=(batch,))
    # warm-up: every prompt bucket these requests use, at the batch size
    for T in sorted({next(b for b in gen.prompt_buckets if len(p) <= b) for p, _ in requests}):
        gen.generate([[1] * T] * batch, 2, stop=())
    ttft, tpot, tokens = [], [], 0
    t0 = time.perf_counter()
    for k in range(0, len(requests), batch):
        group = requests[k : k + batch]
        start = time.perf_counter() - t0
        r = gen.generate([p for p, _ in group], [m for _, m in group], stop=())
        steps = max(r.timings["decode_steps"], 1)
        ttft += [start + r.timings["prefill"]] * len(group)
        tpot += [r.timings["decode"] / steps] * len(group)
        tokens += r.timings["new_tokens"]
    return {"wall": time.perf_counter() - t0, "ttft": ttft, "tpot": tpot, "tokens": tokens}


def prefix_ttft(url: str, name: str, vocab: int, repeats: int = 3) -> dict:
    import openai

    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    rng = np.random.default_rng(1)
    ask = lambda prompt: client.completions.create(  # noqa: E731
        model=name, prompt=prompt, max_tokens=1, temperature=0.0, extra_body={"stop_token_ids": []})
    miss, hit = [], []
    for _ in range(repeats):
        system = rng.integers(3, vocab, SYSTEM).tolist()
        for out in (miss, hit):  # first a system prompt never seen, then the same one with a new question
            t0 = time.perf_counter()
            ask(system + rng.integers(3, vocab, QUESTION).tolist())
            out.append(time.perf_counter() - t0)
    return {"miss": statistics.median(miss), "hit": statistics.median(hit)}


def pct(xs, q) -> float:
    return float(np.percentile(np.asarray(xs), q))


def report(load: dict, static: dict, prefix: dict, compiles, warmup_s: float) -> None:
    res = load["results"]
    tok = sum(r["tokens"] for r in res)
    print(f"engine warm-up (compiling every program): {warmup_s:.0f} s; compiles after warm-up: {compiles}")
    print(f"errors: {len(load['errors'])}" + (f" (first: {load['errors'][0]})" if load["errors"] else ""))
    print("| | wall s | output tok/s | TTFT p50 / p99 s | TPOT p50 / p99 ms |")
    print("|---|---|---|---|---|")
    print(f"| server, {len(res)} streaming requests | {load['wall']:.1f} | {tok / load['wall']:.1f} | "
          f"{pct([r['ttft'] for r in res], 50):.2f} / {pct([r['ttft'] for r in res], 99):.2f} | "
          f"{1e3 * pct([r['tpot'] for r in res], 50):.0f} / {1e3 * pct([r['tpot'] for r in res], 99):.0f} |")
    if static:
        print(f"| static generate, same requests | {static['wall']:.1f} | {static['tokens'] / static['wall']:.1f} | "
              f"{pct(static['ttft'], 50):.2f} / {pct(static['ttft'], 99):.2f} | "
              f"{1e3 * pct(static['tpot'], 50):.0f} / {1e3 * pct(static['tpot'], 99):.0f} |")
        print(f"throughput ratio server / static: {(tok / load['wall']) / (static['tokens'] / static['wall']):.2f}x; "
              f"TTFT p50 ratio static / server: {pct(static['ttft'], 50) / pct([r['ttft'] for r in res], 50):.2f}x")
    print(f"prefix: TTFT behind a {SYSTEM}-token system prompt: miss {prefix['miss']:.2f} s, hit {prefix['hit']:.2f} s "
          f"({prefix['miss'] / prefix['hit']:.1f}x)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default=os.path.join(os.path.expanduser("~"), ".cache", "kimi-jax", "kimi-linear-bench"))
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--skip-static", action="store_true")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="the engine's batch-invariant mode (every decode step at full width; serve --batch-invariant)")
    args = ap.parse_args(argv)

    import kimi_jax
    from kimi_jax.serving.engine import Engine

    model = kimi_jax.from_pretrained(build_weights(args.weights, BENCH_CONFIG), dtype=args.dtype, progress=False)
    max_len = SYSTEM + QUESTION + 64 + 64
    engine = Engine(model, None, slots=args.slots, max_len=max_len, prefill_chunk=256, min_chunk=64,
                    batch_invariant=args.batch_invariant)
    t0 = time.perf_counter()
    engine.start()
    warmup_s = time.perf_counter() - t0
    url, srv = start_server(engine, "bench")
    requests = workload(args.requests, model.cfg.vocab_size)
    run_load(url, "bench", workload(4, model.cfg.vocab_size, seed=9), 4)  # the HTTP path warm
    load = run_load(url, "bench", requests, args.clients)
    prefix = prefix_ttft(url, "bench", model.cfg.vocab_size)
    compiles = engine.stats()["compiles_after_warmup"]
    srv.should_exit = True
    srv.thread.join()
    engine.stop()
    static = {} if args.skip_static else run_static(model, requests, args.slots, 1024 + 64)
    report(load, static, prefix, compiles, warmup_s)
    return 0 if not load["errors"] and compiles == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
