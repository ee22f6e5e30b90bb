"""Structured outputs (issue 38): JSON schema, regex, choice and grammar constraints and forced tool calls, through the
grammar module, the device mask and the server, with oracles we did not write: ``jsonschema`` validates every
reply, the official ``openai`` client sends every request, llguidance's own numpy mask applier checks ours.
"""

import json
import time

import jax.numpy as jnp
import jsonschema
import llguidance.numpy as llnp
import numpy as np
import openai
import pytest

import kimi_jax
from kimi_jax.cli.demo import demo_model_dir
from kimi_jax.generation.sampling import apply_bitmask
from kimi_jax.serving import server, steps
from kimi_jax.serving.engine import Engine, Request
from kimi_jax.text import chat
from kimi_jax.text import grammar as G
from kimi_jax.text.tokenizer import load_tokenizer
from tests.structured_schemas import SCHEMAS
from tests.test_server import Served, _running

# few programs to compile (one prefill bucket, one decode batch, three table widths; each twice: plain and masked);
# max_len fits a prompt declaring two tools (~750 tokens of the demo vocabulary)
ENGINE = dict(slots=4, page_size=64, prefill_chunk=64, min_chunk=64, max_len=1024, compact_decode=False)
ASK = [{"role": "user", "content": "Answer in JSON."}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 24}, "days": {"type": "integer",
    "minimum": 1, "maximum": 7}, "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "days"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string", "maxLength": 30}, "limit": {"anyOf": [
        {"type": "integer", "minimum": 1, "maximum": 10}, {"type": "null"}]}}, "required": ["query"]}}}


@pytest.fixture(scope="module")
def demo_dir():
    return demo_model_dir()  # the shipped, trained demo model


@pytest.fixture(scope="module")
def tok(demo_dir):
    return load_tokenizer(demo_dir)


def _end(tok):
    return tok.specials[chat.END_OF_MSG]


def _walk(tok, g: G.Grammar, rng, prefix=(), n=400) -> list[int]:
    """Tokens drawn uniformly among those the guide allows (a worst-case sampler: no model to keep it sensible)."""
    guide, out = g.guide(), list(prefix)
    for t in prefix:
        assert guide.advance(t)
    row = np.zeros((g.vocab_words,), np.int32)
    for _ in range(n):
        if not guide.fill(row):
            row[:] = -1
        allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
        t = int(rng.choice(allowed))
        out.append(t)
        assert guide.advance(t), guide.error
        if t == _end(tok):
            return out
    raise AssertionError(f"no end in {n} tokens: {tok.decode(out)!r}")


# -- the grammars, without a model --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_token_path_the_grammar_allows_is_valid_json(tok, name):
    """Random walks over the allowed tokens always end in a reply whose answer validates against the schema (in the
    K3 chat format, thinking on: free thinking, then the forced channel change)."""
    schema = SCHEMAS[name]
    g = G.compile_grammar(tok, G.Constraint("json", schema), chat_reply=True, thinking=True, eos=[_end(tok)],
                          vocab_size=tok.vocab_size)
    rng = np.random.default_rng(0)
    for _ in range(3):
        ids = _walk(tok, g, rng, prefix=tok.encode("some thoughts") + [tok.specials[chat.CLOSE]], n=3000)
        reply = chat.parse_reply(tok, ids, thinking=True)
        assert reply.finished and reply.reasoning == "some thoughts"
        jsonschema.validate(json.loads(reply.content), schema)


def test_forced_tool_calls_parse_into_valid_arguments(tok):
    rng = np.random.default_rng(1)
    for tools in ((WEATHER,), (WEATHER, SEARCH)):
        g = G.compile_grammar(tok, G.ToolCall(tools), chat_reply=True, thinking=False, eos=[_end(tok)],
                              vocab_size=tok.vocab_size)
        names = set()
        for _ in range(6):
            reply = chat.parse_reply(tok, _walk(tok, g, rng, n=3000), thinking=False)
            assert reply.finished and reply.content == "" and len(reply.tool_calls) == 1
            call = reply.tool_calls[0]
            spec = next(t for t in tools if t["function"]["name"] == call["name"])
            jsonschema.validate(call["arguments"], spec["function"]["parameters"])
            names.add(call["name"])
        assert names <= {t["function"]["name"] for t in tools}
    # the fixed pieces are the chat module's own ids (its per-segment tokenization)
    calls = [{"function": {"name": "search", "arguments": {"query": "x"}}}]
    want = chat.encode(tok, [{"role": "assistant", "content": "", "tool_calls": calls}], thinking=False,
                       add_generation_prompt=False)
    g = G.compile_grammar(tok, G.ToolCall((SEARCH,)), chat_reply=True, thinking=False, eos=[_end(tok)],
                          vocab_size=tok.vocab_size)
    start = want.index(tok.specials[chat.CLOSE], len(chat.encode(tok, [], thinking=False)))  # the empty answer's end
    guide = g.guide()
    assert all(guide.advance(t) for t in want[start:]), guide.error


