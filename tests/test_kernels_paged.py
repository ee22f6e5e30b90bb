"""Paged attention kernels (interpret mode on CPU) against the paged references, and the references against the
dense ones on the equivalent contiguous cache.

Page tables are what a serving engine makes: pages shuffled through the pool, out of order, one page shared by
two sequences (a cached prefix), entries past a sequence's length naming arbitrary (even NaN-filled) pages, and
sequences of very different lengths in one batch. Both kernel variants run: the GPU-style one (Triton block
rules, the ``pallas_interpret`` implementation) and the TPU-style one (scalar-prefetched page table, page steps
as a sequential grid axis).
"""

import functools
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas.paged_attention as paged_api
from kernels_pallas.attention import reference as attn_ref
from kernels_pallas.mla_decode import reference as mla_ref
from kernels_pallas.paged_attention import pallas as paged_pallas
from kernels_pallas.paged_attention import reference as paged_ref
from tests.parity import TOL, assert_close
from tests.sharding_run import script_on_cpu_devices

DTYPES = [jnp.float32, jnp.bfloat16]
_mla_ref = jax.jit(paged_ref.paged_mla_attention, static_argnames=("scale",))
_gqa_ref = jax.jit(paged_ref.paged_attention, static_argnames=("scale",))


def _normal(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)


