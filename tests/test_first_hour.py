"""What a new user meets first (issue 36): the licence, the version, ``demo`` as a model name everywhere, tiny
checkpoints that take text, and commands whose first lines are their own (no plugin tracebacks on a CPU-only
machine)."""

import hashlib
import os
import pathlib
import subprocess
import sys
import tomllib

import numpy as np
import pytest

import kimi_jax
from kimi_jax import cli
from kimi_jax.checkpoint import synthetic
from kimi_jax.model import config as C
from kimi_jax.text.tokenizer import load_tokenizer

ROOT = pathlib.Path(__file__).resolve().parents[1]
# md5 of https://www.apache.org/licenses/LICENSE-2.0.txt, the text every Apache-2.0 project ships
APACHE_2_MD5 = "3b83ef96387f14655fc854ddc3c6bd57"


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_license_is_the_apache_2_text():
    assert _pyproject()["license"] == "Apache-2.0"
    assert hashlib.md5((ROOT / "LICENSE").read_bytes()).hexdigest() == APACHE_2_MD5


def test_version_is_pyprojects(capsys):
    want = _pyproject()["version"]
    assert kimi_jax.__version__ == want
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"kimi-jax {want}"


def test_demo_is_a_model_name(tmp_path, monkeypatch, capsys):
    """``from_pretrained("demo")``, ``tokenizer="demo"`` and ``kimi-jax info demo`` read the shipped demo model; a
    directory named ``demo`` where the user stands wins over the name."""
    a = kimi_jax.from_pretrained("demo", dtype="float32", progress=False)
    b = kimi_jax.from_pretrained(C.demo_model_dir(), dtype="float32", progress=False)
    np.testing.assert_array_equal(np.asarray(a.embed_tokens[...]), np.asarray(b.embed_tokens[...]))
    gen = kimi_jax.Generator(a, "demo")
    assert gen.tokenizer.encode("The for statement") == load_tokenizer(C.demo_model_dir()).encode("The for statement")
    assert cli.main(["info", "demo"]) == 0
    assert capsys.readouterr().out.startswith(f"family kimi_k3: {a.cfg.num_layers} layers")
    synthetic.write_checkpoint(tmp_path / "demo", "llama", num_shards=1)
    monkeypatch.chdir(tmp_path)
    assert C.load("demo").family == "dense"
    assert kimi_jax.from_pretrained("demo", progress=False).cfg.family == "dense"


def test_make_tiny_writes_a_tokenizer_or_says_why_not(tmp_path, capsys):
    """``make-tiny`` (K3) writes a Kimi-format tokenizer whose specials are the config's ids (``generate --prompt`` on
    it: tests/test_generate_cli.py, beside the programs it shares); a tiny Kimi Linear (vocabulary of 128) and a tiny
    Llama get none, say so, and ``generate --prompt`` refuses their text naming the fix."""
    k3 = str(tmp_path / "k3")
    assert cli.main(["make-tiny", k3]) == 0
    assert "with a tokenizer (tiktoken.model): text prompts work" in capsys.readouterr().out
    tok, cfg = load_tokenizer(k3), C.load(k3)
    assert tok.vocab_size == cfg.vocab_size and cfg.eos_token_id == tok.specials["<|end_of_msg|>"]
    for family, why in (("kimi_linear", "vocab_size 128 cannot hold a Kimi tokenizer"),
                        ("llama", "tokenizers are written in the Kimi tiktoken format only")):
        path = str(tmp_path / family)
        assert cli.main(["make-tiny", path, "--family", family]) == 0
        out = capsys.readouterr().out
        assert "without a tokenizer: " + why in out and "prompts must be token ids" in out
        assert not os.path.exists(os.path.join(path, "tiktoken.model"))
        assert cli.main(["generate", "--model", path, "--prompt", "hi", "--max-new-tokens", "2"]) == 2
        assert "pass --ids" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no tokenizer for this llama checkpoint"):
        synthetic.write_checkpoint(tmp_path / "refused", "llama", tokenizer=True)
    assert not os.path.exists(tmp_path / "refused")  # refused before anything is written


# A command run as the `kimi-jax` script runs it, then JAX's device list (what every model-loading command reaches).
_RUN = "import sys, jax; from kimi_jax.cli import main; rc = main(sys.argv[1:]); print(jax.devices()); sys.exit(rc)"
_PLUGIN_NOISE = ("Traceback", "Jax plugin configuration error", "libtpu", "TPU_WORKER_HOSTNAMES")


def test_no_plugin_traceback_without_an_accelerator():
    """With the CUDA plugin and libtpu installed (the aot / test extras) on a machine without a GPU or TPU, JAX's
    automatic platform choice prints the CUDA plugin's traceback and a libtpu trace; a kimi-jax command names the
    CPU first, so its stderr holds only its own words. The control (plain ``jax.devices()``) shows this machine
    reproduces the noise, so the check can fail."""
    if cli.accelerator_present():
        pytest.skip("this machine shows a GPU or TPU: JAX's own choice is kept there")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # as a user's shell: no platform named
    run = lambda *a: subprocess.run([sys.executable, "-c", *a], cwd=ROOT, env=env, capture_output=True,  # noqa: E731
                                    text=True, timeout=300)
    control = run("import jax; jax.devices()")
    if not any(n in control.stderr for n in _PLUGIN_NOISE):
        pytest.skip("neither the CUDA plugin nor libtpu complains here (the aot extra is not installed)")
    r = run(_RUN, "info", "demo")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("family kimi_k3") and "CpuDevice" in r.stdout
    assert not any(n in r.stderr for n in _PLUGIN_NOISE), r.stderr
