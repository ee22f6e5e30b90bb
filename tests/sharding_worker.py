"""The 8-device side of tests/test_sharding_devices.py and tests/test_multihost.py (not collected by pytest).

    python -m tests.sharding_worker OUT.json WORKDIR [--processes N --process-id I --port P --cases k3:mix]

Sets ``--xla_force_host_platform_device_count`` before jax is imported (8 devices, or 8 / N per process), runs
each case -- a model, a mesh, a layout, an expert dispatch -- next to the unsharded run of the same model on one
device, and writes what the test asserts on: logits errors, greedy tokens, per-device shard shapes, cache specs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

DEVICES = 8
MESHES = {"tp": (1, 1, 8), "ep": (1, 8, 1), "mix": (2, 2, 2), "ep2tp4": (1, 2, 4)}
# model, mesh, layout, dispatch[, kernels[, "scan"]]. Both CPU exchanges (capacity all_to_all; the ragged offsets
# emulated) run. Every kernel op runs inside shard_map on its shard (kernels_pallas/_dispatch.py): with the automatic
# choice (reference / native CPU kernels) and, in the cases marked so, with the Pallas kernels in interpret mode;
# "scan": the model loaded with scanned layers (kimi_jax/model/layer_plan.py), its stacked weights and cache sharded.
CASES = [
    ("k3", "tp", "tp_ep", "capacity"),
    ("k3", "ep", "tp_ep", "capacity"),
    ("k3", "mix", "tp_ep", "ragged_emulated"),
    ("kimi_linear", "tp", "tp_ep", "capacity"),
    ("kimi_linear", "mix", "tp_ep", "capacity"),
    ("llama", "tp", "tp_ep", "capacity"),
    ("k3", "mix", "tp_ep", "capacity", None, "scan"),
]
# -m slow: more wide-EP, ragged-path and interpret-mode cases
SLOW_CASES = [
    ("k3", "tp", "wide_ep", "capacity"),  # wide expert parallelism: whole experts over the model axis
    ("llama", "ep", "tp_ep", "capacity"),
    ("llama", "mix", "tp_ep", "capacity", "pallas_interpret"),
    ("k3", "ep", "tp_ep", "ragged_emulated"),
    ("kimi_linear", "mix", "wide_ep", "ragged_emulated"),
    ("k3", "ep", "tp_ep", "capacity", "pallas_interpret"),
    ("kimi_linear", "tp", "tp_ep", "capacity", "pallas_interpret"),
    # CI time: Pallas (interpret) kernels inside shard_map stay in the default set through tests/test_aot_sharded.py's
    # compiles and the kernels' own multi-device tests
    ("k3", "mix", "tp_ep", "capacity", "pallas_interpret"),
    # CI time: expert parallelism stays in the default set with K3 ("ep"), the ragged path with K3 ("mix"), the
    # mixed mesh with K3 and Kimi Linear, the Llama-shaped model with tensor parallelism
    ("kimi_linear", "ep", "tp_ep", "ragged_emulated"),
    ("llama", "mix", "tp_ep", "capacity"),
]


def kernels(case) -> str | None:
    """The case's kernel implementation (None: the automatic choice)."""
    return case[4] if len(case) > 4 else None


def scanned(case) -> bool:
    return len(case) > 5 and case[5] == "scan"


B, T, CACHE = 8, 24, 48
LENGTHS = [T, T, T, 17, 9, T, 5, 20]  # right padding; rows 0-1 are the K3 fixture's golden prompts
STEPS = {"k3": 16, "kimi_linear": 8, "llama": 8}
K3_FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "k3-tiny-a")


def write_hf_models(workdir):
    """Tiny HF checkpoints with 8 heads and 8 experts, so an 8-way mesh can split heads and experts evenly."""
    from tests import hf_models

    paths = {"kimi_linear": os.path.join(workdir, "kimi_linear"), "llama": os.path.join(workdir, "llama")}
    if not os.path.exists(os.path.join(paths["kimi_linear"], "config.json")):
        hf_models.kimi_linear(paths["kimi_linear"], num_attention_heads=8, num_key_value_heads=8, linear_num_heads=8,
                              num_experts=8, seed=3)
    if not os.path.exists(os.path.join(paths["llama"], "config.json")):
        hf_models.llama(paths["llama"], num_attention_heads=8, num_key_value_heads=4, seed=4)
    return paths