def _table(rng, n_pages, ps, P, lengths):
    """A page table ``[B, P]`` for sequences of ``lengths`` tokens: the needed pages drawn shuffled from the pool
    (so out of order), sequence 1 sharing sequence 0's first page (a cached prefix), entries past each length
    naming arbitrary pages. Returns the table and the set of pages some sequence needs."""
    B = len(lengths)
    need = [-(-n // ps) for n in lengths]
    pool = iter(rng.permutation(n_pages))
    pt = rng.integers(0, n_pages, (B, P))  # entries past the length: any page, used ones included
    for b in range(B):
        for j in range(need[b]):
            pt[b, j] = next(pool)
    if B > 1 and need[0] and need[1]:
        pt[1, 0] = pt[0, 0]
    used = {int(pt[b, j]) for b in range(B) for j in range(need[b])}
    return jnp.asarray(pt, jnp.int32), used


def _positions(lengths, T):
    """Query positions ``[B, T]``: the last T tokens of each sequence (chunked prefill; T = 1 is decode)."""
    return jnp.asarray([[max(n - T + t, 0) for t in range(T)] for n in lengths], jnp.int32)


def _contiguous(pages, pt):
    """The contiguous cache ``[B, P * ps, ...]`` a page table describes, by an explicit loop (not the reference's
    gather)."""
    pages, pt = np.asarray(pages.astype(jnp.float32)), np.asarray(pt)
    out = np.stack([np.concatenate([pages[p] for p in row]) for row in pt])
    return jnp.asarray(out)


def _mla_case(dtype, T, ps, seed, R=64, O=16, H=4, P=5):
    rng = np.random.default_rng(seed)
    lengths = [1, 2 * ps + 3, P * ps]  # one token, a page and a bit, the whole table
    n = 3 * P + 2
    pt, _ = _table(rng, n, ps, P, lengths)
    B = len(lengths)
    q_lat = _normal(rng, (B, T, H, R), jnp.float32)  # the caller absorbs in float32
    q_pe, c = _normal(rng, (B, T, H, O), dtype), _normal(rng, (n, ps, R), dtype)
    kpe = _normal(rng, (n, ps, O), dtype)
    return q_lat, q_pe, c, kpe, pt, _positions(lengths, T)


def _gqa_case(dtype, T, ps, seed, H=4, G=2, K=32, U=16, P=5):
    rng = np.random.default_rng(seed)
    lengths = [P * ps, 3, ps + 1]
    n = 3 * P + 2
    pt, _ = _table(rng, n, ps, P, lengths)
    B = len(lengths)
    q = _normal(rng, (B, T, H, K), dtype)
    k, v = _normal(rng, (n, ps, G, K), dtype), _normal(rng, (n, ps, G, U), dtype)
    return q, k, v, pt, _positions(lengths, T)


# -- the references -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("ps", [16, 64])
def test_references_equal_dense_on_the_contiguous_cache(ps):
    """Paged reference == dense reference over the cache the table describes (shared and shuffled pages)."""
    q_lat, q_pe, c, kpe, pt, pos = _mla_case(jnp.float32, 3, ps, seed=0)
    want = mla_ref.mla_attention(q_lat, q_pe, _contiguous(c, pt), _contiguous(kpe, pt), pos, scale=0.1)
    assert_close(_mla_ref(q_lat, q_pe, c, kpe, pt, pos, scale=0.1), want, 1e-5, "paged MLA reference")
    q, k, v, pt, pos = _gqa_case(jnp.float32, 3, ps, seed=1)
    want = attn_ref.attention(q, _contiguous(k, pt), _contiguous(v, pt), pos, scale=0.2)
    assert_close(_gqa_ref(q, k, v, pt, pos, scale=0.2), want, 1e-5, "paged GQA reference")


# -- the kernels ----------------------------------------------------------------------------------------------


def _mla_kernel(q_lat, q_pe, c, kpe, pt, pos, platform, **kw):
    """GPU style through the op entry (the dispatcher's ``pallas_interpret``); TPU style by a direct call."""
    if platform == "gpu":
        f = functools.partial(paged_api.paged_mla_attention, scale=0.1, implementation="pallas_interpret")
    else:
        f = functools.partial(paged_pallas.paged_mla_attention, scale=0.1, platform="tpu", interpret=True, **kw)
    return jax.jit(f)(q_lat, q_pe, c, kpe, pt, pos)


def _gqa_kernel(q, k, v, pt, pos, platform, **kw):
    if platform == "gpu":
        f = functools.partial(paged_api.paged_attention, scale=0.2, implementation="pallas_interpret")
    else:
        f = functools.partial(paged_pallas.paged_attention, scale=0.2, platform="tpu", interpret=True, **kw)
    return jax.jit(f)(q, k, v, pt, pos)


CASES = [pytest.param(p, d, T, ps, id=f"{p}-{jnp.dtype(d).name}-T{T}-page{ps}")
         for p in ("gpu", "tpu") for d in DTYPES for T in (1, 3) for ps in (16, 64)
         if p == "gpu" or T == 3]


@pytest.mark.parametrize("platform,dtype,T,ps", CASES)
def test_paged_mla(platform, dtype, T, ps):
    q_lat, q_pe, c, kpe, pt, pos = _mla_case(dtype, T, ps, seed=2)
    got = _mla_kernel(q_lat, q_pe, c, kpe, pt, pos, platform)
    # the kernel multiplies in the cache dtype: compare against the reference fed the same rounded query
    want = _mla_ref(q_lat.astype(dtype), q_pe, c, kpe, pt, pos, scale=0.1)
    assert got.dtype == jnp.float32 and got.shape == want.shape
    assert_close(got, want, TOL[jnp.dtype(dtype).name], "paged MLA")


@pytest.mark.parametrize("platform,dtype,T,ps", CASES)
def test_paged_gqa(platform, dtype, T, ps):
    q, k, v, pt, pos = _gqa_case(dtype, T, ps, seed=3)
    got = _gqa_kernel(q, k, v, pt, pos, platform)
    want = _gqa_ref(q, k, v, pt, pos, scale=0.2)
    assert got.dtype == jnp.float32 and got.shape == want.shape
    assert_close(got, want, TOL[jnp.dtype(dtype).name], "paged GQA")


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_pages_past_the_need_are_never_read(platform):
    """Pages only named past every sequence's last needed page are filled with NaN: the kernels never read them
    (the reference, which gathers everything, gets the same answer from a table naming clean pages there)."""
    q_lat, q_pe, c, kpe, pt, pos = _mla_case(jnp.float32, 2, 16, seed=4)
    n, ps = c.shape[:2]
    need = np.asarray(pos).max(axis=1) // ps + 1  # pages each sequence can see
    used = {int(pt[b, j]) for b in range(pt.shape[0]) for j in range(need[b])}
    spare = sorted(set(range(n)) - used)
    past = np.arange(pt.shape[1])[None] >= need[:, None]
    pt_nan = jnp.where(past, spare[0], pt)
    c_nan, kpe_nan = c.at[spare[0]].set(jnp.nan), kpe.at[spare[0]].set(jnp.nan)
    got = _mla_kernel(q_lat, q_pe, c_nan, kpe_nan, pt_nan, pos, platform, pages_per_step=2)
    assert_close(got, _mla_ref(q_lat, q_pe, c, kpe, pt, pos, scale=0.1), TOL["float32"], "NaN pages past the need")
    q, k, v, pt, pos = _gqa_case(jnp.float32, 1, 16, seed=5)
    need = np.asarray(pos).max(axis=1) // 16 + 1
    past = np.arange(pt.shape[1])[None] >= need[:, None]
    spare = sorted(set(range(k.shape[0])) - {int(pt[b, j]) for b in range(3) for j in range(need[b])})
    got = _gqa_kernel(q, k.at[spare[0]].set(jnp.nan), v.at[spare[0]].set(jnp.nan), jnp.where(past, spare[0], pt),
                      pos, platform)
    assert_close(got, _gqa_ref(q, k, v, pt, pos, scale=0.2), TOL["float32"], "GQA NaN pages past the need")


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_rows_that_see_no_key_are_zero(platform):
    """A query row at position -1 (an idle slot) sees no key: zeros, not NaN; the other sequences are unaffected."""
    q_lat, q_pe, c, kpe, pt, pos = _mla_case(jnp.float32, 1, 16, seed=6)
    pos = pos.at[1].set(-1)
    got = np.asarray(_mla_kernel(q_lat, q_pe, c, kpe, pt, pos, platform))
    np.testing.assert_array_equal(got[1], 0.0)
    want = _mla_ref(q_lat, q_pe, c, kpe, pt, pos, scale=0.1)
    assert_close(got[[0, 2]], np.asarray(want)[[0, 2]], TOL["float32"], "other sequences")


def test_gpu_splits_and_tpu_page_steps():
    """Flash-decoding splits and pages per loop step (GPU), several pages per grid step (TPU), including a step
    only partly needed."""
    q_lat, q_pe, c, kpe, pt, pos = _mla_case(jnp.float32, 1, 16, seed=7, P=7)
    want = _mla_ref(q_lat, q_pe, c, kpe, pt, pos, scale=0.1)
    for kw in (dict(num_splits=3, pages_per_step=1), dict(num_splits=2, pages_per_step=2), dict(num_splits=7)):
        got = jax.jit(lambda *a, kw=kw: paged_pallas.paged_mla_attention(*a, scale=0.1, interpret=True, **kw))(
            q_lat, q_pe, c, kpe, pt, pos)
        assert_close(got, want, TOL["float32"], f"GPU {kw}")
    for ppb in (1, 3, 7):
        got = _mla_kernel(q_lat, q_pe, c, kpe, pt, pos, "tpu", pages_per_step=ppb)
        assert_close(got, want, TOL["float32"], f"TPU {ppb} pages per step")


def test_pallas_refuses_cpu_and_reference_dispatch():
    from kernels_pallas import KernelUnavailable

    q, k, v, pt, pos = _gqa_case(jnp.float32, 1, 16, seed=8)
    with pytest.raises(KernelUnavailable, match="paged_attention.*pallas_interpret"):
        paged_api.paged_attention(q, k, v, pt, pos, scale=0.2, implementation="pallas")
    assert_close(paged_api.paged_attention(q, k, v, pt, pos, scale=0.2), _gqa_ref(q, k, v, pt, pos, scale=0.2), 1e-6)


# -- sharded ---------------------------------------------------------------------------------------------------

_SHARDED = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType
    import kernels_pallas.paged_attention as api
    from kernels_pallas._dispatch import Placement
    from tests.test_kernels_paged import _gqa_case, _mla_case
    assert jax.device_count() == 4, jax.devices()
    mesh = jax.make_mesh((4,), ("model",), axis_types=(AxisType.Auto,))
    place = Placement(mesh, (("heads", ("model",)),))
    errs = []
    args = _mla_case(jnp.float32, 2, 16, seed=9, H=8)
    f = lambda impl, p: jax.jit(lambda *a: api.paged_mla_attention(*a, scale=0.1, implementation=impl, placement=p))
    errs.append(float(jnp.max(jnp.abs(f("pallas_interpret", place)(*args) - f("reference", None)(*args)))))
    args = _gqa_case(jnp.float32, 2, 16, seed=10, H=8, G=4)
    g = lambda impl, p: jax.jit(lambda *a: api.paged_attention(*a, scale=0.2, implementation=impl, placement=p))
    errs.append(float(jnp.max(jnp.abs(g("pallas_interpret", place)(*args) - g("reference", None)(*args)))))
    print("ERRS", errs)
""")


def test_sharded_over_heads_on_four_cpu_devices():
    """Query heads (and GQA kv heads with their pages' head axis) split over 4 devices inside shard_map, the pool
    and page table whole on each: the kernel on each shard equals the unsharded reference."""
    errs = script_on_cpu_devices(_SHARDED, 4)
    assert max(errs) <= TOL["float32"], errs
