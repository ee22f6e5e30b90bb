"""DSpark drafters (kimi_jax/model/dspark.py, kimi_jax/checkpoint/drafter.py, the speculative loop): against a
float64 numpy oracle written from the spec (tests/dspark_oracle.py), loaded from the released ``k3_dspark`` layout,
refused by name when they do not fit, and drafting inside ``generate`` from the context the target's forwards wrote.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kimi_jax
from kimi_jax.checkpoint.drafter import load_drafter
from kimi_jax.checkpoint.names import WeightError
from kimi_jax.checkpoint.safetensors_write import Entry, write_file
from kimi_jax.checkpoint.synthetic import write_checkpoint
from kimi_jax.generation import speculative
from kimi_jax.generation.generate import GenerationError, Generator
from kimi_jax.model import dspark
from kimi_jax.model.dspark import DSparkConfigError
from kimi_jax.model.run import RunConfig
from tests import dspark_oracle as oracle

DEMO = os.path.join(os.path.dirname(kimi_jax.__file__), "assets", "k3-demo")
DEMO_DRAFTER = os.path.join(os.path.dirname(kimi_jax.__file__), "assets", "k3-demo-dspark")


def _write(path, cfg: dict, tensors: dict, rename=None):
    os.makedirs(path, exist_ok=True)
    named = {(rename(n) if rename else n): a for n, a in tensors.items()}
    write_file(os.path.join(path, "model.safetensors"), [Entry(n, "F32", a.shape) for n, a in named.items()],
               lambda e: named[e.name])
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(path)


def _nemo_names(name: str) -> str:
    """Another producer's spelling (docs/generation.md (DSpark drafters)): a ``model.`` prefix, ``fc`` / ``hidden_norm`` / ``norm``."""
    stem = {"context_proj.weight": "fc.weight", "context_norm.weight": "hidden_norm.weight",
            "final_norm.weight": "norm.weight"}.get(name, name)
    return "model." + stem


@pytest.mark.parametrize("causal,rename", [(False, None), (True, _nemo_names)], ids=["noncausal", "causal-aliases"])
def test_drafter_equals_the_float64_oracle(tmp_path, causal, rename):
    cfg = oracle.tiny_config(96, causal=causal, block_size=5)
    tensors = oracle.random_checkpoint(cfg, seed=3)
    model = load_drafter(_write(tmp_path, cfg, tensors, rename))
    embed, head, taps = oracle.random_target(cfg, seed=4, T=11)
    for T, anchor in [(11, 7), (4, 90), (1, 0)]:
        base, drafts = oracle.draft(cfg, tensors, embed, head, taps[:T], anchor, 5)
        cache = model.write_context(model.empty_cache(2, 16), jnp.asarray(np.stack([taps, taps])),
                                    jnp.zeros((2,), jnp.int32), jnp.array([T, 11]))
        args = (cache, jnp.asarray(embed), jnp.asarray(head), jnp.array([anchor, anchor]), jnp.array([T, 11]), 5)
        got = np.asarray(model.base_logits(*args))[0]
        np.testing.assert_allclose(got, base, atol=2e-5 * np.abs(base).max())
        assert np.asarray(model.draft(*args))[0].tolist() == drafts


def test_rope_is_interleaved():
    x = jnp.arange(8, dtype=jnp.float32).reshape(1, 8)
    got = np.asarray(dspark.rope_interleaved(x, jnp.array([3]), 10000.0))[0]
    want = oracle.rope_interleaved(np.arange(8, dtype=np.float64).reshape(1, 8), np.array([3]), 10000.0)[0]
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_refusals_name_the_culprit(tmp_path, k3_tiny_a):
    cfg = oracle.tiny_config(96)
    tensors = oracle.random_checkpoint(cfg, seed=0)
    for key, value, fragment in [("mla_use_nope", True, "mla_use_nope"), ("aux_hidden_stream", "mixed", "mixed"),
                                 ("num_target_layers", 5, "num_target_layers"), ("model_type", "qwen3", "model_type"),
                                 ("markov_head_type", "gated", "gated"), ("q_lora_rank", None, "q_lora_rank")]:
        with pytest.raises(DSparkConfigError, match=fragment):
            load_drafter(_write(tmp_path / key, {**cfg, key: value}, tensors))
    bad = dict(tensors)
    del bad["layers.1.mlp.up_proj.weight"]
    with pytest.raises(WeightError, match="lacks 1 tensors.*layers.1.mlp.up_proj"):
        load_drafter(_write(tmp_path / "missing", cfg, bad))
    bad = {**tensors, "layers.0.self_attn.kv_b_proj.weight": tensors["layers.0.self_attn.kv_b_proj.weight"][:-1]}
    with pytest.raises(WeightError, match="kv_b_proj.*shape"):
        load_drafter(_write(tmp_path / "shape", cfg, bad))
    bad = {**tensors, "final_norm.weight": np.full_like(tensors["final_norm.weight"], np.nan)}
    with pytest.raises(WeightError, match="final_norm.*non-finite"):
        load_drafter(_write(tmp_path / "nan", cfg, bad))
    model = kimi_jax.from_pretrained(k3_tiny_a, dtype="float32", progress=False)
    path = _write(tmp_path / "other", cfg, tensors)
    with pytest.raises(DSparkConfigError, match="vocab_size 96"):
        Generator(model, None, max_len=32).generate([[1, 2, 3]], 4, speculative=f"dspark:{path}")
    with pytest.raises(speculative.SpeculativeError, match="block size"):
        speculative.parse(f"dspark:{path},k=9")


