"""Speculative decoding in the serving engine (``Engine(speculative=...)``: the scheduler drafts, a verify step over
every slot checks): greedy replies equal the plain engine's (float32), with requests of mixed lengths in flight
(chunked prefill), a prefix hit, a stop id inside a verify step's kept tokens, and a cancellation, for the three
families: K3 (its fixture's golden tokens too), Kimi Linear and the Llama-shaped model (GQA).

Random-weight models rarely repeat themselves, so the scheduler's prompt-lookup drafter is replaced by an *oracle*
that proposes each request's plain reply with one wrong token at a position that moves from step to step: every
acceptance length occurs, and the KDA state is rolled back after each rejection.
"""

import numpy as np
import pytest

import kimi_jax
from kimi_jax.checkpoint.synthetic import write_checkpoint
from kimi_jax.generation import speculative
from kimi_jax.serving import scheduler as scheduler_mod
from kimi_jax.serving.engine import Engine, Request

SHAPES = dict(slots=4, max_len=96, page_size=16, prefill_chunk=32, min_chunk=32, compact_decode=False)
K = 3


@pytest.fixture(scope="module")
def models(k3_tiny_a, tmp_path_factory):
    """Per family, loaded once: (the float32 model, a plain engine of the same shapes without prefix caching)."""
    made = {}

    def get(family):
        if family not in made:
            path = k3_tiny_a if family == "k3" else write_checkpoint(str(tmp_path_factory.mktemp(family)), family,
                                                                     dtype="float32")
            model = kimi_jax.from_pretrained(path, dtype="float32", progress=False)
            made[family] = model, Engine(model, **SHAPES, prefix_cache_bytes=0, record_logits=True)
        return made[family]

    return get


@pytest.fixture(scope="module")
def model(models):
    return models("k3")[0]


def _prompts(V, lengths, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, V, n).tolist() for n in lengths]


def _oracle(monkeypatch, replies: dict):
    """The drafter proposes ``replies[prompt]`` from the tokens drawn so far, wrong at (tokens so far) mod (k + 1)."""
    def draft(hist, room, drafter):
        for prompt, reply in replies.items():
            if tuple(hist[: len(prompt)]) == prompt and len(hist) > len(prompt):
                c = len(hist) - len(prompt)
                d = list(reply[c: c + min(room, drafter.k)])
                wrong = c % (drafter.k + 1)
                if wrong < len(d):
                    d[wrong] += 1
                return d
        return []

    monkeypatch.setattr(scheduler_mod.speculative, "ngram_draft_host", draft)


def _cancel_mid_reply(eng, b, wb, c, wc):
    """Request ``b`` (30 tokens) cancelled after 5: it ends "abort" with a prefix of its plain reply ``wb``; then
    ``c`` (12 tokens) gets its plain reply ``wc``, and every slot is free."""
    h = eng.submit(Request(b, max_tokens=30, stop_ids=()))
    for _ in range(200):
        eng.step()
        if any(s is not None and len(s.out) >= 5 for s in eng.running):
            break
    h.cancel()
    for _ in range(20):
        eng.step()
        if h.finished:
            break
    assert h.finished
    r = h.result(timeout=10)
    assert r.finish_reason == "abort" and len(r.tokens) >= 5 and r.tokens == wb.tokens[: len(r.tokens)]
    assert eng.generate([c], max_tokens=12, stop_ids=())[0].tokens == wc.tokens
    assert eng.stats()["slots_busy"] == 0


def test_host_drafter_matches_the_device_drafter():
    """The scheduler's n-gram lookup (numpy, per sequence) proposes what the compiled one does."""
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    d = speculative.NGram(k=4, max_n=3, min_n=1)
    hist = rng.integers(0, 5, (64, 40))  # a small vocabulary: matches of every length
    hlen = rng.integers(1, 41, 64)
    room = rng.integers(0, 6, 64)
    drafts, dlen = speculative.ngram_draft(jnp.asarray(hist, jnp.int32), jnp.asarray(hlen, jnp.int32),
                                           jnp.asarray(room, jnp.int32), d)
    for b in range(64):
        host = speculative.ngram_draft_host(hist[b, : hlen[b]], int(room[b]), d)
        assert host == np.asarray(drafts)[b, : int(dlen[b])].tolist(), b


