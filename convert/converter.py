"""HF safetensors -> Orbax conversion: streaming, resumable, memory-bounded, MXFP4 kept packed, optionally quantized.

Order of work:
  1. Validate everything that can be validated without writing: config.json (and the --layers/--experts slice), every
     shard header (JSON, dtypes, offsets, truncation, duplicates -- kimi_jax.checkpoint.safetensors), the name table
     (every tensor placed exactly once, every parameter filled -- kimi_jax.checkpoint.names), every shape and dtype
     against the model (on zero-strided stand-ins, no memory), and the zero padding of every A_log: the checkpoint
     reader's jobs and preflight (kimi_jax.checkpoint.reader), as for loading.
  2. Claim DST: empty, or an unfinished conversion of the same source with the same options (resume), or --overwrite.
  3. Convert parameter by parameter in source-file order. Each output array is allocated 64-byte aligned, filled
     straight from the shard files by the reader (``preadv`` when no transform is needed: one copy) and
     handed to JAX on the CPU device without a copy; a batch of arrays (at most one large one) becomes one Orbax
     partial save. Under --quantize each selected weight is read like any other, quantized as soon as it is read
     (the compiled call ``from_pretrained(quantize=...)`` makes, so the packed fields are the same bits) and only its
     packed fields are saved (``...q_proj.q``, ``...q_proj.scale``): the float weight lives one batch. Peak memory
     is about one output array plus the batch limit, far under 2x the largest + 1 GB.
     The saves are not fsynced one by one (the kernel writes them back while the next batches are read); DST's
     filesystem is synced every ``sync_bytes`` and the state file then records those saves as durable, and their
     pages are dropped from the page cache (the output is not read back; the cache stays bounded).
  4. Sync, config.json and tokenizer files, then finalize the Orbax checkpoint, optionally --verify, and only then
     write ``kimi_jax_checkpoint.json``: an interrupted run never leaves a directory that loads.

The quantization (format and module classes) is part of the options a resume must repeat, and is recorded in the
marker, so ``from_pretrained(DST)`` builds the quantized model and reads the packed fields into it.

Resuming reads which parameters earlier partial saves committed (kimi_jax.checkpoint.orbax.committed_saves) and skips
them. A killed process leaves its unsynced saves intact in the page cache, so all of them count. The state file holds the
machine's boot id: when it differs at resume (the machine went down, and unsynced data with it), only the saves
recorded as durable are kept and the others are deleted and redone.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import gc
import hashlib
import json
import os
import re
import resource
import shutil
import time
from typing import Callable

import jax
import numpy as np
from flax import nnx

from kernels_pallas import quant
from kimi_jax.checkpoint import hf
from kimi_jax.checkpoint import orbax as orbax_io
from kimi_jax.checkpoint import reader as reader_lib
from kimi_jax.checkpoint.names import canonical
from kimi_jax.checkpoint.reader import Job
from kimi_jax.checkpoint.safetensors import Checkpoint, CheckpointError
from kimi_jax.model import config as config_lib
from kimi_jax.model import params
from kimi_jax.model import quantize as quantize_lib
from kimi_jax.model.decoder import KimiModel
from kimi_jax.model.run import RunConfig

# Files copied from SRC besides the weights (tokenizers, chat/generation settings). config.json is written by us.
AUX_FILES = ("tiktoken.model", "tokenizer_config.json", "tokenizer.json", "tokenizer.model", "special_tokens_map.json",
             "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
             "generation_config.json")
BATCH_BYTES = 256 << 20  # parameters saved together; a larger parameter is saved alone
# DST's filesystem is synced after this many bytes: the saves so far are then recorded as durable and dropped from
# the page cache (a conversion does not read its output back; see orbax_io.drop_cached)
SYNC_BYTES = 512 << 20
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_ROUTER = ("mlp.gate", "mlp.e_score_correction_bias")  # sliced to the first --experts rows


class ConvertError(CheckpointError):
    """A conversion that cannot proceed (bad source, DST in the way, options that do not fit)."""


class VerifyError(ConvertError):
    """--verify found a stored array that differs from its source tensor."""


@dataclasses.dataclass
class Summary:
    dst: str
    tensors: int  # source tensors read in this run
    params: int  # parameters (output arrays) written in this run
    skipped: int  # parameters already on disk from an interrupted run
    bytes_in: int
    bytes_out: int
    seconds: float
    peak_rss: int  # bytes (peak resident set of this process)
    verified: bool
    setup_seconds: float = 0.0  # validation, planning, claiming DST (incl. first use of Orbax and JAX)
    stream_seconds: float = 0.0  # reading and saving the parameters

    def __str__(self):
        rate = self.bytes_out / max(self.seconds, 1e-9) / 1e6
        return (f"converted to {self.dst}: {self.tensors} tensors -> {self.params} parameters"
                + (f" ({self.skipped} already done)" if self.skipped else "")
                + f", {self.bytes_in / 1e6:.1f} MB in, {self.bytes_out / 1e6:.1f} MB out in {self.seconds:.1f} s "
                f"({rate:.0f} MB/s), peak RSS {self.peak_rss / 2**20:.0f} MiB" + (", verified" if self.verified else ""))


# -- the plan -------------------------------------------------------------------------------------------------


def _keep(name: str, cfg: config_lib.ModelConfig, layers: int | None, experts: int | None) -> bool:
    cname = canonical(name, cfg) or name
    if layers is not None and (m := _LAYER.match(cname)) and int(m.group(1)) >= layers:
        return False
    if experts is not None and (m := _EXPERT.search(cname)) and int(m.group(1)) >= experts:
        return False
    return True


def _plan_jobs(ckpt: Checkpoint, cfg, targets, layers, experts) -> tuple[list[Job], list[str]]:
    """The reader's jobs for the kept tensors (router rows cut to the first ``experts`` under --experts)."""
    keep = [n for n in ckpt.tensors if _keep(n, cfg, layers, experts)]
    rows = (lambda t: experts if t.endswith(_ROUTER) else None) if experts is not None else None
    return reader_lib.jobs(ckpt, cfg, targets, tensors=keep, rows=rows)


