"""HF safetensors -> Orbax conversion: streaming, resumable, memory-bounded, MXFP4 kept packed.

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
     partial save. Peak memory is about one output array plus the batch limit, far under 2x the largest + 1 GB.
     The saves are not fsynced one by one (the kernel writes them back while the next batches are read); DST's
     filesystem is synced every ``sync_bytes`` and the state file then records those saves as durable, and their
     pages are dropped from the page cache (the output is not read back; the cache stays bounded).
  4. Sync, config.json and tokenizer files, then finalize the Orbax checkpoint, optionally --verify, and only then
     write ``kimi_jax_checkpoint.json``: an interrupted run never leaves a directory that loads.

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

from kimi_jax.checkpoint import orbax as orbax_io
from kimi_jax.checkpoint import reader as reader_lib
from kimi_jax.checkpoint.names import canonical
from kimi_jax.checkpoint.reader import Job
from kimi_jax.checkpoint.safetensors import Checkpoint, CheckpointError
from kimi_jax.model import config as config_lib
from kimi_jax.model import params
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
             on_event: Callable[[str, int], None] | None = None) -> Summary:
    """Convert the HF checkpoint directory ``src`` into a kimi-jax Orbax checkpoint at ``dst``.

    ``dtype``: parameter dtype ("bfloat16" | "float32"; tensors the release keeps in float32 stay float32, MXFP4
    experts stay uint8). ``layers`` / ``experts``: keep the first N layers / routed experts (router rows and
    correction bias sliced to match); config.json is rewritten. ``overwrite``: replace whatever DST holds.
    ``verify``: reread every stored array and compare it bit for bit with its source. ``batch_bytes``: parameters
    saved together per Orbax partial save (a larger parameter is saved alone). ``sync_bytes``: partial saves are
    not fsynced one by one; DST's filesystem is synced after this many bytes and before finalizing, and the state
    file records which saves are durable. ``check_finite``: refuse tensors holding NaN / Inf (MXFP4: the NaN scale
    byte), naming tensor and file, before their batch is saved. ``on_event(event, n)``: called with ("saved", n) after the n-th partial
    save of this run, ("finalize", 0) before the Orbax checkpoint is finalized and ("marker", 0) before the
    completion marker is written (tests kill the process there).
    """
    t0 = time.perf_counter()
    src, dst = os.fspath(src), os.fspath(dst)
    source = _validate(src, dtype, layers, experts)  # 1. nothing written yet
    state = {"format": orbax_io.FORMAT, "source": os.path.abspath(src), "fingerprint": _fingerprint(source.ckpt),
             "dtype": dtype, "layers": layers, "experts": experts, "check_finite": check_finite}
    disk = _Durability(dst, state, sync_bytes)
    done = disk.claim(src, overwrite, set(source.targets))  # 2.
    event = on_event or (lambda name, n: None)
    todo = [j for j in source.jobs if j.target not in done]
    t_stream = time.perf_counter()
    bar = _progress(progress, sum(j.nbytes for j in todo), len(todo), len(done))
    reader = reader_lib.Reader(source.ckpt, check_finite=check_finite)
    _stream(reader, todo, disk, batch_bytes, bar, len(source.jobs), len(done), event)  # 3.
    stream_seconds = time.perf_counter() - t_stream
    _finish(src, dst, source, disk, verify, progress, event)  # 4.
    summary = Summary(dst, reader.tensors, len(todo), len(done), reader.bytes_in, sum(j.nbytes for j in todo),
                      time.perf_counter() - t0, peak_rss(), verify, t_stream - t0, stream_seconds)
    _write_marker(dst, source, state, event)
    return summary


@dataclasses.dataclass
class _Source:
    """A validated source: its config (as read and as sliced), the rewritten config.json, the jobs."""

    ckpt: Checkpoint
    cfg_file: str
    cfg_out: config_lib.ModelConfig
    raw_cfg: dict
    new_raw: dict
    targets: dict
    jobs: list


def _validate(src: str, dtype: str, layers, experts) -> _Source:
    """Everything that can be checked before writing: options, config.json and its slice, every header, the name
    table, every shape and dtype (kimi_jax.checkpoint.reader.preflight)."""
    if dtype not in ("bfloat16", "float32"):
        raise ConvertError(f"--dtype {dtype!r}: choose bfloat16 or float32")
    if not os.path.isdir(src):
        raise FileNotFoundError(f"SRC {src}: no such directory")
    if orbax_io.looks_converted(src):
        raise ConvertError(f"SRC {src} is already a kimi-jax (Orbax) checkpoint")
    cfg_file = os.path.join(src, "config.json")
    cfg = config_lib.load(src)
    if experts is not None and cfg.moe is None:
        raise ConvertError(f"--experts {experts}: {cfg_file} describes a model without routed experts")
    cfg_out = cfg.sliced(layers, experts)
    with open(cfg_file) as f:
        raw_cfg = json.load(f)
    new_raw = sliced_config(raw_cfg, layers, experts) if (layers is not None or experts is not None) else raw_cfg
    if _used(config_lib.from_dict(new_raw)) != _used(cfg_out):
        raise ConvertError(f"{cfg_file}: could not rewrite it for --layers {layers} --experts {experts} "
                           "(the rewritten config does not parse to the sliced model)")
    ckpt = Checkpoint(src)
    abstract = nnx.eval_shape(lambda: KimiModel(cfg_out, run=RunConfig(dtype=np.dtype(dtype)), rngs=nnx.Rngs(0)))
    targets = params.leaves(nnx.state(abstract))
    jobs, _ = _plan_jobs(ckpt, cfg, targets, layers, experts)
    reader_lib.preflight(ckpt, jobs)
    return _Source(ckpt, cfg_file, cfg_out, raw_cfg, new_raw, targets, jobs)


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


def _stream(reader, todo: list[Job], disk: _Durability, batch_bytes: int, bar, total: int, skipped: int, event):
    """Read and save every job, in batches. Double buffering: a worker thread reads batch n+1 into one slab while
    Orbax writes batch n from the other (Orbax partial saves themselves must not overlap: they share one temporary
    directory). Each array is filled straight from the shard files and handed to JAX without a copy."""
    cpu = jax.devices("cpu")[0]
    batches, capacity = _batches(todo, batch_bytes)
    slabs = [_Slab(capacity), _Slab(capacity)]

    def read_batch(i):
        slab = slabs[i % 2]
        slab.used = 0
        out = {}
        for job in batches[i]:
            arr = reader.read(job, out=slab.take(job.sds.shape, job.sds.dtype))
            out[job.target] = jax.device_put(arr, cpu)  # 64-byte aligned: adopted without a copy
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
            disk.saved(batch_id, sum(j.nbytes for j in batches[i]))
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
        verify_checkpoint(dst, src, _jobs=source.jobs, _ckpt=source.ckpt, progress=progress)
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


def verify_checkpoint(dst, src, *, progress: bool = True, _jobs=None, _ckpt=None):
    """Reread every stored parameter of ``dst`` and compare it bit for bit with the source tensors, transformed as
    conversion transforms them (MXFP4 bytes are copied, so they must be identical bytes)."""
    dst, src = os.fspath(dst), os.fspath(src)
    ckpt = _ckpt or Checkpoint(src)
    jobs = _jobs
    if jobs is None:
        meta = json.load(open(os.path.join(dst, orbax_io.MARKER)))
        cfg_src = config_lib.load(src)
        cfg_out = config_lib.load(dst)
        abstract = nnx.eval_shape(lambda: KimiModel(cfg_out, run=RunConfig(dtype=np.dtype(meta["dtype"])),
                                                    rngs=nnx.Rngs(0)))
        jobs, _ = _plan_jobs(ckpt, cfg_src, params.leaves(nnx.state(abstract)), meta["layers"], meta["experts"])
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
            got = orbax_io.restore(dst, {j.target: jax.ShapeDtypeStruct(j.sds.shape, j.sds.dtype, sharding=cpu)
                                         for j in chunk}, check_complete=False)
            for j in chunk:
                want = reader.read(j)
                have = np.asarray(got[j.target])
                if not _same_bytes(have, want):
                    srcs = [p.tensor for p in j.sources]
                    raise VerifyError(f"{dst}: parameter {j.target} differs from its source {srcs[:2]}"
                                      f"{' ...' if len(srcs) > 2 else ''} in {os.path.basename(ckpt.tensors[srcs[0]].file)}")
                if bar is not None:
                    bar.update(j.nbytes)
            del got
    finally:
        reader.close()
        if bar is not None:
            bar.close()
