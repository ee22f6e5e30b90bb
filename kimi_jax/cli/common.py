"""What every command that runs a model shares: the model directory, the dtype, the compilation cache, loading,
and where the model runs -- one device, a mesh of this host's devices, or a mesh over several processes.

    --mesh data=D,expert=E,model=M   the axes as ``kimi-jax plan`` spells them (auto: the plan picks, see below)
    --layout tp_ep|wide_ep           the sharding table (kimi_jax.parallel.sharding)
    --coordinator HOST:PORT --num-processes N --process-id I
                                     one process of N (the same command on every host; JAX's distributed runtime)

Several processes start when ``--coordinator`` (or ``KIMI_JAX_COORDINATOR`` ...) is given, ``--coordinator auto``
asks JAX's cluster detection (Cloud TPU pod slices, SLURM, Open MPI), and under ``srun`` with several tasks. Each
process reads only its shards of the checkpoint. ``--mesh auto`` asks the deployment plan
(:mod:`kimi_jax.deploy.plan`) for the fitting (data=1, expert, model) layouts of every device present and takes
the one that needs the least memory per device, saying which on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

from kernels_pallas import cache_quant
from kimi_jax.checkpoint.loading import auto_dtype, from_pretrained
from kimi_jax.cli import progress
from kimi_jax.cli.demo import build_demo_checkpoint, demo_model_dir
from kimi_jax.deploy import plan as P
from kimi_jax.generation.generate import free_memory
from kimi_jax.model import config as C
from kimi_jax.model.run import RunConfig, check_offload
from kimi_jax.parallel import distributed, sharding
from kimi_jax.text.tokenizer import has_tokenizer, load_tokenizer

CACHE_ENV = "KIMI_JAX_COMPILE_CACHE"  # a directory, or "off" / "0" / "" to disable


# -- arguments ------------------------------------------------------------------------------------------------------


class HelpFormatter(argparse.HelpFormatter):
    """Every flag's default after its help (argparse's ArgumentDefaultsHelpFormatter, but not where the help already
    says its default in its own words, and not for switches, whose default is always off)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


# What the library calls an argument -> the flag that sets it: the library's messages name its Python arguments
# (``max_len``), a command's user typed flags (``--max-len``). Names with an underscore are replaced wherever they
# stand; plain words ("slots", "seed") only as the subject of the library's "X must be ..." checks, since they also
# occur as ordinary words ("8 slots x 2048 tokens").
FLAGS = {name: "--" + name.replace("_", "-") for name in (
    "max_new_tokens", "prefill_chunk", "snapshot_every", "page_size", "max_len", "top_k", "top_p", "kv_cache",
    "kda_state", "min_chunk", "temperature", "seed", "slots", "pages")}
_FLAG_RE = re.compile(r"(?<![\w-])(?:(" + "|".join(n for n in FLAGS if "_" in n) + r")(?![\w-])|("
                      + "|".join(n for n in FLAGS if "_" not in n) + r")(?= must))")


def flag_message(message: str, flags: dict[str, str] = FLAGS) -> str:
    """``message`` with the library's argument names spelled as the flags that set them."""
    return _FLAG_RE.sub(lambda m: flags[m.group(1) or m.group(2)], message)


@contextlib.contextmanager
def flag_names():
    """Errors raised inside (ValueError: the library's refusals) re-raised with flag names (:func:`flag_message`)."""
    try:
        yield
    except ValueError as e:
        raise ValueError(flag_message(str(e))) from None


def dtype_argument(p: argparse.ArgumentParser):
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="activation / parameter dtype; auto (default): bfloat16 (on the CPU too, where it decodes "
                        "faster than float32)")


def quantize_argument(p: argparse.ArgumentParser):
    p.add_argument("--quantize", default=None, metavar="FORMAT",
                   help="weight-only format of the dense weights, quantized at load: int8, int4[:gN][:zero], nf4 "
                        "(from_pretrained(quantize=...))")


