"""Speculative decoding benchmark: plain vs prompt-lookup (n-gram) vs DSpark-drafter decoding, on the demo model and
the shared Kimi Linear benchmark model, batch 1 and 8, on prompts whose answer repeats their input and on free text.

    python benchmarks/speculative.py [--repeats 5] [--prompts 8] [--models demo,bench] [--batches 1,8] [--new 64]
                                     [--dspark PATH] [--llamacpp DIR]

The DSpark column runs the drafter trained for the demo model (``kimi_jax/assets/k3-demo-dspark``,
``scripts/make_demo_drafter.py``) on the demo rows; the benchmark model has random weights and no drafter (a drafter
is trained for one target), so its rows have none.

A row is ``--prompts`` different prompts (8): at batch 1 one request each, at batch 8 one request of all of them
(what one prompt shows is a thin sample: a drafter's acceptance, and with it the pacing's choice, moves from prompt to
prompt). Each repeat runs the row's requests plain then with each drafter (the order rotated), so all see the same
machine; the table gives medians of the paired tokens/s (all the row's new tokens over all its decode time), the
ratio, the acceptance (drafted tokens accepted, new tokens per loop step in the requests that drafted, and how many
requests drafted past the pacing's measure) and whether the speculative tokens equal the plain ones (greedy: in
float32 they must; in bfloat16 a multi-position forward rounds differently from a one-position step, so an argmax
between two near-equal logits can flip, as it can between batch sizes). Results go to
``benchmarks/results/speculative.json`` with the commit.

* ``demo``: the shipped demo model (``kimi_jax/assets/k3-demo``, a small K3 trained on Python's documentation), text
  prompts: *repeat* asks for a function to be rewritten with a new name after showing it (code-editing prompts
  whose answer copies most of their input; ``FUNCTIONS``), *free* are documentation sentences to continue.
* ``bench``: the shared benchmark model (``benchmarks/configs/kimi-linear-bench.md``; random weights built by
  transformers, as ``benchmarks/decode.py`` builds them), token ids: *repeat* a random 64-id block four times, *free*
  256 random ids (each prompt its own draw). Random weights do not continue a repetition, so this row measures what
  speculation costs when it cannot help. The ids are drawn from the two-letter tokens "xy" with x < y of the
  synthetic byte-level BPE vocabulary that the model's GGUF files carry (``PAIR_IDS``), so their text tokenizes back
  to exactly these ids and llama.cpp, which takes text, decodes the same prompt.

The peer: llama.cpp's prompt lookup (``llama-lookup``, n-gram drafts of up to ``--draft`` = 4 tokens from the prompt
and what was generated, as ours) on the benchmark model's batch-1 prompts, greedy (``--temp 0``), the same number of
new tokens, and its plain decoding as the same program with no drafts (``--spec-draft-n-max 0``), paired and
alternated as ours over the same prompts, medians of ``--repeats``; its tokens/s are the tokens after the first over
the decode time it prints (as ours), acceptance its ``n_accept`` / ``n_drafted``; ``llama-bench -p 0 -n NEW-1 -d
PROMPT`` (the first prompt's length) is run too as a cross-check of the plain speed. ``llama-lookup`` decodes one
sequence, so batch 8 has no peer. llama.cpp is found through ``--llamacpp DIR`` or the ``KIMI_JAX_LLAMACPP``
environment variable: a llama.cpp build (DIR holding ``llama-lookup``, or its ``build/bin``, or a folder holding the
build as ``llama_cpp_python-*/vendor/llama.cpp/build/bin``) with the benchmark model's GGUF as ``DIR/bench-f16.gguf``
(bfloat16 runs) or ``DIR/bench-f32.gguf`` (float32), or ``--gguf FILE``. Without them the peer is skipped with the
reason printed. The demo model has no GGUF, so it has no peer.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
sys.path.insert(0, os.path.dirname(HERE))

# The demo's prompts: functions to rename (the answer would copy each one) and documentation openings to continue
FUNCTIONS = [
    ("count_words", "word_frequencies", '''def count_words(text):
    """Return a dictionary mapping each word of text to the number of times it occurs."""
    counts = {}
    for word in text.split():
        word = word.strip(".,;:!?").lower()
        if word:
            counts[word] = counts.get(word, 0) + 1
    return counts
'''),
    ("read_lines", "load_lines", '''def read_lines(path, encoding="utf-8"):
    """Return the lines of the file at path without their line endings, skipping blank lines."""
    lines = []
    with open(path, encoding=encoding) as f:
        for line in f:
            line = line.rstrip("\\n")
            if line.strip():
                lines.append(line)
    return lines
'''),
    ("flatten", "flatten_list", '''def flatten(items):
    """Return a list of the elements of items, with nested lists and tuples expanded in order."""
    result = []
    for item in items:
        if isinstance(item, (list, tuple)):
            result.extend(flatten(item))
        else:
            result.append(item)
    return result
'''),
    ("parse_pairs", "parse_settings", '''def parse_pairs(text):
    """Return a dictionary of the key=value pairs in text, one pair per line; lines starting with # are ignored."""
    pairs = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition("=")
        pairs[key.strip()] = value.strip()
    return pairs
