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


# -- GPTQ ------------------------------------------------------------------------------------------------------


def _correlated_inputs(columns, tokens=384, seed=1):
    """Inputs whose columns are correlated and of unequal size (as hidden states are), one dead column."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    mix = jax.random.normal(k1, (columns, columns)) / np.sqrt(columns) + jnp.eye(columns)
    x = (jax.random.normal(k2, (tokens, columns)) @ mix) * (1 + jnp.arange(columns) % 5)
    return x.at[:, 7].set(0.0)


@pytest.mark.parametrize("name", ["int4:g8", "int8"])
def test_gptq_equals_qwix_gptq(name):
    """Our GPTQ (a fori_loop per block) picks qwix.contrib.gptq_core's codes: the same algorithm, order and rounding;
    scales equal to float32 rounding (the two programs compile the same arithmetic differently). qwix's own runs
    only symmetric int formats (its zero-point and NF4 paths fail), so these two are compared."""
    from qwix._src.core import qarray
    from qwix.contrib import gptq_core

    fmt = Format.parse(name)
    w = _weight((16, 48))
    x = _correlated_inputs(48)
    h = x.T @ x
    tiles = {} if fmt.kind == "int8" else {1: fmt.group}
    how = qarray.HowToQuantize(qtype=jnp.int8 if fmt.kind == "int8" else jnp.int4, channelwise_axes=(0,),
                               tiled_axes=tiles)
    theirs, _ = jax.jit(lambda w, h: gptq_core.quantize_weight(w, h, how, blocksize=16))(w, h)
    q, scale, zero = jax.jit(lambda w, h: quant.gptq(w, h, fmt, block=16))(w, h)
    assert zero is None
    np.testing.assert_array_equal(np.asarray(q, np.int32), np.asarray(theirs.qvalue, np.int32))
    np.testing.assert_allclose(np.asarray(scale), np.asarray(theirs.scale), rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", FORMATS)
def test_gptq_with_uncorrelated_inputs_is_rounding(name):
    """With a Hessian proportional to the identity no error is worth moving to another column: GPTQ's codes are
    round-to-nearest's (qwix.quantize) exactly, for every format (zero points and NF4 too)."""
    fmt = Format.parse(name)
    w = _weight((24, 256))
    rtn = quant.quantize(w, fmt)
    ours = quant.quantize(w, fmt, hessian=3.0 * jnp.eye(256))
    assert type(ours) is type(rtn)
    for a, b in zip(ours[1:], rtn[1:]):  # scales (and zero points)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    got, want = np.asarray(quant.dequantize(ours)), np.asarray(quant.dequantize(rtn))
    # A group's largest magnitude lands exactly on a rounding tie (absmax / (absmax / 127.5) for int8), which the
    # two programs may compute a float32 ulp apart (XLA rewrites x / (a / b) as x * b / a in one of them): there,
    # and only there, the codes may differ by one step.
    w_np = np.asarray(w)
    g = 256 if fmt.kind == "int8" else fmt.fitted(w.shape).group
    groups = np.abs(w_np).reshape(24, -1, g)
    at_max = (groups == groups.max(-1, keepdims=True)).reshape(w_np.shape)
    differ = got != want
    assert not (differ & ~at_max).any()
    assert differ.sum() <= at_max.sum() // 4


@pytest.mark.parametrize("name", ["int4:g32", "int4:g32:zero", "nf4:g64", "int8"])
def test_gptq_lowers_the_output_error(name):
    """What GPTQ is for: on correlated inputs, ``||X (W - Q)^T||`` is smaller than round-to-nearest's."""
    fmt = Format.parse(name)
    w = _weight((32, 256))
    x = _correlated_inputs(256)
    err = lambda q: float(jnp.linalg.norm(x @ (w - quant.dequantize(q)).T))  # noqa: E731
    rtn, ours = err(quant.quantize(w, fmt)), err(quant.quantize(w, fmt, hessian=x.T @ x))
    assert ours < 0.8 * rtn, (ours, rtn)


def test_gptq_refusals():
    with pytest.raises(ValueError, match="one \\[out, in\\] matrix"):
        quant.gptq(jnp.zeros((2, 4, 32)), jnp.eye(32), Format.parse("int4"))
    with pytest.raises(ValueError, match="Hessian"):
        quant.gptq(jnp.zeros((4, 32)), jnp.eye(16), Format.parse("int4"))