def kv_cache_argument(p: argparse.ArgumentParser):
    p.add_argument("--kv-cache", default=None, choices=[f for f in cache_quant.FORMATS if f],
                   help="cache rows in int8 with a float32 scale per row: int8 = MLA latent, rope key, K3.1's "
                        "indexer keys, GQA K / V; int8-index = K3.1's DSA indexer keys only, the latent kept in "
                        "--dtype (default: every field in --dtype)")


def compile_cache_arguments(p: argparse.ArgumentParser):
    g = p.add_mutually_exclusive_group()
    g.add_argument("--compile-cache", metavar="DIR", help=f"keep compiled programs in DIR for later runs (default: "
                   f"${CACHE_ENV} or ~/.cache/kimi-jax/xla)")
    g.add_argument("--no-compile-cache", action="store_true", help="compile everything in this run, keep nothing")


def parallel_arguments(p: argparse.ArgumentParser):
    p.add_argument("--mesh", default=None, metavar="AXES",
                   help="run on a mesh: data=D,expert=E,model=M over every device of every process (as `kimi-jax "
                        "plan` spells it), or auto (the plan's least memory per device for the devices present); "
                        "default: one device")
    p.add_argument("--layout", default="tp_ep", choices=["tp_ep", "wide_ep"], help="sharding table of the mesh")
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="one process of several: process 0's address for JAX's distributed runtime (auto: JAX's "
                        "cluster detection: Cloud TPU pod slices, SLURM, Open MPI)")
    p.add_argument("--num-processes", type=int, default=None, help="with --coordinator: how many processes")
    p.add_argument("--process-id", type=int, default=None, help="with --coordinator: this process's index")


def scan_argument(p: argparse.ArgumentParser):
    p.add_argument("--scan-layers", action="store_true",
                   help="the repeating run of layers as one scan over stacked weights: compiles several times faster "
                        "(full K3 on a pod: minutes instead of most of an hour); on some chips the compiler copies "
                        "the stacked weights per step (`kimi-jax plan --compile ... --scan-layers` shows the bytes)")


# -- the compilation cache ------------------------------------------------------------------------------------------


def default_compile_cache() -> str | None:
    """Where the commands keep compiled programs: ``$KIMI_JAX_COMPILE_CACHE`` when set ("off", "0" or empty
    disable it), else ``$XDG_CACHE_HOME/kimi-jax/xla`` (``~/.cache/kimi-jax/xla``)."""
    if CACHE_ENV in os.environ:
        value = os.environ[CACHE_ENV].strip()
        return None if value.lower() in ("", "0", "off", "false", "no") else value
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "kimi-jax", "xla")


def enable_compile_cache(directory: str, *, explicit: bool) -> bool:
    """Turn on JAX's persistent compilation cache in ``directory`` for this process, so a later run of the same
    model shapes loads its prefill and decode programs instead of compiling them again (the embedded demo:
    first request 13-19 s on a fresh cache, 5 s on the next run). JAX keys every entry by the program, the
    compile options, the JAX/XLA version and the device kind, and keeps only programs that took at least
    ``jax_persistent_cache_min_compile_time_secs`` (default 1 s) to compile.

    A directory the user named (``explicit``) that cannot be created is an error; the default location
    falling through is only reported, and the command runs without the cache."""
    try:
        os.makedirs(directory, exist_ok=True)
        if not os.access(directory, os.W_OK | os.X_OK):
            raise PermissionError(f"{directory}: not writable")
    except OSError as e:
        if explicit:
            raise ValueError(f"--compile-cache {directory}: {e}") from None
        print(f"kimi-jax: compilation cache off ({e})", file=sys.stderr)
        return False
    jax.config.update("jax_compilation_cache_dir", directory)
    return True


def setup_compile_cache(args):
    if args.no_compile_cache:
        return
    directory = args.compile_cache or default_compile_cache()
    if directory:
        enable_compile_cache(directory, explicit=bool(args.compile_cache))