@pytest.mark.parametrize("kind,value,fragment", [
    ("json", {"type": "objec"}, "objec"), ("regex", "(abc", "unclosed group"), ("grammar", "start: foo", "foo"),
    ("choice", [], "non-empty list"), ("json", ["not", "a", "schema"], "expected a JSON object")])
def test_invalid_constraints_are_named(tok, kind, value, fragment):
    with pytest.raises(G.ConstraintError, match=fragment):
        G.compile_grammar(tok, G.Constraint(kind, value), chat_reply=False, thinking=False, eos=[_end(tok)],
                          vocab_size=tok.vocab_size)


def test_draft_masks_leave_the_guide_as_it_was(tok):
    g = G.compile_grammar(tok, G.Constraint("choice", ["yes", "no"]), chat_reply=True, thinking=False,
                          eos=[_end(tok)], vocab_size=tok.vocab_size)
    guide = g.guide()
    before = np.zeros((g.vocab_words,), np.int32)
    guide.fill(before)
    good = tok.encode("yes") + [tok.specials[chat.CLOSE]]
    rows = np.zeros((len(good) + 2, g.vocab_words), np.int32)
    assert guide.fill_drafts(good, rows[: len(good) + 1]) == len(good)
    assert guide.fill_drafts(tok.encode("maybe") + good, rows) == 0  # refused at once
    after = np.zeros_like(before)
    guide.fill(after)
    np.testing.assert_array_equal(before, after)
    step = g.guide()  # the masks along the drafts are the masks one token at a time
    for j, t in enumerate(good):
        one = np.zeros_like(before)
        step.fill(one)
        np.testing.assert_array_equal(one, rows[j])
        step.advance(t)


def test_device_mask_equals_llguidance_numpy_applier(tok):
    """:func:`apply_bitmask` against llguidance's own numpy reference, over a model vocabulary wider than the
    tokenizer's (the extra ids are never allowed)."""
    g = G.compile_grammar(tok, G.Constraint("json", SCHEMAS["person"]), chat_reply=False, thinking=False,
                          eos=[_end(tok)], vocab_size=tok.vocab_size + 100)
    guide, rng = g.guide(), np.random.default_rng(2)
    masks = np.zeros((3, g.vocab_words), np.int32)
    for row in masks:
        guide.fill(row)
        allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
        guide.advance(int(rng.choice(allowed)))
    masks[2, 5] = -1  # arbitrary bits too
    logits = rng.normal(size=(3, tok.vocab_size + 100)).astype(np.float32)
    want = logits.copy()
    llnp.apply_token_bitmask_inplace(want, masks)
    np.testing.assert_array_equal(np.asarray(apply_bitmask(jnp.asarray(logits), jnp.asarray(masks))), want)
    ones = np.full_like(masks, -1)
    np.testing.assert_array_equal(np.asarray(apply_bitmask(jnp.asarray(logits), jnp.asarray(ones))), logits)


# -- the server -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(demo_dir, tok):
    model = kimi_jax.from_pretrained(demo_dir, dtype="float32", progress=False)
    engine = Engine(model, tok, structured=True, **ENGINE).start()
    with _running(server.build_app(engine, "demo")) as port:
        yield Served(engine, model, tok, "demo", port)
    engine.stop(drain=False)


def _schema_request(s: Served, name: str, seed: int):
    return s.client.chat.completions.create(
        model=s.name, messages=ASK, temperature=1.0, seed=seed, max_tokens=400,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}},
        extra_body={"chat_template_kwargs": {"thinking": False}})


