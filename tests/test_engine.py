"""The serving engine (kimi_jax/serving/engine.py), float32, against oracles we did not write and against itself.

* several requests of different lengths in flight at once (chunked prefill, paged cache) give HF transformers'
  greedy tokens and step logits (Llama, Kimi Linear), and the K3 fixture's golden ones;
* prefix caching: a request served from a prefix hit equals the same request on a cold engine (every step's
  logits within 1e-5, tokens identical), for hits on a chunk boundary and inside a chunk and a page, for a request
  that shares the pages of one still decoding, and under eviction pressure; for the three families;
* no compiles after warm-up under mixed traffic; a long prompt's chunks interleave with the others' decode steps;
  seeded sampling does not depend on the slot; stop strings, cancellation, bad input.
"""

import threading

import numpy as np
import pytest

import kimi_jax
from kimi_jax.serving.engine import Engine, EngineError, Request
from tests.parity import assert_close
from tests.test_generate import NEW, TOL, _hf_generate

HIT_TOL = 1e-5  # the bound: prefix hit vs cold, float32 logits of every step
# one compiled shape set shared by every engine here (same slots, pages and chunk buckets); every decode step over all
# slots, so two engines give a request the same float32 numerics whoever decodes beside it (the 1e-5 comparisons)
SHAPES = dict(slots=4, max_len=96, page_size=16, prefill_chunk=32, min_chunk=32, record_logits=True,
              compact_decode=False)


@pytest.fixture(scope="module")
def families(k3_tiny_a, hf_llama, hf_kimi_linear):
    out = {"k3": (kimi_jax.from_pretrained(k3_tiny_a, dtype="float32"), None)}
    for name, (path, hf_model) in (("llama", hf_llama), ("kimi_linear", hf_kimi_linear)):
        out[name] = (kimi_jax.from_pretrained(path, dtype="float32"), hf_model)
    return out


@pytest.fixture(scope="module")
def engines(families):
    """Per family: (an engine with prefix caching, the same engine shapes without it)."""
    made = {}

    def get(family):
        if family not in made:
            model = families[family][0]
            made[family] = (Engine(model, **SHAPES), Engine(model, **SHAPES, prefix_cache_bytes=0))
            made[family][0].warmup()
        return made[family]

    return get


def _prompts(V, lengths, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, V, n).tolist() for n in lengths]


