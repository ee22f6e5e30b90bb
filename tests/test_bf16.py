"""bfloat16 runs: each block stays within bf16 rounding of its float32 self on the same input.

(The tiny random fixture model is chaotic -- 0.4% noise in its embeddings alone moves the last layer by ~40% --
so whole-model bf16-vs-f32 logits are not a meaningful check; per-block errors are.)
"""

import jax
import jax.numpy as jnp
import pytest

import kimi_jax
from kimi_jax.model.attention import Step
from kimi_jax.model.run import RunConfig


@pytest.fixture(scope="module")
def model(k3_tiny_a):
    return kimi_jax.from_pretrained(k3_tiny_a, dtype="float32")


def _rel(a, b):
    a = a.astype(jnp.float32)
    return float(jnp.sqrt(jnp.mean((a - b) ** 2)) / jnp.sqrt(jnp.mean(b**2)))


def test_blocks_bf16_close_to_f32(model):
    r32, r16 = RunConfig(dtype=jnp.float32), RunConfig(dtype=jnp.bfloat16)
    T = 20
    step = Step(jnp.broadcast_to(jnp.arange(T), (2, T)), jnp.ones((2, T), bool), jnp.full((2,), T), False)
    x = jax.random.normal(jax.random.key(1), (2, T, model.cfg.hidden_size))
    for i, layer in enumerate(model.layers):
        y32, _ = layer.self_attn(x, step, None, r32)
        y16, _ = layer.self_attn(x.astype(jnp.bfloat16), step, None, r16)
        assert y16.dtype == jnp.bfloat16
        assert _rel(y16, y32) < 0.015, (i, layer.attn_kind, _rel(y16, y32))
        z32, z16 = layer.mlp(x, r32), layer.mlp(x.astype(jnp.bfloat16), r16)
        z32, z16 = (z[0] if isinstance(z, tuple) else z for z in (z32, z16))
        assert _rel(z16, z32) < 0.015, (i, layer.ffn_kind, _rel(z16, z32))


def test_bf16_model_runs_and_keeps_f32_params(k3_tiny_a):
    m = kimi_jax.from_pretrained(k3_tiny_a, dtype="bfloat16")
    attn = m.layers[0].self_attn
    assert attn.q_proj[...].dtype == jnp.bfloat16
    for p in (attn.A_log, attn.dt_bias, attn.q_conv1d, attn.o_norm, m.layers[1].mlp.e_score_correction_bias):
        assert p[...].dtype == jnp.float32  # released as F32, kept F32
    assert m.layers[1].mlp.experts.w1.get_value().packed.dtype == jnp.uint8  # MXFP4 stays packed
    out = m(jnp.ones((1, 8), jnp.int32))
    assert out.logits.dtype == jnp.float32 and bool(jnp.isfinite(out.logits).all())
