"""Decode-step attention on XLA:CPU: the native kernels (``kernels_pallas/mla_decode/native.cc``, the KDA recurrence
``kernels_pallas/kda/native.cc``) against the XLA forms the automatic choice would otherwise take, in one process.

    python benchmarks/native_attention.py [--repeats 200] [--json OUT]

One query row (batch 1) with the benchmark model's head sizes: MLA over a bfloat16 latent cache (8 heads, R = 512,
O = 64) of 576 and 4096 slots, native against ``"xla_cpu"``; one KDA step (8 heads, K = V = 128, float32 state),
native against the plain-jnp recurrence (``"reference"``). Each case alternates the two implementations call for
call (neither leaves the other a copy to pay for) and reports median times and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
sys.path.insert(0, os.path.dirname(HERE))


def cases():
    """(name, {implementation: jitted fn}, operands) per case."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernels_pallas import kda
    from kernels_pallas import mla_decode as mla

    rng = np.random.default_rng(0)
    H, R, O = 8, 512, 64
    for S in (576, 4096):
        ops = (jnp.asarray(rng.standard_normal((1, 1, H, R)), jnp.float32),
               jnp.asarray(rng.standard_normal((1, 1, H, O)), jnp.float32),
               jnp.asarray(rng.standard_normal((1, S, R)), jnp.bfloat16),
               jnp.asarray(rng.standard_normal((1, S, O)), jnp.bfloat16),
               jnp.full((1, 1), S - 1, jnp.int32))
        fns = {impl: jax.jit(lambda *a, impl=impl: mla.mla_attention(*a, scale=(R + O) ** -0.5, implementation=impl))
               for impl in ("cpu_native", "xla_cpu")}
        yield f"mla bf16 cache, {S} slots", fns, ops
    K = V = 128
    unit = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)
    ops = tuple(jnp.asarray(a, jnp.float32) for a in (
        unit(rng.standard_normal((1, 1, H, K))), unit(rng.standard_normal((1, 1, H, K))),
        rng.standard_normal((1, 1, H, V)), -rng.uniform(0, 1, (1, 1, H, K)), rng.uniform(0, 1, (1, 1, H)),
        0.3 * rng.standard_normal((1, H, K, V))))
    fns = {impl: jax.jit(lambda *a, impl=impl: kda.kda_decode(*a, scale=K**-0.5, implementation=impl))
           for impl in ("cpu_native", "reference")}
    yield "kda decode step", fns, ops


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=200, help="calls of each implementation per case")
    ap.add_argument("--json", default=None, help="also write the times (seconds) to this file")
    args = ap.parse_args(argv)

    import jax

    results = {}
    print("| case | native median us | XLA median us | XLA / native |")
    print("|---|---|---|---|")
    for name, fns, ops in cases():
        for f in fns.values():
            for _ in range(5):
                jax.block_until_ready(f(*ops))
        times = {impl: [] for impl in fns}
        for _ in range(args.repeats):
            for impl, f in fns.items():
                t = time.perf_counter()
                jax.block_until_ready(f(*ops))
                times[impl].append(time.perf_counter() - t)
        native, other = (statistics.median(times[impl]) for impl in fns)
        print(f"| {name} | {native * 1e6:.0f} | {other * 1e6:.0f} | {other / native:.2f} |")
        results[name] = times
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
