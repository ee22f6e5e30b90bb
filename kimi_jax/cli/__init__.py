"""The ``kimi-jax`` command line."""

from __future__ import annotations

import argparse
import sys


def _cmd_info(args):
    from kimi_jax.model import config as C
    from kimi_jax.model.decoder import abstract_model, param_count

    cfg = C.preset(args.model) if args.model in C.PRESETS else C.load(args.model)
    model = abstract_model(cfg)
    kinds = "".join({"kda": "K", "mla": "M", "gqa": "G"}[a] for a in cfg.attn_types)
    print(f"family {cfg.family}: {cfg.num_layers} layers [{kinds}], hidden {cfg.hidden_size}, vocab {cfg.vocab_size}")
    print(f"parameters: {param_count(model) / 1e9:.2f}B")


def _cmd_make_tiny(args):
    import json

    from kimi_jax.checkpoint.synthetic import write_checkpoint

    config = None
    if args.config:
        with open(args.config) as f:
            config = json.load(f)
    path = write_checkpoint(args.dir, args.family, config=config, seed=args.seed, num_shards=args.shards,
                            dtype=args.dtype)
    print(f"wrote a random {args.family} checkpoint to {path}")


def _cmd_plan(args):
    from kimi_jax.parallel.aot import CompilerMissing
    from kimi_jax.parallel.plan import run_cli

    try:
        return run_cli(args)
    except CompilerMissing as e:  # --compile without the aot extra: an install step, not a bug
        print(f"kimi-jax plan: error: {e}", file=sys.stderr)
        return 2


COMMANDS = "kimi_jax.commands"  # entry-point group of commands that packages built on kimi_jax add to the CLI


def _plugin_commands():
    """Entry points of the ``kimi_jax.commands`` group: ``register(subparsers)`` callables. The converter lives above
    kimi_jax (it imports kimi_jax, never the reverse), so its command arrives this way (pyproject.toml)."""
    from importlib.metadata import entry_points

    return sorted(entry_points(group=COMMANDS), key=lambda e: e.name)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kimi-jax", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    from kimi_jax.cli import generate as generate_cli

    generate_cli.add_demo_arguments(sub.add_parser(
        "demo", help="build a tiny Kimi K3 checkpoint in the released format, load it and generate (no downloads)"))
    generate_cli.add_generate_arguments(sub.add_parser(
        "generate", help="generate from a prompt (--model: HF or converted directory; default: the demo model)"))
    generate_cli.add_chat_arguments(sub.add_parser("chat", help="interactive K3-format chat with a model"))
    from kimi_jax.cli import serve as serve_cli

    serve_cli.add_serve_arguments(sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions; default: the demo model)"))
    i = sub.add_parser("info", help="describe a model directory or preset (k3, kimi-linear-48b-a3b, kimi-dense)")
    i.add_argument("model")
    i.set_defaults(func=_cmd_info)
    t = sub.add_parser("make-tiny", help="write a small random checkpoint in a released layout (k3, kimi_linear, llama)")
    t.add_argument("dir")
    t.add_argument("--family", default="k3", choices=["k3", "kimi_linear", "llama"])
    t.add_argument("--config", help="config.json to use instead of the family's tiny default")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--shards", type=int, default=2)
    t.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    t.set_defaults(func=_cmd_make_tiny)
    from kimi_jax.cli import train as train_cli

    train_cli.add_train_arguments(sub.add_parser(
        "train", help="train or LoRA-tune a model on text files (Orbax checkpoints, resumable; exports the HF layout)"))
    for command in _plugin_commands():  # `kimi-jax convert` (the convert package) registers itself here
        command.load()(sub)
    pl = sub.add_parser("plan", help="per-chip memory and roofline decode time of a model on a (data, expert, model) mesh")
    pl.add_argument("--model", default="k3", help="preset (k3, kimi-linear-48b-a3b, kimi-dense) or model directory")
    pl.add_argument("--mesh", default="data=1,expert=64,model=8", help="AXIS=N,... over data, expert, model")
    pl.add_argument("--layout", default="tp_ep", help="sharding table: tp_ep or wide_ep")
    pl.add_argument("--batch", type=int, default=8, help="concurrent sequences")
    pl.add_argument("--context", type=int, default=131072, help="cache length per sequence (tokens)")
    pl.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
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
    pl.add_argument("--kv-cache", default=None, choices=["int8"],
                    help="MLA latent / GQA K,V cache rows in int8 with a float32 scale per row (default: --dtype)")
    pl.add_argument("--kda-state", default=None, choices=["float32", "bfloat16"],
                    help="KDA recurrent state storage (default float32; the update runs in float32 either way)")
    pl.add_argument("--offload", default=None, metavar="KINDS",
                    help="comma list of experts,kda_state,cache kept in host memory: the bytes moved per chip, "
                         "the per-step copy traffic, and with --search the smallest meshes with it")
    pl.add_argument("--hot-experts", type=int, default=0, metavar="N",
                    help="with --offload experts: N routed experts per MoE layer (of each chip's) kept in device "
                         "memory as well (kimi_jax.parallel.offload.keep_hot_experts)")
    pl.add_argument("--host-memory", type=float, default=256.0, metavar="GB",
                    help="with --offload --search: host memory per chip (default 256: a DGX H200's 2 TB / 8)")
    pl.add_argument("--layers", type=int, default=None, help="slice the model to its first N layers")
    pl.add_argument("--experts", type=int, default=None, help="slice the routed experts to the first N")
    pl.set_defaults(func=_cmd_plan)
    return p


def main(argv=None):
    """Run one command. Errors the user can act on -- bad input, a config or checkpoint that does not fit, a kernel
    asked for that cannot run here, a file that cannot be read or written -- end in one line and exit status 2
    (1 for a refused file operation the OS reports); anything else is a bug and keeps its traceback."""
    from kernels_pallas._dispatch import KernelUnavailable

    args = build_parser().parse_args(argv)
    try:
        rc = args.func(args)
    except (ValueError, KernelUnavailable) as e:  # config / checkpoint / input errors, an unavailable kernel
        print(f"kimi-jax {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # missing files, permissions, a full disk: the OS's words and the path
        where = f" {e.filename!r}" if getattr(e, "filename", None) else ""
        print(f"kimi-jax {args.command}: error:{where} {e.strerror or e}", file=sys.stderr)
        return 2 if isinstance(e, FileNotFoundError) else 1
    except KeyboardInterrupt:
        print(f"kimi-jax {args.command}: interrupted", file=sys.stderr)
        return 130
    return rc if isinstance(rc, int) else 0  # commands that decide an exit status return it (plan --compile)


if __name__ == "__main__":
    sys.exit(main())
