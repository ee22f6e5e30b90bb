"""The whole model against the float64 spec oracle (tests/k31_model_oracle.py): first the oracle against an
implementation we did not write (the K3 fixture's golden logits of Moonshot's own layer code), then a tiny K3.1 with
top-4 selection run by the model in float32 -- prefill, decode steps over a static cache, chunked prefill and decode
steps over a paged cache -- against the oracle. The oracle's sparse MLA is the mask form (dense scores, keys not
selected at -inf); the model's is the gather form (absorbed MLA over the chosen latent rows), so each equality is
also mask form == gathered form for the whole model.

Tolerance: the model runs in float32 and the oracle in float64, so the gap is float32 rounding, compounded layer by
layer. The oracle itself evaluated in float32 arithmetic (``dtype=np.float32``) is 2.6e-5 from its float64 self on
the tiny K3.1 below (logits of size ~5; 3.5e-6, 1.1e-5, 1.7e-5, 2.4e-5 after layers 0-3), and an independent float32
implementation shows the same: Moonshot's code in torch is 5.2e-5 from float64 on the K3 fixture's logits
(tests/fixtures/k3-tiny-a/README.md). So 1e-5 is below what float32 reaches on this model; each float32 check asserts
its error is below LOGITS_TOL = 5e-5 and below twice that measured float32 floor. A wrong selection moves logits by
more than 1e-2 (test_the_selection_is_sparse).

The 1e-5 of issue 39 is met in float64: the same checkpoint loaded with ``dtype="float64"`` (under
``jax_enable_x64``, in a subprocess so the flag stays out of this process) runs every internal in float64 (the run's
``compute_dtype``: norm statistics, SiTU, AttnRes, router, KDA gates / state / recurrence, the DSA scores, the
softmaxes, the logits; the kernels' plain-XLA forms follow their operands), and its logits -- prefill, every static
decode step, the paged chunked prefill and decode steps -- equal the oracle's within F64_TOL = 1e-9 (measured
~5e-14), far above float64 rounding and far below a single float32 rounding of the logits (~3e-7), so no internal
left in float32 passes (test_float64_prefill_and_static_decode_equal_the_oracle; the paged cache:
test_float64_paged_cache_equals_the_oracle, -m slow)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_jax.checkpoint import synthetic
from kimi_jax.checkpoint.loading import from_pretrained
from kimi_jax.model import config as C
from kimi_jax.model.cache import init_cache, paged_cache
from tests import k31_model_oracle as O
from tests import k31_oracle

LOGITS_TOL = 5e-5  # float32 model vs float64 oracle: float32's own floor here (module docstring)
ISSUE_TOL = 1e-5  # issue 39's bound: out of float32's reach on this model, met by the float64 model
F64_TOL = 1e-9  # float64 model vs float64 oracle: no internal rounds to float32 (module docstring)
TOPK = 4
T_PREFILL, T = 24, 36  # a 24-token prefill, then 12 decode steps: every query past position 3 sees > TOPK keys


# -- the oracle against the K3 fixture (an external float32 reference) ------------------------------------------


@pytest.fixture(scope="module")
def fixture_oracle(k3_tiny_a):
    return O.load(k3_tiny_a)


def test_oracle_reproduces_the_k3_fixture(fixture_oracle, k3_golden):
    """The oracle on the K3 fixture's checkpoint (MXFP4 experts decoded here) against the golden outputs of
    Moonshot's own layer code in float32: logits of the prefills (24 and 80 tokens, the latter past one KDA chunk),
    every decode step of the reference's own cache path, each layer's output, the AttnRes blocks and mixes, the
    routing."""
    cfg, tensors = fixture_oracle
    g = k3_golden
    errs = {}
    for b in range(2):
        lg, hid = O.forward(cfg, tensors, g["input_ids"][b], return_hidden=True)
        errs[f"prefill {b}"] = np.abs(lg - g["logits_prefill"][b]).max()
        full = O.forward(cfg, tensors, g["full_ids"][b])
        errs[f"teacher-forced {b}"] = np.abs(full - g["logits_full"][b]).max()
        T0 = g["input_ids"].shape[1]
        steps = full[T0 - 1:T0 - 1 + g["decode_logits"].shape[1]]  # the step that produced greedy token j
        errs[f"decode {b}"] = np.abs(steps - g["decode_logits"][b]).max()
        np.testing.assert_array_equal(steps.argmax(-1), g["greedy_tokens"][b])
        if b == 0:
            errs["layers"] = np.abs(hid["layers"] - g["layer_outputs_seq0"]).max()
            errs["blocks"] = np.abs(hid["blocks"] - g["attn_res_blocks_seq0"]).max()
            errs["output mix"] = np.abs(hid["output_mix"] - g["output_attn_res_mix_seq0"]).max()
            errs["final hidden"] = np.abs(hid["final_hidden"] - g["final_hidden_seq0"]).max()
            np.testing.assert_array_equal(np.stack([r[0] for r in hid["routes"]]), g["router_topk_idx_seq0"])
            w = np.stack([r[1] for r in hid["routes"]])
            assert np.abs(w - g["router_topk_weight_seq0"]).max() < 1e-5
    errs["long"] = np.abs(O.forward(cfg, tensors, g["input_ids_long"][0]) - g["logits_long"][0]).max()
    print({k: f"{v:.3g}" for k, v in errs.items()})
    # the fixture's float32 reference is 5.2e-5 / 1.0e-4 / 7.8e-5 / 1.3e-4 from float64 (its README): 2e-4 here
    assert max(errs.values()) < 2e-4, errs


def test_mxfp4_decoder_by_hand():
    """Spec section 5 on one byte row: low nibble first, E2M1 codes, E8M0 scale 2^(s-127), code 8 = -0."""
    packed = np.array([[0x21, 0x8F, 0x7A] + [0] * 13], np.uint8)  # 32 elements: (1, 2), (15, 8), (10, 7), zeros
    w = O.mxfp4_dequantize(packed, np.array([[126]], np.uint8))
    np.testing.assert_array_equal(w[0, :6], np.array([0.5, 1.0, -6.0, -0.0, -1.0, 6.0]) * 0.5)
    assert w.shape == (1, 32) and not np.any(w[0, 6:])


# -- a tiny K3.1, the model in float32 against the oracle ----------------------------------------------------------


def _tiny_k31_config() -> dict:
    """The tiny K3.1 cut to 4 layers (KDA + dense MLP, KDA + MoE, KDA + MoE, MLA + indexer + MoE; AttnRes blocks
    sealed at 0 and 3), top-4."""
    c = C.tiny_k31_config_dict()
    t = c["text_config"]
    t["num_hidden_layers"] = 4
    t["linear_attn_config"].update(kda_layers=[1, 2, 3], full_attn_layers=[4])
    t["dsa_config"].update(index_topk=TOPK, dsa_layers=[4])
    return c


@pytest.fixture(scope="module")
def k31(tmp_path_factory):
    """(checkpoint dir, model in float32, oracle cfg, oracle tensors, ids [2, T], oracle logits [2, T, V], the float32
    floor: max |oracle in float32 arithmetic - oracle in float64|)."""
    path = str(tmp_path_factory.mktemp("k31_oracle"))
    synthetic.write_checkpoint(path, "k3.1", config=_tiny_k31_config(), num_shards=2)  # BF16 + F32 + MXFP4
    model = from_pretrained(path, dtype="float32", progress=False)
    cfg, tensors = O.load(path)
    ids = np.random.default_rng(1).integers(3, cfg["vocab_size"], (2, T)).astype(np.int32)
    want = np.stack([O.forward(cfg, tensors, s) for s in ids])
    floor = max(np.abs(O.forward(cfg, tensors, s, dtype=np.float32) - w).max() for s, w in zip(ids, want))
    return path, model, cfg, tensors, ids, want, floor


def _jitted(model):
    """``call(ids, cache=None, prefix=False, pages=None) -> (logits, cache)``: the model as one jitted function,
    float32 products at full precision (``highest``: on an accelerator the default would drop to bf16 passes)."""
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, static_argnames="prefix")
    def call(state, ids, cache, prefix, pages):
        with jax.default_matmul_precision("highest"):
            out = nnx.merge(graphdef, state)(ids, cache=cache, prefix=prefix, page_table=pages)
        return out.logits, out.cache

    return lambda ids, cache=None, prefix=False, pages=None: call(state, jnp.asarray(ids), cache, prefix, pages)


def _margins(cfg, tensors, ids):
    """The smallest gap, over both sequences, between the k-th and (k+1)-th indexer score (rows with more than k
    keys) and between the router's k-th and (k+1)-th bias-corrected score: what float32 rounding must not reorder."""
    mcfg, k = O._mla_cfg(cfg), int(cfg["num_experts_per_token"])
    index_gap = router_gap = np.inf
    for s in ids:
        _, hid = O.forward(cfg, tensors, s, return_hidden=True)
        for l, (attn, ffn) in enumerate(O.layer_kinds(cfg)):
            t = O._layer_tensors(tensors, l)
            if attn == "mla":
                x = hid["mixer_inputs"][l]
                sc = k31_oracle.index_scores(mcfg, t, x, k31_oracle.q_lora(mcfg, t, x))
                top = -np.sort(-sc[TOPK:], axis=-1)
                kth, next_ = top[:, TOPK - 1], top[:, TOPK]
                tie = kth == next_  # exact ties: keys whose every ReLU is 0 score exactly 0 in both; the later wins
                assert np.all(kth[tie] == 0), kth[tie]
                index_gap = min(index_gap, float(np.min((kth - next_)[~tie])))
            if ffn == "moe":
                g = "block_sparse_moe.gate."
                choice = O.sigmoid(hid["ffn_inputs"][l] @ t[g + "weight"].T) + t[g + "e_score_correction_bias"]
                top = -np.sort(-choice, axis=-1)
                router_gap = min(router_gap, float(np.min(top[:, k - 1] - top[:, k])))
    return index_gap, router_gap


