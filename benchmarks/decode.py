"""Generation benchmark: kimi-jax vs HF transformers on the shared Kimi Linear benchmark model (float32, CPU).

    python benchmarks/decode.py [--weights DIR] [--repeats 3] [--skip-hf] [--dtype bfloat16]

Builds ``benchmarks/configs/kimi-linear-bench.config.json`` with transformers after ``torch.manual_seed(0)`` in
float32 and ``save_pretrained`` (once, into --weights), then measures in one run, as medians of --repeats (each
repeat runs ours and HF back to back on the same batch, after a bandwidth sample, so all see the same machine):

* decode tokens/s at batch 1 and 8: 64 new tokens after a 512-token prompt (63 decode steps; the first new
  token comes from the prefill), aggregate over the batch;
* prefill tokens/s for one 512-token prompt (prompt processing + the first token, as ``generate`` does);
* time to first token of a fresh process-level generator, compilation included;
* weight bytes streamed per decode token at batch 1 divided by the step time, next to the memory read bandwidth
  of this machine measured in the same run (two threads reading a 1 GiB buffer).

HF is timed through ``generate`` with a logits processor that timestamps every step, so its prefill and decode
are separated inside one call. Token ids only (the benchmark model has no tokenizer).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
# a CPU benchmark: with the aot extra installed, JAX would otherwise try to start the CUDA and TPU runtimes first
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# run as a script, this folder would shadow top-level packages (benchmarks/convert.py vs the convert package)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
sys.path.insert(0, os.path.dirname(HERE))
BENCH_CONFIG = os.path.join(HERE, "configs", "kimi-linear-bench.config.json")
PROMPT, NEW = 512, 64


def build_weights(path: str, config_path: str) -> str:
    import torch
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    with open(config_path) as f:
        cfg = json.load(f)
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(KimiLinearConfig(**cfg)).float().eval()
    model.save_pretrained(path)
    return path


def memory_bandwidth(threads: int = 2, gib: float = 1.0, repeats: int = 7) -> float:
    """Bytes/s read by ``threads`` threads summing disjoint halves of a ``gib`` GiB int64 buffer (numpy
    releases the GIL in reductions). Median of ``repeats``."""
    buf = np.ones(int(gib * 2**30) // 8, np.int64)
    parts = np.array_split(buf, threads)
    rates = []
    for _ in range(repeats):
        ts = [threading.Thread(target=np.add.reduce, args=(p,)) for p in parts]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        rates.append(buf.nbytes / (time.perf_counter() - t0))
    return statistics.median(rates)


def decode_weight_bytes(model) -> int:
    """Bytes of parameters one batch-1 decode token reads: everything except the embedding table and the
    routed experts, plus one embedding row and ``top_k`` of ``E`` experts per MoE layer."""
    from flax import nnx

    cfg = model.cfg
    total = 0
    from kimi_jax.model import params

    for path, arr in params.leaves(nnx.state(model, nnx.Param)).items():
        names = path.split(".")
        nbytes = arr.size * arr.dtype.itemsize
        if names[0] == "embed_tokens":
            total += arr.shape[-1] * arr.dtype.itemsize
        elif "experts" in names and "shared_experts" not in names:
            total += nbytes * cfg.moe.top_k // cfg.moe.num_experts
        else:
            total += nbytes
    return total


class _StepClock:
    """A logits processor that records when each generation step's logits are ready."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def hf_run(hf_model, ids: np.ndarray):
    import torch
    from transformers import LogitsProcessorList

    clock = _StepClock()
    t0 = time.perf_counter()
    hf_model.generation_config.eos_token_id = None  # run the whole budget, as ours with stop=()
    with torch.no_grad():
        out = hf_model.generate(torch.as_tensor(ids), max_new_tokens=NEW, do_sample=False,
                                logits_processor=LogitsProcessorList([clock]), pad_token_id=0)
    t_end = time.perf_counter()
    assert out.shape[1] == ids.shape[1] + NEW and len(clock.times) == NEW
    # prefill = start .. first logits; decode = the remaining NEW-1 steps (last step ends at t_end)
    return clock.times[0] - t0, t_end - clock.times[0], out[:, ids.shape[1]:].numpy()