def test_drafts_in_generate_come_from_the_targets_context(tmp_path, k3_tiny_a, monkeypatch):
    """A random drafter on the K3 fixture, a prompt prefilled in two chunks: greedy output equals plain output, and
    every block the loop drafted has the base logits the oracle computes from the target's hidden states of the
    whole sequence so far (so the prefill chunks and each verify step wrote the drafter's context right)."""
    model = kimi_jax.from_pretrained(k3_tiny_a, dtype="float32", progress=False)
    cfg = oracle.tiny_config(model.cfg.vocab_size, hidden_size=model.cfg.hidden_size,
                             target_hidden_size=model.cfg.hidden_size, target_layer_ids=[1, 4, 8],
                             num_target_layers=3, block_size=3)
    tensors = oracle.random_checkpoint(cfg, seed=1)
    path = _write(tmp_path, cfg, tensors)
    drafter = speculative.DSpark(load_drafter(path), 3, "acceptance")
    seen = []
    base_logits = dspark.DSparkModel.base_logits

    def recorded(self, cache, table, head, anchor, ctx_len, n):
        out = base_logits(self, cache, table, head, anchor, ctx_len, n)
        jax.debug.callback(lambda *a: seen.append([np.asarray(x) for x in a]), anchor, ctx_len, out)
        return out

    monkeypatch.setattr(dspark.DSparkModel, "base_logits", recorded)
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, model.cfg.vocab_size, 21).tolist()
    gen = Generator(model, None, max_len=64, prefill_chunk=16)
    plain = gen.generate([prompt], 12, stop=())
    spec = gen.generate([prompt], 12, stop=(), speculative=drafter)
    assert spec.tokens == plain.tokens
    assert len(seen) >= 3
    full = prompt + spec.tokens[0]
    hidden = nnx.jit(lambda m, ids: m(ids, return_hidden=True).hidden)(model, jnp.asarray([full]))  # eager: 30 s
    taps = np.concatenate([np.asarray(hidden[i][0], np.float64) for i in cfg["target_layer_ids"]], axis=-1)
    embed = np.asarray(model.embed_tokens[...], np.float64)
    head = np.asarray(model.lm_head[...], np.float64)
    for anchor, ctx_len, got in seen:
        c = int(ctx_len[0])
        assert full[c] == anchor[0]  # the anchor is the token after the context
        want, _ = oracle.draft(cfg, tensors, embed, head, taps[:c], int(anchor[0]), 3)
        np.testing.assert_allclose(got[0], want, atol=1e-4 * np.abs(want).max())
    held = gen._drafters[drafter]  # split and placed once per drafter: the next request takes the same
    assert gen.generate([prompt], 12, stop=(), speculative=drafter).tokens == spec.tokens
    assert gen._drafters[drafter] is held
    # named by its directory, read once per generator (and so placed and measured once), not once per request
    reads = []
    monkeypatch.setattr(speculative, "load_drafter", lambda *a, **kw: reads.append(a) or load_drafter(*a, **kw))
    for _ in range(2):
        assert gen.generate([prompt], 12, stop=(), speculative=f"dspark:{path},k=3,adapt=acceptance").tokens == \
            spec.tokens
    assert len(reads) == 1


