"""What a speculative verify forward costs on this machine: the target over ``k + 1`` positions (KDA layers in verify
mode, continuing a 200-token cache) against one decode position, for the demo model and the shared benchmark model,
and the speed-up a drafter could reach if every draft were accepted, ``(k + 1) / cost``.

    python benchmarks/verify_cost.py [--models demo,bench] [--dtypes bfloat16,float32] [--positions 1,5,9,17]
                                     [--batch 1] [--compare PLAIN_ROWS,GATHER_PAIRS] [--replay]

Each measurement is a compiled loop of ``--loop`` forwards (the host out of it), timed ``--repeats`` times; the
table gives medians in ms per forward. ``--compare 5,16`` also runs, alternated with the default in the same
process, the automatic kernel choice with ``kernels_pallas.matvec.PLAIN_ROWS`` and ``kernels_pallas.experts.
GATHER_PAIRS`` set to those values (the rule before this benchmark's commit: 5 and 16 -- a packed experts' bound,
bfloat16 experts were sorted past their count -- so the table shows what the rule bought); the constants are read
when a forward is traced. ``--replay`` also times each verify forward followed by its KDA commit over every position
(the rollback's replay of the recorded recurrence inputs), alternated with the forward alone. The speculative loop
adds its own work to a verify forward (drafting, acceptance, the KDA commit): ``benchmarks/speculative.py`` measures
the whole, with text. Results go to
``benchmarks/results/verify_cost.json`` with the commit.
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

CONTEXT = 200


def timed_forward(model, T: int, B: int, loop: int, rules=None, commit: bool = False):
    """A compiled function running ``loop`` forwards over ``T`` positions from a ``CONTEXT``-token cache, with
    ``rules`` = (PLAIN_ROWS, GATHER_PAIRS) set while it is traced (None: as they are); and its arguments. ``commit``:
    each verify forward's cache is committed over all ``T`` positions too (the KDA layers' replay,
    :func:`kimi_jax.model.attention.commit_verified`), its states summed into the result so that the replay runs."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import kernels_pallas.experts as experts
    import kernels_pallas.matvec as matvec
    from kimi_jax.model.attention import commit_verified
    from kimi_jax.model.cache import KDACache, for_verify, init_cache

    ids = jnp.asarray(np.random.default_rng(0).integers(5, model.cfg.vocab_size, (B, CONTEXT)), jnp.int32)
    prefill = nnx.jit(lambda m, x, c: m(x, cache=c, lengths=jnp.full((B,), CONTEXT), prefix=False).cache)
    cache = prefill(model, ids, init_cache(model.cfg, B, CONTEXT + 32, model.run.dtype))
    graph, params = nnx.split(model)
    leaves, tree = jax.tree.flatten(params)

    def run(leaves, cache, x):
        m = nnx.merge(graph, jax.tree.unflatten(tree, leaves))

        def one(i, acc):
            c = cache if T == 1 else for_verify(cache, T)
            out = m(x + i % 2, cache=c, lengths=jnp.full((B,), T), prefix=True)
            acc = acc + out.logits[0, -1, 0].astype(jnp.float32)
            if commit and T > 1:
                kept = commit_verified(out.cache, cache.lengths, jnp.full((B,), T), m.run)
                acc = acc + sum(e.state[..., 0, 0, 0].sum() for e in kept.layers if isinstance(e, KDACache))
            return acc

        return jax.lax.fori_loop(0, loop, one, jnp.float32(0))

    f = jax.jit(run)
    args = (leaves, cache, ids[:, :T])
    saved = matvec.PLAIN_ROWS, experts.GATHER_PAIRS
    if rules is not None:
        matvec.PLAIN_ROWS, experts.GATHER_PAIRS = rules
    try:
        jax.block_until_ready(f(*args))  # traced and compiled here
    finally:
        matvec.PLAIN_ROWS, experts.GATHER_PAIRS = saved
    return f, args


