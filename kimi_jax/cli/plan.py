"""``kimi-jax plan``: per-chip memory and roofline decode time of a model on a mesh (:mod:`kimi_jax.deploy.plan`),
what offloading moves (:mod:`kimi_jax.deploy.offload`), and with ``--compile`` the real compilers' verdict
(:mod:`kimi_jax.deploy.aot`)."""

from __future__ import annotations

import argparse
import sys

import jax.numpy as jnp

from kimi_jax.cli import common
from kimi_jax.deploy import aot, offload
from kimi_jax.deploy.plan import (CHIPS, GB, Plan, drafter_workspace, format_plan, make_plan, search,
                                  tpu_loop_expert_copies)
from kimi_jax.generation import speculative
from kimi_jax.model import config as C
from kimi_jax.model.run import check_offload
from kimi_jax.parallel import sharding
from kimi_jax.serving import validate


def add_plan_arguments(pl: argparse.ArgumentParser) -> None:
    pl.formatter_class = common.HelpFormatter
    pl.add_argument("--model", default="k3", help="preset (k3, kimi-linear-48b-a3b, kimi-dense) or model directory")
    pl.add_argument("--mesh", default="data=1,expert=64,model=8", help="AXIS=N,... over data, expert, model")
    pl.add_argument("--layout", default="tp_ep", help="sharding table: tp_ep or wide_ep")
    pl.add_argument("--batch", type=int, default=8, help="concurrent sequences")
    pl.add_argument("--context", type=int, default=131072, help="cache length per sequence (tokens)")
    pl.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="activation / parameter dtype planned")
    pl.add_argument("--kernels", default="pallas", choices=["pallas", "reference"],
                    help="reference = jnp kernels (CPU): adds their dequant / upcast workspace")
    pl.add_argument("--hbm-bandwidth", type=float, default=None, help="bytes/s for an extra roofline line")
    pl.add_argument("--chips", default=None, help="comma list of h100,h200,b200,v5p,v6e,v7x (default: all)")
    pl.add_argument("--reserve", type=float, default=0.1, help="HBM fraction kept free for the runtime")
    pl.add_argument("--prefill-chunk", type=int, default=None,
                    help="also estimate activations of a prefill chunk of this many tokens (with --compile: "
                         "the chunk compiled, default 512)")
    pl.add_argument("--search", action="store_true", help="list, per chip, the smallest meshes that fit")
    pl.add_argument("--compile", metavar="TARGET", default=None,
                    help="also compile a decode step and a prefill chunk for a real target, deviceless: "
                         "tpu:TOPOLOGY (tpu:v5e:2x2, tpu:v5p:4x4x4, tpu:tpu7x:4x4x2) or gpu:NAME:SxHxD "
                         "(gpu:h200:1x2x8: slices x hosts x GPUs); --mesh must use all its devices; exit status 0 "
                         "only when both compile and fit (needs the aot extra)")
    pl.add_argument("--scan-layers", action="store_true",
                    help="with --compile: the repeating run of layers as one scan over stacked weights (compiles "
                         "in a fraction of the time; see kimi_jax/model/layer_plan.py for what it costs per step)")
    pl.add_argument("--quantize", default=None, metavar="FORMAT",
                    help="weight-only format of the dense weights: int8, int4[:gN][:zero], nf4 (kimi_jax.quantize)")
    common.kv_cache_argument(pl)
    pl.add_argument("--kda-state", default=None, choices=["float32", "bfloat16"],
                    help="KDA recurrent state storage (default float32; the update runs in float32 either way)")
    pl.add_argument("--offload", default=None, metavar="KINDS",
                    help="comma list of experts,kda_state,cache kept in host memory: the bytes moved per chip, "
                         "the per-step copy traffic, and with --search the smallest meshes with it")
    pl.add_argument("--hot-experts", type=int, default=0, metavar="N",
                    help="with --offload experts: N routed experts per MoE layer (of each chip's) kept in device "
                         "memory as well (kimi_jax.model.hot_experts.keep_hot_experts)")
    pl.add_argument("--host-memory", type=float, default=256.0, metavar="GB",
                    help="with --offload --search: host memory per chip (default 256: a DGX H200's 2 TB / 8)")
    pl.add_argument("--serve", action="store_true",
                    help="plan (and with --compile, compile) the serving engine as `kimi-jax serve --mesh` runs it: "
                         "its paged cache for --slots sequences of --max-len tokens, a decode step over every slot, "
                         "prefill chunks of --prefill-chunk tokens of one sequence (--batch / --context do not apply)")
    pl.add_argument("--slots", type=int, default=8, help="with --serve: sequences decoded together")
    pl.add_argument("--max-len", type=int, default=2048, help="with --serve: prompt + new tokens of one request")
    pl.add_argument("--page-size", type=int, default=64, help="with --serve: tokens per page of the attention cache")
    pl.add_argument("--pages", type=int, default=None,
                    help="with --serve: pages in the pool (default: every slot at --max-len, plus half again)")
    pl.add_argument("--speculative", default=None, metavar="SPEC",
                    help="with --compile: also compile generate's speculative decode loop with this drafter "
                         "('ngram[:k=4,...]' or 'dspark:PATH[,k=N]'): the verify forward over k + 1 positions per "
                         "sequence (with --serve: the engine's verify step over every slot, and a DSpark drafter's "
                         "step). A DSpark PATH needs only the drafter's config.json (no weights): the plan counts its "
                         "weights (split over the mesh) and its context cache (the engine's pools: replicated), and "
                         "with a prefill chunk the chunk that writes its context is compiled too (not with --serve)")
    pl.add_argument("--layers", type=int, default=None, help="slice the model to its first N layers")
    pl.add_argument("--experts", type=int, default=None, help="slice the routed experts to the first N")
    pl.set_defaults(func=run)