def prompts(vocab, golden_rows: bool, seed=0):
    """[B, T] right-padded ids and lengths; with ``golden_rows`` rows 0-1 are the K3 fixture's golden prompts."""
    import numpy as np
    from safetensors.numpy import load_file

    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, (B, T)).astype(np.int32)
    if golden_rows:
        ids[:2] = load_file(os.path.join(K3_FIXTURE, "golden.safetensors"))["input_ids"]
    lengths = np.asarray(LENGTHS, np.int32)
    return np.where(np.arange(T)[None] < lengths[:, None], ids, 0).astype(np.int32), lengths


def greedy(model, ids, lengths, steps, cache_sharding=None, scan=False):
    """Prefill (logits [B, T, V]) then ``steps - 1`` decode steps; returns (logits, tokens [B, steps], cache)."""
    import jax.numpy as jnp
    from flax import nnx

    from kimi_jax.model.cache import init_cache

    prefill = nnx.jit(lambda m, x, n, c: m(x, cache=c, lengths=n))
    decode = nnx.jit(lambda m, x, c: m(x, cache=c, prefix=True))
    cache = init_cache(model.cfg, B, CACHE, jnp.float32, sharding=cache_sharding, scan=scan)
    out = prefill(model, jnp.asarray(ids), jnp.asarray(lengths), cache)
    logits = out.logits
    tok = jnp.argmax(jnp.take_along_axis(logits, jnp.asarray(lengths - 1)[:, None, None], axis=1)[:, 0], -1)
    tokens, cache = [tok], out.cache
    for _ in range(steps - 1):
        out = decode(model, tok[:, None], cache)
        cache = out.cache
        tok = jnp.argmax(out.logits[:, -1], -1)
        tokens.append(tok)
    return logits, jnp.stack(tokens, 1), cache


def _key(index):
    return tuple((s.start, s.stop) for s in index)


def shard_report(model):
    from flax import nnx

    from kimi_jax.model import params

    out = {}
    for name, a in params.leaves(nnx.state(model, nnx.Param)).items():
        shards = a.addressable_shards
        out[name] = {"shape": list(a.shape), "spec": str(a.sharding.spec),
                                         "shard": list(shards[0].data.shape),
                                         "distinct": len({_key(s.index) for s in shards})}
    return out


def _cache_entries(cache):
    """(name, entry) of every cache entry: "3" for layer 3, "stack.1" for position 1 of a scanned group."""
    return [(str(i), e) for i, e in enumerate(cache.layers) if e is not None] + \
        [(f"stack.{j}", e) for j, e in enumerate(cache.stack)]


def cache_report(cache):
    import jax

    out = {}
    for i, layer in _cache_entries(cache):
        for name, a in vars(layer).items():
            if a is None:  # KDACache.verify: only set inside a speculative verify call
                continue
            out[f"{i}.{name}"] = {"spec": str(a.sharding.spec), "shape": list(a.shape),
                                  "shard": list(a.addressable_shards[0].data.shape)}
    out["lengths"] = {"spec": str(cache.lengths.sharding.spec)}
    jax.block_until_ready(cache.lengths)
    return out


def valid_logits(logits, lengths):
    import numpy as np

    x = np.asarray(logits)
    return np.concatenate([x[b, : lengths[b]] for b in range(len(lengths))])


