"""Quantized caches: int8 MLA latent / GQA K,V rows (``kernels_pallas.cache_quant``) and a bfloat16 KDA state.

* the row format against a numpy formula written here (bit-exact codes, scales and dequantized values);
* the options' errors, and ``cache_bytes`` / ``kimi-jax plan`` against byte counts derived from the config here;
* every attention kernel over int8 rows (Pallas interpret, GPU and TPU block styles; the CPU forms) against the
  reference run on the numpy-dequantized float cache; the same through ``shard_map`` on a 4-device CPU mesh;
* greedy decode of the K3 fixture and of a tiny Llama with the int8 cache (static and paged) and the bf16 KDA
  state, against the float cache: logits within the tolerances below, the same greedy tokens.
"""

import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import kimi_jax
import kernels_pallas.attention as attn_api
import kernels_pallas.mla_decode as mla_api
import kernels_pallas.paged_attention as paged_api
from kernels_pallas import cache_quant
from kernels_pallas.attention import pallas as attn_pallas
from kernels_pallas.attention import reference as attn_ref
from kernels_pallas.cache_quant import Int8Rows
from kernels_pallas.mla_decode import pallas as mla_pallas
from kernels_pallas.mla_decode import reference as mla_ref
from kernels_pallas.paged_attention import pallas as paged_pallas
from kimi_jax.model import config as C
from kimi_jax.model.cache import KVCache, MLACache, cache_bytes, cache_shapes, init_cache, paged_cache
from tests.parity import assert_close

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))

# Decode logits, quantized cache vs float cache, float32 models (observed on the fixtures: int8 rows 0.017 (K3) of
# logits up to 4.5; bf16 KDA state 0.16; see the report in each test's print).
TOL_INT8 = 0.05
TOL_BF16_STATE = 0.3


# -- the row format ---------------------------------------------------------------------------------------


def _np_quantize(x):
    """The oracle: scale = max|x| * float32(1/127) per row, codes = round-half-even(x * (1 / scale)) in
    [-127, 127]."""
    x = np.asarray(x, np.float32)
    scale = (np.max(np.abs(x), axis=-1, keepdims=True) * np.float32(1 / 127)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    q = np.clip(np.rint(x * (np.float32(1) / safe)), -127, 127).astype(np.int8)
    return q, scale


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["float32", "bfloat16"])
def test_rows_quantize_and_dequantize_exactly(dtype):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 7, 2, 64)) * rng.uniform(0.01, 30, (3, 7, 2, 1))).astype(dtype)
    x[0, 1, 0] = 0  # a zero row: scale 0, codes 0, no NaN
    x[1, 2, 1, :3] = [127.0, -63.5, 0.5]  # exact ties at scale 1 (max 127): half-even rounding
    x[1, 2, 1, 3:] = 0
    rows = jax.jit(cache_quant.quantize)(jnp.asarray(x))
    q, scale = _np_quantize(x)
    np.testing.assert_array_equal(np.asarray(rows.q), q)
    np.testing.assert_array_equal(np.asarray(rows.scale), scale)
    assert rows.q.dtype == jnp.int8 and rows.scale.shape == (3, 7, 2, 1)
    np.testing.assert_array_equal(np.asarray(rows.q[1, 2, 1, :3]), [127, -64, 0])  # 63.5 -> 64, 0.5 -> 0
    np.testing.assert_array_equal(np.asarray(cache_quant.dequantize(rows)), q.astype(np.float32) * scale)
    assert not np.isnan(np.asarray(cache_quant.dequantize(rows))).any()
    # the rounding bound: half a step of the row's scale
    err = np.abs(np.asarray(cache_quant.dequantize(rows)) - x.astype(np.float32))
    assert (err <= scale / 2 + 1e-6 * np.abs(x.astype(np.float32))).all()


