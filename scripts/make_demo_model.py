"""Re-create the demo model shipped in ``kimi_jax/assets/k3-demo`` (what ``kimi-jax demo`` runs).

    python scripts/make_demo_model.py --work /tmp/demo-run [--steps 1200] [--install]

A small Kimi K3 (the released architecture: KDA x3 + gated NoPE MLA, final two MLA, Block AttnRes, LatentMoE with
MXFP4 routed experts, SiTU), trained on this machine on text every Python installation has: the reference pages of
the Python documentation that ``pydoc`` ships (``pydoc_data.topics``) and the docstrings of the standard library.
The steps, each deterministic for a given Python version:

1. the corpus, in a fixed order (topics sorted by name, then modules by path), written to ``WORK/corpus.txt``;
2. a byte-level BPE tokenizer with K3's split pattern learned on it (HF ``tokenizers``' trainer), written as
   ``tiktoken.model`` + ``tokenizer_config.json`` in the release's format, with K3's 256 specials on top, and
   checked: tiktoken over the written file encodes the whole corpus exactly as the trained tokenizer does;
3. a random K3 checkpoint of the demo's shape in the released layout (``kimi_jax.checkpoint.synthetic``);
4. ``kimi-jax train`` on it (the last 5% of the corpus held out), exporting the released layout with the routed
   experts re-packed to MXFP4;
5. with ``--install``: the exported model copied to ``kimi_jax/assets/k3-demo`` with ``RECIPE.json`` (the command,
   the Python version, corpus and tokenizer digests, the losses).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import pathlib
import platform
import shutil
import sys
import sysconfig
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
ASSET = ROOT / "kimi_jax" / "assets" / "k3-demo"
VOCAB = 4096  # 3840 learned ranks + K3's 256 reserved specials
EVAL_FRAC = 0.05  # the corpus's tail held out
SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__", "tkinter"}


def demo_config() -> dict:
    """The demo's K3 config.json: the released architecture at a few million parameters."""
    from kimi_jax.cli.demo import with_special_ids
    from kimi_jax.model.config import tiny_k3_config_dict

    c = tiny_k3_config_dict()
    t = c["text_config"]
    t.update(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=9, num_attention_heads=4, num_key_value_heads=4,
             intermediate_size=768, attn_res_block_size=3, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=64,
             qk_rope_head_dim=16, v_head_dim=64, num_experts=8, num_experts_per_token=2, moe_intermediate_size=128,
             routed_expert_hidden_size=128, num_shared_experts=1, max_position_embeddings=4096)
    t["linear_attn_config"].update(num_heads=4, head_dim=64)
    return with_special_ids(c)