'''),
    ("chunks", "batched", '''def chunks(sequence, size):
    """Return a list of the consecutive slices of sequence of the given size (the last one may be shorter)."""
    if size < 1:
        raise ValueError("size must be at least 1")
    result = []
    for start in range(0, len(sequence), size):
        result.append(sequence[start:start + size])
    return result
'''),
    ("merge_dicts", "combine_dicts", '''def merge_dicts(first, second):
    """Return a new dictionary with the items of first and second; the values of second win."""
    merged = dict(first)
    for key, value in second.items():
        merged[key] = value
    return merged
'''),
    ("is_palindrome", "reads_the_same_backwards", '''def is_palindrome(text):
    """Return True if text reads the same forwards and backwards, ignoring case and spaces."""
    letters = [c.lower() for c in text if not c.isspace()]
    return letters == letters[::-1]
'''),
    ("average", "mean_value", '''def average(numbers):
    """Return the arithmetic mean of numbers, or None for an empty sequence."""
    numbers = list(numbers)
    if not numbers:
        return None
    total = 0
    for number in numbers:
        total += number
    return total / len(numbers)
'''),
]
REPEAT_TEXTS = [f"Rename the function {old} to {new} and change nothing else.\n\n{code}\nResult:\n\n"
                for old, new, code in FUNCTIONS]
FREE_TEXTS = [
    "The for statement is used to iterate over the elements of a sequence",
    "The while statement is used for repeated execution as long as an expression is true",
    "A class definition defines a class object",
    "The import statement",
    "The with statement is used to wrap the execution of a block",
    "The try statement specifies exception handlers",
    "A function definition defines a user-defined function object",
    "The if statement is used for conditional execution",
]
LLAMACPP_ENV = "KIMI_JAX_LLAMACPP"

# The benchmark model's GGUF vocabulary (made for llama.cpp's converter, as the model has no tokenizer): 0-2
# specials, 3..258 the 256 bytes, then 259 + 256 * a + b for the byte pair a, b (a < 124), merged in that order. A run
# of pairs "xy" with x < y, all letters, tokenizes back to exactly those pairs: one pre-token (letters only), and the
# merge across a pair's right edge (y, next x) ranks below the pair's own (x < y), so it never comes first.
LETTERS = [*range(65, 91), *range(97, 123)]
PAIR_IDS = np.array([259 + 256 * a + b for a in LETTERS for b in LETTERS if a < b])


def pair_text(ids) -> str:
    return "".join(chr((i - 259) // 256) + chr((i - 259) % 256) for i in ids)


def prompts(model_name: str, kind: str, n: int) -> list:
    """``n`` different prompts of a row (the demo's texts, or the benchmark model's ids, a set of ``n`` per kind)."""
    if model_name == "demo":
        pool = REPEAT_TEXTS if kind == "repeat" else FREE_TEXTS
        return [pool[i % len(pool)] for i in range(n)]
    rng = np.random.default_rng(0 if kind == "repeat" else 1)
    if kind == "repeat":
        return [np.tile(rng.choice(PAIR_IDS, 64), 4).tolist() for _ in range(n)]
    return [rng.choice(PAIR_IDS, 256).tolist() for _ in range(n)]


def batches(ps: list, b: int) -> list[list]:
    """``ps`` as requests of ``b`` prompts each (every prompt at least once; the last batch filled from the start)."""
    return [[ps[(i + j) % len(ps)] for j in range(b)] for i in range(0, len(ps), b)]


def run_set(gen, requests: list[list], new: int, speculative) -> tuple[int, float, list, list]:
    """Every request of a row with one setting: (tokens after each sequence's first, decode seconds, the tokens,
    each request's ``timings["speculative"]``)."""
    toks, seconds, tokens, stats = 0, 0.0, [], []
    for ps in requests:
        r = gen.generate(ps, new, stop=(), speculative=speculative)
        toks += sum(len(t) for t in r.tokens) - len(ps)  # the first new token of each comes from the prefill
        seconds += r.timings["decode"]
        tokens.append(r.tokens)
        stats.append(r.timings.get("speculative"))
    return toks, seconds, tokens, stats


def find_llamacpp(root: str | None, gguf: str | None, dtype: str | None):
    """(llama-lookup's folder, the GGUF file, None), or (None, None, why not)."""
    if not root:
        return None, None, f"no llama.cpp given (--llamacpp DIR or {LLAMACPP_ENV})"
    root = os.path.abspath(os.path.expanduser(root))
    bins = [root, os.path.join(root, "build", "bin"),
            *sorted(glob.glob(os.path.join(root, "llama_cpp_python-*", "vendor", "llama.cpp", "build", "bin")))]
    bin_dir = next((b for b in bins if os.access(os.path.join(b, "llama-lookup"), os.X_OK)), None)
    if bin_dir is None:
        return None, None, (f"no llama-lookup under {root} (build it: cmake --build BUILD --target llama-lookup "
                            f"llama-tokenize)")
    gguf = gguf or os.path.join(root, "bench-f32.gguf" if dtype == "float32" else "bench-f16.gguf")
    if not os.path.isfile(gguf):
        return None, None, f"no GGUF file {gguf} (--gguf FILE)"
    return bin_dir, gguf, None


def llamacpp_once(bin_dir: str, gguf: str, text: str, new: int, draft: int, threads: int, ctx: int) -> dict:
    """One ``llama-lookup`` run, greedy, ``new`` tokens in all (the first one from the prompt's forward); draft 0 is
    plain decoding. tok_s: the tokens after the first over the decode time, as ours."""
    cmd = [os.path.join(bin_dir, "llama-lookup"), "-m", gguf, "-t", str(threads), "-tb", str(threads), "-c", str(ctx),
           "-n", str(new - 1), "--temp", "0", "--seed", "0", "--ignore-eos", "--spec-draft-n-max", str(draft),
           "-p", text]
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, errors="replace")
    out = p.stdout + p.stderr
    dec = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", out)
    if p.returncode or not dec:
        raise RuntimeError(f"llama-lookup failed ({p.returncode}): {' '.join(cmd[:-1])} ...\n{out[-2000:]}")
    n, t = int(dec.group(1)), float(dec.group(2))
    num = {k: int(re.search(rf"{k}\s+=\s+(\d+)", out).group(1)) for k in ("n_drafted", "n_accept")}
    return {"tok_s": (n - 1) / t, "predicted": n, "drafted": num["n_drafted"], "accepted": num["n_accept"],
            "prompt_tokens": int(re.search(r"encoded\s+(\d+) tokens", out).group(1))}


def llamacpp_tokenize(bin_dir: str, gguf: str, text: str):
    """The ids llama.cpp makes of ``text`` (``llama-tokenize``, as ``llama-lookup`` tokenizes), or None without it."""
    exe = os.path.join(bin_dir, "llama-tokenize")
    if not os.access(exe, os.X_OK):
        return None
    p = subprocess.run([exe, "-m", gguf, "-p", text, "--ids", "--log-disable"], check=False, capture_output=True,
                       text=True)
    m = re.search(r"\[([\d,\s]*)\]", p.stdout)
    return [int(x) for x in m.group(1).split(",") if x.strip()] if m else None


def llamacpp_bench(bin_dir: str, gguf: str, depth: int, new: int, repeats: int, threads: int):
    """``llama-bench``'s decode tok/s for ``new - 1`` tokens after ``depth`` (llama.cpp's own plain decode
    measurement, a cross-check of the draft-0 ``llama-lookup`` run), or None without it."""
    exe = os.path.join(bin_dir, "llama-bench")
    if not os.access(exe, os.X_OK):
        return None
    p = subprocess.run([exe, "-m", gguf, "-t", str(threads), "-p", "0", "-n", str(new - 1), "-d", str(depth),
                        "-r", str(repeats), "-o", "json"], check=False, capture_output=True, text=True)
    try:
        return float(json.loads(p.stdout)[0]["avg_ts"])
    except (ValueError, LookupError):
        return None


def llamacpp_row(bin_dir: str, gguf: str, prompt_ids: list, new: int, draft: int, repeats: int,
                 threads: int) -> dict:
    """llama.cpp plain vs lookup over the row's prompts, paired and alternated as ours: per repeat the tokens/s over
    all prompts, medians; acceptance summed over the prompts of the last repeat."""
    texts = [pair_text(ids) for ids in prompt_ids]
    ctx = max(512, max(len(ids) for ids in prompt_ids) + new + 64)
    same = [llamacpp_tokenize(bin_dir, gguf, t) for t in texts]
    llamacpp_once(bin_dir, gguf, texts[0], new, 0, threads, ctx)  # page the weights in
    plain, look, last = [], [], []
    for r in range(repeats):
        for d in ([0, draft] if r % 2 == 0 else [draft, 0]):
            runs = [llamacpp_once(bin_dir, gguf, t, new, d, threads, ctx) for t in texts]
            tok_s = sum(x["predicted"] - 1 for x in runs) / sum((x["predicted"] - 1) / x["tok_s"] for x in runs)
            (look if d else plain).append(tok_s)
            if d:
                last = runs
    predicted, accepted = sum(x["predicted"] for x in last), sum(x["accepted"] for x in last)
    return {"plain_tok_s": statistics.median(plain), "lookup_tok_s": statistics.median(look),
            "ratio": statistics.median(a / b for a, b in zip(look, plain)),
            "accepted": accepted, "drafted": sum(x["drafted"] for x in last), "predicted": predicted,
            "tokens_per_step": predicted / max(1, predicted - accepted),
            "prompt_tokens": [x["prompt_tokens"] for x in last],
            "prompt_ids_equal": None if None in same else all(t == list(ids) for t, ids in zip(same, prompt_ids)),
            "llama_bench_tok_s": llamacpp_bench(bin_dir, gguf, len(prompt_ids[0]), new, repeats, threads)}


def paired(gen, requests: list[list], new: int, drafters: list, repeats: int) -> dict:
    """Plain and each drafter over every request of the row, paired per repeat (the order rotated): the plain
    median and per drafter its median tokens/s (all the row's tokens over all its decode time), the median of the
    paired ratios, its acceptance over the last repeat's requests (drafts accepted of drafted, new tokens per loop
    step averaged over the requests that drafted, how many requests drafted) and whether its tokens equal the plain
    ones in every repeat. The first drafter's fields at the top level, a DSpark drafter's under ``dspark``."""
    from kimi_jax.generation.generate import MEASURES

    for _ in range(-(-MEASURES // len(requests))):  # compile; adapt=cost measures on a bucket's first MEASURES
        for s in [None, *drafters]:                 # requests that draft
            run_set(gen, requests, new, s)
    plain, runs = [], {i: [] for i in range(len(drafters))}
    stats, same, tokens = {}, {i: True for i in runs}, {}
    for r in range(repeats):
        order = [None, *range(len(drafters))]
        order = order[r % len(order):] + order[:r % len(order)]
        for i in order:
            toks, seconds, tokens[i], st = run_set(gen, requests, new, None if i is None else drafters[i])
            (plain if i is None else runs[i]).append(toks / seconds)
            if i is not None:
                stats[i] = st
        for i in runs:
            same[i] &= tokens[i] == tokens[None]
    out = {"plain_tok_s": statistics.median(plain), "requests": len(requests)}
    for i, d in enumerate(drafters):
        drafting = [x for x in stats[i] if x["drafting"]]
        fields = {"spec_tok_s": statistics.median(runs[i]),
                  "ratio": statistics.median(s / p for s, p in zip(runs[i], plain)),
                  "accepted": sum(x["accepted"] for x in stats[i]), "drafted": sum(x["drafted"] for x in stats[i]),
                  "tokens_per_step": statistics.mean(x["tokens_per_step"] for x in drafting) if drafting else 0.0,
                  "same_tokens": bool(same[i]),
                  # adapt=cost: a verify step's cost in plain steps as measured (the last request's), and how many of
                  # the requests drafted past their measure
                  "verify_cost": stats[i][-1]["verify_cost"], "drafting": len(drafting)}
        if i == 0:
            out.update(fields)
        else:
            out["dspark"] = fields
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="demo,bench")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new", type=int, default=64, help="new tokens per sequence")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=8, help="different prompts per row (batch 1: one request each)")
    ap.add_argument("--spec", default="ngram:k=4", help="the n-gram drafter (generate's speculative=)")
    ap.add_argument("--adapt", default="cost", choices=["cost", "acceptance"],
                    help="the drafters' pacing (speculative adapt=): cost (the default) also weighs a verify step's "
                         "measured cost in plain steps; acceptance verifies whenever a sequence drafted")
    ap.add_argument("--dspark", default=None, metavar="PATH",
                    help="the demo rows' DSpark drafter (default: the one shipped for the demo model; 'none': skip)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="default: from_pretrained's automatic choice (bfloat16)")
    ap.add_argument("--weights", default=os.path.join(os.path.expanduser("~"), ".cache", "kimi-jax", "kimi-linear-bench"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "speculative.json"))
    ap.add_argument("--llamacpp", default=os.environ.get(LLAMACPP_ENV), metavar="DIR",
                    help=f"the llama.cpp peer's folder (default: ${LLAMACPP_ENV}; see above)")
    ap.add_argument("--gguf", default=None, help="the benchmark model's GGUF for the peer (default: in --llamacpp)")
    ap.add_argument("--draft", type=int, default=4, help="llama-lookup's --spec-draft-n-max")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's threads")
    args = ap.parse_args(argv)

    import jax

    import kimi_jax
    from benchmarks.decode import BENCH_CONFIG, build_weights
    from kimi_jax.generation import speculative
    from kimi_jax.generation.generate import Generator
    from kimi_jax.model.config import DEMO_DRAFTER, demo_model_dir
    from kimi_jax.text.tokenizer import load_tokenizer

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} cores, load average {load[0]:.2f}; jax {jax.__version__}; commit {commit}; "
          f"{args.spec}, {args.new} new tokens, dtype {args.dtype or 'automatic'}, median of {args.repeats} paired "
          f"repeats", flush=True)
    peer_bin, peer_gguf, peer_why = (find_llamacpp(args.llamacpp, args.gguf, args.dtype) if "bench" in args.models
                                     else (None, None, "the benchmark model is not run"))
    if peer_why:
        peer = {"skipped": peer_why}
        print(f"llama.cpp peer skipped: {peer_why}", flush=True)
    else:
        v = subprocess.run([os.path.join(peer_bin, "llama-lookup"), "--version"], check=False, capture_output=True,
                           text=True)
        version = next((x.strip() for x in (v.stdout + v.stderr).splitlines() if x.startswith("version")), "")
        version = version.removeprefix("version:").strip()
        peer = {"gguf": os.path.basename(peer_gguf), "version": version, "draft": args.draft, "threads": args.threads,
                "batch8": "not run: llama-lookup decodes one sequence"}
        print(f"llama.cpp peer: {peer_bin}, {peer_gguf}, {version}", flush=True)
    rows = []
    dspark = None if args.dspark == "none" else f"dspark:{args.dspark or DEMO_DRAFTER}"
    for name in args.models.split(","):
        if name == "demo":
            path, tok = demo_model_dir(), True
        elif name == "bench":
            path, tok = build_weights(args.weights, BENCH_CONFIG), False
        else:
            raise SystemExit(f"--models: unknown {name!r} (demo, bench)")
        model = kimi_jax.from_pretrained(path, dtype=args.dtype, progress=False)
        tokenizer = load_tokenizer(path) if tok else None
        for kind in ("repeat", "free"):
            ps = prompts(name, kind, args.prompts)
            for b in (int(x) for x in args.batches.split(",")):
                requests = batches(ps, b)
                longest = max(len(tokenizer.encode(p)) if tokenizer else len(p) for p in ps)
                gen = Generator(model, tokenizer, max_len=longest + args.new + 16)
                # parsed once per model (a DSpark drafter loaded once, so its measured cost is kept between calls)
                drafters = [speculative.parse(f"{s}{',' if ':' in s else ':'}adapt={args.adapt}", dtype=model.run.dtype)
                            for s in [args.spec] + ([dspark] if dspark and name == "demo" else [])]
                row = {"model": name, "prompt": kind, "batch": b,
                       **paired(gen, requests, args.new, drafters, args.repeats)}
                rows.append(row)
                shown = [(args.spec, row)] + ([("dspark", row["dspark"])] if "dspark" in row else [])
                for label, r in shown:
                    print(f"{name:5s} {kind:6s} b={b}: plain {row['plain_tok_s']:7.1f} tok/s, {label} "
                          f"{r['spec_tok_s']:7.1f} tok/s ({r['ratio']:.2f}x); accepted {r['accepted']} of "
                          f"{r['drafted']} drafted, {r['tokens_per_step']:.2f} tokens per step; "
                          f"same tokens: {r['same_tokens']}; verify step = {r['verify_cost'] or float('nan'):.2f} "
                          f"plain steps, drafting in {r['drafting']} of {row['requests']} requests", flush=True)
                if name == "bench" and b == 1 and not peer_why:
                    lc = llamacpp_row(peer_bin, peer_gguf, ps, args.new, args.draft, args.repeats, args.threads)
                    lc["ours_plain_vs_llamacpp"] = row["plain_tok_s"] / lc["plain_tok_s"]
                    lc["ours_spec_vs_llamacpp_lookup"] = row["spec_tok_s"] / lc["lookup_tok_s"]
                    row["llamacpp"] = lc
                    lb = f"{lc['llama_bench_tok_s']:.1f}" if lc["llama_bench_tok_s"] else "n/a"
                    print(f"{'':5s} {kind:6s} b=1 llama.cpp {peer['gguf']}: plain {lc['plain_tok_s']:7.1f} tok/s, "
                          f"lookup draft {args.draft} {lc['lookup_tok_s']:7.1f} tok/s ({lc['ratio']:.2f}x); accepted "
                          f"{lc['accepted']} of {lc['drafted']} drafted; llama-bench plain {lb} tok/s; prompts of "
                          f"{sorted(set(lc['prompt_tokens']))} tokens, ids equal: {lc['prompt_ids_equal']}; "
                          f"ours / llama.cpp: plain "
                          f"{lc['ours_plain_vs_llamacpp']:.2f}x, speculative {lc['ours_spec_vs_llamacpp_lookup']:.2f}x",
                          flush=True)
    print("\n| model | prompt | batch | requests | plain tok/s | n-gram tok/s (ratio) | tokens per step, requests "
          "drafting | DSpark tok/s (ratio) | tokens per step, requests drafting | same tokens (n-gram, DSpark) |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        d = r.get("dspark")
        ds = (f"{d['spec_tok_s']:.1f} ({d['ratio']:.2f}x) | {d['tokens_per_step']:.2f}, {d['drafting']}" if d else
              "- | -")
        print(f"| {r['model']} | {r['prompt']} | {r['batch']} | {r['requests']} | {r['plain_tok_s']:.1f} | "
              f"{r['spec_tok_s']:.1f} ({r['ratio']:.2f}x) | {r['tokens_per_step']:.2f}, {r['drafting']} | {ds} | "
              f"{r['same_tokens']}, {d['same_tokens'] if d else '-'} |")
    if peer_why:
        print(f"\nllama.cpp peer skipped: {peer_why}")
    else:
        print(f"\nllama.cpp peer ({peer['gguf']}, {peer['version']}, {args.threads} threads; batch 8 not run: "
              f"llama-lookup decodes one sequence)\n\n| model | prompt | batch | llama.cpp plain tok/s (llama-bench) "
              f"| lookup tok/s | lookup / plain | accepted / drafted | ours / llama.cpp plain | "
              f"ours n-gram / llama.cpp lookup |\n|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            if "llamacpp" in r:
                lc = r["llamacpp"]
                lb = f"{lc['llama_bench_tok_s']:.1f}" if lc["llama_bench_tok_s"] else "n/a"
                print(f"| {r['model']} | {r['prompt']} | {r['batch']} | {lc['plain_tok_s']:.1f} ({lb}) | "
                      f"{lc['lookup_tok_s']:.1f} | {lc['ratio']:.2f}x (ours {r['ratio']:.2f}x) | {lc['accepted']} / "
                      f"{lc['drafted']} | {lc['ours_plain_vs_llamacpp']:.2f}x | "
                      f"{lc['ours_spec_vs_llamacpp_lookup']:.2f}x |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"commit": commit, "spec": args.spec, "dspark": dspark, "adapt": args.adapt,
                   "dtype": args.dtype or "automatic", "new": args.new, "repeats": args.repeats,
                   "prompts": args.prompts,
                   "cores": os.cpu_count(), "load_average": load[0], "when": time.strftime("%Y-%m-%d %H:%M"),
                   "llamacpp": peer, "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
