"""Long prompts through ``kimi_jax.generate``: chunked prefill and the memory budget (issue 36).

* a memory budget the one-call prefill does not fit makes ``generate`` prefill in chunks that fit, and the chunked
  prefill gives the K3 fixture's golden logits and greedy tokens, and the one-call prefill's, with prompts of
  different lengths ending in different chunks (the KDA state and conv tails carried from chunk to chunk);
* a 100,000-token prompt on the tiny K3 is refused before anything is allocated when its cache does not fit the
  budget, and planned in chunks that fit a larger one (running it is the GPU check in benchmarks/long_prompt.py:
  on this CPU its attention alone is ~4e13 flops).
"""

import dataclasses

import jax
import pytest

import kimi_jax
from kimi_jax.generation import generate as G
from kimi_jax.generation.generate import GenerationError, Generator
from tests.parity import assert_close

TOL = 5e-4  # as tests/test_generate.py: decode-step logits vs the golden full forward (float32)
S = 128  # the cache length of the chunked run
LONG = 100_000


@pytest.fixture(scope="module")
def model(k3_tiny_a):
    return kimi_jax.from_pretrained(k3_tiny_a, dtype="float32", progress=False)


def _compiles():
    """A list that grows by one name per XLA compilation from now on."""
    seen = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *a, **k: seen.append(name) if name == "/jax/core/compile/backend_compile_duration" else None)
    return seen


def test_budget_prefills_in_chunks_that_match_the_golden_forward(model, k3_golden):
    """Prompts of 80 and 24 tokens in a 128-token cache with a memory budget of half what the one-call prefill needs
    (XLA's count of the compiled programs): ``generate`` prefills in the longest power-of-two chunks that fit, the
    80-token prompt's KDA state and conv tails carried from chunk to chunk, the 24-token prompt ending in an earlier
    chunk (its cache left alone after). The first tokens' logits are the golden forward's at the prompts' last
    positions, the 24-token prompt's 16 decode steps the golden ``logits_full`` and its greedy tokens the golden
    ones, and everything equals the one-call prefill's."""
    g = k3_golden
    ids, new = [g["input_ids_long"][0].tolist(), g["input_ids"][0].tolist()], [4, 16]
    one = Generator(model, max_len=S)
    whole = one.plan(ids, new, stop=(), record_logits=True)
    assert (whole.chunk, whole.calls) == (S, 1)
    budget = (whole.cache_bytes + whole.working_bytes) // 2  # rules out the one-call prefill
    chunked = Generator(model, max_len=S, memory_budget=budget)
    plan = chunked.plan(ids, new, stop=(), record_logits=True)
    assert plan.calls == -(-80 // plan.chunk) >= 2 and 24 <= plan.chunk * (plan.calls - 1)  # 24 tokens end first
    assert plan.cache_bytes + plan.working_bytes <= budget == plan.limit
    r = chunked.generate(ids, new, stop=(), record_logits=True)
    assert (r.timings["prefill_chunk"], r.timings["prefill_calls"]) == (plan.chunk, plan.calls)
    assert_close(r.logits[0][0], g["logits_long"][0, 79], TOL, "first token after 80 chunked tokens vs golden")
    err = assert_close(r.logits[1], g["logits_full"][0, 23:39], TOL, "chunked prefill + decode vs golden")
    assert r.tokens[1] == g["greedy_tokens"][0].tolist()
    a = one.generate(ids, new, stop=(), record_logits=True)
    assert r.tokens == a.tokens
    for i in range(2):
        assert_close(r.logits[i], a.logits[i], 1e-4, f"prompt {i}: chunked vs one-call prefill")
    print(f"one call: {(whole.cache_bytes + whole.working_bytes) / 1e6:.1f} MB; chunks of {plan.chunk}: "
          f"{(plan.cache_bytes + plan.working_bytes) / 1e6:.1f} MB (budget {budget / 1e6:.1f} MB); "
          f"max |step logits - golden| = {err:.3g}")


def test_chunked_prefill_with_the_cache_in_host_memory(k3_tiny_a, k3_golden):
    """``RunConfig(offload=("kda_state", "cache"))``: the chunks' cache stays in host memory from the restart through
    the first token to decode (a first token that took the cache in once handed decode a device copy, and the run
    aborted), and gives the golden greedy tokens, twice over the same kept cache."""
    model = kimi_jax.from_pretrained(k3_tiny_a, run=kimi_jax.RunConfig(dtype="float32", offload=("kda_state", "cache")),
                                     progress=False)
    gen = Generator(model, max_len=64, prefill_chunk=8)
    for _ in range(2):
        r = gen.generate(k3_golden["input_ids"], 16, stop=())
        assert r.timings["prefill_calls"] == 3
        assert r.tokens == k3_golden["greedy_tokens"].tolist()


_ON_A_MESH = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import kimi_jax
from safetensors.numpy import load_file
from kimi_jax.generation.generate import Generator
from kimi_jax.parallel import sharding
path = sys.argv[1]
g = load_file(os.path.join(path, "golden.safetensors"))
for mesh in [(2, 1, 2), (1, 2, 2)]:
    model = kimi_jax.from_pretrained(path, dtype="float32", mesh=sharding.make_mesh(*mesh), progress=False)
    gen = Generator(model, max_len=64, prefill_chunk=8)
    for _ in range(2):
        r = gen.generate(g["input_ids"], 16, stop=())
        assert r.timings["prefill_calls"] == 3 and r.tokens == g["greedy_tokens"].tolist(), (mesh, r.tokens)
print("ok")
"""


@pytest.mark.slow
def test_chunked_prefill_on_a_mesh(k3_tiny_a):
    """A sharded model (4 CPU devices, data x model and expert x model): the chunks' cache and last logits keep their
    shardings from call to call (the programs are compiled for them), and the tokens are the golden ones."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", _ON_A_MESH, k3_tiny_a], cwd=root, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_100k_prompt_refused_before_allocation(model, monkeypatch):
    """A budget smaller than the cache for the context (131072 tokens, 76 MB): refused naming both, before anything
    is compiled or allocated; a context past the model's max_position_embeddings is refused naming it."""
    ids = [3 + i % 500 for i in range(LONG)]
    monkeypatch.setattr(G, "init_cache", lambda *a, **k: pytest.fail("a cache was allocated"))
    compiles = _compiles()
    with pytest.raises(GenerationError, match=r"the cache for 1 sequence\(s\) x 131072 tokens needs 0.08 GB per "
                                              r"device .* but the memory budget is 0.05 GB \(memory_budget\)"):
        kimi_jax.generate(model, ids, 4, memory_budget=50_000_000)
    gen = Generator(model, max_len=131072)
    gen.cfg = dataclasses.replace(model.cfg, max_position_embeddings=65536)
    with pytest.raises(GenerationError, match=r"100004 tokens exceeds the model's context of 65536"):
        gen.generate(ids, 4)
    assert not compiles


