"""``Engine(batch_invariant=True)`` (``kimi-jax serve --batch-invariant``): in bfloat16 a request's greedy tokens and
logits do not depend on what else is in flight. The same requests alone and all together, on the K3 fixture: with
the mode, every token and every logit bit equal; without it, on an accelerator the decode programs for fewer rows or
a narrower page table may round differently and some replies change (which is what the mode is for; on this CPU the
product kernels no longer do, see the last test)."""

import numpy as np
import pytest

from kimi_jax.checkpoint.loading import from_pretrained
from kimi_jax.serving.engine import Engine, Request

SHAPES = dict(slots=4, max_len=96, page_size=16, prefill_chunk=32, min_chunk=32, record_logits=True)
LENGTHS = (5, 40, 24, 70)  # a prefix hit on a chunk boundary (40 and 70 share their first 32 with nothing: cold)


@pytest.fixture(scope="module")
def bf16_model(k3_tiny_a):
    return from_pretrained(k3_tiny_a, dtype="bfloat16")


def _alone_and_together(model, **kw):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, model.cfg.vocab_size, n).tolist() for n in LENGTHS]
    prompts.append(prompts[1][:32] + prompts[0])  # shares a chunk-aligned prefix with the second prompt
    eng = Engine(model, **SHAPES, **kw).start()
    try:
        alone = [eng.submit(Request(p, max_tokens=16)).result() for p in prompts]
        handles = [eng.submit(Request(p, max_tokens=16)) for p in prompts]
        together = [h.result() for h in handles]
    finally:
        eng.stop()
    return alone, together, eng.stats()


# CI time (the 30-minute budget): the drafters' cases (~30 and ~50 s more) run -m slow; the n-gram drafter's drafts
# are all rejected on these prompts, the draft model's accepted
@pytest.mark.parametrize("drafter", [None, pytest.param("ngram", marks=pytest.mark.slow),
                                     pytest.param("draft", marks=pytest.mark.slow)])
def test_batch_invariant_replies_do_not_depend_on_load(bf16_model, k3_tiny_a, drafter):
    """With a drafter too (n-gram; the fixture drafting for itself, so drafts are accepted): every step verifies over
    every slot (one program), and what a request drafts depends on its own text alone."""
    speculative = {None: None, "ngram": "ngram:k=3", "draft": f"draft:{k3_tiny_a},k=3,adapt=acceptance"}[drafter]
    alone, together, stats = _alone_and_together(bf16_model, batch_invariant=True, speculative=speculative)
    for a, b in zip(alone, together):
        assert a.tokens == b.tokens
        np.testing.assert_array_equal(a.logits, b.logits)  # every bit, every step
    assert sum(b.cached_tokens for b in together) > 0  # hits served too (on chunk boundaries)
    if speculative:  # drafts were made (and with the draft model accepted)
        assert stats["spec_steps"] > 0 and stats["spec_drafted"] > 0, stats
        assert drafter != "draft" or stats["spec_accepted"] > 0, stats


@pytest.mark.slow
def test_on_a_cpu_the_default_engine_is_load_invariant_too(bf16_model):
    """What the mode removes on an accelerator (whose compilers choose a product's form per shape) does not arise on
    XLA:CPU any more: the default engine (compacted decode, page-table buckets) gives the same requests the same
    logits alone and under load. Every decode program's products now run one kernel that gives a row the same bits
    whatever rows share its call (the native one, up to 5 rows: tests/test_native_kernels.py); before a703d2f one
    row ran natively and several through XLA, which rounds otherwise, and 2 of 8 replies here were identical."""
    alone, together, _ = _alone_and_together(bf16_model)
    for a, b in zip(alone, together):
        np.testing.assert_array_equal(a.logits, b.logits)
