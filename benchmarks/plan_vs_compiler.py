"""Plan vs compiler: compile a step of a model (default: full-size Kimi K3, abstract parameters: no memory) and
compare the compiler's per-device memory analysis with ``kimi-jax plan``'s figures.

    python benchmarks/plan_vs_compiler.py --mesh data=1,expert=8,model=8 --batch 8 --context 131072
    python benchmarks/plan_vs_compiler.py --target tpu:v5p:4x4x4 --mesh data=1,expert=8,model=8 --batch 64 \\
        --context 131072 --prefill-chunk 512 --scan-layers
    python benchmarks/plan_vs_compiler.py --target gpu:h200:1x2x8 --mesh data=1,expert=2,model=8 --serve \\
        --slots 8 --max-len 32768 --scan-layers

Without ``--target`` the decode step compiles for simulated CPU devices (the device count set from the mesh before
jax is imported); with it, for that TPU / GPU target with its own compiler, deviceless (the aot extra). ``--serve``
compiles the serving engine's decode step and prefill chunk over its paged cache instead. Prints a table per program
and writes the numbers, with the commit, into ``benchmarks/results/`` (``--json`` elsewhere).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _row(label, plan_bytes, xla_bytes) -> str:
    ratio = f"{plan_bytes / xla_bytes:9.3f}" if xla_bytes else f"{'-':>9}"
    return f"{label:<44}{plan_bytes / 1e9:>10.3f} GB{xla_bytes / 1e9:>10.3f} GB{ratio}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="k3", help="preset name or model directory")
    ap.add_argument("--mesh", default="data=1,expert=8,model=8")
    ap.add_argument("--layout", default="tp_ep")
    ap.add_argument("--target", default=None, help="tpu:TOPOLOGY or gpu:NAME:SxHxD (default: simulated CPU devices)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--prefill-chunk", type=int, default=0, help="also a fresh prefill chunk of this many tokens")
    ap.add_argument("--serve", action="store_true", help="the serving engine's programs (--slots, --max-len, ...)")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--scan-layers", action="store_true")
    ap.add_argument("--layers", type=int, default=None, help="slice the model to its first N layers")
    ap.add_argument("--experts", type=int, default=None, help="slice the routed experts to the first N")
    ap.add_argument("--json", default=None, help="write the numbers here (default: benchmarks/results/...)")
    args = ap.parse_args(argv)

    sys.path.insert(0, os.path.join(HERE, ".."))
    from kimi_jax.parallel.sharding import parse_mesh

    sizes = parse_mesh(args.mesh)
    n = math.prod(sizes.values())
    if args.target is None:
        flags = os.environ.get("XLA_FLAGS", "")
        # XLA:CPU's default concurrency-optimised scheduler starts every independent op early; with no bf16 dot on
        # CPU that holds a float32 copy of every bf16 weight at once. The memory-minimising scheduler is the one
        # comparable to the TPU / GPU compilers, which schedule under a memory limit.
        os.environ["XLA_FLAGS"] = (f"{flags} --xla_force_host_platform_device_count={n} "
                                   "--xla_cpu_enable_concurrency_optimized_scheduler=false").strip()

    import jax

    from kimi_jax.deploy import aot, plan
    from kimi_jax.deploy.compile import compile_step
    from kimi_jax.model import config as C
    from kimi_jax.parallel import sharding
    from kimi_jax.serving import validate

    cfg = C.preset(args.model) if args.model in C.PRESETS else C.load(args.model)
    if args.layers or args.experts:
        cfg = cfg.sliced(args.layers, args.experts)
    serve = None
    if args.serve:
        chunk = args.prefill_chunk or 256
        serve = validate.shapes(slots=args.slots, max_len=args.max_len, page_size=args.page_size, pages=None,
                                prefill_chunk=chunk, min_chunk=chunk, snapshot_every=None, compact_decode=True)
    p = plan.make_plan(cfg, sizes, args.layout, batch=args.batch, context=args.context, dtype=args.dtype,
                       prefill_chunk=args.prefill_chunk, serve=serve, model_name=args.model)
    kw = dict(dtype=args.dtype, scan_layers=args.scan_layers)
    if args.target is None:
        if jax.device_count() != n:
            sys.exit(f"expected {n} devices, got {jax.device_count()} (was jax imported before XLA_FLAGS was set?)")
        mesh = sharding.make_mesh(**sizes)
        res = {"decode": compile_step(cfg, mesh, args.layout, batch=args.batch, context=args.context, **kw)}
    else:
        res = aot.compile_steps(cfg, aot.parse_target(args.target), sizes, args.layout, batch=args.batch,
                                context=args.context, prefill_chunk=args.prefill_chunk, serve=serve, **kw)
    args_plan = p.param_total + p.cache_total
    act_plan = {"decode": p.activation_total, "prefill": sum(p.prefill_activations.values())}
    print(plan.format_plan(p))
    out = {"commit": _commit(), "date": datetime.date.today().isoformat(), "machine": platform.machine(),
           "target": args.target or f"cpu x {n}", "model": args.model, "layers": cfg.num_layers,
           "mesh": sizes, "layout": args.layout, "batch": args.batch, "context": args.context,
           "prefill_chunk": args.prefill_chunk, "serve": None if serve is None else serve.__dict__,
           "scan_layers": args.scan_layers, "experts": cfg.moe.num_experts if cfg.moe else 0,
           # the decode step, as the CI test reads it: the plan by category and the compiler's analysis
           "plan": {"params": p.param_total, "cache": p.cache_total, "activations": p.activation_total,
                    "total": p.total},
           "xla": res["decode"], "programs": {}}
    for name, r in res.items():
        print(f"\n{name}:")
        if "error" in r:
            print(f"  did not compile or fit: {r['error']}")
            out["programs"][name] = {"error": r["error"]}
            continue
        act = r["temp"] + r["output"] - r["alias"]
        print(f"{'per device':<44}{'plan':>13}{'compiler':>13}{'plan/compiler':>14}")
        print(_row("arguments (parameters + cache)", args_plan, r["argument"]))
        print(_row("activations (temp + outputs - aliased)", act_plan[name], act))
        print(_row("peak", args_plan + act_plan[name], r["peak"]))
        out["programs"][name] = {"plan": {"arguments": args_plan, "activations": act_plan[name],
                                          "peak": args_plan + act_plan[name]},
                                 "compiler": {k: r[k] for k in ("argument", "output", "alias", "temp", "peak",
                                                                "compile_seconds") if k in r}}
    path = args.json or os.path.join(HERE, "results", "plan_vs_compiler_{}_{}_{}{}.json".format(
        args.model, (args.target or "cpu").replace(":", "-"), "serve" if serve else f"b{args.batch}",
        "_scan" if args.scan_layers else ""))
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
