"""Speculative decoding in ``generate`` (kimi_jax/generation/speculative.py): greedy output equals plain greedy
output token for token, and the cache after verification equals the plain run's.

Random-weight models rarely repeat themselves, so besides the n-gram drafter the tests use an *oracle* drafter: it
proposes the plain run's own next tokens with one deliberately wrong token at a position that moves from step to
step, so every acceptance length from 0 to k occurs and the KDA state must be rolled back after each rejection.
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kimi_jax
from kimi_jax.checkpoint.synthetic import write_checkpoint
from kimi_jax.generation import generate as generate_mod
from kimi_jax.generation import speculative
from kimi_jax.generation.generate import Generator
from kimi_jax.model.cache import KDACache


def test_ngram_draft_proposes_what_followed_the_latest_match():
    # history 5 6 7 8 9 | 5 6 7 1 2 | 5 6 7  -> the suffix "5 6 7" last occurred at 5..7 followed by 1 2 5 6 7
    hist = jnp.array([[5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6, 7, 0, 0, 0],
                      [1, 2, 3, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # nothing repeats: no draft
                      [4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]], jnp.int32)  # "4 4 4" at 0..2: one known
    hlen = jnp.array([13, 4, 4])
    drafts, dlen = speculative.ngram_draft(hist, hlen, jnp.array([4, 4, 2]), speculative.NGram(k=4, max_n=3))
    assert dlen.tolist() == [4, 0, 1]
    assert drafts[0].tolist() == [1, 2, 5, 6] and drafts[2, 0] == 4


def test_spec_strings_and_errors():
    assert speculative.parse("ngram") == speculative.NGram()
    assert speculative.parse("ngram:k=6,max_n=4,min_n=2") == speculative.NGram(k=6, max_n=4, min_n=2)
    paced = speculative.parse("ngram:k=5,adapt=acceptance")
    assert (paced.k, paced.adapt) == (5, "acceptance") and speculative.parse("ngram").adapt == "cost"
    for bad, fragment in [("eagle", "unknown drafter"), ("ngram:k=0", "k=0"), ("ngram:x=1", "'x=1'"),
                          ("ngram:min_n=3,max_n=2", "min_n=3"),
                          ("ngram:adapt=fast", "not one of k=N, max_n=N, min_n=N, adapt=")]:
        with pytest.raises(speculative.SpeculativeError, match=fragment):
            speculative.parse(bad)
    with pytest.raises(speculative.SpeculativeError, match="adapt='fast'"):
        speculative.NGram(adapt="fast")


@pytest.mark.parametrize("xp", [np, jnp], ids=["numpy", "jax"])
def test_a_step_verifies_where_the_drafts_repay_its_cost(xp):
    """``worth_verifying``, the one rule of the compiled loop (jax.numpy) and the engine's scheduler (numpy): a step
    verifies when the tokens its drafts are expected to add (acceptance rate x draft length, over the active rows)
    reach the verify step's extra cost (cost - 1 plain steps per active row; in the compiled loop, the steps they
    take off the longest row: cost - 1), or a drafting row probes."""
    def worth(cost, rate, dlen, steps, active=(True, True), remaining=None):
        a = lambda v, dt: xp.asarray(v, dt)  # noqa: E731
        return bool(speculative.worth_verifying(cost, a(rate, xp.float32), a(dlen, xp.int32), a(steps, xp.int32),
                                                a(active, bool), xp=xp,
                                                remaining_B=None if remaining is None else a(remaining, xp.int32)))

    P = speculative.PROBE
    assert worth(1.0, (0.0, 0.0), (1, 0), (1, 1))  # free (adapt="acceptance", or not measured): whenever drafted
    assert not worth(1.0, (1.0, 1.0), (0, 0), (1, 1))  # nothing drafted: the plain step
    assert worth(3.0, (1.0, 0.0), (4, 0), (1, 1))  # expected 4 extra tokens repay (3 - 1) x 2 rows
    assert not worth(3.0, (0.7, 0.2), (4, 4), (1, 1))  # 3.6 do not
    every = int(speculative.probe_every(3.0, xp))
    assert every == 8 * P and int(speculative.probe_every(1.0, xp)) == P  # a failed probe costs < 1/32 of the steps
    assert worth(3.0, (0.7, 0.2), (4, 4), (1, every))  # ... unless a drafting row probes
    assert not worth(3.0, (0.7, 0.2), (4, 4), (1, P))
    assert not worth(3.0, (0.7, 0.2), (4, 0), (1, every))  # (a row that drafted nothing does not)
    assert worth(3.0, (0.5, 0.0), (4, 0), (1, 1), (True, False))  # an idle row costs nothing: 2 >= 2 x 1
    assert not worth(speculative.NEVER, (1.0, 1.0), (4, 4), (P, P))
    assert worth(speculative.ALWAYS, (0.0, 0.0), (0, 0), (1, 1))
    assert speculative.can_pay(4.9, 4) and not speculative.can_pay(5.0, 4)  # k drafts add at most k tokens
    # the compiled loop (the tokens each row may still make given): it ends with its last row, so a verify step
    # counts the steps it takes off the longest row, not the tokens summed
    assert not worth(3.0, (1.0, 0.0), (4, 0), (1, 1), remaining=(10, 10))  # the other row, as long, gains nothing
    assert worth(3.0, (1.0, 0.0), (4, 0), (1, 1), remaining=(20, 10))  # ... unless the drafting row is the longest
    assert worth(3.0, (0.5, 0.5), (4, 4), (1, 1), remaining=(10, 9))  # the longest 2 ahead, the next 1: 10 - 8
    assert not worth(3.0, (0.5, 0.2), (4, 4), (1, 1), remaining=(10, 10))  # 0.8 off the longest
    assert worth(3.0, (1.0, 0.0), (4, 0), (1, 1), (True, False), remaining=(10, 30))  # an ended row: none left
    assert not worth(3.0, (1.0, 1.0), (4, 4), (1, 1), remaining=(1, 1))  # one token left: nothing to take off
    assert worth(3.0, (1.0, 1.0), (4, 4), (1, every), remaining=(1, 1))  # (probes as ever)


def _oracle(monkeypatch, plain_new: list[list[int]], prompt_lens: list[int], B: int, k: int):
    """Replace the n-gram drafter by one that proposes the plain run's next tokens, wrong at position
    (tokens so far) mod (k + 1) (no wrong token when that is k: all k accepted)."""
    N = max(len(t) for t in plain_new) + k + 1
    table = np.zeros((B, N), np.int32)
    for b, t in enumerate(plain_new):
        table[b, : len(t)] = t
    plen = np.zeros((B,), np.int32)
    plen[: len(prompt_lens)] = prompt_lens
    table, plen = jnp.asarray(table), jnp.asarray(plen)

    def draft(hist, hlen, room, drafter):
        c = hlen - plen  # new tokens so far
        idx = c[:, None] + jnp.arange(drafter.k)[None]
        d = jnp.take_along_axis(table, jnp.clip(idx, 0, N - 1), axis=1)
        wrong = (c % (drafter.k + 1))[:, None] == jnp.arange(drafter.k)[None]
        return jnp.where(wrong, d + 1, d), jnp.minimum(room, drafter.k).astype(jnp.int32)

    monkeypatch.setattr(speculative, "ngram_draft", draft)


def _kda_entries(cache):
    return [e for e in (*cache.layers, *cache.stack) if isinstance(e, KDACache)]


@pytest.fixture(scope="module")
def families(k3_tiny_a, tmp_path_factory):
    out = {"k3": k3_tiny_a}
    for family in ("kimi_linear", "llama"):
        out[family] = write_checkpoint(str(tmp_path_factory.mktemp(family)), family, dtype="float32")
    return out


def _cases():  # K3 at batch 8 in the default set, the other five -m slow (15-40 s each on 2 cores)
    for family in ("k3", "kimi_linear", "llama"):
        for batch in (1, 8):
            slow = (family, batch) != ("k3", 8)
            yield pytest.param(family, batch, id=f"{family}-{batch}", marks=pytest.mark.slow if slow else ())


@pytest.mark.parametrize("family,batch", list(_cases()))
def test_greedy_speculative_equals_plain(families, family, batch, monkeypatch):
    model = kimi_jax.from_pretrained(families[family], dtype="float32", progress=False)
    rng = np.random.default_rng(batch)
    prompts = [rng.integers(3, model.cfg.vocab_size, int(n)).tolist() for n in rng.integers(3, 40, batch)]
    budgets = [int(n) for n in rng.integers(8, 24, batch)]
    gen = Generator(model, None, max_len=96)
    plain = gen.generate(prompts, budgets, stop=(), record_logits=True)
    B = plain.timings["batch_bucket"]
    plain_cache = gen._caches[B]
    k = 3 if batch == 1 else 4  # a drafter setting of its own per case: the patched drafter is traced afresh
    _oracle(monkeypatch, plain.tokens, [len(p) for p in prompts], B, k)
    spec = gen.generate(prompts, budgets, stop=(),
                        speculative=speculative.NGram(k=k, max_n=2 + batch % 3, adapt="acceptance"),
                        record_logits=True)
    assert spec.tokens == plain.tokens
    for got, want in zip(spec.logits, plain.logits):  # what each token was drawn from: verify rows vs plain steps
        assert got.shape == want.shape == (len(want), model.cfg.vocab_size)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * max(1.0, float(np.abs(want).max())))
    s = spec.timings["speculative"]
    assert s["accepted"] > 0 and s["tokens_per_step"] > 1.5, s  # the oracle's drafts were used
    spec_cache = gen._caches[B]
    np.testing.assert_array_equal(np.asarray(spec_cache.lengths), np.asarray(plain_cache.lengths))
    for a, b in zip(_kda_entries(plain_cache), _kda_entries(spec_cache)):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-4, atol=2e-5)


def test_one_loop_program_serves_every_prompt_bucket(families):
    """The loop's history is as long as the cache, whatever the prompt's bucket: a longer prompt (a chat's next turn)
    compiles its prefill, never the speculative loop again (it did: the history was the bucket plus the cache)."""
    model = kimi_jax.from_pretrained(families["llama"], dtype="float32", progress=False)
    gen = Generator(model, None, max_len=96)
    drafter = speculative.NGram(k=3, adapt="acceptance")
    rng = np.random.default_rng(0)
    seen = []
    for n in (5, 40, 70):  # prompt buckets 16, 64 and 96
        prompt = rng.integers(3, model.cfg.vocab_size, n).tolist()
        spec = gen.generate([prompt], 12, stop=(), speculative=drafter)
        assert spec.tokens == gen.generate([prompt], 12, stop=()).tokens
        assert spec.timings["speculative"]["verify_steps"] > 0  # (the loop ran)
        seen.append(speculative.decode._cache_size())
    assert seen[0] >= 1 and seen[0] == seen[1] == seen[2], seen


def _fake_clock(monkeypatch) -> list:
    """A clock for the generator where a compiled call of the speculative loop costs 5, a plain step 1 and a verify
    step 2.5 (a call's steps are verify steps where its pacing says ALWAYS); returns the list of the calls' (pacing
    cost, steps)."""
    clock, calls = [0.0], []
    spec_loop = Generator._decode_spec

    def timed_loop(self, st, samp, steps, drafter):
        calls.append((float(st.cost), steps))  # (read before the loop takes st)
        before = int(np.max(st.steps))
        out = spec_loop(self, st, samp, steps, drafter)
        ran = int(np.max(out.steps)) - before  # the steps the loop ran (it stops where every sequence has ended)
        clock[0] += 5.0 + ran * (2.5 if calls[-1][0] < 0 else 1.0)
        return out

    monkeypatch.setattr(Generator, "_decode_spec", timed_loop)
    monkeypatch.setattr(generate_mod, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    return calls


def test_short_requests_complete_a_measure_between_them(families, monkeypatch):
    """A request that ends before its measure did keeps what was timed: the next request of its batch bucket times
    only what is missing, without warming the loop up again (short requests each paying for a whole measure made the
    demo's 32-token speculative request 3x slower than its plain one)."""
    calls = _fake_clock(monkeypatch)
    model = kimi_jax.from_pretrained(families["llama"], dtype="float32", progress=False)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, model.cfg.vocab_size, 6).tolist() * 5, rng.integers(3, model.cfg.vocab_size, 9).tolist()]
    gen = Generator(model, None, max_len=128)
    plain = gen.generate(prompts, 64, stop=())
    B, never, always = plain.timings["batch_bucket"], speculative.NEVER, speculative.ALWAYS
    # 17 tokens: the warm-up (2 steps) and the plain steps' pair (10) leave too few for the verify steps' pair to
    # time MEASURE // 2 added steps
    short = gen.generate(prompts, 17, stop=(), speculative="ngram:k=4")
    assert short.tokens == [t[:17] for t in plain.tokens]
    record = gen._ngrams[speculative.NGram(k=4)]
    assert short.timings["speculative"]["verify_cost"] is None and B not in record.costs
    assert not record.timed[B].plain and record.timed[B].pending == 1.0  # the plain steps' time, kept
    assert calls[:4] == [(never, 1), (always, 1), (never, 1), (never, 9)], calls
    calls.clear()
    second = gen.generate(prompts, 64, stop=(), speculative="ngram:k=4")
    assert second.tokens == plain.tokens
    assert calls[:2] == [(always, 1), (always, 9)], calls  # no warm-up, no plain steps timed again
    assert record.costs[B] == (1.0, 2.5) and second.timings["speculative"]["verify_cost"] == 2.5


def test_accepted_drafts_do_not_keep_a_short_request_from_measuring(families, monkeypatch):
    """A verify step whose drafts are accepted makes up to k + 1 tokens, so a sequence of a short request can end
    within the measure's verify steps; the others still step (the loop runs while one has not ended), and the measure
    divides by the steps that ran: the cost is the clock's 2.5 (a measure that gave up whenever a sequence ended left a
    batch of 8 asking for 32 tokens unmeasured, drafting where it did not pay: 0.36-0.42x of plain)."""
    calls = _fake_clock(monkeypatch)
    model = kimi_jax.from_pretrained(families["llama"], dtype="float32", progress=False)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, model.cfg.vocab_size, 9).tolist() for _ in range(2)]
    gen = Generator(model, None, max_len=128)
    budgets = [24, 40]  # the first sequence ends during the verify steps, the second steps on
    plain = gen.generate(prompts, budgets, stop=())
    _oracle(monkeypatch, plain.tokens, [len(p) for p in prompts], plain.timings["batch_bucket"], 4)
    spec = gen.generate(prompts, budgets, stop=(), speculative="ngram:k=4")
    assert spec.tokens == plain.tokens
    long_verify = [n for cost, n in calls if cost == speculative.ALWAYS][-1]
    assert long_verify == 1 + generate_mod.MEASURE, calls
    assert spec.timings["speculative"]["verify_cost"] == 2.5, (spec.timings, calls)