# -m slow (CI time: ~60 s, ~35 s and ~12 s on 2 cores, mostly compiles): the engine's verify steps run in the default
# set in the draft-model test below and on two processes (tests/test_serve_multihost.py, n-gram drafts on K3)
@pytest.mark.parametrize("family", [pytest.param("k3", marks=pytest.mark.slow),
                                    pytest.param("kimi_linear", marks=pytest.mark.slow),
                                    pytest.param("llama", marks=pytest.mark.slow)])
def test_speculative_engine_equals_the_plain_engine(family, models, k3_golden, monkeypatch):
    model, plain = models(family)
    V = model.cfg.vocab_size
    first = k3_golden["input_ids"].tolist() if family == "k3" else _prompts(V, (23, 11), seed=0)
    others = _prompts(V, (70, 5), seed=1)  # a 3-chunk prompt in flight beside them
    prompts = first + others
    want = plain.generate(prompts, max_tokens=16, stop_ids=())
    eng = Engine(model, **SHAPES, speculative=speculative.NGram(k=K, adapt="acceptance"))
    eng.warmup()
    _oracle(monkeypatch, {tuple(p): w.tokens for p, w in zip(prompts, want)})
    got = eng.generate(prompts, max_tokens=16, stop_ids=())
    assert [g.tokens for g in got] == [w.tokens for w in want]
    if family == "k3":
        np.testing.assert_array_equal(np.array([g.tokens for g in got[:2]]), k3_golden["greedy_tokens"])
    st = eng.stats()
    assert st["spec_steps"] > 0 and st["spec_accepted"] > 0 and st["compiles_after_warmup"] == 0, st
    assert st["decode_steps"] < 15 * len(prompts)  # fewer forwards than tokens

    # a prefix hit (the first prompt's snapshot at 32), and a stop id inside a verify step's kept tokens
    a = others[0]
    tail = _prompts(V, (9,), seed=2)[0]
    cold = plain.generate([a[:40] + tail], max_tokens=16, stop_ids=())[0]
    stop = cold.tokens[6]
    cold_stop = plain.generate([a[:40] + tail], max_tokens=16, stop_ids=(stop,))[0]
    _oracle(monkeypatch, {tuple(a[:40] + tail): cold.tokens})
    hit = eng.generate([a[:40] + tail], max_tokens=16, stop_ids=(stop,))[0]
    assert hit.cached_tokens == 32
    assert hit.tokens == cold_stop.tokens and hit.finish_reason == cold_stop.finish_reason == "stop"

    # a cancellation mid-reply; the slot's next request is served correctly
    b, c = _prompts(V, (12, 20), seed=3)
    wb = plain.generate([b], max_tokens=30, stop_ids=())[0]
    wc = plain.generate([c], max_tokens=12, stop_ids=())[0]
    _oracle(monkeypatch, {tuple(b): wb.tokens, tuple(c): wc.tokens})
    _cancel_mid_reply(eng, b, wb, c, wc)

    # a request that opts out (the server's "speculative": false) is decoded without drafts
    drafted = eng.stats()["spec_drafted"]
    h = eng.submit(Request(c, max_tokens=12, stop_ids=(), speculative=False))
    for _ in range(100):
        eng.step()
        if h.finished:
            break
    assert h.result(timeout=10).tokens == wc.tokens and eng.stats()["spec_drafted"] == drafted


