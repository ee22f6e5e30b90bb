"""``kimi-jax train``: train (or LoRA-tune) a model on text files, checkpoint with Orbax, export to the HF layout.

    kimi-jax train --model DIR --data a.txt b.txt --steps 300 --out runs/x [--lora 8]

Text is tokenized with the model directory's tokenizer (``tiny-k3``: the demo tokenizer; a directory without
tokenizer files: UTF-8 bytes, said on stderr); a ``.jsonl`` file holds conversations,
one ``{"messages": [...]}`` a line (optional ``"thinking"``: false, ``"thinking_effort"``), rendered in the K3 chat
format (:func:`kimi_jax.text.chat.encode`: markers as their special ids, thinking and answer channels). The files'
tokens follow each other in the order given and the last ``--eval-frac`` of them is held out. Each step draws
``--batch`` windows of ``--seq`` tokens from a generator seeded by (seed, step) (one that would start inside a
conversation starts at its beginning, so the model learns to end a message only where it sees the chat markers), so
a run resumed from its checkpoint (``OUT/checkpoints``, rerun the same command) sees exactly the batches it would
have.
Every step's metrics -- loss, gradient norm, learning rate, per-layer gradient and output norms, expert load, AttnRes
weights -- go to ``OUT/metrics.jsonl``; the final model goes to ``OUT/model`` in the released layout (MXFP4
experts re-quantized, LoRA merged) with the tokenizer files, readable by ``kimi_jax.from_pretrained``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from kimi_jax import training
from kimi_jax.checkpoint.loading import from_pretrained
from kimi_jax.cli import common
from kimi_jax.model import config as C
from kimi_jax.model.decoder import KimiModel
from kimi_jax.text import chat
from kimi_jax.text.tokenizer import Tokenizer, has_tokenizer, load_tokenizer, write_demo_tokenizer
from kimi_jax.training import checkpoint as ckpt
from kimi_jax.training.export import export_hf


def add_train_arguments(p):
    p.formatter_class = common.HelpFormatter
    p.add_argument("--model", required=True, help="model directory (HF layout or converted) or 'tiny-k3' (random)")
    p.add_argument("--data", nargs="+", required=True,
                   help="UTF-8 text files, and .jsonl files of chat conversations ({\"messages\": [...]} a line, "
                        "rendered in the K3 chat format); the held-out part is the end of the last file")
    p.add_argument("--steps", type=int, required=True, help="total optimizer steps (the schedule's length)")
    p.add_argument("--out", required=True, help="run directory: checkpoints/, metrics.jsonl, model/")
    p.add_argument("--lora", type=int, default=0, metavar="R", help="train rank-R LoRA adapters only (0: full)")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default 2R)")
    p.add_argument("--batch", type=int, default=8, help="windows per optimizer step")
    p.add_argument("--seq", type=int, default=128, help="tokens per training window")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (warmup, then cosine decay)")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default: steps // 10)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    p.add_argument("--clip", type=float, default=1.0, help="max global gradient norm (0: off)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="compute dtype (master weights are float32 either way)")
    p.add_argument("--remat", action="store_true", help="rematerialise each layer in the backward pass")
    p.add_argument("--balance-rate", type=float, default=1e-3, help="router correction-bias step per update")
    p.add_argument("--eval-every", type=int, default=50, help="steps between held-out evaluations")
    p.add_argument("--eval-frac", type=float, default=0.1, help="fraction of the text held out for eval")
    p.add_argument("--save-every", type=int, default=100, help="steps between checkpoints")
    p.add_argument("--stop-at", type=int, default=None,
                   help="stop after this step as if interrupted, leaving a checkpoint (rerun to resume)")
    p.add_argument("--export-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="dtype of the exported model's floating tensors")
    p.add_argument("--seed", type=int, default=0, help="seed of the windows drawn each step (and of LoRA's init)")
    common.parallel_arguments(p)
    p.set_defaults(func=run)


class _Bytes:
    """UTF-8 bytes as token ids (models without tokenizer files; needs a vocabulary of 256 or more)."""

    def encode(self, text):
        return list(text.encode())


def _load(args):
    """(model, raw config dict, tokenizer, tokenizer source directory or None)."""
    if args.model == "tiny-k3":  # the random tiny K3 gets the demo tokenizer, exported with the model
        raw = C.tiny_k3_config_dict()
        model = KimiModel(C.from_dict(raw), param_dtype=jnp.float32)
        tok_dir = os.path.join(args.out, "tokenizer")
        if not has_tokenizer(tok_dir):
            write_demo_tokenizer(tok_dir, vocab_size=model.cfg.vocab_size)
        return model, raw, load_tokenizer(tok_dir), tok_dir
    if not os.path.isdir(args.model):
        raise ValueError(f"--model {args.model!r}: not a model directory (or 'tiny-k3')")
    with open(os.path.join(args.model, "config.json")) as f:
        raw = json.load(f)
    model = from_pretrained(args.model, dtype="float32", progress=False)
    if has_tokenizer(args.model):
        return model, raw, load_tokenizer(args.model), args.model
    print(f"--model {args.model}: no tokenizer files there; text is encoded as UTF-8 bytes (ids 0-255) and the "
          f"exported model has no tokenizer", file=sys.stderr)
    return model, raw, _Bytes(), None


def unigram_entropy(ids: np.ndarray) -> float:
    """Entropy (nats) of the token frequencies: the loss of the best model that ignores context."""
    counts = np.bincount(ids)
    p = counts[counts > 0] / ids.size
    return float(-(p * np.log(p)).sum())


def windows(ids: np.ndarray, batch: int, seq: int, seed: int, step: int,
            anchors: np.ndarray | None = None) -> np.ndarray:
    """``[batch, seq]`` windows at random offsets, a function of (seed, step) only. With ``anchors`` (see
    :func:`_data`) an offset inside a conversation moves back to the conversation's first token, so every window that
    holds part of a conversation holds its chat markers from the start: the model never learns to end a message from
    text alone, and a plain-text prompt is continued as text."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(ids) - seq + 1, batch)
    if anchors is not None:
        starts = anchors[starts]
    return np.stack([ids[s:s + seq] for s in starts])


