"""Small helpers shared by the Pallas kernels: padding, block sizes, per-backend compiler parameters; and
:func:`acc_dtype`, the dtype every plain-XLA form (references, CPU forms) computes in.

Block-shape rules the kernels follow (JAX_NOTES §1.6):

* GPU (Triton): every array in a kernel has power-of-two sizes, and ``jnp.dot`` wants each side >= 16. So the
  wrappers pad head dims to powers of two and row blocks to >= 16; padding with zeros never changes a dot.
* TPU (Mosaic): the last two block dims are multiples of (8, 128) or the whole array dim. The wrappers use
  whole-array trailing dims (head dims, the contraction dim) and row blocks that are multiples of 8 (16 for bf16).

Sizes that do not divide the block are padded in the wrapper, never read out of bounds: Pallas does not mask
loads past the end of an array (the interpreter clamps them, Triton reads foreign memory).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plt

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST
NEG = -1e30  # "minus infinity" that keeps exp(a - b) finite for masked rows


def acc_dtype(*operands) -> jnp.dtype:
    """What the plain-XLA forms (the references, the XLA:CPU forms) compute and accumulate in: float32, or float64
    where an operand is float64 (a float64 run under ``jax_enable_x64``, which then matches a float64 oracle to
    float64 rounding). bfloat16 and float32 operands get float32, as always. ``operands``: arrays, dtypes or pytrees
    of them (int8 cache rows, packed weights); leaves that are not floating point are ignored."""
    out = jnp.dtype(F32)
    for x in jax.tree.leaves(operands):
        try:
            dt = jnp.dtype(getattr(x, "dtype", x))
        except TypeError:
            continue
        if jnp.issubdtype(dt, jnp.floating) and dt.itemsize > out.itemsize:
            out = jnp.promote_types(out, dt)
    return out


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def pow2_divisor(n: int, target: int, minimum: int) -> int | None:
    """The largest power of two in ``[minimum, next_pow2(target)]`` that divides ``n`` (a block size), or None."""
    b = next_pow2(target)
    while b >= minimum:
        if n % b == 0:
            return b
        b //= 2
    return None


def round_up(n: int, m: int) -> int:
    return -(-int(n) // m) * m


def cdiv(a: int, b: int) -> int:
    return -(-int(a) // b)


def pad_axis(x, axis: int, size: int, value=0):
    """Right-pad ``x`` along ``axis`` to ``size`` (no copy when it already has that size)."""
    axis = axis % x.ndim
    extra = size - x.shape[axis]
    if extra < 0:
        raise ValueError(f"cannot pad axis {axis} of {x.shape} down to {size}")
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def row_block(n: int, target: int, platform: str, dtype) -> int:
    """A row (second-to-last) block size for ``n`` rows: a power of two >= 16 on GPU, a multiple of 8 (16 for
    16-bit types) on TPU, never much larger than ``n`` itself."""
    if platform == "tpu":
        base = 16 if jnp.dtype(dtype).itemsize == 2 else 8
        return min(round_up(target, base), round_up(n, base))
    return max(16, min(next_pow2(target), next_pow2(n)))


def key_block(s: int, target: int, platform: str) -> int:
    """Block over keys/cache slots. Prefers a block that divides ``s`` so a static cache is never copied to pad it.

    TPU wants multiples of 128 on the lane dim of the score tile; GPU wants powers of two >= 16.
    """
    if platform == "tpu":
        step = 128
        cand = [b for b in range(step, max(target, step) + 1, step) if s % b == 0]
        return max(cand) if cand else min(round_up(target, step), round_up(s, step))
    b = max(16, min(next_pow2(target), next_pow2(s)))
    for cand in (b, b // 2, b // 4):  # a slightly smaller power of two that divides s beats a padded copy
        if cand >= 16 and s % cand == 0:
            return cand
    return b


def compiler_params(platform: str, interpret: bool, *, num_warps=None, num_stages=None, semantics=None):
    """Backend compiler parameters (None in interpret mode, where they mean nothing)."""
    if interpret:
        return None
    if platform == "gpu":
        return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    if platform == "tpu":
        return pltpu.CompilerParams(dimension_semantics=semantics)
    raise ValueError(f"no Pallas compiler for platform {platform!r}")


def dot_nt(a, b, precision=None):
    """``a [M, I] @ b [J, I]^T`` with a float32 result."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=F32, precision=precision)


def dot_tn(a, b, precision=None):
    """``a [I, M]^T @ b [I, J]`` with a float32 result."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=F32, precision=precision)


def dot_nn(a, b, precision=None):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=F32, precision=precision)


def precision_for(dtype):
    """Full float32 products for float32 inputs: Triton would otherwise use TF32 (10-bit mantissa)."""
    return HIGHEST if jnp.dtype(dtype) == jnp.float32 else None
