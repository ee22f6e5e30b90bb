"""``kimi-jax demo``, ``kimi-jax generate`` and ``kimi-jax chat`` (wired into :mod:`kimi_jax.cli`).

``--model`` takes an HF checkpoint directory or a converted kimi-jax directory (whatever
:func:`kimi_jax.from_pretrained` reads); without it the embedded tiny K3 demo checkpoint is built in a
temporary directory. Generated text streams to stdout; timings go to stderr. Compiled programs are kept in JAX's
persistent compilation cache (see :func:`enable_compile_cache`) so the next run skips compiling them.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import jax

from kimi_jax.cli import common, progress
from kimi_jax.cli.demo import demo_recipe
from kimi_jax.generation import speculative
from kimi_jax.generation.generate import MEASURES, check_sampling, generate
from kimi_jax.model.config import DEMO_DRAFTER
from kimi_jax.model.decoder import param_count
from kimi_jax.parallel import distributed
from kimi_jax.text import chat

DEFAULT_PROMPT = "The capital of France is"
DEMO_PROMPT = "The for statement"  # the demo model read Python's documentation


def _sampling_arguments(p: argparse.ArgumentParser, max_new: int):
    p.formatter_class = common.HelpFormatter
    p.add_argument("--model", help="HF or converted checkpoint directory (default: the shipped demo model)")
    p.add_argument("--max-new-tokens", type=int, default=max_new, help="most tokens to generate per reply")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]; 1 = off")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--max-len", type=int, default=None,
                   help="cache length: prompt + new tokens must fit (default: fits the request)")
    common.kv_cache_argument(p)
    p.add_argument("--kda-state", default=None, choices=["float32", "bfloat16"],
                   help="KDA recurrent state storage (default float32; the update runs in float32 either way)")
    common.quantize_argument(p)
    p.add_argument("--offload", default=None, metavar="KINDS",
                   help="comma list of experts,kda_state,cache kept in host memory and brought to the device per "
                        "layer (kimi_jax.model.offload; default: none)")
    common.dtype_argument(p)
    p.add_argument("--no-check-finite", action="store_true",
                   help="load weights holding NaN / Inf (or MXFP4 NaN scale bytes) instead of refusing them")
    common.compile_cache_arguments(p)
    common.parallel_arguments(p)
    common.scan_argument(p)


def _speculative_argument(p: argparse.ArgumentParser):
    p.add_argument("--speculative", default=None, metavar="SPEC",
                   help="speculative decoding: 'ngram[:k=4,max_n=3,min_n=1]' drafts from the prompt and output so "
                        "far (prompt lookup); 'dspark:PATH[,k=N]' drafts with a DSpark drafter (k3_dspark layout) "
                        "from the model's hidden states ('dspark:demo': the one shipped for the demo model); "
                        "'draft:PATH[,k=N]' with a smaller model of the family (same vocabulary); each also takes "
                        "adapt=cost (the default: verify only where the drafts are expected to repay a verify step's "
                        "cost on this device, measured in plain steps) or adapt=acceptance (verify whenever a "
                        "sequence drafted); greedy output is the plain greedy output, sampled output (--temperature) "
                        "has the plain sampler's distribution (rejection sampling) (default: off)")


def add_demo_arguments(p: argparse.ArgumentParser):
    p.formatter_class = common.HelpFormatter
    p.add_argument("--prompt", default=DEMO_PROMPT, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate")
    common.dtype_argument(p)
    p.add_argument("--random", action="store_true",
                   help="a random-weight tiny K3 written in the released format instead of the trained demo model")
    p.add_argument("--seed", type=int, default=0, help="with --random: weights seed")
    p.add_argument("--keep", metavar="DIR", help="with --random: write the checkpoint into DIR and keep it "
                   "(default: a temporary directory)")
    p.add_argument("--speculative", action="store_true",
                   help="then generate again with the DSpark drafter trained for the demo model "
                        "(kimi_jax/assets/k3-demo-dspark) and show its acceptance and speed-up")
    common.compile_cache_arguments(p)
    p.set_defaults(func=run_demo)


def add_generate_arguments(p: argparse.ArgumentParser):
    _sampling_arguments(p, 64)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append",
                     help=f"prompt text (repeat for a batch; default: {DEFAULT_PROMPT!r}, said on stderr)")
    src.add_argument("--ids", action="append", help="prompt token ids, comma-separated (repeat for a batch)")
    p.add_argument("--chat", action="store_true",
                   help="wrap each prompt as a user message (K3 chat format) and print the reply's answer, its "
                        "thinking first")
    p.add_argument("--no-thinking", action="store_true", help="with --chat: thinking mode off")
    p.add_argument("--hide-thinking", action="store_true", help="with --chat: print the answer only")
    _speculative_argument(p)
    p.add_argument("--stop", type=int, action="append", help="stop token id (repeatable; default: the "
                   "tokenizer's <|end_of_msg|> / EOS, else config eos_token_id)")
    p.add_argument("--no-stream", action="store_true", help="print the whole text at the end instead of as it comes")
    p.set_defaults(func=run_generate)


def add_chat_arguments(p: argparse.ArgumentParser):
    _sampling_arguments(p, 512)
    # one cache size for the whole conversation: decode compiles once (prefill once per prompt bucket)
    p.set_defaults(max_len=4096)
    p.add_argument("--system", help="system message (default: none)")
    p.add_argument("--no-thinking", action="store_true", help="thinking mode off: the model answers at once")
    p.add_argument("--hide-thinking", action="store_true",
                   help="do not print the thinking channel (by default it streams before the answer, dimmed on a "
                        "terminal)")
    _speculative_argument(p)
    p.set_defaults(func=run_chat)


def check_flags(args) -> None:
    """The generation flags refused by name before anything loads (the library's checks, spelled as flags)."""
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    max_len = getattr(args, "max_len", None)
    if max_len is not None and max_len < 2:
        raise ValueError(f"--max-len must be >= 2, got {max_len}")
    if max_len is not None and args.max_new_tokens >= max_len:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in --max-len "
                         f"{max_len} (the cache holds prompt + new tokens)")
    with common.flag_names():
        check_sampling(1, getattr(args, "temperature", 0.0), getattr(args, "top_k", 0), getattr(args, "top_p", 1.0),
                       args.seed)


