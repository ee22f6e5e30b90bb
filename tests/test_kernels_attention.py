"""Pallas attention kernels (interpret mode on CPU) against the plain-jnp references.

Covers causal GQA prefill with lengths that are not a multiple of the blocks, decode over a static cache with a
different length per sequence (the kernel must not read past each row's position), flash-decoding splits, explicit
key positions, MLA prefill with split nope/rope dims, and absorbed MLA over the latent cache. Both the GPU-style
(Triton block rules, the ``pallas_interpret`` implementation) and the TPU-style (Mosaic block rules) kernels run.
"""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas.attention as attn_api
import kernels_pallas.mla_decode as mla_api
from kernels_pallas.attention import pallas as attn_pallas
from kernels_pallas.attention import reference as attn_ref
from kernels_pallas.mla_decode import pallas as mla_pallas
from kernels_pallas.mla_decode import reference as mla_ref
from kernels_pallas.mla_decode import xla_cpu as mla_xla_cpu
from tests.parity import TOL, assert_close
from tests.sharding_run import script_on_cpu_devices

DTYPES = [jnp.float32, jnp.bfloat16]
_attn_ref = jax.jit(attn_ref.attention, static_argnames=("scale",))
_mla_ref = jax.jit(mla_ref.mla_attention, static_argnames=("scale",))


def _keys(seed, n):
    # numpy draws: no per-shape compiles in the test's own setup
    return [np.random.default_rng([seed, i]) for i in range(n)]


def _normal(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)