def quantization(fmt: str | None, include=None) -> dict | None:
    """The --quantize / --quantize-include request as the state file and the marker record it: ``{"format":
    "int4:g32", "include": [classes in quantize_lib.CLASSES order]}``, or None. Raises on an unknown format or
    class."""
    if fmt is None:
        if include is not None:
            raise ConvertError("--quantize-include needs --quantize FORMAT")
        return None
    try:
        name = quant.Format.parse(fmt).name()
    except ValueError as e:
        raise ConvertError(f"--quantize {fmt!r}: {e}") from None
    include = quantize_lib.DEFAULT if include is None else tuple(include)
    if not include:
        raise ConvertError(f"--quantize-include: no module classes given (choose from "
                           f"{', '.join(quantize_lib.CLASSES)})")
    bad = sorted(set(include) - set(quantize_lib.CLASSES))
    if bad:
        raise ConvertError(f"--quantize-include {','.join(include)!r}: unknown module classes {bad} (choose from "
                           f"{', '.join(quantize_lib.CLASSES)})")
    return {"format": name, "include": [c for c in quantize_lib.CLASSES if c in include]}


def describe_quantization(q: dict | None) -> str:
    """How a recorded quantization reads as options (for messages)."""
    if q is None:
        return "no --quantize"
    return f"--quantize {q['format']} --quantize-include {','.join(q['include'])}"


@dataclasses.dataclass
class _Plan:
    """What DST stores for a model: ``targets`` {stored leaf: ShapeDtypeStruct} (a quantized weight: its packed
    fields), the reader's ``jobs`` (each fills one float or MXFP4 leaf), and for each quantized job target its
    fitted format and the stored leaves of its fields."""

    targets: dict
    jobs: list
    formats: dict  # job target -> quant.Format
    fields: dict  # job target -> (stored leaf, ...) of its packed fields

    def outputs(self, job: Job) -> tuple[str, ...]:
        return self.fields.get(job.target, (job.target,))

    def out_bytes(self, job: Job) -> int:
        return sum(_nbytes(self.targets[k]) for k in self.outputs(job))

    def values(self, job: Job, arr, device) -> dict:
        """{stored leaf: jax.Array} of one job from its read leaf ``arr`` (quantized when the plan says so)."""
        value = jax.device_put(arr, device)  # 64-byte aligned: adopted without a copy
        fmt = self.formats.get(job.target)
        if fmt is None:
            return {job.target: value}
        packed = jax.block_until_ready(quantize_lib.quantizer(fmt)(value))
        value.delete()  # the float leaf is not kept (its buffer is the caller's)
        return dict(zip(self.fields[job.target], packed))


