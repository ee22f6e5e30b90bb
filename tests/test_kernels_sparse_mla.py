"""The sparse MLA op (Kimi K3.1's DSA attention, gather form: ``kernels_pallas/sparse_mla``) on CPU.

The gather-form reference against the mask form (dense scores, every unchosen position at ``-inf``) and against the
dense MLA op when every visible position is chosen; the Pallas kernel in interpret mode (GPU block rules, and the
TPU kernel's 8-row tile groups, DMAs and double buffering) against the reference; the partial results a cache split
by sequence merges; the dispatcher's choices. Rows with fewer valid entries than ``X`` (-1 padding anywhere in the
row, and a row with none) in every case.
"""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas.sparse_mla as api
from kernels_pallas import KernelUnavailable
from kernels_pallas.cache_quant import dequantize, quantize
from kernels_pallas.mla_decode import reference as dense_ref
from kernels_pallas.sparse_mla import pallas as sparse_pallas
from kernels_pallas.sparse_mla import reference as ref
from tests.parity import TOL, assert_close
from tests.sharding_run import script_on_cpu_devices

_ref = jax.jit(ref.sparse_mla_attention, static_argnames=("scale", "with_lse"))
_masked = jax.jit(ref.masked_attention, static_argnames=("scale",))


def _case(B=2, T=2, H=4, R=32, O=16, S=100, X=24, counts=(24, 5, 0, 17), dtype=jnp.float32, seed=0):
    """Operands and distinct chosen positions; row (b, t) has ``counts[b * T + t]`` valid entries, shuffled among
    -1s."""
    rng = np.random.default_rng(seed)
    f = lambda *shape, dt=dtype: jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dt)
    idx = np.full((B, T, X), -1, np.int32)
    for r, n in enumerate(counts):
        b, t = divmod(r, T)
        idx[b, t, :n] = rng.permutation(S)[:n]
        rng.shuffle(idx[b, t])
    return f(B, T, H, R, dt=jnp.float32), f(B, T, H, O), f(B, S, R), f(B, S, O), jnp.asarray(idx)


def _numpy(q_lat, q_pe, c, kpe, idx, scale):
    """float64 numpy gather form: u and lse (rows with no entry: zeros and -inf)."""
    q_lat, q_pe, c, kpe = (np.asarray(x, np.float64) for x in (q_lat, q_pe, c, kpe))
    idx = np.asarray(idx)
    B, T, H, R = q_lat.shape
    u, lse = np.zeros((B, T, H, R)), np.full((B, T, H), -np.inf)
    for b in range(B):
        for t in range(T):
            sel = idx[b, t][(idx[b, t] >= 0) & (idx[b, t] < c.shape[1])]
            if sel.size:
                s = (q_lat[b, t] @ c[b, sel].T + q_pe[b, t] @ kpe[b, sel].T) * scale  # [H, n]
                top = s.max(-1, keepdims=True)
                e = np.exp(s - top)
                u[b, t] = (e / e.sum(-1, keepdims=True)) @ c[b, sel]
                lse[b, t] = np.log(e.sum(-1)) + top[:, 0]
    return u, lse


@pytest.mark.parametrize("O", [16, 0], ids=["O16", "nope-O0"])
def test_reference_equals_mask_form_and_float64(O):
    """Gather form == mask form to float32 rounding, and both == float64 numpy; a row with no entry is zeros."""
    args = _case(O=O)
    u, lse = _ref(*args, scale=0.1, with_lse=True)
    masked = _masked(*args, scale=0.1)
    want_u, want_lse = _numpy(*args, 0.1)
    assert u.shape == args[0].shape and u.dtype == jnp.float32
    assert float(jnp.max(jnp.abs(u - masked))) <= 2e-6
    np.testing.assert_allclose(np.asarray(u), want_u, rtol=0, atol=2e-6)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), np.isfinite(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[fin], want_lse[fin], rtol=1e-6, atol=1e-5)
    assert not np.asarray(u[1, 0]).any()  # counts[2] == 0


def test_every_visible_position_chosen_is_dense_mla():
    """Context <= X: choosing every position <= q_pos (in any order, -1 elsewhere) is the dense causal MLA op."""
    B, T, H, R, O, S, X = 2, 2, 4, 32, 16, 40, 48
    q_lat, q_pe, c, kpe, _ = _case(B, T, H, R, O, S, X, counts=(0,) * 4, seed=1)
    pos = np.array([[3, 4], [30, 31]], np.int32)
    rng = np.random.default_rng(2)
    idx = np.full((B, T, X), -1, np.int32)
    for b in range(B):
        for t in range(T):
            idx[b, t, :pos[b, t] + 1] = rng.permutation(pos[b, t] + 1)
            rng.shuffle(idx[b, t])
    got = _ref(q_lat, q_pe, c, kpe, jnp.asarray(idx), scale=0.1)
    want = dense_ref.mla_attention(q_lat, q_pe, c, kpe, jnp.asarray(pos), scale=0.1)
    assert float(jnp.max(jnp.abs(got - want))) <= 2e-6


