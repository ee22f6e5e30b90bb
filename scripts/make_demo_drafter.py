"""Re-create the DSpark drafter shipped beside the demo model (``kimi_jax/assets/k3-demo-dspark``), which
``kimi-jax demo --speculative`` and ``--speculative dspark:PATH`` use.

    python scripts/make_demo_drafter.py --work /tmp/drafter-run [--steps 1500] [--install]

1. Prompts: the chat questions of the demo's own training conversations (``make_demo_model.conversations``, the
   last ``HELDOUT`` left out for the check) in the K3 chat format, windows of its corpus, and requests to rename a
   function of the standard library (:func:`code_prompts`, the format of ``benchmarks/speculative.py``'s code-editing
   prompts, not its functions): the demo does not copy the function back, but a drafter trained on what it writes
   instead predicts it there too (3.15 tokens per step on the benchmark's 8 rename prompts, every drafted step
   verified, float32, against 2.40 for the drafter trained without them).
2. The demo model's greedy continuations of them (``kimi_jax.generate``), run once more through the model for the
   tapped layers' hidden states and its greedy choice after every position (:mod:`kimi_jax.training.dspark`).
3. A random ``k3_dspark`` drafter (2 MLA layers with RoPE, SwiGLU, a Markov head; the demo's embedding and lm_head
   shared) trained on that with the project's optimizer, written in the released layout.
4. The check: on the held-out questions, greedy speculative output equals plain output and the new tokens per
   loop step with every drafted step verified are reported (also written to ``RECIPE.json``).
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import platform
import random
import shutil
import sys
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx
from make_demo_model import conversations, corpus, stdlib_sources

import kimi_jax
from kimi_jax.checkpoint.drafter import save_drafter
from kimi_jax.generation.generate import Generator
from kimi_jax.model.dspark import DSparkModel, config_from_dict
from kimi_jax.model.run import RunConfig
from kimi_jax.text import chat
from kimi_jax.text.tokenizer import load_tokenizer
from kimi_jax.training import dspark as train_dspark

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEMO = ROOT / "kimi_jax" / "assets" / "k3-demo"
ASSET = ROOT / "kimi_jax" / "assets" / "k3-demo-dspark"
HELDOUT = 64
WINDOWS = 1500
PROMPT, NEW = 64, 96  # corpus windows of PROMPT tokens; NEW greedy tokens after every prompt


def drafter_config(demo_cfg) -> dict:
    return {
        "architectures": ["K3DSparkModel"], "model_type": "k3_dspark", "hidden_size": demo_cfg.hidden_size,
        "intermediate_size": 2 * demo_cfg.hidden_size, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "q_lora_rank": 128, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16, "v_head_dim": 32, "mla_use_nope": False, "mla_use_output_gate": False,
        "vocab_size": demo_cfg.vocab_size, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
        "rope_theta": 50000.0, "num_target_layers": 3, "target_hidden_size": demo_cfg.hidden_size,
        "target_num_hidden_layers": demo_cfg.num_layers, "target_layer_ids": [2, 5, demo_cfg.num_layers - 1],
        "aux_hidden_stream": "prefix", "mask_token_id": demo_cfg.vocab_size - 3, "markov_rank": 64,
        "markov_head_type": "vanilla", "block_size": 4, "hidden_act": "silu", "tie_word_embeddings": False,
    }


def prompts(tok) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """(chat prompts for training, held-out chat prompts, corpus windows)."""
    questions = [row["messages"][-2]["content"] if row["messages"][-1]["role"] == "assistant" else None
                 for row in conversations()]
    asks = [chat.encode(tok, [{"role": "user", "content": q}], add_generation_prompt=True)
            for q in questions if q]
    ids = tok.encode(corpus())
    starts = range(0, len(ids) - PROMPT, max(1, len(ids) // WINDOWS))
    return asks[:-HELDOUT], asks[-HELDOUT:], [ids[s:s + PROMPT] for s in starts]


def code_prompts(tok, n: int, seed: int = 0) -> list[list[int]]:
    """``n`` requests (raw text, token ids) to rename a module-level function of 4-14 lines of the standard library to
    a made-up name: instruction, the function, ``Result:``, as ``benchmarks/speculative.py``'s code-editing prompts
    are (the functions in a fixed order, then a seeded choice)."""
    rng = random.Random(seed)
    verbs = ("load", "parse", "make", "find", "check", "build", "read", "write", "get", "split", "join", "count")
    nouns = ("items", "lines", "names", "values", "text", "path", "data", "entry", "table", "words", "parts", "keys")
    found = []
    for _, src, tree in stdlib_sources():
        lines = src.splitlines()
        for node in tree.body:
            body = lines[node.lineno - 1:node.end_lineno] if isinstance(node, ast.FunctionDef) else []
            if (4 <= len(body) <= 14 and not node.decorator_list and not node.name.startswith("__")
                    and all(len(line) < 100 for line in body)):
                found.append((node.name, "\n".join(body) + "\n"))
    out = []
    for old, code in rng.sample(found, min(n, len(found))):
        new = f"{rng.choice(verbs)}_{rng.choice(nouns)}"
        out.append(tok.encode(f"Rename the function {old} to {new} and change nothing else.\n\n{code}\nResult:\n\n"))
    return out


def continuations(gen: Generator, ps: list[list[int]], batch: int = 32):
    """Each prompt (its last PROMPT tokens) with its NEW greedy tokens, right-padded to ``[N, PROMPT + NEW]``; where
    each row's own output starts; each row's length."""
    seqs, first, stop = [], [], []
    for i in range(0, len(ps), batch):
        part = [p[-PROMPT:] for p in ps[i:i + batch]]
        out = gen.generate(part, NEW, stop=())
        for p, t in zip(part, out.tokens):
            row = (p + t)[:PROMPT + NEW]
            seqs.append(row + [0] * (PROMPT + NEW - len(row)))
            first.append(len(p) - 1)
            stop.append(len(row))
    return np.asarray(seqs, np.int32), np.asarray(first, np.int32), np.asarray(stop, np.int32)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", required=True)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--chat-prompts", type=int, default=768)
    ap.add_argument("--windows", type=int, default=1500, help="corpus windows used as prompts")
    ap.add_argument("--code-prompts", type=int, default=600, help="requests to rename a function used as prompts")
    ap.add_argument("--install", action="store_true")
    args = ap.parse_args(argv)
    work = pathlib.Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    target = kimi_jax.from_pretrained(str(DEMO), dtype="float32", progress=False)
    tok = load_tokenizer(str(DEMO))
    config = drafter_config(target.cfg)
    cfg = config_from_dict(config)
    train_asks, held, windows = prompts(tok)
    windows = windows[:args.windows]
    rng = np.random.default_rng(0)
    pick = rng.choice(len(train_asks), min(args.chat_prompts, len(train_asks)), replace=False)
    gen = Generator(target, None, max_len=256)
    ps = [train_asks[i] for i in pick] + windows + code_prompts(tok, args.code_prompts)
    seqs, first, stop = continuations(gen, ps)
    print(f"{len(seqs)} sequences of {seqs.shape[1]} tokens ({time.time() - t0:.0f} s)", file=sys.stderr)
    data = train_dspark.collect(target, seqs, first, stop, cfg.target_layer_ids, stream=cfg.aux_hidden_stream)
    dmodel = DSparkModel(cfg, run=RunConfig(dtype=jnp.float32), param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    losses = train_dspark.train(dmodel, target, data, steps=args.steps,
                                log=lambda t, v, hit: print(f"step {t}: loss {v:.3f}, slot hits {hit}",
                                                            file=sys.stderr))
    out = work / "k3-demo-dspark"
    save_drafter(dmodel, config, str(out), dtype="BF16")
    # the check on held-out questions: greedy speculative == plain, and the acceptance with every drafted step
    # verified (adapt=acceptance: what the drafter gives, whatever a verify step costs on this machine)
    plain = gen.generate(held, 128)
    spec = gen.generate(held, 128, speculative=f"dspark:{out},adapt=acceptance")
    same = sum(a == b for a, b in zip(plain.tokens, spec.tokens))
    s = spec.timings["speculative"]
    print(f"held-out: {same}/{len(held)} equal to plain; {s}", file=sys.stderr)
    recipe = {"command": "python scripts/make_demo_drafter.py " + " ".join(argv or sys.argv[1:]),
              "python": platform.python_version(), "sequences": len(seqs), "steps": args.steps,
              "final_loss": float(np.mean(losses[-50:])), "heldout_prompts": len(held),
              "heldout_equal_to_plain": same, "heldout_tokens_per_step": s["tokens_per_step"],
              "seconds": round(time.time() - t0)}
    (out / "RECIPE.json").write_text(json.dumps(recipe, indent=2) + "\n")
    if args.install:
        shutil.rmtree(ASSET, ignore_errors=True)
        shutil.copytree(out, ASSET)
        print(f"installed {ASSET}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