def _nbytes(sds) -> int:
    return int(np.prod(sds.shape)) * np.dtype(sds.dtype).itemsize


def _plan_for(ckpt: Checkpoint, cfg_src, cfg_out, dtype: str, layers, experts, q: dict | None) -> _Plan:
    """The jobs and stored leaves of converting ``ckpt`` into the model ``cfg_out`` (quantized as ``q`` records).
    Raises, naming it, on a weight the format cannot take."""
    abstract = nnx.eval_shape(lambda: KimiModel(cfg_out, run=RunConfig(dtype=np.dtype(dtype)), rngs=nnx.Rngs(0)))
    floats = params.leaves(nnx.state(abstract))
    jobs, _ = _plan_jobs(ckpt, cfg_src, floats, layers, experts)
    if q is None:
        return _Plan(floats, jobs, {}, {})
    try:
        formats = quantize_lib.plan(abstract, q["format"], q["include"])
    except ValueError as e:
        raise ConvertError(f"{describe_quantization(q)}: {e}") from None
    note = quantize_lib.summary(abstract, q["format"], q["include"])
    if note is not None:  # the weights the format does not fit are stored in the one they fell back to
        quantize_lib.log.warning("convert --quantize %s", note)
    quantize_lib.quantize(abstract, q["format"], q["include"])  # abstract: the packed fields' shapes
    fields = {}
    for path, var in nnx.to_flat_state(nnx.state(abstract)):
        name = ".".join(map(str, path))
        if name in formats:
            fields[name] = tuple(f"{name}.{f}" for f in var.get_value()._fields)
    return _Plan(params.leaves(nnx.state(abstract)), jobs, formats, fields)


# -- buffers ---------------------------------------------------------------------------------------------------


