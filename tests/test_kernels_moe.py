"""Pallas MoE kernels (interpret mode on CPU) against the references, and MXFP4 kept packed in memory.

The grouped-matmul reference (``lax.ragged_dot``) equals the XLA:CPU form the automatic choice runs on CPU, and its
gradients equal those of a per-group loop (training differentiates it).

The grouped matmul sees ragged groups including empty ones and rows past ``sum(group_sizes)``; the gathered
(decode) kernel sees repeated experts. MXFP4 weights are decoded inside the kernels; the decode is checked bit
for bit against compressed-tensors (the library that wrote K3's experts) on random bytes and on the fixture's
real expert tensors, and the loaded fixture model is checked to hold its experts at ~0.53 bytes per weight.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kernels_pallas.moe_gmm as moe_api
import kimi_jax
from kernels_pallas.moe_gmm import pallas as moe_pallas
from kernels_pallas.moe_gmm import reference as moe_ref
from kernels_pallas.moe_gmm import xla_cpu as moe_cpu
from kernels_pallas.mxfp4 import MXFP4Weight
from tests.parity import TOL, assert_close

E, N, K = 6, 48, 64
_gmm_ref = jax.jit(moe_ref.gmm, static_argnames=("compute_dtype",))
_gather_ref = jax.jit(moe_ref.gather_matmul, static_argnames=("compute_dtype",))


def _weights(kind, rng, e=E, n=N, k=K):
    if kind == "mxfp4":
        return MXFP4Weight(jnp.asarray(rng.integers(0, 256, (e, n, k // 2)), jnp.uint8),
                           jnp.asarray(rng.integers(118, 126, (e, n, k // 32)), jnp.uint8))
    return jnp.asarray(rng.standard_normal((e, n, k)) * 0.2, jnp.float32)


def _tol(dtype, want):
    # MXFP4 weights reach |w| = 6 * 2^-2: outputs of O(10-100); compare at the dtype's tolerance relative to that.
    return TOL[jnp.dtype(dtype).name] * max(1.0, float(jnp.abs(want).max()) / 4)


@pytest.mark.parametrize(
    "kind,dtype", [("dense", jnp.float32), ("dense", jnp.bfloat16), ("mxfp4", jnp.float32), ("mxfp4", jnp.bfloat16)],
    ids=["dense-float32", "dense-bfloat16", "mxfp4-float32", "mxfp4-bfloat16"])
def test_gmm_ragged_groups(kind, dtype):
    """Groups 3, 0, 17, 1, 0, 0 (two empty groups, one spanning two row tiles), 24 rows of which 21 are used."""
    rng = np.random.default_rng(0)
    w = _weights(kind, rng)
    x = jnp.asarray(rng.standard_normal((24, K)), jnp.float32)
    gs = jnp.array([3, 0, 17, 1, 0, 0], jnp.int32)
    got = jax.jit(lambda *a: moe_api.gmm(*a, compute_dtype=dtype, implementation="pallas_interpret"))(x, w, gs)
    want = _gmm_ref(x, w, gs, compute_dtype=dtype)
    assert got.shape == (24, N) and got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got[21:]), 0.0)  # rows past sum(group_sizes)
    assert_close(got, want, _tol(dtype, want), f"gmm {kind}")


@pytest.mark.parametrize(
    "kind,dtype", [("dense", jnp.float32), ("dense", jnp.bfloat16), ("mxfp4", jnp.float32), ("mxfp4", jnp.bfloat16)],
    ids=["dense-float32", "dense-bfloat16", "mxfp4-float32", "mxfp4-bfloat16"])
@pytest.mark.parametrize("capacity", [None, 4], ids=["batched", "overflow"])
def test_reference_gmm_equals_xla_cpu_form(kind, dtype, capacity):
    """The XLA:CPU form (the capacity-batched product, 8 rows per group by default here; with capacity 4 most rows of
    the 17-row group overflow into the tile loop; MXFP4: the tile loop only) against the ragged_dot reference, with
    two empty groups and 3 rows past the groups."""
    rng = np.random.default_rng(5)
    w = _weights(kind, rng)
    x = jnp.asarray(rng.standard_normal((24, K)), jnp.float32)
    gs = jnp.array([3, 0, 17, 1, 0, 0], jnp.int32)
    want = _gmm_ref(x, w, gs, compute_dtype=dtype)
    got = jax.jit(lambda *a: moe_cpu.gmm(*a, compute_dtype=dtype, tile=8, capacity=capacity))(x, w, gs)
    np.testing.assert_array_equal(np.asarray(want[21:]), 0.0)
    err = assert_close(got, want, _tol(dtype, want), f"xla_cpu gmm {kind}")
    print(f"{kind} {jnp.dtype(dtype).name} capacity={capacity}: max |xla_cpu - reference| {err:.3g}")


def test_gmm_automatic_on_cpu_is_the_xla_cpu_form():
    x, w, gs = jnp.ones((4, K)), jnp.ones((E, N, K)), jnp.array([4] + [0] * (E - 1), jnp.int32)
    assert moe_api.GMM.choose(None, (x, w, gs)) == "xla_cpu"
    assert moe_api.GMM.choose("reference", (x, w, gs)) == "reference"
    np.testing.assert_array_equal(np.asarray(moe_api.gmm(x, w, gs, implementation="xla_cpu")),
                                  np.asarray(moe_api.gmm(x, w, gs)))


def test_reference_gmm_gradients_equal_a_per_group_loop():
    """d/dx and d/dw of the reference against the same product written as one matmul per (static) group; rows past
    the groups get no gradient."""
    rng = np.random.default_rng(6)
    w = _weights("dense", rng)
    x = jnp.asarray(rng.standard_normal((24, K)), jnp.float32)
    sizes = [3, 0, 17, 1, 0, 0]
    ct = jnp.asarray(rng.standard_normal((24, N)), jnp.float32)

    def loop(x, w):
        starts = np.cumsum([0] + sizes)
        parts = [x[a:b] @ w[e].T for e, (a, b) in enumerate(zip(starts[:-1], starts[1:]))]
        return jnp.concatenate(parts + [jnp.zeros((24 - starts[-1], N))])

    ref = lambda x, w: moe_ref.gmm(x, w, jnp.asarray(sizes, jnp.int32))  # noqa: E731
    got = jax.jit(jax.grad(lambda x, w: jnp.sum(ref(x, w) * ct), argnums=(0, 1)))(x, w)
    want = jax.grad(lambda x, w: jnp.sum(loop(x, w) * ct), argnums=(0, 1))(x, w)
    for g, h, what in zip(got, want, ("dx", "dw")):
        err = assert_close(g, h, TOL["float32"], f"reference gmm {what}")
        print(f"reference gmm {what}: max |diff| vs the per-group loop {err:.3g}")
    np.testing.assert_array_equal(np.asarray(got[0][21:]), 0.0)


def test_gmm_decode_shaped_many_experts():
    """Few rows, many experts (mostly empty groups): only the used tiles do any work, the rest write zeros."""
    rng = np.random.default_rng(1)
    w = _weights("mxfp4", rng, e=16)
    x = jnp.asarray(rng.standard_normal((4, K)), jnp.float32)
    gs = jnp.zeros(16, jnp.int32).at[jnp.array([2, 9, 15])].set(jnp.array([1, 2, 1]))
    got = jax.jit(lambda *a: moe_pallas.gmm(*a, compute_dtype=jnp.bfloat16, interpret=True, block_n=16))(x, w, gs)
    want = _gmm_ref(x, w, gs, compute_dtype=jnp.bfloat16)
    assert_close(got, want, _tol(jnp.bfloat16, want), "decode-shaped gmm")


@pytest.mark.parametrize(
    "kind,dtype", [("dense", jnp.float32), ("dense", jnp.bfloat16), ("mxfp4", jnp.float32), ("mxfp4", jnp.bfloat16)],
    ids=["dense-float32", "dense-bfloat16", "mxfp4-float32", "mxfp4-bfloat16"])
def test_gather_matmul(kind, dtype):
    """3 tokens x 2 experts each, one token choosing the same expert twice; 32-wide K blocks (2 steps)."""
    rng = np.random.default_rng(2)
    w = _weights(kind, rng)
    x = jnp.asarray(rng.standard_normal((3, 2, K)), jnp.float32)
    idx = jnp.array([[0, 2], [5, 5], [1, 3]], jnp.int32)
    got = jax.jit(lambda *a: moe_api.gather_matmul(*a, compute_dtype=dtype, implementation="pallas_interpret"))(
        x, w, idx)
    want = _gather_ref(x, w, idx, compute_dtype=dtype)
    assert got.shape == (3, 2, N)
    assert_close(got, want, _tol(dtype, want), f"gather_matmul {kind}")


def test_tpu_variants_in_interpret():
    """The TPU kernels (scalar-prefetched expert ids choosing the weight block, one-hot scale expansion)."""
    rng = np.random.default_rng(3)
    w = _weights("mxfp4", rng, n=128)
    x = jnp.asarray(rng.standard_normal((24, K)), jnp.float32)
    gs = jnp.array([3, 0, 17, 1, 0, 2], jnp.int32)
    got = jax.jit(lambda *a: moe_pallas.gmm(*a, compute_dtype=jnp.float32, platform="tpu", interpret=True))(x, w, gs)
    want = _gmm_ref(x, w, gs, compute_dtype=jnp.float32)
    assert_close(got, want, _tol(jnp.float32, want), "TPU-style gmm")
    xg, idx = x[:6].reshape(3, 2, K), jnp.array([[0, 2], [5, 5], [1, 3]], jnp.int32)
    got = jax.jit(lambda *a: moe_pallas.gather_matmul(*a, compute_dtype=jnp.float32, platform="tpu",
                                                      interpret=True))(xg, w, idx)
    want = _gather_ref(xg, w, idx, compute_dtype=jnp.float32)
    assert_close(got, want, _tol(jnp.float32, want), "TPU-style gather_matmul")


def _kernel_decoded(packed, scale):
    """The weights exactly as the kernel decodes them: gmm of the identity gives W^T."""
    n, kh = packed.shape
    x = jnp.eye(2 * kh, dtype=jnp.float32)
    w = MXFP4Weight(jnp.asarray(packed)[None], jnp.asarray(scale)[None])
    out = moe_pallas.gmm(x, w, jnp.array([2 * kh], jnp.int32), compute_dtype=jnp.float32, interpret=True,
                         block_n=16, block_k=32)
    return np.asarray(out).T


def test_in_kernel_decode_is_bit_exact_vs_compressed_tensors(k3_tiny_a):
    from kimi_jax.checkpoint.safetensors import Checkpoint
    from tests.test_mxfp4 import ct_decompress

    rng = np.random.default_rng(4)
    packed = rng.integers(0, 256, (32, 32)).astype(np.uint8)
    packed[0] = np.arange(32) * 8 + 7  # every code in both nibbles, including 8 (-0)
    scale = rng.integers(90, 160, (32, 2)).astype(np.uint8)
    np.testing.assert_array_equal(_kernel_decoded(packed, scale), ct_decompress(packed, scale))
    ckpt = Checkpoint(k3_tiny_a)
    name = "language_model.model.layers.1.block_sparse_moe.experts.3.w1"
    packed, scale = ckpt.get(name + ".weight_packed"), ckpt.get(name + ".weight_scale")
    assert (packed & 0xF == 8).any(), "the fixture tensor should contain -0 codes"
    np.testing.assert_array_equal(_kernel_decoded(packed, scale), ct_decompress(packed, scale))


def test_loaded_k3_experts_stay_packed(k3_tiny_a):
    """Every routed-expert weight of the loaded fixture is a uint8 device array: 0.5 byte of codes + 1/32 byte
    of scale per weight (0.53125), with no dense copy anywhere in the model state."""
    model = kimi_jax.from_pretrained(k3_tiny_a, dtype="bfloat16")
    logical = stored = 0
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = [str(p) for p in path]
        if "experts" not in names or "shared_experts" in names:
            continue
        w = var.get_value()
        assert isinstance(w, MXFP4Weight), f"{'.'.join(names)} is {type(w).__name__}"
        for arr in w:
            assert isinstance(arr, jax.Array) and arr.dtype == jnp.uint8, f"{'.'.join(names)} holds {arr.dtype}"
            stored += sum(s.data.nbytes for s in arr.addressable_shards)
        logical += 2 * w.packed.size
    cfg = model.cfg
    moe_layers = sum(f == "moe" for f in cfg.ffn_types)
    expected_logical = moe_layers * cfg.moe.num_experts * 3 * cfg.moe.expert_intermediate * cfg.moe.expert_in
    assert logical == expected_logical
    assert stored / logical == pytest.approx(0.53125)
    print(f"routed experts: {logical} weights in {stored} bytes = {stored / logical:.5f} bytes/weight")
