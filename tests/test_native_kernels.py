"""The native CPU kernels (``kernels_pallas/{matvec,kda,mla_decode}/native.cc``) against float64 numpy, the
automatic choices that pick them (expert gather, grouped decode products in the model), what happens when one cannot
run (not built, unsupported operands, a compiler that fails), and their build (the cache key covers the header)."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

import kernels_pallas.moe_gmm as moe_api
import kimi_jax
from kernels_pallas import KernelUnavailable, _native, matvec
from kernels_pallas.matvec import native
from kernels_pallas.mxfp4 import MXFP4Weight

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = f"kimi_jax_{native.SYMBOL}"
pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="native kernels are for XLA:CPU")


def _case(rng, N, X, K, F, E):
    x = rng.standard_normal((N, X, K)).astype(np.float32)
    w = rng.standard_normal((E, F, K)).astype(np.float32)
    idx = rng.integers(0, E, (N, X)).astype(np.int32)
    return x, w, idx


@pytest.mark.parametrize("N,X,K,F,E", [
    (1, 2, 1024, 256, 16),  # the benchmark model's up projections at batch 1: split over the pool's threads
    (1, 2, 256, 1024, 16),  # its down projection
    (4, 3, 1000, 70, 5),    # K past the last 16 lanes, F past the last 4 rows, experts repeated, threads
    (3, 2, 37, 13, 5),      # small: one thread
    (1, 1, 1, 1, 1),
])
def test_gather_matvec_matches_numpy(N, X, K, F, E):
    rng = np.random.default_rng(N * 1000 + K)
    x, w, idx = _case(rng, N, X, K, F, E)
    got = np.asarray(jax.jit(lambda a, b, c: moe_api.gather_matmul(a, b, c, implementation="cpu_native"))(x, w, idx))
    want = np.einsum("nxk,nxfk->nxf", x.astype(np.float64), w[idx].astype(np.float64))
    assert got.shape == (N, X, F) and got.dtype == np.float32
    scale = np.sqrt(K)  # products of unit normals summed over K
    np.testing.assert_allclose(got, want, atol=1e-5 * scale, rtol=0)


def _lowered(x, w, idx, **kw):
    return jax.jit(lambda a, b, c: moe_api.gather_matmul(a, b, c, **kw)).lower(x, w, idx).as_text()


def test_automatic_choice_on_cpu():
    """Float32 weights on CPU: the native kernel; bfloat16 compute or implementation='reference': the plain-jnp
    reference; MXFP4 weights: the kernel's MXFP4 handler. Asking for the native kernel where it cannot run
    raises."""
    rng = np.random.default_rng(0)
    x, w, idx = _case(rng, 1, 2, 64, 32, 4)
    assert TARGET in _lowered(x, w, idx)
    assert TARGET not in _lowered(x, w, idx, implementation="reference")
    assert TARGET not in _lowered(x, w, idx, compute_dtype=jnp.bfloat16)
    packed = MXFP4Weight(jnp.asarray(rng.integers(0, 256, (4, 32, 32)), jnp.uint8),
                         jnp.asarray(rng.integers(118, 126, (4, 32, 2)), jnp.uint8))
    assert TARGET not in _lowered(x, packed, idx) and "kimi_jax_KimiMatvecGroupMXFP4" in _lowered(x, packed, idx)
    with pytest.raises(KernelUnavailable, match="MXFP4 scales stored as float32"):
        _lowered(x, packed._replace(scale=packed.scale.astype(jnp.float32)), idx, implementation="cpu_native")
    with pytest.raises(KernelUnavailable, match="bfloat16"):
        _lowered(x, w, idx, implementation="cpu_native", compute_dtype=jnp.bfloat16)
    tpu = AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    with use_abstract_mesh(AbstractMesh((1,), ("x",), axis_types=(AxisType.Auto,), abstract_device=tpu)):
        with pytest.raises(KernelUnavailable, match="runs on CPU only, not on 'tpu'"):
            jax.jit(lambda a, b, c: moe_api.gather_matmul(a, b, c, implementation="cpu_native")).trace(x, w, idx)


def test_unavailable_kernel_is_passed_over():
    """A kernel that did not build: the automatic choice takes the reference, an explicit request raises."""
    rng = np.random.default_rng(1)
    x, w, idx = _case(rng, 1, 2, 64, 32, 4)
    with native.KERNEL.unavailable("turned off by this test"):
        assert TARGET not in _lowered(x, w, idx)
        with pytest.raises(KernelUnavailable, match="turned off"):
            _lowered(x, w, idx, implementation="cpu_native")
    assert TARGET in _lowered(x, w, idx)  # and back after the block


def test_expert_id_out_of_range_is_an_error():
    rng = np.random.default_rng(2)
    x, w, idx = _case(rng, 1, 2, 64, 32, 4)
    idx[0, 1] = 4
    with pytest.raises(Exception, match="item 0: expert id out of range"):
        jax.block_until_ready(jax.jit(lambda a, b, c: moe_api.gather_matmul(a, b, c, implementation="cpu_native"))(
            x, w, idx))


def test_failed_build_falls_back_with_a_warning_and_raises_when_asked(tmp_path):
    """A compiler that fails (here ``false``) in a fresh cache: the automatic choice logs the failure once and runs
    the reference, with the same numbers; an explicit request raises with the build's message."""
    script = textwrap.dedent("""
        import logging, sys
        import numpy as np, jax
        import kernels_pallas.moe_gmm as moe_api
        from kernels_pallas import KernelUnavailable
        logging.basicConfig(stream=sys.stdout, level=logging.WARNING)
        rng = np.random.default_rng(0)
        x = rng.standard_normal((1, 2, 64)).astype(np.float32)
        w = rng.standard_normal((4, 32, 64)).astype(np.float32)
        idx = np.array([[3, 1]], np.int32)
        f = jax.jit(lambda a, b, c: moe_api.gather_matmul(a, b, c))
        for _ in range(2):
            assert "kimi_jax_" not in f.lower(x, w, idx).as_text()
            got = np.asarray(f(x, w, idx))
            np.testing.assert_allclose(got, np.einsum("nxk,nxfk->nxf", x, w[idx]), atol=1e-4)
        try:
            jax.jit(lambda a, b, c: moe_api.gather_matmul(a, b, c, implementation="cpu_native")).lower(x, w, idx)
        except KernelUnavailable as e:
            print("RAISED:", str(e).splitlines()[0])
        else:
            print("NOT RAISED")
    """)
    env = dict(os.environ, CXX="false", XDG_CACHE_HOME=str(tmp_path), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [ln for ln in proc.stdout.splitlines() if ln.startswith("WARNING:kernels_pallas._native")]
    assert len(warnings) == 1 and "building native.cc with false failed" in warnings[0], proc.stdout
    assert "using the plain-jnp reference instead" in proc.stdout
    assert "RAISED: building native.cc with false failed" in proc.stdout, proc.stdout
    assert not list(tmp_path.glob("kimi-jax/native/*.so"))


# -- grouped products (matvec.group) -----------------------------------------------------------------------


def _items(rng, S):
    """Plain weights and expert stacks of several shapes, K and N past the vector and row tails."""
    plain = [(S, 1024, 1024), (S, 100, 1000), (S, 8, 1024), (S, 1, 3)]
    stacked = [(2 * S, 256, 1024, 16), (2 * S, 33, 70, 5)]
    items = [(rng.standard_normal((s, k)).astype(np.float32), rng.standard_normal((n, k)).astype(np.float32), None)
             for s, n, k in plain]
    items += [(rng.standard_normal((s, k)).astype(np.float32), rng.standard_normal((e, n, k)).astype(np.float32),
               rng.integers(0, e, (s,)).astype(np.int32)) for s, n, k, e in stacked]
    return items


def _want(x, w, ids):
    w64 = w.astype(np.float64)
    if ids is None:
        return x.astype(np.float64) @ w64.T
    return np.einsum("sk,snk->sn", x.astype(np.float64), w64[ids])


def _group_fn(structure, **kw):
    """A jitted ``matvec.group`` over flat operands (None ids stay static)."""
    def f(*ops):
        it = iter(ops)
        return matvec.group([(next(it), next(it), next(it) if has_ids else None) for has_ids in structure], **kw)
    return jax.jit(f)


def _flat(items):
    return [a for x, w, ids in items for a in ((x, w) if ids is None else (x, w, ids))]


@pytest.mark.parametrize("S", [1, 3, 8])
def test_group_matches_numpy(S):
    """Every item of one call, plain and stacked, against float64 numpy: the native kernel runs all of them as one
    call, and the reference and the XLA:CPU forms agree. The automatic choice takes the native kernel for items of
    up to ``SHARED_ROWS`` float32 rows (decode at batch 1, a verify step's few positions) and the XLA:CPU forms for
    more (bfloat16 items: ``test_group_errors``)."""
    rng = np.random.default_rng(S)
    items = _items(rng, S)
    structure = [ids is not None for _, _, ids in items]
    f = _group_fn(structure, implementation="cpu_native")
    hlo = f.lower(*_flat(items)).as_text()
    assert hlo.count(f"kimi_jax_{native.SYMBOL}") == 1, "one native call for the whole group"
    auto = _group_fn(structure).lower(*_flat(items)).as_text()
    assert auto.count(f"kimi_jax_{native.SYMBOL}") == (1 if S <= matvec.SHARED_ROWS else 0)
    xla = [np.asarray(g) for g in _group_fn(structure, implementation="xla_cpu")(*_flat(items))]
    got = [np.asarray(g) for g in f(*_flat(items))]
    ref = [np.asarray(g) for g in _group_fn(structure, implementation="reference")(*_flat(items))]
    assert f"kimi_jax_{native.SYMBOL}" not in _group_fn(structure, implementation="reference").lower(
        *_flat(items)).as_text()
    for (x, w, ids), g, r, c in zip(items, got, ref, xla):
        want = _want(x, w, ids)
        assert g.shape == want.shape and g.dtype == np.float32
        np.testing.assert_allclose(g, want, atol=1e-5 * np.sqrt(x.shape[1]), rtol=0)
        np.testing.assert_allclose(g, r, atol=1e-5 * np.sqrt(x.shape[1]), rtol=0)
        np.testing.assert_allclose(c, want, atol=1e-5 * np.sqrt(x.shape[1]), rtol=0)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "int4:g32", "mxfp4"])
