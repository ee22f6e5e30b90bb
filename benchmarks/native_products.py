"""Decode-shaped products on XLA:CPU: the native kernel (``kernels_pallas/matvec/native.cc``) against XLA's own
product, on the shared benchmark model's shapes, in one process.

    python benchmarks/native_products.py [--dtype bfloat16|float32|int8|int4:g32] [--rows 1] [--repeats 60] [--json OUT]

One jitted chain per implementation: the projections of 12 layers (a fused 3072 x 1024, a 1024 x 1024 and a 1536 x
1024 product each) and a 32000 x 1024 head, every product feeding the next through a normalisation, as a decode step
does at batch 1 (random weights; about 204 MB in bfloat16); ``--rows N``: N rows of x through every product (a
verify step's k + 1 = 5 positions, a small batch: the native kernel shares each weight block's reads between up to 5
rows). ``--repeats`` runs of ours, then a tenth as many of XLA's, back to back (alternated one for one, a native
chain right after an XLA one, which makes a float32 copy of every weight, took up to twice its time); the table
gives the median and best time and the weight bytes streamed per second, and the ratio XLA's median time over ours.
Weights are made by XLA, so they start in the system's default pages; the native kernel asks for 2 MB pages on a
weight's second read (the warm-up runs make both).
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

LAYERS, HIDDEN, VOCAB = 12, 1024, 32000
SHAPES = [(3072, HIDDEN), (HIDDEN, HIDDEN), (1536, HIDDEN)] * LAYERS + [(VOCAB, HIDDEN)]


def weights(fmt: str):
    import jax
    import jax.numpy as jnp

    from kernels_pallas import quant

    keys = jax.random.split(jax.random.key(0), len(SHAPES))
    make = jax.jit(lambda k, shape: jax.random.normal(k, shape, jnp.float32) * 0.03, static_argnums=1)
    out = []
    for k, shape in zip(keys, SHAPES):
        w = make(k, shape)
        if fmt in ("bfloat16", "float32"):
            out.append(w.astype(fmt))
        else:
            out.append(jax.jit(lambda w: quant.quantize(w, quant.Format.parse(fmt)))(w))
    return out


def chain(implementation: str):
    import jax
    import jax.numpy as jnp

    from kernels_pallas import matvec

    @jax.jit
    def run(x, ws):
        for w in ws:
            y = matvec.group([(x, w, None)], implementation=implementation)[0]
            y = y[:, :HIDDEN]
            x = (y * jax.lax.rsqrt(jnp.mean(y * y) + 1e-6)).astype(x.dtype)
        return x

    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16, float32, or a packed format (int8, int4:g32, ...)")
    ap.add_argument("--rows", type=int, default=1, help="rows of x (positions or sequences) per product")
    ap.add_argument("--repeats", type=int, default=60, help="native runs (XLA's: a tenth)")
    ap.add_argument("--json", default=None, help="also write the times (seconds) to this file")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    ws = weights(args.dtype)
    nbytes = sum(sum(leaf.nbytes for leaf in jax.tree.leaves(w)) for w in ws)
    act = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    x = jnp.asarray(np.random.default_rng(0).standard_normal((args.rows, HIDDEN)), act)
    runs = {name: chain(impl) for name, impl in (("native", "cpu_native"), ("xla", "reference"))}
    for f in runs.values():
        for _ in range(3):
            f(x, ws).block_until_ready()
    times = {name: [] for name in runs}
    for name, f in runs.items():  # ours first: a run right after XLA's (a float32 copy of every weight) is slow
        for _ in range(args.repeats if name == "native" else max(3, args.repeats // 10)):
            t = time.perf_counter()
            f(x, ws).block_until_ready()
            times[name].append(time.perf_counter() - t)
    print(f"{len(SHAPES)} products of {args.rows} row(s), {nbytes / 1e6:.1f} MB of {args.dtype} weights")
    print("| implementation | median ms | best ms | GB/s (median) | GB/s (best) |")
    print("|---|---|---|---|---|")
    for name, ts in times.items():
        med, best = statistics.median(ts), min(ts)
        print(f"| {name} | {med * 1e3:.2f} | {best * 1e3:.2f} | {nbytes / med / 1e9:.1f} | {nbytes / best / 1e9:.1f} |")
    print(f"XLA / native (median): {statistics.median(times['xla']) / statistics.median(times['native']):.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=HERE).stdout.strip()
            json.dump({"commit": commit, "dtype": args.dtype, "rows": args.rows, "weight_bytes": nbytes,
                       "seconds": times}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