def _qkv(B, T, H, G, K, U, S, dtype, seed=0):
    ks = _keys(seed, 3)
    return _normal(ks[0], (B, T, H, K), dtype), _normal(ks[1], (B, S, G, K), dtype), _normal(ks[2], (B, S, G, U), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_gqa_prefill_awkward_length(dtype):
    """T = 37 rows of 2 heads per kv group: neither rows (74) nor keys (37) fill whole blocks."""
    q, k, v = _qkv(2, 37, 4, 2, 16, 8, 37, dtype)
    pos = jnp.broadcast_to(jnp.arange(37, dtype=jnp.int32), (2, 37))
    got = jax.jit(lambda *a: attn_api.attention(*a, scale=0.25, implementation="pallas_interpret"))(q, k, v, pos)
    want = _attn_ref(q, k, v, pos, scale=0.25)
    assert got.dtype == jnp.float32 and got.shape == (2, 37, 4, 8)
    assert_close(got, want, TOL[jnp.dtype(dtype).name], "GQA prefill")


@pytest.mark.parametrize("dtype,splits", [(jnp.float32, 1), (jnp.bfloat16, 3)],
                         ids=["float32-1split", "bfloat16-3splits"])
def test_decode_over_static_cache_per_sequence_lengths(dtype, splits):
    """Sequences at positions 5 and 97 of a 100-slot cache; slots past a row's position hold junk that must not
    leak in (the kernel skips those blocks entirely, or masks them)."""
    B, T, H, G, S = 2, 2, 8, 2, 100
    q, k, v = _qkv(B, T, H, G, 32, 16, S, dtype, seed=1)
    # junk beyond sequence 0's positions: any leak would dominate the softmax
    k = k.at[0, 7:].set(1e4)
    pos = jnp.array([[5, 6], [97, 98]], jnp.int32)
    got = jax.jit(lambda *a: attn_pallas.attention(*a, scale=0.2, interpret=True, block_k=16, num_splits=splits))(
        q, k, v, pos)
    want = _attn_ref(q, k, v, pos, scale=0.2)
    assert_close(got, want, TOL[jnp.dtype(dtype).name], f"decode, {splits} splits")


def test_explicit_key_positions():
    """k_pos given: keys stored out of order are masked by their own positions (padding slots at 10**6)."""
    q, k, v = _qkv(2, 5, 2, 1, 16, 16, 24, jnp.float32, seed=2)
    k_pos = np.full((2, 24), 10**6)
    k_pos[0] = np.random.default_rng(3).permutation(24)
    k_pos[1, :9] = np.arange(9)
    pos = jnp.array([[3, 7, 11, 20, 23], [0, 2, 4, 6, 8]], jnp.int32)
    got = jax.jit(lambda *a: attn_api.attention(*a[:4], scale=0.3, k_pos=a[4], implementation="pallas_interpret"))(
        q, k, v, pos, jnp.asarray(k_pos, jnp.int32))
    assert_close(got, _attn_ref(q, k, v, pos, scale=0.3, k_pos_BS=k_pos), TOL["float32"], "k_pos")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_mla_prefill_split_rope_dims(dtype):
    """MLA expanded form: per-head nope keys plus one shared rope key row, scored as two dot products; the
    reference with the same split equals the concatenated-192-dims attention."""
    B, T, H, N, O, U = 2, 21, 3, 32, 16, 32
    ks = _keys(4, 5)
    q, k = _normal(ks[0], (B, T, H, N), dtype), _normal(ks[1], (B, T, H, N), dtype)
    v = _normal(ks[2], (B, T, H, U), dtype)
    qpe, kpe = _normal(ks[3], (B, T, H, O), dtype), _normal(ks[4], (B, T, O), dtype)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    got = jax.jit(lambda *a: attn_api.attention(*a[:4], scale=0.15, q_pe=a[4], k_pe=a[5],
                                                implementation="pallas_interpret"))(q, k, v, pos, qpe, kpe)
    want = _attn_ref(q, k, v, pos, scale=0.15, q_pe_BTHO=qpe, k_pe_BSO=kpe)
    concat = _attn_ref(jnp.concatenate([q, qpe], -1),
                                jnp.concatenate([k, jnp.broadcast_to(kpe[:, :, None], (B, T, H, O))], -1), v, pos,
                                scale=0.15)
    assert_close(want, concat, 1e-5, "split reference vs concatenated")
    assert_close(got, want, TOL[jnp.dtype(dtype).name], "MLA prefill")


@pytest.mark.parametrize("dtype,splits", [(jnp.float32, 1), (jnp.bfloat16, 2)],
                         ids=["float32-1split", "bfloat16-2splits"])
def test_mla_absorbed_decode(dtype, splits):
    """Absorbed MLA over a latent cache (R = 64, O = 16), 2 query tokens x 4 heads, lengths 3 and 60 of 72 slots."""
    B, T, H, R, O, S = 2, 2, 4, 64, 16, 72
    ks = _keys(5, 4)
    q_lat = _normal(ks[0], (B, T, H, R), jnp.float32)  # the caller absorbs in float32
    q_pe, c = _normal(ks[1], (B, T, H, O), dtype), _normal(ks[2], (B, S, R), dtype)
    kpe = _normal(ks[3], (B, S, O), dtype)
    pos = jnp.array([[3, 4], [60, 61]], jnp.int32)
    scale = 0.05
    got = jax.jit(lambda *a: mla_pallas.mla_attention(*a, scale=scale, interpret=True, block_k=16,
                                                      num_splits=splits))(q_lat, q_pe, c, kpe, pos)
    # the kernel multiplies in the cache dtype: compare against the reference fed the same rounded query
    want = _mla_ref(q_lat.astype(dtype), q_pe, c, kpe, pos, scale=scale)
    assert got.shape == (B, T, H, R)
    assert_close(got, want, TOL[jnp.dtype(dtype).name], "MLA absorbed decode")


def test_mla_api_dispatch_interpret():
    """The package API routes ``pallas_interpret`` to the kernel and ``reference`` to the oracle."""
    B, T, H, R, O, S = 1, 1, 2, 32, 16, 40
    ks = _keys(6, 4)
    args = (_normal(ks[0], (B, T, H, R), jnp.float32), _normal(ks[1], (B, T, H, O), jnp.float32),
            _normal(ks[2], (B, S, R), jnp.float32), _normal(ks[3], (B, S, O), jnp.float32),
            jnp.array([[33]], jnp.int32))
    got = mla_api.mla_attention(*args, scale=0.1, implementation="pallas_interpret")
    assert_close(got, mla_api.mla_attention(*args, scale=0.1, implementation="reference"), TOL["float32"], "MLA API")


def test_tpu_block_rules_in_interpret():
    """The TPU variant (key blocks as a sequential grid axis with VMEM scratch, 128-wide key blocks, 8-row blocks,
    scalar-prefetched block counts) computes the same thing: sequence 0 needs 1 of 2 key blocks, sequence 1 both."""
    q, k, v = _qkv(2, 3, 4, 2, 16, 8, 200, jnp.float32, seed=7)
    pos = jnp.array([[10, 11, 12], [190, 191, 192]], jnp.int32)
    got = jax.jit(lambda *a: attn_pallas.attention(*a, scale=0.25, platform="tpu", interpret=True, block_k=128))(
        q, k, v, pos)
    assert_close(got, _attn_ref(q, k, v, pos, scale=0.25), TOL["float32"], "TPU-style attention")
    B, T, H, R, O, S = 1, 1, 8, 32, 16, 256
    ks = _keys(8, 4)
    args = (_normal(ks[0], (B, T, H, R), jnp.float32), _normal(ks[1], (B, T, H, O), jnp.float32),
            _normal(ks[2], (B, S, R), jnp.float32), _normal(ks[3], (B, S, O), jnp.float32),
            jnp.array([[100]], jnp.int32))
    got = jax.jit(lambda *a: mla_pallas.mla_attention(*a, scale=0.05, platform="tpu", interpret=True,
                                                      block_k=128))(*args)
    assert_close(got, _mla_ref(*args, scale=0.05), TOL["float32"], "TPU-style MLA")


def test_fully_masked_rows_are_zero_not_nan():
    """Padding rows (no visible key) come out as zeros from the kernel, so they cannot poison later math."""
    q, k, v = _qkv(1, 2, 2, 2, 16, 16, 16, jnp.float32, seed=9)
    k_pos = jnp.full((1, 16), 100, jnp.int32)  # every key after every query
    got = attn_pallas.attention(q, k, v, jnp.array([[0, 1]], jnp.int32), scale=0.1, k_pos_BS=k_pos, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), 0.0)


