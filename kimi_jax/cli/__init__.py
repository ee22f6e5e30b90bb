"""The kimi-jax command line."""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import json
import sys

import jax

from kernels_pallas._dispatch import KernelUnavailable
from kimi_jax.checkpoint import synthetic
from kimi_jax.cli import generate as generate_cli
from kimi_jax.cli import plan as plan_cli
from kimi_jax.cli import serve as serve_cli
from kimi_jax.cli import train as train_cli
from kimi_jax.model import config as C
from kimi_jax.model.decoder import abstract_model, param_count

# Device nodes of the accelerators JAX has plugins for (the paths jax._src.hardware_utils looks at): NVIDIA GPUs
# (and WSL's GPU), AMD GPUs (ROCm's kernel driver), Google TPUs (PCI vendor 0x1ae0; /dev/accel* and /dev/vfio on
# TPU VMs).
GPU_NODES = ("/dev/nvidia[0-9]*", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")
TPU_NODES = ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*")
GOOGLE_PCI_VENDOR = "0x1ae0"


def accelerator_present() -> bool:
    """Whether this machine shows a GPU or TPU device (a device node, or a Google PCI device)."""
    if any(glob.glob(p) for p in GPU_NODES + TPU_NODES):
        return True
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(vendor) as f:
                if f.read().strip() == GOOGLE_PCI_VENDOR:
                    return True
        except OSError:
            continue
    return False


def choose_platform() -> str | None:
    """Name the CPU as JAX's platform when no platform is named and this machine has no accelerator; returns it.

    The ``aot`` and ``test`` extras install the CUDA plugin and libtpu for their deviceless compilers. On a machine
    with neither a GPU nor a TPU, JAX's automatic choice still starts both runtimes, and each reports its failure on
    stderr -- the CUDA plugin's initialisation traceback, libtpu's "Failed to find host bounds" trace -- before the
    command's own output, though JAX then runs on the CPU anyway. Naming the CPU skips those two starts and nothing
    else: deviceless compiles (``plan --compile``) load the compilers themselves. A machine that shows a GPU or TPU
    keeps JAX's choice, so a broken driver still reports itself; ``JAX_PLATFORMS`` set by the user always wins."""
    if jax.config.jax_platforms or accelerator_present():
        return None
    jax.config.update("jax_platforms", "cpu")
    return "cpu"


def _version() -> str:
    try:  # the installed distribution's version: pyproject.toml's, the one source (as kimi_jax.__version__)
        return importlib.metadata.version("kimi-jax")
    except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path that was never installed
        return "unknown"


def _cmd_info(args):
    cfg = C.preset(args.model) if args.model in C.PRESETS else C.load(args.model)  # C.load: "demo" too
    model = abstract_model(cfg)
    kinds = "".join({"kda": "K", "mla": "M", "gqa": "G"}[a] for a in cfg.attn_types)
    print(f"family {cfg.family}: {cfg.num_layers} layers [{kinds}], hidden {cfg.hidden_size}, vocab {cfg.vocab_size}")
    ix = cfg.mla.indexer if cfg.mla is not None else None
    if ix is not None:
        print(f"DSA indexer (K3.1) in each of the {cfg.attn_types.count('mla')} MLA layers: {ix.num_heads} heads x "
              f"{ix.head_dim}, top-{ix.topk} keys per query")
    print(f"parameters: {param_count(model) / 1e9:.2f}B")


def _cmd_make_tiny(args):
    config = None
    if args.config:
        with open(args.config) as f:
            config = json.load(f)
    why = synthetic.tokenizer_problem(args.family, config)
    path = synthetic.write_checkpoint(args.dir, args.family, config=config, seed=args.seed, num_shards=args.shards,
                                      dtype=args.dtype, tokenizer=why is None, fp8_indexer=args.fp8_indexer)
    if why is None:
        print(f"wrote a random {args.family} checkpoint to {path}, with a tokenizer (tiktoken.model): text prompts "
              "work")
    else:
        print(f"wrote a random {args.family} checkpoint to {path}, without a tokenizer: {why}. Its prompts must be "
              "token ids (generate --ids)")


COMMANDS = "kimi_jax.commands"  # entry-point group of commands that packages built on kimi_jax add to the CLI


def _plugin_commands():
    """Entry points of the ``kimi_jax.commands`` group: ``register(subparsers)`` callables. The converter lives above
    kimi_jax (it imports kimi_jax, never the reverse), so its command arrives this way (pyproject.toml)."""
    return sorted(importlib.metadata.entry_points(group=COMMANDS), key=lambda e: e.name)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kimi-jax", description=__doc__)
    p.add_argument("--version", action="version", version=f"kimi-jax {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    generate_cli.add_demo_arguments(sub.add_parser(
        "demo", help="build a tiny Kimi K3 checkpoint in the released format, load it and generate (no downloads)"))
    generate_cli.add_generate_arguments(sub.add_parser(
        "generate", help="generate from a prompt (--model: HF or converted directory; default: the demo model)"))
    generate_cli.add_chat_arguments(sub.add_parser("chat", help="interactive K3-format chat with a model"))
    serve_cli.add_serve_arguments(sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions; default: the demo model)"))
    i = sub.add_parser("info", help="describe a model directory, the shipped demo model (demo) or a preset (k3, "
                                    "k3.1, kimi-linear-48b-a3b, kimi-dense)")
    i.add_argument("model", help="a model directory, demo, or a preset name")
    i.set_defaults(func=_cmd_info)
    t = sub.add_parser("make-tiny", help="write a small random checkpoint in a released layout (k3, k3.1, "
                                         "kimi_linear, llama), with a tokenizer where its vocabulary holds one (k3)")
    t.add_argument("dir", help="output directory (new or empty)")
    t.add_argument("--family", default="k3", choices=["k3", "k3.1", "kimi_linear", "llama"],
                   help="layout (default: %(default)s)")
    t.add_argument("--config", help="config.json to use instead of the family's tiny default")
    t.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: %(default)s)")
    t.add_argument("--shards", type=int, default=2, help="safetensors files to split it into (default: %(default)s)")
    t.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="dtype of the tensors the release does not pin (default: %(default)s)")
    t.add_argument("--fp8-indexer", action="store_true",
                   help="k3.1: the indexer's wq_b and wk as float8_e4m3fn with a float32 weight_scale_inv per "
                        "128 x 128 block, as DeepSeek-V3.2 stores them (loaded dequantized)")
    t.set_defaults(func=_cmd_make_tiny)
    train_cli.add_train_arguments(sub.add_parser(
        "train", help="train or LoRA-tune a model on text files (Orbax checkpoints, resumable; exports the HF layout)"))
    for command in _plugin_commands():  # `kimi-jax convert` (the convert package) registers itself here
        command.load()(sub)
    plan_cli.add_plan_arguments(sub.add_parser(
        "plan", help="per-chip memory and roofline decode time of a model on a (data, expert, model) mesh"))
    return p


def main(argv=None):
    """Run one command. Errors the user can act on -- bad input, a config or checkpoint that does not fit, a kernel
    asked for that cannot run here, a file that cannot be read or written -- end in one line and exit status 2
    (1 for a refused file operation the OS reports); anything else is a bug and keeps its traceback."""
    choose_platform()  # before any command starts JAX's runtimes
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
