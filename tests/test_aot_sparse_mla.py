"""The sparse MLA kernel (Kimi K3.1's DSA attention, ``kernels_pallas/sparse_mla``) compiled by the real TPU and NVIDIA
GPU compilers, deviceless (kimi_jax/deploy/aot.py), at full K3.1 decode shapes: batch 8, one query token, 96 heads,
latent 512 + 64, a 32K-token bf16 cache, 2048 chosen positions per query.

The compiled program must hold the Pallas custom call (the kernel, not the reference, was compiled), and its
temporaries must stay below the size of the latent cache: the kernel reads the chosen rows (on TPU their 8-row
groups) where they lie and never writes a gathered or contiguous copy. (On TPU they still hold one copy of the
``kpe`` cache: XLA lays a 64-wide minor dim out transposed and relays it out for Mosaic, as for the dense kernel.)
The same over a paged cache (a shared pool of 64-token pages and a page table), and a verify step of 8 query tokens.
v5p and H200 in the default set (about 5 s and 2 s); the NoPE form (O = 0), the paged form, T = 8 and v6e / H100,
``-m slow``.
``benchmarks/aot_sparse_mla.py`` writes the compilers' figures beside the dense kernel's.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import kernels_pallas.sparse_mla as api
from kimi_jax.deploy import aot
from tests.test_aot import TARGETS

S = jax.ShapeDtypeStruct
BF, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
B, H, R, CONTEXT, TOPK = 8, 96, 512, 32768, 2048


PAGE = 64
N_PAGES = B * CONTEXT // PAGE + 8  # the same positions in a shared pool of 64-token pages, a few spare


def _args(O, paged=False, T=1):
    q = (S((B, T, H, R), F32), S((B, T, H, O), BF))
    if paged:
        return (*q, S((N_PAGES, PAGE, R), BF), S((N_PAGES, PAGE, O), BF), S((B, CONTEXT // PAGE), I32),
                S((B, T, TOPK), I32))
    return (*q, S((B, CONTEXT, R), BF), S((B, CONTEXT, O), BF), S((B, T, TOPK), I32))


def _cases():
    for chip in ("v5p", "h200", "v6e", "h100"):
        for O, paged, T in ((64, False, 1), (0, False, 1), (64, True, 1), (64, False, 8)):
            fast = chip in ("v5p", "h200") and (O, paged, T) == (64, False, 1)
            name = f"{chip}-O{O}{'-paged' if paged else ''}{f'-T{T}' if T > 1 else ''}"
            yield pytest.param(TARGETS[chip], O, paged, T, id=name, marks=() if fast else pytest.mark.slow)


@pytest.mark.parametrize("target,O,paged,T", list(_cases()))
def test_sparse_mla_decode_compiles(target, O, paged, T):
    try:
        t = aot.parse_target(target)
        mesh = Mesh(aot.device_array(t, (1,)), ("x",))
    except aot.CompilerMissing as e:  # not a pass: nothing was compiled
        pytest.skip(f"deviceless compiler for {target} not installed: {e}")
    args = [S(a.shape, a.dtype, sharding=NamedSharding(mesh, PartitionSpec())) for a in _args(O, paged, T)]
    op = api.paged_sparse_mla_attention if paged else api.sparse_mla_attention
    f = lambda *a: op(*a, scale=192 ** -0.5)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), jax.set_mesh(mesh):
        compiled = jax.jit(f).lower(*args).compile()
    assert t.marker in compiled.as_text(), f"no Pallas kernel ({t.marker}) in the program for {target}"
    temp = compiled.memory_analysis().temp_size_in_bytes
    latent = B * CONTEXT * R * 2
    assert temp < latent, f"{temp} bytes of temporaries, as much as the latent cache ({latent})"
    print(f"{target} O={O} paged={paged} T={T}: temporaries {temp / 2**20:.1f} MiB")