def test_100k_prompt_planned_in_bounded_memory(model, monkeypatch):
    """With a budget of 2 GB the 100,000-token prompt is planned in 391 chunks of 256 tokens whose cache and working
    memory fit it (the one-call prefill would need ~0.8 TB); nothing is allocated."""
    ids = [3 + i % 500 for i in range(LONG)]
    monkeypatch.setattr(G, "init_cache", lambda *a, **k: pytest.fail("a cache was allocated"))
    budget = 2_000_000_000
    plan = Generator(model, max_len=131072, prefill_chunk=256, memory_budget=budget).plan(ids, 4, stop=())
    assert (plan.chunk, plan.calls) == (256, 391)
    assert plan.cache_bytes + plan.working_bytes <= budget
    print(f"100k tokens in chunks of 256: {(plan.cache_bytes + plan.working_bytes) / 1e9:.2f} GB")


@pytest.mark.slow
def test_100k_prompt_refused_when_no_chunk_fits(model):
    """A budget that holds the cache but not even a 16-token chunk's working memory (the attention of a chunk reads
    the whole 131072-token cache): refused naming the chunk, the cache and the budget."""
    ids = [3 + i % 500 for i in range(LONG)]
    gen = Generator(model, max_len=131072, prefill_chunk=16, memory_budget=150_000_000)
    with pytest.raises(GenerationError, match=r"prefilling 1 sequence\(s\) of up to 100000 tokens needs [0-9.]+ GB "
                                              r"per device even in chunks of 16 tokens .* but the memory budget is "
                                              r"0.15 GB"):
        gen.generate(ids, 4)


def test_bad_chunk_and_budget_refused(model):
    with pytest.raises(GenerationError, match="prefill_chunk must be >= 1"):
        Generator(model, prefill_chunk=0)
    with pytest.raises(GenerationError, match="memory_budget must be a positive number of bytes"):
        Generator(model, memory_budget=-5)
