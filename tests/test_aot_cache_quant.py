"""int8 caches through the real TPU and GPU compilers, deviceless (kimi_jax/deploy/aot.py).

* every attention kernel over int8 rows at K3's head sizes (latent 512 + rope 64; GQA head dim 128) compiles for a
  TPU v6e and an H200, and the compiled program holds the Pallas custom call (the kernel, not the reference);
  full K3 decode shapes (96 heads, 128K cache) and a v5e in the slow set;
* (slow) a whole decode step of a K3 slice with an MLA layer, compiled for a v6e: the compiler's argument bytes drop
  by exactly what ``cache_bytes`` says the int8 cache and the bf16 KDA state save.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import kernels_pallas.attention as attn_api
import kernels_pallas.mla_decode as mla_api
import kernels_pallas.paged_attention as paged_api
from kernels_pallas.cache_quant import Int8Rows
from kimi_jax.deploy import aot

S = jax.ShapeDtypeStruct
BF, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
R8 = Int8Rows.shapes


def _cases(B, H, S_, pages):
    return {
        "mla_decode": (lambda ql, qp, c, kpe, p: mla_api.mla_attention(ql, qp, c, kpe, p, scale=0.07),
                       (S((B, 1, H, 512), F32), S((B, 1, H, 64), BF), R8((B, S_, 512)), R8((B, S_, 64)),
                        S((B, 1), I32))),
        "paged_mla_decode": (lambda ql, qp, c, kpe, pt, p: paged_api.paged_mla_attention(ql, qp, c, kpe, pt, p,
                                                                                         scale=0.07),
                             (S((B, 1, H, 512), F32), S((B, 1, H, 64), BF), R8((pages, 64, 512)), R8((pages, 64, 64)),
                              S((B, S_ // 64), I32), S((B, 1), I32))),
        "paged_gqa_decode": (lambda q, k, v, pt, p: paged_api.paged_attention(q, k, v, pt, p, scale=0.1),
                             (S((B, 1, 8, 128), BF), R8((pages, 64, 2, 128)), R8((pages, 64, 2, 128)),
                              S((B, S_ // 64), I32), S((B, 1), I32))),
        "gqa_decode": (lambda q, k, v, p: attn_api.attention(q, k, v, p, scale=0.1),
                       (S((B, 1, 8, 128), BF), R8((B, S_, 2, 128)), R8((B, S_, 2, 128)), S((B, 1), I32))),
    }


SMALL = _cases(2, 16, 1024, 40)
FULL = _cases(8, 96, 131072, 8 * 2048)  # one device's share of K3 decode at batch 8 over a 128K cache


def _params():
    for target in ("tpu:v6e:1x1", "gpu:h200:1x1x1", "tpu:v5e:1x1"):
        for size, cases in (("small", SMALL), ("k3", FULL)):
            for name in cases:
                fast = size == "small" and target != "tpu:v5e:1x1"
                marks = [] if fast else [pytest.mark.slow]
                if size == "k3" and target.startswith("tpu"):
                    # Known: Mosaic takes the [.., S, 1] float32 scales in a lane-padded tiled layout, so XLA copies
                    # them (128x their bytes) into temporaries; the fix is lane-dense [.., 1, S] scale blocks
                    # folded into scores / probabilities on the TPU path (see the issue #20 report).
                    marks.append(pytest.mark.xfail(reason="TPU relayouts the [.., S, 1] scales", strict=True))
                yield pytest.param(target, size, name, id=f"{target.split(':')[1]}-{size}-{name}", marks=marks)


@pytest.mark.parametrize("target,size,name", list(_params()))
def test_int8_cache_kernel_compiles(target, size, name):
    f, args = (SMALL if size == "small" else FULL)[name]
    t = aot.parse_target(target)
    mesh = Mesh(aot.device_array(t, (1,)), ("x",))
    args = jax.tree.map(lambda a: S(a.shape, a.dtype, sharding=NamedSharding(mesh, PartitionSpec())), args)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), jax.set_mesh(mesh):
        compiled = jax.jit(f).lower(*args).compile()
    assert t.marker in compiled.as_text(), f"{name}: no Pallas kernel ({t.marker}) compiled for {target}"
    # the kernel reads the int8 cache in place: no dense (bf16 / f32) copy of it among the temporaries
    cache = sum(x.size * x.dtype.itemsize for a in args for x in jax.tree.leaves(a) if x.ndim >= 3 and
                x.dtype in (jnp.int8,))
    assert compiled.memory_analysis().temp_size_in_bytes < cache, (name, compiled.memory_analysis())


@pytest.mark.slow
def test_k3_slice_decode_step_arguments_shrink_as_cache_bytes_says():
    """K3's first 4 layers (3 KDA + 1 MLA, 16 experts) at batch 8 over a 4096-token cache, compiled for one v6e:
    argument bytes with the int8 cache (and the bf16 KDA state) = the float cache's minus cache_bytes' saving."""
    from kimi_jax.model import config as C
    from kimi_jax.model.cache import cache_bytes
    from kimi_jax.deploy import plan

    cfg = C.preset("k3").sliced(4, 16)
    assert "mla" in cfg.attn_types
    mesh = aot.target_mesh(aot.parse_target("tpu:v6e:1x1"))
    kw = dict(batch=8, context=4096, dtype="bfloat16")
    base = plan.compile_step(cfg, mesh, **kw)
    full = cache_bytes(cfg, 8, 4096, jnp.bfloat16)["total"]
    for opts in (dict(kv_cache="int8"), dict(kv_cache="int8", kda_state="bfloat16")):
        r = plan.compile_step(cfg, mesh, **kw, **opts)
        saved = full - cache_bytes(cfg, 8, 4096, jnp.bfloat16, **opts)["total"]
        assert saved > 0 and base["argument"] - r["argument"] == saved, (opts, base["argument"], r["argument"], saved)
        assert r["pallas_calls"] == base["pallas_calls"], (base["pallas_calls"], r["pallas_calls"])
        print(f"{opts}: arguments {base['argument'] / 1e9:.4f} -> {r['argument'] / 1e9:.4f} GB "
              f"(cache_bytes saving {saved / 1e9:.4f} GB)")