def run(args) -> int:
    try:
        return _plan(args)
    except aot.CompilerMissing as e:  # --compile without the aot extra: an install step, not a bug
        print(f"kimi-jax plan: error: {e}", file=sys.stderr)
        return 2


def _plan(args) -> int:
    """``kimi-jax plan``. Returns the exit status: with ``--compile``, 0 only
    when every compiled program fits the target's HBM."""
    target = None
    # a wrong spec is named at once; a DSpark drafter from its config alone (abstract), in the planned dtype
    drafter = speculative.parse(args.speculative, dtype=args.dtype, weights=False)
    if drafter is not None and not args.compile:
        raise ValueError("--speculative compiles the speculative programs for a target: it needs --compile")
    if args.compile:
        target = aot.parse_target(args.compile)  # before any slow work: an unknown target fails at once
        aot.cpu_runtime()  # before the plan's first jnp call starts JAX's backends
    cfg = C.preset(args.model) if args.model in C.PRESETS else C.load(args.model)
    if args.layers or args.experts:
        cfg = cfg.sliced(args.layers, args.experts)
    dspark = drafter.model.cfg if isinstance(drafter, speculative.DSpark) else None
    if dspark is not None:
        dspark.check_target(cfg)  # a drafter for another target (or taps past a --layers slice) is named at once
    chips = args.chips.split(",") if args.chips else list(CHIPS)
    unknown = [c for c in chips if c not in CHIPS]
    if unknown:
        raise ValueError(f"--chips: unknown {unknown}; known: {sorted(CHIPS)}")
    if not 0 <= args.reserve < 1:
        raise ValueError(f"--reserve {args.reserve} must be in [0, 1)")
    sizes = sharding.parse_mesh(args.mesh)
    sharding.check_expert_split(cfg, sizes, args.layout)
    if target is not None:
        aot.target_mesh(target, **sizes)  # a mesh that does not use the target's devices fails before the plan
    chunk = args.prefill_chunk if args.prefill_chunk is not None else (COMPILE_PREFILL_CHUNK if target else 0)
    serve = None
    if args.serve:  # the engine's own checks of its shapes, before any slow work
        if args.kda_state or args.offload:
            raise ValueError("--serve: the serving engine keeps its cache on the device and its KDA state in float32 "
                             "(no --kda-state or --offload)")
        chunk = args.prefill_chunk or SERVE_PREFILL_CHUNK
        serve = validate.shapes(slots=args.slots, max_len=args.max_len, page_size=args.page_size, pages=args.pages,
                                prefill_chunk=chunk, min_chunk=chunk, snapshot_every=None, compact_decode=True)
    cache_options = dict(kv_cache=args.kv_cache, kda_state=args.kda_state)
    p = make_plan(cfg, sizes, args.layout, batch=args.batch, context=args.context, dtype=args.dtype,
                  kernels=args.kernels, prefill_chunk=chunk, quantize=args.quantize, **cache_options, serve=serve,
                  drafter=dspark, model_name=args.model + (f" ({args.quantize} weights)" if args.quantize else ""))
    print(format_plan(p, chips, args.reserve, args.hbm_bandwidth))
    if args.offload:
        _offload_cli(cfg, p, args, chips)
    if target is not None:
        return _compile_cli(cfg, target, p, args, chunk, serve, drafter)
    if args.search:
        print("\nsmallest fitting meshes (data=1), per chip:")
        for name, plans in search(cfg, args.layout, batch=args.batch, context=args.context, dtype=args.dtype,
                                  kernels=args.kernels, chips=chips, reserve=args.reserve,
                                  quantize=args.quantize, **cache_options).items():
            if not plans:
                print(f"  {CHIPS[name].name:<18} none up to 512 chips")
            for q in plans:
                t = q.step_seconds(CHIPS[name].hbm_bandwidth)
                print(f"  {CHIPS[name].name:<18} {q.chips:4d} chips expert={q.sizes['expert']:<4d}"
                      f"model={q.sizes['model']:<3d} {q.total / GB:7.1f} GB/chip  {t * 1e3:6.2f} ms/step")
    return 0


