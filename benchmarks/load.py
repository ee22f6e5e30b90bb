"""Loading benchmark: peak memory and load throughput of ``from_pretrained`` next to a plain read of the same files
and HF transformers, on the shared benchmark model (1.09 GB of float32 safetensors).

    python benchmarks/load.py [--weights DIR] [--repeats 3] [--skip-hf]

Each measurement runs in a fresh process (peak resident memory is the process's ``VmHWM``), with the checkpoint
files in the page cache (a first plain read puts them there), so the times measure what the loader itself costs:

* plain read: every byte of the shard files read once into a reused buffer (the floor for any loader);
* kimi-jax: ``from_pretrained(dtype="float32")`` with the NaN / Inf check (default) and without it, then one
  greedy decode of 8 tokens (peak after load, and after generating: the cache and compiled programs included);
* HF transformers: ``KimiLinearForCausalLM.from_pretrained(torch_dtype=float32)``, then the same generation.

Prints, per engine, the process's footprint before loading (the runtime alone: Python, JAX or torch and their
native libraries), the peak after loading and after decoding, the peak over the checkpoint's bytes (the goal is
at most 1.3x through load and decode) with and without the runtime's own footprint, and GB/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
sys.path.insert(0, ROOT)

CHILD = r"""
import json, os, sys, time
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, {root!r})
what, path = sys.argv[1], sys.argv[2]

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

if what.startswith("ours"):
    import jax
    import kimi_jax
    jax.numpy.zeros(1).block_until_ready()  # the runtime started: its own footprint is in `base`
elif what == "hf":
    import torch
    from transformers import KimiLinearForCausalLM
base = hwm()
t0 = time.perf_counter()
if what == "read":
    buf = bytearray(64 << 20)
    n = 0
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with open(os.path.join(path, f), "rb", buffering=0) as fh:
                while True:
                    k = fh.readinto(buf)
                    if not k:
                        break
                    n += k
    load = time.perf_counter() - t0
    print(json.dumps(dict(load_s=load, bytes=n, base=base, after_load=hwm(), after_decode=hwm())))
    sys.exit()
ids = [[(7 * i + 3) % 30000 + 10 for i in range(64)]]
if what.startswith("ours"):
    model = kimi_jax.from_pretrained(path, dtype="float32", check_finite=what == "ours")
    load = time.perf_counter() - t0
    after_load = hwm()
    kimi_jax.generate(model, ids, 8, stop=())
else:
    model = KimiLinearForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    load = time.perf_counter() - t0
    after_load = hwm()
    with torch.no_grad():
        model.generate(torch.tensor(ids), max_new_tokens=8, do_sample=False)
print(json.dumps(dict(load_s=load, base=base, after_load=after_load, after_decode=hwm())))
"""


def run(what: str, path: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", KIMI_JAX_COMPILE_CACHE="off")
    out = subprocess.run([sys.executable, "-c", CHILD.format(root=ROOT), what, path], capture_output=True, text=True,
                         env=env, timeout=1800)
    if out.returncode:
        raise RuntimeError(f"{what} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    from benchmarks.decode import BENCH_CONFIG, build_weights

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default=os.path.join(os.path.expanduser("~"), ".cache", "kimi-jax", "kimi-linear-bench"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args(argv)
    path = build_weights(args.weights, BENCH_CONFIG)
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    run("read", path)  # into the page cache
    names = ["read", "ours", "ours_unchecked"] + ([] if args.skip_hf else ["hf"])
    results = {n: [] for n in names}
    for i in range(args.repeats):  # interleaved, so every engine sees the same machine, in a rotating order: the
        for n in names[i % len(names):] + names[:i % len(names)]:  # first big allocation after a small process
            results[n].append(run(n, path))  # pays more for fresh pages (~1.4 s here), whoever makes it
    gb = 1e9
    print(f"checkpoint: {size / gb:.3f} GB of safetensors in {path} (page cache warm); medians of {args.repeats}")
    print(f"| {'':32} | load s | GB/s | runtime alone | peak RSS after load | after 8 decode steps | "
          "peak / checkpoint | (peak - runtime) / checkpoint |")
    print("|---|---|---|---|---|---|---|---|")
    labels = {"read": "plain read of the files", "ours": "kimi-jax from_pretrained",
              "ours_unchecked": "kimi-jax, check_finite=False", "hf": "HF transformers from_pretrained"}
    for n, rs in results.items():
        load = statistics.median(r["load_s"] for r in rs)
        b = statistics.median(r["base"] for r in rs)
        a = statistics.median(r["after_load"] for r in rs)
        d = statistics.median(r["after_decode"] for r in rs)
        print(f"| {labels[n]:32} | {load:6.2f} | {size / load / gb:5.2f} | {b / gb:5.2f} GB | {a / gb:6.2f} GB | "
              f"{d / gb:6.2f} GB | {d / size:5.2f}x | {(d - b) / size:5.2f}x |")


if __name__ == "__main__":
    main()
