"""``kimi-jax serve`` on two processes x 4 CPU devices (one 8-device mesh through jax.distributed on loopback), driven
by the official ``openai`` client, with the exact command line of a multi-host deployment:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 kimi-jax serve --model DIR --mesh data=1,expert=2,model=4 \\
        --coordinator 127.0.0.1:PORT --num-processes 2 --process-id I --port P --dtype float32

* the K3 fixture (``--mesh data=1,expert=2,model=4``: the expert axis spans the processes, so each reads half the
  experts and the expert exchange crosses them), served with ``--speculative ngram:k=4`` (process 0's scheduler
  drafts, its verify steps travel in the plans): requests of mixed lengths in flight together give the fixture's
  golden greedy tokens (a reference implementation's) and the single-process plain engine's; a prefix hit, a stop
  string, constrained requests (one whose drafts a verify step's masks check) and a cancelled stream; replies whose
  n-gram drafts the model accepts (the engine's counters say drafts were made and accepted); no compilation after
  warm-up on either process; killing process 1 mid-stream ends the stream with an error and process 0 with status
  1 within 60 s, naming process 1;
* a tiny Kimi Linear (``--mesh data=2,expert=1,model=4``: the data axis spans the processes): the single-process
  engine's tokens, and SIGTERM to process 0 drains the stream in flight, then both processes exit 0.

One server pair per model serves every assertion about it (each pair compiles the engine's programs on 8 devices;
on this 2-core machine, shared: the K3 pair ~100-120 s to come up, the module ~4 min).
"""

import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest

import kimi_jax
from kimi_jax.serving.engine import Engine
from kimi_jax.text.grammar import Constraint, compile_grammar

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
# small static shapes, few programs to compile on 8 devices: one prefill bucket (64 tokens, fresh and continued),
# decode rows 1 and 4 over a table of one 64-token page
SHAPES = dict(slots=4, max_len=64, page_size=64, prefill_chunk=64)
FLAGS = ["--slots", "4", "--max-len", "64", "--page-size", "64", "--prefill-chunk", "64", "--log-level", "warning",
         "--no-compile-cache"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command() -> list[str]:
    """``kimi-jax``: the console script beside this Python (the installed entry point), else the same main()."""
    script = os.path.join(os.path.dirname(sys.executable), "kimi-jax")
    if os.path.exists(script):
        return [script]
    return [sys.executable, "-c", "import sys; from kimi_jax.cli import main; sys.exit(main())"]


class Pair:
    """Two ``kimi-jax serve`` processes of one job; stderr of each kept in a file."""

    def __init__(self, model_dir: str, mesh: str, *extra: str):
        self.port, coordinator = _free_port(), _free_port()
        self.dir = tempfile.mkdtemp(prefix="kimi_serve_pair_")
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "KIMI_JAX_COORDINATOR")}
        env.update(XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
                   PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
        self.logs = [os.path.join(self.dir, f"process{i}.log") for i in range(2)]
        self.procs = []
        for i in range(2):
            cmd = [*_command(), "serve", "--model", model_dir, "--mesh", mesh, "--coordinator",
                   f"127.0.0.1:{coordinator}", "--num-processes", "2", "--process-id", str(i), "--port",
                   str(self.port), "--dtype", "float32", *FLAGS, *extra]
            with open(self.logs[i], "w") as log:
                self.procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        self.url = f"http://127.0.0.1:{self.port}"
        self.started = time.monotonic()
        deadline = time.monotonic() + 900
        while "serving '" not in self.log(0):
            if any(p.poll() is not None for p in self.procs) or time.monotonic() > deadline:
                self.close()
                raise AssertionError(f"the pair did not come up:\n{self.log(0)[-3000:]}\n{self.log(1)[-3000:]}")
            time.sleep(0.2)
        self.up_seconds = time.monotonic() - self.started
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=300)

    def log(self, i: int) -> str:
        with open(self.logs[i]) as f:
            return f.read()

    def health(self) -> dict:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=30) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            return json.loads(e.read())

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _ids(pair: Pair, prompt, max_tokens: int, **kw):
    extra = {"return_token_ids": True, "ignore_eos": True, **kw.pop("extra_body", {})}
    return pair.client.completions.create(model=pair.name, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                          extra_body=extra, **kw)


def _reference(model_dir: str, prompts, max_tokens: int, tokenizer=None):
    """The single-process engine (one device) on the same shapes: what the pair must answer."""
    eng = Engine(kimi_jax.from_pretrained(model_dir, dtype="float32", progress=False), tokenizer, **SHAPES)
    return eng.generate(prompts, max_tokens=max_tokens, stop_ids=())