# -- the partial form: a cache split by sequence over devices ------------------------------------------------------


def _mla_case(B=2, T=2, H=4, R=32, O=16, S=256, seed=11):
    ks = _keys(seed, 4)
    return (_normal(ks[0], (B, T, H, R), jnp.float32), _normal(ks[1], (B, T, H, O), jnp.float32),
            _normal(ks[2], (B, S, R), jnp.float32), _normal(ks[3], (B, S, O), jnp.float32))


def _numpy_lse(q_lat, q_pe, c, kpe, pos, scale, first):
    """log-sum-exp over the visible scores of keys at positions first..first+S-1, in float64 numpy."""
    q_lat, q_pe, c, kpe = (np.asarray(x, np.float64) for x in (q_lat, q_pe, c, kpe))
    s = (np.einsum("bthr,bsr->bths", q_lat, c) + np.einsum("btho,bso->bths", q_pe, kpe)) * scale
    visible = (first + np.arange(c.shape[1]))[None, None, None, :] <= np.asarray(pos)[:, :, None, None]
    s = np.where(visible, s, -np.inf)
    top = s.max(-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)  # rows that see no key: exp(-inf) sums to 0, log gives -inf
    with np.errstate(divide="ignore"):
        return np.log(np.exp(s - top).sum(-1)) + top[..., 0]


_PARTIAL_IMPLS = {
    "reference": lambda *a, scale: mla_ref.mla_attention(*a, scale=scale, with_lse=True),
    "xla_cpu": lambda *a, scale: mla_xla_cpu.mla_attention(*a, scale=scale, with_lse=True),
    "pallas-gpu": lambda *a, scale: mla_pallas.mla_attention(*a, scale=scale, interpret=True, block_k=32,
                                                             with_lse=True),
    "pallas-gpu-2splits": lambda *a, scale: mla_pallas.mla_attention(*a, scale=scale, interpret=True, block_k=16,
                                                                     num_splits=2, with_lse=True),
    "pallas-tpu": lambda *a, scale: mla_pallas.mla_attention(*a, scale=scale, platform="tpu", interpret=True,
                                                             block_k=128, with_lse=True),
}


@pytest.mark.parametrize("impl", list(_PARTIAL_IMPLS))
def test_mla_partial_results_merge_to_the_whole_cache(impl):
    """Each half of a 200-slot cache (keys at positions 0..99 and 100..199; query positions shifted by 100 for the
    second) gives its partial result and log-sum-exp; the lse equals numpy's over the visible scores, a query that sees
    nothing of a half gets zeros and -inf there, and the softmax-weighted merge equals attention over the whole cache.
    100 keys are not a whole number of key blocks: the kernels pad them, and sequence 1's queries (positions past
    the first half's end) must not see that padding."""
    q_lat, q_pe, c, kpe = _mla_case(S=200)
    pos = jnp.array([[3, 4], [150, 151]], jnp.int32)  # sequence 0 sees nothing of the second half
    scale, half = 0.05, 100
    f = jax.jit(lambda *a: _PARTIAL_IMPLS[impl](*a, scale=scale))
    parts = [f(q_lat, q_pe, c[:, :half], kpe[:, :half], pos), f(q_lat, q_pe, c[:, half:], kpe[:, half:], pos - half)]
    for (u, lse), first in zip(parts, (0, half)):
        assert u.shape == q_lat.shape and lse.shape == q_lat.shape[:3]
        want = _numpy_lse(q_lat, q_pe, c[:, first:first + half], kpe[:, first:first + half], pos, scale, first)
        np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), np.isfinite(want))
        fin = np.isfinite(want)
        np.testing.assert_allclose(np.asarray(lse)[fin], want[fin], rtol=1e-5, atol=1e-4)
    u1, lse1 = parts[1]
    assert not np.isfinite(np.asarray(lse1[0])).any() and not np.asarray(u1[0]).any()
    lses = np.stack([np.asarray(p[1], np.float64) for p in parts])
    top = lses.max(0)
    w = np.exp(lses - top)
    merged = sum(w[i][..., None] * np.asarray(parts[i][0], np.float64) for i in range(2)) / w.sum(0)[..., None]
    assert_close(merged, _mla_ref(q_lat, q_pe, c, kpe, pos, scale=scale), TOL["float32"], f"{impl} merged halves")