def measure(fns: dict, loop: int, repeats: int) -> dict:
    """Median ms per forward of each function, the functions alternated in every repeat."""
    import jax

    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, (f, args) in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[name].append((time.perf_counter() - t) / loop * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="demo,bench")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--positions", default="1,5,9,17", help="k + 1 for each verify forward (1: the decode step)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--loop", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--compare", default=None, metavar="PLAIN_ROWS,GATHER_PAIRS",
                    help="also run the automatic choice with these bounds, alternated with the default")
    ap.add_argument("--replay", action="store_true",
                    help="also time each verify forward with its KDA commit (the rollback's replay), alternated")
    ap.add_argument("--weights", default=os.path.join(os.path.expanduser("~"), ".cache", "kimi-jax", "kimi-linear-bench"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "verify_cost.json"))
    args = ap.parse_args(argv)

    import jax

    import kimi_jax
    from benchmarks.decode import BENCH_CONFIG, build_weights
    from kimi_jax.model.config import demo_model_dir

    positions = sorted({1, *(int(t) for t in args.positions.split(","))})
    compare = tuple(int(v) for v in args.compare.split(",")) if args.compare else None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} cores, load average {load[0]:.2f}; jax {jax.__version__}; commit {commit}; "
          f"batch {args.batch}, {CONTEXT}-token context, {args.loop} forwards per call, median of {args.repeats}"
          + (f"; compared with PLAIN_ROWS, GATHER_PAIRS = {compare}" if compare else ""), flush=True)
    rows = []
    for name in args.models.split(","):
        if name == "demo":
            path = demo_model_dir()
        elif name == "bench":
            path = build_weights(args.weights, BENCH_CONFIG)
        else:
            raise SystemExit(f"--models: unknown {name!r} (demo, bench)")
        for dtype in args.dtypes.split(","):
            model = kimi_jax.from_pretrained(path, dtype=dtype, progress=False)
            base = None
            for T in positions:
                fns = {"ms": timed_forward(model, T, args.batch, args.loop)}
                if compare:
                    fns["compared_ms"] = timed_forward(model, T, args.batch, args.loop, compare)
                if args.replay and T > 1:
                    fns["replay_ms"] = timed_forward(model, T, args.batch, args.loop, commit=True)
                row = {"model": name, "dtype": dtype, "batch": args.batch, "positions": T,
                       **measure(fns, args.loop, args.repeats)}
                base = row if T == 1 else base
                row["cost"] = row["ms"] / base["ms"]
                row["ceiling"] = T / row["cost"]
                if compare:
                    row["compared_cost"] = row["compared_ms"] / base["compared_ms"]
                rows.append(row)
                shown = f", compared {row['compared_ms']:.3f} ms" if compare else ""
                shown += f", with the KDA commit {row['replay_ms']:.3f} ms" if "replay_ms" in row else ""
                print(f"{name:5s} {dtype:8s} b={args.batch} {T:2d} positions: {row['ms']:.3f} ms{shown}; "
                      f"{row['cost']:.2f} decode steps, full acceptance at most {row['ceiling']:.2f}x", flush=True)
    extra = "compared ms | " if compare else ""
    print(f"\n| model | dtype | positions | ms | {extra}decode steps | speed-up at full acceptance |\n|---|---|---|---|"
          + ("---|" if compare else "") + "---|---|")
    for r in rows:
        c = f"{r['compared_ms']:.3f} | " if compare else ""
        print(f"| {r['model']} | {r['dtype']} | {r['positions']} | {r['ms']:.3f} | {c}{r['cost']:.2f} | "
              f"{r['ceiling']:.2f}x |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"commit": commit, "batch": args.batch, "context": CONTEXT, "loop": args.loop,
                   "repeats": args.repeats, "compare": compare, "replay": args.replay, "cores": os.cpu_count(),
                   "load_average": load[0],
                   "when": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
