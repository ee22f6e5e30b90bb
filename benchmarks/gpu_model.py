"""Whole-model checks on an NVIDIA GPU: the compiled Pallas kernels against the reference path and Moonshot's golden
outputs, host offload against the on-device run, and decode speed of the shared benchmark model.

    python benchmarks/gpu_model.py [--fixture DIR] [--json out.json] [--only fixture,offload,speed,speculative]

Sections (each in its own try/except; one failure is reported and the rest still run):

* ``fixture``: the shared K3 fixture (KDA, gated MLA, MXFP4 LatentMoE) in float32, a right-padded batch (lengths 24
  and 17) through a cached prefill and 4 decode steps at per-sequence positions, once with every kernel the Pallas
  one compiled for the GPU (``implementation="pallas"``: Triton) and once with the plain-jnp reference: max |logit
  difference| between them, and of sequence 0 against the fixture's golden prefill and decode logits (as
  ``tests/test_kernels_model.py`` does in interpret mode on CPU).
* ``offload``: ``Generator.generate`` of the fixture (prefill + 5 decode steps, recorded logits) with the KDA state,
  the cache and the routed experts in ``pinned_host`` memory against the same on the device: equal bit for bit or
  not, and where the offloaded arrays are after the run; the same with 2 of 8 experts per layer kept hot on the device.
* ``speed``: the shared benchmark model's config (``benchmarks/configs/kimi-linear-bench.config.json``: Kimi Linear,
  12 layers, hidden 1024, 16 experts) with random weights in bfloat16: decode tokens/s (64 new after a 512-token
  prompt, 63 decode steps) and prefill tokens/s at batch 1 and 8, with the kernels (the automatic choice on a GPU:
  Pallas) and with the reference path (XLA), and with int8 / int4 weights; medians of --repeats after a compiling
  call; greedy tokens of kernels vs reference compared.
* ``speculative``: what speculative decoding can reach on this device at batch 1. The ceilings: a verify forward over
  ``k + 1`` = 5, 9 and 17 positions against one decode position (``benchmarks/verify_cost.py``'s compiled loop, a
  200-token cache), for the benchmark config (random bfloat16 weights) and the demo model, and ``(k + 1) / cost``,
  the speed-up if every draft were accepted. Then the whole loop (``benchmarks/speculative.py``'s paired runs): the
  demo model plain vs n-gram (k = 8) vs its DSpark drafter, greedy, on that benchmark's 8 code-editing prompts and on a
  chat question the drafter was not trained on: tokens/s, the ratio, tokens per verify step, equal tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
sys.path.insert(0, os.path.dirname(HERE))

PROMPT, NEW, STEPS = 512, 64, 4


def _max_abs(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def _run_cached(model, ids, lengths, feed, max_len):
    """Cached prefill of right-padded ``ids``, then one decode step per column of ``feed``: (prefill logits, decode
    logits [B, steps, V])."""
    import jax.numpy as jnp
    from flax import nnx

    from kimi_jax.model.cache import init_cache

    prefill = nnx.jit(lambda m, x, n, c: m(x, cache=c, lengths=n))
    step = nnx.jit(lambda m, x, c: m(x, cache=c, prefix=True))
    out = prefill(model, jnp.asarray(ids), jnp.asarray(lengths), init_cache(model.cfg, ids.shape[0], max_len, jnp.float32))
    logits, cache, steps = np.asarray(out.logits), out.cache, []
    for j in range(feed.shape[1]):
        out = step(model, jnp.asarray(feed[:, j : j + 1]), cache)
        cache = out.cache
        steps.append(np.asarray(out.logits[:, 0]))
    return logits, np.stack(steps, 1)


def fixture(path: str, kernels: str = "pallas") -> dict:
    from safetensors.numpy import load_file

    import kimi_jax

    g = load_file(os.path.join(path, "golden.safetensors"))
    ids = np.array(g["input_ids"])
    lengths = np.array([24, 17], np.int32)
    ids[1, 17:] = 0
    feed = np.stack([g["greedy_tokens"][0, :STEPS], g["greedy_tokens"][1, 3 : 3 + STEPS]]).astype(np.int32)
    out = {}
    runs = {}
    for impl in ("reference", kernels):
        t0 = time.perf_counter()
        runs[impl] = _run_cached(kimi_jax.from_pretrained(path, dtype="float32", implementation=impl), ids, lengths,
                                 feed, 32)
        out[f"{impl}_seconds"] = round(time.perf_counter() - t0, 2)
    (kp, kd), (rp, rd) = runs[kernels], runs["reference"]
    out["prefill_seq0_kernels_vs_reference"] = _max_abs(kp[0], rp[0])
    out["prefill_seq1_padded_kernels_vs_reference"] = _max_abs(kp[1, :17], rp[1, :17])
    out["decode_kernels_vs_reference"] = _max_abs(kd, rd)
    out["prefill_seq0_kernels_vs_golden"] = _max_abs(kp[0], g["logits_prefill"][0])
    out["decode_seq0_kernels_vs_golden"] = _max_abs(kd[0], g["decode_logits"][0, 1 : 1 + STEPS])
    out["prefill_seq0_reference_vs_golden"] = _max_abs(rp[0], g["logits_prefill"][0])
    out["decode_seq0_reference_vs_golden"] = _max_abs(rd[0], g["decode_logits"][0, 1 : 1 + STEPS])
    out["greedy_seq0_kernels_equal_golden"] = bool(np.array_equal(np.argmax(kd[0], -1), g["greedy_tokens"][0, 1 : 1 + STEPS]))
    return out


def offload(path: str) -> dict:
    import jax
    import jax.numpy as jnp
    from safetensors.numpy import load_file

    import kimi_jax
    from kimi_jax import Generator, RunConfig

    kinds = ("kda_state", "cache", "experts")
    golden = load_file(os.path.join(path, "golden.safetensors"))
    ids = golden["input_ids"]
    mem = lambda t: sorted({getattr(x.sharding, "memory_kind", None) or "device" for x in jax.tree.leaves(t)})
    base = kimi_jax.from_pretrained(path, dtype="float32")
    ref = Generator(base, max_len=32).generate(ids, 6, stop=(), record_logits=True)
    model = kimi_jax.from_pretrained(path, run=RunConfig(dtype=jnp.float32, offload=kinds))
    gen = Generator(model, max_len=32)
    out = gen.generate(ids, 6, stop=(), record_logits=True)
    a, b = np.stack(out.logits), np.stack(ref.logits)
    (cache,) = gen._caches.values()
    # hot experts: 2 of each layer's 8 also on the device (usage counted on the fixture's longer sequences)
    from kimi_jax.model import hot_experts as off

    hot_model = kimi_jax.from_pretrained(path, run=RunConfig(dtype=jnp.float32, offload=kinds))
    off.keep_hot_experts(hot_model, 2, off.expert_usage(base, golden["full_ids"]))
    hot = np.stack(Generator(hot_model, max_len=32).generate(ids, 6, stop=(), record_logits=True).logits)
    return {"offloaded": list(kinds), "logits_bit_equal": bool(np.array_equal(a, b)), "max_abs_diff": _max_abs(a, b),
            "hot_experts_logits_bit_equal": bool(np.array_equal(hot, b)), "hot_experts_max_abs_diff": _max_abs(hot, b),
            "tokens_equal": out.tokens == ref.tokens,
            "expert_weights_memory": mem(model.layers[1].mlp.experts.w1.get_value()),
            "cache_layers_memory": sorted({k for e in cache.layers for k in mem(e)}),
            "device_memory_kinds": [m.kind for m in jax.devices()[0].addressable_memories()]}


def speed(config_path: str, repeats: int, budget_s: float) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import kimi_jax
    from kimi_jax import Generator, RunConfig
    from kimi_jax.model.config import from_dict
    from kimi_jax.model.decoder import KimiModel

    with open(config_path) as f:
        cfg = from_dict(json.load(f))
    rng = np.random.default_rng(0)
    batches = (1, 8)
    prompts = {b: rng.integers(3, cfg.vocab_size, (b, PROMPT)).astype(np.int32) for b in batches}
    rows, tokens = [], {}
    t_start = time.perf_counter()
    variants = [("bf16", None, None), ("bf16", "reference", None), ("int8", None, "int8"), ("int4:g32", None, "int4"),
                ("int8", "reference", "int8")]
    for label, impl, fmt in variants:
        if rows and time.perf_counter() - t_start > budget_s:
            rows.append({"weights": label, "kernels": impl or "auto", "skipped": "time budget"})
            continue
        row = {"weights": label, "kernels": impl or "auto"}
        try:
            model = KimiModel(cfg, run=RunConfig(dtype=jnp.bfloat16, implementation=impl), rngs=nnx.Rngs(0))
            if fmt:
                kimi_jax.quantize(model, fmt)
            row["param_bytes"] = int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param))))
            gen = Generator(model, max_len=PROMPT + NEW, batch_buckets=batches, prompt_buckets=(PROMPT,))
            for b in batches:
                t0 = time.perf_counter()
                first = gen.generate(prompts[b], NEW, stop=())
                row[f"b{b}_first_call_s"] = round(time.perf_counter() - t0, 2)
                runs = [gen.generate(prompts[b], NEW, stop=()) for _ in range(repeats)]
                dec = statistics.median(r.timings["decode"] for r in runs)
                pre = statistics.median(r.timings["prefill"] for r in runs)
                row[f"b{b}_decode_tok_s"] = round(b * (NEW - 1) / dec, 1)
                row[f"b{b}_decode_step_ms"] = round(1e3 * dec / (NEW - 1), 3)
                row[f"b{b}_prefill_tok_s"] = round(b * PROMPT / pre, 1)
                tokens[(label, impl, b)] = np.array(first.tokens)
            ref_tokens = tokens.get((label, "reference", 1)) if impl is None else tokens.get((label, None, 1))
            if ref_tokens is not None:
                row["b1_greedy_tokens_equal_other_path"] = float(np.mean(ref_tokens == tokens[(label, impl, 1)]))
            del gen, model
        except Exception as e:  # noqa: BLE001 -- report and go on
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            row["traceback"] = traceback.format_exc(limit=8)
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)
    return rows


def _ceilings(model, repeats: int) -> list[dict]:
    """A verify forward's cost in decode steps at 5, 9 and 17 positions, batch 1, and the speed-up at full
    acceptance (``benchmarks/verify_cost.py``)."""
    from benchmarks.verify_cost import measure, timed_forward

    rows, base = [], None
    for T in (1, 5, 9, 17):
        ms = measure({"ms": timed_forward(model, T, 1, 20)}, 20, max(5, repeats))["ms"]
        base = ms if T == 1 else base
        rows.append({"positions": T, "ms": round(ms, 4), "cost": round(ms / base, 3),
                     "ceiling": round(T * base / ms, 3)})
    return rows


def speculative(config_path: str, repeats: int, budget_s: float) -> dict:
    # imported once jax has its backend: both modules default JAX_PLATFORMS to cpu for their own command lines
    import jax.numpy as jnp
    from flax import nnx

    import kimi_jax
    from benchmarks.speculative import REPEAT_TEXTS, paired
    from kimi_jax import Generator, RunConfig
    from kimi_jax.generation import speculative as spec
    from kimi_jax.model.config import DEMO_DRAFTER, demo_model_dir, from_dict
    from kimi_jax.model.decoder import KimiModel
    from kimi_jax.text import chat
    from kimi_jax.text.tokenizer import load_tokenizer

    t_start = time.perf_counter()
    with open(config_path) as f:
        bench = KimiModel(from_dict(json.load(f)), run=RunConfig(dtype=jnp.bfloat16), rngs=nnx.Rngs(0))
    demo = kimi_jax.from_pretrained(demo_model_dir(), dtype="bfloat16", progress=False)
    out = {"ceilings": {"bench": _ceilings(bench, repeats), "demo": _ceilings(demo, repeats)}, "loops": []}
    print(json.dumps(out["ceilings"]), flush=True)
    del bench
    tok = load_tokenizer(demo_model_dir())
    question = chat.encode(tok, [{"role": "user", "content": "What is the zipfile module?"}], add_generation_prompt=True)
    drafters = [spec.parse(s, dtype=demo.run.dtype) for s in ("ngram:k=8", f"dspark:{DEMO_DRAFTER}")]
    # paired's requests: a list of requests, each a list of prompts (batch 1: one prompt each; the 8 rename prompts)
    for kind, requests in (("repeat", [[t] for t in REPEAT_TEXTS]), ("chat", [[question]])):
        if time.perf_counter() - t_start > budget_s:
            out["loops"].append({"prompt": kind, "skipped": "time budget"})
            continue
        # a generator per prompt: what a drafter's pacing learned (its costs and gains per batch bucket) lives in the
        # generator, and one prompt's verdict ("drafting does not pay here") must not decide the other's
        gen = Generator(demo, tok, max_len=512)
        row = {"model": "demo", "prompt": kind, "batch": 1, **paired(gen, requests, 64, drafters, repeats)}
        out["loops"].append(row)
        print(json.dumps(row, default=str), flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixture", default=os.path.join(HERE, "..", "tests", "fixtures", "k3-tiny-a"))
    ap.add_argument("--config", default=os.path.join(HERE, "configs", "kimi-linear-bench.config.json"))
    ap.add_argument("--only", default="fixture,offload,speed,speculative")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--speed-budget-s", type=float, default=240.0,
                    help="start no new speed variant (nor speculative loop) after this many seconds of the section")
    ap.add_argument("--json", default=None)
    ap.add_argument("--interpret", action="store_true", help="CPU smoke test: the fixture's kernels in interpret mode")
    args = ap.parse_args(argv)

    import jax

    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}", flush=True)
    results = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__}
    kernels = "pallas_interpret" if args.interpret else "pallas"
    sections = {"fixture": lambda: fixture(args.fixture, kernels), "offload": lambda: offload(args.fixture),
                "speed": lambda: speed(args.config, args.repeats, args.speed_budget_s),
                "speculative": lambda: speculative(args.config, args.repeats, args.speed_budget_s)}
    ok = True
    for name in args.only.split(","):
        t0 = time.perf_counter()
        try:
            results[name] = sections[name]()
        except Exception as e:  # noqa: BLE001
            ok = False
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:600]}", "traceback": traceback.format_exc(limit=10)}
        print(f"== {name} ({time.perf_counter() - t0:.1f} s)\n" + json.dumps(results[name], indent=1, default=str),
              flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
