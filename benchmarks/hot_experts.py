"""How much of a decode step's expert traffic a hot set saves: the shipped demo model (trained K3 10.1M: 8 routed
experts per MoE layer, top-2), experts offloaded to host memory, the ``H`` most used per layer kept on the device too
(:func:`kimi_jax.model.hot_experts.keep_hot_experts`).

    python benchmarks/hot_experts.py [--calibration 64] [--tokens 256]

Usage is counted on sequences of the model's training text (:func:`hot_experts.expert_usage`); the hit rate -- the share
of routed choices that land in the hot set, i.e. of per-slot copies a decode step no longer makes -- is measured on
its held-out text, next to ``H / E`` (what a hot set buys when routing is uniform). Also prints the host -> device
bytes of one decode step as the GPU compiler schedules them (deviceless, batch 1), with and without a hot set:
every expert copy then sits in a branch that runs only for a cold choice.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "scripts"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calibration", type=int, default=64, help="training-text sequences to count usage on")
    ap.add_argument("--heldout", type=int, default=64, help="held-out sequences to measure the hit rate on")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--no-compile", action="store_true", help="skip the deviceless GPU compiles")
    args = ap.parse_args(argv)

    import make_demo_model

    import kimi_jax
    from kimi_jax.cli.demo import demo_model_dir
    from kimi_jax.deploy.compile import compile_step
    from kimi_jax.model import hot_experts
    from kimi_jax.text.tokenizer import load_tokenizer

    path = demo_model_dir()
    ids = np.asarray(load_tokenizer(path).encode(make_demo_model.corpus()))
    start = int(len(ids) * (1 - make_demo_model.EVAL_FRAC))
    rng = np.random.default_rng(0)
    pick = lambda lo, hi, n: np.stack([ids[a:a + args.tokens] for a in rng.integers(lo, hi - args.tokens, n)])  # noqa: E731
    calib, held = pick(0, start, args.calibration), pick(start, len(ids), args.heldout)
    model = kimi_jax.from_pretrained(path, dtype="float32", progress=False)
    train_use = hot_experts.expert_usage(model, calib)
    held_use = hot_experts.expert_usage(model, held)
    E, X = model.cfg.moe.num_experts, model.cfg.moe.top_k
    print(f"demo model: {len(train_use)} MoE layers x {E} experts, top-{X}; usage on {calib.size} training tokens, "
          f"hit rate on {held.size} held-out tokens")
    share = np.stack([u / u.sum() for u in held_use])
    print("held-out routing share per layer (sorted, largest first): " + "; ".join(
        "/".join(f"{v:.2f}" for v in np.sort(s)[::-1]) for s in share))
    print("\n| hot experts per layer | hit rate (mean over layers) | min / max layer | uniform routing |")
    print("|---|---|---|---|")
    for H in range(1, E):
        hits = []
        for tu, hu in zip(train_use, held_use):
            top = np.argsort(-tu, kind="stable")[:H]
            hits.append(hu[top].sum() / hu.sum())
        print(f"| {H} | {np.mean(hits):.3f} | {min(hits):.3f} / {max(hits):.3f} | {H / E:.3f} |")

    if not args.no_compile:
        from kimi_jax.deploy import aot

        mesh = aot.target_mesh(aot.parse_target("gpu:h200:1x1x1"))
        print("\ndeviceless XLA:GPU (H200), one decode step, batch 1, 256-token cache, experts on host:")
        for H in (0, E // 4, E // 2):
            r = compile_step(model.cfg, mesh, offload=("experts",), batch=1, context=256, parallel=False,
                                     hot_experts=H)
            print(f"  hot {H}: device arguments {r['argument'] / 1e6:.3f} MB, host {r['host_argument'] / 1e6:.3f} MB; "
                  f"host -> device per step: {r['h2d'] / 1e6:.3f} MB if every choice is cold, "
                  f"{r['h2d_always'] / 1e6:.3f} MB unconditionally")
    return 0


if __name__ == "__main__":
    sys.exit(main())