def _offload_cli(cfg, p: Plan, args, chips):
    """``--offload``: what moves to host memory on this mesh, and with ``--search`` the smallest meshes with it."""
    kinds = check_offload(args.offload)
    kw = dict(batch=args.batch, context=args.context, dtype=args.dtype, quantize=args.quantize)
    hot = getattr(args, "hot_experts", 0) or 0
    o = offload.offload_bytes(cfg, kinds, p.sizes, args.layout, hot=hot, **kw)
    print("\n" + offload.format_offload(o))
    print(f"  left on each chip: {(p.total - o.device_freed) / GB:.2f} GB of the plan's {p.total / GB:.2f} GB")
    if not args.search:
        return
    print(f"\nsmallest fitting meshes with {','.join(kinds)} in host memory ({args.host_memory:g} GB of it per chip; "
          f"data=1), per chip:")
    for name in chips:
        rows = offload.offload_plan(cfg, kinds, args.layout, chip=name, reserve=args.reserve,
                                    host_bytes=args.host_memory * GB, hot=hot, **kw)
        r = rows["with"]
        if r is None:
            print(f"  {CHIPS[name].name:<18} none up to 512 chips")
            continue
        before = rows["without"]["chips"] if rows["without"] else "none"
        whole = "" if r["h2d_whole_layers"] == r["h2d_per_step"] else \
            f" (every local expert: {r['whole_layer_seconds'] * 1e3:.2f})"
        print(f"  {CHIPS[name].name:<18} {r['chips']:4d} chips (without: {before}) {r['device'] / GB:7.1f} GB/chip on "
              f"device, {r['host'] / GB:7.1f} GB/chip in host memory, {r['copy_seconds'] * 1e3:8.2f} ms/step of "
              f"copies{whole}")


COMPILE_PREFILL_CHUNK = 512  # ``plan --compile`` without --prefill-chunk: a typical prefill chunk
SERVE_PREFILL_CHUNK = 256  # ``plan --serve`` without --prefill-chunk: ``kimi-jax serve``'s default


def _compile_cli(cfg, target, p: Plan, args, chunk: int, serve=None, drafter=None) -> int:
    """Compile the decode step and a prefill chunk for ``target``; print them beside the plan; exit status."""
    implementation = "reference" if args.kernels == "reference" else None  # None: the automatic (Pallas) choice
    kw = dict(batch=args.batch, context=args.context, dtype=args.dtype, prefill_chunk=chunk,
              implementation=implementation, scan_layers=args.scan_layers, quantize=args.quantize,
              kv_cache=args.kv_cache, kda_state=args.kda_state, serve=serve,
              speculative=drafter)
    res = aot.compile_steps(cfg, target, p.sizes, args.layout, **kw)
    devices = len(aot.target_devices(target))
    source = "its target config" if target.platform == "gpu" else "datasheet table"
    layers = "scanned layers" if args.scan_layers else "unrolled layers"
    print(f"\ncompiled for {target.text}: {devices} device(s) of {aot.target_devices(target)[0].device_kind}, "
          f"{aot.hbm_bytes(target) / GB:.2f} GB HBM each ({source}), {args.kernels} kernels, {layers}")
    dspark = drafter.model.cfg if isinstance(drafter, speculative.DSpark) else None
    plan_act = {"decode": p.activation_total, "prefill": sum(p.prefill_activations.values())}
    plan_args = dict.fromkeys(res, p.param_total + p.cache_total)
    if drafter is not None:
        # the loop also holds each sequence's output and token history (int32, 3 x context); a DSpark drafter its
        # weights and context cache (in p.drafter). The verify forward's activations are a decode step's over k + 1
        # positions; a DSpark drafter adds its drafting step's (plan.drafter_workspace)
        plan_args["speculative"] = p.param_total + p.cache_total + p.drafter_total + args.batch * 3 * args.context * 4
        plan_act["speculative"] = p.activation_total * (drafter.k + 1)
        if target.platform == "tpu":  # the MoE kernel's relayout copies of the experts, hoisted out of the loop
            plan_act["speculative"] += tpu_loop_expert_copies(cfg, p.sizes, args.layout, args.dtype, args.quantize)
        if dspark is not None:
            plan_act["speculative"] += drafter_workspace(dspark, args.batch, args.context, drafter.k, p.sizes,
                                                         args.layout)
            plan_args["prefill_tapped"] = p.param_total + p.cache_total + p.drafter_total
            # a fresh chunk's activations, plus the tapped layers' hidden states and the drafter's context input
            taps = len(dspark.target_layer_ids) * dspark.target_hidden_size + dspark.hidden_size
            itemsize = jnp.dtype(args.dtype).itemsize
            plan_act["prefill_tapped"] = plan_act["prefill"] + args.batch * chunk * taps * itemsize
    titles = {"decode": f"decode step ([{args.batch}, 1] ids)",
              "prefill": f"prefill chunk ([{args.batch}, {chunk}] ids, fresh)",
              "speculative": f"speculative decode loop ({args.speculative}: verify over [{args.batch}, "
                             f"{drafter.k + 1 if drafter else 0}] ids)",
              "prefill_tapped": f"prefill chunk writing the drafter's context ([{args.batch}, {chunk}] ids after "
                                "cached ones, tapped hidden states)"}
    if serve is not None:
        titles = {"decode": f"serving decode step ({serve.slots} slots, page table of {serve.pages_per_seq} pages)",
                  "prefill": f"serving prefill chunk ([1, {chunk}] ids after cached ones)"}
        if drafter is not None:
            _serve_drafting(titles, plan_args, plan_act, p, args, serve, drafter)
    for name, r in res.items():
        print(format_compiled(titles[name], plan_args[name], plan_act[name], r))
    return 0 if all(r["fits"] for r in res.values()) else 1