# -- processes and meshes -------------------------------------------------------------------------------------------


def setup_processes(args) -> bool:
    """Start JAX's distributed runtime when this is one process of several (see the module docstring), before
    anything touches a device. Returns whether it did. Bad flags are refused naming them."""
    given = [f for f, v in (("--coordinator", args.coordinator), ("--num-processes", args.num_processes),
                            ("--process-id", args.process_id)) if v is not None]
    if args.coordinator == "auto":
        if len(given) > 1:
            raise ValueError("--coordinator auto detects the process count and index: drop "
                             f"{', '.join(g for g in given if g != '--coordinator')}")
        distributed.initialize()
        return True
    if given and len(given) < 3 and not distributed.env_configured():
        missing = [f for f in ("--coordinator", "--num-processes", "--process-id") if f not in given]
        raise ValueError(f"{', '.join(given)} without {', '.join(missing)}: several processes need all three "
                         "(or --coordinator auto)")
    if args.num_processes is not None and args.num_processes < 1:
        raise ValueError(f"--num-processes must be >= 1, got {args.num_processes}")
    if args.process_id is not None and args.num_processes is not None and \
            not 0 <= args.process_id < args.num_processes:
        raise ValueError(f"--process-id {args.process_id} must be in [0, {args.num_processes})")
    if given or distributed.env_configured() or distributed.launched_by_slurm():
        if args.num_processes == 1:
            return False
        distributed.initialize(args.coordinator, args.num_processes, args.process_id)
        return True
    return False


def leader() -> bool:
    """Whether this process speaks for the job (prints results, serves HTTP): process 0."""
    return jax.process_index() == 0


def make_mesh(args, path: str, *, batch: int, context: int, dtype: str, quantize: str | None = None):
    """The mesh ``--mesh`` asks for over every device of every process (None: one device). ``auto``: the plan's
    fitting layout with the least memory per device for ``batch`` sequences of ``context`` tokens."""
    if args.mesh is None:
        if jax.process_count() > 1:
            raise ValueError(f"{jax.process_count()} processes need --mesh (over all {jax.device_count()} devices)")
        return None
    if args.mesh == "auto":
        sizes = auto_mesh(path, args.layout, batch=batch, context=context, dtype=dtype, quantize=quantize)
    else:
        sizes = sharding.parse_mesh(args.mesh)
    n = sizes["data"] * sizes["expert"] * sizes["model"]
    if n != jax.device_count():
        raise ValueError(f"--mesh {args.mesh}: {n} devices, but {jax.process_count()} process(es) hold "
                         f"{jax.device_count()}: the mesh must use them all")
    return sharding.make_mesh(sizes["data"], sizes["expert"], sizes["model"])


def _device_memory() -> tuple[str, float]:
    """(what the devices are, bytes of memory each) for the plan's fit."""
    d = jax.devices()[0]
    try:
        stats = d.memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory statistics
        stats = {}
    if "bytes_limit" in stats:
        return d.device_kind, float(stats["bytes_limit"])
    free = free_memory(d)
    if free is None:
        raise ValueError(f"--mesh auto: the memory of a {d.device_kind} is unknown here; give --mesh AXES")
    if d.platform == "cpu":  # every simulated CPU device shares the host's memory
        free /= jax.local_device_count()
    return d.device_kind, float(free)


