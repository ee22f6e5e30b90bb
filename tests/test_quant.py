"""The weight-only integer formats (kernels_pallas/quant.py) against qwix, the quantizer they take their numerics
from: our decode of the repacked fields equals ``qwix.dequantize`` of qwix's own ``QArray`` bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix

from kernels_pallas import packed, quant
from kernels_pallas.quant import Format

FORMATS = ["int8", "int4:g32", "int4:g64", "int4:g128", "int4:g32:zero", "int4:g128:zero", "nf4:g64", "nf4:g32"]


def _weight(shape, seed=0):
    w = jax.random.normal(jax.random.key(seed), shape, jnp.float32) * 0.05
    # a few outliers per row, as trained weights have
    return w.at[..., 3].multiply(8.0)


def _qwix(w, fmt: Format):
    rows = tuple(range(w.ndim - 1))
    if fmt.kind == "int8":
        return qwix.quantize(w, jnp.int8, channelwise_axes=rows)
    tiles = {w.ndim - 1: fmt.group}
    if fmt.kind == "nf4":
        return qwix.quantize(w, "nf4", channelwise_axes=rows, tiled_axes=tiles)
    return qwix.quantize(w, jnp.int4, channelwise_axes=rows, tiled_axes=tiles,
                         calibration_method="minmax" if fmt.zero_point else "absmax")


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("shape", [(48, 256), (3, 16, 128)])
def test_decode_equals_qwix_bit_for_bit(name, shape):
    fmt = Format.parse(name)
    w = _weight(shape)
    ours = quant.quantize(w, fmt)
    theirs = np.asarray(qwix.dequantize(_qwix(w, fmt)))
    got = np.asarray(quant.dequantize(ours, jnp.float32))
    assert got.shape == theirs.shape == shape
    np.testing.assert_array_equal(got, theirs)
    assert packed.is_packed(ours) and packed.format_name(ours) == fmt.name()
    # error bounds a format of this many bits must meet (absmax / minmax scaling): half a step per group
    err = np.abs(got - np.asarray(w))
    assert err.max() > 0
    if fmt.kind == "int8":
        step = np.abs(np.asarray(w)).max(-1, keepdims=True) / 127.5
        assert (err <= step / 2 * 1.0001).all()


@pytest.mark.parametrize("name", FORMATS)
def test_bytes_and_fields(name):
    fmt = Format.parse(name)
    w = quant.quantize(_weight((64, 256)), fmt)
    assert w.shape == (64, 256)
    assert packed.nbytes(w) == pytest.approx(64 * 256 * fmt.bytes_per_value(256))
    units = packed.group_units(w)
    assert len(units) == len(w)
    if fmt.kind != "int8":
        assert units[0] == fmt.group // 2 and w[0].shape[-1] // units[0] == w[1].shape[-1]


def test_nibble_order_and_signs():
    """Element 2k in the low nibble, two's complement: -8..7 round-trips through the packed bytes."""
    codes = jnp.arange(-8, 8, dtype=jnp.int32).reshape(1, 16)
    p = quant.pack_nibbles(codes & 0xF)
    assert int(p[0, 0]) == ((-8 & 0xF) | ((-7 & 0xF) << 4))
    np.testing.assert_array_equal(np.asarray(quant.signed_nibbles(quant.unpack_nibbles(p))), np.asarray(codes))


def test_nf4_table_is_qwix_table():
    from qwix._src.core import numerics

    np.testing.assert_array_equal(quant.NF4_TABLE, np.asarray(numerics.get_nf4_buckets(), np.float32))


@pytest.mark.parametrize("bad, why", [("int3", "unknown weight format"), ("int4:g7", "even"),
                                      ("nf4:zero", "zero point"), ("int4:x", "unknown option")])
def test_bad_format_names(bad, why):
    with pytest.raises(ValueError, match=why):
        Format.parse(bad)


def test_refuses_a_shape_the_group_does_not_divide():
    with pytest.raises(ValueError, match="not a multiple of the group 32"):
        quant.quantize(jnp.ones((4, 48)), Format.parse("int4"))
