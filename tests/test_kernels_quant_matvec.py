"""The native XLA:CPU products of packed integer weights (``kernels_pallas/matvec/native.cc``: int8, int4, int4 with
a zero point, NF4, read in place) against float64 numpy of the decoded weight (``quant.dequantize``, the oracle), the
reference path for packed items, and the automatic choice that takes the native kernel for decode-shaped packed
items.

Tolerance: the kernel's products are those of the oracle's float32 decode (4-bit: bit for bit, see
``test_decode_is_exact``; int8 applies the row scale after the sum, one more rounding), summed in float32 with at most
I/16 additions per lane, 4 in the lane tree and the scale's multiply. The classic bound for a float32 sum,
``|error| <= k * 2**-24 * sum_i |w_i x_i|`` with ``k`` the longest chain of roundings a term goes through, then holds
with ``k = I/16 + 6``: a bound, not a statistical guess, so it is tight on the kernel's order and never flaky. The
reference (XLA's einsum, order unknown) is held to ``k = I + 2``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

import kernels_pallas.matvec as matvec
from kernels_pallas import KernelUnavailable, quant
from kernels_pallas._dispatch import NATIVE, PALLAS, REFERENCE
from kernels_pallas.matvec import native
from kernels_pallas.mxfp4 import MXFP4Weight
from kernels_pallas.quant import Format

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="native kernels are for XLA:CPU")

FORMATS = ["int8", "int4:g32", "int4:g64", "int4:g128", "int4:g32:zero", "int4:g128:zero", "nf4:g64"]
EPS32 = 2.0**-24
_quantize = jax.jit(quant.quantize, static_argnums=1)  # jitted: qwix op by op takes seconds per weight
_dequantize = jax.jit(quant.dequantize)


def _weight(rng, shape, name):
    w = rng.standard_normal(shape).astype(np.float32) * 0.05
    w[..., 5] *= 8.0  # an outlier column, as trained weights have
    return _quantize(jnp.asarray(w), Format.parse(name))


def _item(rng, name, M, J, I, E=None):
    w = _weight(rng, (J, I) if E is None else (E, J, I), name)
    x = jnp.asarray(rng.standard_normal((M, I)), jnp.float32)
    ids = None if E is None else jnp.asarray(np.r_[rng.integers(0, E, M - 1), E - 1], jnp.int32)  # the last too
    return x, w, ids


def _dense64(w, ids, M):
    """The oracle's decoded weight per row, ``[M, J, I]`` float64."""
    d = np.asarray(_dequantize(w), np.float64)
    return np.broadcast_to(d, (M, *d.shape)) if ids is None else d[np.asarray(ids)]


def _check(got, x, w, ids, *, k_of_I):
    """``got`` against float64 numpy within ``k * 2**-24 * sum_i |w_i x_i|`` per element (module docstring)."""
    x64 = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    d = _dense64(w, ids, x64.shape[0])
    want = np.einsum("mi,mji->mj", x64, d)
    bound = k_of_I(x64.shape[1]) * EPS32 * np.einsum("mi,mji->mj", np.abs(x64), np.abs(d))
    got = np.asarray(got)
    assert got.shape == want.shape and got.dtype == np.float32
    err = np.abs(got - want)
    assert (err <= bound).all(), f"max error {err.max():.3g}, its bound {bound.flat[np.argmax(err - bound)]:.3g}"


def _kernel(I):
    return I / 16 + 6


def _any_order(I):
    return I + 2


def _group_fn(**kw):
    """A jitted ``matvec.group`` over a list of items (None ids stay static)."""
    def f(items):
        return matvec.group([(x, w, ids) for (x, w, ids) in items], **kw)
    return jax.jit(f)


def _target(w):
    return f"kimi_jax_{native.symbol(w)}"


@pytest.mark.parametrize("stacked", [False, True], ids=["plain", "experts"])
@pytest.mark.parametrize("name", FORMATS)
def test_matches_float64(name, stacked):
    """One item, M in {1, 3}: the native kernel and the reference against float64 numpy of the decoded weight. J = 70
    leaves rows past the last 8; I = 384 is three 128-column groups."""
    rng = np.random.default_rng(FORMATS.index(name) * 2 + stacked)
    for M in (1, 3):
        item = _item(rng, name, M, 70, 384, E=5 if stacked else None)
        f = _group_fn(implementation="cpu_native")
        assert f.lower([item]).as_text().count(_target(item[1])) == 1
        _check(f([item])[0], *item, k_of_I=_kernel)
        _check(_group_fn(implementation="reference")([item])[0], *item, k_of_I=_any_order)


def test_int8_rows_past_the_last_vector():
    """int8 takes any I: I = 1000 ends in 8 columns past the last 16-lane vector (summed in order)."""
    rng = np.random.default_rng(7)
    for E in (None, 4):
        item = _item(rng, "int8", 2, 33, 1000, E=E)
        _check(_group_fn(implementation="cpu_native")([item])[0], *item, k_of_I=lambda I: I / 16 + 16)