def run_cases(cases, paths, out, out_dir):
    import numpy as np
    from safetensors.numpy import load_file

    import kimi_jax
    from kimi_jax.model.cache import cache_shapes
    from kimi_jax.parallel import sharding

    golden = load_file(os.path.join(K3_FIXTURE, "golden.safetensors"))
    baselines = {}
    for case in cases:
        model_key, mesh_key, layout, dispatch = case[:4]
        impl = kernels(case)
        path = paths[model_key]
        t0 = time.perf_counter()
        if model_key not in baselines:
            base = kimi_jax.from_pretrained(path, dtype="float32")
            ids, lengths = prompts(base.cfg.vocab_size, model_key == "k3")
            logits, tokens, _ = greedy(base, ids, lengths, STEPS[model_key])
            baselines[model_key] = (ids, lengths, valid_logits(logits, lengths), np.asarray(tokens))
            rec = {"tokens": np.asarray(tokens).tolist(), "seconds": time.perf_counter() - t0}
            if model_key == "k3":
                rec["golden_logits_err"] = float(np.abs(np.asarray(logits)[:2] - golden["logits_prefill"]).max())
                rec["golden_tokens_equal"] = bool((np.asarray(tokens)[:2] == golden["greedy_tokens"]).all())
            out["baseline"][model_key] = rec
            t0 = time.perf_counter()
        ids, lengths, ref_logits, ref_tokens = baselines[model_key]
        mesh = sharding.make_mesh(*MESHES[mesh_key])
        scan = scanned(case)
        model = kimi_jax.from_pretrained(path, dtype="float32", mesh=mesh, layout=layout, scan_layers=scan)
        model.run = dataclasses.replace(model.run, implementation=impl,
                                        parallel=dataclasses.replace(model.run.parallel, dispatch=dispatch))
        cs = sharding.cache_shardings(model.cfg, cache_shapes(model.cfg, B, CACHE, "float32", scan=scan), mesh,
                                      layout)
        logits, tokens, cache = greedy(model, ids, lengths, STEPS[model_key], cs, scan)
        tokens = np.asarray(tokens)
        rec = {
            "model": model_key, "mesh": mesh_key, "sizes": dict(mesh.shape), "layout": layout, "dispatch": dispatch,
            "kernels": impl, "scan": scan, "logits_err": float(np.abs(valid_logits(logits, lengths) - ref_logits).max()),
            "max_logit": float(np.abs(ref_logits).max()),
            "tokens": tokens.tolist(), "tokens_equal": bool((tokens == ref_tokens).all()),
            "params": shard_report(model), "cache": cache_report(cache),
            "cache_as_planned": {f"{i}.{k}": getattr(layer, k).sharding.is_equivalent_to(
                getattr(planned, k), getattr(layer, k).ndim)
                for (i, layer), (_, planned) in zip(_cache_entries(cache), _cache_entries(cs)) for k in vars(layer)
                if getattr(layer, k) is not None},
            "seconds": time.perf_counter() - t0,
        }
        if model_key == "k3":
            rec["golden_logits_err"] = float(np.abs(np.asarray(logits)[:2] - golden["logits_prefill"]).max())
            rec["golden_tokens_equal"] = bool((tokens[:2] == golden["greedy_tokens"]).all())
            if mesh_key == "mix" and impl is None and not scan and "orbax" not in out:
                out["orbax"] = orbax_check(model, mesh, layout, out_dir)
        if model_key == "k3" and mesh_key == "ep" and impl is None:
            # the generation engineer's generate() on the sharded model (its own caches, buckets, while_loop)
            from kimi_jax.generation.generate import generate

            g = generate(model, [list(map(int, ids[b, : lengths[b]])) for b in range(B)], STEPS[model_key], stop=(),
                         max_len=CACHE + 16)
            rec["generate_tokens_equal"] = [list(map(int, t)) for t in g.tokens] == ref_tokens.tolist()
        out["cases"].append(rec)
        print(f"{model_key:12s} {mesh_key:4s} {layout:8s} {dispatch:16s} {impl or 'auto':16s} err {rec['logits_err']:.2e} "
              f"tokens {'==' if rec['tokens_equal'] else '!='} {rec['seconds']:.1f}s", file=sys.stderr, flush=True)