def test_cost_pacing_is_measured_per_bucket_and_stops_drafting_where_it_cannot_pay(families, monkeypatch):
    """``adapt="cost"`` (the default): the first request of a batch bucket measures a verify step against a plain
    step on its own first steps (the greedy tokens stay the plain ones), as do the next requests until the bucket
    has MEASURES measures, and later requests reuse their medians; where a verify step costs k + 1 plain steps or
    more the request decodes plainly after it, and where it is cheap the drafts are used. The clock is replaced by one
    where a compiled call costs 5 plain steps of its own and a verify step 2.5 (so the measure must cancel the calls'
    own cost); real times are the benchmark's."""
    _fake_clock(monkeypatch)
    model = kimi_jax.from_pretrained(families["llama"], dtype="float32", progress=False)
    rng = np.random.default_rng(5)
    base = rng.integers(3, model.cfg.vocab_size, 6).tolist()
    prompts = [base * 5, rng.integers(3, model.cfg.vocab_size, 9).tolist()]
    gen = Generator(model, None, max_len=128)
    plain = gen.generate(prompts, 64, stop=())
    B = plain.timings["batch_bucket"]
    first = gen.generate(prompts, 64, stop=(), speculative="ngram:k=4")
    s = first.timings["speculative"]
    assert first.tokens == plain.tokens
    record = gen._ngrams[speculative.NGram(k=4)]
    assert s["verify_cost"] == pytest.approx(2.5) and record.costs == {B: (1.0, 2.5)}, s  # kept for bucket B
    timed = record.timed[B]
    assert list(timed.plain) == [1.0] and list(timed.ratio) == [2.5] and timed.pending is None, timed
    for _ in range(generate_mod.MEASURES - 1):  # the bucket's next requests that draft measure too
        record.gains[B] = 4.0  # (as if the last request's drafts had paid)
        assert gen.generate(prompts, 64, stop=(), speculative="ngram:k=4").tokens == plain.tokens
    assert list(timed.ratio) == [2.5] * generate_mod.MEASURES and record.costs[B] == (1.0, 2.5), timed
    measure = Generator._measure
    monkeypatch.setattr(Generator, "_measure", lambda *a: pytest.fail("measured twice"))
    record.costs[B] = (1.0, 6.0)  # a verify step dearer than k + 1 = 5 plain steps: drafting cannot pay
    dear = gen.generate(prompts, 64, stop=(), speculative="ngram:k=4")
    assert dear.tokens == plain.tokens
    assert dear.timings["speculative"] == {"verify_steps": 0, "drafted": 0, "accepted": 0, "verified": 0,
                                           "tokens_per_step": 0.0, "verify_cost": 6.0, "drafting": False}
    # ... but a bucket that has not drafted for a while tries again, measuring anew: one measure on a busy machine
    # that read a verify step as 6 plain steps is outvoted in the medians of the samples
    monkeypatch.setattr(Generator, "_measure", measure)
    timed.ratio.appendleft(6.0)
    record.skipped[B] = generate_mod.EXPLORE
    again = gen.generate(prompts, 64, stop=(), speculative="ngram:k=4")
    assert again.tokens == plain.tokens and again.timings["speculative"]["drafting"] and record.skipped[B] == 0
    assert list(timed.ratio) == [6.0, 2.5, 2.5, 2.5, 2.5] and record.costs[B] == (1.0, 2.5), timed
    monkeypatch.setattr(Generator, "_measure", lambda *a: pytest.fail("measured twice"))
    record.costs[B], record.gains[B] = (1.0, 3.0), 1.5  # 3 > 1 + 1.5: the last request's drafts gained too little
    assert not gen.generate(prompts, 64, stop=(), speculative="ngram:k=4").timings["speculative"]["drafting"]
    record.costs[B] = (1.0, 1.0)  # free: the repeating prompt's drafts are used (and their share kept)
    cheap = gen.generate(prompts, 64, stop=(), speculative="ngram:k=4")
    assert cheap.tokens == plain.tokens and cheap.timings["speculative"]["drafted"] > 0
    # a request whose drafter proposed nothing (no verify step had drafts: random text) leaves a gain of 0, so the
    # next request of a bucket where verifying costs anything decodes plainly
    record.learn(B, {"drafting": True, "verified": 0, "accepted": 0, "verify_cost": 1.5})
    assert record.gains[B] == 0.0 and not gen._drafting(record, B, 1.5) and gen._drafting(record, B, 1.0)
    # a request that measured and then decoded plainly leaves its measuring steps' gain (not the optimistic k) for
    # the next request's choice before its prefill; one that neither drafted nor measured leaves the last one
    record.learn(B, {"drafting": False, "verify_steps": 9, "verified": 4, "accepted": 2})
    assert record.gains[B] == 0.5 and not gen._drafting(record, B, 2.0) and gen._drafting(record, B, 1.5)
    plain_timings = {"drafting": False, "verify_steps": 0, "verified": 0, "accepted": 0}
    record.learn(B, plain_timings)
    assert record.gains[B] == 0.5
    # a try after EXPLORE plain requests whose drafts did not pay makes the bucket wait twice as many before the next
    # (up to EXPLORE_MAX); a request whose drafts paid brings the wait back to EXPLORE
    explore, most = generate_mod.EXPLORE, generate_mod.EXPLORE_MAX
    record.skipped[B] = explore
    assert record.exploring(B) and gen._drafting(record, B, 9.0)
    waits = []
    for _ in range(5):
        record.learn(B, {"drafting": True, "verified": 4, "accepted": 2, "verify_cost": 3.0})  # 3 > 1 + 0.5
        waits.append(record.explore[B])
        for _ in range(record.explore[B] - 1):
            record.learn(B, plain_timings)
        assert not record.exploring(B) and not gen._drafting(record, B, 3.0)
        record.learn(B, plain_timings)
        assert record.exploring(B) and gen._drafting(record, B, 3.0)
    assert waits == [2 * explore, 4 * explore, 8 * explore, most, most] and most == 8 * explore, waits
    record.learn(B, {"drafting": True, "verified": 4, "accepted": 12, "verify_cost": 3.0})  # 3 <= 1 + 3: paid
    assert record.explore[B] == explore and record.skipped[B] == 0 and record.gains[B] == 3.0
    record.skipped[B] = 2  # a request that drafts without being a try (its drafts were expected to pay) and did not
    record.learn(B, {"drafting": True, "verified": 4, "accepted": 0, "verify_cost": 3.0})  # pay: the wait stays
    assert record.explore[B] == explore and record.skipped[B] == 0
    # the plain loop's step, where a plain request was timed, is the baseline when it is the cheaper (the
    # speculative loop's plain step also keeps a model drafter's cache): 2.5 / 0.4 > k + 1 here, drafting stops
    record.costs[B], gen._plain_steps[B] = (1.0, 2.5), 0.4
    upkeep = gen.generate(prompts, 64, stop=(), speculative="ngram:k=4")
    assert upkeep.tokens == plain.tokens
    assert upkeep.timings["speculative"]["verify_cost"] == 6.25 and not upkeep.timings["speculative"]["drafting"]
    monkeypatch.undo()
    ended = Generator(model, None, max_len=128).generate(prompts, 4, stop=(), speculative="ngram:k=4")
    assert ended.tokens == [t[:4] for t in plain.tokens]
    assert ended.timings["speculative"]["verify_cost"] is None  # too short to measure


