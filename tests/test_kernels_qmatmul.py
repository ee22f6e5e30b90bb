"""The integer-weight matmul (kernels_pallas/qmatmul): the reference against a float64 product of an independent
numpy decode, and both Pallas kernels (the GPU one through the dispatcher's ``pallas_interpret``, the TPU one with
``platform="tpu"``) in Pallas interpret mode against the reference.

Tolerances are bounds derived from the arithmetic, per output element, in units of ``B = |x| @ |W|^T`` (float64):

* float32 sums: the kernel and the reference each sum I products in float32 (in different orders) and each rounds
  every product and decoded weight (int8: the row scale once more), so each is within ``(I + 2) u`` of the exact
  value (u = 2^-24, Higham's bound) and they differ by at most ``2 (I + 2) u B``;
* bfloat16 activations with the group-wise formats: the kernel rounds each decoded float32 weight to bfloat16 for
  the product (8-bit significand: relative error <= 2^-8), adding ``2^-8 B``. int8 codes are exact in bfloat16
  (|q| <= 127): no term.

The relative RMS error is checked too, and it is the sharp test: with bf16-rounded weights it must stay within
2^-8 (uniform rounding errors have an RMS of at most 2^-8 / sqrt(3); measured 1.7e-3), else within 2^-17 = 128 u
(measured 4-5e-7). Swapping each nibble pair gives 1.5; a 1% error on one byte column in 256, 5.5e-4 (float32).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

import kernels_pallas.qmatmul as qm
from kernels_pallas import KernelUnavailable, quant
from kernels_pallas.qmatmul import pallas as qp
from tests.parity import errors

U32 = 2.0**-24
BF16_WEIGHT = 2.0**-8  # bfloat16's unit roundoff

# name -> (kind, group); kinds as kernels_pallas.qmatmul.pallas.fields names them
FORMATS = {"int8": ("int8", 0), "int4-g32": ("int4", 32), "int4-g128": ("int4", 128),
           "int4-g32-zero": ("int4_zero", 32), "nf4-g64": ("nf4", 64)}
SHAPES = [(256, 512), (384, 1024)]  # (J, I)


def _weight(name, J, I, seed=0):  # noqa: E741
    """Random codes over every byte value, positive scales, zero points over all of -8..7."""
    kind, g = FORMATS[name]
    rng = np.random.default_rng(seed)
    if kind == "int8":
        return quant.Int8Weight(jnp.asarray(rng.integers(-128, 128, (J, I)), jnp.int8),
                                jnp.asarray(rng.uniform(1e-3, 3e-3, (J, 1)), jnp.float32))
    packed = jnp.asarray(rng.integers(0, 256, (J, I // 2)), jnp.uint8)
    scale = jnp.asarray(rng.uniform(2e-3, 6e-3, (J, I // g)), jnp.float32)
    if kind == "int4":
        return quant.Int4Weight(packed, scale)
    if kind == "int4_zero":
        return quant.Int4ZeroWeight(packed, scale, jnp.asarray(rng.integers(-8, 8, (J, I // g)), jnp.int8))
    return quant.NF4Weight(packed, scale)


def _decode64(w) -> np.ndarray:
    """The logical weight in float64, decoded in numpy from the fields (independently of quant.dequantize)."""
    if isinstance(w, quant.Int8Weight):
        return np.asarray(w.q, np.float64) * np.asarray(w.scale, np.float64)
    p = np.asarray(w.packed).astype(np.int64)
    codes = np.empty((p.shape[0], 2 * p.shape[1]), np.int64)
    codes[:, 0::2], codes[:, 1::2] = p & 15, p >> 4
    rep = lambda a: np.repeat(np.asarray(a, np.float64), codes.shape[1] // a.shape[1], axis=1)  # noqa: E731
    if isinstance(w, quant.NF4Weight):
        return quant.NF4_TABLE.astype(np.float64)[codes] * rep(w.absmax)
    q = np.where(codes >= 8, codes - 16, codes).astype(np.float64)
    if isinstance(w, quant.Int4ZeroWeight):
        q = q - rep(w.zero)
    return q * rep(w.scale)


def _x(M, I, dtype, seed=1):  # noqa: E741
    return jnp.asarray(np.random.default_rng(seed).standard_normal((M, I)), jnp.float32).astype(dtype)


def _assert_bound(got, want, x, W64, rounding, what):
    """|got - want| <= (rounding + 2 (I + 2) u) B elementwise, and relative RMS <= max(rounding, 2^-17)."""
    x64 = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    bound = (rounding + 2 * (x64.shape[1] + 2) * U32) * (np.abs(x64) @ np.abs(W64).T)
    diff = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    worst = float(np.max(diff / bound))
    _, rel_rms = errors(got, want)
    assert worst <= 1.0, f"{what}: error {worst:.3g} x its bound (relative RMS {rel_rms:.3g})"
    assert rel_rms <= max(rounding, 2.0**-17), f"{what}: relative RMS {rel_rms:.3g}"


def _rounding(name, dtype):
    return BF16_WEIGHT if jnp.dtype(dtype) == jnp.bfloat16 and FORMATS[name][0] != "int8" else 0.0


_interpret = jax.jit(lambda x, w: qm.matmul(x, w, implementation="pallas_interpret"))
_reference = jax.jit(lambda x, w: qm.matmul(x, w, implementation="reference"))


@pytest.mark.parametrize("name", FORMATS)
def test_reference_equals_float64_product(name):
    J, I = SHAPES[1]  # noqa: E741
    w = _weight(name, J, I)
    W64 = _decode64(w)
    # float32 decode = the exact value rounded once ((q - z) * s, NF4[c] * absmax: one float32 product)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(w)), W64.astype(np.float32))
    x = _x(5, I, jnp.float32)
    got = _reference(x, w)
    assert got.shape == (5, J) and got.dtype == jnp.float32
    want = np.asarray(x, np.float64) @ W64.T
    bound = (I + 2) * U32 * (np.abs(np.asarray(x, np.float64)) @ np.abs(W64).T)
    assert np.all(np.abs(np.asarray(got, np.float64) - want) <= bound), name


@pytest.mark.parametrize("J,I", SHAPES, ids=[f"{j}x{i}" for j, i in SHAPES])
@pytest.mark.parametrize("M", [1, 5, 64])
@pytest.mark.parametrize("name", FORMATS)
def test_gpu_kernel_interpret_bf16(name, M, J, I):  # noqa: E741
    """The Triton kernel's source (the dispatcher's interpret mode) with bfloat16 activations."""
    w = _weight(name, J, I)
    x = _x(M, I, jnp.bfloat16)
    got = _interpret(x, w)
    assert got.shape == (M, J) and got.dtype == jnp.float32
    _assert_bound(got, _reference(x, w), x, _decode64(w), _rounding(name, jnp.bfloat16), f"{name} M={M}")


@pytest.mark.parametrize("name", FORMATS)
def test_gpu_kernel_interpret_f32(name):
    """float32 activations: the products at full precision (no TF32), equal to the reference to float32 sums."""
    J, I = SHAPES[1]  # noqa: E741
    w = _weight(name, J, I)
    x = _x(5, I, jnp.float32)
    _assert_bound(_interpret(x, w), _reference(x, w), x, _decode64(w), 0.0, name)


# The TPU kernel's I block: several steps where the format allows (the scales' dynamic sublane offsets): int8 and
# int4-g32 in 256-column steps (4), nf4-g64 in 512 (2); int4-g128 takes lcm(256, 8 * 128) = 1024, one step.
TPU_BLOCK_K = {"int8": 256, "int4-g32": 256, "int4-g128": None, "int4-g32-zero": 256, "nf4-g64": 512}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("M", [5, 64])
@pytest.mark.parametrize("name", FORMATS)
def test_tpu_kernel_interpret(name, M, dtype):
    """The Mosaic kernel's source in interpret mode: the (M, J, I) grid with its VMEM accumulator, J in 3 blocks of
    128, rows padded to the row tile (M=5) or in 4 tiles of 16 (M=64)."""
    J, I = SHAPES[1]  # noqa: E741
    w = _weight(name, J, I)
    x = _x(M, I, dtype)
    f = jax.jit(lambda x, w: qp.matmul(x, w, platform="tpu", interpret=True, block_k=TPU_BLOCK_K[name],
                                       block_m=16 if M == 64 else None))
    got = f(x, w)
    assert got.shape == (M, J)
    _assert_bound(got, _reference(x, w), x, _decode64(w), _rounding(name, dtype), f"{name} M={M}")


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
@pytest.mark.parametrize("name,J,I", [("int8", 200, 200), ("int4-g32-zero", 200, 96)], ids=["int8", "int4-zero"])
def test_sizes_that_do_not_divide(platform, name, J, I):  # noqa: E741
    """GPU: J padded to a 64-row block, int8's I to a 256-column step; TPU: whole-dimension blocks."""
    w = _weight(name, J, I)
    x = _x(3, I, jnp.bfloat16)
    got = jax.jit(lambda x, w: qp.matmul(x, w, platform=platform, interpret=True))(x, w)
    _assert_bound(got, _reference(x, w), x, _decode64(w), _rounding(name, jnp.bfloat16), f"{name} {platform}")