def _in_flight(pair: Pair, prompts, max_tokens: int):
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:  # all at once: the slots fill together
        return list(pool.map(lambda p: _ids(pair, p, max_tokens), prompts))


def _until(cond, what: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


# -- K3 -------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def k3_dir(k3_tiny_a, tmp_path_factory):
    """The K3 fixture beside a byte-level tokenizer in the K3 layout (256 byte ranks + 256 specials = its vocabulary
    of 512), so stop strings have text to match."""
    from kimi_jax.text.tokenizer import write_kimi_tokenizer

    out = tmp_path_factory.mktemp("k3_with_tokenizer")
    for f in os.listdir(k3_tiny_a):
        if f == "config.json" or f.endswith((".safetensors", ".index.json")) and f != "golden.safetensors":
            os.symlink(os.path.join(k3_tiny_a, f), out / f)
    tok = write_kimi_tokenizer(out, {bytes([b]): b for b in range(256)})
    assert tok.vocab_size == 512
    return str(out)


@pytest.fixture(scope="module")
def k3_pair(k3_dir):
    pair = Pair(k3_dir, "data=1,expert=2,model=4", "--peer-timeout", "5", "--speculative", "ngram:k=4,adapt=acceptance")
    pair.name = os.path.basename(k3_dir)
    yield pair
    pair.close()


def test_k3_on_two_processes(k3_pair, k3_dir, k3_golden):
    pair, golden = k3_pair, k3_golden
    prompts = golden["input_ids"].tolist()
    rng = np.random.default_rng(0)
    prompts += [rng.integers(3, 512, 40).tolist(), rng.integers(3, 512, 5).tolist()]
    hit = prompts[0] + [7, 8, 9]  # the first prompt is stored (its end): a hit inside a page, copied on write
    replies = _in_flight(pair, prompts, 16)
    followup = _ids(pair, hit, 16)
    from kimi_jax.text.tokenizer import load_tokenizer

    want = _reference(k3_dir, prompts + [hit], 16, load_tokenizer(k3_dir))
    got = [r.choices[0].token_ids for r in replies + [followup]]
    np.testing.assert_array_equal(np.array(got[:2]), golden["greedy_tokens"])  # a reference implementation's
    assert got == [w.tokens for w in want]  # the single-process engine's, every request
    assert followup.usage.prompt_tokens_details.cached_tokens == 24 and followup.choices[0].text == want[-1].text

    text = replies[1].choices[0].text  # a stop string from the reply's text: the text ends before it
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = _ids(pair, prompts[1], 16, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[: text.index(stop)]

    # constrained requests: their token masks travel in process 0's plans; the single-process engine's replies. The
    # alphabet's reply drafts (each letter it draws is followed by the next in the prompt): a verify step's masks,
    # one per position, checked on both processes
    regex = "[a-z]{3,10}"
    ref = Engine(kimi_jax.from_pretrained(k3_dir, dtype="float32", progress=False), load_tokenizer(k3_dir),
                 structured=True, **SHAPES)
    g = compile_grammar(ref.tokenizer, Constraint("regex", regex), chat_reply=False, thinking=False,
                        eos=ref.default_stop_ids(), vocab_size=ref.cfg.vocab_size)
    for prompt in (prompts[2], list(b"abcdefghijklmnopqrstuvwxyz")):
        before = pair.health()["spec_drafted"]
        got = pair.client.completions.create(model=pair.name, prompt=prompt, max_tokens=12, temperature=0,
                                             extra_body={"structured_outputs": {"regex": regex},
                                                         "return_token_ids": True})
        assert got.choices[0].token_ids == ref.generate([prompt], max_tokens=12, constraint=g)[0].tokens
        assert got.choices[0].finish_reason == "stop" and re.fullmatch(regex, got.choices[0].text), got
    assert pair.health()["spec_drafted"] > before  # the alphabet's

    stream = pair.client.completions.create(model=pair.name, prompt=prompts[3], max_tokens=40, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.response.close()  # the client walks away mid-stream: the slot is freed
    _until(lambda: pair.health()["slots_busy"] == 0, "the cancelled stream's slot was not freed")

    time.sleep(2.5)  # two heartbeats: process 1's compile count as of now
    h = pair.health()
    assert h["processes"] == 2 and h["compiles_after_warmup"] == 0, h
    assert h["peer_compiles_after_warmup"] == {"1": 0}, h
    assert h["prefix_hits"] >= 1


# Prompts whose greedy replies (24 tokens) repeat themselves where prompt lookup drafts: random weights rarely do, so
# these were found by a search over random prompts, replaying the drafter (ngram_draft_host) over each plain reply
SPECULATIVE_PROMPTS = [[358, 111, 162, 502],  # its reply: ... 287, 216, ... 287 -> the drafted 216 accepted
                       [131, 229, 217, 62, 468, 369, 101, 13, 305, 430, 54, 114, 319, 305, 410, 367, 141, 363, 466,
                        357, 502, 152, 153, 349, 268, 492, 128, 127, 142, 224]]


def _accepted_drafts(prompt, reply, drafter) -> int:
    """The drafts the scheduler's n-gram lookup makes over ``reply`` (greedy) that the reply keeps, verify step by
    verify step (the first token is the prefill's)."""
    from kimi_jax.generation import speculative

    kept, c = 0, 1
    while c < len(reply):
        d = speculative.ngram_draft_host(prompt + reply[:c], min(drafter.k, len(reply) - c - 1), drafter)
        a = next((i for i, t in enumerate(d) if t != reply[c + i]), len(d))
        kept, c = kept + a, c + a + 1
    return kept


def test_k3_speculative_on_two_processes(k3_pair, k3_dir):
    """``--speculative ngram:k=4`` on two processes: requests in flight together (replies that repeat themselves,
    two random prompts) get the single-process plain engine's greedy replies, with drafts made and accepted."""
    from kimi_jax.generation import speculative

    pair = k3_pair
    rng = np.random.default_rng(37)
    prompts = SPECULATIVE_PROMPTS + [rng.integers(3, 512, n).tolist() for n in (29, 9)]
    want = [w.tokens for w in _reference(k3_dir, prompts, 24)]
    drafter = speculative.parse("ngram:k=4")
    assert all(_accepted_drafts(p, w, drafter) >= 1 for p, w in zip(SPECULATIVE_PROMPTS, want))  # the prompts' point
    before = pair.health()
    got = [r.choices[0].token_ids for r in _in_flight(pair, prompts, 24)]
    after = pair.health()
    assert got == want
    spec = {k: after[k] - before[k] for k in ("spec_steps", "spec_drafted", "spec_accepted")}
    assert spec["spec_steps"] > 0 and spec["spec_drafted"] > spec["spec_accepted"] >= 2, spec
    assert after["compiles_after_warmup"] == 0, after


def test_k3_losing_process_1_mid_stream(k3_pair):
    """Process 1 killed while a stream runs: the client gets an error (not a hang) and process 0 exits with status
    1 within 60 s, naming process 1."""
    pair = k3_pair
    stream = iter(pair.client.completions.create(model=pair.name, prompt=[5, 6, 7], max_tokens=60, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    next(stream)
    pair.procs[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises((openai.APIError, openai.APIConnectionError)):
        for _ in stream:
            pass
    assert pair.procs[0].wait(60) == 1
    assert time.monotonic() - killed < 60
    assert "process 1 stopped answering" in pair.log(0), pair.log(0)[-3000:]


# -- Kimi Linear --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kimi_linear_dir(tmp_path_factory):
    from kimi_jax.checkpoint.synthetic import write_checkpoint

    return str(write_checkpoint(tmp_path_factory.mktemp("kimi_linear"), "kimi_linear", dtype="float32"))


def test_kimi_linear_data_parallel_over_two_processes_and_sigterm(kimi_linear_dir):
    """data=2 across the processes: the single-process engine's tokens; SIGTERM to process 0 mid-stream drains it,
    then both processes exit 0."""
    pair = Pair(kimi_linear_dir, "data=2,expert=1,model=4")
    pair.name = os.path.basename(kimi_linear_dir)
    try:
        rng = np.random.default_rng(1)
        prompts = [rng.integers(3, 128, n).tolist() for n in (7, 33, 20, 3)]
        got = [r.choices[0].token_ids for r in _in_flight(pair, prompts, 12)]
        assert got == [w.tokens for w in _reference(kimi_linear_dir, prompts, 12)]
        stream = iter(pair.client.completions.create(
            model=pair.name, prompt=prompts[0], max_tokens=40, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True}))
        chunks = [next(stream)]
        pair.procs[0].send_signal(signal.SIGTERM)
        chunks += list(stream)
        assert sum(len(c.choices[0].token_ids) for c in chunks) == 40 and chunks[-1].choices[0].finish_reason == "length"
        assert [p.wait(60) for p in pair.procs] == [0, 0], (pair.log(0)[-2000:], pair.log(1)[-2000:])
        assert "stopped" in pair.log(1)
    finally:
        pair.close()