@pytest.mark.parametrize("family", ["k3", pytest.param("kimi_linear", marks=pytest.mark.slow)])
def test_kda_state_after_one_rejected_draft_equals_plain(families, family, monkeypatch):
    """One verify step whose second draft is wrong (the oracle drafter at one new token so far) keeps two tokens, the
    second a stop id, so the run ends there. The KDA recurrent state then equals the plain run's after the same two
    one-position steps within 1e-6 (float32); the conv tails (the layers' projected inputs of the last positions)
    within 1e-5, the rounding of a 4-row forward's products against 1-row ones, grown over the layers."""
    model = kimi_jax.from_pretrained(families[family], dtype="float32", progress=False)
    rng = np.random.default_rng(5)
    gen = Generator(model, None, max_len=64)
    for _ in range(5):  # a prompt whose third new token does not occur among the first two
        prompts = [rng.integers(3, model.cfg.vocab_size, 23).tolist()]
        first = gen.generate(prompts, 3, stop=()).tokens[0]
        if first[2] not in first[:2]:
            break
    stop = (first[2],)
    plain = gen.generate(prompts, 10, stop=stop)  # the prefill's token, then two decode steps, the last a stop
    assert plain.tokens[0] == first
    B = plain.timings["batch_bucket"]
    plain_cache = gen._caches[B]
    _oracle(monkeypatch, plain.tokens, [len(p) for p in prompts], B, 3)
    spec = gen.generate(prompts, 10, stop=stop,
                        speculative=speculative.NGram(k=3, max_n=1, min_n=1, adapt="acceptance"))
    assert spec.tokens == plain.tokens
    assert spec.timings["speculative"] == {"verify_steps": 1, "drafted": 3, "accepted": 1, "verified": 1,
                                           "tokens_per_step": 2.0, "verify_cost": None, "drafting": True}
    spec_cache = gen._caches[B]
    np.testing.assert_array_equal(np.asarray(spec_cache.lengths), np.asarray(plain_cache.lengths))
    worst = {"state": 0.0, "conv": 0.0}
    for a, b in zip(_kda_entries(plain_cache), _kda_entries(spec_cache)):
        for name in ("state", "conv_q", "conv_k", "conv_v"):
            diff = np.abs(np.asarray(getattr(b, name))[:1] - np.asarray(getattr(a, name))[:1])
            key = "state" if name == "state" else "conv"
            worst[key] = max(worst[key], float(diff.max()))
    assert worst["state"] <= 1e-6 and worst["conv"] <= 1e-5, worst