def _docstrings(path: pathlib.Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docs = (ast.get_docstring(n) for n in ast.walk(tree) if isinstance(n, kinds))
    return [d for d in docs if d and len(d) >= 200]


def corpus() -> str:
    """The documentation pages pydoc ships, then the standard library's longer docstrings."""
    import pydoc_data.topics

    parts = [pydoc_data.topics.topics[k].strip() for k in sorted(pydoc_data.topics.topics)]
    lib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    for p in sorted(lib.rglob("*.py")):
        if not SKIP_DIRS & set(p.relative_to(lib).parts[:-1]):
            parts.extend(_docstrings(p))
    return "\n\n".join(parts) + "\n"


def tokenizer(work: pathlib.Path, text: str):
    """Learn the BPE, write it in the release format, check tiktoken reproduces the trainer on the corpus."""
    from kimi_jax.text.tokenizer import NUM_RESERVED_SPECIAL, byte_level_bytes, learn_bpe, write_kimi_tokenizer

    ranks, hf = learn_bpe(text.split("\n\n"), VOCAB - NUM_RESERVED_SPECIAL)
    tok = write_kimi_tokenizer(work / "init", ranks)
    ours = tok.encode(text)
    docs = text.split("\n\n")  # what the trainer saw; compare token bytes (its alphabet's ids are in another order)
    theirs = [ranks[byte_level_bytes(t)] for enc in hf.encode_batch(docs) for t in enc.tokens]
    if [i for d in docs for i in tok.encode(d)] != theirs:
        raise SystemExit("tiktoken over the written tiktoken.model does not reproduce the trained BPE")
    print(f"tokenizer: {len(ranks)} ranks; corpus {len(text.encode()) / 1e6:.2f} MB -> {len(ours)} tokens "
          f"({len(text.encode()) / len(ours):.2f} bytes/token); tiktoken == trainer on all "
          f"{len(theirs)} per-document ids", file=sys.stderr)
    return tok


def heldout_loss(model_dir, text: str, frac: float = EVAL_FRAC, seq: int = 256, batch: int = 8) -> tuple[float, int]:
    """Mean next-token loss (nats) of the model in ``model_dir``, as loaded, over the held-out tail of ``text``
    (the part ``kimi-jax train --eval-frac`` kept out), in non-overlapping windows of ``seq``; and the tokens
    counted."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import kimi_jax
    from kimi_jax.text.tokenizer import load_tokenizer

    ids = np.asarray(load_tokenizer(model_dir).encode(text), np.int32)
    held = ids[int(len(ids) * (1 - frac)):]
    n = len(held) // seq
    windows = held[: n * seq].reshape(n, seq)
    model = kimi_jax.from_pretrained(model_dir, dtype="float32", progress=False)
    nll = nnx.jit(lambda m, x: -jnp.take_along_axis(jax.nn.log_softmax(m(x).logits[:, :-1]), x[:, 1:, None], -1))
    total = sum(float(nll(model, jnp.asarray(windows[i:i + batch])).sum()) for i in range(0, n, batch))
    count = n * (seq - 1)
    return total / count, count


def _digest(path) -> str:
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()[:16]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, help="working directory (corpus, initial model, run)")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--install", action="store_true", help="copy the result to kimi_jax/assets/k3-demo")
    args = ap.parse_args(argv)

    from kimi_jax import cli
    from kimi_jax.checkpoint.synthetic import write_checkpoint

    work = pathlib.Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    text = corpus()
    (work / "corpus.txt").write_text(text, encoding="utf-8")
    if not (work / "init" / "config.json").exists():
        shutil.rmtree(work / "init", ignore_errors=True)
        tokenizer(work, text)
        write_checkpoint(work / "init", family="k3", config=demo_config(), seed=args.seed, num_shards=1)
    train = ["train", "--model", str(work / "init"), "--data", str(work / "corpus.txt"), "--steps", str(args.steps),
             "--out", str(work / "run"), "--batch", str(args.batch), "--seq", str(args.seq), "--lr", str(args.lr),
             "--eval-frac", str(EVAL_FRAC), "--eval-every", "100", "--save-every", "100", "--seed", str(args.seed),
             "--dtype", "float32"]
    t0 = time.time()
    rc = cli.main(train)
    if rc:
        return rc
    summary = json.loads((work / "run" / "summary.json").read_text())
    held, counted = heldout_loss(work / "run" / "model", text)
    recipe = {"command": "python scripts/make_demo_model.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "train": "kimi-jax " + " ".join(train), "python": platform.python_version(),
              "corpus_sha256": _digest(work / "corpus.txt"), "corpus_bytes": len(text.encode()),
              "tiktoken_sha256": _digest(work / "init" / "tiktoken.model"), "train_seconds": round(time.time() - t0),
              "train_tokens": args.steps * args.batch * args.seq, "heldout_loss": held, "heldout_tokens": counted,
              **{k: summary[k] for k in ("steps", "final_loss", "eval_loss", "unigram_entropy")}}
    print(json.dumps(recipe, indent=2))
    if args.install:
        shutil.rmtree(ASSET, ignore_errors=True)
        shutil.copytree(work / "run" / "model", ASSET)
        (ASSET / "RECIPE.json").write_text(json.dumps(recipe, indent=2) + "\n")
        print(f"installed {ASSET}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
