"""Every kernel op in Pallas interpret mode against its reference, at the awkward shapes of tests/kernel_shapes.py
(latent ranks and head dims of 24, 40, 72; 1, 3 and 5 heads; KDA head dims 32 and 48; 3, 5 and 6 experts): values,
not only compiles. The kernels pad such dims to their blocks and must slice the padding back off.

``pallas_interpret`` runs the kernels with the GPU (Triton) block rules, which pad head dims to powers of two; the
TPU (Mosaic) block rules, which take whole dims instead, run in interpret mode through each op's Pallas entry with
``platform="tpu"``. Operands are float32, so the tolerance is the float32 one of tests/parity.py. The default set is
the covering set ``FAST`` with the GPU rules and a few cases with the TPU rules; the cross product is ``-m slow``.
"""

import functools
import logging

import jax
import jax.numpy as jnp
import pytest

import kernels_pallas.attention as attn_api
import kernels_pallas.kda as kda_api
import kernels_pallas.mla_decode as mla_api
import kernels_pallas.moe_gmm as moe_api
import kernels_pallas.paged_attention as paged_api
import kernels_pallas.qmatmul as qmatmul_api
import kernels_pallas.sparse_mla as sparse_api
from kernels_pallas import KernelUnavailable, _dispatch
from kernels_pallas._dispatch import INTERPRET
from tests import kernel_shapes as ks
from tests.parity import TOL, assert_close
from tests.test_kernels_lowering import DEVICES, _mesh

BF = jnp.bfloat16

OPS = [attn_api.OP, mla_api.OP, paged_api.MLA_OP, paged_api.GQA_OP, sparse_api.OP, sparse_api.PAGED_OP, kda_api.PREFILL,
       kda_api.DECODE, moe_api.GMM, moe_api.GATHER, qmatmul_api.OP]
# With the TPU rules, one case of each op (the GPU rules' padding is where the bugs were; these keep the Mosaic
# paths' whole-dim blocks honest at the same sizes; sparse_mla's TPU kernel runs fast in test_kernels_sparse_mla.py).
TPU_FAST = {"gqa-prefill-H3-G1-K40-T19-S19", "mla-prefill-H1-K16-O8-U24-T19", "mla_decode-H3-R24-O8-T1-S100",
            "paged_mla-H3-R24-O8-T1", "paged_gqa-H5-G5-K24-T2", "kda_prefill-H5-D48-T37", "kda_decode-H3-D32-T1",
            "gmm-mxfp4-E5-J40-I96-M40", "gather-float-E6-X3-J24-I96-N2", "qmatmul-int4-g32-M5-J40-I96",
            *(c.name for c in ks.FAST if not c.gpu)}  # what the GPU kernels refuse, the TPU ones must compute


def _params(rules):
    for case in ks.FAST + ks.SLOW:
        slow = case not in ks.FAST or (rules == "tpu" and case.name not in TPU_FAST)
        yield pytest.param(case, id=case.name, marks=pytest.mark.slow if slow else ())


@pytest.fixture
def tpu_rules(monkeypatch):
    """``pallas_interpret`` with the TPU block rules: each op's interpret entry called with ``platform="tpu"``, and
    the shapes it refuses judged for the TPU kernel."""
    for op in OPS:
        pallas, refuses = op.impls[INTERPRET], op.pallas_unsupported
        monkeypatch.setitem(op.impls, INTERPRET,
                            lambda *a, _fn=pallas, platform, **kw: _fn(*a, platform="tpu", **kw))
        monkeypatch.setattr(op, "pallas_unsupported", lambda platform, *a, _fn=refuses, **kw: _fn("tpu", *a, **kw))


def _check(case, rules="gpu"):
    args = ks.operands(case, jnp.float32)
    if rules == "gpu" and not case.gpu:  # a size the GPU kernel cannot block: refused by name, before tracing
        with pytest.raises(KernelUnavailable, match=r"cannot run here: .*\(.*\d.*\)"):
            case.run(*args, implementation="pallas_interpret")
        return
    got = jax.jit(functools.partial(case.run, implementation="pallas_interpret"))(*args)
    want = jax.jit(functools.partial(case.run, implementation="reference"))(*args)
    got, want = ks.leaves(got), ks.leaves(want)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"{case.name}: result {i} has shape {g.shape}, the reference {w.shape}"
        assert_close(g, w, TOL["float32"], f"{case.name} result {i}")


@pytest.mark.parametrize("case", list(_params("gpu")))
def test_interpret_matches_reference(case):
    _check(case)


@pytest.mark.parametrize("case", list(_params("tpu")))
def test_interpret_tpu_rules_match_reference(case, tpu_rules):
    _check(case, "tpu")


@pytest.mark.parametrize("case", [c for c in ks.FAST if not c.gpu], ids=lambda c: c.name)
def test_gpu_kernel_refuses_by_name(case, caplog, monkeypatch):
    """Sizes the GPU kernel cannot block (a page of 8 tokens, int4 groups of 48 columns): on a GPU the automatic
    choice runs the reference and logs why, once; an explicit ``pallas`` raises KernelUnavailable naming the shape."""
    args = [jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), a) for a in ks.operands(case, BF)]
    device, platform, marker = DEVICES["cuda"]
    monkeypatch.setattr(_dispatch, "_logged", set())  # the reason is logged once per process: from here
    with _mesh(device):
        with pytest.raises(KernelUnavailable, match=r"implementation='pallas' cannot run here: .*\(.*\d.*\)"):
            jax.jit(functools.partial(case.run, implementation="pallas")).trace(*args)
        with caplog.at_level(logging.INFO, logger=_dispatch.__name__):
            for _ in range(2):
                text = jax.jit(case.run).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert marker not in text, f"{case.name}: the automatic choice compiled the GPU kernel it cannot block"
    said = [r.getMessage() for r in caplog.records if "passes over its Pallas kernel" in r.getMessage()]
    assert len(said) == 1 and "runs the reference" in said[0], caplog.text