def _rate(n, s):
    return f"{n / s:.1f} tok/s" if s > 0 else "-"


def _report(r, label=""):
    t = r.timings
    n_prompt = sum(len(p) for p in r.prompt_tokens)
    print(f"{label}prefill {n_prompt} tokens in {t['prefill']:.3f}s ({_rate(n_prompt, t['prefill'])}; first token "
          f"after {t['prefill']:.3f}s); decode {t['decode_steps']} steps x {len(r.tokens)} sequences in "
          f"{t['decode']:.3f}s ({_rate(t['new_tokens'] - len(r.tokens), t['decode'])})", file=sys.stderr)


class _Held:
    """A stream callback that shows nothing until its second call: the first comes right after the prefill, before
    the decode program compiles (seconds to minutes on a cold start), so holding it back turns a stall in the middle
    of the text into a wait the status line explains. Then it ends the status line and passes every piece on."""

    def __init__(self, show, status: progress.Status | None):
        self.show, self.status, self.pending, self.calls = show, status, [], 0

    def __call__(self, tokens, text):
        self.calls += 1
        self.pending.append((tokens, text))
        if self.calls >= 2:
            self.flush()

    def flush(self):
        if self.status is not None:
            self.status.close()
            self.status = None
        for tokens, text in self.pending:
            self.show(tokens, text)
        self.pending = []


def _printer(index: int = 0):
    def stream(tokens, text):
        if text is not None:
            sys.stdout.write(text[index])
        else:
            sys.stdout.write(" ".join(map(str, tokens[index])) + " ")
        sys.stdout.flush()
    return stream