def _serve_drafting(titles, plan_args, plan_act, p: Plan, args, serve, drafter) -> None:
    """The plan's side of the engine's verify step and a DSpark drafter's step (``plan --serve --speculative``): the
    verify step takes the decode step's arguments and k + 1 positions' activations; the drafter's step its weights
    (split), its pools (replicated), the target's embedding and lm_head, and its drafting workspace over each slot's
    pages gathered from the pools (each chip gathers the rows and positions its share of the MLA op reads, as a
    static context cache is split)."""
    K1 = drafter.k + 1
    titles["verify"] = f"serving verify step ({serve.slots} slots x {K1} positions, {args.speculative})"
    plan_act["verify"] = p.activation_total * K1
    if isinstance(drafter, speculative.DSpark):
        dcfg = drafter.model.cfg
        titles["draft"] = f"the DSpark drafter's step (context of the kept positions, {drafter.k} drafts per slot)"
        plan_args["draft"] = p.drafter_total + p.params.get("embedding + lm_head", 0)
        L = serve.pages_per_seq * serve.page_size
        view = sharding.draft_cache_bytes(dcfg, serve.slots, L, args.dtype, p.sizes, args.layout)
        plan_act["draft"] = view + drafter_workspace(dcfg, serve.slots, L, drafter.k, p.sizes, args.layout)


def format_compiled(title: str, plan_args: int, plan_act: int, r: dict) -> str:
    """One compiled program beside the plan, per device: arguments, activations, peak; time and fit."""
    if "error" in r:
        what = f"does NOT fit ({r['hbm'] / GB:.2f} GB HBM)" if r["oom"] else "did NOT compile"
        return f"{title}: {what}: {r['error']}"
    verdict = "fits" if r["fits"] else "does NOT fit"
    lines = [f"{title}: compiled in {r['compile_seconds']:.1f} s, {r['pallas_calls']} Pallas kernel calls, "
             f"{verdict} ({r['peak'] / GB:.3f} GB peak of {r['hbm'] / GB:.2f} GB); the compiler counts "
             f"{r.get('bytes_accessed', 0) / GB:.2f} GB accessed per device",
             f"  {'per device':<40}{'plan':>12}{'compiler':>12}{'plan/compiler':>15}"]
    rows = [("arguments (parameters + cache + ids)", plan_args, r["argument"]),
            ("activations (temp + outputs - aliased)", plan_act, r["temp"] + r["output"] - r["alias"]),
            ("peak", plan_args + plan_act, r["peak"])]
    for label, a, x in rows:
        ratio = f"{a / x:>15.3f}" if x else f"{'-':>15}"
        lines.append(f"  {label:<40}{a / GB:>9.3f} GB{x / GB:>9.3f} GB{ratio}")
    return "\n".join(lines)
