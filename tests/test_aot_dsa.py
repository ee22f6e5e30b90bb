"""K3.1's DSA selection compiled deviceless by the real TPU and GPU compilers (kimi_jax/deploy/aot.py) at full
K3.1 indexer shapes (32 heads x 128, top-2048) over a 128K-token bf16 key cache: the streaming form's temporaries
stay a small fraction of the reference's ``[B, T, S]`` float32 scores (a prefill chunk of 2,048 queries: 1 GiB) and
of the key cache read as float32 (a decode step of 8 sequences: 512 MiB): the plain-XLA form (what runs on a mesh) and
the automatic choice on one chip, whose index scores are a Pallas kernel (Mosaic / Triton). In the default set: the
XLA form's H200 prefill, the kernel's v5p prefill and H200 decode (about 1, 5 and 2 s); the rest and the
reference's own figure ``-m slow``. ``benchmarks/aot_dsa_select.py`` writes the figures."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kernels_pallas import dsa
from kernels_pallas.dsa import reference, streaming
from kimi_jax.deploy import aot
from tests.test_aot import TARGETS

S = jax.ShapeDtypeStruct
CONTEXT, H, K, TOPK = 131072, 32, 128, 2048
CASES = {"prefill": (1, 2048), "decode": (8, 1)}


def _temp(target, fn, batch, queries, marker=False):
    try:
        t = aot.parse_target(target)
        mesh = Mesh(aot.device_array(t, (1,)), ("x",))
    except aot.CompilerMissing as e:  # not a pass: nothing was compiled
        pytest.skip(f"deviceless compiler for {target} not installed: {e}")
    sh = NamedSharding(mesh, PartitionSpec())
    args = [S((batch, queries, H, K), jnp.bfloat16, sharding=sh), S((batch, queries, H), jnp.float32, sharding=sh),
            S((batch, CONTEXT, K), jnp.bfloat16, sharding=sh), S((batch, queries), jnp.int32, sharding=sh)]
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), jax.set_mesh(mesh):
        compiled = jax.jit(lambda *a: fn(*a, topk=TOPK)).lower(*args).compile()
    if marker:
        assert t.marker in compiled.as_text(), f"no Pallas kernel ({t.marker}) in the program for {target}"
    return compiled.memory_analysis().temp_size_in_bytes


def _cases(fast):
    for chip in ("v5p", "h200", "v6e"):
        for case in CASES:
            yield pytest.param(TARGETS[chip], case, id=f"{chip}-{case}",
                               marks=() if (chip, case) in fast else pytest.mark.slow)


def _whole(batch, queries):
    return batch * max(queries * CONTEXT * 4, CONTEXT * K * 4)  # the scores, or the keys as float32


@pytest.mark.parametrize("target,case", list(_cases({("h200", "prefill")})))
def test_streaming_selection_compiles_bounded(target, case):
    """The plain-XLA streaming form (what runs on a mesh)."""
    temp = _temp(target, streaming.select, *CASES[case])
    assert temp < _whole(*CASES[case]) / 4, f"{target} {case}: {temp} bytes of temporaries"


@pytest.mark.parametrize("target,case", list(_cases({("v5p", "prefill"), ("h200", "decode")})))
def test_automatic_selection_is_the_pallas_kernel_and_bounded(target, case):
    """The op's automatic choice on one TPU / GPU: the streaming form with the Pallas scores kernel (Mosaic or
    Triton in the program)."""
    temp = _temp(target, dsa.select, *CASES[case], marker=True)
    assert temp < _whole(*CASES[case]) / 4, f"{target} {case}: {temp} bytes of temporaries"


@pytest.mark.slow
@pytest.mark.parametrize("chip", ["v5p", "h200"])
def test_reference_selection_holds_every_score(chip):
    """What the streaming form avoids: the reference's temporaries hold the whole [1, 2048, 128K] scores."""
    assert _temp(TARGETS[chip], reference.select, *CASES["prefill"]) >= 2048 * CONTEXT * 4
