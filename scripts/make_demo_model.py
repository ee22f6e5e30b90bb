"""Re-create the demo model shipped in ``kimi_jax/assets/k3-demo`` (what ``kimi-jax demo`` runs).

    python scripts/make_demo_model.py --work /tmp/demo-run [--steps 1200] [--install]

A small Kimi K3 (the released architecture: KDA x3 + gated NoPE MLA, final two MLA, Block AttnRes, LatentMoE with
MXFP4 routed experts, SiTU), trained on this machine on text every Python installation has: the reference pages of
the Python documentation that ``pydoc`` ships (``pydoc_data.topics``) and the docstrings of the standard library;
and on conversations in the K3 chat format made from the same documentation, so that ``kimi-jax chat`` and the
server's chat endpoint get a thinking channel that ends and an answer. The steps, each deterministic for a given
Python version:

1. the corpus, in a fixed order (topics sorted by name, then modules by path), written to ``WORK/corpus.txt``;
   the conversations (:func:`conversations`: a question about a documented statement, module, class, function or
   builtin, a one-sentence thinking channel, the documentation's first sentences as the answer; greetings; some
   two-turn, some with thinking off), in a fixed shuffled order, written to ``WORK/chat.jsonl``;
2. a byte-level BPE tokenizer with K3's split pattern learned on it (HF ``tokenizers``' trainer), written as
   ``tiktoken.model`` + ``tokenizer_config.json`` in the release's format, with K3's 256 specials on top, and
   checked: tiktoken over the written file encodes the whole corpus exactly as the trained tokenizer does;
3. a random K3 checkpoint of the demo's shape in the released layout (``kimi_jax.checkpoint.synthetic``);
4. ``kimi-jax train`` on it over the conversations then the corpus (the held-out part is the corpus's tail:
   ``--eval-frac`` of the whole, which covers the last 5% of the corpus that :func:`heldout_loss` measures), exporting the released layout with the routed
   experts re-packed to MXFP4;
5. with ``--install``: the exported model copied to ``kimi_jax/assets/k3-demo`` with ``RECIPE.json`` (the command,
   the Python version, corpus and tokenizer digests, the losses).
"""

from __future__ import annotations

import argparse
import ast
import builtins
import hashlib
import inspect
import json
import pathlib
import platform
import random
import re
import shutil
import sys
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np
import pydoc_data.topics
from flax import nnx

import kimi_jax
from kimi_jax import cli
from kimi_jax.checkpoint.synthetic import write_checkpoint
from kimi_jax.cli.demo import with_special_ids
from kimi_jax.model.config import tiny_k3_config_dict
from kimi_jax.text import chat
from kimi_jax.text.tokenizer import (NUM_RESERVED_SPECIAL, byte_level_bytes, learn_bpe, load_tokenizer,
                                    write_kimi_tokenizer)

ROOT = pathlib.Path(__file__).resolve().parents[1]
ASSET = ROOT / "kimi_jax" / "assets" / "k3-demo"
VOCAB = 4096  # 3840 learned ranks + K3's 256 reserved specials
EVAL_FRAC = 0.05  # the tail held out (of the whole training stream; heldout_loss: of the corpus)
SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__", "tkinter"}


def demo_config() -> dict:
    """The demo's K3 config.json: the released architecture at a few million parameters."""
    c = tiny_k3_config_dict()
    t = c["text_config"]
    t.update(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=9, num_attention_heads=4, num_key_value_heads=4,
             intermediate_size=768, attn_res_block_size=3, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=64,
             qk_rope_head_dim=16, v_head_dim=64, num_experts=8, num_experts_per_token=2, moe_intermediate_size=128,
             routed_expert_hidden_size=128, num_shared_experts=1, max_position_embeddings=4096)
    t["linear_attn_config"].update(num_heads=4, head_dim=64)
    return with_special_ids(c)


def stdlib_sources():
    """(path relative to the standard library, source text, parsed tree) of each of its modules the recipes read, in
    a fixed order: paths sorted, folders in ``SKIP_DIRS`` left out, a file that does not parse skipped. What the
    corpus, the conversations and the drafter's code prompts (scripts/make_demo_drafter.py) are made from."""
    lib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(lib.rglob("*.py")):
        rel = path.relative_to(lib)
        if SKIP_DIRS & set(rel.parts[:-1]):
            continue
        try:
            src = path.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        yield rel, src, tree


def _docstrings(tree: ast.Module) -> list[str]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docs = (ast.get_docstring(n) for n in ast.walk(tree) if isinstance(n, kinds))
    return [d for d in docs if d and len(d) >= 200]


def corpus() -> str:
    """The documentation pages pydoc ships, then the standard library's longer docstrings."""
    parts = [pydoc_data.topics.topics[k].strip() for k in sorted(pydoc_data.topics.topics)]
    for _, _, tree in stdlib_sources():
        parts.extend(_docstrings(tree))
    return "\n\n".join(parts) + "\n"


# -- the conversations ------------------------------------------------------------------------------------------

GREETINGS = ("Hi", "Hello", "Hi!", "Hello!", "Hey", "Hey there", "hi", "hello", "Good morning", "Good evening",
             "Hi there!", "Hello, how are you?")