def test_blocks_for_k3_sizes():
    """The defaults divide K3's projection sizes (no weight copies) and meet each compiler's rules."""
    for J, I in [(6144, 7168), (33792, 7168), (7168, 33792), (1536, 7168)]:  # noqa: E741
        for kind, g in FORMATS.values():
            g = g or I
            t = qp.blocks(kind, 512, J, I, g, jnp.bfloat16, "tpu")
            assert J % t.bn == 0 and I % t.bk == 0 and t.bn % 128 == 0 and t.bm % 16 == 0
            assert kind == "int8" or (t.bk // 2 % 128 == 0 and (t.bk // g) % 8 == 0)
            for M in (8, 512):
                b = qp.blocks(kind, M, J, I, g, jnp.bfloat16, "gpu")
                assert J % b.bn == 0 and I % b.bk == 0
                assert all(v & (v - 1) == 0 and v >= 16 for v in b)


def test_choice_and_errors():
    w = _weight("int4-g32", 256, 512)
    x = _x(2, 512, jnp.bfloat16)
    assert qm.OP.choose(None, (x, w)) == "reference"  # CPU: the automatic choice
    np.testing.assert_array_equal(np.asarray(qm.matmul(x, w)), np.asarray(_reference(x, w)))
    tpu = AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    with use_abstract_mesh(AbstractMesh((1,), ("x",), axis_types=(AxisType.Auto,), abstract_device=tpu)):
        assert qm.OP.choose(None, (x, w)) == "pallas"
    with pytest.raises(KernelUnavailable, match="needs a TPU or GPU"):
        qm.matmul(x, w, implementation="pallas")
    with pytest.raises(ValueError, match="does not match"):
        qm.matmul(x[:, :256], w, implementation="pallas_interpret")
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        qm.matmul(x.astype(jnp.float16), w, implementation="pallas_interpret")
    odd = quant.Int4Weight(jnp.zeros((16, 48), jnp.uint8), jnp.ones((16, 2), jnp.float32))  # groups of 48
    with pytest.raises(KernelUnavailable, match=r"Int4Weight \(16, 96\) in groups of 48 columns.*power-of-two group"):
        qm.matmul(jnp.zeros((2, 96), jnp.bfloat16), odd, implementation="pallas_interpret")
    with pytest.raises(TypeError, match="not an integer weight format"):
        qp.matmul(x, jnp.zeros((256, 512), jnp.bfloat16))
