"""Scanned vs unrolled layers, as the real TPU / GPU compilers see them (deviceless, kimi_jax/deploy/aot.py).

For one model and target, compiles the decode step and a prefill chunk twice -- layers unrolled, and the repeating
run of layers as one ``lax.scan`` over stacked weights (kimi_jax/model/layer_plan.py) -- and prints, per program:
compile seconds, Pallas kernel calls, per-device peak and temporaries, and the bytes the compiler's cost model says
the program accesses. The scan's price shows in the last two: every iteration's slice of a stacked weight (and of
the stacked cache) is copied into a buffer of its own before the kernel or dot that reads it.

    python benchmarks/scan_layers.py --target tpu:v5p:2x2x1 --mesh data=1,expert=2,model=2 --layers 9 --experts 64
    python benchmarks/scan_layers.py --target tpu:v5p:4x4x4 --mesh data=1,expert=8,model=8   # full-size K3
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kimi_jax.model import config as C  # noqa: E402
from kimi_jax.model.layer_plan import layer_plan  # noqa: E402
from kimi_jax.deploy import aot  # noqa: E402
from kimi_jax.parallel import sharding  # noqa: E402

GB = 1e9


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="k3")
    ap.add_argument("--target", default="tpu:v5p:2x2x1")
    ap.add_argument("--mesh", default="data=1,expert=2,model=2")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--prefill-chunk", type=int, default=512, help="0: decode step only")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    cfg = C.preset(args.model) if args.model in C.PRESETS else C.load(args.model)
    if args.layers or args.experts:
        cfg = cfg.sliced(args.layers, args.experts)
    plan = layer_plan(cfg, True)
    print(f"{args.model}: {cfg.num_layers} layers; scanned: layers {plan.start}..{plan.stop - 1} as {plan.count} "
          f"groups of {plan.period}; target {args.target}, mesh {args.mesh}, batch {args.batch}, "
          f"context {args.context}", flush=True)
    target = aot.parse_target(args.target)
    sizes = sharding.parse_mesh(args.mesh)
    results = {}
    for scan in (False, True):
        res = aot.compile_steps(cfg, target, sizes, batch=args.batch, context=args.context,
                                prefill_chunk=args.prefill_chunk, scan_layers=scan)
        results["scanned" if scan else "unrolled"] = res
        for step, r in res.items():
            name = f"{'scanned' if scan else 'unrolled'} {step}"
            if "error" in r:
                print(f"{name:18s} {r['error']}", flush=True)
                continue
            print(f"{name:18s} compile {r['compile_seconds']:7.1f} s  Pallas calls {r['pallas_calls']:4d}  "
                  f"peak {r['peak'] / GB:8.3f} GB  temp {r['temp'] / GB:7.3f} GB  "
                  f"accessed {r['bytes_accessed'] / GB:8.3f} GB", flush=True)
    for step in results["unrolled"]:
        a, b = results["unrolled"][step], results["scanned"][step]
        if "error" not in a and "error" not in b:
            print(f"{step}: compile {a['compile_seconds'] / b['compile_seconds']:.1f}x faster scanned; "
                  f"bytes accessed {b['bytes_accessed'] / max(a['bytes_accessed'], 1):.2f}x, "
                  f"temporaries {(b['temp'] - a['temp']) / GB:+.3f} GB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "plan": vars(plan), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