@pytest.mark.parametrize("compact", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_k3_in_flight_matches_golden(compact, families, engines, k3_golden):
    """``compact``: decode steps with fewer active slots run a smaller batch of just them (rows gathered)."""
    g = k3_golden
    eng = engines("k3")[0] if not compact else Engine(families["k3"][0], **{**SHAPES, "compact_decode": True})
    fixture = g["input_ids"].tolist()
    others = _prompts(eng.cfg.vocab_size, (70, 5), seed=1)  # a 3-chunk prompt in flight beside them
    out = eng.generate(fixture + others, max_tokens=NEW, stop_ids=())
    ours = np.stack([o.logits for o in out[:2]])
    assert_close(ours, g["decode_logits"], TOL, "engine step logits vs golden decode_logits")
    assert_close(ours, g["logits_full"][:, 23:39], TOL, "engine step logits vs golden full forward")
    np.testing.assert_array_equal(np.array([o.tokens for o in out[:2]]), g["greedy_tokens"])
    assert [o.finish_reason for o in out] == ["length"] * 4
    if compact:
        assert eng.row_buckets == (1, 4)


@pytest.mark.parametrize("family", ["llama", "kimi_linear"])
def test_hf_in_flight_matches_hf(family, families, engines):
    _, hf_model = families[family]
    eng, _ = engines(family)
    prompts = _prompts(eng.cfg.vocab_size, (11, 40, 5, 67), seed=2)
    out = eng.generate(prompts, max_tokens=NEW, stop_ids=())
    for p, o in zip(prompts, out):
        tokens, step_logits, _ = _hf_generate(hf_model, np.array([p]), NEW)
        assert_close(o.logits, step_logits[0], TOL, f"{family}: engine step logits vs HF generate ({len(p)} tokens)")
        assert o.tokens == tokens[0].tolist()


def _alone(cold: Engine, prompt, **kw):
    return cold.generate([prompt], max_tokens=8, stop_ids=(), **kw)[0]


def _same(hit, cold, what):
    assert hit.tokens == cold.tokens, what
    assert_close(hit.logits, cold.logits, HIT_TOL, what)


def _run_until(eng: Engine, cond, limit=200):
    for _ in range(limit):
        if cond():
            return
        eng.step()
    raise AssertionError("engine did not get there")


@pytest.mark.parametrize("family", ["k3", "kimi_linear", "llama"])
def test_prefix_hit_equals_cold(family, engines):
    eng, cold = engines(family)
    eng.prefix.clear()
    V = eng.cfg.vocab_size
    a, tail1, tail2, shared, t3, t4 = _prompts(V, (45, 10, 20, 37, 9, 14), seed=3)
    first = eng.generate([a], max_tokens=8, stop_ids=())[0]  # stores snapshots at 32 and 45
    _same(first, _alone(cold, a), f"{family}: cold request on the prefix engine")
    mid = eng.generate([a + tail1], max_tokens=8, stop_ids=())[0]  # hit at 45: inside a chunk and a page
    assert mid.cached_tokens == 45
    _same(mid, _alone(cold, a + tail1), f"{family}: hit ending inside a chunk and a page")
    edge = eng.generate([a[:40] + tail2], max_tokens=8, stop_ids=())[0]  # hit at 32: the chunk boundary
    assert edge.cached_tokens == 32
    _same(edge, _alone(cold, a[:40] + tail2), f"{family}: hit on a chunk boundary")

    # two requests diverging after a shared prefix; the second shares the pages of the first while it decodes
    d = eng.submit(Request(shared + t3, max_tokens=12, stop_ids=()))
    _run_until(eng, lambda: any(s is not None and s.decoding for s in eng.running))
    e = eng.submit(Request(shared + t4, max_tokens=8, stop_ids=()))
    _run_until(eng, lambda: d.finished and e.finished)
    rd, re_ = d.result(), e.result()
    assert re_.cached_tokens == 32
    _same(rd, cold.generate([shared + t3], max_tokens=12, stop_ids=())[0], f"{family}: first of two diverging")
    _same(re_, _alone(cold, shared + t4), f"{family}: second of two diverging (hit)")
    assert eng.stats()["slots_busy"] == 0


def test_follow_up_turn_hits_the_finished_reply(engines):
    """A finished request leaves its prompt and reply in the prefix cache: the next turn (prompt + reply + more)
    restores all of it and matches a cold engine."""
    eng, cold = engines("kimi_linear")
    eng.prefix.clear()
    first, more = _prompts(eng.cfg.vocab_size, (21, 6), seed=11)
    reply = eng.generate([first], max_tokens=9, stop_ids=())[0].tokens
    turn = first + reply + more
    hit = eng.generate([turn], max_tokens=8, stop_ids=())[0]
    assert hit.cached_tokens == len(first) + len(reply) - 1
    _same(hit, _alone(cold, turn), "follow-up turn")


@pytest.mark.parametrize("host", [pytest.param(False, marks=pytest.mark.slow), True])
def test_prefix_eviction_under_pressure(host, families, engines):
    """A small snapshot budget: entries are evicted (or spilled to host memory and restored from there) all along,
    and every answer stays the cold one."""
    model = families["k3"][0]
    _, cold = engines("k3")
    one = sum(a.size * a.dtype.itemsize for a in __import__("jax").tree.leaves(
        cold.cache.layers[0])) // cold.slots  # one KDA layer's state + tails for one slot
    n_kda = sum(k == "kda" for k in model.cfg.attn_types)
    snap = one * n_kda
    budgets = dict(prefix_cache_bytes=2 * snap, prefix_host_bytes=4 * snap) if host else dict(prefix_cache_bytes=6 * snap)
    eng = Engine(model, **SHAPES, **budgets)  # room for 6 snapshots: on the device, or 2 there and 4 on the host
    eng.warmup()
    V = model.cfg.vocab_size
    bases = _prompts(V, (40, 50), seed=4)  # each request stores 3 snapshots (32, its prompt, its reply): evictions
    rng = np.random.default_rng(5)
    for k in range(9):
        base = bases[k % 2]
        prompt = base[: int(rng.integers(33, len(base) + 1))] + rng.integers(3, V, 5).tolist()
        got = eng.generate([prompt], max_tokens=6, stop_ids=())[0]
        want = cold.generate([prompt], max_tokens=6, stop_ids=())[0]
        _same(got, want, f"request {k} under eviction pressure")
    st = eng.stats()
    assert st["prefix_evictions"] > 0 and st["prefix_hits"] > 0
    assert st["prefix_entries"] <= 6 and st["prefix_bytes"] + st["prefix_host_bytes"] <= 6 * snap
    if host:
        assert st["prefix_spills"] > 0 and st["prefix_bytes"] <= 2 * snap and st["prefix_host_bytes"] <= 4 * snap
    held = {p for e in eng.prefix.entries.values() for p in e.pages}
    assert st["pages_free"] == eng.n_pages - len(held)  # nothing leaked


def test_no_recompiles_under_mixed_traffic(families, engines):
    engines("k3")  # the shapes compiled
    eng = Engine(families["k3"][0], **SHAPES).start()
    V = eng.cfg.vocab_size
    rng = np.random.default_rng(6)
    try:
        handles, lock = [], threading.Lock()

        def client(c):
            for k in range(4):
                n = int(rng.integers(1, 80))
                req = Request(rng.integers(3, V, n).tolist(), max_tokens=int(rng.integers(1, 96 - n)),
                              temperature=float(rng.choice([0.0, 0.8])), top_k=int(rng.choice([0, 5])),
                              top_p=float(rng.choice([1.0, 0.9])), seed=c * 10 + k, stop_ids=(int(rng.integers(3, V)),))
                h = eng.submit(req)
                with lock:
                    handles.append(h)
                if k == 1 and c == 0:
                    h.cancel()

        threads = [threading.Thread(target=client, args=(c,)) for c in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results = [list(h.events(timeout=300))[-1].finish_reason for h in handles]
    finally:
        eng.stop()
    assert len(results) == 20 and set(results) <= {"stop", "length", "abort"}
    st = eng.stats()
    assert st["compiles_after_warmup"] == 0, st
    assert st["slots_busy"] == 0 and st["waiting"] == 0


def test_long_prompt_interleaves_with_decode(engines):
    eng, _ = engines("k3")
    V = eng.cfg.vocab_size
    short, long = _prompts(V, (4, 90), seed=7)
    a = eng.submit(Request(short, max_tokens=6, stop_ids=()))
    _run_until(eng, lambda: any(s is not None and s.decoding for s in eng.running))
    b = eng.submit(Request(long, max_tokens=1, stop_ids=()))
    a._take()  # its tokens so far
    got = []
    while not b.finished:
        eng.step()
        got.append(sum(len(ev.tokens) for ev in a._take()))
    # every step ran one of the long prompt's 3 chunks and gave the short request a token
    assert len(got) == 3 and all(n == 1 for n in got), got
    _run_until(eng, lambda: a.finished)


def test_seeded_sampling_does_not_depend_on_the_slot(engines):
    eng, cold = engines("k3")
    V = eng.cfg.vocab_size
    p, *others = _prompts(V, (9, 30, 12, 5), seed=8)
    kw = dict(max_tokens=10, temperature=1.0, top_p=0.95, seed=1234, stop_ids=())
    alone = cold.generate([p], **kw)[0]
    crowd = [Request(o, max_tokens=10, temperature=0.7, seed=7, stop_ids=()) for o in others]
    handles = [eng.submit(r) for r in crowd[:2]] + [eng.submit(Request(p, **kw))] + [eng.submit(crowd[2])]
    _run_until(eng, lambda: all(h.finished for h in handles))
    assert handles[2].result().tokens == alone.tokens
    assert cold.generate([p], **{**kw, "seed": 99})[0].tokens != alone.tokens


def test_cancel_frees_slot_and_pages(engines):
    eng, _ = engines("k3")
    eng.prefix.clear()
    free = eng.stats()["pages_free"]
    h = eng.submit(Request(_prompts(eng.cfg.vocab_size, (50,), seed=9)[0], max_tokens=40, stop_ids=()))
    _run_until(eng, lambda: any(s is not None and s.decoding for s in eng.running))
    h.cancel()
    eng.step()
    assert list(h.events(timeout=1))[-1].finish_reason == "abort"
    eng.prefix.clear()
    st = eng.stats()
    assert st["slots_busy"] == 0 and st["pages_free"] == free


def test_bad_requests(engines):
    eng, _ = engines("k3")
    V = eng.cfg.vocab_size
    cases = [(Request([]), "empty"), (Request([V]), "outside the vocabulary"),
             (Request([1] * 90, max_tokens=10), "maximum context length of 96 tokens"), (Request([1], max_tokens=0), "max_tokens"),
             (Request([1], temperature=-1), "temperature"), (Request([1], top_p=0), "top_p"),
             (Request([1], top_k=-2), "top_k"), (Request([1], seed=2**32), "seed"),
             (Request([1], stop_ids=(V + 5,)), "stop ids"), (Request([1], stop_strings=("x",)), "tokenizer"),
             (Request("abc"), "token ids")]
    for req, msg in cases:
        with pytest.raises(EngineError, match=msg):
            eng.submit(req)


@pytest.mark.slow  # the server tests check stop strings over HTTP on the same engine code
def test_stop_strings_and_text(tmp_path):
    from kimi_jax.cli.demo import build_demo_checkpoint
    from kimi_jax.text.tokenizer import load_tokenizer

    path = build_demo_checkpoint(tmp_path / "demo")
    tok = load_tokenizer(path)
    eng = Engine(kimi_jax.from_pretrained(path, dtype="float32"), tok, slots=2, max_len=64, page_size=16,
                 prefill_chunk=32, min_chunk=32)
    prompt = tok.encode("The quick brown fox")
    full = eng.generate([prompt], max_tokens=24, stop_ids=())[0]
    assert full.text == tok.decode(full.tokens)
    stop = full.text[len(full.text) // 2 :][:3]
    cut = eng.generate([prompt], max_tokens=24, stop_ids=(), stop_strings=(stop,))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert full.tokens[: len(cut.tokens)] == cut.tokens


@pytest.mark.slow
def test_scanned_layers_give_the_same_answers(k3_tiny_a, engines):
    """A model with scanned layers (stacked KDA state and page pools) serves the same tokens and logits, prefix hits
    included (the scanned run of the fixture holds KDA layers)."""
    _, cold = engines("k3")
    model = kimi_jax.from_pretrained(k3_tiny_a, dtype="float32", scan_layers=True)
    assert model.plan.count and any(model.cfg.attn_types[i] == "kda" for i in model.plan.scanned)
    eng = Engine(model, **SHAPES)
    a, tail = _prompts(eng.cfg.vocab_size, (45, 4), seed=10)
    first, hit = eng.generate([a], max_tokens=8, stop_ids=())[0], eng.generate([a + tail], max_tokens=8, stop_ids=())[0]
    assert hit.cached_tokens == 45
    _same(first, _alone(cold, a), "scanned layers")
    _same(hit, _alone(cold, a + tail), "scanned layers, prefix hit")


@pytest.mark.slow  # 90 s (two 8-device engines in a subprocess); run with -m slow
@pytest.mark.parametrize("mesh,state_spec", [("2x1x4", "P('data', 'model')"), ("1x8x1", "P()")])
def test_engine_on_a_mesh_equals_one_device(k3_tiny_a, mesh, state_spec):
    """The engine with a model sharded over 8 simulated devices (data x expert x model): the same tokens and logits
    as on one device, prefix hits included, KDA state split over the mesh, and no compile after warm-up (every
    written cache keeps its sharding). KDA state: slots over data, heads over model (whole on an expert-only mesh)."""
    r = _mesh_worker(k3_tiny_a, mesh)
    assert r["tokens_equal"] and r["max_diff"] < TOL, r
    assert r["cached"] == [0, 0, 45, 20], r
    assert r["compiles_after_warmup"] == 0, r
    assert r["state_sharding"] == state_spec, r


@pytest.mark.slow  # ~3-5 min on 2 cores (two 8-device engines with a drafter in a subprocess)
def test_dspark_engine_on_a_mesh_equals_one_device(k3_tiny_a, tmp_path):
    """A DSpark drafter in the engine on a data x model mesh (its weights split by their logical axes, its context
    pools replicated as the target's latent pools are): the same greedy tokens as on one device, prefix hits
    included, drafts verified, no compile after warm-up."""
    import json
    import os

    from tests import dspark_oracle as oracle
    from tests.test_dspark import _write

    with open(os.path.join(k3_tiny_a, "config.json")) as f:
        target = json.load(f)["text_config"]
    H = target["hidden_size"]
    cfg = oracle.tiny_config(target["vocab_size"], hidden_size=H, target_hidden_size=H, target_layer_ids=[1, 4, 8],
                             num_target_layers=3, block_size=3)
    drafter = _write(tmp_path, cfg, oracle.random_checkpoint(cfg, seed=2))
    r = _mesh_worker(k3_tiny_a, "2x1x4", f"dspark:{drafter},adapt=acceptance")
    assert r["tokens_equal"] and r["cached"] == [0, 0, 45, 20] and r["compiles_after_warmup"] == 0, r
    assert r["spec"]["spec_steps"] > 0, r
    assert r["drafter_o_proj"] == "P(None, 'model')", r  # its 4 heads over model=4


def _mesh_worker(path, mesh, *drafter):
    """tests/engine_mesh_worker.py (the model at ``path``, a ``mesh`` of 8 CPU devices such as ``"2x1x4"``, a
    drafter if given) in a subprocess: its JSON result."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "tests.engine_mesh_worker", path, mesh, *drafter], cwd=root,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # ~3-5 min on 2 cores (two 8-device engines with a draft model in a subprocess)
def test_draft_model_engine_on_a_mesh_equals_one_device(k3_tiny_a):
    """A draft model in the engine on a data x model mesh (the K3 fixture drafting for itself; named by its path, so
    read onto the target's mesh: its weights and its cache split as the target's): the same greedy tokens as on one
    device, prefix hits included, every draft accepted, no compile after warm-up."""
    r = _mesh_worker(k3_tiny_a, "2x1x4", f"draft:{k3_tiny_a},k=3,adapt=acceptance")
    assert r["tokens_equal"] and r["cached"] == [0, 0, 45, 20] and r["compiles_after_warmup"] == 0, r
    assert r["draft_state_sharding"] == r["state_sharding"] == "P('data', 'model')", r
    assert r["spec"]["spec_accepted"] == r["spec"]["spec_drafted"] > 0, r


def test_prefix_pages_spill_to_host_and_come_back(families, engines):
    """A pool of 8 pages of 16 tokens: a second conversation needs the pages the first one's prefix entries hold, so
    their cache pages move to host memory (not dropped); the first conversation's next turn then hits its stored
    reply, whose pages are written back from host memory. It answers exactly as the same requests on an engine whose
    pool never runs short (same tokens, the same float32 logits bit for bit), and with the cold engine's tokens.
    (Against the cold engine this K3 follow-up differs by 2e-5 with or without the spill: the hit prefills from
    token 52, the cold run in chunks of 32, and KDA's float32 sums follow the chunks.)"""
    model = families["k3"][0]
    roomy, cold = engines("k3")
    roomy.prefix.clear()
    eng = Engine(model, **{**SHAPES, "pages": 8}, prefix_cache_bytes=1 << 30, prefix_host_bytes=1 << 30)
    eng.warmup()
    V = model.cfg.vocab_size
    first, other, more = _prompts(V, (45, 60, 6), seed=21)
    out = {}
    for e in (eng, roomy):
        reply = e.generate([first], max_tokens=8, stop_ids=())[0].tokens
        e.generate([other], max_tokens=8, stop_ids=())
        if e is eng:
            st = eng.stats()
            assert st["prefix_page_spills"] > 0 and st["prefix_evictions"] == 0  # spilled, not dropped
        turn = first + reply + more
        out[e is eng] = e.generate([turn], max_tokens=8, stop_ids=())[0]
    hit = out[True]
    assert hit.cached_tokens == out[False].cached_tokens == len(first) + len(reply) - 1
    assert hit.tokens == out[False].tokens == _alone(cold, turn).tokens
    np.testing.assert_array_equal(np.asarray(hit.logits), np.asarray(out[False].logits))
    st = eng.stats()
    assert st["prefix_page_restores"] > 0 and st["compiles_after_warmup"] == 0
    assert roomy.stats()["prefix_page_spills"] == 0
    held = {p for e in eng.prefix.entries.values() for p in e.pages}
    assert st["pages_free"] == eng.n_pages - len(held)  # nothing leaked
    spilled = sum(e.page_nbytes for e in eng.prefix.entries.values())
    snapshots = sum(e.nbytes for e in eng.prefix.entries.values() if e.on_host)
    assert st["prefix_host_bytes"] == spilled + snapshots


def test_a_failed_step_keeps_spilling_prefix_pages_to_host(families, engines):
    """A step that fails ends its requests with an error and the engine starts over on fresh device state; its
    prefix cache must still move pages to host memory when the pool runs short (it once came back without its page
    reader, so pages were silently dropped instead), and the next turn still hits the spilled reply."""
    model = families["k3"][0]
    _, cold = engines("k3")
    eng = Engine(model, **{**SHAPES, "pages": 8}, prefix_cache_bytes=1 << 30, prefix_host_bytes=1 << 30)
    eng.warmup()
    real = eng.executor.programs

    def broken(*args, **kw):
        raise RuntimeError("injected device failure")

    eng.executor.programs = real._replace(prefill_chunk=broken)
    eng.start(warmup=False)
    try:
        V = model.cfg.vocab_size
        first, other, more = _prompts(V, (45, 60, 6), seed=21)
        with pytest.raises(RuntimeError, match="injected device failure"):
            eng.generate([first], max_tokens=4, stop_ids=(), timeout=120)
        eng.executor.programs = real
        reply = eng.generate([first], max_tokens=8, stop_ids=(), timeout=120)[0].tokens
        eng.generate([other], max_tokens=8, stop_ids=(), timeout=120)  # needs the pages the first one's entries hold
        st = eng.stats()
        assert st["prefix_page_spills"] > 0 and st["prefix_evictions"] == 0, st  # spilled, not dropped
        turn = first + reply + more
        hit = eng.generate([turn], max_tokens=8, stop_ids=(), timeout=120)[0]
    finally:
        eng.stop()
    assert hit.cached_tokens == len(first) + len(reply) - 1
    assert hit.tokens == _alone(cold, turn).tokens
    assert eng.stats()["prefix_page_restores"] > 0 and eng.stats()["compiles_after_warmup"] == 0
