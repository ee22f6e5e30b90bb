"""The embedded demo checkpoint and the demo / generate / chat commands (in-process, sharing compiled code)."""

import io
import json
import os
import re

import pytest

from kimi_jax import cli
from kimi_jax.cli import common
from kimi_jax.cli import generate as generate_cli
from kimi_jax.cli.demo import build_demo_checkpoint
from kimi_jax.text.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return build_demo_checkpoint(tmp_path_factory.mktemp("demo"))


def test_demo_checkpoint_is_in_the_released_format(demo_dir):
    files = sorted(os.listdir(demo_dir))
    assert files == ["config.json", "model-00001-of-000002.safetensors", "model-00002-of-000002.safetensors",
                     "model.safetensors.index.json", "tiktoken.model", "tokenizer_config.json"]
    cfg = json.load(open(os.path.join(demo_dir, "config.json")))
    tok = load_tokenizer(demo_dir)
    assert cfg["model_type"] == "kimi_k3" and cfg["text_config"]["vocab_size"] == tok.vocab_size == 1024
    # as released: the config's eos is the chat turn terminator, bos/pad the [BOS]/[PAD] specials
    assert cfg["eos_token_id"] == tok.specials["<|end_of_msg|>"] == 770
    assert (cfg["bos_token_id"], cfg["pad_token_id"]) == (tok.specials["[BOS]"], tok.specials["[PAD]"])
    index = json.load(open(os.path.join(demo_dir, "model.safetensors.index.json")))
    assert set(index) == {"metadata", "weight_map"}
    assert all(k.startswith("language_model.") for k in index["weight_map"])
    assert any(k.endswith("experts.0.w1.weight_packed") for k in index["weight_map"])


def test_demo_command(capsys):
    assert cli.main(["demo", "--max-new-tokens", "6"]) == 0  # the shipped trained model
    out, err = capsys.readouterr()
    assert "demo Kimi K3 in the released format" in err and "MXFP4 experts" in err
    assert "Trained on Python's documentation" in err and "held-out loss" in err
    assert "time to first token" in err and "tok/s" in err
    assert "the first request compiles the prefill and decode programs" in err  # said before the wait
    assert out.strip()  # the streamed text
    assert cli.main(["demo", "--random", "--max-new-tokens", "6"]) == 0
    out, err = capsys.readouterr()
    assert "tiny Kimi K3 in the released format" in err and "Random weights" in err and out.strip()
    assert cli.main(["demo", "--seed", "3"]) == 2
    assert "add --random" in capsys.readouterr().err


def test_demo_speculative_reports_a_measured_verify_step(capsys):
    """``kimi-jax demo --speculative``: the demo's DSpark drafter over 128 new tokens, plain and speculative alike,
    and what its verify step was measured to cost (over the demo's own budget, 32 tokens by default, the measure of a
    verify step hardly finished, and the comparison reported its cost: 0.33x)."""
    assert cli.main(["demo", "--max-new-tokens", "6", "--speculative"]) == 0
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if x.startswith("speculative (")]
    assert len(line) == 1 and "128 new tokens, DSpark drafter k3-demo-dspark, k=4" in line[0], err
    assert "a verify step costs" in line[0] and "tok/s plain" in line[0], line


