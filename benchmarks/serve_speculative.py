"""Speculative decoding in the serving engine: the demo model's engine plain vs with the n-gram drafter vs with its
shipped DSpark drafter (on the device beside the model), on chat questions its drafter was not trained on, at 1 and 4
requests in flight.

    python benchmarks/serve_speculative.py [--repeats 3] [--concurrency 1,4] [--new 64] [--dtype float32]

Each engine is built and warmed up once (every program compiled: nothing may compile during the measured runs), then
each repeat sends the same requests (greedy, ``--new`` tokens at most, the chat format's stop ids) through
``Engine.generate`` -- all of a batch in flight together -- to plain, n-gram and DSpark in a rotated order, so all see
the same machine. Reported per concurrency: output tokens/s (new tokens over the wall time, medians), the paired
ratio to plain, the drafts accepted, new tokens per verify forward and slot, and whether the replies equal plain's
(greedy, float32: they must). Results go to ``benchmarks/results/serve_speculative.json`` with the commit.

No peer runs here: the demo model has no GGUF for llama.cpp; ``benchmarks/speculative.py`` runs llama.cpp's prompt
lookup beside ours on the shared benchmark model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
sys.path.insert(0, os.path.dirname(HERE))

# the first 8 of the 64 questions scripts/make_demo_drafter.py holds out (the last of the demo model's training
# conversations: the demo model knows them, its drafter was not trained on them)
QUESTIONS = ["What is timeit.Timer.autorange for?", "Describe the class UserWarning.",
             "Explain sysconfig.expand_makefile_vars().", "What is unittest.case.TestCase.fail for?",
             "Explain random.Random.paretovariate().", "What is logging.handlers.QueueListener?",
             "What does bytes.removesuffix() do?", "Explain sorted()."]


def run(engine, prompts, new: int) -> tuple[float, list, dict]:
    """(new tokens per second, replies' tokens, the engine's speculative counters' change) for one batch."""
    before = engine.stats()
    t0 = time.perf_counter()
    got = engine.generate(prompts, max_tokens=new)
    wall = time.perf_counter() - t0
    after = engine.stats()
    delta = {k: after[k] - before[k] for k in ("spec_steps", "spec_drafted", "spec_accepted", "decode_steps")}
    return sum(len(g.tokens) for g in got) / wall, [g.tokens for g in got], delta


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default=os.path.join(HERE, "results", "serve_speculative.json"))
    args = ap.parse_args(argv)

    import jax

    import kimi_jax
    from kimi_jax.model.config import DEMO_DRAFTER, demo_model_dir
    from kimi_jax.serving.engine import Engine
    from kimi_jax.text import chat
    from kimi_jax.text.tokenizer import load_tokenizer

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    levels = [int(x) for x in args.concurrency.split(",")]
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; jax {jax.__version__}; commit "
          f"{commit}; demo model, {args.dtype}, {args.new} new tokens, median of {args.repeats} paired repeats",
          flush=True)
    path = demo_model_dir()
    model = kimi_jax.from_pretrained(path, dtype=args.dtype, progress=False)
    tok = load_tokenizer(path)
    ids = [chat.encode(tok, [{"role": "user", "content": q}], add_generation_prompt=True) for q in QUESTIONS]
    shapes = dict(slots=max(levels), max_len=max(map(len, ids)) + args.new + 16, page_size=16, prefill_chunk=64,
                  min_chunk=16, prefix_cache_bytes=0)  # no prefix cache: every repeat prefills its prompts
    engines = {}
    for name, spec in (("plain", None), ("ngram", "ngram:k=4"), ("dspark", f"dspark:{DEMO_DRAFTER}")):
        engines[name] = Engine(model, tok, **shapes, speculative=spec)
        t0 = time.perf_counter()
        engines[name].warmup()
        print(f"{name}: warm-up {time.perf_counter() - t0:.1f} s", flush=True)
    from kimi_jax.serving.steps import backend_compiles

    compiled = backend_compiles()
    rows = []
    for c in levels:
        batches = [ids[i:i + c] for i in range(0, len(ids), c)][: max(1, 4 // c)]
        tps = {n: [] for n in engines}
        toks, spec = {}, {n: {} for n in engines}
        for r in range(args.repeats):
            names = list(engines)
            for n in names[r % 3:] + names[: r % 3]:
                rates, out = [], []
                for b in batches:
                    rate, got, delta = run(engines[n], b, args.new)
                    rates.append(rate)
                    out += got
                    for k, v in delta.items():
                        spec[n][k] = spec[n].get(k, 0) + v
                tps[n].append(statistics.mean(rates))
                toks[n] = out
        row = {"concurrency": c, "requests": sum(map(len, batches)), "plain_tok_s": statistics.median(tps["plain"])}
        for n in ("ngram", "dspark"):
            s = spec[n]
            row[n] = {"tok_s": statistics.median(tps[n]),
                      "ratio": statistics.median(a / b for a, b in zip(tps[n], tps["plain"])),
                      "accepted": s["spec_accepted"], "drafted": s["spec_drafted"], "verify_steps": s["spec_steps"],
                      "same_tokens": toks[n] == toks["plain"]}
            print(f"concurrency {c}: plain {row['plain_tok_s']:.1f} tok/s, {n} {row[n]['tok_s']:.1f} tok/s "
                  f"({row[n]['ratio']:.2f}x); accepted {s['spec_accepted']} of {s['spec_drafted']} drafted in "
                  f"{s['spec_steps']} verify steps; same tokens: {row[n]['same_tokens']}", flush=True)
        rows.append(row)
    compiles = backend_compiles() - compiled
    print(f"programs compiled during the measured runs: {compiles}")
    print("\n| in flight | plain tok/s | n-gram tok/s (ratio) | accepted / drafted | DSpark tok/s (ratio) | "
          "accepted / drafted | same tokens (n-gram, DSpark) |\n|---|---|---|---|---|---|---|")
    for r in rows:
        g, d = r["ngram"], r["dspark"]
        print(f"| {r['concurrency']} | {r['plain_tok_s']:.1f} | {g['tok_s']:.1f} ({g['ratio']:.2f}x) | "
              f"{g['accepted']} / {g['drafted']} | {d['tok_s']:.1f} ({d['ratio']:.2f}x) | {d['accepted']} / "
              f"{d['drafted']} | {g['same_tokens']}, {d['same_tokens']} |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"commit": commit, "dtype": args.dtype, "new": args.new, "repeats": args.repeats,
                   "cores": os.cpu_count(), "when": time.strftime("%Y-%m-%d %H:%M"), "compiles_during_runs": compiles,
                   "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
