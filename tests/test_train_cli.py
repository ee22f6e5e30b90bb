"""``kimi-jax train`` end to end, and the export to the released layouts.

An interrupted run (``--stop-at``) resumed from its Orbax checkpoint ends exactly where an uninterrupted run ends;
the exported K3 (MXFP4 experts re-packed) reloads with ``kimi_jax.from_pretrained`` and generates; an exported Llama
and an exported Kimi Linear load in HF transformers and compute our logits (transformers is the oracle for the layout).
"""

import json
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import kimi_jax
from kimi_jax import training
from kimi_jax.checkpoint.synthetic import write_checkpoint
from kimi_jax.cli import main
from kimi_jax.model import config as C
from kimi_jax.text.tokenizer import _DEMO_TEXT, write_demo_tokenizer
from kimi_jax.training.export import export_hf


def _small_k3(path):
    """A 4-layer K3 (KDA x3 + MLA, AttnRes blocks of 2, MXFP4 experts) with the demo tokenizer."""
    c = C.tiny_k3_config_dict()
    t = c["text_config"]
    t.update(num_hidden_layers=4, attn_res_block_size=2)
    t["linear_attn_config"].update(kda_layers=[1, 2, 3], full_attn_layers=[4])
    write_checkpoint(path, "k3", config=c, seed=1, num_shards=1)
    write_demo_tokenizer(path, vocab_size=t["vocab_size"])
    return str(path)


def _train(model, text, out, *extra):
    return main(["train", "--model", model, "--data", text, "--steps", "6", "--out", out, "--batch", "2",
                 "--seq", "32", "--dtype", "float32", "--eval-every", "3", "--save-every", "2", "--lr", "1e-2",
                 *extra])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_cli")
    model = _small_k3(root / "k3")
    text = str(root / "text.txt")
    with open(text, "w") as f:
        f.write(_DEMO_TEXT * 3)
    whole, split = str(root / "whole"), str(root / "split")
    assert _train(model, text, whole) == 0
    assert _train(model, text, split, "--stop-at", "3") == 0
    assert not os.path.exists(os.path.join(split, "model"))  # stopped: nothing exported yet
    with open(os.path.join(split, "metrics.jsonl"), "a") as f:  # as a run killed after logging step 4 leaves it
        f.write(json.dumps({"step": 4, "loss": 99.0}) + "\n")
    assert _train(model, text, split) == 0  # resumes at step 3; step 4's stale row goes
    return model, whole, split


def _metrics(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_interrupted_run_resumes_exactly(runs):
    _, whole, split = runs
    a, b = _metrics(whole), _metrics(split)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]  # the second process started at step 4
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert a[-1]["loss"] < a[0]["loss"]
    with open(os.path.join(whole, "model", "model.safetensors"), "rb") as f, \
            open(os.path.join(split, "model", "model.safetensors"), "rb") as g:
        assert f.read() == g.read()
    row = a[-1]
    assert len(row["expert_load"]) == 3 and len(row["layer_grad_norm"]) == 4 and len(row["layer_out_rms"]) == 4
    assert np.allclose(np.sum(row["expert_load"], -1), 1.0) and row["attn_res"] and "eval_loss" in row


def test_rerun_of_a_finished_run_keeps_its_summary(runs, capsys):
    """The same command again resumes at the last step, trains nothing, and reports the run's numbers (was: a
    summary.json rewritten with ``"final_loss": null``)."""
    model, whole, _ = runs
    path = os.path.join(whole, "summary.json")
    with open(path) as f:
        before = json.load(f)
    last = _metrics(whole)[-1]
    assert before["final_loss"] == last["loss"] and before["eval_loss"] == last["eval_loss"] is not None
    assert _train(model, os.path.join(os.path.dirname(whole), "text.txt"), whole) == 0
    assert "resumed from step 6" in capsys.readouterr().err
    with open(path) as f:
        assert json.load(f) == before
    assert len(_metrics(whole)) == 6