def test_a_step_that_does_not_verify_runs_no_drafter(tmp_path, k3_tiny_a, monkeypatch):
    """A DSpark drafter's block is drafted only for a step that verifies: with pacing that never verifies, the loop
    never runs the drafter (it drafted every step and threw the block away: its plain steps, which pacing weighs a
    verify step against, cost the demo's 2.5-3x the plain loop's), and the output is the plain output."""
    model = kimi_jax.from_pretrained(k3_tiny_a, dtype="float32", progress=False)
    cfg = oracle.tiny_config(model.cfg.vocab_size, hidden_size=model.cfg.hidden_size,
                             target_hidden_size=model.cfg.hidden_size, target_layer_ids=[1, 4, 8],
                             num_target_layers=3, block_size=2)
    drafter = speculative.DSpark(load_drafter(_write(tmp_path, cfg, oracle.random_checkpoint(cfg, seed=2))), 2,
                                 "acceptance")
    ran, real = [], dspark.DSparkModel.draft

    def counted(self, *a, **kw):
        out = real(self, *a, **kw)
        jax.debug.callback(lambda: ran.append(1))
        return out

    monkeypatch.setattr(dspark.DSparkModel, "draft", counted)
    # (a drafter setting no other test uses, k = 2: the loop is traced afresh with the patches)
    monkeypatch.setattr(speculative, "worth_verifying", lambda *a, **kw: jnp.bool_(False))
    prompt = np.random.default_rng(3).integers(3, model.cfg.vocab_size, 9).tolist()
    gen = Generator(model, None, max_len=64)
    plain = gen.generate([prompt], 10, stop=())
    spec = gen.generate([prompt], 10, stop=(), speculative=drafter)
    assert spec.tokens == plain.tokens and spec.timings["speculative"]["drafted"] == 0
    assert spec.timings["speculative"]["verify_steps"] > 0 and ran == []


def test_the_memory_check_counts_the_drafter(tmp_path):
    """Before allocating, a Generator counts a DSpark drafter's context cache and the copy of its weights it makes
    (in the model's dtype): a budget the target's cache and prefill fit but not with the drafter's is refused,
    naming the drafter. A 2-layer synthetic target, one 16-token prefill compiled; no cache allocated."""
    model = kimi_jax.from_pretrained(write_checkpoint(str(tmp_path), "llama", dtype="float32"), dtype="float32",
                                     progress=False)
    dcfg = dspark.config_from_dict(oracle.tiny_config(
        model.cfg.vocab_size, hidden_size=model.cfg.hidden_size, target_hidden_size=model.cfg.hidden_size,
        target_layer_ids=[0, 1], num_target_layers=2, block_size=3))
    resident = speculative.DSpark(dspark.DSparkModel(dcfg, run=RunConfig(dtype=jnp.float32)), 3)  # on the device, f32
    bf16 = speculative.DSpark(dspark.abstract(dcfg, jnp.bfloat16), 3)  # the generator makes an f32 copy
    prompt, S = list(range(3, 15)), 64
    plain = Generator(model, None, max_len=S).plan([prompt], 4, stop=())
    assert plain.drafter_bytes == 0
    context = dspark.cache_bytes(dcfg, 1, S, jnp.float32)
    assert Generator(model, None, max_len=S).plan([prompt], 4, stop=(), speculative=resident).drafter_bytes == context
    weights = sum(a.size * 4 for a in jax.tree.leaves(nnx.state(bf16.model)))
    assert Generator(model, None, max_len=S).plan([prompt], 4, stop=(), speculative=bf16).drafter_bytes == (
        context + weights)
    tight = Generator(model, None, max_len=S, memory_budget=plain.cache_bytes + plain.working_bytes + context // 2)
    assert tight.plan([prompt], 4, stop=()).chunk == plain.chunk  # the target alone fits
    with pytest.raises(GenerationError, match=r"and the DSpark drafter [0-9.]+ GB more \(context cache [0-9.]+ GB, "
                                              r"weights 0.00 GB\).* or without the DSpark drafter"):
        tight.plan([prompt], 4, stop=(), speculative=resident)


# a request to rename a function, as benchmarks/speculative.py's code-editing prompts (not one of them)
RENAME = "\n".join([
    "Rename the function mean to average and change nothing else.", "",
    "def mean(numbers):",
    '    """Return the arithmetic mean of numbers, or None where there are none."""',
    "    numbers = list(numbers)",
    "    if not numbers:",
    "        return None",
    "    return sum(numbers) / len(numbers)", "",
    "Result:", "", ""])


@pytest.mark.slow  # ~30 s: the demo model's programs (CI time); the drafter's math is held to the oracle above
def test_shipped_demo_drafter_drafts_what_the_demo_model_accepts():
    """The drafter trained for the demo model (scripts/make_demo_drafter.py) on a chat question and a request to
    rename a function, neither trained on: greedy output equals plain output, with more than 1.5 tokens per verify
    step (the chat question) and more than 1.8 (the rename, 2.10 here: the drafter saw the demo's answers to such
    requests; the one trained without them, before 78210ba, 1.47)."""
    from kimi_jax.text import chat
    from kimi_jax.text.tokenizer import load_tokenizer

    model = kimi_jax.from_pretrained(DEMO, dtype="float32", progress=False)
    tok = load_tokenizer(DEMO)
    ask = chat.encode(tok, [{"role": "user", "content": "What is the zipfile module?"}], add_generation_prompt=True)
    gen = Generator(model, tok, max_len=256)
    for ids, least in ((ask, 1.5), (tok.encode(RENAME), 1.8)):
        plain = gen.generate([ids], 64)
        spec = gen.generate([ids], 64, speculative=f"dspark:{DEMO_DRAFTER},adapt=acceptance")
        assert spec.tokens == plain.tokens
        assert spec.timings["speculative"]["tokens_per_step"] > least, spec.timings["speculative"]


def test_dspark_demo_names_the_shipped_drafter(tmp_path, monkeypatch):
    """``dspark:demo`` (as ``--model demo``) is the drafter shipped for the demo model: its weights, its block size
    unless ``k`` is given; a local directory named ``demo`` wins over the name, as for models."""
    shipped = load_drafter(DEMO_DRAFTER)
    named = speculative.parse("dspark:demo,k=3")
    assert named.k == 3 and named.model.cfg == shipped.cfg
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(shipped, nnx.Param)),
                                 nnx.to_flat_state(nnx.state(named.model, nnx.Param)), strict=True):
        np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value), err_msg=str(path))
    assert speculative.parse("dspark:demo", weights=False).k == shipped.cfg.block_size
    speculative.check("dspark:demo")  # what a command checks before it loads anything
    monkeypatch.chdir(tmp_path)
    os.mkdir("demo")
    with pytest.raises(FileNotFoundError, match=r"demo/config.json: no config.json"):
        speculative.parse("dspark:demo")


