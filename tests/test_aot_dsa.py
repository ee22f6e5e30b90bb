"""K3.1's DSA selection compiled deviceless by the real TPU and GPU compilers (kimi_jax/deploy/aot.py) at full
K3.1 indexer shapes (32 heads x 128, top-2048) over a 128K-token bf16 key cache: the streaming form's temporaries
stay a small fraction of the reference's ``[B, T, S]`` float32 scores (a prefill chunk of 2,048 queries: 1 GiB) and
of the key cache read as float32 (a decode step of 8 sequences: 512 MiB). v5p and H200 prefill in the default set
(about 5 s and 1 s); decode, v6e and the reference's own figure ``-m slow``. ``benchmarks/aot_dsa_select.py``
writes all of them."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kernels_pallas.dsa import reference, streaming
from kimi_jax.deploy import aot
from tests.test_aot import TARGETS

S = jax.ShapeDtypeStruct
CONTEXT, H, K, TOPK = 131072, 32, 128, 2048
CASES = {"prefill": (1, 2048), "decode": (8, 1)}


def _temp(target, fn, batch, queries):
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
    return compiled.memory_analysis().temp_size_in_bytes


def _cases():
    for chip in ("v5p", "h200", "v6e"):
        for case in CASES:
            slow = chip == "v6e" or case == "decode"
            yield pytest.param(TARGETS[chip], case, id=f"{chip}-{case}", marks=pytest.mark.slow if slow else ())


@pytest.mark.parametrize("target,case", list(_cases()))
def test_streaming_selection_compiles_bounded(target, case):
    batch, queries = CASES[case]
    whole = batch * max(queries * CONTEXT * 4, CONTEXT * K * 4)  # the scores, or the keys as float32
    temp = _temp(target, streaming.select, batch, queries)
    assert temp < whole / 4, f"{target} {case}: {temp} bytes of temporaries (all scores / keys at once: {whole})"


@pytest.mark.slow
@pytest.mark.parametrize("chip", ["v5p", "h200"])
def test_reference_selection_holds_every_score(chip):
    """What the streaming form avoids: the reference's temporaries hold the whole [1, 2048, 128K] scores."""
    assert _temp(TARGETS[chip], reference.select, *CASES["prefill"]) >= 2048 * CONTEXT * 4