def test_chat_jsonl_is_rendered_in_the_k3_format(tmp_path):
    """A .jsonl of conversations is tokenized as :func:`kimi_jax.text.chat.encode` renders them (markers as their
    special ids), after and before the text files around it, in the order given."""
    from kimi_jax.cli import train as train_cli
    from kimi_jax.text import chat
    from kimi_jax.text.tokenizer import load_tokenizer

    tok_dir = tmp_path / "tok"
    write_demo_tokenizer(tok_dir, vocab_size=1024)
    tok = load_tokenizer(tok_dir)
    talks = [{"messages": [{"role": "user", "content": "Hi"},
                           {"role": "assistant", "reasoning_content": "A greeting.", "content": "Hello!"}]},
             {"messages": [{"role": "user", "content": "And?"}, {"role": "assistant", "content": "Bye."}],
              "thinking": False}]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(t) + "\n" for t in talks) + "\n")
    (tmp_path / "a.txt").write_text(_DEMO_TEXT)
    args = types.SimpleNamespace(data=[str(tmp_path / "a.txt"), str(tmp_path / "chat.jsonl"), str(tmp_path / "a.txt")],
                                 eval_frac=0.1, seq=8)
    train_ids, eval_ids, anchors = train_cli._data(args, tok, 1024)
    text = tok.encode(_DEMO_TEXT)
    first = chat.encode(tok, talks[0]["messages"], add_generation_prompt=False)
    second = chat.encode(tok, talks[1]["messages"], thinking=False, add_generation_prompt=False)
    want = text + first + second + text
    assert np.concatenate([train_ids, eval_ids]).tolist() == want
    assert tok.specials[chat.END_OF_MSG] in train_ids.tolist()
    # a window never starts inside a conversation: there it starts at the conversation's first token (its markers)
    a, b = len(text), len(text) + len(first)
    want_anchors = list(range(a)) + [a] * len(first) + [b] * len(second) + list(range(b + len(second), len(train_ids)))
    assert anchors.tolist() == want_anchors
    assert train_ids[a] == tok.specials[chat.OPEN] and train_ids[b] == tok.specials[chat.OPEN]
    starts = {int(w[0]) for step in range(50) for w in train_cli.windows(
        np.arange(len(train_ids)), 8, 8, 0, step, anchors)}  # windows of positions: their first is the start
    assert not starts & (set(range(a + 1, b)) | set(range(b + 1, b + len(second))))
    assert {a, b} <= starts and starts - {a, b}  # conversations and text are both drawn
    (tmp_path / "bad.jsonl").write_text('{"messages": [{"role": "robot"}]}\n')
    with pytest.raises(ValueError, match=r"--data .*bad.jsonl, line 1: not a conversation"):
        train_cli._data(types.SimpleNamespace(data=[str(tmp_path / "bad.jsonl")], eval_frac=0.1, seq=8), tok, 1024)


def test_export_reloads_and_generates(runs):
    model_dir, whole, _ = runs
    out = os.path.join(whole, "model")
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tiktoken.model", "tokenizer_config.json"]
    from safetensors import safe_open

    with safe_open(os.path.join(out, "model.safetensors"), "np") as f:
        names = list(f.keys())
        packed = f.get_tensor("language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed")
    assert packed.dtype == np.uint8  # re-packed as MXFP4, as released
    with safe_open(os.path.join(model_dir, "model.safetensors"), "np") as f:
        assert sorted(f.keys()) == sorted(names)  # the released tensor set, nothing more or less
        assert not np.array_equal(packed, f.get_tensor(
            "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"))  # the experts trained
    model = kimi_jax.from_pretrained(out, dtype="float32", progress=False)
    gen = kimi_jax.generate(model, "The quick brown", max_new_tokens=6, tokenizer=out)
    assert len(gen.tokens[0]) == 6 and isinstance(gen.text[0], str)


@pytest.mark.parametrize("family", ["llama", "kimi_linear"])
def test_exported_hf_model_loads_in_transformers(family, hf_llama, hf_kimi_linear, tmp_path):
    """Two steps of training, exported to the released HF layout: transformers' own class reads it and computes our
    logits (Kimi Linear: its KDA, MLA, router and experts)."""
    import transformers

    path, _ = hf_llama if family == "llama" else hf_kimi_linear
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    model = training.prepare(kimi_jax.from_pretrained(path, dtype="float32", progress=False))
    trainer, state = training.init(model, training.TrainConfig(optim=training.OptimConfig(lr=1e-2, warmup=0)))
    step, _ = training.compile_steps(trainer)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, raw["vocab_size"], (2, 16)), jnp.int32)
    for _ in range(2):
        state, _ = step(state, training.Batch(ids, jnp.ones_like(ids)))
    trained = trainer.model(state)
    out = export_hf(trained, raw, tmp_path / "out", dtype="float32")
    cls = {"llama": transformers.LlamaForCausalLM, "kimi_linear": transformers.KimiLinearForCausalLM}[family]
    hf = cls.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(np.asarray(ids))).logits.numpy()
    ours = np.asarray(jax.jit(lambda i: trained(i).logits)(ids))
    print(f"{family} export: max |ours - transformers| = {np.max(np.abs(ours - ref)):.3g}")
    assert np.max(np.abs(ours - ref)) < 2e-4
    base = np.asarray(jax.jit(lambda i: kimi_jax.from_pretrained(path, dtype="float32", progress=False)(i).logits)(ids))
    assert np.max(np.abs(ours - base)) > 1e-2  # the export holds the trained weights, not the originals