_SLOW = pytest.mark.slow  # 3-4 s each in interpret mode: the fast set keeps one GPU and one TPU case


@pytest.mark.parametrize("kind,dtype,O,kw", [
    pytest.param("gpu", jnp.float32, 16, {"block_k": 16}, marks=_SLOW, id="gpu-float32"),
    pytest.param("gpu-2splits", jnp.bfloat16, 16, {"block_k": 16, "num_splits": 2}, id="gpu-bfloat16-2splits"),
    pytest.param("gpu-nope", jnp.float32, 0, {"block_k": 16, "block_q": 16}, marks=_SLOW, id="gpu-float32-O0"),
    pytest.param("tpu", jnp.float32, 16, {"platform": "tpu", "block_k": 16}, marks=_SLOW, id="tpu-float32"),
    pytest.param("tpu-bf16-nope", jnp.bfloat16, 0, {"platform": "tpu", "block_k": 16}, id="tpu-bfloat16-O0"),
])
def test_pallas_interpret_matches_reference(kind, dtype, O, kw):
    """The kernel (interpret mode) over 2 x 2 rows with 24, 5, 0 and 17 valid entries of 40 (2 or 3 blocks of 16):
    GPU block rules (one split or two), the TPU kernel (8-row tile groups, double-buffered
    DMAs; a 100-slot cache is not a whole number of groups). Queries are cast to the cache dtype, as the kernel does."""
    q_lat, q_pe, c, kpe, idx = _case(X=40, O=O, dtype=dtype, counts=(24, 5, 0, 17), seed=3)
    f = jax.jit(lambda *a: sparse_pallas.sparse_mla_attention(*a, scale=0.1, interpret=True, with_lse=True, **kw))
    u, lse = f(q_lat, q_pe, c, kpe, idx)
    want, want_lse = _ref(q_lat.astype(dtype), q_pe, c, kpe, idx, scale=0.1, with_lse=True)
    assert u.shape == q_lat.shape and u.dtype == jnp.float32
    assert_close(u, want, TOL[jnp.dtype(dtype).name], kind)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), np.isfinite(np.asarray(want_lse)))
    fin = np.isfinite(np.asarray(want_lse))
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(want_lse)[fin], rtol=1e-3, atol=1e-3)
    assert not np.asarray(u[1, 0]).any()


_PARTIAL = {
    "reference": lambda *a: _ref(*a, scale=0.1, with_lse=True),
    "pallas-gpu": jax.jit(lambda *a: sparse_pallas.sparse_mla_attention(*a, scale=0.1, interpret=True, block_k=16,
                                                                        with_lse=True)),
}


@pytest.mark.parametrize("impl", ["reference", pytest.param("pallas-gpu", marks=_SLOW)])
def test_partial_results_merge_to_the_whole_cache(impl):
    """What ``Rule.merge`` does on a cache split by sequence: each half gets the indices shifted by its first position
    (the other half's fall outside it), returns its partial result and lse; the softmax-weighted merge equals the
    whole. Sequence 0, token 1 chose keys in one half only."""
    q_lat, q_pe, c, kpe, idx = _case(S=200, X=32, counts=(32, 9, 0, 20), seed=4)
    idx = idx.at[0, 1].set(jnp.where(idx[0, 1] >= 0, idx[0, 1] % 100, -1))
    half, f = 100, _PARTIAL[impl]
    parts = [f(q_lat, q_pe, c[:, :half], kpe[:, :half], idx), f(q_lat, q_pe, c[:, half:], kpe[:, half:], idx - half)]
    lses = np.stack([np.asarray(p[1], np.float64) for p in parts])
    assert not np.isfinite(lses[1, 0, 1]).any()  # sequence 0, token 1: nothing in the second half
    top = np.where(np.isfinite(lses.max(0)), lses.max(0), 0.0)
    w = np.exp(lses - top)
    num = sum(w[i][..., None] * np.asarray(parts[i][0], np.float64) for i in range(2))
    den = w.sum(0)[..., None]
    merged = num / np.where(den > 0, den, 1.0)
    assert_close(merged, _ref(q_lat, q_pe, c, kpe, idx, scale=0.1), TOL["float32"], f"{impl} merged halves")