def test_generate_command(demo_dir, capsys):
    assert cli.main(["generate", "--model", demo_dir, "--prompt", "The capital of France is",
                     "--max-new-tokens", "5", "--no-stream"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "decode" in err
    # no --dtype: the first line says which dtype runs and why
    assert err.splitlines()[0] == "kimi-jax: dtype bfloat16 (automatic; --dtype float32 for full precision)", err
    # ids in, ids out (a batch of two, different lengths)
    assert cli.main(["generate", "--model", demo_dir, "--ids", "5,6,7", "--ids", "8,9", "--max-new-tokens", "3"]) == 0
    out, _ = capsys.readouterr()
    assert out.startswith("[0] ") and "\n[1] " in out


@pytest.mark.slow
def test_generate_says_what_it_compiles(demo_dir, capsys):
    """A cold request names each program as it compiles (n of m) and sums them up after the text; the text is held
    back until the decode program is compiled, so it no longer stops mid-sentence for it. (Shapes of this test
    alone -- a cache of 512 -- so the programs are compiled here, whatever ran before in this process.)"""
    argv = ["generate", "--model", demo_dir, "--ids", "5,6,7", "--max-new-tokens", "300", "--stop", "0"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    lines = err.splitlines()
    first = lines.index("kimi-jax: compiling prefill (program 1 of 2)...")
    assert lines[first + 1] == "kimi-jax: compiling decode loop (program 2 of 2)..."
    assert re.search(r"^kimi-jax: compiled 2 program\(s\) in [\d.]+s \(prefill [\d.]+s, decode loop [\d.]+s",
                     err, re.M), err
    assert len(out.split()) >= 30  # the text came (ids: the tiny model has no text of its own)
    assert cli.main(argv) == 0  # compiled: nothing to say
    assert "compiling" not in capsys.readouterr().err


def test_make_tiny_checkpoint_takes_text(tmp_path, capsys):
    """`kimi-jax make-tiny DIR` writes a tokenizer, so `generate --model DIR --prompt` takes text (issue 36; the same
    shapes as test_generate_command's, whose compiled programs it reuses)."""
    assert cli.main(["make-tiny", str(tmp_path / "k3")]) == 0
    assert "text prompts work" in capsys.readouterr().out
    assert cli.main(["generate", "--model", str(tmp_path / "k3"), "--prompt", "hi", "--max-new-tokens", "5",
                     "--no-stream"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "decode" in err


@pytest.mark.slow
def test_generate_command_memory_options(demo_dir, capsys):
    """--kv-cache int8 / --kda-state bfloat16 reach the generator: greedy output as the float cache gives (the tiny
    model's int8 decode error is 1e-2 in the logits, far from its top-2 margins on these few steps) or a clear
    refusal of an unknown choice. --offload: every kind in host memory gives the on-device output (bit for bit on
    the CPU); --quantize int8: the output of the Python API's int8 model; unknown names end in one line."""
    import kimi_jax

    argv = ["generate", "--model", demo_dir, "--ids", "5,6,7", "--max-new-tokens", "4", "--dtype", "float32"]
    assert cli.main(argv) == 0
    plain = capsys.readouterr().out
    assert cli.main(argv + ["--kv-cache", "int8", "--kda-state", "bfloat16"]) == 0
    quant = capsys.readouterr().out
    assert plain.strip() and quant == plain
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(argv + ["--kv-cache", "int4"])
    assert cli.main(argv + ["--offload", "experts,kda_state,cache"]) == 0
    assert capsys.readouterr().out == plain
    assert cli.main(argv + ["--quantize", "int8", "--no-stream"]) == 0
    got = capsys.readouterr().out
    model = kimi_jax.from_pretrained(demo_dir, dtype="float32", quantize="int8")
    assert got == kimi_jax.generate(model, [[5, 6, 7]], 4, tokenizer=load_tokenizer(demo_dir)).text[0] + "\n"
    assert cli.main(argv + ["--quantize", "int5"]) == 2
    assert "unknown weight format 'int5'" in capsys.readouterr().err
    assert cli.main(argv + ["--offload", "gpu"]) == 2
    assert "offload: unknown ['gpu']" in capsys.readouterr().err


def test_dtype_choice(capsys, monkeypatch):
    """An asked dtype runs as asked and is said so; auto picks bfloat16, on an accelerator and on the CPU."""
    import jax
    import jax.numpy as jnp

    from kimi_jax.checkpoint import loading as run

    assert common.resolve_dtype("float32") == "float32"
    assert capsys.readouterr().err == "kimi-jax: dtype float32 (--dtype)\n"
    assert run.auto_dtype()[0] == jnp.bfloat16 == run.resolve_dtype(None) == run.resolve_dtype("auto")
    assert run.resolve_dtype("float32") == jnp.float32

    class Device:  # what jax.devices() returns on a TPU host, as far as the choice looks
        platform = "tpu"

    assert run.auto_dtype([Device()]) == (jnp.bfloat16, "bfloat16 on tpu")
    monkeypatch.setattr(jax, "devices", lambda *a: [Device()])
    assert run.resolve_dtype(None) == jnp.bfloat16


def test_from_pretrained_default_dtype(demo_dir):
    import jax.numpy as jnp

    import kimi_jax

    model = kimi_jax.from_pretrained(demo_dir)  # no dtype: bfloat16
    assert model.run.dtype == jnp.bfloat16
    assert model.layers[0].self_attn.q_proj[...].dtype == jnp.bfloat16


@pytest.mark.parametrize("argv,msg", [
    (["generate", "--model", "/nonexistent/dir", "--ids", "1"], "no such model directory"),
    (["generate", "--ids", "1,x"], "comma-separated integers"),
    (["generate", "--ids", "1", "--top-p", "0"], "--top-p must be in"),
    (["generate", "--ids", "1", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["generate", "--ids", "5000"], "outside the vocabulary"),
])
def test_generate_command_errors(argv, msg, capsys, demo_dir):
    if "--model" not in argv:
        argv = argv[:1] + ["--model", demo_dir] + argv[1:]
    assert cli.main(argv) == 2
    assert msg in capsys.readouterr().err


def test_text_without_tokenizer_files(k3_tiny_a, capsys):
    assert cli.main(["generate", "--model", k3_tiny_a, "--prompt", "hello"]) == 2
    assert "tokenizer files" in capsys.readouterr().err


def test_chat_session(demo_dir, capsys, monkeypatch):
    from kimi_jax.text import chat

    results, real = [], generate_cli.generate
    monkeypatch.setattr(generate_cli, "generate", lambda *a, **kw: results.append(real(*a, **kw)) or results[-1])
    args = cli.build_parser().parse_args(["chat", "--model", demo_dir, "--max-new-tokens", "4", "--no-thinking",
                                          "--max-len", "256"])
    long = "word " * 300  # outgrows the 256-token cache: reported, the session goes on
    generate_cli.run_chat(args, stdin=io.StringIO(f"hello\n/reset\n\n{long}\nhi again\n/exit\nnever read\n"))
    out, err = capsys.readouterr()
    assert out.count("kimi> ") == 2  # two replies; the empty line, /reset and the refused message have none
    assert "the cache holds 256" in err and "/reset starts a new conversation" in err
    assert len(results) == 2  # the long message never reached generation
    # a reply is reported cut exactly when its 4 tokens hold no end of message
    end = load_tokenizer(demo_dir).specials[chat.END_OF_MSG]
    assert err.count("reply cut at 4 tokens") == sum(end not in r.tokens[0] for r in results)


def test_chat_speculative_replies_as_plain(capsys):
    """``kimi-jax chat --speculative dspark:demo``: the shipped model with its shipped drafter (float32, greedy, every
    drafted step verified) replies exactly as plain chat, turn after turn, and says each turn's acceptance."""
    lines = "What is the zipfile module?\nAnd the for statement?\n"
    base = ["chat", "--max-new-tokens", "24", "--dtype", "float32", "--max-len", "256"]
    outs = []
    for extra in ([], ["--speculative", "dspark:demo,adapt=acceptance"]):
        generate_cli.run_chat(cli.build_parser().parse_args(base + extra), stdin=io.StringIO(lines))
        outs.append(capsys.readouterr())
    (plain, _), (spec, err) = outs
    assert spec == plain and plain.count("kimi> ") == 2
    said = re.findall(r"speculative \(dspark:demo,adapt=acceptance\): (\d+) of (\d+) drafted tokens accepted", err)
    assert len(said) == 2 and all(0 < int(a) <= int(d) for a, d in said), err


def test_compile_cache_location(monkeypatch, tmp_path):
    monkeypatch.setenv("KIMI_JAX_COMPILE_CACHE", str(tmp_path / "c"))
    assert common.default_compile_cache() == str(tmp_path / "c")
    for off in ("off", "0", ""):
        monkeypatch.setenv("KIMI_JAX_COMPILE_CACHE", off)
        assert common.default_compile_cache() is None
    monkeypatch.delenv("KIMI_JAX_COMPILE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert common.default_compile_cache() == str(tmp_path / "xdg" / "kimi-jax" / "xla")


def test_compile_cache_flags(tmp_path, capsys):
    import jax

    before = jax.config.jax_compilation_cache_dir
    args = cli.build_parser().parse_args(["demo", "--no-compile-cache"])
    common.setup_compile_cache(args)  # nothing enabled, nothing created
    assert jax.config.jax_compilation_cache_dir == before
    # a directory the user named that cannot be made: a clear error before any work
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cli.main(["demo", "--compile-cache", str(blocker / "xla")]) == 2
    assert f"--compile-cache {blocker / 'xla'}" in capsys.readouterr().err
    assert jax.config.jax_compilation_cache_dir == before
    with pytest.raises(SystemExit):  # one or the other
        cli.build_parser().parse_args(["demo", "--no-compile-cache", "--compile-cache", str(tmp_path)])


_COUNT_HITS = """
import sys, jax
from jax import monitoring
hits = []
monitoring.register_event_listener(lambda event, **kw: hits.append(event) if event.endswith("cache_hits") else None)
from kimi_jax import cli
code = cli.main(sys.argv[1:])
print("CACHE_HITS", len(hits), file=sys.stderr)
sys.exit(code)
"""


@pytest.mark.slow
def test_compile_cache_reused_by_the_next_run(tmp_path):
    """Two fresh processes running the demo: the first fills the cache, the second loads its programs."""
    import subprocess
    import sys

    cache = tmp_path / "xla"
    env = {k: v for k, v in os.environ.items() if k != "KIMI_JAX_COMPILE_CACHE"}
    env["KIMI_JAX_COMPILE_CACHE"] = str(cache)  # the default location, as a user sets it
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    hits = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", _COUNT_HITS, "demo", "--max-new-tokens", "3"], cwd=root, env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        hits.append(int(r.stderr.rsplit("CACHE_HITS", 1)[1].split()[0]))
        assert cache.is_dir() and os.listdir(cache)  # entries written by the first run
    assert hits[0] == 0
    assert hits[1] >= 2  # at least the prefill and the decode program


@pytest.mark.parametrize("error, code, line", [
    ("kernel", 2, "kimi-jax info: error: moe_gmm: implementation='pallas' needs a TPU or GPU"),
    ("permission", 1, "kimi-jax info: error: '/out/x' Permission denied"),
    ("disk", 1, "kimi-jax info: error: '/out/x' No space left on device"),
])
def test_cli_errors_are_one_line(monkeypatch, capsys, error, code, line):
    """Errors a user can act on end in one stderr line and a non-zero exit, whatever their class."""
    import errno

    from kernels_pallas._dispatch import KernelUnavailable

    def fail(args):
        if error == "kernel":
            raise KernelUnavailable("moe_gmm: implementation='pallas' needs a TPU or GPU, but the target is 'cpu'")
        if error == "permission":
            raise PermissionError(errno.EACCES, "Permission denied", "/out/x")
        raise OSError(errno.ENOSPC, "No space left on device", "/out/x")

    monkeypatch.setattr(cli, "_cmd_info", fail)
    assert cli.main(["info", "k3"]) == code
    err = capsys.readouterr().err
    assert err.startswith(line) and err.count("\n") == 1 and "Traceback" not in err