@contextlib.contextmanager
def _compiling(expected=("prefill", "decode")):
    """A status line naming the programs that compile inside the block; yields (the status, the
    :class:`~kimi_jax.cli.progress.CompileWatch`, whose summary :func:`_say_compiled` prints after the output)."""
    status = progress.Status("kimi-jax: ")
    try:
        with progress.watch_compiles(status, expected=expected) as watch:
            yield status, watch
    finally:
        status.close()


def _say_compiled(watch) -> None:
    if watch.summary():
        print(f"kimi-jax: {watch.summary()}", file=sys.stderr)


def run_demo(args):
    if (args.seed or args.keep) and not args.random:
        raise ValueError("--seed and --keep describe the random model: add --random")
    if args.speculative and args.random:
        raise ValueError("--speculative runs the drafter trained for the demo model: not with --random")
    check_flags(args)
    common.setup_compile_cache(args)

    with common.model_dir(None, random=args.random, seed=args.seed, keep=args.keep) as path:
        got = common.load_model(path, common.resolve_dtype(args.dtype))
        model, tok, load_s, dtype = got.model, got.tokenizer, got.seconds, got.dtype
        cfg = model.cfg
        kinds = "".join({"kda": "K", "mla": "M", "gqa": "G"}[a] for a in cfg.attn_types)
        print(f"{'tiny' if args.random else 'demo'} Kimi K3 in the released format ({param_count(model) / 1e6:.2f}M "
              f"parameters, {cfg.num_layers} layers [{kinds}], {cfg.moe.num_experts} MXFP4 experts, vocab "
              f"{cfg.vocab_size}) loaded from {path} in {load_s:.2f}s; {jax.devices()[0].platform}, {dtype}. "
              f"{_provenance(args.random)}", file=sys.stderr)
        print("kimi-jax demo: the first request compiles the prefill and decode programs (on a first run, seconds to "
              "a minute on a CPU; later runs read them from the compilation cache)", file=sys.stderr)
        kw = dict(max_new_tokens=args.max_new_tokens, tokenizer=tok, stop=())  # stop=(): always show the budget
        print(f"> {args.prompt}", file=sys.stderr)
        t0 = time.perf_counter()
        with _compiling() as (status, watch):
            held = _Held(_printer(), status)
            first = generate(model, args.prompt, stream=held, **kw)
            held.flush()
        total = time.perf_counter() - t0
        print(file=sys.stderr)
        _say_compiled(watch)
        print(f"first request (compiles prefill + decode, or loads them from the compilation cache): time to first "
              f"token {first.timings['prefill']:.2f}s, total {total:.2f}s", file=sys.stderr)
        again = generate(model, args.prompt, **kw)
        assert again.tokens == first.tokens  # greedy and deterministic
        _report(again, "second request (compiled): ")
        if args.speculative:
            _demo_speculative(model, args.prompt, kw)


SPEC_TOKENS = 128  # the fewest new tokens the speculative comparison decodes (below)


def _demo_speculative(model, prompt, kw) -> None:
    """The demo prompt again with the demo's DSpark drafter: the same tokens, the acceptance, the speed (the median
    of three plain and speculative pairs, after the requests that measure what a verify step costs: the generator's
    first ``MEASURES`` speculative ones). Over at least ``SPEC_TOKENS`` new tokens, plain and speculative alike: a
    verify step's cost is timed on a request's first speculative steps (about 22), which a 32-token request hardly
    gets past."""
    kw = {**kw, "max_new_tokens": max(kw["max_new_tokens"], SPEC_TOKENS)}
    drafter = speculative.parse(f"dspark:{DEMO_DRAFTER}", dtype=model.run.dtype)
    for _ in range(MEASURES):  # compiles the verify loop; each times a verify step, where the bucket still drafts
        generate(model, prompt, speculative=drafter, **kw)
    runs = [(generate(model, prompt, **kw), generate(model, prompt, speculative=drafter, **kw)) for _ in range(3)]
    plain, r = sorted(runs, key=lambda pair: pair[0].timings["decode"] / pair[1].timings["decode"])[1]  # the median
    if r.tokens != plain.tokens:  # greedy speculative output is plain greedy output (up to float rounding)
        print("speculative: the output differs from the plain output (a near-tie decided differently in this dtype)",
              file=sys.stderr)
    s, n = r.timings["speculative"], plain.timings["new_tokens"] - 1
    print(f"speculative ({n + 1} new tokens, DSpark drafter {DEMO_DRAFTER.name}, k={drafter.k}): {s['accepted']} of "
          f"{s['drafted']} drafted tokens accepted, {s['tokens_per_step']:.2f} new tokens per forward{_paced(s)}; "
          f"decode {_rate(n, r.timings['decode'])} vs {_rate(n, plain.timings['decode'])} plain "
          f"({plain.timings['decode'] / r.timings['decode']:.2f}x)", file=sys.stderr)


