"""The converted checkpoint on disk, and reading it back.

A converted directory (DST) holds::

    config.json                   the model config (rewritten when --layers/--experts sliced it)
    tiktoken.model, tokenizer_config.json, ...   copied from the source
    params/                       one Orbax checkpoint: a flat dict {"layers.3.self_attn.q_proj": array, ...} keyed
                                  by the model's parameter leaves (kimi_jax.model.params), experts stacked [E, ...],
                                  an MXFP4 weight as its uint8 fields (``...experts.w1.packed``, ``...w1.scale``),
                                  a weight converted with --quantize as its packed fields (``...q_proj.q``,
                                  ``...q_proj.scale``; kernels_pallas.quant)
    kimi_jax_checkpoint.json      written last: its presence is what makes DST a complete checkpoint; records the
                                  options, including ``"quantize": {"format": "int8", "include": [classes]}`` (or
                                  null), which :func:`abstract_model` applies to the model the checkpoint fills

While a conversion runs, ``params.partial_save/`` accumulates one Orbax partial save per batch of parameters and
``kimi_jax_convert_state.json`` records what is being converted; ``from_pretrained`` refuses such a directory.
Restoring takes an abstract target tree (``{path: jax.ShapeDtypeStruct(shape, dtype, sharding=...)}``) and hands the
shardings straight to Orbax, so each process reads only its own slices.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil

import jax
import numpy as np
from flax import nnx

from kernels_pallas import quant
from kimi_jax.checkpoint.safetensors import CheckpointError
from kimi_jax.model import params
from kimi_jax.model import quantize as quantize_lib

PARAMS = "params"
PARTIAL = PARAMS + ".partial_save"  # orbax.checkpoint.experimental.v1.partial's session directory for PARAMS
MARKER = "kimi_jax_checkpoint.json"
STATE = "kimi_jax_convert_state.json"
FORMAT = "kimi-jax-orbax"
VERSION = 2  # 2: packed weights stored by field (``w1.packed``), not as ``w1_packed`` parameters
SAVED_KEY = "kimi_jax_saved"  # custom metadata of each partial save: {SAVED_KEY: {batch_id: [param paths]}}


class IncompleteCheckpointError(CheckpointError):
    """A converted directory whose conversion has not finished."""


def ocp():
    import orbax.checkpoint.experimental.v1 as v1  # 0.3-0.6 s to import; converted checkpoints only

    return v1


def context(*, partial_load: bool = False):
    """Orbax options: no compression (random-looking weights barely compress, and zstd would cost the CPU time the
    conversion is bounded by)."""
    ctx = ocp().Context()
    ctx.array.saving.use_compression = False
    if partial_load:
        ctx.pytree.loading.partial_load = True
    return ctx


# -- what a directory is ----------------------------------------------------------------------------------------


def looks_converted(path) -> bool:
    """Any trace of a kimi-jax conversion (complete or not)."""
    return any(os.path.exists(os.path.join(path, n)) for n in (MARKER, STATE, PARAMS, PARTIAL))


def read_marker(path) -> dict:
    """The metadata of a complete converted checkpoint; raises :class:`IncompleteCheckpointError` otherwise."""
    path = os.fspath(path)
    marker = os.path.join(path, MARKER)
    if not os.path.exists(marker):
        state = os.path.join(path, STATE)
        how = (f"a conversion was started ({STATE} is present) and has not finished" if os.path.exists(state)
               else "no conversion metadata")
        raise IncompleteCheckpointError(
            f"{path}: incomplete kimi-jax checkpoint: {MARKER} is missing ({how}); rerun `kimi-jax convert SRC "
            f"{path}` to resume it, or convert again with --overwrite")
    try:
        with open(marker) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{marker}: unreadable ({e})") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(f"{marker}: format {meta.get('format')!r} version {meta.get('version')!r}; "
                              f"this kimi-jax reads {FORMAT!r} version {VERSION}: convert the source again "
                              "(kimi-jax convert --overwrite)")
    if not os.path.isdir(os.path.join(path, PARAMS)):
        raise IncompleteCheckpointError(f"{path}: {MARKER} is present but {PARAMS}/ is missing")
    return meta


def quantization(meta: dict):
    """The weight-only quantization a converted checkpoint stores (``kimi-jax convert --quantize``), as
    ``(kernels_pallas.quant.Format, module classes)``, or None."""
    q = meta.get("quantize")
    if q is None:
        return None

    try:
        return quant.Format.parse(q["format"]), tuple(q["include"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{MARKER}: unreadable quantization record {q!r} ({e})") from None


# -- writing (used by the converter) -----------------------------------------------------------------------------


def boot_id() -> str | None:
    """This boot of the machine (Linux), or None where the system does not say."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


