"""MXFP4 codec (kernels_pallas/mxfp4.py) against compressed-tensors, the library that wrote K3's experts: bit for bit, both
directions, on random tensors that include zeros of both signs, float32 subnormals, E2M1 rounding ties, values that
saturate at 6 x scale, and group maxima across the whole E8M0 range."""

import ml_dtypes
import numpy as np
import pytest
import torch
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.helpers import (
    pack_fp4_to_uint8,
    quantize_and_pack_fp4,
    unpack_fp4_from_uint8,
)
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4
from compressed_tensors.quantization.utils.helpers import calculate_qparams
from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales

from kernels_pallas import mxfp4

# The weights scheme of the release's quantization_config (config_groups.group_0.weights).
ARGS = QuantizationArgs(num_bits=4, type="float", strategy="group", group_size=32, symmetric=True,
                        scale_dtype=torch.uint8, dynamic=False)
SCHEME = QuantizationScheme(targets=["Linear"], weights=ARGS)
TIES = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)


def ct_quantize(w: torch.Tensor):
    """compressed-tensors' own path: per-(row, 32-column group) min/max -> calculate_qparams -> compress."""
    g = w.reshape(w.shape[0], -1, 32)
    scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), ARGS)
    out = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp}, SCHEME)
    return out["weight_packed"].numpy(), out["weight_scale"].numpy()


