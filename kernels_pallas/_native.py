"""Native CPU kernels: small C++ sources built on first use and called from XLA as FFI custom calls.

A decode step on XLA:CPU is a chain of few-row products, each streaming its weight once; XLA runs them one by one
(the small ones at about half the memory rate of the large ones) and first copies a chosen expert out of its
stacked ``[E, J, I]`` array. A few lines of C++ stream several products as one piece of work and read chosen
experts where they lie (``kernels_pallas/matvec``). The sources sit next to their op (``<op>/native.cc``, with what
they share in ``_native.h``), written against XLA's FFI headers, which ship with jaxlib (``jax.ffi.include_dir()``);
they are compiled with the machine's C++ compiler (``$CXX``, else ``c++``/``g++``/``clang++``) for this CPU, once
per source, header, compiler, jaxlib and CPU, into ``$XDG_CACHE_HOME/kimi-jax/native``
(``~/.cache/kimi-jax/native``), and loaded from there afterwards.

``KIMI_JAX_NATIVE=off`` turns them off: the automatic choice is then the plain-jnp reference, and asking for a
native kernel explicitly raises. When the build fails (no compiler, say), the automatic choice logs why once and
uses the reference; an explicit request raises :class:`NativeUnavailable` with the compiler's message.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jaxlib

from kernels_pallas._dispatch import KernelUnavailable

log = logging.getLogger(__name__)

ENV = "KIMI_JAX_NATIVE"  # "off" / "0" / "false" disables the native kernels
HEADER = Path(__file__).with_name("_native.h")  # what every kernel includes: vectors, loads, the parts loop
_registered: set[str] = set()
_lock = threading.Lock()


class NativeUnavailable(KernelUnavailable):
    """A native kernel cannot be built or loaded here; the message says why."""


def enabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() not in ("off", "0", "false", "no")


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "kimi-jax" / "native"


def _compiler() -> str:
    for cand in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if cand and shutil.which(cand):
            return cand
    raise NativeUnavailable("no C++ compiler found (set $CXX, or install g++ or clang++)")


def _arch_flags() -> list[str]:
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return ["-march=native"]
    if machine in ("arm64", "aarch64"):
        return ["-mcpu=native"]
    return []


def _cpu_id() -> bytes:
    """What ``-march=native`` depends on: the CPU model and its feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor().encode()
    keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
    return "\n".join(sorted(set(keep))).encode()


def _build(source: Path) -> Path:
    cxx = _compiler()
    flags = ["-O3", "-std=c++17", "-shared", "-fPIC", "-w", *_arch_flags(), "-I", jax.ffi.include_dir()]
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"cannot run the C++ compiler {cxx!r}: {e}") from e
    key = hashlib.sha256(b"\0".join([
        source.read_bytes(), HEADER.read_bytes(), version.encode(), " ".join(flags).encode(),
        jaxlib.__version__.encode(), _cpu_id(),
    ])).hexdigest()[:20]
    out = cache_dir() / f"{source.stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename into place: concurrent builders (test workers) never see half a file
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *flags, str(source), "-o", tmp], capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise NativeUnavailable(f"building {source.name} with {cxx} failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


_libraries: dict[str, ctypes.CDLL | NativeUnavailable] = {}


def _library(source: Path) -> ctypes.CDLL:
    """The built library, loaded; a failed build is remembered, not retried at every trace."""
    if str(source) not in _libraries:
        try:
            _libraries[str(source)] = ctypes.CDLL(str(_build(source)))
        except OSError as e:
            _libraries[str(source)] = NativeUnavailable(f"cannot load the native kernel {source.name}: {e}")
        except NativeUnavailable as e:
            _libraries[str(source)] = e
    lib = _libraries[str(source)]
    if isinstance(lib, NativeUnavailable):
        raise lib
    return lib


def target(source: Path, symbol: str) -> str:
    """Build ``source`` if needed and register its FFI handler ``symbol`` for the CPU; returns the target name.
    Raises :class:`NativeUnavailable` when native kernels are off or cannot be built."""
    if not enabled():
        raise NativeUnavailable(f"native CPU kernels are turned off (${ENV}={os.environ.get(ENV)!r})")
    name = f"kimi_jax_{symbol}"
    with _lock:
        if name not in _registered:
            handler = getattr(_library(source), symbol)
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(handler), platform="cpu")
            _registered.add(name)
    return name


@functools.cache
def _warn_once(message: str) -> None:
    log.warning("%s; using the plain-jnp reference instead", message)


def try_target(source: Path, symbol: str) -> str | None:
    """:func:`target` for the automatic choice: None (after logging why, once) when the kernel is unavailable;
    silent when the user turned native kernels off."""
    try:
        return target(source, symbol)
    except NativeUnavailable as e:
        if enabled():
            _warn_once(str(e))
        return None
