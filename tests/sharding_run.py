"""Runs tests/sharding_worker.py in subprocesses (jax must see 8 devices from its first import), once per session."""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def _env():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the worker sets its own device count
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _fail(what, proc):
    raise AssertionError(f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")


def script_on_cpu_devices(script: str, devices: int = 4):
    """Runs ``script`` (Python source) in a subprocess that sees ``devices`` simulated CPU devices and returns the
    Python literal it prints after the marker ``ERRS``."""
    import ast

    env = dict(_env(), XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0 or "ERRS" not in proc.stdout:
        _fail("script on CPU devices", proc)
    return ast.literal_eval(proc.stdout.split("ERRS", 1)[1].strip())


@functools.lru_cache(maxsize=None)
def single_process(cases: str = "all") -> dict:
    """The worker's cases ("all": the default set; "slow": the extra ones) on 8 simulated devices in one process."""
    work = tempfile.mkdtemp(prefix="kimi_sharding_")
    out = os.path.join(work, "result.json")
    proc = subprocess.run([sys.executable, "-m", "tests.sharding_worker", out, work, "--cases", cases], cwd=ROOT,
                          env=_env(),
                          capture_output=True, text=True, timeout=1500)
    if proc.returncode:
        _fail("8-device worker", proc)
    sys.stderr.write(proc.stderr[-3000:])
    with open(out) as f:
        return json.load(f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def multi_process(cases: str, processes: int = 2) -> list[dict]:
    """``processes`` local processes sharing the 8 devices through jax.distributed; one result per process."""
    work = tempfile.mkdtemp(prefix="kimi_multihost_")
    out = os.path.join(work, "result.json")
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.sharding_worker", out, work, "--processes", str(processes),
                               "--process-id", str(i), "--port", str(port), "--cases", cases], cwd=ROOT, env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(processes)]
    results = []
    try:
        for i, p in enumerate(procs):
            stdout, stderr = p.communicate(timeout=900)
            p.stdout, p.stderr = stdout, stderr
            if p.returncode:
                _fail(f"process {i} of {processes}", p)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i in range(processes):
        with open(f"{out}.{i}") as f:
            results.append(json.load(f))
    return results


def plan_vs_compiler(*args: str) -> dict:
    """benchmarks/plan_vs_compiler.py with ``args``; returns its --json numbers."""
    work = tempfile.mkdtemp(prefix="kimi_plan_")
    out = os.path.join(work, "result.json")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "plan_vs_compiler.py"), *args,
                           "--json", out], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    if proc.returncode:
        _fail("plan_vs_compiler.py", proc)
    sys.stderr.write(proc.stdout[-1500:])
    with open(out) as f:
        return json.load(f)