@pytest.mark.slow  # the default set runs the n-gram drafter on the fixture through the CLI (golden tokens)
def test_ngram_drafter_on_the_k3_fixture_equals_plain(k3_tiny_a):
    model = kimi_jax.from_pretrained(k3_tiny_a, dtype="float32", progress=False)
    rng = np.random.default_rng(0)
    base = rng.integers(3, 500, 10).tolist()
    prompts = [base * 4, rng.integers(3, 500, 25).tolist(), base[:4] * 7]
    gen = Generator(model, None, max_len=128)
    plain = gen.generate(prompts, 32, stop=())
    spec = gen.generate(prompts, 32, stop=(), speculative="ngram:k=4,adapt=acceptance")
    assert spec.tokens == plain.tokens and spec.timings["speculative"]["drafted"] > 0


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _check_draws(got, p, what):
    """Pearson's chi-square test of the token ids ``got`` against the probabilities ``p``: tokens of probability 0
    never drawn, and the test does not reject at the 1e-3 level."""
    from scipy.stats import chisquare

    counts = np.bincount(got, minlength=len(p))
    assert not counts[p == 0].any(), f"{what}: drew tokens of probability 0: {counts} vs {p.round(4)}"
    live = p > 0
    res = chisquare(counts[live], p[live] / p[live].sum() * len(got))
    assert res.pvalue > 1e-3, f"{what}: chi-square p = {res.pvalue:.2e}: {counts} vs {(p * len(got)).round(1)}"