# scanned -m slow (CI time: 16 s): the scanned model's hidden states are the unrolled one's (tests/test_scan.py)
@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["unrolled", "scanned"])
def test_attn_res_stream_is_what_the_next_layer_reads(k3_tiny_a, monkeypatch, scan):
    """``consumer_stream`` (a drafter's ``attn_res`` taps) rebuilt from a call's outputs equals the AttnRes mix the
    model computed for the next layer's attention inside the same call (recorded from the model's own mixing), and
    the output mix after the last layer; the scanned model gives the unrolled model's streams."""
    from kimi_jax.model import decoder

    model = kimi_jax.from_pretrained(k3_tiny_a, dtype="float32", progress=False)
    seen = {}
    mix = decoder._mix

    def recorded(res, blocks, partial, run):
        out = mix(res, blocks, partial, run)
        seen.setdefault(id(res), out[0])
        return out

    monkeypatch.setattr(decoder, "_mix", recorded)
    ids = jnp.asarray(np.random.default_rng(0).integers(3, model.cfg.vocab_size, (2, 9)))
    out = model(ids, return_hidden=True)
    n = model.cfg.num_layers
    want = [seen[id(model.layers[i + 1].self_attention_res)] for i in range(n - 1)] + [out.output_mix]
    target = model
    if scan:
        target = kimi_jax.from_pretrained(k3_tiny_a, dtype="float32", progress=False, scan_layers=True)
        out = target(ids, return_hidden=True)
        assert target.plan.count > 0
    tol = 1e-5 if scan else 1e-6  # the scanned forward's own float32 rounding against the unrolled one's
    for i in range(n):
        np.testing.assert_allclose(np.asarray(target.consumer_stream(out, i)), np.asarray(want[i]), rtol=tol,
                                   atol=tol)
    taps = dspark.target_taps(target, out, (1, 4), "attn_res")
    np.testing.assert_allclose(np.asarray(taps), np.concatenate([np.asarray(want[1]), np.asarray(want[4])], -1),
                               rtol=tol, atol=tol)