@pytest.mark.slow
def test_tiny_k3_learns_a_text(tmp_path):
    """The demo K3 (9 layers) for 300 steps on the README: the loss falls well below the unigram entropy; the
    checkpoint reloads and generates (about 15 minutes on 2 CPU cores)."""
    from kimi_jax.cli.demo import build_demo_checkpoint

    model = build_demo_checkpoint(str(tmp_path / "demo"))
    readme = os.path.join(os.path.dirname(__file__), "..", "README.md")
    out = str(tmp_path / "run")
    assert main(["train", "--model", model, "--data", readme, "--steps", "300", "--out", out, "--batch", "8",
                 "--seq", "64", "--dtype", "float32", "--lr", "3e-3", "--eval-every", "50"]) == 0
    with open(os.path.join(out, "summary.json")) as f:
        s = json.load(f)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    recent = float(np.mean([r["loss"] for r in rows[-20:]]))
    # the training loss falls far below the unigram entropy; the held-out tenth of the README (other sections)
    # less far: 35k tokens do not make a language model
    assert recent < s["unigram_entropy"] - 1.5 and s["eval_loss"] < s["unigram_entropy"] - 0.5, (recent, s)
    m = kimi_jax.from_pretrained(s["model"], dtype="float32", progress=False)
    assert len(kimi_jax.generate(m, "The model", max_new_tokens=8, tokenizer=s["model"]).tokens[0]) == 8


def test_checkpoint_of_another_setup_is_refused_by_name(tmp_path):
    """A train checkpoint is restored only into the leaves it holds: a missing or extra leaf, or another shape or
    dtype, is refused from the stored metadata, naming the leaf (Orbax alone reports a 'structure mismatch')."""
    from typing import NamedTuple

    from kimi_jax.training import checkpoint as ckpt

    class S(NamedTuple):
        step: jax.Array
        w: jax.Array
        b: jax.Array

    mgr = ckpt.manager(tmp_path / "c")
    state = S(jnp.int32(3), jnp.arange(6.0).reshape(2, 3), jnp.ones(4))
    ckpt.save(mgr, state, {"note": "x"})
    got, extra = ckpt.restore_latest(mgr, S(jnp.int32(0), jnp.zeros((2, 3)), jnp.zeros(4)))
    assert int(got.step) == 3 and np.array_equal(got.w, state.w) and extra == {"note": "x"}

    class Other(NamedTuple):
        step: jax.Array
        w: jax.Array
        c: jax.Array

    mgr = ckpt.manager(tmp_path / "c")  # a fresh manager, as a resumed process opens it
    with pytest.raises(ValueError, match=r"lacks \['\.c'\] and has \['\.b'\]"):
        ckpt.restore_latest(mgr, Other(jnp.int32(0), jnp.zeros((2, 3)), jnp.zeros(4)))
    with pytest.raises(ValueError, match=r"\.w: stored \(2, 3\) float32, this run has \(3, 2\) float32"):
        ckpt.restore_latest(mgr, S(jnp.int32(0), jnp.zeros((3, 2)), jnp.zeros(4)))
    with pytest.raises(ValueError, match=r"\.b: stored \(4,\) float32, this run has \(4,\) bfloat16"):
        ckpt.restore_latest(mgr, S(jnp.int32(0), jnp.zeros((2, 3)), jnp.zeros(4, jnp.bfloat16)))


def test_tiny_k3_trains_with_the_demo_tokenizer(tmp_path, capsys):
    """``train --model tiny-k3`` encodes text with the demo tokenizer (written into OUT/tokenizer and exported with
    the model), not silently as bytes; a model directory without tokenizer files says it falls back to bytes."""
    import argparse

    from kimi_jax.cli import train as train_cli

    out = str(tmp_path / "run")
    model, raw, tok, tok_dir = train_cli._load(argparse.Namespace(model="tiny-k3", out=out))
    assert tok_dir == os.path.join(out, "tokenizer") and sorted(os.listdir(tok_dir)) == ["tiktoken.model",
                                                                                          "tokenizer_config.json"]
    ids = tok.encode("The quick brown fox")
    assert len(ids) < len("The quick brown fox") and max(ids) < model.cfg.vocab_size  # BPE merges, inside the vocabulary
    assert tok.decode(ids) == "The quick brown fox"
    bare = write_checkpoint(str(tmp_path / "bare"), "k3", num_shards=1)  # no tokenizer files
    capsys.readouterr()
    assert isinstance(train_cli._load(argparse.Namespace(model=bare, out=out))[2], train_cli._Bytes)
    assert "no tokenizer files there; text is encoded as UTF-8 bytes" in capsys.readouterr().err