_ABSENT = object()


@contextlib.contextmanager
def _unsynced_writes():
    """TensorStore writes without an fsync per file while the block runs.

    Orbax builds each save's TensorStore context from module-level defaults and has no option for ``file_io_sync``,
    so the defaults are patched for the block and restored after it. Where that module is not as expected (another
    Orbax version), the saves stay synced: slower, never less durable."""
    try:
        from orbax.checkpoint._src.serialization import tensorstore_utils as tsu  # 0.3-0.6 s to import; converted checkpoints only

        defaults = [tsu._BASE_TS_CONTEXT, tsu._DEFAULT_OCDBT_TS_CONTEXT]
    except (ImportError, AttributeError):
        defaults = None
    if defaults is None or not all(isinstance(d, dict) for d in defaults):
        yield False
        return
    before = [d.get("file_io_sync", _ABSENT) for d in defaults]
    for d in defaults:
        d["file_io_sync"] = False
    try:
        yield True
    finally:
        for d, b in zip(defaults, before):
            if b is _ABSENT:
                d.pop("file_io_sync", None)
            else:
                d["file_io_sync"] = b


def save_batch(dst: str, arrays: dict, batch_id: str, *, synced: bool = True):
    """One Orbax partial save of ``arrays`` (flat path -> array) into DST/params.partial_save, recording the paths
    in the save's custom metadata so a resumed conversion knows what is already on disk.

    ``synced=False``: the data files are not fsynced (Orbax still commits the save by renaming its directory); the
    caller makes them durable later with :func:`sync_filesystem` and keeps a ledger of which saves are durable."""
    with context(), (_unsynced_writes() if not synced else contextlib.nullcontext()):
        ocp().partial.save(os.path.join(dst, PARAMS), arrays, custom_metadata={SAVED_KEY: {batch_id: sorted(arrays)}})