@pytest.mark.parametrize("top_k", [0, 3])
@pytest.mark.parametrize("draft", ["likely", "bad"])
def test_rejection_sampling_keeps_the_samplers_distribution(draft, top_k):
    """Sampled rows: the first kept token has the target's distribution (softmax(logits / T), top-k renormalised,
    computed here in numpy), whether the drafts are likely or deliberately bad (the least likely tokens); given that
    the first draft was accepted the second has p_1's; a draft token is kept exactly when accepted. 20000 rows of the
    same logits, each row its own random stream; Pearson's chi-square per distribution."""
    B, V, T = 20000, 6, 0.8
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, V)).astype(np.float32) * 1.5
    pick = (-2, -1) if draft == "likely" else (0, 0)  # the second / first likeliest, or the least likely
    drafts = np.array([int(np.argsort(logits[0])[pick[0]]), int(np.argsort(logits[1])[pick[1]])], np.int32)
    samp = kimi_jax.generation.sampling.Sampling(
        temperature=jnp.full((B,), T, jnp.float32), top_k=jnp.full((B,), top_k, jnp.int32),
        top_p=jnp.ones((B,), jnp.float32), budget=jnp.full((B,), 10, jnp.int32), stop=jnp.full((1,), -1, jnp.int32),
        seed=jnp.uint32(7))
    t, a = jax.jit(speculative.accept_drafts)(jnp.broadcast_to(logits, (B, 3, V)), jnp.broadcast_to(drafts, (B, 2)),
                                              jnp.full((B,), 2, jnp.int32), samp, jnp.zeros((B,), jnp.int32))
    t, a = np.asarray(t), np.asarray(a)

    def target(row):
        z = logits[row].astype(np.float64) / T
        if top_k:
            z = np.where(z >= np.sort(z)[-top_k], z, -np.inf)
        return _softmax(z)

    _check_draws(t[:, 0], target(0), "first token")
    assert np.array_equal(t[:, 0] == drafts[0], a >= 1)  # kept as the draft exactly when accepted
    if draft == "likely":
        second = t[a >= 1, 1]
        _check_draws(second, target(1), "second token, first accepted")
        assert np.array_equal(second == drafts[1], a[a >= 1] == 2)
        assert 0.05 < np.mean(a >= 1) < 0.95 and np.mean(a == 2) > 0.02  # every branch taken
    else:
        assert np.mean(a >= 1) == pytest.approx(target(0)[drafts[0]], abs=0.01)  # rarely or never accepted