def test_dispatch():
    """``pallas_interpret`` runs the kernel, ``reference`` the oracle, the automatic choice on CPU the reference; an
    int8 cache: the reference reads the chosen rows dequantized (== the mask form over the dequantized cache), the
    kernel refuses it by name."""
    q_lat, q_pe, c, kpe, idx = _case(B=1, T=1, counts=(15,), X=16, seed=5)
    want = api.sparse_mla_attention(q_lat, q_pe, c, kpe, idx, scale=0.1, implementation="reference")
    assert api.OP.choose(None, (q_lat, q_pe, c, kpe, idx)) == "reference"
    got = api.sparse_mla_attention(q_lat, q_pe, c, kpe, idx, scale=0.1, implementation="pallas_interpret")
    assert_close(got, want, TOL["float32"], "dispatch")
    qc, qk = quantize(c), quantize(kpe)
    int8 = api.sparse_mla_attention(q_lat, q_pe, qc, qk, idx, scale=0.1)
    assert_close(int8, _masked(q_lat, q_pe, dequantize(qc), dequantize(qk), idx, scale=0.1), 1e-5, "int8 reference")
    with pytest.raises(KernelUnavailable, match="int8"):
        api.sparse_mla_attention(q_lat, q_pe, qc, qk, idx, scale=0.1, implementation="pallas_interpret")


_SEQ_SPLIT = textwrap.dedent("""
    import jax, jax.numpy as jnp
    import kernels_pallas.sparse_mla as api
    from kernels_pallas._dispatch import split_axes
    from kimi_jax.parallel import sharding
    from tests.test_kernels_sparse_mla import _case
    assert jax.device_count() == 4, jax.devices()
    errs = {}
    args = _case(B=2, T=2, H=4, S=256, X=48, counts=(48, 9, 0, 30), seed=6)
    want = api.sparse_mla_attention(*args, scale=0.1, implementation="reference")
    for mesh_sizes in ((1, 1, 4), (1, 2, 2)):
        place = sharding.Parallel(sharding.make_mesh(*mesh_sizes), sharding.TP_EP).placement
        for impl in (None, "reference", "pallas_interpret"):
            f = jax.jit(lambda *a: api.sparse_mla_attention(*a, scale=0.1, implementation=impl, placement=place))
            errs[f"{mesh_sizes}-{impl}"] = float(jnp.max(jnp.abs(f(*args) - want)))
        errs[f"{mesh_sizes}-split"] = {k: list(v) for k, v in split_axes(api.RULE, place, args).items()}
    print("ERRS", errs)
""")


@pytest.mark.slow  # a subprocess with 4 CPU devices: ~10 s
def test_cache_split_by_sequence_on_four_cpu_devices():
    """The op with the default layout on 4 CPU devices: the cache positions split over ``model`` (4, or 2 beside
    expert=2, which takes the batch), each device attending over the chosen entries in its slice, the partials merged;
    every implementation equals the unsharded reference."""
    errs = script_on_cpu_devices(_SEQ_SPLIT, 4)
    assert errs["(1, 1, 4)-split"] == {"S": ["model"]}, errs
    assert errs["(1, 2, 2)-split"] == {"B": ["expert"], "S": ["model"]}, errs
    values = {k: v for k, v in errs.items() if not k.endswith("split")}
    assert len(values) == 6 and max(values.values()) <= TOL["float32"], values


def _paged(c, kpe, page_size, seed):
    """The contiguous caches ``[B, S, ...]`` cut into pages of a shared pool in a shuffled order (plus 3 spare pages),
    and the page table that reads them back."""
    B, S = c.shape[:2]
    P = S // page_size
    rng = np.random.default_rng(seed)
    order = rng.permutation(B * P + 3)[:B * P]
    table = jnp.asarray(order.reshape(B, P), jnp.int32)

    def pool(x):
        pages = np.zeros((B * P + 3, page_size, x.shape[-1]), np.float32)
        pages[order] = np.asarray(x, np.float32).reshape(B * P, page_size, -1)
        return jnp.asarray(pages).astype(x.dtype)
    return pool(c), pool(kpe), table


# the paged kernel runs fast in tests/test_kernels_shapes.py (GPU rules)
@pytest.mark.parametrize("platform", [pytest.param("gpu", marks=_SLOW), pytest.param("tpu", marks=_SLOW)])
def test_paged_equals_static_cache(platform):
    """The paged op (pages of 16 in a shuffled pool) == the static-cache reference on the same logical cache, for its
    reference and its kernel (interpret mode); entries past the table's positions are no key."""
    q_lat, q_pe, c, kpe, idx = _case(S=96, X=32, counts=(32, 7, 0, 20), seed=7)
    idx = idx.at[1, 1, 0].set(96)  # one past the 6-page table: no key, as -1
    c_pages, kpe_pages, table = _paged(c, kpe, 16, seed=8)
    want = _ref(q_lat, q_pe, c, kpe, jnp.where(idx < 96, idx, -1), scale=0.1)
    got_ref = api.paged_sparse_mla_attention(q_lat, q_pe, c_pages, kpe_pages, table, idx, scale=0.1,
                                             implementation="reference")
    assert float(jnp.max(jnp.abs(got_ref - want))) <= 2e-6
    f = jax.jit(lambda *a: sparse_pallas.paged_sparse_mla_attention(*a, scale=0.1, platform=platform,
                                                                     interpret=True, block_k=16))
    assert_close(f(q_lat, q_pe, c_pages, kpe_pages, table, idx), want, TOL["float32"], f"paged {platform}")
