"""Kernels for kimi-jax: one small package per op, each a plain-jnp reference (the oracle and the CPU path)
plus accelerator kernels behind the same signature, chosen with ``implementation=``.

``implementation=None`` picks the reference on CPU and the Pallas kernel on TPU/GPU where one exists; an
implementation that was asked for explicitly and cannot run raises :class:`KernelUnavailable`.
"""

from kernels_pallas._dispatch import KernelUnavailable, resolve  # noqa: F401