def _eval_batches(ids: np.ndarray, batch: int, seq: int):
    n = max(1, min(4, len(ids) // (batch * seq)))
    starts = np.linspace(0, len(ids) - seq, n * batch).astype(int)
    return [np.stack([ids[s:s + seq] for s in starts[i * batch:(i + 1) * batch]]) for i in range(n)]


def _conversations(path: str, tok) -> list[list[int]]:
    """The token ids of each conversation of a ``.jsonl`` file, in the K3 chat format."""
    if not isinstance(tok, Tokenizer) or any(m not in tok.specials for m in (chat.OPEN, chat.SEP, chat.END_OF_MSG)):
        raise ValueError(f"--data {path}: chat conversations need a tokenizer with the K3 chat markers (the model "
                         f"directory's tiktoken.model)")
    talks: list[list[int]] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                talks.append(chat.encode(tok, row["messages"], thinking=row.get("thinking", True),
                                         thinking_effort=row.get("thinking_effort", "max"),
                                         add_generation_prompt=False))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(f"--data {path}, line {n}: not a conversation ({type(e).__name__}: {e})") from None
    return talks


def _data(args, tok, vocab: int):
    """(training ids, held-out ids, anchors) of the ``--data`` files: ``anchors[p]`` is the first position of the
    conversation that training position ``p`` falls in, and ``p`` itself in text (what :func:`windows` starts at)."""
    parts, talks, texts = [], [], []  # talks: (offset, length) of each conversation in the joined ids
    at = 0

    def add(ids):
        nonlocal at
        parts.append(ids)
        at += len(ids)

    for f in args.data:  # consecutive text files are joined by a newline and tokenized together, as one text
        if f.endswith(".jsonl"):
            if texts:
                add(tok.encode("\n".join(texts)))
            for conv in _conversations(f, tok):
                talks.append((at, len(conv)))
                add(conv)
            texts = []
        else:
            texts.append(open(f, encoding="utf-8").read())
    if texts:
        add(tok.encode("\n".join(texts)))
    ids = np.asarray([i for p in parts for i in p], np.int32)
    if ids.size and int(ids.max()) >= vocab:
        raise ValueError(f"token id {int(ids.max())} >= vocab size {vocab}")
    cut = int(len(ids) * (1 - args.eval_frac))
    if cut < args.seq or len(ids) - cut < args.seq:
        raise ValueError(f"{len(ids)} tokens of text: too few for windows of --seq {args.seq} in both the training "
                         f"and the held-out part (--eval-frac {args.eval_frac})")
    anchors = np.arange(cut)
    for start, n in talks:
        anchors[start:min(start + n, cut)] = start
    return ids[:cut], ids[cut:], anchors


def _export(trainer, state, raw, tok_dir, args) -> str:
    """The final model in the released layout under ``OUT/model``, with the tokenizer files."""
    out = export_hf(trainer.model(state), raw, os.path.join(args.out, "model"), dtype=args.export_dtype)
    if tok_dir is not None:
        for f in os.listdir(tok_dir):
            if f.startswith("tokenizer") or f.endswith((".model", ".tiktoken")) or f == "special_tokens_map.json":
                shutil.copy(os.path.join(tok_dir, f), out)
    return out


def _trim_metrics(path: str, step: int) -> None:
    """Keep the metrics rows of steps <= ``step`` (the checkpoint resumed from): rows a killed run logged after its
    last checkpoint are run again, and would otherwise appear twice."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        rows = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    with open(path, "w") as f:
        f.writelines(rows)


def _last_row(path: str) -> dict:
    """The last row of ``metrics.jsonl`` (empty if there is none)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        rows = [line for line in f if line.strip()]
    return json.loads(rows[-1]) if rows else {}


def _host(metrics) -> dict:
    return jax.tree.map(lambda x: np.asarray(x).tolist(), jax.device_get(metrics))


def run(args):
    common.setup_processes(args)

    if jax.process_count() > 1:  # refused before anything loads
        raise ValueError("train runs in one process for now (its checkpoints, metrics and export are written by "
                         "one host): --mesh over this host's devices works; drop --coordinator")
    if args.mesh == "auto":
        raise ValueError("train --mesh auto: the plan sizes serving, not training; give --mesh data=D,expert=E,model=M")
    mesh = common.make_mesh(args, "", batch=args.batch, context=args.seq, dtype=args.dtype)
    model, raw, tok, tok_dir = _load(args)
    train_ids, eval_ids, anchors = _data(args, tok, model.cfg.vocab_size)
    h1 = unigram_entropy(train_ids)
    print(f"{len(train_ids)} training tokens, {len(eval_ids)} held out; unigram entropy {h1:.3f} nats", file=sys.stderr)

    model.run = dataclasses.replace(model.run, remat=args.remat)
    training.prepare(model, dtype=args.dtype)
    optim = training.OptimConfig(lr=args.lr, steps=args.steps, warmup=args.warmup if args.warmup is not None
                                 else args.steps // 10, weight_decay=args.weight_decay, clip=args.clip)
    lora = None
    if args.lora:
        lora = training.LoraConfig(rank=args.lora, alpha=2.0 * args.lora if args.lora_alpha is None
                                   else args.lora_alpha)
    config = training.TrainConfig(optim=optim, lora=lora, balance_rate=args.balance_rate, seed=args.seed)
    trainer, state = training.init(model, config, mesh=mesh, layout=args.layout)  # mesh None: one device
    step_fn, eval_fn = training.compile_steps(trainer)

    os.makedirs(args.out, exist_ok=True)
    mgr = ckpt.manager(os.path.join(args.out, "checkpoints"))
    got = ckpt.restore_latest(mgr, state)
    if got is not None:
        state = got[0]
        print(f"resumed from step {int(state.step)}", file=sys.stderr)
    start = int(state.step)
    _trim_metrics(os.path.join(args.out, "metrics.jsonl"), start)

    def evaluate():
        tot = cnt = 0.0
        for b in _eval_batches(eval_ids, args.batch, args.seq):
            b = jnp.asarray(b)
            loss, n = eval_fn(state, training.Batch(b, jnp.ones_like(b)))
            tot, cnt = tot + float(loss) * float(n), cnt + float(n)
        return tot / cnt

    log = open(os.path.join(args.out, "metrics.jsonl"), "a")
    stop = args.steps if args.stop_at is None else min(args.steps, args.stop_at)
    bar = tqdm(range(start, stop), initial=start, total=args.steps, desc="train", file=sys.stderr)
    last = {}
    for i in bar:
        b = jnp.asarray(windows(train_ids, args.batch, args.seq, args.seed, i, anchors))
        state, metrics = step_fn(state, training.Batch(b, jnp.ones_like(b)))
        row = {"step": i + 1, **_host(metrics)}
        if (i + 1) % args.eval_every == 0 or i + 1 == args.steps:
            row["eval_loss"] = evaluate()
        log.write(json.dumps(row) + "\n")
        last = row
        shown = {"loss": f"{row['loss']:.3f}"}
        if "eval_loss" in row:
            shown["eval"] = f"{row['eval_loss']:.3f}"
        bar.set_postfix(**shown)
        if (i + 1) % args.save_every == 0 and i + 1 < stop:
            ckpt.save(mgr, state, {"unigram_entropy": h1})
    log.close()
    if int(state.step) > start or got is None:
        ckpt.save(mgr, state, {"unigram_entropy": h1})
    if int(state.step) < args.steps:
        print(f"stopped at step {int(state.step)} of {args.steps}; rerun the command to resume", file=sys.stderr)
        return 0
    out = _export(trainer, state, raw, tok_dir, args)
    # the last logged step, not this process's last: a rerun of a finished run trains nothing and reports the same
    last = _last_row(os.path.join(args.out, "metrics.jsonl")) or last
    summary = {"steps": int(state.step), "final_loss": last.get("loss"), "eval_loss": last.get("eval_loss"),
               "unigram_entropy": h1, "model": out}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary))
    return 0 if math.isfinite(last.get("loss", 0.0) or 0.0) else 1