def test_the_selection_is_sparse(k31):
    """Top-4 over 36 tokens really selects: against the oracle with every key (top-k >= T) the logits agree exactly
    while a query sees at most 4 keys and differ by far more than LOGITS_TOL at every later position; the top-4
    choice is well posed (no near-tie at the 4th key for float32 to flip)."""
    _, _, cfg, tensors, ids, want, floor = k31
    dense = np.stack([O.forward(cfg, tensors, s, index_topk=T) for s in ids])
    np.testing.assert_array_equal(dense[:, :TOPK], want[:, :TOPK])
    per_pos = np.abs(dense - want).max(axis=(0, 2))[TOPK:]
    print(f"top-{TOPK} vs all keys: smallest per-position max |diff| {per_pos.min():.3g}")
    assert per_pos.min() > 1e-2, per_pos
    print(f"float32 floor: max |oracle in float32 - oracle in float64| = {floor:.3g}")
    assert 1e-5 < floor < LOGITS_TOL / 1.5, floor  # 1e-5 is out of float32's reach here; LOGITS_TOL is not tight
    index_gap, router_gap = _margins(cfg, tensors, ids)
    print(f"smallest gap at the k-th choice: indexer {index_gap:.3g}, router {router_gap:.3g}")
    assert index_gap > 1e-4 and router_gap > 1e-4, (index_gap, router_gap)


