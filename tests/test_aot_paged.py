"""The paged attention kernels compiled by the real TPU and NVIDIA GPU compilers, deviceless (kimi_jax/deploy/aot.py).

K3's absorbed MLA decode (64 heads, latent 512 + 64, pages of 64 tokens, bf16) and a dense-GQA decode (32 query
on 8 kv heads of 128) over a pool of a few hundred pages at batch 8, and one chunked-prefill step over the pool.
The compiled program must hold the Pallas custom call (the kernel, not the reference, was compiled), and a decode
step's temporaries must stay below the size of the gathered cache: the kernel reads the pool through the page
table and never writes a contiguous copy. (On TPU they still hold one copy of the MLA ``kpe`` pool: XLA lays a
64-wide minor dim out transposed and relays it out for Mosaic, as for the dense cache's ``kpe``.) The default
set compiles the kernels for v5p and H200; the other chips, and the serving engine's whole decode step (50 s a
chip), are ``-m slow``.
"""

import jax
import jax.numpy as jnp
import pytest

import kernels_pallas.paged_attention as paged_api
from tests.test_aot import TARGETS

S = jax.ShapeDtypeStruct
BF, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
N_PAGES, PAGE, P = 520, 64, 64  # a 520-page pool; 64-page (4096-token) tables


def _mla(B, T, H):
    f = lambda ql, qp, c, kpe, pt, p: paged_api.paged_mla_attention(ql, qp, c, kpe, pt, p, scale=0.07)  # noqa: E731
    args = (S((B, T, H, 512), F32), S((B, T, H, 64), BF), S((N_PAGES, PAGE, 512), BF), S((N_PAGES, PAGE, 64), BF),
            S((B, P), I32), S((B, T), I32))
    return f, args, B * P * PAGE * (512 + 64) * 2


def _gqa(B, T, H, G):
    f = lambda q, k, v, pt, p: paged_api.paged_attention(q, k, v, pt, p, scale=0.088)  # noqa: E731
    args = (S((B, T, H, 128), BF), S((N_PAGES, PAGE, G, 128), BF), S((N_PAGES, PAGE, G, 128), BF), S((B, P), I32),
            S((B, T), I32))
    return f, args, B * P * PAGE * G * 128 * 2 * 2


CASES = {
    "k3_paged_mla_decode": _mla(8, 1, 64),
    # a 32-token prefill chunk over the cached prefix: its temporaries are query-sized (the float32 absorbed query
    # rounded to bf16, flash-decoding partials), so no bound on them
    "k3_paged_mla_chunk": (*_mla(2, 32, 64)[:2], None),
    "dense_paged_gqa_decode": _gqa(8, 1, 32, 8),
}


def _cases():
    for chip, target in TARGETS.items():
        for name in CASES:
            fast = chip in ("v5p", "h200")
            yield pytest.param(target, name, id=f"{chip}-{name}", marks=() if fast else pytest.mark.slow)


@pytest.mark.parametrize("target,name", list(_cases()))
def test_paged_kernel_compiles(target, name):
    f, args, gathered = CASES[name]
    t, compiled = _compile_kernel_and_stats(target, f, args)
    assert t.marker in compiled.as_text(), f"{name}: no Pallas kernel ({t.marker}) in the program for {target}"
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert gathered is None or temp < gathered, \
        f"{name}: {temp} bytes of temporaries, as much as a gathered cache ({gathered})"


def _compile_kernel_and_stats(target_text, f, args):
    """As tests/test_aot.py's ``_compile_kernel``, but the compiled executable (for ``memory_analysis``)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from kimi_jax.deploy import aot

    target = aot.parse_target(target_text)
    mesh = Mesh(aot.device_array(target, (1,)), ("x",))
    args = [S(a.shape, a.dtype, sharding=NamedSharding(mesh, PartitionSpec())) for a in args]
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), jax.set_mesh(mesh):
        return target, jax.jit(f).lower(*args).compile()


@pytest.mark.parametrize("target", [pytest.param(TARGETS["v5p"], marks=pytest.mark.slow),  # 50 s; the paged kernels
                                    pytest.param(TARGETS["h200"], marks=pytest.mark.slow)])  # compile in the fast set
def test_engine_decode_step_compiles(target):
    """The serving engine's decode step (kimi_jax/serving/steps.py) over the paged cache, for a full-width K3 slice
    (layers 0-3: three KDA and one MLA layer, 16 MXFP4 experts) on one device of the target: the compiler accepts the
    whole step, and the paged MLA kernel (not its reference) is in it, beside the KDA and MoE kernels."""
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from kimi_jax.model import params
    from kimi_jax.model.cache import paged_cache_shapes
    from kimi_jax.model.config import preset
    from kimi_jax.model.decoder import abstract_model
    from kimi_jax.model.run import RunConfig
    from kimi_jax.deploy import aot
    from kimi_jax.serving import steps

    cfg = preset("k3").sliced(4, 16)
    assert cfg.attn_types == ("kda", "kda", "kda", "mla")
    t = aot.parse_target(target)
    mesh = Mesh(aot.device_array(t, (1,)), ("x",))
    put = lambda a: S(a.shape, a.dtype, sharding=NamedSharding(mesh, PartitionSpec()))  # noqa: E731
    graphdef, state = nnx.split(abstract_model(cfg, RunConfig(dtype=BF)))
    state = params.fill(state, {k: put(v) for k, v in params.leaves(state).items()})
    slots, pages = 4, 16
    cache = jax.tree.map(put, paged_cache_shapes(cfg, slots, 4 * pages, PAGE, BF))
    samp = steps.SlotSampling(*(put(S((slots,), dt)) for dt in (F32, I32, F32, jnp.uint32, I32)))
    args = (put(S((slots, pages), I32)), put(S((slots,), I32)), put(S((slots,), jnp.bool_)), samp)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), jax.set_mesh(mesh):
        compiled = steps.programs(graphdef).decode_step.lower(state, cache, *args).compile()
    text = compiled.as_text()
    assert text.count(t.marker) >= 3, f"expected the paged MLA, KDA and MoE kernels in the step for {target}"
    m = compiled.memory_analysis()
    print(f"{target}: engine decode step, arguments {m.argument_size_in_bytes / 2**30:.2f} GiB, temporaries "
          f"{m.temp_size_in_bytes / 2**20:.1f} MiB")