_MESH_SCRIPT = """
import json, sys
import jax, numpy as np
import kimi_jax
from kimi_jax.checkpoint.drafter import load_drafter
from kimi_jax.generation import speculative
from kimi_jax.generation.generate import Generator
from kimi_jax.model import dspark
from kimi_jax.parallel.sharding import make_mesh

target, path = sys.argv[1], sys.argv[2]
seen = {}
base_logits = dspark.DSparkModel.base_logits

def recorded(self, cache, table, head, anchor, ctx_len, n):
    out = base_logits(self, cache, table, head, anchor, ctx_len, n)
    key = "mesh" if self.run.parallel is not None else "one"
    jax.debug.callback(lambda *a: seen.setdefault(key, []).append([np.asarray(x) for x in a]), ctx_len, out)
    return out

dspark.DSparkModel.base_logits = recorded
prompt = np.random.default_rng(0).integers(3, 200, 21).tolist()
out = {}
for key, mesh in (("one", None), ("mesh", make_mesh(1, 2, 4))):
    model = kimi_jax.from_pretrained(target, dtype="float32", progress=False, mesh=mesh)
    drafter = speculative.DSpark(load_drafter(path), 3, "acceptance")
    gen = Generator(model, None, max_len=48, prefill_chunk=16)
    out[key] = gen.generate([prompt], 10, stop=(), speculative=drafter).tokens
    # a draft model named by its path: on the mesh it is read onto it (weights and cache split as the target's)
    out[key + "_draft"] = gen.generate([prompt], 10, stop=(), speculative=f"draft:{target},k=3,adapt=acceptance").tokens
    if mesh is not None:
        parsed = speculative.parse(f"draft:{target},k=3", dtype="float32", parallel=model.run.parallel)
        out["draft_on_mesh"] = str(parsed.model.embed_tokens[...].sharding.spec)
        held = gen._drafters[drafter]
        out["specs"] = {k: str(v.sharding.spec) for k, v in
                        __import__("kimi_jax.model.params", fromlist=["leaves"]).leaves(held.params).items()
                        if k.startswith(("context_proj", "markov_head", "layers.0.mlp.down", "layers.0.self_attn.o"))}
        out["plan"] = gen.plan([prompt], 10, stop=(), speculative=drafter).drafter_bytes
n = min(len(seen["one"]), len(seen["mesh"]))
out["drafts"] = n
out["ctx_equal"] = all((a[0] == b[0]).all() for a, b in zip(seen["one"][:n], seen["mesh"][:n]))
out["logits_err"] = max(float(np.abs(a[1] - b[1]).max()) for a, b in zip(seen["one"][:n], seen["mesh"][:n]))
out["logits_max"] = max(float(np.abs(a[1]).max()) for a in seen["one"][:n])
print("ERRS", repr(out))
"""


@pytest.mark.slow  # ~70 s (two generators, one on 8 CPU devices, in a subprocess): run with -m slow; the default set
# holds the placed MLA op's log-sum-exp (tests/test_kernels_attention.py) and the sharded deviceless compile
def test_dspark_in_generate_on_a_mesh_equals_one_device(tmp_path, k3_tiny_a):
    """The K3 fixture split over a 1 x 2 x 4 mesh of CPU devices with a DSpark drafter: the drafter runs on the
    target's mesh, its weights split by their logical axes (attention heads, MLP width, vocabulary, the tapped
    streams) and its context cache by rows and positions; it drafts the base logits it drafts on one device (float32,
    to rounding), at the same context lengths, and greedy output is the one-device output. A draft model named by
    its path (the fixture itself) is read onto the mesh and gives the same tokens too."""
    import subprocess
    import sys

    model = kimi_jax.from_pretrained(k3_tiny_a, dtype="float32", progress=False)
    cfg = oracle.tiny_config(model.cfg.vocab_size, hidden_size=model.cfg.hidden_size,
                             target_hidden_size=model.cfg.hidden_size, target_layer_ids=[1, 4, 8],
                             num_target_layers=3, block_size=3)
    path = _write(tmp_path, cfg, oracle.random_checkpoint(cfg, seed=1))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHONPATH=root + os.pathsep + env.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, "-c", _MESH_SCRIPT, k3_tiny_a, path], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "ERRS" in proc.stdout, proc.stderr[-4000:]
    import ast
    r = ast.literal_eval(proc.stdout.split("ERRS", 1)[1].strip())
    print(r)
    assert r["mesh"] == r["one"] == r["mesh_draft"] == r["one_draft"], r
    assert r["draft_on_mesh"] == "P('model', None)", r  # the draft model's embedding: its vocabulary over model
    assert r["drafts"] >= 3 and r["ctx_equal"], r
    assert r["logits_err"] <= 1e-4 * r["logits_max"], r
    assert r["specs"] == {"context_proj": "P(None, 'model')", "layers.0.mlp.down_proj": "P(None, 'model')",
                          "layers.0.self_attn.o_proj": "P(None, 'model')", "markov_head.markov_w1": "P('model', None)",
                          "markov_head.markov_w2": "P('model', None)"}, r
    # the plan counts the context cache per device: 2 layers x 48 positions x (32 + 8), positions over model=4 (the
    # one row cannot split over expert=2); the weights are held already
    assert r["plan"] == 2 * 48 * (32 + 8) * 4 // 4, r