def sync_filesystem(path: str):
    """Write every dirty page of the filesystem holding ``path`` to its disk (``syncfs``; ``sync`` where there is no
    syncfs). Raises OSError when the kernel reports a write error."""
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fn = ctypes.CDLL(None, use_errno=True).syncfs
        except (OSError, AttributeError):
            os.sync()
            return
        if fn(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
    finally:
        os.close(fd)


def _save_dirs(dst: str) -> list[str]:
    """Names of the committed partial-save directories (``*.pending_*``) in DST's session, sorted."""
    session = os.path.join(dst, PARTIAL)
    if not os.path.isdir(session):
        return []
    return sorted(e for e in os.listdir(session) if ".pending_" in e)


def drop_cached(dst: str, seen: set[str]) -> int:
    """Drop the data of DST's committed partial saves from the page cache (``posix_fadvise(DONTNEED)`` on each of
    their files); call it after a successful :func:`sync_filesystem`, so the pages are clean and nothing is lost.
    ``seen``: the save directories already dropped (updated here), so each sync looks at the new saves only.
    Returns the bytes advised. A no-op where the OS has no ``posix_fadvise``.

    Why: a conversion writes the whole model once and does not read it back, so keeping it cached only pushes other
    data out; and the kernel fills new writes fastest into pages it just freed (on the 2-core VM this was built on,
    a Python copy loop syncing and dropping every 512 MiB ran 2x faster than one that kept its output cached)."""
    if not hasattr(os, "posix_fadvise"):
        return 0
    advised = 0
    for entry in _save_dirs(dst):
        if entry in seen:
            continue
        seen.add(entry)
        for root, _, files in os.walk(os.path.join(dst, PARTIAL, entry)):
            for name in files:
                try:
                    fd = os.open(os.path.join(root, name), os.O_RDONLY)
                except OSError:
                    continue
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    advised += os.fstat(fd).st_size
                except OSError:
                    pass
                finally:
                    os.close(fd)
    return advised


def committed_saves(dst: str) -> list[tuple[str, list[str], list[str]]]:
    """The committed partial saves of an unfinished conversion: (directory, batch ids, parameter paths) each.

    Each committed partial save is a ``*.pending_*`` directory of the session with the ``_CHECKPOINT_METADATA`` Orbax
    writes (including our custom metadata); an interrupted save never got renamed into one, so it is not listed
    (Orbax clears its leftover temporary directory on the next save)."""
    session = os.path.join(dst, PARTIAL)
    saves = []
    for entry in _save_dirs(dst):
        meta_file = os.path.join(session, entry, "_CHECKPOINT_METADATA")
        try:
            with open(meta_file) as f:
                custom = json.load(f).get("custom_metadata") or {}
            batches = custom[SAVED_KEY]
            ids, paths = list(batches), [p for v in batches.values() for p in v]
        except (OSError, json.JSONDecodeError, KeyError, AttributeError, TypeError) as e:
            raise CheckpointError(f"{meta_file}: cannot tell which parameters this partial save holds ({e!r}); "
                                  "convert again with --overwrite") from None
        saves.append((os.path.join(session, entry), ids, paths))
    return saves


def drop_saves(saves: list, keep_ids: set[str]) -> list:
    """Delete those of ``saves`` (from :func:`committed_saves`) that hold a batch not in ``keep_ids``; returns the
    others."""
    kept = []
    for save in saves:
        if set(save[1]) <= keep_ids:
            kept.append(save)
        else:
            shutil.rmtree(save[0])
    return kept


def finalize(dst: str):
    with context():
        ocp().partial.finalize(os.path.join(dst, PARAMS))


def stored(path) -> dict[str, jax.ShapeDtypeStruct]:
    """Path -> ShapeDtypeStruct of every stored parameter (metadata only, no data read)."""
    meta = ocp().metadata(os.path.join(os.fspath(path), PARAMS)).metadata
    return {k: jax.ShapeDtypeStruct(tuple(v.shape), np.dtype(v.dtype)) for k, v in meta.items()}


# -- reading ----------------------------------------------------------------------------------------------------


def restore(path, target: dict, *, check_complete: bool = True) -> dict:
    """Read parameters of a converted checkpoint into ``target``'s shapes, dtypes and shardings.

    ``target``: {param path: jax.ShapeDtypeStruct | np.ndarray}. A ShapeDtypeStruct with a ``sharding`` is read
    straight into that sharding (each process reads only its devices' slices); without one it lands on the first
    local device; an np.ndarray target gives host numpy. Dtypes are cast on read (bf16 storage -> float32 target is
    exact). A subset of the stored parameters may be requested. Raises naming the parameter on any mismatch.
    """
    path = os.fspath(path)
    if check_complete:
        read_marker(path)
    have = stored(path)
    missing = sorted(set(target) - set(have))
    if missing:
        raise CheckpointError(f"{path}: {len(missing)} parameter(s) not in the converted checkpoint: {missing[:5]}")
    default = None
    abstract = {}
    for k, t in target.items():
        if tuple(t.shape) != tuple(have[k].shape):
            raise CheckpointError(f"{path}: parameter {k} is stored as {list(have[k].shape)}, "
                                  f"the target wants {list(t.shape)}")
        stored_int, want_int = (np.issubdtype(np.dtype(d), np.integer) for d in (have[k].dtype, t.dtype))
        if (stored_int or want_int) and np.dtype(have[k].dtype) != np.dtype(t.dtype):  # codes are never cast
            raise CheckpointError(f"{path}: parameter {k} is stored as {np.dtype(have[k].dtype).name}, "
                                  f"the target wants {np.dtype(t.dtype).name}")
        if isinstance(t, jax.ShapeDtypeStruct) and t.sharding is None:
            default = default or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            t = jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=default)
        abstract[k] = t
    with context(partial_load=len(abstract) < len(have)):
        return ocp().load(os.path.join(path, PARAMS), abstract)


def abstract_model(path, model_factory):
    """The abstract model (shapes, no memory) the converted checkpoint at ``path`` fills: ``model_factory``'s, with
    the weights the conversion quantized in their packed types (:func:`quantization`)."""
    abstract = nnx.eval_shape(model_factory)
    q = quantization(read_marker(path))
    if q is not None:
        quantize_lib.quantize(abstract, *q)  # the packed fields' shapes; nothing is computed
    return abstract


def load_converted(path, cfg, model_factory, *, shardings=None, abstract=None):
    """Build the model for ``cfg`` and fill it from the converted checkpoint at ``path`` (``shardings``: optional
    {param path: Sharding}, e.g. ``kimi_jax.parallel.sharding.param_shardings(...)``). A checkpoint converted with
    --quantize fills the quantized model directly: its packed fields are read as stored, no float weight is built.
    ``abstract``: :func:`abstract_model`, when the caller has it already."""
    abstract = abstract_model(path, model_factory) if abstract is None else abstract
    graphdef, state = nnx.split(abstract)
    targets = params.leaves(state)
    if shardings:
        targets = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings.get(k)) for k, v in targets.items()}
    have = stored(path) if os.path.isdir(os.path.join(os.fspath(path), PARAMS)) else {}
    extra = sorted(set(have) - set(targets))
    if extra:
        raise CheckpointError(f"{path}: converted checkpoint holds parameters this {cfg.family} model does not have: "
                              f"{extra[:5]} (config.json and params/ disagree)")
    values = restore(path, targets)
    return nnx.merge(graphdef, params.fill(state, values))