def test_twenty_schemas_sampled_through_the_server_validate(served):
    """Must-show 1: every schema at temperature 1.0, through the ``openai`` client; every reply that ended parses
    and validates; the ones cut by max_tokens are counted (and must be few: the 10M-parameter demo model, sampled,
    can write a number's digits or a string's words for hundreds of tokens, which every schema here allows)."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        replies = dict(zip(SCHEMAS, pool.map(lambda n: _schema_request(served, n, 7), SCHEMAS)))
    cut = [n for n, r in replies.items() if r.choices[0].finish_reason == "length"]
    for name, r in replies.items():
        if name in cut:
            continue
        assert r.choices[0].finish_reason == "stop", (name, r)
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[name])
    print(f"\n{len(SCHEMAS) - len(cut)} of {len(SCHEMAS)} replies ended and validated; cut by max_tokens: {cut}")
    for n in cut:
        print(n, repr(replies[n].choices[0].message.content))
    assert len(cut) <= 3, cut


def test_json_object_regex_choice_and_grammar(served):
    base = dict(model=served.name, messages=ASK, temperature=1.0, seed=3, max_tokens=200,
                extra_body={"chat_template_kwargs": {"thinking": False}})
    r = served.client.chat.completions.create(**base, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    for so, check in [({"regex": "[a-z]{3,8}@example\\.(com|org)"},
                       lambda t: __import__("re").fullmatch("[a-z]{3,8}@example\\.(com|org)", t)),
                      ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
                      ({"grammar": 'start: "(" num " " op " " num ")"\nnum: /[0-9]{1,3}/\nop: "+" | "-"'},
                       lambda t: __import__("re").fullmatch(r"\([0-9]{1,3} [+-] [0-9]{1,3}\)", t))]:
        r = served.client.chat.completions.create(**{**base, "extra_body": {**base["extra_body"],
                                                                            "structured_outputs": so}})
        assert r.choices[0].finish_reason == "stop" and check(r.choices[0].message.content), (so, r)
    # streamed: the deltas join into the constrained answer
    chunks = served.client.chat.completions.create(**base, response_format={"type": "json_object"}, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)
    # completions: the constraint from the first token
    r = served.client.completions.create(model=served.name, prompt="The answer:", max_tokens=40, temperature=1.0,
                                         seed=1, extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert r.choices[0].text in ("alpha", "beta") and r.choices[0].finish_reason == "stop"


def test_forced_tool_calls(served):
    """Must-show 2: a named function's call with valid arguments; ``required`` with two tools calls one of them."""
    base = dict(model=served.name, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                temperature=1.0, max_tokens=200, extra_body={"chat_template_kwargs": {"thinking": False}})
    for seed in (1, 2):
        r = served.client.chat.completions.create(**base, seed=seed, tools=[WEATHER, SEARCH], tool_choice={
            "type": "function", "function": {"name": "get_weather"}})
        assert r.choices[0].finish_reason == "tool_calls", r
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        r = served.client.chat.completions.create(**base, seed=seed, tools=[WEATHER, SEARCH], tool_choice="required")
        (call,) = r.choices[0].message.tool_calls
        spec = {"get_weather": WEATHER, "search": SEARCH}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), spec["function"]["parameters"])
    # thinking on (greedy: the demo model's sampled thinking may not end within max_tokens): free, then the call
    r = served.client.chat.completions.create(**{**base, "extra_body": {}, "temperature": 0.0}, tools=[WEATHER, SEARCH],
                                              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r.choices[0].finish_reason == "tool_calls", r
    assert r.choices[0].message.reasoning_content and r.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_unconstrained_requests_are_untouched(served, demo_dir):
    """Must-show 3: greedy float32 tokens of an unconstrained request on the structured engine equal
    :func:`kimi_jax.generate`'s (the path before), alone and beside a constrained request; the constrained one gives
    the same reply alone and beside it."""
    tok = served.tok
    prompt = chat.encode(tok, ASK, thinking=False)
    want = kimi_jax.generate(served.model, [prompt], max_new_tokens=24, stop=[_end(tok)], tokenizer=tok).tokens[0]
    g = G.compile_grammar(tok, G.Constraint("json", SCHEMAS["weather"]), chat_reply=True, thinking=False,
                          eos=[_end(tok)], vocab_size=served.model.cfg.vocab_size)
    eng, compiled = served.engine, steps.backend_compiles()
    plain = eng.submit(Request(prompt=prompt, max_tokens=24)).result(120)
    alone = eng.submit(Request(prompt=prompt, max_tokens=120, constraint=g)).result(120)
    both = [eng.submit(Request(prompt=prompt, max_tokens=24)),
            eng.submit(Request(prompt=prompt, max_tokens=120, constraint=g))]
    together = [h.result(120) for h in both]
    assert plain.tokens == list(want) == together[0].tokens
    assert alone.tokens == together[1].tokens
    jsonschema.validate(json.loads(chat.parse_reply(tok, alone.tokens, thinking=False).content), SCHEMAS["weather"])
    assert steps.backend_compiles() == compiled  # the masked programs were compiled at warm-up


def test_errors_are_400s_naming_the_field(served):
    base = {"model": served.name, "messages": ASK, "max_tokens": 4}
    for extra, param, fragment in [
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
             "response_format", "objec"),
            ({"response_format": {"type": "xml"}}, "response_format", "response_format"),
            ({"structured_outputs": {"regex": "(abc"}}, "structured_outputs", "unclosed"),
            ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
            ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural_tag"),
            ({"tool_choice": "required"}, "tool_choice", "no tools"),
            ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
             "nope"),
            ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
             "tool_choice", "give one")]:
        r = served.http.post("/v1/chat/completions", {**base, **extra})
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["param"] == param and fragment in err["message"], (extra, err)
    assert served.engine.stats()["slots_busy"] == 0
    with pytest.raises(openai.BadRequestError, match="response_format"):
        served.client.chat.completions.create(model=served.name, messages=ASK, max_tokens=4,
                                              response_format={"type": "json_schema", "json_schema": {
                                                  "name": "x", "schema": {"type": "objec"}}})


