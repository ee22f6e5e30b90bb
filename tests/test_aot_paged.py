"""The paged attention kernels compiled by the real TPU and NVIDIA GPU compilers, deviceless (kimi_jax/parallel/aot.py).

K3's absorbed MLA decode (64 heads, latent 512 + 64, pages of 64 tokens, bf16) and a dense-GQA decode (32 query
on 8 kv heads of 128) over a pool of a few hundred pages at batch 8, and one chunked-prefill step over the pool.
The compiled program must hold the Pallas custom call (the kernel, not the reference, was compiled), and a decode
step's temporaries must stay below the size of the gathered cache: the kernel reads the pool through the page
table and never writes a contiguous copy. (On TPU they still hold one copy of the MLA ``kpe`` pool: XLA lays a
64-wide minor dim out transposed and relays it out for Mosaic, as for the dense cache's ``kpe``.) The default
set compiles for v5p and H200; the other chips are ``-m slow``.
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

    from kimi_jax.parallel import aot

    target = aot.parse_target(target_text)
    mesh = Mesh(aot.device_array(target, (1,)), ("x",))
    args = [S(a.shape, a.dtype, sharding=NamedSharding(mesh, PartitionSpec())) for a in args]
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), jax.set_mesh(mesh):
        return target, jax.jit(f).lower(*args).compile()