def ct_decompress(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    out = MXFP4PackedCompressor.decompress(
        {"weight_packed": torch.from_numpy(packed), "weight_scale": torch.from_numpy(scale)}, SCHEME)
    return out["weight"].float().numpy()


def nasty_weights(rng, rows=48, cols=256, dtype=np.float32):
    """Random normal weights with every hard case planted in known rows."""
    w = rng.standard_normal((rows, cols)).astype(np.float32) * np.float32(0.05)
    w *= np.exp2(rng.integers(-3, 4, (rows, cols // 32, 1))).repeat(32, -1).reshape(rows, cols).astype(np.float32)
    w[0, :32] = 0.0  # all-zero group -> scale byte 0
    w[1, :32] = -0.0  # all negative zeros -> code 0 (torch.sign(-0.0) == 0), not 8
    w[2, :64:2] = -0.0
    w[3, :32] = rng.standard_normal(32) * 1e-40  # float32 subnormals: group max rounds to 0 or 2**-126
    w[3, 32:64] = rng.standard_normal(32) * 1e-38
    w[4, 1:32] = rng.standard_normal(31) * 1e-3  # one large value makes the rest round to +-0 (codes 0 / 8)
    w[4, 0] = 10.0
    w[5, :32] = rng.standard_normal(32) * 1e37  # near the top of the float32 range (scale byte ~250)
    w[6, :32] = rng.standard_normal(32) * 1e-30  # near the bottom (small bytes)
    # Exact E2M1 rounding ties at scale 1 (group max 6 -> byte 127): +-0.25 .. +-5.0, then 6 itself.
    ties = np.concatenate([TIES, -TIES, TIES * 0.5, [6.0, -6.0]]).astype(np.float32)
    w[7, : len(ties)] = ties
    w[7, len(ties):32] = 0.5
    # Group max with mantissa 1.5..1.75 x 2**k: max / scale lands in (6, 7) and saturates to 6.
    w[8, :32] = rng.uniform(-1, 1, 32).astype(np.float32)
    w[8, 0] = 1.7
    w[9, :32] = -w[8, :32]
    return w.astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("seed", [0, 1])
def test_quantize_matches_compressed_tensors(seed, dtype):
    np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    w = nasty_weights(np.random.default_rng(seed), dtype=np_dtype)
    w_t = torch.from_numpy(w.astype(np.float32)).to(getattr(torch, dtype))
    ref_packed, ref_scale = ct_quantize(w_t)
    packed, scale = mxfp4.quantize_np(w)
    np.testing.assert_array_equal(scale, ref_scale, err_msg="E8M0 scale bytes differ from compressed-tensors")
    np.testing.assert_array_equal(packed, ref_packed, err_msg="packed nibbles differ from compressed-tensors")
    # The planted cases really are in the data (a check that would catch a vacuous test).
    codes = mxfp4.unpack_codes_np(packed)
    assert (codes == 8).any() and (codes[1, :32] == 0).all(), "expected -0 codes, and code 0 for -0.0 inputs"
    assert scale[0, 0] == 0 and scale[5, 0] > 240 and scale[6, 0] < 40
    assert (codes[8, :32] & 7).max() == 7 and (codes[9, :32] & 7).max() == 7


def test_scale_choice_matches_generate_mx_scales():
    """Scale bytes for group maxima spread over every float32 binade, incl. subnormals and mantissas around the
    round-up point (1.75 x 2**k)."""
    rng = np.random.default_rng(2)
    amax = np.concatenate([
        np.exp2(rng.uniform(-149, 127, 20000)),
        np.exp2(np.arange(-149, 127)) * 1.75, np.exp2(np.arange(-149, 127)) * np.float32(1.7499999),
        np.nextafter(np.exp2(np.arange(-126, 127)) * 1.75, 0), [0.0, 1e-45, 1.1754942e-38, 2.97e38]]).astype(np.float32)
    amax = amax[np.isfinite(amax)]
    ref = generate_mx_scales(torch.from_numpy(amax))
    ref = torch.clamp(ref, 0, 255).round().to(torch.uint8).numpy()  # calculate_qparams' round_to_quantized_type_dtype
    np.testing.assert_array_equal(mxfp4.scale_bytes_np(amax), ref)


def test_cast_to_fp4_rounding_matches():
    """Every float32 value on a fine grid over [-8, 8] (incl. exact ties) gets compressed-tensors' E2M1 code."""
    x = np.concatenate([np.linspace(-8, 8, 64001, dtype=np.float32), TIES, -TIES, np.nextafter(TIES, 0),
                        np.nextafter(TIES, 10), [0.0, -0.0, 1e-45, -1e-45]]).astype(np.float32)
    x = x[: len(x) // 2 * 2]
    ref = pack_fp4_to_uint8(cast_to_fp4(torch.from_numpy(x.copy())).reshape(1, -1)).numpy()
    np.testing.assert_array_equal(mxfp4.pack_codes_np(mxfp4.encode_e2m1_np(x))[None], ref)


def test_explicit_scale_saturation_matches_quantize_and_pack():
    """With a given (too small) scale, values beyond 6 x scale clamp to +-6 as in quantize_and_pack_fp4."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((16, 128)) * 4).astype(np.float32)
    scale = rng.integers(120, 130, (16, 4)).astype(np.uint8)
    ref = quantize_and_pack_fp4(torch.from_numpy(w), torch.from_numpy(mxfp4.scale_values_np(scale)), group_size=32)
    packed, _ = mxfp4.quantize_np(w, scale)
    np.testing.assert_array_equal(packed, ref.numpy())
    assert ((mxfp4.unpack_codes_np(packed) & 7) == 7).mean() > 0.2, "test should exercise saturation"


def test_pack_ours_unpack_theirs_and_back():
    rng = np.random.default_rng(4)
    codes = rng.integers(0, 16, (32, 96)).astype(np.uint8)  # every code, -0 (8) included
    values = mxfp4.E2M1[codes]
    ours = mxfp4.pack_codes_np(codes)
    theirs = pack_fp4_to_uint8(torch.from_numpy(values))
    np.testing.assert_array_equal(ours, theirs.numpy())
    np.testing.assert_array_equal(mxfp4.pack_codes_np(mxfp4.values_to_codes_np(values)), ours)
    # unpack: theirs on our bytes, ours on theirs -- bitwise, so -0.0 must stay -0.0
    back_theirs = unpack_fp4_from_uint8(torch.from_numpy(ours), 32, 96, dtype=torch.float32).numpy()
    back_ours = mxfp4.E2M1[mxfp4.unpack_codes_np(theirs.numpy())]
    np.testing.assert_array_equal(back_theirs.view(np.uint32), values.view(np.uint32))
    np.testing.assert_array_equal(back_ours.view(np.uint32), values.view(np.uint32))
    np.testing.assert_array_equal(mxfp4.unpack_codes_np(ours), codes)
    # all 256 byte values round-trip through their unpack and our pack
    every = np.arange(256, dtype=np.uint8).reshape(8, 32)
    vals = unpack_fp4_from_uint8(torch.from_numpy(every), 8, 64, dtype=torch.float32).numpy()
    np.testing.assert_array_equal(mxfp4.pack_codes_np(mxfp4.values_to_codes_np(vals)), every)


def test_dequantize_matches_decompress():
    rng = np.random.default_rng(5)
    packed = rng.integers(0, 256, (24, 64)).astype(np.uint8)
    scale = rng.integers(0, 255, (24, 4)).astype(np.uint8)  # every E8M0 byte except 255 (NaN)
    scale[0] = [0, 1, 253, 254]
    ref = ct_decompress(packed, scale)
    np.testing.assert_array_equal(mxfp4.dequantize_np(packed, scale), ref)
    np.testing.assert_array_equal(mxfp4.dequantize_np(packed, scale, ml_dtypes.bfloat16).astype(np.float32), ref)
    # and a real quantize -> decompress round trip
    w = nasty_weights(rng)
    p, s = mxfp4.quantize_np(w)
    np.testing.assert_array_equal(mxfp4.dequantize_np(p, s), ct_decompress(p, s))


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.quantize_np(np.zeros((2, 48), np.float32))
    with pytest.raises(ValueError, match="NaN or infinite"):
        mxfp4.quantize_np(np.full((1, 32), np.inf, np.float32))
    with pytest.raises(ValueError, match="too large"):
        mxfp4.quantize_np(np.full((1, 32), 3.3e38, np.float32))
    with pytest.raises(ValueError, match="not E2M1"):
        mxfp4.values_to_codes_np(np.array([0.7], np.float32))
