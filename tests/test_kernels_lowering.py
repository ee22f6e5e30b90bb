"""Kernels lowered for TPU (Mosaic) and GPU (Triton) from this CPU machine, and the implementation policy.

Lowering runs Pallas's own block-shape and lowering rules (JAX_NOTES §1.5): an abstract TPU / H100 device in an
abstract mesh makes the package APIs pick their Pallas kernels automatically, so these tests check both the
dispatch and that every kernel lowers at K3's real head sizes (KDA 128, MLA nope 128 + rope 64, latent 512 + 64,
expert 3072 x 3584 in MXFP4). What they cannot check: Mosaic's layout passes, the VMEM budget and Triton's PTX
step, which run later inside the TPU/GPU compilers (benchmarks/gpu_kernels.py does that on a GPU).
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

import kernels_pallas.attention as attn_api
import kernels_pallas.kda as kda_api
import kernels_pallas.mla_decode as mla_api
import kernels_pallas.moe_gmm as moe_api
import kernels_pallas.paged_attention as paged_api
import kernels_pallas.sparse_mla as sparse_api
from kernels_pallas import KernelUnavailable
from kernels_pallas._dispatch import Op
from kernels_pallas._dispatch import target_platform
from kernels_pallas.mxfp4 import MXFP4Weight

DEVICES = {
    "tpu": (AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu"), "tpu", "tpu_custom_call"),
    "cuda": (AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"), "cuda",
             "__gpu$xla.gpu.triton"),
}
S = jax.ShapeDtypeStruct
BF, F32, I32, U8 = jnp.bfloat16, jnp.float32, jnp.int32, jnp.uint8


def _mesh(device):
    return use_abstract_mesh(AbstractMesh((1,), ("x",), axis_types=(AxisType.Auto,), abstract_device=device))


def _lower(target, f, *args):
    """Lowered text of ``f`` for ``target`` and the number of Pallas custom calls in it."""
    device, platform, marker = DEVICES[target]
    with _mesh(device):
        txt = jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    return txt.count(marker)


B = 2
KERNELS = {
    # causal GQA prefill, 8 query heads on 2 kv heads, head dim 128
    "gqa_prefill": (lambda q, k, v, p: attn_api.attention(q, k, v, p, scale=0.1),
                    (S((B, 256, 8, 128), BF), S((B, 256, 2, 128), BF), S((B, 256, 2, 128), BF), S((B, 256), I32))),
    # decode over a 4096-slot static cache
    "gqa_decode": (lambda q, k, v, p: attn_api.attention(q, k, v, p, scale=0.1),
                   (S((B, 1, 8, 128), BF), S((B, 4096, 2, 128), BF), S((B, 4096, 2, 128), BF), S((B, 1), I32))),
    # MLA prefill with K3's split dims: nope 128 + rope 64 (192 is not a power of two), v 128
    "mla_prefill": (lambda q, k, v, p, qpe, kpe: attn_api.attention(q, k, v, p, scale=0.1, q_pe=qpe, k_pe=kpe),
                    (S((B, 128, 4, 128), BF), S((B, 128, 4, 128), BF), S((B, 128, 4, 128), BF), S((B, 128), I32),
                     S((B, 128, 4, 64), BF), S((B, 128, 64), BF))),
    # absorbed MLA decode over K3's latent cache (512 + 64 per token)
    "mla_decode": (lambda ql, qp, c, kpe, p: mla_api.mla_attention(ql, qp, c, kpe, p, scale=0.07),
                   (S((B, 1, 16, 512), F32), S((B, 1, 16, 64), BF), S((B, 2048, 512), BF), S((B, 2048, 64), BF),
                    S((B, 1), I32))),
    # the same over a paged cache: 40 pages of 64 tokens in the pool, a 16-page table per sequence
    "paged_mla_decode": (lambda ql, qp, c, kpe, pt, p: paged_api.paged_mla_attention(ql, qp, c, kpe, pt, p, scale=0.07),
                         (S((B, 1, 16, 512), F32), S((B, 1, 16, 64), BF), S((40, 64, 512), BF), S((40, 64, 64), BF),
                          S((B, 16), I32), S((B, 1), I32))),
    # K3.1's sparse MLA: 256 chosen positions of the 2048-slot latent cache per query
    "sparse_mla_decode": (lambda ql, qp, c, kpe, i: sparse_api.sparse_mla_attention(ql, qp, c, kpe, i, scale=0.07),
                          (S((B, 1, 16, 512), F32), S((B, 1, 16, 64), BF), S((B, 2048, 512), BF),
                           S((B, 2048, 64), BF), S((B, 1, 256), I32))),
    "paged_gqa_decode": (lambda q, k, v, pt, p: paged_api.paged_attention(q, k, v, pt, p, scale=0.1),
                         (S((B, 1, 8, 128), BF), S((40, 64, 2, 128), BF), S((40, 64, 2, 128), BF), S((B, 16), I32),
                          S((B, 1), I32))),
    "kda_prefill": (lambda q, k, v, g, b, s: kda_api.kda_prefill(q, k, v, g, b, s, scale=0.088),
                    (S((B, 128, 2, 128), F32), S((B, 128, 2, 128), F32), S((B, 128, 2, 128), BF),
                     S((B, 128, 2, 128), F32), S((B, 128, 2), F32), S((B, 2, 128, 128), F32))),
    "kda_decode": (lambda q, k, v, g, b, s: kda_api.kda_decode(q, k, v, g, b, s, scale=0.088),
                   (S((B, 1, 2, 128), F32), S((B, 1, 2, 128), F32), S((B, 1, 2, 128), BF), S((B, 1, 2, 128), F32),
                    S((B, 1, 2), F32), S((B, 2, 128, 128), F32))),
    # K3 expert up-projection (3072 x 3584) in MXFP4, prefill-shaped and decode-shaped
    "gmm_mxfp4": (lambda x, wp, ws, gs: moe_api.gmm(x, MXFP4Weight(wp, ws), gs, compute_dtype=BF),
                  (S((256, 3584), BF), S((8, 3072, 1792), U8), S((8, 3072, 112), U8), S((8,), I32))),
    "gather_mxfp4": (lambda x, wp, ws, i: moe_api.gather_matmul(x, MXFP4Weight(wp, ws), i, compute_dtype=BF),
                     (S((2, 16, 3584), BF), S((32, 3072, 1792), U8), S((32, 3072, 112), U8), S((2, 16), I32))),
    "gmm_bf16": (lambda x, w, gs: moe_api.gmm(x, w, gs), (S((256, 1024), BF), S((8, 512, 1024), BF), S((8,), I32))),
}


@pytest.mark.parametrize("target", ["tpu", "cuda"])
@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_lowers(name, target):
    f, args = KERNELS[name]
    assert _lower(target, f, *args) >= 1, f"{name}: no Pallas kernel in the {target} lowering"


@pytest.mark.parametrize("target", ["tpu", "cuda"])
def test_whole_k3_model_lowers_with_kernels(target):
    """Tiny K3 (6 KDA, 3 MLA, 8 MXFP4 MoE layers), bf16, abstract parameters: the automatic choice on an
    accelerator puts a Pallas kernel at every KDA, MLA and expert matmul, for cached prefill and decode."""
    from kimi_jax.model import config
    from kimi_jax.model.cache import cache_shapes
    from kimi_jax.model.decoder import abstract_model
    from kimi_jax.model.run import RunConfig

    cfg = config.from_dict(config.tiny_k3_config_dict())
    gdef, state = nnx.split(abstract_model(cfg, RunConfig(dtype=BF)))
    cache = cache_shapes(cfg, 2, 64, BF)
    n_kda, n_mla = cfg.attn_types.count("kda"), cfg.attn_types.count("mla")
    expected = n_kda + n_mla + 3 * cfg.ffn_types.count("moe")
    for prefix, T in [(False, 16), (True, 1)]:
        f = lambda st, ids, c: nnx.merge(gdef, st)(ids, cache=c, prefix=prefix).logits  # noqa: B023
        assert _lower(target, f, state, S((2, T), I32), cache) == expected, ("decode" if prefix else "prefill")


def test_automatic_choice_and_explicit_requests():
    assert target_platform() == "cpu"
    op = Op("op", None, {"reference": None, "pallas": None})  # "pallas_interpret" comes with "pallas"
    assert op.choose(None) == "reference"  # CPU: the oracle
    assert op.choose("pallas_interpret") == "pallas_interpret"
    with pytest.raises(KernelUnavailable, match="pallas_interpret"):
        op.choose("pallas")  # never a silent fallback
    with pytest.raises(KernelUnavailable, match="choose from"):
        op.choose("triton")
    for target, platform in [("tpu", "tpu"), ("cuda", "gpu")]:
        with _mesh(DEVICES[target][0]):
            assert target_platform() == platform
            assert op.choose(None) == "pallas"
            assert op.choose("reference") == "reference"


def test_package_apis_refuse_compiled_pallas_on_cpu():
    q = jnp.zeros((1, 2, 2, 16))
    with pytest.raises(KernelUnavailable, match="attention.*pallas_interpret"):
        attn_api.attention(q, q, q, jnp.zeros((1, 2), jnp.int32), scale=1.0, implementation="pallas")
    with pytest.raises(KernelUnavailable, match="kda_decode"):
        kda_api.kda_decode(q, q, q, q, jnp.zeros((1, 2, 2)), jnp.zeros((1, 2, 16, 16)), scale=1.0,
                           implementation="pallas")
    with pytest.raises(KernelUnavailable, match="moe_gmm"):
        moe_api.gmm(jnp.zeros((4, 16)), jnp.zeros((2, 16, 16)), jnp.array([2, 2]), implementation="pallas")