def test_prefill_and_static_decode_equal_the_oracle(k31):
    """A cached prefill of 24 tokens (logits at every position), then 12 decode steps over the static cache."""
    _, model, _, _, ids, want, floor = k31
    call = _jitted(model)
    lg, cache = call(ids[:, :T_PREFILL], init_cache(model.cfg, 2, T, jnp.float32))
    out = [np.asarray(lg)]
    for t in range(T_PREFILL, T):
        lg, cache = call(ids[:, t:t + 1], cache, prefix=True)
        out.append(np.asarray(lg))
    got = np.concatenate(out, axis=1)
    prefill_err = np.abs(got[:, :T_PREFILL] - want[:, :T_PREFILL]).max()
    decode_err = np.abs(got[:, T_PREFILL:] - want[:, T_PREFILL:]).max()
    print(f"max |model - oracle|: prefill {prefill_err:.3g}, static decode {decode_err:.3g} (float32 floor "
          f"{floor:.3g})")
    assert max(prefill_err, decode_err) < min(LOGITS_TOL, 2 * floor), (prefill_err, decode_err, floor)


def test_paged_cache_equals_the_oracle(k31):
    """The serving engine's paged cache (pages of 4 in shuffled order): a chunked prefill of two 12-token chunks
    (the second reads the first through the page table, as after a prefix hit), then 12 decode steps."""
    _, model, _, _, ids, want, floor = k31
    call = _jitted(model)
    ps, n_pages = 4, 2 * T // 4 + 2
    table = np.random.default_rng(4).permutation(n_pages)[:2 * T // ps].reshape(2, T // ps).astype(np.int32)
    pages = jnp.asarray(table)
    cache = paged_cache(model.cfg, 2, n_pages, ps, jnp.float32)
    out = []
    for a, b in [(0, 12), (12, 24)] + [(t, t + 1) for t in range(T_PREFILL, T)]:
        lg, cache = call(ids[:, a:b], cache, prefix=True, pages=pages)
        out.append(np.asarray(lg))
    got = np.concatenate(out, axis=1)
    err = np.abs(got - want).max()
    print(f"max |model - oracle|: paged chunked prefill + decode {err:.3g}")
    assert err < min(LOGITS_TOL, 2 * floor), (err, floor)


@pytest.mark.slow
def test_serving_engine_with_a_prefix_hit_equals_the_oracle(k31):
    """The serving engine (paged cache, chunked prefill, several requests in flight), then a prompt sharing the
    first 32 tokens of one of them (a prefix hit: its pages, indexer keys included, and its KDA state are reused):
    every recorded step's logits against the oracle's logits of prompt + generated tokens."""
    from kimi_jax.serving.engine import Engine

    _, model, cfg, tensors, _, _, floor = k31
    eng = Engine(model, slots=4, max_len=64, page_size=8, prefill_chunk=16, min_chunk=16, record_logits=True,
                 compact_decode=False)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, cfg["vocab_size"], n).tolist() for n in (11, 37, 5)]
    with jax.default_matmul_precision("highest"):
        out = eng.generate(prompts, max_tokens=6, stop_ids=())
        hit_prompt = prompts[1][:32] + rng.integers(3, cfg["vocab_size"], 7).tolist()
        hit = eng.generate([hit_prompt], max_tokens=6, stop_ids=())[0]
    assert hit.cached_tokens == 32
    errs = []
    for p, o in zip(prompts + [hit_prompt], out + [hit]):
        want = O.forward(cfg, tensors, np.asarray(p + o.tokens[:-1]))[len(p) - 1:]
        np.testing.assert_array_equal(want.argmax(-1), o.tokens)
        errs.append(float(np.abs(np.asarray(o.logits) - want).max()))
    print(f"max |engine - oracle| per request (the last a prefix hit): {[f'{e:.3g}' for e in errs]}")
    assert max(errs) < min(LOGITS_TOL, 2 * floor), (errs, floor)