def _paced(s: dict) -> str:
    """What the speculative loop measured of a verify step's cost (``timings["speculative"]``), for a report."""
    if s["verify_cost"] is None:
        return ""
    return (f" (a verify step costs {s['verify_cost']:.1f} plain steps here" +
            ("" if s["drafting"] else ": more than its drafts repay, so it decoded plainly") +
            ")")


def _provenance(random: bool) -> str:
    if random:
        return "Random weights: the text is noise."

    r = demo_recipe()
    chats = " and chats about it" if r.get("chat_conversations") else ""  # the recipe's RECIPE.json says which
    return (f"Trained on Python's documentation{chats} ({r['train_tokens'] / 1e6:.1f}M tokens seen, "
            f"held-out loss {r['heldout_loss']:.2f} nats/token): it writes in that style, and knows little.")


def _ids(args) -> list[list[int]] | None:
    """The ``--ids`` prompts, parsed (None without ``--ids``); a malformed one is refused naming it."""
    if not args.ids:
        return None
    out = []
    for s in args.ids:
        try:
            out.append([int(t) for t in s.replace(" ", "").split(",") if t])
        except ValueError:
            raise ValueError(f"--ids {s!r}: expected comma-separated integers") from None
    return out


def _prompts(args, tok):
    ids = _ids(args)
    if ids is not None:
        return ids
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
        raise ValueError(f"the K3 chat format needs the Kimi tokenizer's markers; this tokenizer lacks "
                         f"{', '.join(missing)}")


def _load_for(args, path, *, batch: int, context: int):
    """The model on the mesh ``--mesh`` asks for (one device without it), loaded for ``batch`` sequences of
    ``context`` tokens (what ``--mesh auto`` plans for)."""
    dtype = common.resolve_dtype(args.dtype)
    mesh = common.make_mesh(args, path, batch=batch, context=context, dtype=dtype, quantize=args.quantize)
    return common.load_model(path, dtype, not args.no_check_finite, args.quantize, args.offload, mesh=mesh,
                             layout=args.layout, scan_layers=args.scan_layers)


def _check_generate_flags(args) -> None:
    check_flags(args)
    _ids(args)
    if (args.no_thinking or args.hide_thinking) and not args.chat:
        raise ValueError("--no-thinking and --hide-thinking describe a chat reply: add --chat")
    if args.chat and args.ids:
        raise ValueError("--chat wraps text prompts as user messages: give --prompt, not --ids")
    _check_speculative(args)
    if not args.prompt and not args.ids:  # the default prompt, said: a reply to a prompt nobody sees is a puzzle
        print(f"kimi-jax generate: no --prompt given; using {DEFAULT_PROMPT!r}", file=sys.stderr)


def _check_speculative(args) -> None:
    """``--speculative`` checked, and a drafter read, before the model loads (``args.drafter``: None without one, and
    for a draft model on ``--mesh``, which is read onto the model's mesh once it is up: :func:`_drafter`)."""
    args.drafter = None
    if args.speculative:
        speculative.check(args.speculative)  # a wrong spec is named before anything loads
        if not (args.mesh and args.speculative.startswith("draft:")):
            # read and checked before the model loads, in the dtype the model will most likely run in (generate
            # casts a DSpark drafter to the model's and places it on the model's mesh)
            args.drafter = speculative.parse(args.speculative, dtype="bfloat16" if args.dtype == "auto" else args.dtype)