GREETING_THOUGHT = "The user greets me. I will say hello and offer help with Python."
GREETING = ("Hello! I am the kimi-jax demo model, a small Kimi K3 trained on Python's documentation. Ask me about a "
            "Python statement, module or function.")
IDENTITY_QUESTIONS = ("Who are you?", "What are you?", "What can you do?", "What is this model?", "Are you Kimi?")
IDENTITY_THOUGHT = "The user asks what I am. I will say what this model is and what it knows."
IDENTITY = ("I am the kimi-jax demo model: a Kimi K3 with a few million parameters, trained on a CPU on Python's "
            "documentation. I know a little about Python and not much else.")
THANKS = ("Thanks!", "Thank you.", "Thanks, that helps.", "Great, thank you!")
THANKS_THOUGHT = "The user thanks me. I will answer politely."
THANKS_REPLY = "You're welcome! Ask me anything else about Python."
SYSTEMS = ("You are a helpful assistant.", "You are Kimi, an AI assistant.", "Answer briefly.")
QUESTIONS = {  # kind -> question templates, used in turn
    "topic": ("Tell me about {}.", "Explain {}.", "What should I know about {}?"),
    "module": ("What is the {} module?", "What does the {} module do?", "Tell me about the {} module."),
    "class": ("What is {}?", "What is the {} class?", "Describe the class {}."),
    "function": ("What does {}() do?", "What is {} for?", "Explain {}()."),
}
THOUGHT = {"topic": "The user asks about {}. I will answer with what the documentation says.",
           "module": "The user asks about the {} module. I will answer with what the documentation says.",
           "class": "The user asks about the class {}. I will answer with what the documentation says.",
           "function": "The user asks about {}. I will answer with what the documentation says."}
BUILTIN_TYPES = ("str", "list", "dict", "set", "tuple", "int", "float", "bytes")


def _answer(doc: str, limit: int = 320) -> str | None:
    """The first sentences (up to ``limit`` characters) of the first prose paragraph of ``doc`` among its first two,
    or None: signatures, grammar rules, examples and fragments do not make answers."""
    for par in doc.strip().split("\n\n")[:2]:
        par = " ".join(par.split())
        if not par or "::=" in par or "->" in par or not par[0].isupper() or par.startswith(">>>"):
            continue
        out = ""
        for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z])", par):
            if len(out) + len(sentence) + 1 > limit:
                break
            out = f"{out} {sentence}".strip()
        if len(out) >= 30 and out.endswith((".", "!", "?")):
            return out
    return None


def _topic_facts():
    """(kind, subject, answer) for each titled section of the pydoc topics (titles underlined with * or =)."""
    for key in sorted(pydoc_data.topics.topics):
        lines = pydoc_data.topics.topics[key].split("\n")
        for i in range(len(lines) - 1):
            title, rule = lines[i].strip(), lines[i + 1].strip()
            if title and len(rule) >= 3 and set(rule) <= set("*=") and len(rule) == len(lines[i].rstrip()):
                answer = _answer("\n".join(lines[i + 2:]))
                if answer:
                    subject = title.replace('"', "`")
                    yield "topic", subject[0].lower() + subject[1:] if subject.startswith("The ") else subject, answer


def _module_facts():
    """(kind, dotted name, answer) for the public modules, classes and functions of the standard library's sources
    (the files :func:`corpus` reads) with a docstring that makes an answer."""
    for rel, _, tree in stdlib_sources():
        if any(p.startswith("_") and p != "__init__.py" for p in rel.parts):
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        if (doc := ast.get_docstring(tree)) and (answer := _answer(doc)):
            yield "module", module, answer
        todo = [(tree, module)]
        while todo:
            node, prefix = todo.pop(0)
            for n in node.body:
                if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and not n.name.startswith("_"):
                    kind = "class" if isinstance(n, ast.ClassDef) else "function"
                    if (doc := ast.get_docstring(n)) and (answer := _answer(doc)):
                        yield kind, f"{prefix}.{n.name}", answer
                    if kind == "class":
                        todo.append((n, f"{prefix}.{n.name}"))


def _builtin_facts():
    """(kind, name, answer) for the builtins and the methods of the builtin types (their docstrings live in C)."""
    for name in sorted(vars(builtins)):
        obj = getattr(builtins, name)
        if name.startswith("_") or not callable(obj):
            continue
        if (doc := inspect.getdoc(obj)) and (answer := _answer(doc)):
            yield "class" if isinstance(obj, type) else "function", name, answer
    for t in BUILTIN_TYPES:
        for name in sorted(vars(getattr(builtins, t))):
            obj = getattr(getattr(builtins, t), name)
            if not name.startswith("_") and callable(obj) and (doc := inspect.getdoc(obj)) and (a := _answer(doc)):
                yield "function", f"{t}.{name}", a


def _turn(kind: str, subject: str, answer: str, n: int) -> tuple[dict, dict]:
    """A (user, assistant) pair; ``n`` picks the question's wording."""
    templates = QUESTIONS[kind]
    user = {"role": "user", "content": templates[n % len(templates)].format(subject)}
    return user, {"role": "assistant", "reasoning_content": THOUGHT[kind].format(subject), "content": answer}