@pytest.mark.parametrize("verify_cost", [10.0, 1.0])
def test_the_scheduler_verifies_where_the_timed_cost_is_repaid(models, monkeypatch, verify_cost):
    """``adapt="cost"`` (the default) in the engine: the scheduler times each decode and verify step (the engine's
    measure, replaced here by a verify step ``verify_cost`` times a plain one) and verifies only where the drafts
    are expected to repay it. Dear (10 plain steps, more than the k + 1 = 4 tokens a step can gain): after two
    steps of each kind (the first of each left out of the timing), the slots decode plainly. Free: the oracle's
    drafts are verified as with ``adapt="acceptance"``. The replies are the plain engine's either way."""
    model, plain = models("llama")
    prompts = _prompts(model.cfg.vocab_size, (23, 11, 30, 7), seed=4)
    want = plain.generate(prompts, max_tokens=40, stop_ids=())
    timed = scheduler_mod.Scheduler.timed
    fake = lambda self, plan, seconds: timed(  # noqa: E731
        self, plan, verify_cost if isinstance(plan.compute, scheduler_mod.Verify) else 1.0)
    monkeypatch.setattr(scheduler_mod.Scheduler, "timed", fake)
    eng = Engine(model, **SHAPES, speculative=speculative.NGram(k=K))
    eng.warmup()
    _oracle(monkeypatch, {tuple(p): w.tokens for p, w in zip(prompts, want)})
    got = eng.generate(prompts, max_tokens=40, stop_ids=())
    assert [g.tokens for g in got] == [w.tokens for w in want]
    st = eng.stats()
    if verify_cost > K + 1:  # two steps of each kind timed (the first of each left out), then plain steps only
        assert st["spec_steps"] == 2 and st["decode_steps"] >= 30, st
    else:
        assert st["spec_steps"] > st["decode_steps"] / 2 and st["spec_accepted"] > 0, st


def test_new_requests_start_at_the_acceptance_of_the_finished_ones(models, monkeypatch):
    """A slot starts at the acceptance rate of the requests before it (``Scheduler.prior``: 1 at first, then a moving
    average of finished requests' last rates), so a drafter whose drafts keep failing stops costing verify steps at
    each new request's start (every request started at 1: the demo's chat replies with the n-gram drafter in the
    engine, 13% accepted, ran 8 verify steps per 64-token request, 0.80-0.90x of plain). A request's first step may
    verify whatever the rate (a probe), so a request whose drafts are right is found at once. A verify step costs 2
    plain steps here (timed so). Replies are the plain engine's."""
    model, plain = models("llama")
    V = model.cfg.vocab_size
    prompts = _prompts(V, (23, 11, 30, 17), seed=10)
    want = plain.generate(prompts, max_tokens=40, stop_ids=())
    timed = scheduler_mod.Scheduler.timed
    fake = lambda self, plan, seconds: timed(  # noqa: E731
        self, plan, 2.0 if isinstance(plan.compute, scheduler_mod.Verify) else 1.0)
    monkeypatch.setattr(scheduler_mod.Scheduler, "timed", fake)
    eng = Engine(model, **SHAPES, speculative=speculative.NGram(k=K))
    eng.warmup()
    replies = {tuple(p): w.tokens for p, w in zip(prompts, want)}

    def drafts(off: int):
        def draft(hist, room, drafter):  # each request's next tokens (+ off)
            for prompt, reply in replies.items():
                if tuple(hist[: len(prompt)]) == prompt and len(hist) > len(prompt):
                    c = len(hist) - len(prompt)
                    return [(t + off) % V for t in reply[c: c + min(room, drafter.k)]]
            return []
        return draft

    monkeypatch.setattr(speculative, "ngram_draft_host", drafts(1))  # every one wrong: all rejected
    steps, priors = [], [eng.scheduler.prior]
    for p, w in zip(prompts[:3], want):
        before = eng.stats()["spec_steps"]
        assert eng.generate([p], max_tokens=40, stop_ids=())[0].tokens == w.tokens
        steps.append(eng.stats()["spec_steps"] - before)
        priors.append(eng.scheduler.prior)
    assert priors[0] == 1.0 and priors[1] > priors[2] > priors[3], priors
    assert steps[0] > steps[1] > steps[2] > 0, steps
    monkeypatch.setattr(speculative, "ngram_draft_host", drafts(0))  # right drafts: found at the first step
    before = eng.stats()
    assert eng.generate([prompts[3]], max_tokens=40, stop_ids=())[0].tokens == want[3].tokens
    after = eng.stats()
    assert after["spec_steps"] - before["spec_steps"] > steps[0], (steps, before, after)
    assert after["spec_accepted"] - before["spec_accepted"] > 25, (before, after)


