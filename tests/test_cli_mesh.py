"""``--mesh`` on the commands that run a model (kimi_jax/cli/common.py): ``kimi-jax generate`` on 8 simulated CPU
devices gives one device's tokens (and the K3 fixture's golden ones), ``--mesh auto`` takes the plan's layout for the
devices present, ``--scan-layers`` runs the same model scanned and ``--speculative`` gives the same tokens, and the process flags refuse what cannot work, naming it. The 8-device runs share one subprocess
(jax must see the devices from its first import)."""

import numpy as np
import pytest

from tests.sharding_run import script_on_cpu_devices

SCRIPT = """
import contextlib, io, sys
from kimi_jax.cli import common, main

def run(*extra):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["generate", "--model", {path!r}, "--ids", {a!r}, "--ids", {b!r}, "--max-new-tokens", "16",
                     "--dtype", "float32", "--no-compile-cache", *extra]) == 0
    return [[int(t) for t in line.split("] ", 1)[1].split()] for line in out.getvalue().splitlines()]

one = run()
mesh = run("--mesh", "data=1,expert=2,model=4")
scanned = run("--mesh", "data=1,expert=2,model=4", "--scan-layers")
spec = run("--mesh", "data=1,expert=2,model=4", "--speculative", "ngram:k=3")
auto = common.auto_mesh({path!r}, "tp_ep", batch=8, context=4096, dtype="float32")
print("ERRS", (one, mesh, scanned, spec, auto))
"""


# -m slow for CI time (the 30-minute budget): sharded generation is checked in-process on 8 devices
# (tests/test_sharding_devices.py) and serve on a mesh over two processes
@pytest.mark.slow
def test_generate_on_a_mesh_equals_one_device(k3_tiny_a, k3_golden, capfd):
    ids = [",".join(map(str, row)) for row in k3_golden["input_ids"].tolist()]
    one, mesh, scanned, spec, auto = script_on_cpu_devices(SCRIPT.format(path=k3_tiny_a, a=ids[0], b=ids[1]),
                                                           devices=8)
    assert one == k3_golden["greedy_tokens"].tolist()  # a reference implementation's greedy tokens
    assert mesh == one
    assert scanned == one  # --scan-layers: the repeating layers stacked, sharded and scanned
    assert spec == one  # speculative decoding on the mesh: the verify forward and the KDA commit sharded
    # the fixture fits every layout; the plan's least memory per device: experts and heads split furthest
    assert auto["data"] == 1 and auto["expert"] * auto["model"] == 8, auto


@pytest.mark.parametrize("argv,fragment", [
    (["--coordinator", "127.0.0.1:1234"], "without --num-processes, --process-id"),
    (["--coordinator", "auto", "--process-id", "0"], "--coordinator auto detects"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "2"], "--process-id 2 must be in"),
    (["--mesh", "data=2,expert=2"], "4 devices, but 1 process(es) hold 1"),
    (["--mesh", "data=1,fsdp=2"], "'fsdp=2'"),
])
def test_process_and_mesh_flags_are_refused_by_name(argv, fragment, capsys):
    from kimi_jax import cli

    assert cli.main(["generate", "--ids", "1,2", "--max-new-tokens", "1", "--no-compile-cache", *argv]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") <= 3, err


TRAIN = """
import json, os, tempfile
from kimi_jax.cli import main

root = tempfile.mkdtemp()
text = os.path.join(root, "t.txt")
open(text, "w").write("The quick brown fox jumps over the lazy dog. " * 40)

def losses(*extra):
    out = os.path.join(root, "out" + "_".join(extra).replace("=", "").replace(",", ""))
    assert main(["train", "--model", "tiny-k3", "--data", text, "--steps", "3", "--out", out, "--batch", "2",
                 "--seq", "16", "--dtype", "float32", "--eval-every", "100", "--save-every", "100", *extra]) == 0
    return [json.loads(line)["loss"] for line in open(os.path.join(out, "metrics.jsonl"))]

print("ERRS", (losses(), losses("--mesh", "data=2")))
"""


@pytest.mark.slow  # the library's sharded step is tested in tests/test_train_sharded.py; this is the CLI's wiring
def test_train_on_a_mesh_equals_one_device():
    one, mesh = script_on_cpu_devices(TRAIN, devices=2)
    assert len(one) == len(mesh) == 3
    np.testing.assert_allclose(mesh, one, rtol=2e-5)
