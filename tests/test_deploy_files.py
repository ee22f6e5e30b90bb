"""The launch files under deploy/ say what works: each `kimi-jax serve` they run parses with the real CLI, its mesh
uses exactly the target's devices, and the plan of the serving engine it asks for fits the chip (the compilers'
verdict for the same shapes is in deploy/README.md, ``kimi-jax plan --serve --compile``); the scripts are valid
shell, the Kubernetes manifest valid YAML whose leader and worker run the same command."""

import math
import pathlib
import re
import shlex
import subprocess

import pytest
import yaml

from kimi_jax.cli import build_parser
from kimi_jax.deploy import plan
from kimi_jax.model import config
from kimi_jax.parallel import sharding
from kimi_jax.serving import validate

DEPLOY = pathlib.Path(__file__).resolve().parents[1] / "deploy"
# file -> (devices the target has, HBM per device): v5p 4x4x4 (64 chips), tpu7x 4x4x2 (32 chips, 64 devices),
# 2 x 8 H200
TARGETS = {"tpu-v5p.sh": (64, 95e9), "tpu7x.sh": (64, 96e9), "slurm-h200x16.sbatch": (16, 141e9),
           "k8s-lws-h200x16.yaml": (16, 141e9)}
# scanned where the compiler's peak for the scanned serving programs is within 10% of the plan (deploy/README.md):
# v5p and H200; TPU7x re-tiles every stacked weight per step when scanned, so it runs unrolled
SCANNED = {"tpu-v5p.sh": True, "tpu7x.sh": True, "slurm-h200x16.sbatch": True, "k8s-lws-h200x16.yaml": True}
ENV = {"MODEL": "/models/k3", "SLOTS": None, "MAX_LEN": None, "PORT": None, "LWS_LEADER_ADDRESS": "leader",
       "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "0"}


def _defaults(text: str) -> dict:
    """The scripts' ``NAME=${NAME:-value}`` defaults."""
    return dict(re.findall(r"^(\w+)=\$\{\w+:-([^}]*)\}", text, re.M))


def _serve_commands(path: pathlib.Path) -> list[list[str]]:
    text = path.read_text()
    env = {**_defaults(text), **{k: v for k, v in ENV.items() if v is not None}}
    if path.suffix == ".yaml":
        docs = list(yaml.safe_load_all(text))
        tmpl = docs[0]["spec"]["leaderWorkerTemplate"]
        commands = [c["args"][0] for t in ("leaderTemplate", "workerTemplate") for c in tmpl[t]["spec"]["containers"]]
    else:
        lines = [ln for ln in text.replace("\\\n", " ").splitlines() if not ln.lstrip().startswith("#")]
        commands = [ln[ln.index("kimi-jax serve"):] for ln in lines if "kimi-jax serve" in ln]
    out = []
    for c in commands:
        c = re.sub(r"\$\{?(\w+)\}?", lambda m: env[m.group(1)], c)
        words = shlex.split(c)
        assert words[:2] == ["kimi-jax", "serve"], c
        out.append(words[1:])
    return out


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_launch_command_parses_and_fits(name):
    devices, hbm = TARGETS[name]
    commands = _serve_commands(DEPLOY / name)
    assert commands and all(c == commands[0] for c in commands), commands  # LWS: leader and worker alike
    args = build_parser().parse_args(commands[0])
    sizes = sharding.parse_mesh(args.mesh)
    assert math.prod(sizes.values()) == devices, (name, sizes)
    assert args.scan_layers == SCANNED[name], name
    shapes = validate.shapes(slots=args.slots, max_len=args.max_len, page_size=args.page_size, pages=args.pages,
                             prefill_chunk=args.prefill_chunk, min_chunk=64, snapshot_every=args.snapshot_every,
                             compact_decode=True)
    p = plan.make_plan(config.preset("k3"), sizes, args.layout, batch=1, context=1, serve=shapes)
    peak = max(p.total, p.param_total + p.cache_total + sum(p.prefill_activations.values()))
    assert peak <= 0.9 * hbm, (name, peak / 1e9)


@pytest.mark.parametrize("name", ["tpu-v5p.sh", "tpu7x.sh", "slurm-h200x16.sbatch"])
def test_scripts_are_valid_shell(name):
    subprocess.run(["bash", "-n", str(DEPLOY / name)], check=True)


def test_kubernetes_leader_serves_and_is_selected():
    docs = list(yaml.safe_load_all((DEPLOY / "k8s-lws-h200x16.yaml").read_text()))
    lws, service = docs
    leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    assert leader["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/health"
    assert service["spec"]["selector"]["role"] == leader["metadata"]["labels"]["role"]
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