def test_rows_that_share_a_weight_get_the_bits_of_one_row(fmt):
    """Rows of x that use the same matrix share its reads (up to 5 at a time, native.cc's DotRows; a 4-bit weight's
    decoded blocks too): each row's result has exactly the bits it has alone, for a plain weight and for runs of
    equal expert ids in a stack (rows and columns past the vector, block and row tails), and matches float64
    numpy."""
    from kernels_pallas import quant

    rng = np.random.default_rng(11)
    I = 1000 if fmt in ("float32", "bfloat16", "int8") else 1024  # 4-bit groups: whole blocks of 32 columns
    x = jnp.asarray(rng.standard_normal((7, I)), jnp.float32)
    w = rng.standard_normal((3, 70, I)).astype(np.float32)
    if fmt == "mxfp4":
        codes, scales = rng.integers(0, 256, (3, 70, I // 2)), rng.integers(118, 126, (3, 70, I // 32))
        plain, stack = (MXFP4Weight(jnp.asarray(c, jnp.uint8), jnp.asarray(e, jnp.uint8))
                        for c, e in ((codes[0], scales[0]), (codes, scales)))
        dense = lambda a: _mxfp4_decoded(a.packed, a.scale)  # noqa: E731
    elif fmt in ("int8", "int4:g32"):
        plain, stack = (quant.quantize(jnp.asarray(a), quant.Format.parse(fmt)) for a in (w[0], w))
        dense = lambda a: np.asarray(quant.dequantize(a), np.float64)  # noqa: E731
    else:
        plain, stack = jnp.asarray(w[0], fmt), jnp.asarray(w, fmt)
        dense = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    ids = jnp.asarray([2, 2, 2, 0, 2, 2, 1], jnp.int32)  # runs of 3, 1, 2, 1
    f = jax.jit(lambda it: matvec.group(it, implementation="cpu_native"))
    together = f([(x, plain, None), (x, stack, ids)])
    alone = [f([(x[m:m + 1], plain, None), (x[m:m + 1], stack, ids[m:m + 1])]) for m in range(7)]
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(together[i]), np.concatenate([np.asarray(a[i]) for a in alone]))
    x64 = np.asarray(x, np.float64)
    tol = 1e-5 * np.sqrt(I) * (64 if fmt == "mxfp4" else 1)  # (MXFP4 values reach 6 x 2^(125 - 127))
    np.testing.assert_allclose(np.asarray(together[0]), x64 @ dense(plain).T, atol=tol, rtol=0)
    want = np.einsum("mi,mji->mj", x64, dense(stack)[np.asarray(ids)])
    np.testing.assert_allclose(np.asarray(together[1]), want, atol=tol, rtol=0)


def test_group_errors():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    w = rng.standard_normal((32, 64)).astype(np.float32)
    stack = rng.standard_normal((4, 32, 64)).astype(np.float32)
    f = _group_fn([False, True], implementation="cpu_native")
    with pytest.raises(Exception, match="item 1: expert id out of range"):
        jax.block_until_ready(f(x, w, x, stack, np.array([4], np.int32)))
    with pytest.raises(Exception, match="item 1: expert id out of range"):
        jax.block_until_ready(f(x, w, x, stack, np.array([-1], np.int32)))
    with pytest.raises(KernelUnavailable, match="float16 weights"):
        _group_fn([False], implementation="cpu_native").lower(x, w.astype(jnp.float16))
    with pytest.raises(KernelUnavailable, match="different dtypes"):
        _group_fn([False, False], implementation="cpu_native").lower(x, w, x, w.astype(jnp.bfloat16))
    with pytest.raises(KernelUnavailable, match="implementation='triton' is not available"):
        _group_fn([False], implementation="triton").lower(x, w)
    # no Pallas product kernel: a model run that asks for the Pallas kernels gets the plain products here
    assert f"kimi_jax_{native.SYMBOL}" not in _group_fn([False], implementation="pallas").lower(x, w).as_text()
    # one plain product under the automatic choice goes native, float32 (faster than XLA's) and bfloat16 (XLA:CPU's
    # one-row bf16 product is 6-20x slower) alike; past SHARED_ROWS float32 rows it is XLA's, past PLAIN_ROWS
    # bfloat16 rows (a verify step of k = 8 runs its 9-row bfloat16 products natively)
    bf16 = f"kimi_jax_{native.SYMBOLS[jnp.dtype(jnp.bfloat16)]}"
    assert f"kimi_jax_{native.SYMBOL}" in _group_fn([False]).lower(x, w).as_text()
    assert bf16 in _group_fn([False]).lower(x, w.astype(jnp.bfloat16)).as_text()
    many = np.repeat(x, matvec.SHARED_ROWS + 1, axis=0)
    assert "kimi_jax_" not in _group_fn([False]).lower(many, w).as_text()
    for rows, native_call in ((9, True), (matvec.PLAIN_ROWS, True), (matvec.PLAIN_ROWS + 1, False)):
        xb, wb = (jnp.asarray(a, jnp.bfloat16) for a in (np.repeat(x, rows, axis=0), w))
        assert (bf16 in _group_fn([False]).lower(xb, wb).as_text()) == native_call, rows


def test_model_decode_groups_products(hf_kimi_linear):
    """A batch-1 decode step of the HF Kimi Linear tiny model (KDA, MLA, dense MLP, MoE with a shared expert) on CPU
    in float32 runs its products as grouped native calls and its KDA recurrence natively; prefill and decode logits
    equal the reference path's, step by step."""
    from flax import nnx

    from kimi_jax.model.cache import init_cache

    path, _ = hf_kimi_linear
    ids = np.random.default_rng(0).integers(3, 200, (1, 9)).astype(np.int32)
    logits, prefilled, hlos = {}, {}, {}
    for impl in (None, "reference"):
        m = kimi_jax.from_pretrained(path, dtype="float32", implementation=impl)
        prefill = nnx.jit(lambda mod, x, c: mod(x, cache=c))
        step = nnx.jit(lambda mod, x, c: mod(x, cache=c, prefix=True))
        out = prefill(m, jnp.asarray(ids[:, :5]), init_cache(m.cfg, 1, 16, jnp.float32))
        prefilled[impl] = np.asarray(out.logits)
        hlos[impl] = step.lower(m, jnp.asarray(ids[:, 5:6]), out.cache).as_text()
        steps = []
        for j in range(5, 9):
            out = step(m, jnp.asarray(ids[:, j : j + 1]), out.cache)
            steps.append(np.asarray(out.logits[:, 0]))
        logits[impl] = np.stack(steps)
    # tests/hf_models.py: KDA x3 (layer-input products, then the low-rank second halves), MLA (q, kv_a), a dense
    # MLP (gate, up), MoE x3 (chosen experts' and shared expert's up projections, then their down projections); and
    # the products that stand alone: KDA's output projection x3, the dense MLP's down projection, MLA's q_b and
    # output projections, the lm_head
    assert hlos[None].count(f"kimi_jax_{native.SYMBOL}") == 2 * 3 + 1 + 1 + 2 * 3 + 3 + 1 + 2 + 1
    assert hlos[None].count("kimi_jax_KimiKdaRecurrentF32") == 3  # and the KDA recurrence of each KDA layer
    assert "kimi_jax_" not in hlos["reference"]
    np.testing.assert_allclose(prefilled[None], prefilled["reference"], atol=2e-5, rtol=0)
    np.testing.assert_allclose(logits[None], logits["reference"], atol=2e-5, rtol=0)



# -- KDA recurrence (kernels_pallas/kda/native.cc) ------------------------------------------------------------


def _kda_numpy(q, k, v, g, beta, s0, scale):
    """S <- (I - b k k^T) diag(a) S + b k v^T, o = S^T (scale q), per sequence and head, in float64."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    B, T, H, K = q.shape
    S = np.asarray(s0, np.float64).copy()
    o = np.zeros(v.shape)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                kt, a, bt = k[b, t, h], np.exp(g[b, t, h]), beta[b, t, h]
                S[b, h] = (np.eye(K) - bt * np.outer(kt, kt)) @ np.diag(a) @ S[b, h] + bt * np.outer(kt, v[b, t, h])
                o[b, t, h] = S[b, h].T @ (scale * q[b, t, h])
    return o, S


def _kda_case(B, T, H, K, V, seed=0):
    rng = np.random.default_rng(seed)
    unit = lambda x: (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)
    q, k = unit(rng.standard_normal((B, T, H, K))), unit(rng.standard_normal((B, T, H, K)))
    v = rng.standard_normal((B, T, H, V)).astype(np.float32)
    g = (-3.0 * rng.uniform(0, 1, (B, T, H, K))).astype(np.float32)
    beta = rng.uniform(0, 1, (B, T, H)).astype(np.float32)
    s0 = (0.3 * rng.standard_normal((B, H, K, V))).astype(np.float32)
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("B,T,H,K,V", [
    (1, 1, 8, 128, 128),  # the benchmark model's decode step: whole rows, two threads
    (2, 23, 3, 128, 128),  # prefill: 64-column blocks copied out and back, blocks shared by the threads
    (1, 9, 2, 20, 70),  # a 64-column block, then 6 columns past the last vector
    (3, 1, 1, 5, 24),  # one vector and 8 columns; a single part (one thread)
])
def test_kda_recurrence_matches_numpy(B, T, H, K, V):
    import kernels_pallas.kda as kda

    q, k, v, g, beta, s0 = _kda_case(B, T, H, K, V)
    scale = K**-0.5
    want_o, want_s = _kda_numpy(q, k, v, g, beta, s0, scale)
    f = jax.jit(lambda *a: kda.kda_decode(*a, scale=scale, implementation="cpu_native"))
    assert "kimi_jax_KimiKdaRecurrentF32" in f.lower(q, k, v, g, beta, s0).as_text()
    o, s = (np.asarray(x) for x in f(q, k, v, g, beta, s0))
    np.testing.assert_allclose(o, want_o, atol=2e-5, rtol=0)
    np.testing.assert_allclose(s, want_s, atol=2e-5, rtol=0)
    # prefill from a zero state, with inert right padding (g = 0, beta = 0 leave the state as it is)
    pad = lambda x, fill: np.concatenate([x, np.full((B, 3, *x.shape[2:]), fill, x.dtype)], 1)
    args = (pad(q, 0.5), pad(k, 0.5), pad(v, 1.0), pad(g, 0.0), pad(beta, 0.0))
    o0, s0_out = jax.jit(lambda *a: kda.kda_prefill(*a, scale=scale, chunk_size=1, implementation="cpu_native"))(*args)
    want_o0, want_s0 = _kda_numpy(q, k, v, g, beta, np.zeros_like(s0), scale)
    np.testing.assert_allclose(np.asarray(o0)[:, :T], want_o0, atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(s0_out), want_s0, atol=2e-5, rtol=0)


def test_kda_automatic_choice():
    """On CPU the recurrence is native for decode and for prefill with chunk_size=1; the chunked form, the
    reference, a native kernel that did not build and lowering for a TPU keep the plain-jnp forms; asking for the
    native kernel off CPU raises."""
    import kernels_pallas.kda as kda
    from kernels_pallas.kda import native as kda_native

    args = _kda_case(1, 4, 2, 16, 16)
    target = "kimi_jax_KimiKdaRecurrentF32"
    lower = lambda fn, **kw: jax.jit(lambda *a: fn(*a, scale=0.25, **kw)).lower(*args).as_text()
    assert target in lower(kda.kda_decode)
    assert target in lower(kda.kda_prefill, chunk_size=1)
    assert target not in lower(kda.kda_prefill, chunk_size=64)
    assert target not in lower(kda.kda_decode, implementation="reference")
    with kda_native.KERNEL.unavailable("turned off by this test"):
        assert target not in lower(kda.kda_decode)
        with pytest.raises(KernelUnavailable, match="turned off"):
            lower(kda.kda_decode, implementation="cpu_native")
    tpu = AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    with use_abstract_mesh(AbstractMesh((1,), ("x",), axis_types=(AxisType.Auto,), abstract_device=tpu)):
        with pytest.raises(KernelUnavailable, match="runs on CPU only, not on 'tpu'"):
            jax.jit(lambda *a: kda.kda_decode(*a, scale=0.25, implementation="cpu_native")).trace(*args)


def test_bfloat16_weights_stream_in_the_native_kernel():
    """bfloat16 weights (plain, and an expert stack read in place) with bfloat16 or float32 inputs: one bf16 native
    call, float32 results equal to float64 numpy on the same (exactly widened) values; the bf16 MoE gather too."""
    rng = np.random.default_rng(5)
    bf = jnp.bfloat16
    x1 = jnp.asarray(rng.standard_normal((1, 1000)), bf)
    w1 = jnp.asarray(rng.standard_normal((70, 1000)), bf)  # rows past the last 8, lanes past the last 16
    x2 = jnp.asarray(rng.standard_normal((3, 256)), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((5, 129, 256)), bf)
    ids = jnp.asarray([4, 0, 4], jnp.int32)
    items = [(x1, w1, None), (x2, w2, ids)]
    f = jax.jit(lambda it: matvec.group(it))
    assert f.lower(items).as_text().count(f"kimi_jax_{native.SYMBOLS[jnp.dtype(bf)]}") == 1
    got = f(items)
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    want = [f64(x1) @ f64(w1).T, np.einsum("mi,mji->mj", f64(x2), f64(w2)[np.asarray(ids)])]
    for g, w in zip(got, want):
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(g), w, atol=1e-5 * np.sqrt(1000), rtol=0)
    # the MoE gather in a bfloat16 model: x rounded to bf16 as the reference does, experts read in place
    x, w, idx = _case(rng, 2, 2, 300, 40, 6)
    xb, wb = jnp.asarray(x, bf), jnp.asarray(w, bf)
    gather = jax.jit(lambda a, b, c: moe_api.gather_matmul(a, b, c))
    assert f"kimi_jax_{native.SYMBOLS[jnp.dtype(bf)]}" in gather.lower(xb, wb, idx).as_text()
    ref = jax.jit(lambda a, b, c: moe_api.gather_matmul(a, b, c, implementation="reference"))(xb, wb, idx)
    np.testing.assert_allclose(np.asarray(gather(xb, wb, idx)), np.asarray(ref), atol=1e-4, rtol=0)


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # the OCP MX spec's FP4 (E2M1) magnitudes; bit 3 is the sign


def _mxfp4_decoded(packed, scale):
    """MXFP4 bytes -> float64 ``[..., J, I]``, written here from the format: the low nibble is the even column,
    each E2M1 code's bit 3 its sign, every 32 columns scaled by 2^(E8M0 byte - 127) (255: NaN)."""
    packed, scale = np.asarray(packed), np.asarray(scale).astype(np.float64)
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    mag = np.asarray(E2M1)[codes & 7]
    vals = np.where(codes & 8, -mag, mag)
    s = np.where(scale == 255, np.nan, np.exp2(scale - 127))
    return vals * np.repeat(s, 32, axis=-1)


def test_mxfp4_experts_stream_in_the_native_kernel():
    """MXFP4 expert stacks (K3's routed experts) read in place, codes and E8M0 scale bytes decoded in the kernel:
    float32 results equal float64 numpy on the decoded weights (a NaN scale byte gives NaN rows, as the format
    says); the MoE gather takes the kernel automatically on CPU, float32 and bfloat16 compute, and agrees with the
    reference's decode-then-multiply; the expert path reads packed experts in place up to a verify step's few
    pairs."""
    from kernels_pallas import experts

    rng = np.random.default_rng(11)
    E, J, I = 5, 70, 96  # rows past the last 8, three scale groups
    packed = rng.integers(0, 256, (E, J, I // 2)).astype(np.uint8)
    scale = rng.integers(110, 135, (E, J, I // 32)).astype(np.uint8)
    scale[3, 7, 1] = 255
    w = MXFP4Weight(jnp.asarray(packed), jnp.asarray(scale))
    x = rng.standard_normal((6, I)).astype(np.float32)
    ids = np.array([0, 3, 3, 4, 1, 0], np.int32)
    f = jax.jit(lambda a, b, c: matvec.group([(a, b, c)]))
    assert f.lower(x, w, ids).as_text().count("kimi_jax_KimiMatvecGroupMXFP4") == 1
    got = np.asarray(f(x, w, ids)[0])
    want = np.einsum("mi,mji->mj", x.astype(np.float64), _mxfp4_decoded(packed, scale)[ids])
    assert np.isnan(got[1:3, 7]).all() and np.isnan(want[1:3, 7]).all() and np.isfinite(np.delete(got, 7, 1)).all()
    ok = ~np.isnan(want)
    np.testing.assert_allclose(got[ok], want[ok], atol=1e-6 * np.abs(want[ok]).max(), rtol=0)

    # the MoE gather (decode of a K3 layer): native automatically, equal to the reference
    scale[3, 7, 1] = 120
    w = MXFP4Weight(jnp.asarray(packed), jnp.asarray(scale))
    xg, idx = rng.standard_normal((3, 2, I)).astype(np.float32), rng.integers(0, E, (3, 2)).astype(np.int32)
    for dt in (jnp.float32, jnp.bfloat16):
        gather = jax.jit(lambda a, b, c: moe_api.gather_matmul(a, b, c, compute_dtype=dt))
        assert "kimi_jax_KimiMatvecGroupMXFP4" in gather.lower(xg, w, idx).as_text()
        ref = jax.jit(lambda a, b, c: moe_api.gather_matmul(a, b, c, compute_dtype=dt, implementation="reference"))
        g, r = np.asarray(gather(xg, w, idx), np.float32), np.asarray(ref(xg, w, idx), np.float32)
        np.testing.assert_allclose(g, r, atol=(1e-5 if dt == jnp.float32 else 2e-2) * np.abs(r).max(), rtol=0)

    # packed or bfloat16 experts on CPU: gathered up to experts.GATHER_PAIRS pairs (top 2: 18 for a verify step of
    # k = 8 at batch 1, 80 for k = 4 at batch 8), or the experts' count, whichever is more
    choose = lambda pairs, n: experts.choose_path(pairs, n, float32=False)  # noqa: E731
    assert experts.GATHER_PAIRS >= 80
    bound = experts.GATHER_PAIRS
    assert [choose(p, 8) for p in (2, 10, 18, 80, bound, bound + 1)] == ["gather"] * 5 + ["sorted"]
    assert [choose(p, 896) for p in (640, 897)] == ["gather", "sorted"]
    assert experts.choose_path(10, 8, float32=False, implementation="reference") == "sorted"


def test_every_native_source_ships_with_the_package():
    """A wheel carries every kernel source and the header they share (pyproject's package-data): a source left out
    would make an installed package fall back to the reference with a warning."""
    import fnmatch
    import glob
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        data = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    files = glob.glob(os.path.join(ROOT, "kernels_pallas", "**", "*.cc"), recursive=True)
    files += glob.glob(os.path.join(ROOT, "kernels_pallas", "**", "*.h"), recursive=True)
    assert len(files) >= 4
    for path in files:
        rel = os.path.relpath(path, ROOT)
        package, name = os.path.dirname(rel).replace(os.sep, "."), os.path.basename(rel)
        assert any(fnmatch.fnmatch(name, pat) for pat in data.get(package, [])), f"{rel} is not in package-data"


def test_a_header_change_rebuilds(tmp_path, monkeypatch):
    """The build cache is keyed on the headers a source includes as well as on the source: every kernel's key covers
    ``_native.h``, and a changed header gives a new library that is built and loaded (a small source: the test
    compiles in about a second)."""
    from pathlib import Path

    from kernels_pallas.kda import native as kda_native
    from kernels_pallas.mla_decode import native as mla_native

    header = Path(ROOT, "kernels_pallas", "_native.h").resolve()
    for kernel in (native.KERNEL, kda_native.KERNEL, mla_native.KERNEL):
        assert _native.headers(kernel.source) == [header], kernel.source
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "op").mkdir()
    source = tmp_path / "op" / "native.cc"
    # XLA's header is not beside the source: jaxlib's version keys it, not its text
    source.write_text('#include "../shared.h"\n#include "xla/ffi/api/ffi.h"\n'
                      'extern "C" int Answer() { return kAnswer; }\n')
    for answer in (41, 42):
        (tmp_path / "shared.h").write_text(f"constexpr int kAnswer = {answer};\n")
        assert _native.headers(source) == [(tmp_path / "shared.h").resolve()]
        assert _native.Kernel(source).library().Answer() == answer  # the old library would answer 41
    assert len(list((tmp_path / "cache").glob("kimi-jax/native/native-*.so"))) == 2


def _has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512f " in line + " " for line in f)
    except OSError:
        return False


@pytest.mark.skipif(not _has_avx512(), reason="compares this machine's AVX-512 build with an AVX2 build")
def test_bfloat16_and_4bit_products_have_the_same_bits_with_avx2(tmp_path):
    """The bfloat16 and 4-bit (int4, MXFP4) summation orders do not depend on the instruction set (native.cc): a
    build for AVX2 + FMA gives this machine's AVX-512 build's bits, rows and columns past every vector and block tail
    included, and rows of x that share a weight's reads (blocks of other sizes on each)."""
    script = textwrap.dedent("""
        import sys
        import numpy as np, jax, jax.numpy as jnp
        from kernels_pallas import _native, matvec, quant
        from kernels_pallas.mxfp4 import MXFP4Weight
        if sys.argv[1] == "avx2":
            _native._arch_flags = lambda: ["-mavx2", "-mfma", "-mf16c"]
        rng = np.random.default_rng(0)
        bf = jnp.bfloat16
        x1, x2 = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((1, 1000), (3, 2048)))
        w1 = jnp.asarray(rng.standard_normal((70, 1000)), bf)
        w2 = jnp.asarray(rng.standard_normal((4, 300, 2048)), bf)
        w3 = quant.quantize(jnp.asarray(rng.standard_normal((70, 2048)), jnp.float32), quant.Format.parse("int4:g32"))
        w4 = MXFP4Weight(jnp.asarray(rng.integers(0, 256, (4, 70, 1024)), jnp.uint8),
                         jnp.asarray(rng.integers(115, 130, (4, 70, 64)), jnp.uint8))
        ids = jnp.asarray([3, 0, 3], jnp.int32)
        f = jax.jit(lambda it: matvec.group(it, implementation="cpu_native"))
        x5 = jnp.asarray(rng.standard_normal((5, 1000)), jnp.float32)  # rows that share the weight's reads
        outs = (f([(x1, w1, None), (x2, w2, ids)]) + f([(x2[:1], w3, None)]) + f([(x2, w4, ids)])
                + f([(x5, w1, None)]) + f([(x2, w3, None)]) + f([(x2, w4, ids * 0)]))
        np.save(sys.argv[2], np.concatenate([np.asarray(o).ravel() for o in outs]))
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    got = {}
    for build in ("native", "avx2"):
        out = str(tmp_path / f"{build}.npy")
        proc = subprocess.run([sys.executable, "-c", script, build, out], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got[build] = np.load(out)
    assert got["native"].size == 70 + 3 * 300 + 70 + 3 * 70 + 5 * 70 + 3 * 70 + 3 * 70
    np.testing.assert_array_equal(got["native"], got["avx2"])


def _huge_page_state(lo: int, hi: int):
    """(whether every mapping over [lo, hi) is advised for 2 MB pages, their AnonHugePages bytes), from smaps."""
    advised, huge, cur = True, 0, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                a, b = (int(v, 16) for v in head.split("-"))
                cur = a < hi and b > lo
            elif cur and head == "AnonHugePages:":
                huge += int(line.split()[1]) * 1024
            elif cur and head == "VmFlags:":
                advised &= "hg" in line.split()[1:]
    return advised, huge


def test_a_weight_read_twice_is_asked_into_2mb_pages():
    """The second product that reads a weight at the same address asks for its memory in 2 MB pages and collapses
    it (MADV_HUGEPAGE + MADV_COLLAPSE, native.cc HugePages): its pages are then huge, and the products unchanged."""
    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
        release = tuple(int(v) for v in os.uname().release.split(".")[:2])
    except (OSError, ValueError):
        pytest.skip("no transparent huge pages on this system")
    if "[never]" in mode or release < (6, 1):
        pytest.skip(f"transparent huge pages {mode.strip()!r} on Linux {os.uname().release}: no MADV_COLLAPSE")
    w = jax.jit(lambda k: jax.random.normal(k, (4096, 1024)).astype(jnp.bfloat16))(jax.random.key(0))  # 8 MB
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 1024)), jnp.float32)
    f = jax.jit(lambda x, w: matvec.group([(x, w, None)])[0])
    assert f"kimi_jax_{native.SYMBOLS[jnp.dtype(jnp.bfloat16)]}" in f.lower(x, w).as_text()
    H = 2 << 20
    p = w.unsafe_buffer_pointer()
    lo, hi = -(-p // H) * H, (p + w.nbytes) // H * H  # the whole 2 MB pages inside the weight
    first = np.asarray(f(x, w))
    second = np.asarray(f(x, w))
    advised, huge = _huge_page_state(lo, hi)
    assert advised and huge >= hi - lo, (advised, huge, hi - lo)
    np.testing.assert_array_equal(np.asarray(f(x, w)), first)
    np.testing.assert_array_equal(second, first)
    want = np.asarray(x, np.float64) @ np.asarray(w.astype(jnp.float32), np.float64).T
    np.testing.assert_allclose(first, want, atol=1e-5 * np.sqrt(1024), rtol=0)


def _mla_numpy(q_lat, q_pe, c, kpe, q_pos, scale):
    """Absorbed MLA attention in float64 (the reference's math): causal by absolute position."""
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    s = (np.einsum("bthr,bsr->bths", f64(q_lat), f64(c)) + np.einsum("btho,bso->bths", f64(q_pe), f64(kpe))) * scale
    S = c.shape[1]
    s = np.where(np.arange(S)[None, None, None, :] <= np.asarray(q_pos)[:, :, None, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bths,bsr->bthr", p, f64(c))


@pytest.mark.parametrize("B,T,H,R,O,S,dtype", [
    (1, 1, 8, 512, 64, 576, jnp.bfloat16),  # the benchmark model's decode step: bf16 cache, several chunks
    (1, 1, 8, 512, 64, 300, jnp.float32),
    (2, 3, 13, 72, 24, 300, jnp.float32),  # heads in groups of 8, 4, 1; columns past the last vector; 2 chunks
    (3, 1, 2, 40, 8, 37, jnp.bfloat16),  # one chunk; positions past the cache and inside it
])
def test_mla_decode_matches_numpy(B, T, H, R, O, S, dtype):
    import kernels_pallas.mla_decode as mla
    from kernels_pallas.mla_decode import native as mla_native, reference

    rng = np.random.default_rng(S + H)
    q_lat, q_pe = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((B, T, H, R), (B, T, H, O)))
    c, kpe = (jnp.asarray(rng.standard_normal(s), dtype) for s in ((B, S, R), (B, S, O)))
    q_pos = jnp.asarray(rng.integers(0, S + 4, (B, T)), jnp.int32)
    scale = (R + O) ** -0.5
    f = jax.jit(lambda *a: mla.mla_attention(*a, scale=scale, implementation="cpu_native"))
    assert f"kimi_jax_{mla_native.SYMBOLS[jnp.dtype(dtype)]}" in f.lower(q_lat, q_pe, c, kpe, q_pos).as_text()
    got = np.asarray(f(q_lat, q_pe, c, kpe, q_pos))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, _mla_numpy(q_lat, q_pe, c, kpe, q_pos, scale), atol=2e-6, rtol=0)
    # the split-cache form (what a mesh's merge takes): the log-sum-exp too, and a row that sees no slot of this
    # part of the cache gives zeros and -inf, as the reference does
    q_pos = q_pos.at[0, 0].set(-1)
    lse_f = jax.jit(lambda *a: mla_native.mla_attention(*a, scale=scale, with_lse=True))
    (u, lse), (ru, rlse) = lse_f(q_lat, q_pe, c, kpe, q_pos), reference.mla_attention(
        q_lat, q_pe, c, kpe, q_pos, scale=scale, with_lse=True)
    np.testing.assert_allclose(np.asarray(u), np.asarray(ru), atol=2e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(rlse), atol=2e-6, rtol=1e-6)
    assert np.isneginf(np.asarray(lse)[0, 0]).all() and (np.asarray(u)[0, 0] == 0).all()


def test_mla_decode_automatic_choice():
    """On CPU a decode step (few query rows) over a bfloat16 cache runs the native kernel; a float32 cache (where
    it was not faster), a prefill chunk of many rows, an int8 cache and mixed cache dtypes keep XLA's, and so does a
    run where the native kernel did not build; asking for the native kernel with an int8 cache raises, naming it."""
    import kernels_pallas.mla_decode as mla
    from kernels_pallas import cache_quant
    from kernels_pallas.mla_decode import native as mla_native

    rng = np.random.default_rng(0)
    q = lambda T: (jnp.asarray(rng.standard_normal((1, T, 4, 32)), jnp.float32),  # noqa: E731
                   jnp.asarray(rng.standard_normal((1, T, 4, 8)), jnp.float32))
    c, kpe = jnp.asarray(rng.standard_normal((1, 64, 32)), jnp.bfloat16), jnp.asarray(rng.standard_normal((1, 64, 8)))
    target = "kimi_jax_KimiMlaDecode"
    lower = lambda T, c, kpe, **kw: jax.jit(  # noqa: E731
        lambda *a: mla.mla_attention(*a, scale=0.1, **kw)).lower(*q(T), c, kpe, jnp.zeros((1, T), jnp.int32)).as_text()
    assert target in lower(1, c, kpe.astype(jnp.bfloat16))
    assert target not in lower(mla.NATIVE_ROWS + 1, c, kpe.astype(jnp.bfloat16))
    assert target not in lower(1, c.astype(jnp.float32), kpe)
    assert target in lower(1, c.astype(jnp.float32), kpe, implementation="cpu_native")
    assert target not in lower(1, c, kpe)  # bf16 latent with a float32 decoupled part: XLA's
    c8, k8 = cache_quant.quantize(c), cache_quant.quantize(kpe)
    assert target not in lower(1, c8, k8)
    with pytest.raises(KernelUnavailable, match="int8 cache"):
        lower(1, c8, k8, implementation="cpu_native")
    with mla_native.KERNEL.unavailable("turned off by this test"):
        assert target not in lower(1, c, kpe.astype(jnp.bfloat16))