def orbax_check(hf_model, mesh, layout, workdir):
    """The converted (Orbax) fixture restored with ``from_pretrained(mesh=...)``: every parameter equal to the
    sharded safetensors load and laid out the same way."""
    import numpy as np
    from flax import nnx

    import kimi_jax
    from convert.converter import convert_checkpoint

    dst = os.path.join(workdir, "k3_orbax")
    if not os.path.exists(dst):
        convert_checkpoint(K3_FIXTURE, dst, dtype="float32", progress=False)
    model = kimi_jax.from_pretrained(dst, dtype="float32", mesh=mesh, layout=layout)
    from kimi_jax.model import params

    ref = params.leaves(nnx.state(hf_model, nnx.Param))
    rec = {"params": 0, "equal": 0, "same_sharding": 0, "sharded": 0}
    for name, a in params.leaves(nnx.state(model, nnx.Param)).items():
        b = ref[name]
        rec["params"] += 1
        rec["equal"] += bool(np.array_equal(np.asarray(a), np.asarray(b)))
        rec["same_sharding"] += bool(a.sharding.is_equivalent_to(b.sharding, a.ndim))
        rec["sharded"] += len({_key(s.index) for s in a.addressable_shards}) > 1
    rec["parallel"] = model.run.parallel is not None
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("workdir")
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--cases", default="all", help="all, slow, or model:mesh[:layout[:dispatch]],...")
    args = ap.parse_args()
    local = DEVICES // args.processes
    flags = os.environ.get("XLA_FLAGS", "")
    # O0 backend codegen halves compile time on these tiny models; numerics are the same in both runs compared.
    # The memory-minimising scheduler: see benchmarks/plan_vs_compiler.py.
    os.environ["XLA_FLAGS"] = (f"{flags} --xla_force_host_platform_device_count={local} "
                               "--xla_backend_optimization_level=0 "
                               "--xla_cpu_enable_concurrency_optimized_scheduler=false").strip()
    import jax

    if args.processes > 1:
        from kimi_jax.parallel import distributed

        distributed.initialize(f"127.0.0.1:{args.port}", args.processes, args.process_id)
    assert jax.device_count() == DEVICES, jax.devices()
    if args.cases in ("all", "slow"):
        cases = CASES if args.cases == "all" else SLOW_CASES
    else:
        cases = []
        for c in args.cases.split(","):
            parts = c.split(":")
            cases.append((parts[0], parts[1], parts[2] if len(parts) > 2 else "tp_ep",
                          parts[3] if len(parts) > 3 else "auto"))
    paths = {"k3": K3_FIXTURE}
    if any(c[0] != "k3" for c in cases):
        paths.update(write_hf_models(args.workdir))
    out = {"devices": jax.device_count(), "processes": jax.process_count(), "baseline": {}, "cases": []}
    if args.processes > 1:
        run_multihost(cases, paths, out)
    else:
        run_cases(cases, paths, out, args.workdir)
    with open(args.out if args.processes == 1 else f"{args.out}.{jax.process_index()}", "w") as f:
        json.dump(out, f)


def run_multihost(cases, paths, out):
    """Each process holds 8 / N of the devices; only the sharded run (a single-device run would need them all)."""
    import jax

    import kimi_jax
    from kimi_jax.checkpoint import hf
    from kimi_jax.model.cache import cache_shapes
    from kimi_jax.parallel import distributed, sharding

    for model_key, mesh_key, layout, dispatch in cases:
        mesh = sharding.make_mesh(*MESHES[mesh_key])
        model = kimi_jax.from_pretrained(paths[model_key], dtype="float32", mesh=mesh, layout=layout)
        load = dict(hf.LAST_LOAD)
        if dispatch != "auto":
            model.run = dataclasses.replace(model.run, parallel=dataclasses.replace(model.run.parallel, dispatch=dispatch))
        ids, lengths = prompts(model.cfg.vocab_size, model_key == "k3")
        cs = sharding.cache_shardings(model.cfg, cache_shapes(model.cfg, B, CACHE, "float32"), mesh, layout)
        _, tokens, _ = greedy(model, ids, lengths, STEPS[model_key], cs)
        # and the public generate() (bucketed prefill, while_loop decode, results gathered from both processes)
        from kimi_jax.generation.generate import generate

        g = generate(model, [list(map(int, ids[b, : lengths[b]])) for b in range(B)], STEPS[model_key], stop=(),
                     max_len=CACHE + 16)
        experts = model.layers[3].mlp.experts.w1.get_value().packed
        out["cases"].append({
            "model": model_key, "mesh": mesh_key, "layout": layout, "dispatch": model.run.parallel.dispatch,
            "tokens": distributed.process_allgather(tokens).tolist(),
            "generate_tokens": [list(map(int, t)) for t in g.tokens],
            "local_devices": sorted(d.id for d in jax.local_devices()),
            "expert_slices_here": sorted({_key(s.index)[0] for s in experts.addressable_shards}),
            "expert_shape": list(experts.shape), "load": load})


if __name__ == "__main__":
    main()
