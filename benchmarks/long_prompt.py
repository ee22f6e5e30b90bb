"""A long prompt through ``kimi_jax.generate`` on the random tiny K3: refused before allocation under a small memory
budget, prefilled in chunks that fit a larger one, and the memory it really took.

    python benchmarks/long_prompt.py [--tokens 100000] [--budget-gb 2] [--refuse-budget-gb 0.05] [--new 4]

Prints one JSON line: the refusal's message, the plan (chunk, calls, the cache's and the working memory's bytes as
XLA counts them for the compiled programs), the prefill and decode times, and the memory the run added on top of
the loaded model and compiled programs: on a GPU / TPU the device's peak bytes in use, on the CPU the process's
resident memory sampled every 5 ms (``VmRSS``), each minus its value before the run. The run fits the budget when
that is at most ``--budget-gb``. On the CPU the attention of every chunk reads the whole cache (~4e13 flops for
100,000 tokens), so use ``--tokens 20000`` there; the 100,000-token run is for an accelerator.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402

import kimi_jax  # noqa: E402
from kimi_jax.checkpoint import synthetic  # noqa: E402
from kimi_jax.generation.generate import GenerationError, Generator, _auto_max_len  # noqa: E402


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class _Peak:
    """The most memory in use while the block runs, minus what was in use before it (bytes)."""

    def __init__(self, device):
        self.device = device
        self.stats = device.memory_stats() is not None

    def __enter__(self):
        if self.stats:
            self.before = self.device.memory_stats().get("bytes_in_use", 0)
            return self
        self.before, self.top, self.stop = _rss(), 0, False

        def sample():
            while not self.stop:
                self.top = max(self.top, _rss())
                time.sleep(0.005)

        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        if self.stats:
            self.added = self.device.memory_stats().get("peak_bytes_in_use", 0) - self.before
        else:
            self.stop = True
            self.thread.join()
            self.added = max(self.top, _rss()) - self.before


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=100_000, help="prompt length (default: %(default)s)")
    ap.add_argument("--budget-gb", type=float, default=2.0, help="memory_budget of the run (default: %(default)s)")
    ap.add_argument("--refuse-budget-gb", type=float, default=0.05,
                    help="a memory_budget too small for the cache (default: %(default)s)")
    ap.add_argument("--new", type=int, default=4, help="new tokens (default: %(default)s)")
    args = ap.parse_args()
    out = {"platform": jax.devices()[0].platform, "tokens": args.tokens}
    with tempfile.TemporaryDirectory() as tmp:
        path = synthetic.write_checkpoint(tmp, "k3", dtype="float32")
        model = kimi_jax.from_pretrained(path, dtype="float32", progress=False)
    ids = [3 + (7 * i) % 700 for i in range(args.tokens)]
    max_len = _auto_max_len(args.tokens, args.new)  # what kimi_jax.generate picks
    try:  # the plan refuses what generate would, allocating nothing
        Generator(model, max_len=max_len, memory_budget=int(args.refuse_budget_gb * 1e9)).plan(ids, args.new)
        out["refused"] = None
    except GenerationError as e:
        out["refused"] = str(e)
    budget = int(args.budget_gb * 1e9)
    gen = Generator(model, max_len=max_len, memory_budget=budget)
    t = time.perf_counter()
    plan = gen.plan(ids, args.new, stop=())
    out["compile_s"] = round(time.perf_counter() - t, 2)
    out["plan"] = {"chunk": plan.chunk, "calls": plan.calls, "cache_bytes": plan.cache_bytes,
                   "working_bytes": plan.working_bytes, "budget_bytes": budget}
    with _Peak(jax.devices()[0]) as peak:
        r = gen.generate(ids, args.new, stop=())
    out["timings"] = {k: round(v, 3) if isinstance(v, float) else v for k, v in r.timings.items()}
    out["added_bytes"] = peak.added
    out["fits_budget"] = peak.added <= budget
    print(json.dumps(out))


if __name__ == "__main__":
    main()
