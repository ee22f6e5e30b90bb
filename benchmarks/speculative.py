"""Speculative decoding benchmark: plain vs prompt-lookup (n-gram) decoding, on the demo model and the shared Kimi
Linear benchmark model, batch 1 and 8, on a prompt whose answer repeats its input and on free text.

    python benchmarks/speculative.py [--repeats 3] [--models demo,bench] [--batches 1,8] [--new 64]

Each repeat runs plain then speculative (alternating which goes first) on the same batch with the same greedy
settings, so both see the same machine; the table gives medians of the paired tokens/s, the ratio, the acceptance
(drafted tokens accepted, and new tokens per verify forward) and whether the speculative tokens equal the plain ones
(greedy: in float32 they must; in bfloat16 a multi-position forward rounds differently from a one-position step, so
an argmax between two near-equal logits can flip, as it can between batch sizes). Results go to
``benchmarks/results/speculative.json`` with the commit.

* ``demo``: the shipped demo model (``kimi_jax/assets/k3-demo``, a small K3 trained on Python's documentation), text
  prompts: *repeat* asks for a function to be rewritten with a new name after showing it (a code-editing prompt
  whose answer copies most of its input), *free* is a documentation sentence to continue.
* ``bench``: the shared benchmark model (``benchmarks/configs/kimi-linear-bench.md``; random weights built by
  transformers, as ``benchmarks/decode.py`` builds them), token ids: *repeat* is a random 64-id block four times,
  *free* random ids. Random weights do not continue a repetition, so this row measures what speculation costs when
  it cannot help.

The peer (llama.cpp's ``llama-lookup`` on the same prompts) is not run yet: the llama.cpp build the decode
benchmarks compare against has only llama.cpp's benchmark tools.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
sys.path.insert(0, os.path.dirname(HERE))

CODE = '''def count_words(text):
    """Return a dictionary mapping each word of text to the number of times it occurs."""
    counts = {}
    for word in text.split():
        word = word.strip(".,;:!?").lower()
        if word:
            counts[word] = counts.get(word, 0) + 1
    return counts
'''
REPEAT_TEXT = f"Rename the function count_words to word_frequencies and change nothing else.\n\n{CODE}\nResult:\n\n"
FREE_TEXT = "The for statement is used to iterate over the elements of a sequence"


def prompts(model_name: str, kind: str, batch: int):
    if model_name == "demo":
        return [REPEAT_TEXT if kind == "repeat" else FREE_TEXT] * batch
    rng = np.random.default_rng(0)
    if kind == "repeat":
        return [np.tile(rng.integers(3, 32000, 64), 4).tolist() for _ in range(batch)]
    return [rng.integers(3, 32000, 256).tolist() for _ in range(batch)]


def run_once(gen, ps, new: int, speculative):
    r = gen.generate(ps, new, stop=(), speculative=speculative)
    toks = sum(len(t) for t in r.tokens) - len(ps)  # the first new token of each comes from the prefill
    return toks / r.timings["decode"], r


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="demo,bench")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new", type=int, default=64, help="new tokens per sequence")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--spec", default="ngram:k=4", help="the drafter (generate's speculative=)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="default: from_pretrained's automatic choice (bfloat16)")
    ap.add_argument("--weights", default=os.path.join(os.path.expanduser("~"), ".cache", "kimi-jax", "kimi-linear-bench"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "speculative.json"))
    args = ap.parse_args(argv)

    import jax

    import kimi_jax
    from kimi_jax.generation.generate import Generator
    from kimi_jax.model.config import demo_model_dir
    from kimi_jax.text.tokenizer import load_tokenizer

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} cores, load average {load[0]:.2f}; jax {jax.__version__}; commit {commit}; "
          f"{args.spec}, {args.new} new tokens, dtype {args.dtype or 'automatic'}, median of {args.repeats} paired "
          f"repeats", flush=True)
    rows = []
    for name in args.models.split(","):
        if name == "demo":
            path, tok = demo_model_dir(), True
        elif name == "bench":
            import importlib.util

            spec = importlib.util.spec_from_file_location("bench_decode", os.path.join(HERE, "decode.py"))
            decode = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(decode)  # benchmarks/decode.py builds the weights
            path, tok = decode.build_weights(args.weights, decode.BENCH_CONFIG), False
        else:
            raise SystemExit(f"--models: unknown {name!r} (demo, bench)")
        model = kimi_jax.from_pretrained(path, dtype=args.dtype, progress=False)
        tokenizer = load_tokenizer(path) if tok else None
        for kind in ("repeat", "free"):
            for b in (int(x) for x in args.batches.split(",")):
                ps = prompts(name, kind, b)
                longest = max(len(tokenizer.encode(p)) if tokenizer else len(p) for p in ps)
                gen = Generator(model, tokenizer, max_len=longest + args.new + 16)
                run_once(gen, ps, args.new, None)  # compile both
                run_once(gen, ps, args.new, args.spec)
                plain, spec, stats, same = [], [], None, True
                for r in range(args.repeats):
                    order = [None, args.spec] if r % 2 == 0 else [args.spec, None]
                    for s in order:
                        tps, res = run_once(gen, ps, args.new, s)
                        (spec if s else plain).append(tps)
                        if s:
                            stats, spec_tokens = res.timings["speculative"], res.tokens
                        else:
                            plain_tokens = res.tokens
                    same &= spec_tokens == plain_tokens
                ratio = statistics.median(s / p for s, p in zip(spec, plain))
                row = {"model": name, "prompt": kind, "batch": b, "plain_tok_s": statistics.median(plain),
                       "spec_tok_s": statistics.median(spec), "ratio": ratio,
                       "accepted": stats["accepted"], "drafted": stats["drafted"],
                       "tokens_per_step": stats["tokens_per_step"], "same_tokens": bool(same)}
                rows.append(row)
                print(f"{name:5s} {kind:6s} b={b}: plain {row['plain_tok_s']:7.1f} tok/s, {args.spec} "
                      f"{row['spec_tok_s']:7.1f} tok/s ({ratio:.2f}x); accepted {stats['accepted']} of "
                      f"{stats['drafted']} drafted, {stats['tokens_per_step']:.2f} tokens per step; "
                      f"same tokens: {same}", flush=True)
    print("\n| model | prompt | batch | plain tok/s | n-gram tok/s | ratio | accepted / drafted | tokens per step | "
          "same tokens |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['prompt']} | {r['batch']} | {r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} | "
              f"{r['ratio']:.2f}x | {r['accepted']} / {r['drafted']} | {r['tokens_per_step']:.2f} | "
              f"{r['same_tokens']} |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"commit": commit, "spec": args.spec, "dtype": args.dtype or "automatic", "new": args.new, "repeats": args.repeats,
                   "cores": os.cpu_count(), "load_average": load[0], "when": time.strftime("%Y-%m-%d %H:%M"),
                   "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
