"""What a JSON-schema constraint costs the serving engine: decode tokens/s at batch 1 and 8 with and without one, and
on an engine with structured outputs off (its programs take no mask).

    python benchmarks/structured.py [--weights DIR] [--new 128] [--repeats 3] [--dtype float32]

The shared Kimi Linear benchmark model (``benchmarks/configs``, vocabulary 32,000) has no tokenizer; constraints are
over text, so this script trains one for it: a byte-level BPE of 32,000 ids (HF ``tokenizers``, on the Python
standard library's sources; deterministic, ~2 s) written as a ``tokenizer.json`` beside the weights. The model's
weights are random, so its choices inside the constraint mean nothing; what is measured is the machinery: the
host's mask per constrained row and step (llguidance), its trip to the device, and the masked sampling.

Each measurement (plain and constrained alternate, ``--repeats`` times; medians): ``B`` requests of the same 64-token prompt (random ids), ``--new`` new tokens each, sampled at
``--temperature`` (1; 0: greedy) with seeds 0..B-1, through an engine with structured outputs on (warm: every program compiled
first); decode tokens/s = tokens after the first / (last finish - first first token). The constraint: an array of
at least 40 ``{"id": integer, "name": string <= 8, "tags": [enum...]}`` objects, long enough that no reply ends
before ``--new`` tokens. Also reported: the host's mask time per token (``Guide.fill``) replayed over a constrained
reply. Writes ``benchmarks/results/structured.json`` with the commit.
"""

from __future__ import annotations

import argparse
import glob
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
from benchmarks.decode import BENCH_CONFIG, build_weights  # noqa: E402

SCHEMA = {"type": "array", "minItems": 40, "items": {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0}, "name": {"type": "string", "maxLength": 8},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue", "urgent", "later"]}, "maxItems": 3}},
    "required": ["id", "name", "tags"], "additionalProperties": False}}


def build_tokenizer(path: str, vocab: int) -> str:
    """A byte-level BPE ``tokenizer.json`` of ``vocab`` ids (``<|end|>`` = id 0, the EOS) in ``path``."""
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    os.makedirs(path, exist_ok=True)
    files = sorted(glob.glob(os.path.join(sys.base_prefix, "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}",
                                          "*.py")))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|end|>"], show_progress=False,
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|end|>"}, f)
    return path


def measure(engine, prompt, B: int, new: int, constraint, temperature: float) -> float:
    """Decode tokens/s of ``B`` requests at once."""
    from kimi_jax.serving.engine import Request

    handles = [engine.submit(Request(prompt=prompt, max_tokens=new, temperature=temperature, seed=i,
                                     constraint=constraint))
               for i in range(B)]
    while not all(h.finished for h in handles):
        engine.step()
    done = [h.result() for h in handles]
    if any(c.finish_reason != "length" for c in done):
        raise RuntimeError(f"a reply ended early: {[c.finish_reason for c in done]}")
    t0 = min(h.timings["first_token"] for h in handles)
    t1 = max(h.timings["finished"] for h in handles)
    return sum(len(c.tokens) - 1 for c in done) / (t1 - t0), done


def mask_time(grammar, tokens) -> float:
    """Seconds per ``Guide.fill`` over a constrained reply's tokens (replayed)."""
    guide, row, times = grammar.guide(), np.zeros((grammar.vocab_words,), np.int32), []
    for t in tokens:
        t0 = time.perf_counter()
        guide.fill(row)
        times.append(time.perf_counter() - t0)
        guide.advance(t)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default=os.path.join(os.path.expanduser("~"), ".cache", "kimi-jax", "kimi-linear-bench"))
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--temperature", type=float, default=1.0, help="0: greedy (no sort in the sampler)")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/structured[_greedy].json")
    args = ap.parse_args(argv)
    args.out = args.out or os.path.join(HERE, "results", f"structured{'' if args.temperature > 0 else '_greedy'}.json")

    import jax

    import kimi_jax
    from kimi_jax.serving.engine import Engine
    from kimi_jax.text.grammar import Constraint, compile_grammar
    from kimi_jax.text.tokenizer import load_tokenizer

    path = build_weights(args.weights, BENCH_CONFIG)
    tok = load_tokenizer(build_tokenizer(os.path.join(args.weights + "-tokenizer"), 32000))
    model = kimi_jax.from_pretrained(path, dtype=args.dtype, progress=False)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; jax {jax.__version__}; "
          f"commit {commit}; {args.dtype}; temperature {args.temperature}; {args.new} new tokens, median of "
          f"{args.repeats}")
    shape = dict(slots=8, max_len=64 + args.new + 64, page_size=64, prefill_chunk=64, min_chunk=64, prefix_cache_bytes=0)
    engine, off = Engine(model, tok, structured=True, **shape), Engine(model, tok, structured=False, **shape)
    for e in (off, engine):  # the structured engine last: its count of compiles after warm-up is then its own
        t0 = time.perf_counter()
        e.warmup()
        print(f"warm-up, structured={e.shapes.structured}: {time.perf_counter() - t0:.0f} s")
    grammar = compile_grammar(tok, Constraint("json", SCHEMA), chat_reply=False, thinking=False, eos=[tok.eos_id],
                              vocab_size=model.cfg.vocab_size)
    prompt = np.random.default_rng(0).integers(1, model.cfg.vocab_size, 64).tolist()
    rows, reply = {}, None
    for B in (1, 8):
        rates = {"off": [], "plain": [], "json_schema": []}
        for _ in range(args.repeats):  # alternating, so that drift in the machine's speed hits all alike
            for name, e, c in (("off", off, None), ("plain", engine, None), ("json_schema", engine, grammar)):
                rate, done = measure(e, prompt, B, args.new, c, args.temperature)
                rates[name].append(rate)
                reply = done[0].tokens if c is not None else reply
        rows.update({f"{name}_b{B}": statistics.median(r) for name, r in rates.items()})
        r = {k: rows[f"{k}_b{B}"] for k in rates}
        print(f"batch {B}: structured off {r['off']:.1f} tok/s; on: unconstrained {r['plain']:.1f} tok/s "
              f"(x{r['plain'] / r['off']:.3f}), json_schema {r['json_schema']:.1f} tok/s "
              f"(x{r['json_schema'] / r['off']:.3f})")
    fill = mask_time(grammar, reply)
    print(f"host mask (Guide.fill) per constrained row and token: median {fill * 1e3:.3f} ms "
          f"(vocabulary {tok.vocab_size}); compiles after warm-up: {engine.stats()['compiles_after_warmup']}")
    with open(args.out, "w") as f:
        json.dump({"commit": commit, "dtype": args.dtype, "temperature": args.temperature, "new": args.new,
                   "repeats": args.repeats,
                   "tokens_per_s": rows, "json_vs_off_b1": rows["json_schema_b1"] / rows["off_b1"],
                   "json_vs_off_b8": rows["json_schema_b8"] / rows["off_b8"], "mask_ms_median": fill * 1e3,
                   "cpu_count": os.cpu_count(), "compiles_after_warmup": engine.stats()["compiles_after_warmup"]},
                  f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
