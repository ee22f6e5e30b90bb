"""Plan vs compiler: compile the full-size Kimi K3 decode step (93 layers, 896 experts, abstract parameters: no
memory) on a simulated mesh of CPU devices and compare XLA's per-device memory analysis with `kimi-jax plan`.

    python benchmarks/plan_vs_compiler.py --mesh data=1,expert=8,model=8 --batch 8 --context 131072

The device count is set from the mesh before jax is imported. Prints one table and, with --json, the numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="k3", help="preset name or model directory")
    ap.add_argument("--mesh", default="data=1,expert=8,model=8")
    ap.add_argument("--layout", default="tp_ep")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layers", type=int, default=None, help="slice the model to its first N layers")
    ap.add_argument("--experts", type=int, default=None, help="slice the routed experts to the first N")
    ap.add_argument("--json", default=None, help="write the numbers here")
    args = ap.parse_args(argv)

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from kimi_jax.parallel.sharding import parse_mesh

    sizes = parse_mesh(args.mesh)
    n = math.prod(sizes.values())
    flags = os.environ.get("XLA_FLAGS", "")
    # XLA:CPU's default concurrency-optimised scheduler starts every independent op early; with no bf16 dot on CPU
    # that means a float32 copy of every bf16 weight live at once (31.6 GB of temporaries per device at full size).
    # The memory-minimising scheduler is the one comparable to TPU/GPU compilers, which schedule under a memory limit.
    os.environ["XLA_FLAGS"] = (f"{flags} --xla_force_host_platform_device_count={n} "
                               "--xla_cpu_enable_concurrency_optimized_scheduler=false").strip()

    import jax

    from kimi_jax.model import config as C
    from kimi_jax.deploy import plan
    from kimi_jax.parallel import sharding

    if jax.device_count() != n:
        sys.exit(f"expected {n} devices, got {jax.device_count()} (was jax imported before XLA_FLAGS was set?)")
    cfg = C.preset(args.model) if args.model in C.PRESETS else C.load(args.model)
    if args.layers or args.experts:
        cfg = cfg.sliced(args.layers, args.experts)
    mesh = sharding.make_mesh(**sizes)
    p, r, xla = plan.compare_with_compiler(cfg, mesh, args.layout, batch=args.batch, context=args.context,
                                           dtype=args.dtype, model_name=args.model)
    print(plan.format_plan(p))
    print()
    print(plan.format_comparison(p, r, xla))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mesh": sizes, "layout": args.layout, "batch": args.batch, "context": args.context,
                       "layers": cfg.num_layers, "experts": cfg.moe.num_experts if cfg.moe else 0,
                       "plan": {"params": p.param_total, "cache": p.cache_total, "activations": p.activation_total,
                                "total": p.total},
                       "plan_reference_kernels": {"activations": r.activation_total, "total": r.total},
                       "xla": xla}, f, indent=1)


if __name__ == "__main__":
    main()
