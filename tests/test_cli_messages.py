"""What the commands say (issue 36): help on every flag with its default, flags (not Python arguments) named in
errors, checks before the dtype line and before anything loads, one limit per request, a port refused in one line,
the Python the package needs, and the status line a long wait keeps."""

import argparse
import importlib.metadata
import io
import pathlib
import re
import time
import tomllib
import types

import jax
import jax.numpy as jnp
import pytest

from kimi_jax import cli
from kimi_jax.cli import common, progress
from kimi_jax.serving import validate
from kimi_jax.serving.events import Request

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _subparsers():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return parser, sub.choices


def test_every_flag_has_help_and_shows_its_default():
    """Each argument of each command (the convert plugin's too) has help; each flag whose default is a value shows
    it in the help the command prints."""
    _, commands = _subparsers()
    assert {"demo", "generate", "chat", "serve", "info", "make-tiny", "train", "convert", "plan"} <= set(commands)
    bad = []
    for name, p in commands.items():
        text = " ".join(p.format_help().split())
        for a in p._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            flag = "/".join(a.option_strings) or a.dest
            if not a.help or a.help == argparse.SUPPRESS:
                bad.append(f"{name} {flag}: no help")
            elif a.option_strings and a.default not in (None, False, argparse.SUPPRESS):
                shown = " ".join((p._get_formatter()._get_help_string(a) % {"default": a.default}).split())
                if "default" not in shown or shown not in text:
                    bad.append(f"{name} {flag}: default {a.default!r} not shown")
    assert not bad, "\n".join(bad)


def test_top_level_help_has_no_markup():
    parser, commands = _subparsers()
    for text in [parser.format_help(), *(p.format_help() for p in commands.values())]:
        assert "``" not in text and ":func:" not in text and ":mod:" not in text


def test_flags_are_checked_before_the_dtype_line(capsys):
    """A bad flag ends in one line naming it, before the dtype line and before anything loads."""
    for argv, line in [(["generate", "--max-new-tokens", "0"], "generate: error: --max-new-tokens must be >= 1, got 0"),
                       (["generate", "--top-p", "0"], "generate: error: --top-p must be in (0, 1], got 0.0"),
                       (["generate", "--temperature", "-1"], "generate: error: --temperature must be >= 0"),
                       (["generate", "--ids", "1,x"], "generate: error: --ids '1,x': expected comma-separated"),
                       (["generate", "--max-new-tokens", "8", "--max-len", "8"], "--max-new-tokens 8 leaves no room"),
                       (["chat", "--top-k", "-1"], "chat: error: --top-k must be >= 0 (0 = off), got -1"),
                       (["demo", "--max-new-tokens", "-3"], "demo: error: --max-new-tokens must be >= 1, got -3"),
                       (["serve", "--slots", "0"], "serve: error: --slots must be >= 1, got 0")]:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("kimi-jax ") and line in err and err.count("\n") == 1, (argv, err)
        assert "[" not in err.split("error:")[1], err  # no Python list printed


def test_dtype_line_is_short(capsys):
    assert common.resolve_dtype("auto") == "bfloat16"
    line = capsys.readouterr().err
    assert line == "kimi-jax: dtype bfloat16 (automatic; --dtype float32 for full precision)\n" and len(line) < 80


def test_library_limits_are_named_as_flags(capsys):
    """The generator names its Python argument (``max_len``); through the command the same limit is the flag."""
    assert cli.main(["generate", "--ids", "1,2,3", "--max-new-tokens", "2", "--max-len", "4"]) == 2
    err = capsys.readouterr().err
    assert "exceeds the cache length 4 (raise --max-len)" in err and "max_len" not in err
    assert common.flag_message("max_new_tokens must be positive; raise max_len, not top_k") == \
        "--max-new-tokens must be positive; raise --max-len, not --top-k"
    assert common.flag_message("max_len_x and my_max_len stay") == "max_len_x and my_max_len stay"