def test_a_draft_model_drafts_only_before_a_step_that_may_verify(models, monkeypatch):
    """A model drafter (here the Llama-shaped model drafting for itself) drafts its block after a plain step only
    where the scheduler may verify next (:meth:`Scheduler._draft_next`: the plan's ``Decode.draft``); it follows
    every step either way. The verify step's cost is dear (10 plain steps, more than the k + 1 tokens it can gain)
    for the first 20 steps, then free: the plain steps before draft no block, the drafter still follows them exactly
    (every draft after is accepted), and the replies are the plain engine's."""
    model, plain = models("llama")
    prompts = _prompts(model.cfg.vocab_size, (23, 11), seed=8)
    want = plain.generate(prompts, max_tokens=40, stop_ids=())
    monkeypatch.setattr(scheduler_mod.Scheduler, "_cost",
                        lambda self, n: 10.0 if self.counters["decode_steps"] < 20 else 1.0)
    eng = Engine(model, **SHAPES, speculative=speculative.DraftModel(model, k=K))
    eng.warmup()
    plans = []
    emit = scheduler_mod.Scheduler._emit
    monkeypatch.setattr(scheduler_mod.Scheduler, "_emit", lambda self, op: (plans.append(op), emit(self, op))[1])
    got = eng.generate(prompts, max_tokens=40, stop_ids=())
    assert [g.tokens for g in got] == [w.tokens for w in want]
    decodes = [op for op in plans if isinstance(op, scheduler_mod.Decode)]
    skipped = [op for op in decodes if not op.draft]
    assert len(skipped) >= 17, [op.draft for op in decodes]  # the dear steps but the probe's
    st = eng.stats()
    assert st["spec_accepted"] == st["spec_drafted"] > 0 and st["spec_steps"] > 3, st


def test_refusals(model, capsys):
    with pytest.raises(speculative.SpeculativeError, match="k=0"):
        Engine(model, **SHAPES, speculative="ngram:k=0")
    from kimi_jax.cli import main

    assert main(["serve", "--speculative", "ngram:k=0"]) == 2  # named before anything loads
    assert "ngram k=0" in capsys.readouterr().err
    assert main(["serve", "--speculative", "draft:/nowhere"]) == 2
    assert "no draft model at '/nowhere'" in capsys.readouterr().err
    assert main(["serve", "--speculative", "dspark:/nowhere"]) == 2  # its config.json read before the model loads
    assert "/nowhere" in capsys.readouterr().err
    speculative.check("draft:demo,k=2")  # the shipped model's name resolves as from_pretrained resolves it
    for bad, why in (("draft:demo,k=x", "'k=x' is not one of k=N, adapt="),
                     ("draft:,k=2", "give the drafter's directory")):
        with pytest.raises(speculative.SpeculativeError, match=why):
            speculative.check(bad)