# -m slow for CI time (the 30-minute budget): the rejection sampler's distribution is checked by the chi-square test
@pytest.mark.slow
def test_sampled_speculative_generation_is_reproducible_and_greedy_when_cold(k3_tiny_a, monkeypatch):
    """Temperature > 0 runs through rejection sampling: a near-zero temperature with the oracle drafter (every
    acceptance length) gives the plain greedy tokens, so the sampled path keeps the right tokens in the right places;
    the same seed gives the same tokens."""
    model = kimi_jax.from_pretrained(k3_tiny_a, dtype="float32", progress=False)
    gen = Generator(model, None, max_len=96)
    base = np.random.default_rng(1).integers(3, 500, 8).tolist()
    prompts = [base * 4, base[:5] * 5]
    greedy = gen.generate(prompts, 24, stop=())
    with monkeypatch.context() as m:
        _oracle(m, greedy.tokens, [len(p) for p in prompts], greedy.timings["batch_bucket"], 5)
        cold = gen.generate(prompts, 24, stop=(), temperature=1e-4,
                            speculative=speculative.NGram(k=5, max_n=1, adapt="acceptance"))
    assert cold.tokens == greedy.tokens
    assert cold.timings["speculative"]["accepted"] > 0 and cold.timings["speculative"]["tokens_per_step"] > 1.5
    one = gen.generate(prompts, 24, stop=(), temperature=1.0, seed=3, speculative="ngram:k=4,adapt=acceptance")
    two = gen.generate(prompts, 24, stop=(), temperature=1.0, seed=3, speculative="ngram:k=4,adapt=acceptance")
    assert one.tokens == two.tokens and all(len(x) == 24 for x in one.tokens)