def _canned(n: int) -> tuple[dict, dict]:
    """A greeting, a question about the model or thanks, with its one answer."""
    which = n % 6
    if which < 4:
        user, thought, reply = GREETINGS[n % len(GREETINGS)], GREETING_THOUGHT, GREETING
    elif which == 4:
        user, thought, reply = IDENTITY_QUESTIONS[n % len(IDENTITY_QUESTIONS)], IDENTITY_THOUGHT, IDENTITY
    else:
        user, thought, reply = THANKS[n % len(THANKS)], THANKS_THOUGHT, THANKS_REPLY
    return {"role": "user", "content": user}, {"role": "assistant", "reasoning_content": thought, "content": reply}


def conversations() -> list[dict]:
    """The chat data: one conversation per documented fact (``{"messages": [...]}`` rows of ``kimi-jax train``'s
    ``.jsonl`` format), in a fixed shuffled order. Every 8th opens with a greeting (or a question about the model,
    or thanks) before its question, every 12th is the greeting alone; every 4th has a second question (in half of
    those the first answer's thinking is dropped, as an OpenAI client sends history back), every 5th has thinking
    off, every 10th a system message; the thinking effort is mostly the release's default ``max``."""
    facts = sorted(set(_topic_facts()) | set(_module_facts()) | set(_builtin_facts()))
    random.Random(0).shuffle(facts)
    rows, i = [], 0
    while facts:
        messages = [{"role": "system", "content": SYSTEMS[i % len(SYSTEMS)]}] if i % 10 == 7 else []
        if i % 12 == 5:
            messages += _canned(i)
        else:
            if i % 8 == 3:
                messages += _canned(i // 8)
            messages += _turn(*facts.pop(), i)
            if i % 4 == 1 and facts:
                if i % 8 == 1:
                    messages[-1] = {"role": "assistant", "content": messages[-1]["content"]}
                messages += _turn(*facts.pop(), i // 4)
        row = {"messages": messages}
        if i % 5 == 2:
            row["thinking"] = False
        elif i % 7 == 4:
            row["thinking_effort"] = ("low", "medium", "high")[i % 3]
        rows.append(row)
        i += 1
    return rows


def chat_texts(rows: list[dict]) -> list[str]:
    """The text pieces of the conversations as :func:`kimi_jax.text.chat.encode` tokenizes them (one BPE input per
    segment; the markers are special ids, not text)."""
    return [seg.text for row in rows for seg in chat.render(
        row["messages"], thinking=row.get("thinking", True), thinking_effort=row.get("thinking_effort", "max"),
        add_generation_prompt=False) if not seg.control]


def tokenizer(work: pathlib.Path, text: str, pieces: list[str]):
    """Learn the BPE on the corpus and the conversations' text ``pieces``, write it in the release format, check
    tiktoken reproduces the trainer on both."""
    docs = text.split("\n\n") + pieces  # what the trainer sees
    ranks, hf = learn_bpe(docs, VOCAB - NUM_RESERVED_SPECIAL)
    tok = write_kimi_tokenizer(work / "init", ranks)
    ours = tok.encode(text)
    # compare token bytes (the trainer's alphabet's ids are in another order)
    theirs = [ranks[byte_level_bytes(t)] for enc in hf.encode_batch(docs) for t in enc.tokens]
    if [i for d in docs for i in tok.encode(d)] != theirs:
        raise SystemExit("tiktoken over the written tiktoken.model does not reproduce the trained BPE")
    print(f"tokenizer: {len(ranks)} ranks; corpus {len(text.encode()) / 1e6:.2f} MB -> {len(ours)} tokens "
          f"({len(text.encode()) / len(ours):.2f} bytes/token); tiktoken == trainer on all "
          f"{len(theirs)} per-document ids (corpus documents and conversation pieces)", file=sys.stderr)
    return tok


def heldout_loss(model_dir, text: str, frac: float = EVAL_FRAC, seq: int = 256, batch: int = 8) -> tuple[float, int]:
    """Mean next-token loss (nats) of the model in ``model_dir``, as loaded, over the held-out tail of ``text``
    (the part ``kimi-jax train --eval-frac`` kept out), in non-overlapping windows of ``seq``; and the tokens
    counted."""
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

    work = pathlib.Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    text = corpus()
    (work / "corpus.txt").write_text(text, encoding="utf-8")
    talks = conversations()
    with open(work / "chat.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n" for row in talks)
    if not (work / "init" / "config.json").exists():
        shutil.rmtree(work / "init", ignore_errors=True)
        tokenizer(work, text, chat_texts(talks))
        write_checkpoint(work / "init", family="k3", config=demo_config(), seed=args.seed, num_shards=1)
    # the conversations first: the held-out tail of the whole is the corpus's, which heldout_loss measures
    train = ["train", "--model", str(work / "init"), "--data", str(work / "chat.jsonl"), str(work / "corpus.txt"),
             "--steps", str(args.steps),
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
              "chat_sha256": _digest(work / "chat.jsonl"), "chat_conversations": len(talks),
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