def _drafter(args, model):
    """The drafter of ``--speculative`` for the loaded ``model`` (None without the flag)."""
    if args.speculative and args.drafter is None:
        return speculative.parse(args.speculative, dtype=model.run.dtype, parallel=model.run.parallel)
    return args.drafter


def _say_speculative(args, r) -> None:
    if args.speculative:
        s = r.timings["speculative"]
        print(f"speculative ({args.speculative}): {s['accepted']} of {s['drafted']} drafted tokens accepted; "
              f"{s['tokens_per_step']:.2f} new tokens per forward{_paced(s)}", file=sys.stderr)


def run_generate(args):
    _check_generate_flags(args)
    common.setup_compile_cache(args)
    common.setup_processes(args)

    with common.model_dir(args.model) as path:
        n = len(args.prompt or args.ids or [None])
        got = _load_for(args, path, batch=n, context=args.max_len or 4096)
        model, tok = got.model, got.tokenizer
        drafter = _drafter(args, model)
        prompts = _prompts(args, tok)
        speak = common.leader()  # several processes compute together; process 0 prints
        # one prompt, one process: streamed; several processes print whole replies (the tokens are gathered)
        streamed = not (args.no_stream or len(prompts) > 1 or jax.process_count() > 1)
        reply = _ChatReply(tok, not args.no_thinking, not args.hide_thinking) if args.chat else None
        with _compiling() as (status, watch), common.flag_names():
            held = _Held(reply.stream if reply else _printer(), status) if streamed else None
            r = generate(model, prompts, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                         top_p=args.top_p, stop=args.stop, seed=args.seed, tokenizer=tok, stream=held,
                         max_len=args.max_len, kv_cache=args.kv_cache, kda_state=args.kda_state,
                         speculative=drafter)
            if held is not None:
                held.flush()
        if speak:
            _print_generated(args, r, tok, prompts, reply, streamed)
            _say_compiled(watch)
            _say_speculative(args, r)


def _print_generated(args, r, tok, prompts, reply, streamed: bool) -> None:
    if streamed:
        if reply is not None:
            reply.end()
        print()
    else:
        for i in range(len(prompts)):
            out = r.text[i] if r.text is not None else " ".join(map(str, r.tokens[i]))
            if args.chat:
                out = chat.parse_reply(tok, r.tokens[i], thinking=not args.no_thinking).content
            print(f"[{i}] {out}" if len(prompts) > 1 else out)
    if args.chat and tok is not None:
        for i, ids in enumerate(r.tokens):
            got = chat.parse_reply(tok, ids, thinking=not args.no_thinking)
            print(f"[{i}] reasoning: {got.reasoning!r}\n[{i}] answer: {got.content!r}", file=sys.stderr)
    _report(r)


DIM, PLAIN = "\x1b[2m", "\x1b[0m"  # SGR faint / reset: the thinking printed dimmer than the answer


class _ChatReply:
    """One chat reply streamed to stdout as it is generated: the thinking channel first (after ``[thinking]``, dim
    on a terminal; left out with ``show_thinking=False``), then the answer on its own line. Each call re-reads the
    reply so far (:func:`kimi_jax.text.chat.parse_reply` splits it by marker ids) and prints what is new."""

    def __init__(self, tok, thinking: bool, show_thinking: bool, out=None):
        self.tok, self.thinking, self.show_thinking = tok, thinking, show_thinking
        self.out = out or sys.stdout
        self.tty = self.out.isatty()
        self.stop = {tok.specials[chat.END_OF_MSG]}
        self.ids: list[int] = []
        self.thought = self.said = 0  # characters of each channel printed
        self.in_thought = False

    def _write(self, text: str):
        self.out.write(text)
        self.out.flush()

    def stream(self, tokens, _text):
        self.ids.extend(tokens[0])
        got = chat.parse_reply(self.tok, [t for t in self.ids if t not in self.stop], thinking=self.thinking)
        if self.show_thinking and len(got.reasoning) > self.thought and not self.said:
            if not self.in_thought:
                self._write((DIM if self.tty else "") + "[thinking] ")
                self.in_thought = True
            self._write(got.reasoning[self.thought:])
            self.thought = len(got.reasoning)
        if len(got.content) > self.said:
            self._close_thought()
            self._write(got.content[self.said:])
            self.said = len(got.content)

    def _close_thought(self):
        if self.in_thought:
            self._write((PLAIN if self.tty else "") + "\n")
            self.in_thought = False

    def end(self):
        self._close_thought()