def test_generate_says_the_prompt_it_was_not_given(capsys):
    """Without --prompt the command says which prompt it uses (and its help does): here the run stops at a bad
    --mesh right after, before any model loads."""
    _, commands = _subparsers()
    assert "'The capital of France is'" in " ".join(commands["generate"].format_help().split())
    assert cli.main(["generate", "--mesh", "bogus=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kimi-jax generate: no --prompt given; using 'The capital of France is'\n"), err


def test_serve_refuses_a_port_in_one_line(capsys):
    """Was an OverflowError traceback from the socket."""
    for port in ("99999", "-1"):
        assert cli.main(["serve", "--port", port]) == 2
        err = capsys.readouterr().err
        assert err == f"kimi-jax serve: error: --port {port}: a TCP port is 0 to 65535 (0: any free port)\n"


def test_one_limit_per_request():
    """Whichever of the cache length and the model's context is shorter, a request too long is refused naming
    that one number, max_model_len (what /v1/models reports)."""
    shapes = validate.shapes(slots=1, max_len=2048, page_size=64, pages=None, prefill_chunk=64, min_chunk=64,
                             snapshot_every=None, compact_decode=True)
    for context, limit in [(4096, 2048), (1024, 1024), (None, 2048)]:
        cfg = types.SimpleNamespace(vocab_size=100, max_position_embeddings=context)
        assert validate.max_model_len(cfg, shapes.max_len) == limit
        with pytest.raises(validate.EngineError) as e:
            validate.check_request(Request([1] * 1000, max_tokens=limit), cfg, shapes, None)
        assert str(e.value) == (f"prompt (1000 tokens) + max_tokens ({limit}) = {1000 + limit} exceeds the maximum "
                                f"context length of {limit} tokens (max_model_len): shorten the prompt or lower "
                                "max_tokens")


def _min_version(spec: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.search(r">=\s*([\d.]+)", spec).group(1).split("."))


def test_python_requirement_is_jaxs():
    """pyproject's requires-python is at least what the JAX it installs needs (JAX 0.12: Python 3.12)."""
    ours = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    jax_needs = importlib.metadata.metadata("jax")["Requires-Python"]
    assert _min_version(ours) >= _min_version(jax_needs) and _min_version(ours) >= (3, 12), (ours, jax_needs)


def test_status_line_on_a_terminal_and_in_a_log():
    """On a terminal the line is rewritten in place (and cleared at the end); in a log each stage is one line, and a
    long stage is said again every `every` seconds."""
    tty = io.StringIO()
    s = progress.Status("kimi-jax: ", stream=tty, tty=True)
    s.set("compiling decode (program 2 of 2)...")
    s.close("compiled")
    assert tty.getvalue() == "\r\x1b[Kkimi-jax: compiling decode (program 2 of 2)...\r\x1b[Kkimi-jax: compiled\n"
    log = io.StringIO()
    s = progress.Status("kimi-jax: ", stream=log, tty=False, every=0.01)
    s.set("loading demo...")
    time.sleep(1.3)  # the ticker wakes every second
    s.close()
    lines = log.getvalue().splitlines()
    assert lines[0] == "kimi-jax: loading demo..." and len(lines) >= 2
    # said again with the time so far (a tick just short of the first second says it without)
    assert all(re.fullmatch(r"kimi-jax: loading demo\.\.\.( \ds)?", x) for x in lines[1:]), lines


def test_compiles_are_named_and_counted():
    """The watch names the jitted functions of generation as JAX traces and compiles them (n of m), ignores other
    programs, and sums them up. (The command end to end, with the held-back text: test_generate_says_what_it_compiles,
    slow.)"""
    def prefill(x):
        return jnp.sin(x) * 2

    def decode(x):
        return jnp.cos(x) + 1

    def helper(x):
        return x - 1

    log = io.StringIO()
    status = progress.Status("kimi-jax: ", stream=log, tty=False)
    with progress.watch_compiles(status, expected=("prefill", "decode")) as watch:
        x = jnp.ones((13,))
        jax.jit(prefill)(jax.jit(helper)(x)).block_until_ready()
        jax.jit(decode)(x).block_until_ready()
    status.close()
    assert log.getvalue().splitlines() == ["kimi-jax: compiling prefill (program 1 of 2)...",
                                           "kimi-jax: compiling decode loop (program 2 of 2)..."]
    assert [name for name, _ in watch.done] == ["prefill", "decode loop"]
    assert re.fullmatch(r"compiled 2 program\(s\) in [\d.]+s \(prefill [\d.]+s, decode loop [\d.]+s\)",
                        watch.summary()), watch.summary()
    jax.jit(prefill)(x)  # after the block: nothing is watched any more
    assert len(watch.done) == 2


def test_text_is_held_until_the_decode_program_is_compiled():
    """The first piece of a stream (right after the prefill) waits for the second (after the first decode call, by
    which time decode has compiled); then the status line ends and everything flows."""
    from kimi_jax.cli.generate import _Held

    shown, log = [], io.StringIO()
    status = progress.Status("kimi-jax: ", stream=log, tty=True)
    status.set("compiling decode loop (program 2 of 2)...")
    held = _Held(lambda tokens, text: shown.append(text[0]), status)
    held([[1]], ["The"])
    assert shown == [] and held.status is status
    held([[2, 3]], [" for statement"])
    assert shown == ["The", " for statement"] and held.status is None and log.getvalue().endswith("\r\x1b[K")
    held([[4]], [" is"])
    held.flush()
    assert shown == ["The", " for statement", " is"]