def ours_run(gen, ids: np.ndarray):
    r = gen.generate(ids, NEW, stop=())
    assert all(len(t) == NEW for t in r.tokens)
    return r.timings["prefill"], r.timings["decode"], np.array(r.tokens)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default=os.path.join(os.path.expanduser("~"), ".cache", "kimi-jax", "kimi-linear-bench"))
    ap.add_argument("--config", default=BENCH_CONFIG)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="ours (HF runs float32)")
    ap.add_argument("--quantize", default=None, metavar="FORMAT",
                    help="ours: weight-only format of the dense weights (int8, int4, nf4: kimi_jax.quantize)")
    ap.add_argument("--quantize-include", default="attention,mlp,latent,lm_head,experts",
                    help="module classes --quantize applies to (default: all but the embedding, as llama.cpp's "
                         "Q8_0 quantizes every matrix)")
    args = ap.parse_args(argv)

    import jax
    import torch

    import kimi_jax
    from kimi_jax.generation.generate import Generator

    torch.set_num_threads(os.cpu_count() or 2)
    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} cores, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; jax "
          f"{jax.__version__} ({jax.devices()[0].platform}), torch {torch.__version__}")
    path = build_weights(args.weights, args.config)

    rng = np.random.default_rng(0)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = {b: rng.integers(3, 32000, (b, PROMPT)).astype(np.int64) for b in batches}

    # ours: time to first token of a fresh generator (compiles prefill); first calls compile
    t0 = time.perf_counter()
    model = kimi_jax.from_pretrained(path, dtype=args.dtype, quantize=args.quantize,
                                     quantize_include=args.quantize_include.split(",") if args.quantize else None)
    load_s = time.perf_counter() - t0
    gen = Generator(model, max_len=PROMPT + NEW, batch_buckets=tuple(batches), prompt_buckets=(PROMPT,))
    wbytes = decode_weight_bytes(model)
    print(f"load {load_s:.2f}s; decode weight bytes per token at batch 1: {wbytes / 1e6:.1f} MB")
    results = {}
    for b in batches:
        pre, dec, toks = ours_run(gen, prompts[b])  # first call: compiles
        if b == batches[0]:
            results["ttft_compile"] = pre
        results[("ours_tokens", b)] = toks
        print(f"ours  b={b}: first call prefill {pre:.2f}s decode {dec:.2f}s (compiles)", flush=True)
    hf = None
    if not args.skip_hf:
        from transformers import KimiLinearForCausalLM

        hf = KimiLinearForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # Interleaved repeats: a memory-bandwidth sample, then ours and HF on the same batch back to back, so both
    # (and the bandwidth) see the same machine: on a shared 2-core machine the absolute speed drifts by tens of %.
    bws = []
    for r in range(args.repeats):
        bws.append(memory_bandwidth(repeats=3))
        for b in batches:
            results.setdefault(("ours", b), []).append(ours_run(gen, prompts[b]))
            if hf is not None:
                results.setdefault(("hf", b), []).append(hf_run(hf, prompts[b]))
        print(f"repeat {r}: bandwidth {bws[-1] / 1e9:.1f} GB/s; " + "; ".join(
            f"b={b} ours prefill {results[('ours', b)][-1][0]:.3f}s decode {results[('ours', b)][-1][1]:.3f}s" + (
                f", HF prefill {results[('hf', b)][-1][0]:.3f}s decode {results[('hf', b)][-1][1]:.3f}s"
                if hf is not None else "") for b in batches), flush=True)
    for b in batches:
        if hf is not None:
            same = all(np.array_equal(run[2], results[("ours_tokens", b)]) for run in results[("hf", b)])
            print(f"b={b}: HF greedy tokens identical to ours: {same}")
    bw = statistics.median(bws)
    print(f"memory read bandwidth (2 threads reading 1 GiB; median over the repeats): {bw / 1e9:.1f} GB/s "
          f"(bandwidth limit at batch 1: {bw / wbytes:.1f} tok/s)")

    med = lambda runs, i: statistics.median(r[i] for r in runs)
    print()
    print("| metric | kimi-jax | HF transformers | ratio |")
    print("|---|---|---|---|")
    def row(metric, ours, hf):  # HF's columns read "-" when it did not run (--skip-hf)
        theirs = "- | -" if hf is None else f"{hf:.1f} | {ours / hf:.2f}x"
        print(f"| {metric} | {ours:.1f} | {theirs} |")

    for b in batches:
        row(f"decode b={b} (tok/s, {NEW} new after {PROMPT})", b * (NEW - 1) / med(results[("ours", b)], 1),
            b * (NEW - 1) / med(results[("hf", b)], 1) if ("hf", b) in results else None)
    b0 = batches[0]
    row(f"prefill {PROMPT} b={b0} (tok/s)", b0 * PROMPT / med(results[("ours", b0)], 0),
        b0 * PROMPT / med(results[("hf", b0)], 0) if ("hf", b0) in results else None)
    print(f"| time to first token, compile included (s) | {results['ttft_compile']:.2f} | - | - |")
    if 1 in batches:
        step = med(results[("ours", 1)], 1) / (NEW - 1)
        achieved = wbytes / step
        print(f"| decode b=1 weight stream (GB/s) | {achieved / 1e9:.1f} | measured read bandwidth "
              f"{bw / 1e9:.1f} | {achieved / bw:.0%} |")
    if hf is not None:
        paired = lambda b, i: statistics.median(h[i] / o[i] for h, o in zip(results[("hf", b)], results[("ours", b)]))
        print("paired ratios (median over repeats of HF time / our time, same repeat): " + "; ".join(
            f"decode b={b} {paired(b, 1):.2f}x" for b in batches) + f"; prefill b={b0} {paired(b0, 0):.2f}x")
    load = os.getloadavg()
    print(f"\nload average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