def auto_mesh(path: str, layout: str, *, batch: int, context: int, dtype: str, quantize: str | None = None) -> dict:
    """The (data=1, expert, model) sizes over every device that the plan says fit, least memory per device first;
    printed on stderr. Refused, with the best plan's need, when none fits."""
    cfg = C.load(path)
    n = jax.device_count()
    kind, memory = _device_memory()
    chip = P.Chip(kind, memory, 0.0)
    kernels = "reference" if jax.devices()[0].platform == "cpu" else "pallas"
    plans = []
    for sizes in P.candidate_meshes(n):
        try:
            plans.append(P.make_plan(cfg, sizes, layout, batch=batch, context=context, dtype=dtype, kernels=kernels,
                                     quantize=quantize))
        except ValueError:  # a mesh this model cannot take (heads that do not divide): not a candidate
            continue
    if not plans:
        raise ValueError(f"--mesh auto: no (expert, model) mesh of {n} devices can shard this model")
    plans.sort(key=lambda p: p.total)
    best = plans[0]
    text = ",".join(f"{k}={v}" for k, v in best.sizes.items())
    if not best.fits(chip):
        raise ValueError(f"--mesh auto: no layout of {n} x {kind} fits: the smallest, {text}, plans "
                         f"{best.total / 1e9:.2f} GB per device for {batch} sequences of {context} tokens, "
                         f"{memory * 0.9 / 1e9:.2f} GB usable")
    print(f"kimi-jax: --mesh auto: {text} ({layout}) on {n} x {kind}: {best.total / 1e9:.3f} GB per device planned "
          f"of {memory / 1e9:.1f} GB", file=sys.stderr)
    return dict(best.sizes)


# -- the model ------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def model_dir(path, *, random=False, seed=0, keep=None):
    """The model directory to load: ``path``; else the shipped demo model, or (``random``) a freshly written random
    tiny K3 (kept in ``keep`` when given)."""
    if path:
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path}: no such model directory")
        yield path
        return

    if not random:
        yield demo_model_dir()
        return
    if keep:
        yield build_demo_checkpoint(keep, seed=seed)
        return
    with tempfile.TemporaryDirectory(prefix="kimi-jax-demo-") as tmp:
        yield build_demo_checkpoint(tmp, seed=seed)


def resolve_dtype(asked: str) -> str:
    """The dtype to run, said on stderr in one short line (after the flags are checked, before loading): as asked,
    or the automatic choice (:func:`kimi_jax.checkpoint.loading.auto_dtype` says why it is bfloat16)."""
    if asked != "auto":
        print(f"kimi-jax: dtype {asked} (--dtype)", file=sys.stderr)
        return asked
    dtype, _ = auto_dtype()
    print(f"kimi-jax: dtype {dtype.name} (automatic; --dtype float32 for full precision)", file=sys.stderr)
    return dtype.name


@dataclasses.dataclass
class Loaded:
    model: object
    tokenizer: object  # or None: token-id prompts only
    seconds: float
    dtype: str
    mesh: object = None


def load_model(path, dtype, check_finite=True, quantize=None, offload=None, mesh=None, layout="tp_ep",
               scan_layers: bool = False) -> Loaded:
    """The model (on ``mesh`` when given: each process reads only its shards) and its tokenizer. ``quantize``: a
    weight format (refused by name before any weight is read when it does not fit); ``offload``:
    ``"experts,kda_state,cache"`` or a part of it; ``scan_layers``: the repeating layers stacked and scanned.
    ``dtype``: as :func:`resolve_dtype` returned it."""
    kinds = check_offload(offload) if offload else ()
    t0 = time.perf_counter()
    kw = dict(run=RunConfig(dtype=jnp.dtype(dtype), offload=kinds)) if kinds else dict(dtype=dtype)
    status = progress.Status("kimi-jax: ")
    status.set(f"loading {path} ({_disk_bytes(path) / 1e9:.2f} GB)...")
    try:
        model = from_pretrained(path, check_finite=check_finite, quantize=quantize, mesh=mesh, layout=layout,
                                scan_layers=scan_layers, **kw)
    finally:
        status.close()
    tok = load_tokenizer(path) if has_tokenizer(path) else None
    return Loaded(model, tok, time.perf_counter() - t0, dtype, mesh)


def _disk_bytes(path) -> int:
    """Bytes of the files under ``path`` (the weights, in every checkpoint layout, and a few small files)."""
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)