@pytest.mark.slow  # CI time: streaming runs in the default set without a drafter (tests/test_generate.py)
def test_streamed_speculative_output_is_the_whole_output(k3_tiny_a, monkeypatch):
    """``stream=`` with a drafter: each call hands over the tokens its verify steps kept (several per step when
    drafts are accepted), and the streamed pieces join up to the returned tokens, which are the plain greedy ones."""
    model = kimi_jax.from_pretrained(k3_tiny_a, dtype="float32", progress=False)
    gen = Generator(model, None, max_len=96)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 500, 9).tolist(), rng.integers(3, 500, 20).tolist()]
    plain = gen.generate(prompts, 20, stop=())
    _oracle(monkeypatch, plain.tokens, [len(p) for p in prompts], plain.timings["batch_bucket"], 2)
    pieces = [[], []]

    def stream(new, text):
        assert text is None
        for i, t in enumerate(new):
            pieces[i] += t

    spec = gen.generate(prompts, 20, stop=(), stream=stream, stream_every=2,
                        speculative=speculative.NGram(k=2, max_n=2, min_n=2, adapt="acceptance"))
    assert spec.tokens == plain.tokens and pieces == plain.tokens
    assert spec.timings["speculative"]["accepted"] > 0


def test_refusals(k3_tiny_a):
    model = kimi_jax.from_pretrained(k3_tiny_a, dtype="float32", progress=False)
    gen = Generator(model, None, max_len=64)
    with pytest.raises(speculative.SpeculativeError, match="unknown drafter"):
        gen.generate([[1, 2, 3]], 4, speculative="medusa")


