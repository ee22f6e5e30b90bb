"""The whole model with every Pallas kernel switched on (``implementation="pallas_interpret"``) against the
reference path and against oracles we did not write, float32.

* K3 fixture (KDA with lower-bounded gate, MLA, MXFP4 LatentMoE): a right-padded batch (lengths 24 and 17)
  through a cached prefill -- KDA chunked kernel, MLA flash kernel with split rope dims, grouped-matmul MoE
  decoding MXFP4 in-kernel -- then incremental decode steps at different positions per sequence -- KDA recurrent
  kernel, absorbed MLA kernel over the latent cache, gathered MoE kernel. Every logit equals the reference path's,
  and sequence 0 equals the fixture's golden prefill and decode logits (Moonshot's own code).
* HF Kimi Linear tiny model (softplus KDA gate, MLA with rope dims, dense-weight MoE): prefill logits vs HF
  transformers and vs the reference path, over 70 tokens (several kernel chunks).
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import kimi_jax
from kimi_jax.model.cache import init_cache
from tests.parity import TOL, assert_close

STEPS = 4


def _run(model, ids, lengths, feed, max_len):
    """Cached prefill of ``ids`` (right-padded to ``lengths``), then one decode step per column of ``feed``.
    Returns (prefill logits [B, T, V], decode logits [B, steps, V])."""
    B = ids.shape[0]
    prefill = nnx.jit(lambda m, x, n, c: m(x, cache=c, lengths=n))
    step = nnx.jit(lambda m, x, c: m(x, cache=c, prefix=True))
    out = prefill(model, jnp.asarray(ids), jnp.asarray(lengths), init_cache(model.cfg, B, max_len, jnp.float32))
    logits, cache, steps = out.logits, out.cache, []
    for j in range(feed.shape[1]):
        out = step(model, jnp.asarray(feed[:, j : j + 1]), cache)
        cache = out.cache
        steps.append(np.asarray(out.logits[:, 0]))
    return np.asarray(logits), np.stack(steps, 1)


# -m slow (CI time: 36-56 s on 2 cores): every K3 kernel stays in the default set on its own against its reference
# (tests/test_kernels_*.py) and compiled in the sharded model for TPU and GPU (tests/test_aot_sharded.py); the whole
# model with every kernel (interpret mode) in the default set is Kimi Linear's prefill below
@pytest.mark.slow
def test_k3_prefill_and_decode_with_all_kernels(k3_tiny_a, k3_golden):
    g = k3_golden
    ids = np.array(g["input_ids"])
    lengths = np.array([24, 17], np.int32)
    ids[1, 17:] = 0  # right padding
    # decode feeds: sequence 0 follows the golden greedy continuation; sequence 1 some other tokens
    feed = np.stack([g["greedy_tokens"][0, :STEPS], g["greedy_tokens"][1, 3 : 3 + STEPS]]).astype(np.int32)
    ref = _run(kimi_jax.from_pretrained(k3_tiny_a, dtype="float32", implementation="reference"), ids, lengths, feed, 32)
    ker = _run(kimi_jax.from_pretrained(k3_tiny_a, dtype="float32", implementation="pallas_interpret"), ids, lengths,
               feed, 32)
    tol = TOL["float32"]
    assert_close(ker[0][0], ref[0][0], tol, "prefill logits, sequence 0, kernels vs reference")
    assert_close(ker[0][1, :17], ref[0][1, :17], tol, "prefill logits, padded sequence 1, kernels vs reference")
    err = assert_close(ker[1], ref[1], tol, "decode-step logits, kernels vs reference")
    gp = assert_close(ker[0][0], g["logits_prefill"][0], tol, "prefill logits vs golden")
    # golden decode_logits[:, j + 1] is the step that fed greedy_tokens[:, j]
    gd = assert_close(ker[1][0], g["decode_logits"][0, 1 : 1 + STEPS], 5e-4, "decode-step logits vs golden")
    print(f"k3-tiny-a: max |decode logits, kernels - reference| = {err:.3g}; kernels vs golden: prefill {gp:.3g}, "
          f"decode {gd:.3g}")


def test_kimi_linear_prefill_with_all_kernels(hf_kimi_linear):
    path, hf_model = hf_kimi_linear
    ids = torch.randint(0, 128, (2, 70), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hf = hf_model(ids).logits.numpy()
    fwd = nnx.jit(lambda m, x: m(x).logits)
    x = jnp.asarray(ids.numpy(), jnp.int32)
    ker = fwd(kimi_jax.from_pretrained(path, dtype="float32", implementation="pallas_interpret"), x)
    ref = fwd(kimi_jax.from_pretrained(path, dtype="float32", implementation="reference"), x)
    assert_close(ker, ref, TOL["float32"], "Kimi Linear logits, kernels vs reference")
    err = assert_close(ker, hf, TOL["float32"], "Kimi Linear logits, kernels vs HF transformers")
    print(f"kimi-linear tiny: max |logits, kernels - HF| = {err:.3g}")
