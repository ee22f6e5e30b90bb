"""MXFP4 as compressed-tensors stores it (``mxfp4-pack-quantized``, K3's routed experts): the format in one place.

Layout of a logical weight ``W[out, in]``:
  * ``weight_packed`` uint8 ``[out, in/2]``: byte j holds element 2j in the low nibble, 2j+1 in the high nibble.
  * ``weight_scale``  uint8 ``[out, in/32]``: E8M0 exponent, scale = 2**(byte - 127), one per 32 input columns.
  * nibble = E2M1 code: bit 3 sign, bits 2..1 exponent, bit 0 mantissa -> 0, .5, 1, 1.5, 2, 3, 4, 6 (and negatives;
    code 8 is -0, which the quantizer emits for small negatives and which decodes to 0).

Every decoded value is exact in bfloat16 (and float32) for scale bytes in the normal range, so dequantizing is
lossless. On device the weights stay packed (0.53 bytes per parameter) as one :class:`MXFP4Weight` (a pytree: it
passes through ``jit`` and sharding like an array pair) and are decoded next to the matmul (:func:`dequantize`).
The host codec below (``*_np``) writes and reads the checkpoint bytes, bit for bit as compressed-tensors does.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

GROUP = 32
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
PAIR = np.stack([E2M1[np.arange(256) & 0xF], E2M1[np.arange(256) >> 4]], axis=-1)  # byte -> (low, high)


class MXFP4Weight(NamedTuple):
    """One MXFP4 weight (a packed weight type, :mod:`kernels_pallas.packed`): ``[..., J, I]`` logical values as
    ``packed [..., J, I/2]`` nibble pairs and ``scale [..., J, I/32]`` E8M0 bytes."""

    packed: jax.Array  # uint8 [..., J, I/2]
    scale: jax.Array  # uint8 [..., J, I/32]

    @property
    def shape(self):
        """Logical (dequantized) shape."""
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    # Elements of each field's last dimension per scale group: a shard boundary must fall between groups.
    GROUP_UNITS = (GROUP // 2, 1)

    @classmethod
    def random(cls, key, shape) -> "MXFP4Weight":
        """Random codes for ``shape`` logical values (any byte is a valid pair of codes) and scale bytes near
        2**-6, a plausible expert weight scale: the weights of a randomly initialised model."""
        *lead, k = shape
        kp, ks = jax.random.split(key)
        packed = jax.random.randint(kp, (*lead, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
        return cls(packed, jax.random.randint(ks, (*lead, k // GROUP), 119, 123, jnp.int32).astype(jnp.uint8))


def dequantize(w: MXFP4Weight, dtype=jnp.bfloat16) -> jax.Array:
    """Decode to ``[..., J, I]``: a 256-entry byte->pair table, times the power-of-two scale (exact)."""
    packed, scale = w
    if packed.shape[-1] * 2 != scale.shape[-1] * GROUP or packed.shape[:-1] != scale.shape[:-1]:
        raise ValueError(f"MXFP4 packed {packed.shape} and scale {scale.shape} do not match")
    vals = jnp.asarray(PAIR)[packed.astype(jnp.int32)]
    vals = vals.reshape(*packed.shape[:-1], scale.shape[-1], GROUP)
    s = jax.lax.bitcast_convert_type(scale, jnp.float8_e8m0fnu).astype(jnp.float32)
    return (vals * s[..., None]).reshape(*packed.shape[:-1], packed.shape[-1] * 2).astype(dtype)


def as_dense(w, dtype) -> jax.Array:
    """Dense array for either a plain weight or an :class:`MXFP4Weight`."""
    return dequantize(w, dtype) if isinstance(w, MXFP4Weight) else w.astype(dtype)


# -- host codec (numpy): the checkpoint bytes ------------------------------------------------------------------


def _check(packed_shape, scale_shape):
    if len(packed_shape) != len(scale_shape) or packed_shape[:-1] != scale_shape[:-1]:
        raise ValueError(f"MXFP4 packed {tuple(packed_shape)} and scale {tuple(scale_shape)} disagree on leading dims")
    if packed_shape[-1] * 2 != scale_shape[-1] * GROUP:
        raise ValueError(
            f"MXFP4 packed last dim {packed_shape[-1]} (= {2 * packed_shape[-1]} values) does not match "
            f"{scale_shape[-1]} scales x {GROUP}"
        )


def scale_values_np(scale_u8: np.ndarray) -> np.ndarray:
    """E8M0 bytes -> float32 powers of two (255 is NaN by the OCP MX spec)."""
    s = np.ldexp(np.float32(1.0), scale_u8.astype(np.int32) - 127).astype(np.float32)
    return np.where(scale_u8 == 255, np.float32(np.nan), s)


def dequantize_np(packed: np.ndarray, scale: np.ndarray, dtype=np.float32) -> np.ndarray:
    """Host decode: ``[..., in/2]`` uint8 + ``[..., in/32]`` uint8 -> ``[..., in]`` values."""
    _check(packed.shape, scale.shape)
    vals = PAIR[packed].reshape(*packed.shape[:-1], scale.shape[-1], GROUP)
    with np.errstate(over="ignore"):  # 6 x 2**127 overflows to inf, as it does in compressed-tensors
        out = vals * scale_values_np(scale)[..., None]
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2).astype(dtype)


def unpack_codes_np(packed: np.ndarray) -> np.ndarray:
    """uint8 ``[..., n/2]`` -> nibble codes uint8 ``[..., n]`` (low nibble first)."""
    return np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_codes_np(codes: np.ndarray) -> np.ndarray:
    """Nibble codes uint8 ``[..., n]`` -> uint8 ``[..., n/2]`` (element 2j low, 2j+1 high)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of values ({codes.shape[-1]})")
    c = codes.astype(np.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def encode_e2m1_np(x: np.ndarray) -> np.ndarray:
    """Round values (already divided by their scale) to E2M1 codes exactly as compressed-tensors' ``cast_to_fp4``
    followed by ``pack_fp4_to_uint8`` does.

    Magnitudes are clamped to 6; ties go to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2,
    3.5 -> 4, 5 -> 4). A negative value that rounds to zero keeps its sign (code 8, "-0"), but ``-0.0`` itself
    gives code 0: compressed-tensors multiplies by ``torch.sign(x)``, which is 0 for either zero.
    """
    x = np.asarray(x, np.float32)
    if not np.all(np.isfinite(x)):
        raise ValueError("MXFP4: cannot encode NaN or infinite values")
    a = np.abs(x)
    # One comparison per boundary; strict vs inclusive alternates so that ties land on the even code.
    code = ((a > 0.25).astype(np.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5)
            + (a > 5.0)).astype(np.uint8)
    return code | ((x < 0).astype(np.uint8) << 3)


def values_to_codes_np(v: np.ndarray) -> np.ndarray:
    """Exact E2M1 values (0, +-0.5, ... +-6, either zero) -> codes, as ``pack_fp4_to_uint8`` maps them: the sign
    bit of the value becomes bit 3 (so ``-0.0`` is code 8). Raises on anything that is not an E2M1 value."""
    v = np.asarray(v, np.float32)
    mag = np.abs(v)
    code = np.searchsorted(E2M1[:8], mag).astype(np.uint8)
    if np.any(code > 7) or np.any(E2M1[np.minimum(code, 7)] != mag):
        raise ValueError("values_to_codes_np: input holds values that are not E2M1 (0, 0.5, 1, 1.5, 2, 3, 4, 6)")
    return code | (np.signbit(v).astype(np.uint8) << 3)


def scale_bytes_np(amax: np.ndarray) -> np.ndarray:
    """E8M0 scale byte per group from the group's max |w|, as compressed-tensors' ``generate_mx_scales`` then
    ``compress_mx_scale``: round max |w| to a power of two p (adding half an E2M1 mantissa step, i.e. bit 21 of a
    float32, before truncating the mantissa), then byte = 127 + log2(p) - 2 (2 = floor(log2(6))), clamped at 0
    (an all-zero group gets byte 0). Groups whose max rounds past the float32 range have no valid scale."""
    amax = np.asarray(amax, np.float32)
    bits = amax.view(np.uint32).astype(np.int64)
    p2 = ((bits + (1 << 21)) & 0xFF800000).astype(np.uint32).view(np.float32)
    if not np.all(np.isfinite(p2)):
        raise ValueError("MXFP4: a group's max |w| is too large for an E8M0 scale (>= 1.75 * 2**127)")
    with np.errstate(divide="ignore"):
        e = np.log2(p2)  # exact: p2 is a power of two (or 0 -> -inf)
    return np.clip(127 + e - 2, 0, 254).astype(np.uint8)


def quantize_np(w: np.ndarray, scale: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Quantize ``[..., in]`` weights to (packed ``[..., in/2]``, scale ``[..., in/32]``) uint8, bit for bit as
    compressed-tensors' MX path (``calculate_qparams`` -> ``MXFP4PackedCompressor.compress``) writes them.

    ``scale``: optional E8M0 bytes to use instead of the per-group choice (values beyond 6x the scale saturate).
    float32 and bfloat16 inputs are divided by the scale in their own precision, as torch does; other float
    dtypes are first cast to float32.
    """
    w = np.asarray(w)
    in_dtype = w.dtype if w.dtype in (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)) else np.dtype(np.float32)
    w = w.astype(in_dtype)
    if w.shape[-1] % GROUP:
        raise ValueError(f"MXFP4 needs the input width to be a multiple of {GROUP}, got {w.shape[-1]}")
    g = w.astype(np.float32).reshape(*w.shape[:-1], w.shape[-1] // GROUP, GROUP)
    if not np.all(np.isfinite(g)):
        raise ValueError("MXFP4: cannot quantize NaN or infinite weights")
    if scale is None:
        scale = scale_bytes_np(np.abs(g).max(axis=-1))
    else:
        scale = np.asarray(scale, np.uint8)
        if scale.shape != g.shape[:-1]:
            raise ValueError(f"MXFP4 scale shape {scale.shape} does not match weights {w.shape} (want {g.shape[:-1]})")
        if np.any(scale == 255):
            raise ValueError("MXFP4: scale byte 255 is NaN in E8M0")
    # Division by a power of two is exact in float32 unless the result is subnormal; rounding that exact quotient
    # to the input dtype reproduces a division done in that dtype.
    scaled = (g / scale_values_np(scale)[..., None]).astype(in_dtype).astype(np.float32)
    codes = encode_e2m1_np(scaled).reshape(w.shape)
    return pack_codes_np(codes), scale