def test_cli_speculative_gives_the_golden_greedy_tokens(k3_tiny_a, k3_golden, capsys):
    """``kimi-jax generate --speculative ngram`` with token ids in, float32: the fixture's golden greedy tokens (a
    reference implementation's)."""
    from kimi_jax.cli import main

    golden = k3_golden["greedy_tokens"]
    argv = ["generate", "--model", k3_tiny_a, "--dtype", "float32", "--no-compile-cache", "--speculative", "ngram:k=3",
            "--max-new-tokens", str(golden.shape[1]), "--stop", "0"]
    for row in k3_golden["input_ids"].tolist():
        argv += ["--ids", ",".join(map(str, row))]
    assert main(argv) == 0
    out = capsys.readouterr()
    got = [[int(t) for t in line.split("] ", 1)[1].split()] for line in out.out.splitlines()]
    np.testing.assert_array_equal(np.array(got), golden)
    assert "drafted tokens accepted" in out.err
    assert main(["generate", "--model", k3_tiny_a, "--ids", "1,2", "--speculative", "ngram:k=99"]) == 2
    assert "k=99" in capsys.readouterr().err


SCALE = {"k3": 0.003, "kimi_linear": 0.03, "llama": 0.03}  # noise that leaves the draft model often right (the K3 fixture flips on less)


def _perturbed(path, scale: float):
    """The model at ``path`` with noise of ``scale`` times each float weight's own spread added: a draft model that
    mostly agrees with it (packed expert weights left as they are)."""
    from flax import nnx

    m = kimi_jax.from_pretrained(path, dtype="float32", progress=False)
    state = nnx.state(m, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(7), len(jax.tree.leaves(state))))

    def noisy(x):
        key = next(keys)
        if not jnp.issubdtype(x.dtype, jnp.floating) or x.ndim < 2:
            return x
        return x + scale * jnp.std(x) * jax.random.normal(key, x.shape, x.dtype)

    nnx.update(m, jax.tree.map(noisy, state))
    return m


@pytest.mark.parametrize("family,batch", [  # the Llama-shaped model in the default set (the cheapest to compile)
    pytest.param("k3", 2, id="k3-2", marks=pytest.mark.slow), pytest.param("k3", 8, id="k3-8", marks=pytest.mark.slow),
    pytest.param("kimi_linear", 1, id="kimi_linear-1", marks=pytest.mark.slow), pytest.param("llama", 8, id="llama-8")])
def test_greedy_with_a_draft_model_equals_plain(families, family, batch):
    """A draft model (the target with noisy weights: it agrees often, not always): greedy output equals plain output
    with drafts accepted and rejected, a prompt prefilled in chunks; the KDA states of the target's cache agree with
    the plain run's. The target itself as its own draft model: every draft accepted."""
    model = kimi_jax.from_pretrained(families[family], dtype="float32", progress=False)
    rng = np.random.default_rng(batch)
    prompts = [rng.integers(3, model.cfg.vocab_size, int(n)).tolist() for n in rng.integers(3, 40, batch)]
    gen = Generator(model, None, max_len=96, prefill_chunk=16)
    plain = gen.generate(prompts, 16, stop=())
    B = plain.timings["batch_bucket"]
    plain_cache = gen._caches[B]
    draft = speculative.DraftModel(_perturbed(families[family], SCALE[family]), 3, "acceptance")
    spec = gen.generate(prompts, 16, stop=(), speculative=draft)
    assert spec.tokens == plain.tokens
    s = spec.timings["speculative"]
    assert 0 < s["accepted"] < s["drafted"], s  # some drafts accepted, some rejected
    for a, b in zip(_kda_entries(plain_cache), _kda_entries(gen._caches[B])):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-4, atol=2e-5)
    if family == "llama":
        same = gen.generate(prompts, 16, stop=(), speculative=speculative.DraftModel(model, 3, "acceptance"))
        assert same.tokens == plain.tokens
        assert same.timings["speculative"]["accepted"] == same.timings["speculative"]["drafted"] > 0
