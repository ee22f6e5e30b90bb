"""Routed experts: each token's chosen experts applied to it, one op for every way of running them.

``routed_experts(z [N, L], w, idx [N, X], act=...) -> (y [N, X, L], shared [N, D] or None)``; ``w`` is
``{"w1", "w3": [E, F, L], "w2": [E, L, F]}``, float arrays or packed weights (:mod:`kernels_pallas.packed`), and
``act(a, b)`` the GLU (float32 in, compute dtype out). The ways (``path``, :func:`choose_path` when not named):

* ``"gather"``: each (token, expert) pair reads its expert's weights (decode: no more pairs than experts);
* ``"sorted"``: the pairs sorted by expert into one grouped matmul (prefill);
* ``"dense"``: every expert on every token, each expert read once (float experts; the automatic choice on
  XLA:CPU, one device, float32, for batches between the two);
* on a mesh whose axes split the experts (``exchange`` given): pairs sent to the devices that hold their experts
  (:mod:`kernels_pallas.experts.expert_parallel`).

On CPU a gather (float or packed experts) may run, with the shared experts when given and in the same format, as
one native call per projection (:func:`kernels_pallas.experts.cpu.grouped_gather`); only then is the second result
the shared experts' output.
The products inside each path are kernel ops of their own (:mod:`kernels_pallas.moe_gmm`,
:mod:`kernels_pallas.matvec`), dispatched with ``implementation``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax.numpy as jnp

from kernels_pallas import matvec, packed
from kernels_pallas._dispatch import Placement, target_platform
from kernels_pallas.experts import cpu, expert_parallel, reference

PATHS = ("gather", "sorted", "dense")
# On XLA:CPU with the native kernel, bfloat16 or packed experts are gathered up to this many (token, expert) pairs
# even where they outnumber the experts: a verify step's k + 1 positions (top 2: 18 pairs at k = 8 and batch 1, 80 at
# k = 4 and batch 8). A verify forward (benchmarks/verify_cost.py, as matvec.PLAIN_ROWS says), against the sorted
# path past the experts' count (16 for the packed experts before): at batch 1 over 9 positions the demo model (8
# MXFP4 experts) in float32 11.5 -> 5.8 ms, and with matvec.PLAIN_ROWS in bfloat16 the demo 6.6 -> 2.6 ms, the
# benchmark model (16 bfloat16 experts) 50.7 -> 30.4 ms; at batch 8 over 5 positions (80 pairs, against a bound of
# 32) the demo 16.7 -> 11.3 ms in float32, 10.6 -> 7.6 in bfloat16, the benchmark model 93.4 -> 88.7 ms.
GATHER_PAIRS = 80


@dataclasses.dataclass(frozen=True)
class Exchange:
    """How the experts are split over the placement's mesh: ``weight_specs`` (the partition specs of ``w``, shaped
    like it: a ``PartitionSpec`` per array, a packed weight's type holding one per field), the token exchange
    (``"auto"``: ``"ragged"`` on TPU / GPU, ``"capacity"`` on CPU, where XLA has no ragged all-to-all;
    ``"ragged_emulated"``: the ragged offsets over ``all_gather``) and ``capacity_factor`` (None: lossless buffers;
    a number: buffers at that multiple of the mean load, dropping the pairs past it)."""

    weight_specs: Any
    dispatch: str = "auto"
    capacity_factor: float | None = None


class Shared(NamedTuple):
    """The shared experts, for a path that runs them beside the routed ones: input ``x [N, D]``, weights
    ``gate``/``up`` ``[S, D]`` and ``down`` ``[D, S]`` (float or packed), their GLU ``act(a, b)``."""

    x: Any
    gate: Any
    up: Any
    down: Any
    act: Callable


def choose_path(pairs: int, num_experts: int, *, float32: bool, implementation=None,
                placement=None, requested: str = "auto") -> str:
    """The path for ``pairs`` (token, expert) pairs: ``requested`` unless ``"auto"``; else ``"gather"`` when the
    pairs do not outnumber the experts and ``"sorted"`` otherwise, and on XLA:CPU (automatic kernels, one
    device, float32 experts) ``"dense"`` for batches in between: each expert is read once, and the wasted products
    cost less than the per-slot loop. With the plain-jnp gather (which copies each chosen expert) that starts at
    3/4 pairs per expert (measured: 2.5 vs 3.5 ms at 16 pairs / 16 experts); with the native gather kernel, past
    one pair per expert (batch-8 decode of the benchmark model, 16 pairs / 16 experts: 69 vs 79 ms per step
    gathered vs dense). Other experts (bfloat16, packed) on XLA:CPU with the native kernel: gathered (read in place)
    up to :data:`GATHER_PAIRS` pairs or as many as there are experts, sorted beyond."""
    if requested != "auto":
        if requested not in PATHS:
            raise ValueError(f"unknown moe_path {requested!r}; choose auto or one of {list(PATHS)}")
        return requested
    E = num_experts
    one_device = placement is None or placement.devices == 1
    cpu = implementation is None and one_device and target_platform(placement) == "cpu"
    if cpu and float32:
        gather = pairs <= E if matvec.native.KERNEL.ready() else 4 * pairs < 3 * E
        return "gather" if gather else "dense" if pairs <= 2 * E else "sorted"
    if cpu and matvec.native.KERNEL.ready():
        # bfloat16 and packed experts (MXFP4, int8 / int4) are read in place by the native kernel up to GATHER_PAIRS
        # pairs (a verify step's few positions over few experts), where the sorted path converts or decodes every
        # expert
        return "gather" if pairs <= max(E, GATHER_PAIRS) else "sorted"
    return "gather" if pairs <= E else "sorted"


def routed_experts(z_NL, w: dict, idx_NX, *, act, compute_dtype, precision=None, implementation=None,
                   path: str = "auto", placement: Placement | None = None, exchange: Exchange | None = None,
                   shared: Shared | None = None):
    """``(y [N, X, L] in compute_dtype, the shared experts' output [N, D] in compute_dtype or None)``: see the
    module docstring. ``path``: ``"auto"`` or one of :data:`PATHS` (a run's ``moe_path``)."""
    kw = dict(act=act, compute_dtype=compute_dtype, precision=precision, implementation=implementation)
    if exchange is not None and placement is not None:
        local = lambda z, w, idx: _local(z, w, idx, path=path, placement=placement, **kw)  # noqa: E731
        y = expert_parallel.routed(z_NL, w, idx_NX, exchange, placement, local, ragged=_ragged(exchange, placement),
                                   **kw)
        return y, None
    N, X = idx_NX.shape
    chosen = choose_path(N * X, w["w1"].shape[0], float32=_float32(w, compute_dtype),
                         implementation=implementation, placement=placement, requested=path)
    if chosen == "gather":
        fused = cpu.grouped_gather(z_NL, w, idx_NX, shared, act=act, compute_dtype=compute_dtype,
                                   implementation=implementation, placement=placement)
        if fused is not None:
            return fused
    return _local(z_NL, w, idx_NX, path=chosen, placement=placement, **kw), None


def _local(z_NL, w, idx_NX, *, path, placement, act, compute_dtype, precision, implementation):
    """One device's tokens through one path (the whole of ``w`` on this device)."""
    N, X = idx_NX.shape
    path = choose_path(N * X, w["w1"].shape[0], float32=_float32(w, compute_dtype),
                       implementation=implementation, placement=placement, requested=path)
    kw = dict(act=act, compute_dtype=compute_dtype, implementation=implementation)
    if path == "dense":
        if packed.is_packed(w["w1"]):
            raise ValueError("moe_path='dense' needs float expert weights (MXFP4 experts use 'gather' or 'sorted')")
        return reference.dense(z_NL, w, idx_NX, precision=precision, **kw)
    return (reference.gather if path == "gather" else reference.sorted_groups)(z_NL, w, idx_NX, **kw)


def _float32(w, compute_dtype) -> bool:
    return not packed.is_packed(w["w1"]) and jnp.dtype(compute_dtype) == jnp.float32


def _ragged(exchange: Exchange, placement: Placement) -> str:
    """The exchange's dispatch with ``"auto"`` decided for the target (TPU / GPU have ``ragged_all_to_all``)."""
    if exchange.dispatch != "auto":
        return exchange.dispatch
    return "ragged" if target_platform(placement) in ("tpu", "gpu") else "capacity"
