"""Choosing an implementation for a kernel call.

Names every kernel package understands:

* ``"reference"``: the plain-jnp oracle (``reference.py``); runs anywhere. The automatic choice on CPU.
* ``"pallas"``: the Pallas kernel compiled for the target accelerator (Triton on GPU, Mosaic on TPU). The
  automatic choice on TPU/GPU. Asking for it on CPU raises :class:`KernelUnavailable` -- never a silent
  fallback to the reference.
* ``"pallas_interpret"``: the same Pallas kernel source run by Pallas's HLO interpreter
  (``interpret=True``), with the GPU (Triton) block choices. This is how CPU tests exercise kernel code.

Two ops also take ``"cpu_native"``, a C++ kernel for XLA:CPU (``kernels_pallas/_native.py``): the grouped decode
products (``matvec.group``) and the MoE decode matmul (``moe_gmm.gather_matmul``, which runs on it), chosen
automatically on CPU when they apply and it builds.

The target platform is the one being traced for: the platform of an abstract mesh's device when one is set
(``jax.sharding.use_abstract_mesh``, which is how CI lowers for TPU/CUDA on a CPU machine), else
``jax.default_backend()``.
"""

from __future__ import annotations

import jax

PALLAS = "pallas"
INTERPRET = "pallas_interpret"
NATIVE = "cpu_native"  # a C++ kernel for XLA:CPU; only ops that have one (matvec, moe_gmm.gather_matmul) take it


class KernelUnavailable(RuntimeError):
    """An explicitly requested kernel implementation cannot run here."""


def target_platform() -> str:
    """``"tpu"``, ``"gpu"`` or ``"cpu"``: what the current trace is lowered for."""
    mesh = jax.sharding.get_abstract_mesh()
    device = getattr(mesh, "abstract_device", None)
    platform = device.platform if (device is not None and not mesh.empty) else jax.default_backend()
    return {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)


def resolve(op: str, implementation: str | None, available: dict, *, accelerated: tuple[str, ...] = ()) -> str:
    """Return the implementation name to use for ``op``.

    ``available`` maps names to callables. ``None`` means automatic: the first of ``accelerated`` that is
    available on TPU/GPU, else ``"reference"``. An explicit name that is unknown, or ``"pallas"`` on a platform
    without a Pallas compiler, raises :class:`KernelUnavailable`.
    """
    platform = target_platform()
    if implementation is None:
        if platform in ("tpu", "gpu"):
            for name in accelerated:
                if name in available:
                    return name
        return "reference"
    if implementation not in available:
        raise KernelUnavailable(
            f"{op}: implementation={implementation!r} is not available (choose from {sorted(available)})"
        )
    if implementation == PALLAS and platform not in ("tpu", "gpu"):
        raise KernelUnavailable(
            f"{op}: implementation='pallas' needs a TPU or GPU, but the target platform is {platform!r}; "
            f"use implementation='{INTERPRET}' to run the Pallas kernel in interpret mode on CPU"
        )
    return implementation


def pallas_platform(implementation: str) -> tuple[str, bool]:
    """(platform whose block rules the kernel follows, interpret?) for a resolved Pallas implementation."""
    if implementation == INTERPRET:
        return "gpu", True
    return target_platform(), False
