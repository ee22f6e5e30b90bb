"""Pallas KDA kernels (interpret mode on CPU) against the plain-jnp references.

The chunked prefill kernel must equal the token-by-token recurrence (outputs and final state) for both gate
forms -- K3's lower-bounded sigmoid and Kimi Linear's unbounded softplus, whose large decays would overflow a
factorised exp(G_i) exp(-G_j) -- with lengths that are not a multiple of the chunk, an initial state, and value
widths split over programs. The recurrent (decode) kernel must equal the reference step exactly in float32, and
one decode step after a kernel prefill must equal the last position of a longer kernel prefill.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas.kda as kda_api
from kernels_pallas.kda import pallas as kda_pallas
from kernels_pallas.kda import reference as kda_ref
from tests.parity import TOL, assert_close

_recurrent_ref = jax.jit(kda_ref.kda_recurrent, static_argnames=("scale",))


def _inputs(T, B=2, H=2, K=16, V=16, seed=0, gate="lower_bound", v_dtype=jnp.float32):
    """q, k unit vectors (what the model passes), g <= 0 per channel, beta in (0, 1), a non-zero initial state."""
    rng = np.random.default_rng(seed)
    n = lambda x: x / np.sqrt(np.sum(x * x, -1, keepdims=True) + 1e-6)
    q = n(rng.standard_normal((B, T, H, K)))
    k = n(rng.standard_normal((B, T, H, K)))
    v = rng.standard_normal((B, T, H, V))
    z = rng.standard_normal((B, T, H, K))
    if gate == "lower_bound":
        g = -5.0 / (1.0 + np.exp(-z))
    else:  # softplus form, scaled so 8 steps decay by ~e^-130: exp(+130) would overflow float32
        g = -20.0 * np.log1p(np.exp(z))
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, H))))
    s0 = 0.3 * rng.standard_normal((B, H, K, V))
    f = lambda x: jnp.asarray(x, jnp.float32)
    return f(q), f(k), jnp.asarray(v, jnp.float32).astype(v_dtype), f(g), f(beta), f(s0)


@pytest.mark.parametrize(
    "T,chunk,gate,block_v",
    [(37, 16, "lower_bound", None), (40, 8, "softplus", 8), (5, 16, "lower_bound", 16)],
    ids=["T37-C16-lowerbound", "T40-C8-softplus-splitV", "T5-C16-short"],
)
def test_chunked_kernel_equals_recurrence(T, chunk, gate, block_v):
    q, k, v, g, beta, s0 = _inputs(T, gate=gate)
    o_ref, s_ref = _recurrent_ref(q, k, v, g, beta, s0, scale=0.25)
    o, s = jax.jit(lambda *a: kda_pallas.kda_chunked(*a, scale=0.25, chunk_size=chunk, interpret=True,
                                                     block_v=block_v))(q, k, v, g, beta, s0)
    assert o.shape == o_ref.shape and s.shape == s_ref.shape
    assert np.isfinite(np.asarray(o)).all()
    assert_close(o, o_ref, 1e-5, "chunked kernel output")
    assert_close(s, s_ref, 1e-5, "chunked kernel final state")


def test_chunked_kernel_bf16_values_and_zero_state():
    """bf16 values (a bf16 model's v) and no initial state, through the package API."""
    q, k, v, g, beta, _ = _inputs(23, v_dtype=jnp.bfloat16, seed=1)
    o_ref, s_ref = _recurrent_ref(q, k, v, g, beta, None, scale=0.25)
    o, s = jax.jit(lambda *a: kda_api.kda_prefill(*a, scale=0.25, implementation="pallas_interpret"))(q, k, v, g, beta)
    assert_close(o, o_ref, TOL["float32"], "bf16-v chunked output")
    assert_close(s, s_ref, TOL["float32"], "bf16-v chunked state")


def test_recurrent_kernel_equals_reference():
    q, k, v, g, beta, s0 = _inputs(6, gate="softplus", seed=2)
    o_ref, s_ref = _recurrent_ref(q, k, v, g, beta, s0, scale=0.25)
    o, s = jax.jit(lambda *a: kda_api.kda_decode(*a, scale=0.25, implementation="pallas_interpret"))(
        q, k, v, g, beta, s0)
    assert_close(o, o_ref, 1e-6, "recurrent kernel output")
    assert_close(s, s_ref, 1e-6, "recurrent kernel state")


def test_decode_step_after_prefill_equals_longer_prefill():
    """Kernel prefill of 19 tokens, then one kernel decode step == position 19 of a 20-token kernel prefill."""
    q, k, v, g, beta, _ = _inputs(20, seed=3)
    prefill = jax.jit(lambda *a: kda_pallas.kda_chunked(*a, scale=0.25, chunk_size=8, interpret=True))
    decode = jax.jit(lambda *a: kda_pallas.kda_recurrent(*a, scale=0.25, interpret=True))
    _, s19 = prefill(*(x[:, :19] for x in (q, k, v, g, beta)))
    o_step, s20 = decode(*(x[:, 19:] for x in (q, k, v, g, beta)), s19)
    o_all, s_all = prefill(q, k, v, g, beta)
    assert_close(o_step[:, 0], o_all[:, 19], 1e-5, "decode step vs prefill last position")
    assert_close(s20, s_all, 1e-5, "state after decode step vs prefill state")


def test_inert_padding_steps_leave_state_unchanged():
    """Right padding as the model marks it (g = 0, beta = 0) does not touch the kernel's state."""
    q, k, v, g, beta, s0 = _inputs(12, seed=4)
    pad = lambda x, val: jnp.concatenate([x, jnp.full((x.shape[0], 5, *x.shape[2:]), val, x.dtype)], axis=1)
    run = jax.jit(lambda *a: kda_pallas.kda_chunked(*a, scale=0.25, chunk_size=8, interpret=True))
    o, s = run(q, k, v, g, beta, s0)
    o_pad, s_pad = run(pad(q, 1.0), pad(k, 1.0), pad(v, 1.0), pad(g, 0.0), pad(beta, 0.0), s0)
    assert_close(s_pad, s, 1e-6, "state with padded steps")
    assert_close(o_pad[:, :12], o, 1e-6, "outputs before the padding")


def test_tpu_block_rules_in_interpret():
    """The TPU variant (whole V per program, 64-token chunks) computes the same thing."""
    q, k, v, g, beta, s0 = _inputs(70, seed=5, gate="softplus")
    o_ref, s_ref = _recurrent_ref(q, k, v, g, beta, s0, scale=0.25)
    o, s = jax.jit(lambda *a: kda_pallas.kda_chunked(*a, scale=0.25, platform="tpu", interpret=True))(
        q, k, v, g, beta, s0)
    assert_close(o, o_ref, 1e-5, "TPU-style chunked output")
    assert_close(s, s_ref, 1e-5, "TPU-style chunked state")
    o, s = jax.jit(lambda *a: kda_pallas.kda_recurrent(*a, scale=0.25, platform="tpu", interpret=True))(
        q[:, :3], k[:, :3], v[:, :3], g[:, :3], beta[:, :3], s0)
    o_ref, s_ref = _recurrent_ref(q[:, :3], k[:, :3], v[:, :3], g[:, :3], beta[:, :3], s0, scale=0.25)
    assert_close(o, o_ref, 1e-6, "TPU-style recurrent output")
    assert_close(s, s_ref, 1e-6, "TPU-style recurrent state")