# -m slow for CI time (the 30-minute budget): the drafter's math against the oracle runs in the default set through
# generate (tests/test_dspark.py)
@pytest.mark.slow
def test_dspark_drafter_in_the_engine_drafts_from_the_targets_context(model, models, tmp_path, monkeypatch):
    """A DSpark drafter on the device (``speculative=DSpark``) on the K3 fixture: a 3-chunk prompt, then a prompt
    sharing its first chunk (a prefix hit: the drafter's context comes with the pages). Each step's block is
    recorded: for every row that kept tokens, the drafter's base logits equal the float64 oracle's computed from the
    target's hidden states of the whole sequence so far (so prefill chunks, verify steps and shared pages wrote the
    drafter's context right). The drafts the verify steps get are the plain reply with one wrong token at a moving
    position (every acceptance length occurs); greedy replies equal the plain engine's."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from kimi_jax.checkpoint.drafter import load_drafter
    from kimi_jax.serving import steps
    from tests import dspark_oracle as oracle
    from tests.test_dspark import _write

    V, n = model.cfg.vocab_size, 3
    cfg = oracle.tiny_config(V, hidden_size=model.cfg.hidden_size, target_hidden_size=model.cfg.hidden_size,
                             target_layer_ids=[1, 4, 8], num_target_layers=3, block_size=n)
    tensors = oracle.random_checkpoint(cfg, seed=1)
    drafter = speculative.DSpark(load_drafter(_write(tmp_path, cfg, tensors)), n, "acceptance")
    a = _prompts(V, (70,), seed=5)[0]
    b = a[:40] + _prompts(V, (9,), seed=6)[0]
    want = [w.tokens for w in models("k3")[1].generate([a, b], max_tokens=12, stop_ids=())]
    fulls = [a + want[0], b + want[1]]
    now, seen = [0], []  # the request running (one at a time), the recorded blocks

    def oracle_drafts(written, ctx_len, anchor):
        out = np.zeros((len(written), n), np.int32)
        full = fulls[now[0]]
        for r in np.flatnonzero(np.asarray(written) > 0):
            c = int(ctx_len[r])
            if c < len(full) and full[c] == int(anchor[r]):  # a decoding row: its reply, one token wrong
                d = (full[c + 1: c + 1 + n] + [0] * n)[:n]
                if c % (n + 1) < n:
                    d[c % (n + 1)] = (d[c % (n + 1)] + 1) % V
                out[r] = d
        return out

    original = steps.draft_step

    def recorded(dgraph, dparams, pools, embed, head, taps, table, lengths, rows, tokens, written, want, *, k, **kw):
        pools, _ = original(dgraph, dparams, pools, embed, head, taps, table, lengths, rows, tokens, written, want,
                            k=k, **kw)
        dmodel = nnx.merge(dgraph, dparams)
        ctx_len = jnp.take(lengths, rows, mode="clip")
        anchor = jnp.take_along_axis(tokens, jnp.clip(written - 1, 0, tokens.shape[1] - 1)[:, None], axis=1)[:, 0]
        base = dmodel.base_logits(dmodel.page_view(pools, table), embed, head, anchor, ctx_len, k)
        jax.debug.callback(lambda *x: seen.append([now[0]] + [np.asarray(v) for v in x]), written, ctx_len, anchor,
                           base)
        drafts = jax.pure_callback(oracle_drafts, jax.ShapeDtypeStruct((rows.shape[0], k), jnp.int32), written,
                                   ctx_len, anchor)
        return pools, drafts

    monkeypatch.setattr(steps, "draft_step", recorded)
    monkeypatch.setattr(steps, "_PROGRAMS", {})  # compiled anew, with the recording
    eng = Engine(model, **{**SHAPES, "compact_decode": True}, speculative=drafter)  # one row per step: compacted
    for i, p in enumerate((a, b)):
        now[0] = i
        assert eng.generate([p], max_tokens=12, stop_ids=())[0].tokens == want[i]
    st = eng.stats()
    assert st["prefix_hit_tokens"] == 32 and st["spec_accepted"] > 0, st
    assert st["decode_steps"] < 2 * 11, st  # fewer forwards than tokens

    embed = np.asarray(model.embed_tokens[...], np.float64)
    head = np.asarray(model.lm_head[...], np.float64)
    hidden = nnx.jit(lambda m, ids: m(ids, return_hidden=True).hidden)
    taps = []
    for full in fulls:
        hs = hidden(model, jnp.asarray([full]))
        taps.append(np.concatenate([np.asarray(hs[i][0], np.float64) for i in cfg["target_layer_ids"]], axis=-1))
    checked = 0
    for i, written, ctx_len, anchor, base in seen:
        for r in np.flatnonzero(written > 0):
            c = int(ctx_len[r])
            want_base, _ = oracle.draft(cfg, tensors, embed, head, taps[i][:c], int(anchor[r]), n)
            np.testing.assert_allclose(base[r], want_base, atol=1e-4 * np.abs(want_base).max())
            checked += 1
    assert checked >= 10, checked


@pytest.mark.slow  # ~90 s on 2 cores: the demo model's programs with and without the drafter
def test_shipped_demo_drafter_in_the_engine():
    """The demo model's shipped drafter through the engine, warmed up: four chat questions it was not trained on in
    flight at once (prompts of several chunks), then a follow-up turn (a prefix hit): greedy replies equal the
    plain engine's, drafts are accepted (over 2 new tokens per verify forward and slot), and nothing compiles
    after the warm-up."""
    import os

    from kimi_jax.text import chat
    from kimi_jax.text.tokenizer import load_tokenizer

    demo = os.path.join(os.path.dirname(kimi_jax.__file__), "assets", "k3-demo")
    model = kimi_jax.from_pretrained(demo, dtype="float32", progress=False)
    tok = load_tokenizer(demo)
    qs = ["What is the zipfile module?", "How do I sort a list in Python?", "Explain recursion.",
          "What does the json module do?"]
    turns = [[{"role": "user", "content": q}] for q in qs]
    ids = [chat.encode(tok, t, add_generation_prompt=True) for t in turns]
    shapes = dict(slots=4, max_len=256, page_size=16, prefill_chunk=32, min_chunk=16)
    plain = Engine(model, tok, **shapes)
    want = plain.generate(ids, max_tokens=48)
    follow = chat.encode(tok, turns[0] + [{"role": "assistant", "content": want[0].text},
                                          {"role": "user", "content": "And the tarfile module?"}],
                         add_generation_prompt=True)
    want_follow = plain.generate([follow], max_tokens=32)[0]
    eng = Engine(model, tok, **shapes, speculative=f"dspark:{demo}-dspark,adapt=acceptance")
    eng.warmup()  # last: compiles after it are counted (by every engine of the process)
    got = eng.generate(ids, max_tokens=48)
    assert [g.tokens for g in got] == [w.tokens for w in want]
    hit = eng.generate([follow], max_tokens=32)[0]
    assert hit.tokens == want_follow.tokens and hit.cached_tokens > 0
    st = eng.stats()
    new = sum(len(g.tokens) - 1 for g in got) + len(hit.tokens) - 1
    # more than half the new tokens were accepted drafts: over 2 tokens per slot and forward
    assert st["compiles_after_warmup"] == 0 and st["spec_accepted"] > new / 2, st
    assert st["spec_accepted"] > 0.6 * st["spec_drafted"], st


def _draft_engine_run(eng, plain, prompts, V):
    """Greedy replies through ``eng`` equal ``plain``'s: requests of mixed lengths in flight (a 3-chunk prompt among
    them), a prefix hit, and a cancellation mid-reply after which the slot serves the next request correctly."""
    want = plain.generate(prompts, max_tokens=16, stop_ids=())
    got = eng.generate(prompts, max_tokens=16, stop_ids=())
    assert [g.tokens for g in got] == [w.tokens for w in want]
    if got[0].logits is not None:  # recorded: each kept token's verify row against the plain step's logits
        for g, w in zip(got, want):
            want_logits = np.asarray(w.logits)
            np.testing.assert_allclose(np.asarray(g.logits), want_logits, rtol=0,
                                       atol=1e-4 * max(1.0, float(np.abs(want_logits).max())))

    a = prompts[2]  # its prompt's snapshot at 32 tokens is a prefix hit for this one
    tail = _prompts(V, (9,), seed=2)[0]
    cold = plain.generate([a[:40] + tail], max_tokens=16, stop_ids=())[0]
    hit = eng.generate([a[:40] + tail], max_tokens=16, stop_ids=())[0]
    assert hit.cached_tokens == 32 and hit.tokens == cold.tokens

    b, c = _prompts(V, (12, 20), seed=3)
    wb, wc = (plain.generate([p], max_tokens=n, stop_ids=())[0] for p, n in ((b, 30), (c, 12)))
    _cancel_mid_reply(eng, b, wb, c, wc)
    st = eng.stats()
    assert st["slots_busy"] == 0 and st["compiles_after_warmup"] == 0 and st["spec_steps"] > 0, st
    return st


# -m slow for CI time (K3 ~100 s, Kimi Linear 70-100 s on 2 cores, mostly compiles): draft models stay in the
# default set through generate (tests/test_speculative.py::test_greedy_with_a_draft_model_equals_plain)
@pytest.mark.slow
@pytest.mark.parametrize("family", ["k3", "kimi_linear"])
def test_draft_model_in_the_engine_follows_the_target_exactly(family, models, k3_golden):
    """A model drafting for itself (``DraftModel``): its own paged cache must hold exactly what the target's does --
    after its prefills, after every verify step it follows, across its own drafting steps (whose KDA states it
    drops), a prefix hit (its snapshot and pages restored) and a cancellation -- so every draft it makes is the
    target's greedy token and is accepted; the replies are the plain engine's (K3: and the fixture's golden
    tokens)."""
    model, plain = models(family)
    V = model.cfg.vocab_size
    first = k3_golden["input_ids"].tolist() if family == "k3" else _prompts(V, (23, 11), seed=0)
    prompts = first + _prompts(V, (70, 5), seed=1)
    eng = Engine(model, **SHAPES, speculative=speculative.DraftModel(model, k=K, adapt="acceptance"),
                 record_logits=True)
    eng.warmup()
    if family == "k3":
        got = eng.generate(prompts[:2], max_tokens=k3_golden["greedy_tokens"].shape[1], stop_ids=())
        np.testing.assert_array_equal(np.array([g.tokens for g in got]), k3_golden["greedy_tokens"])
    st = _draft_engine_run(eng, plain, prompts, V)
    assert st["spec_accepted"] == st["spec_drafted"] > 0, st
    assert st["decode_steps"] * 2 < st["finished"] * 16  # about k + 1 tokens per step


@pytest.mark.slow  # ~2 min on 2 cores: another engine's programs
def test_draft_model_in_the_engine_with_rejections(models):
    """A draft model that disagrees with the target (the K3 fixture with its output head perturbed): drafts are
    rejected at every depth, the draft model's cache follows only the kept positions, and the replies stay the
    plain engine's."""
    import jax
    from flax import nnx

    model, plain = models("k3")
    V = model.cfg.vocab_size
    draft = nnx.clone(model)
    head = draft.embed_tokens if model.cfg.tie_word_embeddings else draft.lm_head
    noise = np.random.default_rng(9).standard_normal(head[...].shape)  # 40% of argmaxes agree with the target's
    head[...] = head[...] + jax.numpy.asarray(0.5 * noise * float(jax.numpy.std(head[...])), head[...].dtype)
    eng = Engine(model, **SHAPES, speculative=speculative.DraftModel(draft, k=K, adapt="acceptance"))
    eng.warmup()
    st = _draft_engine_run(eng, plain, _prompts(V, (23, 11, 70, 5), seed=0), V)
    assert 0 < st["spec_accepted"] < st["spec_drafted"], st