# -- the tiny K3.1 in float64 against the oracle: issue 39's 1e-5 ------------------------------------------------


def _float64_logits(k31, tmp_path, form: str) -> np.ndarray:
    """The checkpoint loaded with ``dtype="float64"`` in a subprocess with ``jax_enable_x64``
    (tests/k31_float64_worker.py), run over the ids as ``form`` ("static" or "paged") says: its logits ``[2, T,
    V]``, after checking they and the cache's KDA states are float64."""
    path, ids = k31[0], k31[4]
    np.save(tmp_path / "ids.npy", ids)
    out = tmp_path / "logits.npz"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_ENABLE_X64="1",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "tests.k31_float64_worker", path, str(tmp_path / "ids.npy"),
                           str(T_PREFILL), str(out), form], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = np.load(out)
    assert got["logits"].dtype == np.float64 and set(got["state_dtypes"]) == {"float64"}, got["state_dtypes"]
    return got["logits"]


def test_float64_prefill_and_static_decode_equal_the_oracle(k31, tmp_path):
    """Issue 39's check: the float64 model's cached prefill of 24 tokens (logits at every position) and its 12
    decode steps over the static cache against the oracle, within 1e-5 and within F64_TOL."""
    want = k31[5]
    got = _float64_logits(k31, tmp_path, "static")
    prefill_err = np.abs(got[:, :T_PREFILL] - want[:, :T_PREFILL]).max()
    decode_err = np.abs(got[:, T_PREFILL:] - want[:, T_PREFILL:]).max()
    print(f"float64 model, max |model - oracle|: prefill {prefill_err:.3g}, static decode {decode_err:.3g}")
    assert max(prefill_err, decode_err) < min(ISSUE_TOL, F64_TOL), (prefill_err, decode_err)


@pytest.mark.slow  # ~11 s on one core (two compiles); the static cache's run is the default set's float64 check
def test_float64_paged_cache_equals_the_oracle(k31, tmp_path):
    """The float64 model over the paged cache as test_paged_cache_equals_the_oracle runs the float32 one (a chunked
    prefill of two 12-token chunks, 12 decode steps) against the oracle, within 1e-5 and within F64_TOL."""
    err = np.abs(_float64_logits(k31, tmp_path, "paged") - k31[5]).max()
    print(f"float64 model, max |model - oracle|: paged chunked prefill + decode {err:.3g}")
    assert err < min(ISSUE_TOL, F64_TOL), err


def test_float64_needs_x64(k31):
    """Without ``jax_enable_x64`` (this process) a float64 run is refused, naming the flag, before any weight is read:
    JAX would make float32 arrays of it."""
    from kimi_jax.model.run import RunConfig

    assert not jax.config.read("jax_enable_x64")
    with pytest.raises(ValueError, match="jax_enable_x64"):
        RunConfig(dtype=jnp.float64)
    with pytest.raises(ValueError, match="jax_enable_x64"):
        from_pretrained(k31[0], dtype="float64", progress=False)
