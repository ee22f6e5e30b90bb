"""Native CPU kernels: small C++ sources built on first use and called from XLA as FFI custom calls.

A decode step on XLA:CPU is a chain of few-row products, each streaming its weight once; XLA runs them one by one
(the small ones at about half the memory rate of the large ones) and first copies a chosen expert out of its
stacked ``[E, J, I]`` array. A few lines of C++ stream several products as one piece of work and read chosen
experts where they lie (``kernels_pallas/matvec``). The sources sit next to their op (``<op>/native.cc``, with what
they share in ``_native.h``), written against XLA's FFI headers, which ship with jaxlib (``jax.ffi.include_dir()``);
they are compiled with the machine's C++ compiler (``$CXX``, else ``c++``/``g++``/``clang++``) for this CPU, once
per source, header, compiler, jaxlib and CPU, into ``$XDG_CACHE_HOME/kimi-jax/native`` (``~/.cache/kimi-jax/native``),
and loaded from there afterwards.

Each source is one :class:`Kernel` (its op's ``native.KERNEL``): the automatic choice asks ``ready()``, which logs
once why a kernel that does not build (no compiler, say) is passed over for the reference; a call asks
``target(symbol)``, which raises :class:`NativeUnavailable` with the compiler's message.
``implementation="reference"`` runs an op without its native kernel.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jaxlib

from kernels_pallas._dispatch import KernelUnavailable

log = logging.getLogger(__name__)

_registered: set[str] = set()
_lock = threading.Lock()
_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


class NativeUnavailable(KernelUnavailable):
    """A native kernel cannot be built or loaded here; the message says why."""


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


def headers(source: Path) -> list[Path]:
    """The files ``source`` includes by a quoted path that exists relative to the including file (``_native.h``),
    and theirs: with the source, what the build cache is keyed on. XLA's headers resolve only under jaxlib's
    include directory; jaxlib's version keys them."""
    found: list[Path] = []
    todo = [source]
    while todo:
        including = todo.pop(0)
        for name in _INCLUDE.findall(including.read_bytes()):
            path = (including.parent / name.decode()).resolve()
            if path.is_file() and path not in found:
                found.append(path)
                todo.append(path)
    return found


def _build(source: Path) -> Path:
    cxx = _compiler()
    flags = ["-O3", "-std=c++17", "-shared", "-fPIC", "-w", *_arch_flags(), "-I", jax.ffi.include_dir()]
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"cannot run the C++ compiler {cxx!r}: {e}") from e
    key = hashlib.sha256(b"\0".join([
        source.read_bytes(), *(h.read_bytes() for h in headers(source)), version.encode(), " ".join(flags).encode(),
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


@functools.cache
def _warn_once(message: str) -> None:
    log.warning("%s; using the plain-jnp reference instead", message)


class Kernel:
    """One native kernel source (``<op>/native.cc``), built and loaded on first use; a failed build is
    remembered, not retried at every trace."""

    def __init__(self, source: Path):
        self.source = Path(source)
        self._library: ctypes.CDLL | NativeUnavailable | None = None
        self._unavailable: NativeUnavailable | None = None

    def library(self) -> ctypes.CDLL:
        """The built library, loaded; raises :class:`NativeUnavailable` when it cannot be built or loaded."""
        if self._unavailable is not None:
            raise self._unavailable
        with _lock:
            if self._library is None:
                try:
                    self._library = ctypes.CDLL(str(_build(self.source)))
                except OSError as e:
                    self._library = NativeUnavailable(f"cannot load the native kernel {self.source.name}: {e}")
                except NativeUnavailable as e:
                    self._library = e
        if isinstance(self._library, NativeUnavailable):
            raise self._library
        return self._library

    def ready(self) -> bool:
        """Whether the kernel builds and loads here (built on first use): the automatic choice's probe. When it
        does not, says why once."""
        try:
            self.library()
        except NativeUnavailable as e:
            _warn_once(str(e))
            return False
        return True

    def target(self, symbol: str) -> str:
        """Registers the FFI handler ``symbol`` for the CPU (building the kernel if needed); returns the target
        name. Raises :class:`NativeUnavailable` when the kernel cannot be built or loaded."""
        handler = getattr(self.library(), symbol)
        name = f"kimi_jax_{symbol}"
        with _lock:
            if name not in _registered:
                jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(handler), platform="cpu")
                _registered.add(name)
        return name

    @contextlib.contextmanager
    def unavailable(self, why: str):
        """Within the block the kernel is one that did not build (``why``: the message), built or not: how tests
        see the choices an op makes without it."""
        self._unavailable = NativeUnavailable(why)
        try:
            yield self
        finally:
            self._unavailable = None
