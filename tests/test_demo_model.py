"""The trained demo model shipped in the package (kimi_jax/assets/k3-demo): its format, its recipe, its loss, its text.

The recipe (scripts/make_demo_model.py) rebuilds the corpus from this interpreter's own files, so the held-out loss
the model's RECIPE.json records is measured again here, on the model as shipped (bf16, MXFP4 experts, as loaded).
"""

import importlib.util
import json
import os
import pathlib
import platform
import re

import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

import kimi_jax
from kernels_pallas import mxfp4
from kimi_jax.cli.demo import demo_model_dir, demo_recipe
from kimi_jax.text.tokenizer import load_tokenizer

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def recipe_module():
    spec = importlib.util.spec_from_file_location("make_demo_model", ROOT / "scripts" / "make_demo_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def corpus(recipe_module):
    return recipe_module.corpus()


@pytest.fixture(scope="module")
def model():
    return kimi_jax.from_pretrained(demo_model_dir(), dtype="float32", progress=False)


def test_shipped_model_is_k3_in_the_released_format(model):
    path = demo_model_dir()
    cfg = json.load(open(os.path.join(path, "config.json")))
    assert cfg["model_type"] == "kimi_k3" and cfg["text_config"]["quantization_config"]["format"] == \
        "mxfp4-pack-quantized"
    with safe_open(os.path.join(path, "model.safetensors"), "np") as f:
        names = list(f.keys())
        packed = [n for n in names if n.endswith(".weight_packed")]
        assert all(n.startswith("language_model.") for n in names)
        assert packed and all(f.get_slice(n).get_dtype() == "U8" for n in packed)
    values = [var.get_value() for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    experts = [v for v in values if isinstance(v, mxfp4.MXFP4Weight)]
    assert len(experts) == 3 * sum(t == "moe" for t in model.cfg.ffn_types)  # gate, up, down per MoE layer
    assert set(model.cfg.attn_types) == {"kda", "mla"} and model.cfg.attn_res_block_size
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    assert size < 25e6  # a few MB in the package


def test_tokenizer_is_the_recipes_and_round_trips(recipe_module, corpus):
    r = demo_recipe()
    tok = load_tokenizer(demo_model_dir())
    cfg = json.load(open(os.path.join(demo_model_dir(), "config.json")))
    assert tok.vocab_size == recipe_module.VOCAB and cfg["eos_token_id"] == tok.special_id("<|end_of_msg|>")
    if r["python"] == platform.python_version():  # the corpus is this interpreter's own text
        import hashlib

        assert hashlib.sha256(corpus.encode()).hexdigest()[:16] == r["corpus_sha256"]
    sample = corpus[: 200_000]
    assert tok.decode(tok.encode(sample)) == sample
    assert len(tok.encode(sample)) < len(sample.encode()) / 3  # a learned vocabulary, not bytes


def _unigram_heldout(ids: np.ndarray, frac: float) -> float:
    """Cross-entropy (nats) on the held-out tail of the best context-free model of the training part (token
    frequencies, add-one smoothed): the loss a model that learned nothing of context would get."""
    cut = int(len(ids) * (1 - frac))
    counts = np.bincount(ids[:cut], minlength=int(ids.max()) + 1) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[ids[cut:]].mean())


def test_heldout_loss_is_the_recipes_and_beats_unigram(recipe_module, corpus):
    r = demo_recipe()
    loss, counted = recipe_module.heldout_loss(demo_model_dir(), corpus)
    ids = np.asarray(load_tokenizer(demo_model_dir()).encode(corpus))
    unigram = _unigram_heldout(ids, recipe_module.EVAL_FRAC)
    print(f"\nshipped demo model: held-out loss {loss:.4f} nats/token over {counted} tokens (recipe "
          f"{r['heldout_loss']:.4f}); unigram model on the same tokens {unigram:.4f}; training loss "
          f"{r['final_loss']:.3f}")
    if r["python"] == platform.python_version():  # the same corpus: the recipe's number, measured again
        assert counted == r["heldout_tokens"]
        assert loss == pytest.approx(r["heldout_loss"], abs=2e-3)
    assert loss < unigram - 1.0


def _words(text: str) -> list[str]:
    return [w.lower() for w in re.findall(r"[A-Za-z]+", text)]


def _pair_rate(text: str, pairs: set) -> tuple[float, int]:
    """Fraction of adjacent word pairs of ``text`` that also occur adjacent somewhere in the corpus."""
    w = _words(text)
    got = list(zip(w, w[1:]))
    return sum(p in pairs for p in got) / max(1, len(got)), len(got)


# -m slow for CI time (the 30-minute budget): the held-out loss test runs in the default set
@pytest.mark.slow
def test_demo_model_writes_the_language_it_read(model, corpus, tmp_path):
    """Greedy continuations of the shipped model are made of word pairs its corpus uses; the random-weight tiny
    K3's are not (the same measure on both)."""
    from kimi_jax.cli.demo import build_demo_checkpoint

    w = _words(corpus)
    pairs = set(zip(w, w[1:]))
    prompts = ["The for statement", "A dictionary is", "This module provides"]
    out = kimi_jax.generate(model, prompts, tokenizer=load_tokenizer(demo_model_dir()), max_new_tokens=40, stop=())
    rate, n = _pair_rate(" ".join(out.text), pairs)
    shown = "\n".join(f"{p!r} -> {t!r}" for p, t in zip(prompts, out.text))
    print(f"\n{shown}\nword pairs seen in the corpus: {rate:.3f} of {n}")
    rand_dir = build_demo_checkpoint(tmp_path / "random")
    rand = kimi_jax.from_pretrained(rand_dir, dtype="float32", progress=False)
    r_out = kimi_jax.generate(rand, prompts, tokenizer=load_tokenizer(rand_dir), max_new_tokens=40, stop=())
    r_rate, r_n = _pair_rate(" ".join(r_out.text), pairs)
    print(f"random tiny K3: {r_rate:.3f} of {r_n}")
    assert n >= 30 and rate >= 0.8
    assert r_n >= 30 and r_rate < 0.5