def test_cache_options_and_errors():
    cfg = C.preset("k3").sliced(4, 16)
    c = init_cache(cfg, 2, 32, jnp.bfloat16, kv_cache="int8", kda_state=jnp.bfloat16)
    mla = next(e for e in c.layers if isinstance(e, MLACache))
    assert isinstance(mla.c, Int8Rows) and mla.c.q.shape == (2, 32, 512) and mla.c.scale.shape == (2, 32, 1)
    assert mla.kpe.q.shape == (2, 32, 64) and mla.kpe.scale.dtype == jnp.float32
    assert next(e for e in c.layers if hasattr(e, "state")).state.dtype == jnp.bfloat16
    assert c.max_len == 32
    with pytest.raises(ValueError, match="kv_cache='int4'"):
        init_cache(cfg, 1, 8, kv_cache="int4")
    with pytest.raises(ValueError, match="kda_state='float16'"):
        cache_shapes(cfg, 1, 8, kda_state="float16")
    with pytest.raises(ValueError, match="kda_state='f8'"):
        paged_cache(cfg, 1, 4, 16, kda_state="f8")


@pytest.mark.parametrize("preset", ["k3", "kimi-dense"])
def test_cache_bytes_count_codes_and_scales(preset):
    """cache_bytes against the arithmetic of the config; and the allocated cache's nbytes."""
    cfg = C.preset(preset)
    B, S = 8, 131072
    n = {kind: cfg.attn_types.count(kind) for kind in ("kda", "mla", "gqa")}
    base = cache_bytes(cfg, B, S, jnp.bfloat16)
    got = cache_bytes(cfg, B, S, jnp.bfloat16, kv_cache="int8", kda_state=jnp.bfloat16)
    if n["mla"]:
        m = cfg.mla
        assert base["mla"] == n["mla"] * B * S * (m.kv_lora_rank + m.qk_rope_dim) * 2
        assert got["mla"] == n["mla"] * B * S * (m.kv_lora_rank + m.qk_rope_dim + 2 * 4)  # codes + 2 scales
    if n["gqa"]:
        g = cfg.gqa
        assert got["kv"] == n["gqa"] * B * S * g.num_kv_heads * 2 * (g.head_dim + 4)
    if n["kda"]:
        k = cfg.kda
        assert got["kda_state"] == n["kda"] * B * k.num_heads * k.head_dim**2 * 2 == base["kda_state"] // 2
    assert got["kda_conv"] == base["kda_conv"]
    small = C.preset(preset).sliced(4, 16 if C.preset(preset).moe else None)
    alloc = init_cache(small, 2, 16, jnp.bfloat16, kv_cache="int8", kda_state=jnp.bfloat16)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(alloc)) - alloc.lengths.nbytes
    assert nbytes == cache_bytes(small, 2, 16, jnp.bfloat16, kv_cache="int8", kda_state=jnp.bfloat16)["total"]