def test_a_constraint_cut_by_max_tokens_ends_by_length(served):
    r = served.client.chat.completions.create(
        model=served.name, messages=ASK, max_tokens=3, temperature=1.0, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS["nested_order"]}},
        extra_body={"chat_template_kwargs": {"thinking": False}})
    assert r.choices[0].finish_reason == "length"


def test_speculative_decoding_under_a_constraint(served):
    """Greedy constrained replies with n-gram drafting equal those without: drafts the constraint refuses are cut
    before the verify step (the demo model repeats digits, so drafts are made, accepted, and cut where the schema's
    bound ends the number)."""
    tok = served.tok
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99999999},
              "m": {"type": "integer", "minimum": 0, "maximum": 99999999}}, "required": ["n", "m"],
              "additionalProperties": False}
    g = G.compile_grammar(tok, G.Constraint("json", schema), chat_reply=True, thinking=False, eos=[_end(tok)],
                          vocab_size=served.model.cfg.vocab_size)
    prompts = [chat.encode(tok, [{"role": "user", "content": q}], thinking=False)
               for q in ("Two numbers as JSON.", "What is 7777 times 7777?")]
    plain = [served.engine.submit(Request(prompt=p, max_tokens=80, constraint=g)) for p in prompts]
    plain = [h.result(120) for h in plain]
    spec = Engine(served.model, tok, structured=True, speculative="ngram:k=4,adapt=acceptance", **ENGINE)
    got = spec.generate(prompts, max_tokens=80, constraint=g)
    assert [c.tokens for c in got] == [c.tokens for c in plain]
    for c in got:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(chat.parse_reply(tok, c.tokens, thinking=False).content), schema)
    st = spec.stats()
    assert st["spec_drafted"] > 0 and st["spec_accepted"] > 0, st


def test_generate_with_a_constraint(demo_dir, tok):
    """``kimi_jax.generate(..., constraint=)``: a completion prompt is constrained from its first token, a chat prompt
    in its answer; wrong constraints are named before anything runs."""
    model = kimi_jax.from_pretrained(demo_dir, dtype="float32", progress=False)
    prompts = ["The colour is", chat.encode(tok, ASK, thinking=False)]
    out = kimi_jax.generate(model, prompts, 120, constraint={"json": SCHEMAS["flags"]}, tokenizer=tok,
                            temperature=1.0, seed=4)
    jsonschema.validate(json.loads(out.text[0]), SCHEMAS["flags"])
    answer = chat.parse_reply(tok, out.tokens[1], thinking=False)
    assert answer.finished and out.finish_reason == ["stop", "stop"]
    jsonschema.validate(json.loads(answer.content), SCHEMAS["flags"])
    with pytest.raises(ValueError, match="unclosed group"):
        kimi_jax.generate(model, "x", 4, constraint={"regex": "(a"}, tokenizer=tok)
    with pytest.raises(ValueError, match="constraint: give"):
        kimi_jax.generate(model, "x", 4, constraint={"xml": "a"}, tokenizer=tok)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        kimi_jax.generate(model, [1, 2], 4, constraint={"regex": "a"})


def test_a_cancelled_constrained_request_frees_its_slot(served):
    """Cancelled mid-reply (its guide dropped with the slot), then the same constraint again: the engine is idle in
    between and the second reply is the one the request gives alone."""
    tok, eng = served.tok, served.engine
    g = G.compile_grammar(tok, G.Constraint("json", SCHEMAS["list_of_people"]), chat_reply=True, thinking=False,
                          eos=[_end(tok)], vocab_size=served.model.cfg.vocab_size)
    prompt = chat.encode(tok, [{"role": "user", "content": "People as JSON."}], thinking=False)
    h = eng.submit(Request(prompt=prompt, max_tokens=200, temperature=1.0, seed=9, constraint=g))
    for ev in h.events(timeout=120):
        if ev.tokens:
            h.cancel()
            break
    assert h.result(120).finish_reason == "abort"
    deadline = time.monotonic() + 60
    while eng.stats()["slots_busy"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert eng.stats()["slots_busy"] == 0
    again = eng.submit(Request(prompt=prompt, max_tokens=200, temperature=1.0, seed=9, constraint=g)).result(120)
    if again.finish_reason == "stop":
        jsonschema.validate(json.loads(chat.parse_reply(tok, again.tokens, thinking=False).content),
                            SCHEMAS["list_of_people"])
    assert again.finish_reason in ("stop", "length")
