"""MXFP4 as compressed-tensors stores it (``mxfp4-pack-quantized``), for K3's routed experts.

Layout of a logical weight ``W[out, in]``:
  * ``weight_packed`` uint8 ``[out, in/2]``: byte j holds element 2j in the low nibble, 2j+1 in the high nibble.
  * ``weight_scale``  uint8 ``[out, in/32]``: E8M0 exponent, scale = 2**(byte - 127), one per 32 input columns.
  * nibble = E2M1 code: bit 3 sign, bits 2..1 exponent, bit 0 mantissa -> 0, .5, 1, 1.5, 2, 3, 4, 6 (and negatives;
    code 8 is -0, which the quantizer emits for small negatives and which decodes to 0).

Every decoded value is exact in bfloat16 (and float32) for scale bytes in the normal range, so dequantizing is
lossless. On device the weights stay packed (0.53 bytes per parameter) and are decoded next to the matmul.
"""

from __future__ import annotations

import numpy as np

from kernels_pallas.mxfp4 import E2M1 as E2M1_VALUES  # noqa: F401
from kernels_pallas.mxfp4 import GROUP, MXFP4Weight, dequantize  # noqa: F401  (device decode lives with the kernels)
from kernels_pallas.mxfp4 import PAIR as _PAIR_NP


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
    vals = _PAIR_NP[packed].reshape(*packed.shape[:-1], scale.shape[-1], GROUP)
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
    """Round float values (already divided by their scale) to the nearest E2M1 code, ties to even code.

    Values are clamped to +-6; the sign bit is kept for negative values that round to zero (-0 = code 8),
    as compressed-tensors does.
    """
    x = np.asarray(x, np.float32)
    a = np.minimum(np.abs(x), 6.0)
    # Midpoints between consecutive magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; ties go to the even code.
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    code = np.searchsorted(mids, a, side="left").astype(np.uint8)  # a <= mid -> lower code
    at_mid = np.isin(a, mids)
    # a exactly at a midpoint: searchsorted(side=left) picked the lower code; move up when that code is odd.
    code = np.where(at_mid & (code % 2 == 1), code + 1, code).astype(np.uint8)
    sign = np.signbit(x).astype(np.uint8) << 3
    return code | sign


def quantize_np(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantize ``[..., in]`` float weights to (packed ``[..., in/2]``, scale ``[..., in/32]``) uint8.

    Scale per 32-column group as compressed-tensors' MX path computes it: round the group's max |w| to a power
    of two (adding half an E2M1 mantissa step first), then byte = 127 + log2(that) - 2 (2 = floor(log2(6))).
    """
    w = np.asarray(w, np.float32)
    if w.shape[-1] % GROUP:
        raise ValueError(f"MXFP4 needs the input width to be a multiple of {GROUP}, got {w.shape[-1]}")
    g = w.reshape(*w.shape[:-1], w.shape[-1] // GROUP, GROUP)
    amax = np.abs(g).max(axis=-1)
    bits = amax.view(np.uint32).astype(np.int64)
    # float32: 23 mantissa bits; E2M1 keeps 1 -> add 1 << (23 - 1 - 1), then keep sign+exponent.
    p2 = ((bits + (1 << 21)) & 0xFF800000).astype(np.uint32).view(np.float32)
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(p2))
    e = np.where(amax > 0, e, -127.0)  # all-zero group: smallest scale, every code 0
    byte = np.clip(127 + e - 2, 0, 254).astype(np.uint8)
    scaled = g / scale_values_np(byte)[..., None]
    codes = encode_e2m1_np(scaled).reshape(w.shape)
    return pack_codes_np(codes), byte
