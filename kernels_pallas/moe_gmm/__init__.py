"""MoE expert matmuls with bf16/f32 or MXFP4-packed weights.

``gmm(x [M, I], w [E, J, I], group_sizes [E]) -> [M, J]`` for expert-sorted rows (prefill-shaped) and
``gather_matmul(x [N, X, I], w [E, J, I], idx [N, X]) -> [N, X, J]`` for few tokens (decode-shaped). Both return
float32.
``w`` is a float array or a :class:`kernels_pallas.mxfp4.MXFP4Weight` (kept packed; the kernels decode per tile); the
reference and the CPU native gather also take the integer formats of :mod:`kernels_pallas.quant`.

``gmm`` has a third implementation, ``"xla_cpu"`` (:mod:`kernels_pallas.moe_gmm.xla_cpu`), the automatic choice on
CPU: the reference is ``lax.ragged_dot``, which XLA:CPU runs as a dense product with every expert (15x slower); the
XLA:CPU form reads each expert once but loops with traced bounds, which reverse mode cannot differentiate, so training
(``implementation="reference"``) runs ``ragged_dot``.

``gather_matmul`` has a third implementation, ``"cpu_native"`` (:mod:`kernels_pallas.matvec`): on XLA:CPU with float32 or
bfloat16 weights it reads the chosen experts in place, where the reference copies each one out of the stacked array first
(batch-1 decode of the benchmark model spent about a fifth of its step on those copies). It is the automatic choice
there when it builds (``kernels_pallas/_native.py``); ``implementation="reference"`` keeps the plain-jnp path.

On a mesh: expert parallelism (``kimi_jax/parallel/expert_parallel.py``) runs these inside its own ``shard_map`` on each
device's local experts, with no placement. Given a placement, ``gmm`` runs whole on every device (its rows
are sorted over all tokens) and ``gather_matmul`` splits tokens over ``batch`` with every expert on each device.
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas import matvec
from kernels_pallas._dispatch import (
    NATIVE,
    PALLAS,
    REFERENCE,
    XLA_CPU,
    CpuImpl,
    Op,
    Rule,
    target_platform,
)
from kernels_pallas.matvec import native
from kernels_pallas.moe_gmm import pallas, reference, xla_cpu
from kernels_pallas import packed

GMM_RULE = Rule(args=("MI", "EJI", "E"), out="MJ")
GATHER_RULE = Rule(args=("NXI", "EJI", "NX"), out="NXJ", split=(("N", "batch"),))


def _native_item(x, w, idx, compute_dtype):
    """(the (x, w, ids) item of the native grouped product, why it cannot run or None)."""
    dt = jnp.dtype(compute_dtype or x.dtype)
    if dt not in native.SYMBOLS:
        return None, f"{dt.name} compute (the native kernel runs float32 or bfloat16)"
    if not packed.is_packed(w) and jnp.dtype(w.dtype) != dt:
        return None, f"{jnp.dtype(w.dtype).name} experts with {dt.name} compute (the reference rounds them first)"
    # x rounded to the compute dtype as the reference does, then widened (exactly) for the kernel
    item = (x.reshape(-1, x.shape[-1]).astype(dt).astype(jnp.float32), w, idx.reshape(-1))
    return item, native.unsupported([item])


def _native_gather_unsupported(x, w, idx, *, compute_dtype=None):
    return _native_item(x, w, idx, compute_dtype)[1]


def _native_gather(x, w, idx, *, compute_dtype=None):
    item, _ = _native_item(x, w, idx, compute_dtype)
    return native.group([item])[0].reshape(*x.shape[:2], -1)


GMM = Op("moe_gmm", GMM_RULE, {REFERENCE: reference.gmm, PALLAS: pallas.gmm},
         cpu=(CpuImpl(XLA_CPU, xla_cpu.gmm),))
GATHER = Op("moe_gather_matmul", GATHER_RULE, {REFERENCE: reference.gather_matmul, PALLAS: pallas.gather_matmul},
            cpu=(CpuImpl(NATIVE, _native_gather, ready=native.KERNEL.ready, unsupported=_native_gather_unsupported),))


def gmm(x, w, group_sizes, *, compute_dtype=None, implementation=None, placement=None):
    return GMM(x, w, group_sizes, compute_dtype=compute_dtype, implementation=implementation, placement=placement)


def native_gather_ready() -> bool:
    """Whether the automatic choice of :func:`gather_matmul` for float32 operands is the native kernel here (on
    CPU, and it builds). Builds it on first use."""
    return matvec.native_ready()


def gather_matmul(x, w, idx, *, compute_dtype=None, implementation=None, placement=None):
    return GATHER(x, w, idx, compute_dtype=compute_dtype, implementation=implementation, placement=placement)


def _float32_weights(z, w1, w3, w2, *, compute_dtype=None, **_):
    dts = {jnp.dtype(compute_dtype or z.dtype), *(jnp.dtype(getattr(w, "dtype", jnp.uint8)) for w in (w1, w3, w2))}
    return None if dts == {jnp.dtype(jnp.float32)} else "operands other than float32"


DENSE = Op("moe_dense_experts", None, {REFERENCE: reference.dense_experts}, plain=True,
           cpu=(CpuImpl(XLA_CPU, xla_cpu.dense_experts, unsupported=_float32_weights),))


def dense_experts(z, w1, w3, w2, *, act, compute_dtype=None, precision=None, implementation=None, placement=None):
    """Every expert on every token (float expert weights): ``[E, N, L]`` float32. ``act(a, b)``: the GLU."""
    return DENSE(z, w1, w3, w2, act=act, compute_dtype=compute_dtype, precision=precision,
                 implementation=implementation, placement=placement)


def expert_path(pairs: int, num_experts: int, *, float32: bool, implementation=None, placement=None) -> str:
    """How to run ``pairs`` (token, expert) pairs: ``"gather"`` (each pair reads its expert's weights; decode),
    ``"sorted"`` (tokens sorted into one grouped matmul; prefill), or ``"dense"`` (every expert on every token).

    Dense is an XLA:CPU choice (the automatic one, one device, float32 experts) for batches in between: each
    expert is read once, and the wasted products cost less than the per-slot loop. With the plain-jnp gather
    (which copies each chosen expert) that starts at 3/4 pairs per expert (measured: 2.5 vs 3.5 ms at 16 pairs /
    16 experts); with the native gather kernel, past one pair per expert (batch-8 decode of the benchmark model,
    16 pairs / 16 experts: 69 vs 79 ms per step gathered vs dense).
    """
    E = num_experts
    one_device = placement is None or placement.devices == 1
    if implementation is None and float32 and one_device and target_platform(placement) == "cpu":
        gather = pairs <= E if native_gather_ready() else 4 * pairs < 3 * E
        return "gather" if gather else "dense" if pairs <= 2 * E else "sorted"
    return "gather" if pairs <= E else "sorted"