@pytest.mark.parametrize("name", FORMATS)
def test_decode_is_exact(name):
    """Rows of x that are one-hot columns read single weights: the kernel's values are the oracle's, bit for bit
    (nibble order and sign, zero point, the NF4 table, the scale's place; an expert stack at the chosen rows)."""
    rng = np.random.default_rng(11)
    I, J, E = 128, 24, 3
    eye = jnp.eye(I, dtype=jnp.float32)
    w = _weight(rng, (E, J, I), name)
    ids = jnp.asarray(np.arange(I) % E, jnp.int32)
    plain = jax.tree.map(lambda f: f[1], w)
    got_plain, got_stack = _group_fn(implementation="cpu_native")([(eye, plain, None), (eye, w, ids)])
    dense = np.asarray(quant.dequantize(w, jnp.float32))
    np.testing.assert_array_equal(np.asarray(got_plain), dense[1].T)
    np.testing.assert_array_equal(np.asarray(got_stack), dense[np.arange(I) % E, :, np.arange(I)])


def test_mixed_call():
    """Several items of one format in one native call: plain and stacked, shapes and group sizes differing, one item
    large enough to be split into parts for the threads."""
    rng = np.random.default_rng(3)
    for names in (["int4:g32", "int4:g128", "int4:g64"], ["int8"] * 3, ["nf4:g64", "nf4:g32", "nf4:g64"],
                  ["int4:g32:zero", "int4:g128:zero", "int4:g64:zero"]):
        items = [_item(rng, names[0], 1, 512, 1024), _item(rng, names[1], 2, 130, 256, E=6),
                 _item(rng, names[2], 1, 9, 128)]
        f = _group_fn(implementation="cpu_native")
        assert f.lower(items).as_text().count(_target(items[0][1])) == 1, "one native call for the whole group"
        for got, item in zip(f(items), items):
            _check(got, *item, k_of_I=_kernel)


def test_bfloat16_inputs():
    """bfloat16 x is widened exactly: the native result is the float32 product of the widened x and the float32
    decode. (The reference decodes to x's dtype, rounding the weight to bfloat16: equal within that rounding.)"""
    rng = np.random.default_rng(4)
    x, w, ids = _item(rng, "int4:g32", 3, 40, 256, E=3)
    xb = x.astype(jnp.bfloat16)
    got = _group_fn()([(xb, w, ids)])[0]
    _check(got, xb, w, ids, k_of_I=_kernel)
    ref = np.asarray(_group_fn(implementation="reference")([(xb, w, ids)])[0])
    np.testing.assert_allclose(np.asarray(got), ref, atol=2**-8 * np.abs(ref).max(), rtol=0)


def test_automatic_choice_on_cpu():
    """Decode-shaped packed items (every item at most PACKED_ROWS rows; a single plain product too: the alternative
    decodes the whole weight first) run the native kernel; more rows, implementation='reference' or lowering for a
    TPU run the reference; the XLA:CPU forms refuse packed weights."""
    rng = np.random.default_rng(5)
    one = [_item(rng, "int4:g32", 1, 64, 256)]
    decode = one + [_item(rng, "int4:g64", matvec.PACKED_ROWS, 32, 128, E=4)]
    for items in (one, decode):
        assert matvec.fuses(items)
        assert matvec.GROUP.choose(None, (items,)) == NATIVE
        assert _group_fn().lower(items).as_text().count(_target(items[0][1])) == 1
    prefill = [_item(rng, "int8", matvec.PACKED_ROWS + 1, 32, 128)]
    assert not matvec.fuses(prefill) and matvec.GROUP.choose(None, (prefill,)) == REFERENCE
    assert "kimi_jax_" not in _group_fn().lower(prefill).as_text()
    _check(_group_fn()(prefill)[0], *prefill[0], k_of_I=_any_order)
    assert "kimi_jax_" not in _group_fn(implementation="reference").lower(decode).as_text()
    with pytest.raises(KernelUnavailable, match="int4:g32 weights .*XLA:CPU forms"):
        matvec.GROUP.choose("xla_cpu", (one,))
    tpu = AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    with use_abstract_mesh(AbstractMesh((1,), ("x",), axis_types=(AxisType.Auto,), abstract_device=tpu)):
        # the plain integer item through the Pallas matmul (kernels_pallas/qmatmul), the expert stack the reference
        assert matvec.GROUP.choose(None, (decode,)) == PALLAS
        assert not matvec.fuses(decode)


def test_unsupported_combinations():
    """One kernel per weight format: a call mixing formats (float and packed weights, MXFP4 and int4) and 4-bit
    groups that are not whole 32-column blocks are refused with the reason when asked for, and the automatic choice
    runs the reference for them (with the same numbers)."""
    rng = np.random.default_rng(6)
    i8, i4 = _item(rng, "int8", 1, 32, 128), _item(rng, "int4:g32", 1, 32, 128)
    dense = (i8[0], jnp.asarray(rng.standard_normal((32, 128)), jnp.float32), None)
    g16 = _item(rng, "int4:g16", 1, 32, 128)
    mx = (i8[0], MXFP4Weight(jnp.asarray(rng.integers(0, 256, (32, 64)), jnp.uint8),
                             jnp.asarray(rng.integers(118, 126, (32, 4)), jnp.uint8)), None)
    cases = [([i8, i4], "different dtypes .*: int8 and int4:g32"), ([dense, i4], "float32 and int4:g32"),
             ([g16], "groups of 16 columns"), ([mx, i4], "different dtypes .*: mxfp4 and int4:g32")]
    for items, why in cases:
        with pytest.raises(KernelUnavailable, match=why):
            matvec.GROUP.choose(NATIVE, (items,))
        assert not matvec.fuses(items)
        assert "kimi_jax_" not in _group_fn().lower(items).as_text()
    for got, item in zip(_group_fn()([i8, i4]), [i8, i4]):
        _check(got, *item, k_of_I=_any_order)