def test_plan_counts_the_int8_cache(capsys):
    from kimi_jax import cli
    from kimi_jax.deploy import plan

    cfg = C.preset("k3")
    sizes = dict(data=1, expert=8, model=8)
    p0 = plan.make_plan(cfg, sizes, batch=8, context=131072)
    p1 = plan.make_plan(cfg, sizes, batch=8, context=131072, kv_cache="int8", kda_state="bfloat16")
    m, b_loc = cfg.mla, 1  # batch 8 over expert=8: one sequence per chip; the latent cache's positions over model
    n_mla = cfg.attn_types.count("mla")
    assert p1.cache["mla"] == n_mla * b_loc * (131072 // 8) * (m.kv_lora_rank + m.qk_rope_dim + 8)
    assert p1.cache["kda_state"] * 2 == p0.cache["kda_state"]
    assert p1.param_total == p0.param_total
    rc = cli.main(["plan", "--model", "k3", "--mesh", "expert=8,model=8", "--kv-cache", "int8", "--kda-state",
                   "bfloat16", "--chips", "v6e"])
    out = capsys.readouterr().out
    assert rc == 0 and "int8 MLA/KV cache, bfloat16 KDA state" in out and "MLA latent cache, int8" in out, out
    assert f"{p1.cache['mla'] / 1e9:9.2f} GB" in out


# -- the kernels ----------------------------------------------------------------------------------------


def _rows(key, shape, dtype=jnp.float32):
    """Random int8 rows and their float32 dequantization, computed in numpy (the oracle's cache)."""
    x = np.asarray(jax.random.normal(key, shape, jnp.float32)) * 2
    q, scale = _np_quantize(x)
    return Int8Rows(jnp.asarray(q), jnp.asarray(scale)), jnp.asarray(q.astype(np.float32) * scale)


def _mla_case(seed, dtype, B=2, T=1, H=4, R=128, O=64, S=128):
    k = jax.random.split(jax.random.key(seed), 4)
    q_lat = jax.random.normal(k[0], (B, T, H, R), jnp.float32)
    q_pe = jax.random.normal(k[1], (B, T, H, O), jnp.float32).astype(dtype)
    c, c_f = _rows(k[2], (B, S, R))
    kpe, kpe_f = _rows(k[3], (B, S, O))
    pos = jnp.array([[S - 1 - 3 * t for t in range(T)][::-1], [37 + t for t in range(T)]], jnp.int32)[:B]
    return q_lat, q_pe, c, kpe, c_f, kpe_f, pos


def _pages(B, P, n, seed):
    return jnp.asarray(np.random.default_rng(seed).permutation(n)[: B * P].reshape(B, P).astype(np.int32))


# kernel tolerance vs the reference on the dequantized cache: float32 exact up to summation order; bfloat16
# queries (the kernel rounds q and each dequantized tile to bf16, as for a bf16 cache)
KTOL = {"float32": 2e-5, "bfloat16": 0.08}
DTYPES = [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("style", ["gpu", "tpu", "xla_cpu"])
def test_mla_attention_over_int8_rows(dtype, style):
    q_lat, q_pe, c, kpe, c_f, kpe_f, pos = _mla_case(0, dtype, T=2)
    want = mla_ref.mla_attention(q_lat, q_pe, c_f, kpe_f, pos, scale=0.1)
    if style == "gpu":
        got = jax.jit(functools.partial(mla_api.mla_attention, scale=0.1, implementation="pallas_interpret"))(
            q_lat, q_pe, c, kpe, pos)
    elif style == "tpu":
        got = jax.jit(functools.partial(mla_pallas.mla_attention, scale=0.1, platform="tpu", interpret=True,
                                        block_k=128))(q_lat, q_pe, c, kpe, pos)
    else:
        got = mla_api.mla_attention(q_lat, q_pe, c, kpe, pos, scale=0.1, implementation="xla_cpu")
    assert_close(got, want, KTOL[jnp.dtype(dtype).name], f"mla_attention int8 ({style})")
    ref = mla_api.mla_attention(q_lat, q_pe, c, kpe, pos, scale=0.1, implementation="reference")
    assert_close(ref, want, 1e-6, "mla_attention reference reads the int8 rows")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("style", ["gpu", "tpu", "xla_cpu"])
def test_paged_mla_attention_over_int8_pages(dtype, style):
    ps, P, n = 16, 4, 11
    q_lat, q_pe, _, _, _, _, pos = _mla_case(1, dtype, T=2, S=ps * P)
    k = jax.random.split(jax.random.key(5), 2)
    c, c_f = _rows(k[0], (n, ps, q_lat.shape[-1]))
    kpe, kpe_f = _rows(k[1], (n, ps, q_pe.shape[-1]))
    pt = _pages(2, P, n, 0)
    want = mla_ref.mla_attention(q_lat, q_pe, c_f[pt].reshape(2, P * ps, -1), kpe_f[pt].reshape(2, P * ps, -1), pos,
                                 scale=0.1)
    if style == "gpu":
        got = jax.jit(functools.partial(paged_api.paged_mla_attention, scale=0.1,
                                        implementation="pallas_interpret"))(q_lat, q_pe, c, kpe, pt, pos)
    elif style == "tpu":
        got = jax.jit(functools.partial(paged_pallas.paged_mla_attention, scale=0.1, platform="tpu", interpret=True,
                                        pages_per_step=2))(q_lat, q_pe, c, kpe, pt, pos)
    else:
        got = paged_api.paged_mla_attention(q_lat, q_pe, c, kpe, pt, pos, scale=0.1, implementation="xla_cpu")
    assert_close(got, want, KTOL[jnp.dtype(dtype).name], f"paged_mla_attention int8 ({style})")


def _gqa_q(seed, dtype, B=2, T=3, H=4, K=32):
    return jax.random.normal(jax.random.key(seed), (B, T, H, K), jnp.float32).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("style", ["gpu", "tpu"])
def test_paged_gqa_over_int8_pages(dtype, style):
    ps, P, n, G, K = 16, 4, 9, 2, 32
    q = _gqa_q(2, dtype, K=K)
    pos = jnp.array([[50, 51, 52], [20, 21, 22]], jnp.int32)
    k = jax.random.split(jax.random.key(6), 2)
    kp, kp_f = _rows(k[0], (n, ps, G, K))
    vp, vp_f = _rows(k[1], (n, ps, G, K))
    pt = _pages(2, P, n, 1)
    want = attn_ref.attention(q, kp_f[pt].reshape(2, P * ps, G, K), vp_f[pt].reshape(2, P * ps, G, K), pos, scale=0.2)
    if style == "gpu":
        got = jax.jit(functools.partial(paged_api.paged_attention, scale=0.2, implementation="pallas_interpret"))(
            q, kp, vp, pt, pos)
    else:
        got = jax.jit(functools.partial(paged_pallas.paged_attention, scale=0.2, platform="tpu", interpret=True))(
            q, kp, vp, pt, pos)
    assert_close(got, want, KTOL[jnp.dtype(dtype).name], f"paged_attention int8 ({style})")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("style", ["gpu", "tpu"])
def test_cached_gqa_over_int8_rows(dtype, style):
    S, G, K = 256, 2, 32
    q = _gqa_q(3, dtype, K=K)
    pos = jnp.array([[200, 201, 202], [9, 10, 11]], jnp.int32)
    k = jax.random.split(jax.random.key(7), 2)
    kc, kc_f = _rows(k[0], (2, S, G, K))
    vc, vc_f = _rows(k[1], (2, S, G, K))
    want = attn_ref.attention(q, kc_f, vc_f, pos, scale=0.2)
    if style == "gpu":
        got = jax.jit(functools.partial(attn_api.attention, scale=0.2, implementation="pallas_interpret"))(
            q, kc, vc, pos)
    else:
        got = jax.jit(functools.partial(attn_pallas.attention, scale=0.2, platform="tpu", interpret=True,
                                        block_k=128))(q, kc, vc, pos)
    assert_close(got, want, KTOL[jnp.dtype(dtype).name], f"attention int8 ({style})")
    assert_close(attn_api.attention(q, kc, vc, pos, scale=0.2, implementation="reference"), want, 1e-6,
                 "attention reference reads the int8 rows")


_SHARDED = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding
    sys.path.insert(0, os.getcwd())
    from tests.test_cache_quant import _mla_case, _rows, _pages
    import kernels_pallas.mla_decode as mla_api, kernels_pallas.paged_attention as paged_api
    from kernels_pallas._dispatch import Placement
    from kimi_jax.model import config as C
    from kimi_jax.model.cache import cache_shapes
    from kimi_jax.parallel import sharding
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    place = Placement(mesh, (("batch", ("data",)), ("heads", ("model",))))
    worst = 0.0
    for impl in ("pallas_interpret", "reference"):
        q_lat, q_pe, c, kpe, c_f, kpe_f, pos = _mla_case(0, jnp.float32, T=2)
        want = mla_api.mla_attention(q_lat, q_pe, c_f, kpe_f, pos, scale=0.1, implementation="reference")
        got = jax.jit(lambda *a: mla_api.mla_attention(*a, scale=0.1, implementation=impl, placement=place))(
            q_lat, q_pe, c, kpe, pos)
        worst = max(worst, float(jnp.max(jnp.abs(got - want))))
        ps, P, n = 16, 4, 9
        q = jax.random.normal(jax.random.key(1), (2, 1, 4, 32))
        kp, kp_f = _rows(jax.random.key(2), (n, ps, 2, 32))
        vp, vp_f = _rows(jax.random.key(3), (n, ps, 2, 32))
        pt, p = _pages(2, P, n, 0), jnp.array([[40], [17]], jnp.int32)
        want = paged_api.paged_attention(q, kp_f, vp_f, pt, p, scale=0.2, implementation="reference")
        got = jax.jit(lambda *a: paged_api.paged_attention(*a, scale=0.2, implementation=impl,
                                                           placement=place))(q, kp, vp, pt, p)
        worst = max(worst, float(jnp.max(jnp.abs(got - want))))
    # the cache sharding rules give the scales specs (codes and scales split alike)
    cfg = C.preset("kimi-dense").sliced(2)
    shapes = cache_shapes(cfg, 4, 64, kv_cache="int8")
    specs = sharding.cache_specs(cfg, shapes, dict(data=2, expert=1, model=2))
    kv = specs.layers[0]
    assert kv.k.q == kv.k.scale and kv.k.q[0] is not None, kv
    print("WORST", worst, kv.k.q)
""")


@pytest.mark.slow
def test_int8_kernels_under_shard_map_on_a_cpu_mesh():
    """MLA (batch and heads split) and paged GQA (heads and kv heads split) over int8 caches inside shard_map on 4
    CPU devices equal the unsharded reference; the cache specs cover the scales."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", _SHARDED], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    line = next(s for s in proc.stdout.splitlines() if s.startswith("WORST"))
    assert float(line.split()[1]) < 2e-5, line
    print(line)


# -- whole models -----------------------------------------------------------------------------------------


def _decode(model, ids, feed, cache, pt=None):
    """Prefill ``ids`` into ``cache`` (through page table ``pt`` when given), then one step per column of ``feed``
    (teacher forcing: every variant sees the same tokens). Returns logits [B, 1 + steps, V]: the prefill's last
    position, then each step's."""
    prefill = nnx.jit(lambda m, x, c, pt: m(x, cache=c, page_table=pt, last_only=True))
    step = nnx.jit(lambda m, x, c, pt: m(x, cache=c, prefix=True, page_table=pt))
    out = prefill(model, jnp.asarray(ids), cache, pt)
    logits, cache = [np.asarray(out.logits[:, -1])], out.cache
    for j in range(feed.shape[1]):
        out = step(model, jnp.asarray(feed[:, j : j + 1]), cache, pt)
        logits.append(np.asarray(out.logits[:, 0]))
        cache = out.cache
    return np.stack(logits, 1), cache


def _compare(name, got, want, tol):
    err = assert_close(got, want, tol, f"{name}: logits vs the float cache")
    agree = float((got.argmax(-1) == want.argmax(-1)).mean())
    print(f"{name}: max |logits - float cache| = {err:.3g} (logits up to {np.abs(want).max():.3g}); "
          f"greedy agreement {agree:.0%}")
    assert agree == 1.0, f"{name}: greedy tokens differ from the float cache's"
    return err


@pytest.fixture(scope="module")
def k3_model(k3_tiny_a, k3_golden):
    model = kimi_jax.from_pretrained(k3_tiny_a, dtype="float32")
    ids = np.array(k3_golden["input_ids"])
    feed = np.array(k3_golden["greedy_tokens"][:, :6]).astype(np.int32)
    want, _ = _decode(model, ids, feed, init_cache(model.cfg, 2, 64, jnp.float32))
    return model, ids, feed, want


def test_k3_decode_with_int8_cache(k3_model, k3_golden):
    model, ids, feed, want = k3_model
    got, cache = _decode(model, ids, feed, init_cache(model.cfg, 2, 64, jnp.float32, kv_cache="int8"))
    _compare("k3 static int8 cache", got, want, TOL_INT8)
    # the stored rows are the quantized float rows: int8 codes with scales, nothing written past the tokens fed
    mla = next(e for e in cache.layers if isinstance(e, MLACache))
    assert mla.c.q.dtype == jnp.int8 and not np.asarray(mla.c.q[:, ids.shape[1] + feed.shape[1]:]).any()
    # the float cache's greedy tokens are the fixture's golden ones, so the int8 cache reproduces them too
    np.testing.assert_array_equal(want[:, :-1].argmax(-1), k3_golden["greedy_tokens"][:, :6])


@pytest.mark.slow
def test_k3_generate_int8_cache_and_bf16_state(k3_model, k3_golden):
    """The generation API with both options: the fixture's golden greedy tokens."""
    model, ids, *_ = k3_model
    r = kimi_jax.generate(model, ids, 8, stop=(), max_len=64, kv_cache="int8", kda_state=jnp.bfloat16)
    np.testing.assert_array_equal(np.array(r.tokens), k3_golden["greedy_tokens"][:, :8])
    with pytest.raises(ValueError, match="kv_cache='fp8'"):
        kimi_jax.generate(model, ids, 2, max_len=64, kv_cache="fp8")


@pytest.mark.slow
def test_k3_decode_paged_int8_and_bf16_state(k3_model):
    model, ids, feed, want = k3_model
    pt = jnp.array([[5, 2, 7, 0], [1, 6, 3, 4]], jnp.int32)  # 4 pages of 16 per sequence, scattered in a pool of 8
    got, _ = _decode(model, ids, feed, paged_cache(model.cfg, 2, 8, 16, jnp.float32, kv_cache="int8"), pt)
    _compare("k3 paged int8 cache", got, want, TOL_INT8)
    got, cache = _decode(model, ids, feed, init_cache(model.cfg, 2, 64, jnp.float32, kda_state=jnp.bfloat16))
    assert next(e for e in cache.layers if hasattr(e, "state")).state.dtype == jnp.bfloat16
    _compare("k3 bf16 KDA state", got, want, TOL_BF16_STATE)
    got, _ = _decode(model, ids, feed, paged_cache(model.cfg, 2, 8, 16, jnp.float32, kv_cache="int8",
                                                   kda_state=jnp.bfloat16), pt)
    _compare("k3 paged int8 cache + bf16 KDA state", got, want, TOL_BF16_STATE)


@pytest.mark.slow
def test_k3_bf16_state_is_the_float_state_rounded_per_call(k3_model):
    """The oracle of the bf16 state: the float32 cache with its KDA state rounded to bf16 after every call (prefill
    and each step), the update itself in float32. Bit-equal logits; the whole difference from the float cache is
    that rounding."""
    from kimi_jax.model.cache import KDACache

    model, ids, feed, want = k3_model

    def rounded(cache):
        layers = tuple(e.replace(state=e.state.astype(jnp.bfloat16).astype(jnp.float32))
                       if isinstance(e, KDACache) else e for e in cache.layers)
        return cache.replace(layers=layers)

    prefill = nnx.jit(lambda m, x, c: m(x, cache=c, last_only=True))
    step = nnx.jit(lambda m, x, c: m(x, cache=c, prefix=True))
    out = prefill(model, jnp.asarray(ids), init_cache(model.cfg, 2, 64, jnp.float32))
    logits, cache = [np.asarray(out.logits[:, -1])], rounded(out.cache)
    for j in range(feed.shape[1]):
        out = step(model, jnp.asarray(feed[:, j : j + 1]), cache)
        logits.append(np.asarray(out.logits[:, 0]))
        cache = rounded(out.cache)
    got, _ = _decode(model, ids, feed, init_cache(model.cfg, 2, 64, jnp.float32, kda_state=jnp.bfloat16))
    np.testing.assert_array_equal(got, np.stack(logits, 1))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from kimi_jax.checkpoint import synthetic

    path = synthetic.write_checkpoint(str(tmp_path_factory.mktemp("llama_q")), "llama", num_shards=1)
    return kimi_jax.from_pretrained(path, dtype="float32")


@pytest.mark.parametrize("paged", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["static", "paged"])
def test_llama_decode_with_int8_kv_cache(llama, paged):
    rng = np.random.default_rng(3)
    ids = rng.integers(3, llama.cfg.vocab_size, (2, 12)).astype(np.int32)
    feed = rng.integers(3, llama.cfg.vocab_size, (2, 6)).astype(np.int32)
    want, _ = _decode(llama, ids, feed, init_cache(llama.cfg, 2, 32, jnp.float32))
    if paged:
        cache, pt = paged_cache(llama.cfg, 2, 6, 16, jnp.float32, kv_cache="int8"), jnp.array([[4, 1], [0, 5]])
    else:
        cache, pt = init_cache(llama.cfg, 2, 32, jnp.float32, kv_cache="int8"), None
    got, cache = _decode(llama, ids, feed, cache, pt)
    assert isinstance(cache.layers[0], KVCache) and cache.layers[0].k.scale.shape[-2:] == (2, 1)  # per kv head
    _compare(f"llama {'paged' if paged else 'static'} int8 KV cache", got, want, TOL_INT8)