_SEQ_SPLIT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    import kernels_pallas.mla_decode as api
    from kernels_pallas._dispatch import split_axes
    from kernels_pallas.cache_quant import quantize
    from kimi_jax.parallel import sharding
    from tests.test_kernels_attention import _mla_case
    assert jax.device_count() == 4, jax.devices()
    errs = {}
    for mesh_sizes in ((1, 1, 4), (1, 2, 2)):
        mesh = sharding.make_mesh(*mesh_sizes)
        place = sharding.Parallel(mesh, sharding.TP_EP).placement
        q_lat, q_pe, c, kpe = _mla_case(B=2, T=2, H=4, S=256)
        pos = jnp.array([[3, 4], [200, 201]], jnp.int32)
        for cache in ("float32", "int8"):
            cc, kk = (c, kpe) if cache == "float32" else (quantize(c), quantize(kpe))
            want = api.mla_attention(q_lat, q_pe, cc, kk, pos, scale=0.05, implementation="reference")
            for impl in (None, "reference", "pallas_interpret"):
                f = jax.jit(lambda *a: api.mla_attention(*a, scale=0.05, implementation=impl, placement=place))
                got = f(q_lat, q_pe, cc, kk, pos)
                errs[f"{mesh_sizes}-{cache}-{impl}"] = float(jnp.max(jnp.abs(got - want)))
        # asked for the log-sum-exp too (a drafter merges it with its block's): over the whole cache, merged
        u, lse = api.mla_attention(q_lat, q_pe, c, kpe, pos - 150, scale=0.05, with_lse=True,
                                   implementation="reference")
        got_u, got_lse = jax.jit(lambda *a: api.mla_attention(*a, scale=0.05, with_lse=True, placement=place))(
            q_lat, q_pe, c, kpe, pos - 150)
        seen = np.isfinite(np.asarray(lse))
        errs[f"{mesh_sizes}-lse"] = (float(jnp.max(jnp.abs(got_u - u))), bool((np.isfinite(got_lse) == seen).all()),
                                     float(np.abs(np.asarray(got_lse - lse)[seen]).max()), int((~seen).sum()))
        split = split_axes(api.RULE, place, (q_lat, q_pe, c, kpe, pos))
        errs[f"{mesh_sizes}-split"] = {k: list(v) for k, v in split.items()}
    print("ERRS", errs)
""")


def test_mla_cache_split_by_sequence_on_four_cpu_devices():
    """The MLA op with the default layout on 4 CPU devices: the cache positions split over ``model`` (4, or 2 beside
    expert=2, which takes the batch), heads whole; every implementation (float32 and int8 caches) equals the unsharded
    reference; asked for its log-sum-exp too, that too, merged over the devices (-inf where a query sees nothing)."""
    errs = script_on_cpu_devices(_SEQ_SPLIT, 4)
    assert errs["(1, 1, 4)-split"] == {"S": ["model"]}, errs
    assert errs["(1, 2, 2)-split"] == {"B": ["expert"], "S": ["model"]}, errs
    values = {k: v for k, v in errs.items() if not k.endswith(("split", "lse"))}
    assert len(values) == 12 and max(values.values()) <= TOL["float32"], values
    for mesh_sizes in ("(1, 1, 4)", "(1, 2, 2)"):  # sequence 0 at position -147: it sees nothing (lse -inf)
        u_err, same_seen, lse_err, unseen = errs[f"{mesh_sizes}-lse"]
        assert u_err <= TOL["float32"] and same_seen and lse_err <= 1e-4 and unseen == 2 * 4, errs
