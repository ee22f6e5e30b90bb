"""``kimi-jax demo``, ``kimi-jax generate`` and ``kimi-jax chat`` (wired into :mod:`kimi_jax.cli`).

``--model`` takes an HF checkpoint directory or a converted kimi-jax directory (whatever
:func:`kimi_jax.from_pretrained` reads); without it the embedded tiny K3 demo checkpoint is built in a
temporary directory. Generated text streams to stdout; timings go to stderr. Compiled programs are kept in JAX's
persistent compilation cache (see :func:`enable_compile_cache`) so the next run skips compiling them.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax

from kimi_jax.cli import common
from kimi_jax.cli.demo import demo_recipe
from kimi_jax.generation.generate import GenerationError, generate
from kimi_jax.model.decoder import param_count
from kimi_jax.parallel import distributed
from kimi_jax.text import chat

DEFAULT_PROMPT = "The capital of France is"
DEMO_PROMPT = "The for statement"  # the demo model read Python's documentation


def _sampling_arguments(p: argparse.ArgumentParser, max_new: int):
    p.add_argument("--model", help="HF or converted checkpoint directory (default: the shipped demo model)")
    p.add_argument("--max-new-tokens", type=int, default=max_new)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-len", type=int, default=None, help="cache length (default: fits the request)")
    p.add_argument("--kv-cache", default=None, choices=["int8"],
                   help="MLA latent / GQA K,V cache rows in int8 with a float32 scale per row (default: --dtype)")
    p.add_argument("--kda-state", default=None, choices=["float32", "bfloat16"],
                   help="KDA recurrent state storage (default float32; the update runs in float32 either way)")
    common.quantize_argument(p)
    p.add_argument("--offload", default=None, metavar="KINDS",
                   help="comma list of experts,kda_state,cache kept in host memory and brought to the device per "
                        "layer (kimi_jax.model.offload)")
    common.dtype_argument(p)
    p.add_argument("--no-check-finite", action="store_true",
                   help="load weights holding NaN / Inf (or MXFP4 NaN scale bytes) instead of refusing them")
    common.compile_cache_arguments(p)
    common.parallel_arguments(p)


def add_demo_arguments(p: argparse.ArgumentParser):
    p.add_argument("--prompt", default=DEMO_PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=32)
    common.dtype_argument(p)
    p.add_argument("--random", action="store_true",
                   help="a random-weight tiny K3 written in the released format instead of the trained demo model")
    p.add_argument("--seed", type=int, default=0, help="with --random: weights seed")
    p.add_argument("--keep", metavar="DIR", help="with --random: write the checkpoint into DIR and keep it")
    common.compile_cache_arguments(p)
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
    common.setup_compile_cache(args)

    if (args.seed or args.keep) and not args.random:
        raise ValueError("--seed and --keep describe the random model: add --random")
    with common.model_dir(None, random=args.random, seed=args.seed, keep=args.keep) as path:
        got = common.load_model(path, common.resolve_dtype(args.dtype))
        model, tok, load_s, dtype = got.model, got.tokenizer, got.seconds, got.dtype
        cfg = model.cfg
        kinds = "".join({"kda": "K", "mla": "M", "gqa": "G"}[a] for a in cfg.attn_types)
        print(f"{'tiny' if args.random else 'demo'} Kimi K3 in the released format ({param_count(model) / 1e6:.2f}M "
              f"parameters, {cfg.num_layers} layers [{kinds}], {cfg.moe.num_experts} MXFP4 experts, vocab "
              f"{cfg.vocab_size}) loaded from {path} in {load_s:.2f}s; {jax.devices()[0].platform}, {dtype}. "
              f"{_provenance(args.random)}", file=sys.stderr)
        kw = dict(max_new_tokens=args.max_new_tokens, tokenizer=tok, stop=())  # stop=(): always show the budget
        print(f"> {args.prompt}", file=sys.stderr)
        t0 = time.perf_counter()
        first = generate(model, args.prompt, stream=_printer(), **kw)
        total = time.perf_counter() - t0
        print(file=sys.stderr)
        print(f"first request (compiles prefill + decode, or loads them from the compilation cache): time to first "
              f"token {first.timings['prefill']:.2f}s, total {total:.2f}s", file=sys.stderr)
        again = generate(model, args.prompt, **kw)
        assert again.tokens == first.tokens  # greedy and deterministic
        _report(again, "second request (compiled): ")


def _provenance(random: bool) -> str:
    if random:
        return "Random weights: the text is noise."

    r = demo_recipe()
    return (f"Trained on Python's documentation ({r['train_tokens'] / 1e6:.1f}M tokens seen, held-out loss "
            f"{r['heldout_loss']:.2f} nats/token): it writes in that style, and knows little.")


def _prompts(args, tok):
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
    missing = [m for m in (chat.OPEN, chat.CLOSE, chat.SEP, chat.END_OF_MSG) if m not in tok.specials]
    if missing:
        raise ValueError(f"the K3 chat format needs the Kimi tokenizer's markers; this tokenizer lacks {missing}")


def _load_for(args, path, *, batch: int, context: int):
    """The model on the mesh ``--mesh`` asks for (one device without it), loaded for ``batch`` sequences of
    ``context`` tokens (what ``--mesh auto`` plans for)."""
    dtype = common.resolve_dtype(args.dtype)
    mesh = common.make_mesh(args, path, batch=batch, context=context, dtype=dtype, quantize=args.quantize)
    return common.load_model(path, dtype, not args.no_check_finite, args.quantize, args.offload, mesh=mesh,
                             layout=args.layout)


def run_generate(args):
    common.setup_compile_cache(args)
    common.setup_processes(args)

    with common.model_dir(args.model) as path:
        n = len(args.prompt or args.ids or [None])
        got = _load_for(args, path, batch=n, context=args.max_len or 4096)
        model, tok = got.model, got.tokenizer
        prompts = _prompts(args, tok)
        speak = common.leader()  # several processes compute together; process 0 prints
        # one prompt, one process: streamed; several processes print whole replies (the tokens are gathered)
        stream = None if (args.no_stream or len(prompts) > 1 or jax.process_count() > 1) else _printer()
        r = generate(model, prompts, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, stop=args.stop, seed=args.seed, tokenizer=tok, stream=stream,
                              max_len=args.max_len, kv_cache=args.kv_cache, kda_state=args.kda_state)
        if not speak:
            return
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
    common.setup_compile_cache(args)
    common.setup_processes(args)

    stdin = stdin or sys.stdin
    thinking = not args.no_thinking
    speak = common.leader()  # several processes: process 0 reads the conversation and prints; all compute

    with common.model_dir(args.model) as path:
        loaded = _load_for(args, path, batch=1, context=args.max_len)
        model, tok = loaded.model, loaded.tokenizer
        live = speak and jax.process_count() == 1  # streamed as it comes; on several processes, whole replies
        if tok is None:
            raise ValueError(f"{path}: chat needs tokenizer files (tiktoken.model + tokenizer_config.json)")
        _require_chat(tok)
        stop = [tok.specials[chat.END_OF_MSG]]
        history = [{"role": "system", "content": args.system}] if args.system else []
        if speak:
            print("kimi-jax chat: type a message; /reset clears the conversation, /exit (or EOF) quits.",
                  file=sys.stderr)
        while True:
            if speak:
                print("you> ", end="", file=sys.stderr, flush=True)
            line = distributed.share_text(stdin.readline() if speak else None)
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

            if speak:
                print("kimi> ", end="", flush=True)
            try:
                r = generate(model, [ids], args.max_new_tokens, temperature=args.temperature,
                                      top_k=args.top_k, top_p=args.top_p, stop=stop, seed=args.seed, tokenizer=tok,
                                      stream=stream if live else None, max_len=args.max_len, kv_cache=args.kv_cache,
                                      kda_state=args.kda_state)
            except GenerationError as e:  # e.g. the conversation outgrew the cache: keep the session alive
                if speak:
                    print(f"\n[{e}; /reset starts a new conversation]", file=sys.stderr)
                history.pop()
                continue
            reply = chat.parse_reply(tok, r.tokens[0], thinking=thinking)
            history.append({"role": "assistant", "content": reply.content, "reasoning_content": reply.reasoning,
                            **({"tool_calls": [{"function": c} for c in reply.tool_calls]} if reply.tool_calls else {})})
            if not speak:
                continue
            print("" if live else reply.content)
            if not reply.finished:
                print(f"[reply cut at {args.max_new_tokens} tokens]", file=sys.stderr)
            _report(r)