def _round64(n: int) -> int:
    return -(-n // 64) * 64


class _Slab:
    """A reusable buffer that a batch's arrays are carved from (64-byte aligned). Reusing it avoids the page faults
    (kernel zeroing) that a fresh allocation per array costs, which is a full extra pass over the bytes."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.buf: np.ndarray | None = None  # allocated on first use
        self.used = 0

    def fits(self, nbytes: int) -> bool:
        return self.used + nbytes <= self.capacity

    def take(self, shape, dtype) -> np.ndarray:
        if self.buf is None:
            self.buf = reader_lib.aligned_empty((self.capacity,), np.uint8)
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        out = self.buf[self.used:self.used + n].view(dtype).reshape(shape)
        self.used += _round64(n)
        return out


# -- DST handling --------------------------------------------------------------------------------------------


def _fingerprint(ckpt: Checkpoint) -> str:
    """Identifies the source by its tensor inventory (names, dtypes, shapes, files, sizes), not its path."""
    h = hashlib.sha256()
    for name in sorted(ckpt.tensors):
        i = ckpt.tensors[name]
        h.update(f"{name}|{i.dtype}|{list(i.shape)}|{os.path.basename(i.file)}|{i.offset}\n".encode())
    return h.hexdigest()


def _claim_dst(dst: str, src: str, state: dict, overwrite: bool) -> dict | None:
    """Make DST ours. Returns the recorded state when resuming an unfinished conversion of the same source and
    options, else None."""
    real_dst, real_src = os.path.realpath(dst), os.path.realpath(src)
    if real_dst == real_src or real_src.startswith(real_dst.rstrip(os.sep) + os.sep):
        raise ConvertError(f"DST {dst} is SRC or contains it; choose another destination")
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise ConvertError(f"DST {dst} exists and is not a directory")
    if os.path.isdir(dst) and os.listdir(dst):
        if overwrite:
            shutil.rmtree(dst)
        elif os.path.exists(os.path.join(dst, orbax_io.MARKER)):
            raise ConvertError(f"DST {dst} already holds a complete kimi-jax checkpoint; pass --overwrite to replace it")
        elif os.path.exists(os.path.join(dst, orbax_io.STATE)):
            with open(os.path.join(dst, orbax_io.STATE)) as f:
                old = json.load(f)
            if old.get("quantize") != state["quantize"]:
                raise ConvertError(f"DST {dst} holds an unfinished conversion made with "
                                   f"{describe_quantization(old.get('quantize'))}; this run asks for "
                                   f"{describe_quantization(state['quantize'])}. Rerun with the same quantization to "
                                   "resume, or pass --overwrite to start again")
            keys = ("format", "fingerprint", "dtype", "layers", "experts")
            diff = {k: (old.get(k), state[k]) for k in keys if old.get(k) != state[k]}
            if diff:
                raise ConvertError(f"DST {dst} holds an unfinished conversion with other settings {diff} (was, now); "
                                   "rerun with the same SRC and options to resume, or pass --overwrite")
            return old
        else:
            raise ConvertError(f"DST {dst} is not empty; pass --overwrite to replace its contents")
    try:
        os.makedirs(dst, exist_ok=True)
        _write_json(os.path.join(dst, orbax_io.STATE), state)
    except OSError as e:
        raise ConvertError(f"DST {dst} is not writable ({e.strerror or e})") from None
    return None


def _write_json(path: str, obj, *, indent=2):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=indent)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _used(cfg: config_lib.ModelConfig) -> config_lib.ModelConfig:
    """``cfg`` without the sub-configs of layer kinds it no longer has (the parser leaves those out)."""
    kinds = set(cfg.attn_types) | set(cfg.ffn_types)
    return cfg.replace(**{k: None for k, used in (("kda", "kda"), ("mla", "mla"), ("gqa", "gqa"), ("moe", "moe"),
                                                   ("mlp", "dense")) if used not in kinds})


def sliced_config(raw: dict, layers: int | None, experts: int | None) -> dict:
    """config.json rewritten for the first ``layers`` layers / ``experts`` experts (release and HF key forms)."""
    raw = json.loads(json.dumps(raw))
    text = raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw
    if layers is not None:
        text["num_hidden_layers"] = layers
        lac = text.get("linear_attn_config")
        if isinstance(lac, dict):
            for key in ("kda_layers", "full_attn_layers"):  # 1-based layer numbers
                if lac.get(key) is not None:
                    lac[key] = [x for x in lac[key] if int(x) <= layers]
        for key in ("layer_types", "mlp_layer_types"):
            if isinstance(text.get(key), list):
                text[key] = text[key][:layers]
    if experts is not None:
        for key in ("num_experts", "n_routed_experts"):
            if key in text:
                text[key] = experts
    return raw


# -- the converter -------------------------------------------------------------------------------------------


def convert_checkpoint(src, dst, **kw) -> Summary:
    """See :func:`_convert`. The cyclic garbage collector is paused for the call: planning and Orbax's per-save
    bookkeeping allocate many short-lived objects, and GC passes over them cost several percent of the CPU time."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _convert(src, dst, **kw)
    finally:
        if enabled:
            gc.enable()


def _convert(src, dst, *, dtype: str = "bfloat16", layers: int | None = None, experts: int | None = None,
             overwrite: bool = False, verify: bool = False, progress: bool = True,
             batch_bytes: int = BATCH_BYTES, sync_bytes: int = SYNC_BYTES, check_finite: bool = True,
             quantize: str | None = None, quantize_include=None,
             on_event: Callable[[str, int], None] | None = None) -> Summary:
    """Convert the HF checkpoint directory ``src`` into a kimi-jax Orbax checkpoint at ``dst``.

    ``dtype``: parameter dtype ("bfloat16" | "float32"; tensors the release keeps in float32 stay float32, MXFP4
    experts stay uint8). ``layers`` / ``experts``: keep the first N layers / routed experts (router rows and
    correction bias sliced to match); config.json is rewritten. ``overwrite``: replace whatever DST holds.
    ``verify``: reread every stored array and compare it bit for bit with its source. ``batch_bytes``: parameters
    saved together per Orbax partial save (a larger parameter is saved alone). ``sync_bytes``: partial saves are
    not fsynced one by one; DST's filesystem is synced after this many bytes and before finalizing, and the state
    file records which saves are durable. ``check_finite``: refuse tensors holding NaN / Inf (MXFP4: the NaN scale
    byte), naming tensor and file, before their batch is saved. ``quantize`` / ``quantize_include``: store the
    selected weights in a weight-only format (``"int8"``, ``"int4:g64"``, ...; module classes as
    :func:`kimi_jax.model.quantize.quantize` takes them, default its DEFAULT), each quantized from the ``dtype``
    weight as it is read; ``from_pretrained(DST)`` then returns the quantized model. ``on_event(event, n)``: called
    with ("saved", n) after the n-th partial
    save of this run, ("finalize", 0) before the Orbax checkpoint is finalized and ("marker", 0) before the
    completion marker is written (tests kill the process there).
    """
    t0 = time.perf_counter()
    src, dst = os.fspath(src), os.fspath(dst)
    q = quantization(quantize, quantize_include)
    source = _validate(src, dtype, layers, experts, q)  # 1. nothing written yet
    state = {"format": orbax_io.FORMAT, "source": os.path.abspath(src), "fingerprint": _fingerprint(source.ckpt),
             "dtype": dtype, "layers": layers, "experts": experts, "check_finite": check_finite, "quantize": q}
    disk = _Durability(dst, state, sync_bytes)
    done = disk.claim(src, overwrite, set(source.targets))  # 2.
    event = on_event or (lambda name, n: None)
    plan = source.plan
    todo = [j for j in plan.jobs if not set(plan.outputs(j)) <= done]
    skipped = len(plan.jobs) - len(todo)
    t_stream = time.perf_counter()
    bar = _progress(progress, sum(j.nbytes for j in todo), len(todo), skipped)
    reader = reader_lib.Reader(source.ckpt, check_finite=check_finite)
    _stream(reader, plan, todo, disk, batch_bytes, bar, len(plan.jobs), skipped, event)  # 3.
    stream_seconds = time.perf_counter() - t_stream
    _finish(src, dst, source, disk, verify, progress, event)  # 4.
    summary = Summary(dst, reader.tensors, len(todo), skipped, reader.bytes_in, sum(plan.out_bytes(j) for j in todo),
                      time.perf_counter() - t0, peak_rss(), verify, t_stream - t0, stream_seconds)
    _write_marker(dst, source, state, event)
    return summary


@dataclasses.dataclass
class _Source:
    """A validated source: its config (as read and as sliced), the rewritten config.json, the plan (jobs, stored
    leaves)."""

    ckpt: Checkpoint
    cfg_file: str
    cfg_out: config_lib.ModelConfig
    raw_cfg: dict
    new_raw: dict
    plan: _Plan

    @property
    def targets(self) -> dict:
        return self.plan.targets


def _validate(src: str, dtype: str, layers, experts, q: dict | None = None) -> _Source:
    """Everything that can be checked before writing: options, config.json and its slice, every header, the name
    table, every shape and dtype (kimi_jax.checkpoint.reader.preflight), every weight against the quantization."""
    if dtype not in ("bfloat16", "float32"):
        raise ConvertError(f"--dtype {dtype!r}: choose bfloat16 or float32")
    if not os.path.isdir(src):
        raise FileNotFoundError(f"SRC {src}: no such directory")
    if orbax_io.looks_converted(src):
        raise ConvertError(f"SRC {src} is already a kimi-jax (Orbax) checkpoint")
    cfg_file = os.path.join(src, "config.json")
    raw_cfg = config_lib.read_json(src)
    cfg = config_lib.from_dict(raw_cfg)
    ct = hf.pack_quantized(cfg)
    if ct is not None:
        raise ConvertError(f"SRC {src} stores its weights {ct.name()} (compressed-tensors): convert does not take "
                           "pack-quantized sources; kimi_jax.from_pretrained(SRC) reads them packed as they are")
    if experts is not None and cfg.moe is None:
        raise ConvertError(f"--experts {experts}: {cfg_file} describes a model without routed experts")
    cfg_out = cfg.sliced(layers, experts)
    new_raw = sliced_config(raw_cfg, layers, experts) if (layers is not None or experts is not None) else raw_cfg
    if _used(config_lib.from_dict(new_raw)) != _used(cfg_out):
        raise ConvertError(f"{cfg_file}: could not rewrite it for --layers {layers} --experts {experts} "
                           "(the rewritten config does not parse to the sliced model)")
    ckpt = Checkpoint(src)
    plan = _plan_for(ckpt, cfg, cfg_out, dtype, layers, experts, q)
    reader_lib.preflight(ckpt, plan.jobs)
    return _Source(ckpt, cfg_file, cfg_out, raw_cfg, new_raw, plan)


class _Durability:
    """DST's state file and which partial saves are known to be on disk.

    Saves are not fsynced one by one (unless the machine has no boot id, when a crash cannot be told from a kill):
    DST's filesystem is synced every ``sync_bytes``, and the state file then records those saves as durable and
    their pages are dropped from the page cache."""

    def __init__(self, dst: str, state: dict, sync_bytes: int):
        self.dst, self.state, self.sync_bytes = dst, state, sync_bytes
        self.file = os.path.join(dst, orbax_io.STATE)
        self.boot = orbax_io.boot_id()
        self.synced = self.boot is None
        self.durable: list[str] = []  # batch ids of partial saves known to be on disk
        self.unsynced: list[str] = []  # committed partial saves whose data may still be only in the page cache
        self.dropped: set[str] = set()  # save directories already dropped from the page cache
        self.since_sync = 0

    def claim(self, src: str, overwrite: bool, targets: set) -> set:
        """Make DST ours; returns the parameters an interrupted run of the same conversion already saved."""
        resumed = _claim_dst(self.dst, src, self.state, overwrite)
        done = set()
        if resumed is not None and (resumed.get("phase") == "finalize"
                                    or os.path.isdir(os.path.join(self.dst, orbax_io.PARAMS))):
            done = set(targets)  # every batch was saved (and synced) before the interrupted run began finalizing
        elif resumed is not None:
            done = self._resume(resumed, targets)
        self.state.update(boot_id=self.boot, durable=self.durable)
        if done != targets:
            _write_json(self.file, self.state)
        return done

    def _resume(self, resumed: dict, targets: set) -> set:
        saves = orbax_io.committed_saves(self.dst)
        self.durable = list(resumed.get("durable", []))
        if resumed.get("boot_id") is None:  # that run fsynced every save
            self.durable = [i for _, ids, _ in saves for i in ids]
        elif resumed["boot_id"] != self.boot:
            # The machine restarted (or a sync failed) after those saves: the page cache that held the unsynced
            # ones is gone, so only saves synced before are trusted; the others are deleted and redone.
            saves = orbax_io.drop_saves(saves, set(self.durable))
        known = set(self.durable)
        self.unsynced = [i for _, ids, _ in saves for i in ids if i not in known]
        done = {p for _, _, paths in saves for p in paths}
        stray = sorted(done - targets)
        if stray:
            raise ConvertError(f"DST {self.dst}: the unfinished conversion holds parameters {stray[:3]} this model "
                               "does not have; pass --overwrite")
        return done

    def saved(self, batch_id: str, nbytes: int):
        if self.synced:
            return
        self.unsynced.append(batch_id)
        self.since_sync += nbytes
        if self.since_sync >= self.sync_bytes:
            self.make_durable()

    def make_durable(self):
        """Sync DST's filesystem, record every save so far as durable, drop them from the page cache."""
        try:
            orbax_io.sync_filesystem(self.dst)
        except OSError as e:
            with contextlib.suppress(OSError):  # a resumed run must not trust the unsynced saves
                _write_json(self.file, dict(self.state, boot_id="sync-failed"))
            raise ConvertError(f"DST {self.dst}: writing the converted data to disk failed ({e}); rerun to resume "
                               "(saves made since the last successful sync are redone)") from e
        self.durable.extend(self.unsynced)
        self.unsynced.clear()
        self.since_sync = 0
        _write_json(self.file, self.state)
        orbax_io.drop_cached(self.dst, self.dropped)


def _batches(todo: list[Job], batch_bytes: int) -> tuple[list[list[Job]], int]:
    """Parameters grouped into batches that each fit one slab (a parameter larger than ``batch_bytes`` is a batch
    alone), and the slab capacity."""
    capacity = max([batch_bytes] + [_round64(j.nbytes) for j in todo])
    batches: list[list[Job]] = []
    used = capacity
    for job in todo:
        if used + _round64(job.nbytes) > capacity:
            batches.append([])
            used = 0
        batches[-1].append(job)
        used += _round64(job.nbytes)
    return batches, capacity


def _stream(reader, plan: _Plan, todo: list[Job], disk: _Durability, batch_bytes: int, bar, total: int, skipped: int,
            event):
    """Read and save every job, in batches. Double buffering: a worker thread reads batch n+1 into one slab while
    Orbax writes batch n from the other (Orbax partial saves themselves must not overlap: they share one temporary
    directory). Each array is filled straight from the shard files and handed to JAX without a copy; a weight to
    quantize is quantized in the worker right after it is read (its float copy is the slab's, reused two batches
    later), so the batch holds only its packed fields."""
    cpu = jax.devices("cpu")[0]
    batches, capacity = _batches(todo, batch_bytes)
    slabs = [_Slab(capacity), _Slab(capacity)]

    def read_batch(i):
        slab = slabs[i % 2]
        slab.used = 0
        out = {}
        for job in batches[i]:
            arr = reader.read(job, out=slab.take(job.sds.shape, job.sds.dtype))
            out.update(plan.values(job, arr, cpu))
            if bar is not None:
                bar.update(job.nbytes)
        return out

    written = 0
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kimi-jax-convert-read")
    nxt = None
    try:
        nxt = pool.submit(read_batch, 0) if batches else None
        for i in range(len(batches)):
            arrays = nxt.result()
            nxt = pool.submit(read_batch, i + 1) if i + 1 < len(batches) else None
            batch_id = f"{time.time_ns()}-{i}"
            orbax_io.save_batch(disk.dst, arrays, batch_id, synced=disk.synced)
            written += len(arrays)
            disk.saved(batch_id, sum(a.nbytes for a in arrays.values()))
            for a in arrays.values():
                a.delete()  # its slab is refilled two batches from now
            del arrays
            if bar is not None:
                bar.set_postfix_str(f"tensors {reader.tensors}, params {skipped + written}/{total}", refresh=False)
            event("saved", i + 1)
    finally:
        if nxt is not None:
            nxt.cancel()
        pool.shutdown(wait=True)
        reader.close()
        if bar is not None:
            bar.close()


def _finish(src: str, dst: str, source: _Source, disk: _Durability, verify: bool, progress: bool, event):
    """Config and tokenizer files, then finalize the Orbax checkpoint, check it holds every parameter, verify."""
    if source.new_raw is source.raw_cfg:
        shutil.copyfile(source.cfg_file, os.path.join(dst, "config.json"))
    else:
        _write_json(os.path.join(dst, "config.json"), source.new_raw)
    for name in AUX_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    if not os.path.isdir(os.path.join(dst, orbax_io.PARAMS)):
        if not disk.synced:
            disk.make_durable()
        _write_json(disk.file, dict(disk.state, phase="finalize"))
        event("finalize", 0)
        try:
            orbax_io.finalize(dst)
        except (OSError, ValueError) as e:
            raise ConvertError(f"DST {dst}: finalizing the Orbax checkpoint failed ({e}); "
                               "pass --overwrite to convert again") from e
    have = orbax_io.stored(dst)
    if set(have) != set(source.targets):
        raise ConvertError(f"DST {dst}: finalized checkpoint has {len(have)} parameters, the model {len(source.targets)} "
                           f"(missing {sorted(set(source.targets) - set(have))[:3]}); pass --overwrite to convert again")
    if verify:
        verify_checkpoint(dst, src, _plan=source.plan, _ckpt=source.ckpt, progress=progress)
    source.ckpt.close()


def _write_marker(dst: str, source: _Source, state: dict, event):
    """The completion marker, written last: only now does DST load."""
    cfg_out, targets = source.cfg_out, source.targets
    marker = dict(state, version=orbax_io.VERSION, family=cfg_out.family, num_layers=cfg_out.num_layers,
                  num_experts=None if cfg_out.moe is None else cfg_out.moe.num_experts, params=len(targets),
                  bytes=sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in targets.values()),
                  source_files=sorted({os.path.basename(i.file) for i in source.ckpt.tensors.values()}))
    event("marker", 0)
    _write_json(os.path.join(dst, orbax_io.MARKER), marker)
    os.unlink(os.path.join(dst, orbax_io.STATE))


