"""``kimi-jax demo``, ``kimi-jax generate`` and ``kimi-jax chat`` (wired into :mod:`kimi_jax.cli`).

``--model`` takes an HF checkpoint directory or a converted kimi-jax directory (whatever
:func:`kimi_jax.from_pretrained` reads); without it the embedded tiny K3 demo checkpoint is built in a
temporary directory. Generated text streams to stdout; timings go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

DEFAULT_PROMPT = "The capital of France is"


def _sampling_arguments(p: argparse.ArgumentParser, max_new: int):
    p.add_argument("--model", help="HF or converted checkpoint directory (default: the embedded tiny K3 demo)")
    p.add_argument("--max-new-tokens", type=int, default=max_new)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-len", type=int, default=None, help="cache length (default: fits the request)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="activation/parameter dtype (float32 is the fast choice on CPU)")


def add_demo_arguments(p: argparse.ArgumentParser):
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0, help="weights seed of the demo checkpoint")
    p.add_argument("--keep", metavar="DIR", help="write the demo checkpoint into DIR and keep it")
    p.set_defaults(func=run_demo)


def add_generate_arguments(p: argparse.ArgumentParser):
    _sampling_arguments(p, 64)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    src.add_argument("--ids", action="append", help="prompt token ids, comma-separated (repeat for a batch)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (K3 chat format)")
    p.add_argument("--no-thinking", action="store_true", help="with --chat: thinking mode off")
    p.add_argument("--stop", type=int, action="append", help="stop token id (repeatable; default: the "
                   "tokenizer's <|end_of_msg|> / EOS, else config eos_token_id)")
    p.add_argument("--no-stream", action="store_true")
    p.set_defaults(func=run_generate)


def add_chat_arguments(p: argparse.ArgumentParser):
    _sampling_arguments(p, 256)
    # one cache size for the whole conversation: decode compiles once (prefill once per prompt bucket)
    p.set_defaults(max_len=4096)
    p.add_argument("--system", help="system message")
    p.add_argument("--no-thinking", action="store_true", help="thinking mode off")
    p.add_argument("--show-thinking", action="store_true", help="print the reasoning channel as it streams")
    p.set_defaults(func=run_chat)


@contextlib.contextmanager
def _model_dir(path, seed=0, keep=None):
    """The model directory to load: ``path``, or a freshly built demo checkpoint."""
    if path:
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path}: no such model directory")
        yield path
        return
    from kimi_jax.demo import build_demo_checkpoint

    if keep:
        yield build_demo_checkpoint(keep, seed=seed)
        return
    with tempfile.TemporaryDirectory(prefix="kimi-jax-demo-") as tmp:
        yield build_demo_checkpoint(tmp, seed=seed)


def _load(path, dtype):
    import kimi_jax
    from kimi_jax.tokenizer import has_tokenizer, load_tokenizer

    t0 = time.perf_counter()
    model = kimi_jax.from_pretrained(path, dtype=dtype)
    tok = load_tokenizer(path) if has_tokenizer(path) else None
    return model, tok, time.perf_counter() - t0


def _rate(n, s):
    return f"{n / s:.1f} tok/s" if s > 0 else "-"


def _report(r, label=""):
    t = r.timings
    n_prompt = sum(len(p) for p in r.prompt_tokens)
    print(f"{label}prefill {n_prompt} tokens in {t['prefill']:.3f}s ({_rate(n_prompt, t['prefill'])}; first token "
          f"after {t['prefill']:.3f}s); decode {t['decode_steps']} steps x {len(r.tokens)} sequences in "
          f"{t['decode']:.3f}s ({_rate(t['new_tokens'] - len(r.tokens), t['decode'])})", file=sys.stderr)


def _printer(index: int = 0):
    def stream(tokens, text):
        if text is not None:
            sys.stdout.write(text[index])
        else:
            sys.stdout.write(" ".join(map(str, tokens[index])) + " ")
        sys.stdout.flush()
    return stream


def run_demo(args):
    import jax

    import kimi_jax
    from kimi_jax.model import param_count

    with _model_dir(None, seed=args.seed, keep=args.keep) as path:
        model, tok, load_s = _load(path, args.dtype)
        cfg = model.cfg
        kinds = "".join({"kda": "K", "mla": "M", "gqa": "G"}[a] for a in cfg.attn_types)
        print(f"tiny Kimi K3 in the released format ({param_count(model) / 1e6:.2f}M parameters, {cfg.num_layers} "
              f"layers [{kinds}], {cfg.moe.num_experts} MXFP4 experts, vocab {cfg.vocab_size}) loaded from {path} "
              f"in {load_s:.2f}s; {jax.devices()[0].platform}, {args.dtype}. Random weights: the text is noise.",
              file=sys.stderr)
        kw = dict(max_new_tokens=args.max_new_tokens, tokenizer=tok, stop=())  # stop=(): always show the budget
        print(f"> {args.prompt}", file=sys.stderr)
        t0 = time.perf_counter()
        first = kimi_jax.generate(model, args.prompt, stream=_printer(), **kw)
        total = time.perf_counter() - t0
        print(file=sys.stderr)
        print(f"first request (compiles prefill + decode): time to first token {first.timings['prefill']:.2f}s, "
              f"total {total:.2f}s", file=sys.stderr)
        again = kimi_jax.generate(model, args.prompt, **kw)
        assert again.tokens == first.tokens  # greedy and deterministic
        _report(again, "second request (compiled): ")


def _prompts(args, tok):
    from kimi_jax import chat

    if args.ids:
        try:
            return [[int(t) for t in s.replace(" ", "").split(",") if t] for s in args.ids]
        except ValueError:
            raise ValueError(f"--ids: expected comma-separated integers, got {args.ids}") from None
    texts = args.prompt or [DEFAULT_PROMPT]
    if tok is None:
        raise ValueError("text prompts need tokenizer files (tiktoken.model or tokenizer.json) in the model "
                         "directory; pass --ids instead")
    if args.chat:
        _require_chat(tok)
        return [chat.encode(tok, [{"role": "user", "content": t}], thinking=not args.no_thinking) for t in texts]
    return texts


def _require_chat(tok):
    from kimi_jax import chat

    missing = [m for m in (chat.OPEN, chat.CLOSE, chat.SEP, chat.END_OF_MSG) if m not in tok.specials]
    if missing:
        raise ValueError(f"the K3 chat format needs the Kimi tokenizer's markers; this tokenizer lacks {missing}")


def run_generate(args):
    import kimi_jax
    from kimi_jax import chat

    with _model_dir(args.model) as path:
        model, tok, _ = _load(path, args.dtype)
        prompts = _prompts(args, tok)
        stream = None if (args.no_stream or len(prompts) > 1) else _printer()
        r = kimi_jax.generate(model, prompts, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, stop=args.stop, seed=args.seed, tokenizer=tok, stream=stream,
                              max_len=args.max_len)
        if stream is not None:
            print()
        else:
            for i in range(len(prompts)):
                out = r.text[i] if r.text is not None else " ".join(map(str, r.tokens[i]))
                print(f"[{i}] {out}" if len(prompts) > 1 else out)
        if args.chat and tok is not None:
            for i, ids in enumerate(r.tokens):
                reply = chat.parse_reply(tok, ids, thinking=not args.no_thinking)
                print(f"[{i}] reasoning: {reply.reasoning!r}\n[{i}] answer: {reply.content!r}", file=sys.stderr)
        _report(r)


def run_chat(args, stdin=None):
    import kimi_jax
    from kimi_jax import chat
    from kimi_jax.generate import GenerationError

    stdin = stdin or sys.stdin
    thinking = not args.no_thinking
    with _model_dir(args.model) as path:
        model, tok, _ = _load(path, args.dtype)
        if tok is None:
            raise ValueError(f"{path}: chat needs tokenizer files (tiktoken.model + tokenizer_config.json)")
        _require_chat(tok)
        stop = [tok.specials[chat.END_OF_MSG]]
        history = [{"role": "system", "content": args.system}] if args.system else []
        print("kimi-jax chat: type a message; /reset clears the conversation, /exit (or EOF) quits.",
              file=sys.stderr)
        while True:
            print("you> ", end="", file=sys.stderr, flush=True)
            line = stdin.readline()
            if not line or line.strip() == "/exit":
                break
            line = line.rstrip("\n")
            if line.strip() == "/reset":
                history = history[:1] if args.system else []
                continue
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            ids = chat.encode(tok, history, thinking=thinking)
            shown = {"think": 0, "answer": 0}
            got: list[int] = []

            def stream(tokens, _text):
                got.extend(tokens[0])
                reply = chat.parse_reply(tok, [t for t in got if t not in stop], thinking=thinking)
                if args.show_thinking and len(reply.reasoning) > shown["think"]:
                    sys.stderr.write(reply.reasoning[shown["think"]:])
                    shown["think"] = len(reply.reasoning)
                if len(reply.content) > shown["answer"]:
                    sys.stdout.write(reply.content[shown["answer"]:])
                    shown["answer"] = len(reply.content)
                sys.stdout.flush()

            print("kimi> ", end="", flush=True)
            try:
                r = kimi_jax.generate(model, [ids], args.max_new_tokens, temperature=args.temperature,
                                      top_k=args.top_k, top_p=args.top_p, stop=stop, seed=args.seed, tokenizer=tok,
                                      stream=stream, max_len=args.max_len)
            except GenerationError as e:  # e.g. the conversation outgrew the cache: keep the session alive
                print(f"\n[{e}; /reset starts a new conversation]", file=sys.stderr)
                history.pop()
                continue
            reply = chat.parse_reply(tok, r.tokens[0], thinking=thinking)
            print()
            if not reply.finished:
                print(f"[reply cut at {args.max_new_tokens} tokens]", file=sys.stderr)
            history.append({"role": "assistant", "content": reply.content, "reasoning_content": reply.reasoning,
                            **({"tool_calls": [{"function": c} for c in reply.tool_calls]} if reply.tool_calls else {})})
            _report(r)