def _turn(args, model, tok, history, thinking: bool, live: bool, first: bool, drafter=None):
    """One reply of the conversation ``history`` (streamed when ``live``): its :class:`Generation` (None when the
    conversation outgrew the cache: said, and the session goes on), the :class:`_ChatReply` and the compile watch."""
    ids = chat.encode(tok, history, thinking=thinking)
    reply = _ChatReply(tok, thinking, not args.hide_thinking)

    def show(tokens, text):
        if not reply.ids:
            print("kimi> ", end="", flush=True)
        reply.stream(tokens, text)

    try:
        # the first reply compiles the decode loop too; a later one at most the prefill of a longer conversation
        with _compiling(("prefill", "decode") if first else ()) as (status, watch), common.flag_names():
            held = _Held(show, status) if live else None
            r = generate(model, [ids], args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                         top_p=args.top_p, stop=sorted(reply.stop), seed=args.seed, tokenizer=tok, stream=held,
                         max_len=args.max_len, kv_cache=args.kv_cache, kda_state=args.kda_state,
                         speculative=drafter)
            if held is not None:
                held.flush()
    except ValueError as e:  # e.g. the conversation outgrew the cache: keep the session alive
        print(f"\n[{e}; /reset starts a new conversation]", file=sys.stderr)
        return None, reply, None
    return r, reply, watch


def _chat_lines(stdin, speak: bool):
    """The user's lines (shared with every process), prompted with ``you>``; ends at EOF or /exit."""
    while True:
        if speak:
            print("you> ", end="", file=sys.stderr, flush=True)
        line = distributed.share_text(stdin.readline() if speak else None)
        if not line or line.strip() == "/exit":
            return
        yield line.rstrip("\n")


def run_chat(args, stdin=None):
    check_flags(args)
    _check_speculative(args)
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
        drafter = _drafter(args, model)
        history = [{"role": "system", "content": args.system}] if args.system else []
        if speak:
            print("kimi-jax chat: type a message; /reset clears the conversation, /exit (or EOF) quits.",
                  file=sys.stderr)
        replied = False
        for line in _chat_lines(stdin, speak):
            if line.strip() == "/reset":
                history = history[:1] if args.system else []
                continue
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            r, shown, watch = _turn(args, model, tok, history, thinking, live, not replied, drafter)
            replied = True
            if r is None:
                history.pop()
                continue
            reply = chat.parse_reply(tok, r.tokens[0], thinking=thinking)
            history.append({"role": "assistant", "content": reply.content, "reasoning_content": reply.reasoning,
                            **({"tool_calls": [{"function": c} for c in reply.tool_calls]} if reply.tool_calls else {})})
            if speak:
                _end_turn(args, r, reply, shown, live)
                _say_compiled(watch)
                _say_speculative(args, r)


def _end_turn(args, r, reply, shown: _ChatReply, live: bool) -> None:
    if live:
        shown.end()
        print()
    else:
        print(f"kimi> {reply.content}")
    if not reply.finished:
        where = "in its thinking, before any answer" if not reply.content else "in its answer"
        print(f"[reply cut at {args.max_new_tokens} tokens, {where}: --max-new-tokens raises the budget]",
              file=sys.stderr)
    _report(r)