def peak_rss() -> int:
    """Peak resident set of this process in bytes: VmHWM (reset by exec, unlike ru_maxrss, which Linux carries over
    from the process that forked us), else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _progress(enabled: bool, total: int, n: int, skipped: int):
    if not enabled:
        return None
    from tqdm import tqdm

    desc = f"converting {n} params" + (f" ({skipped} done before)" if skipped else "")
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, dynamic_ncols=True)


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.reshape(-1).view(np.uint8),
                                                                        b.reshape(-1).view(np.uint8))


def verify_checkpoint(dst, src, *, progress: bool = True, _plan=None, _ckpt=None):
    """Reread every stored parameter of ``dst`` and compare it bit for bit with the source tensors, transformed as
    conversion transforms them (MXFP4 bytes are copied, so they must be identical bytes; a quantized weight's packed
    fields must be the bits its source weight quantizes to)."""
    dst, src = os.fspath(dst), os.fspath(src)
    ckpt = _ckpt or Checkpoint(src)
    plan = _plan
    if plan is None:
        meta = orbax_io.read_marker(dst)
        plan = _plan_for(ckpt, config_lib.load(src), config_lib.load(dst), meta["dtype"], meta["layers"],
                         meta["experts"], meta.get("quantize"))
    jobs = plan.jobs
    cpu_device = jax.devices("cpu")[0]
    reader = reader_lib.Reader(ckpt, check_finite=False)  # bytes are compared as they are
    bar = _progress(progress, sum(j.nbytes for j in jobs), len(jobs), 0)
    if bar is not None:
        bar.set_description(f"verifying {len(jobs)} params")
    try:
        i = 0
        while i < len(jobs):  # batches bounded like the conversion's
            chunk, size = [], 0
            while i < len(jobs) and (not chunk or size + jobs[i].nbytes <= BATCH_BYTES):
                chunk.append(jobs[i])
                size += jobs[i].nbytes
                i += 1
            cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
            got = orbax_io.restore(dst, {k: jax.ShapeDtypeStruct(plan.targets[k].shape, plan.targets[k].dtype,
                                                                 sharding=cpu)
                                         for j in chunk for k in plan.outputs(j)}, check_complete=False)
            for j in chunk:
                for k, want in plan.values(j, reader.read(j), cpu_device).items():
                    if not _same_bytes(np.asarray(got[k]), np.asarray(want)):
                        srcs = [p.tensor for p in j.sources]
                        raise VerifyError(f"{dst}: parameter {k} differs from its source {srcs[:2]}"
                                          f"{' ...' if len(srcs) > 2 else ''} in "
                                          f"{os.path.basename(ckpt.tensors[srcs[0]].file)}"
                                          + (f" quantized to {plan.formats[j.target].name()}"
                                             if j.target in plan.formats else ""))
                if bar is not None:
                    bar.update(j.nbytes)
            del got
    finally:
        reader.close()
        if bar is not None:
            bar.close()
