"""What it costs to get one engine step's plan from process 0 to the others: the distributed runtime's key-value store
(what :mod:`kimi_jax.serving.multihost` uses) against a collective broadcast of a fixed-size int32 buffer
(``jax.experimental.multihost_utils.broadcast_one_to_all``, a jitted psum over every device).

    python benchmarks/plan_channel.py [--processes 2] [--devices 4] [--steps 500]

Starts the processes itself (loopback, ``--devices`` simulated CPU devices each). The plan is a decode step over 8
slots with 2 new pages (what a busy engine sends each step). Per step, in microseconds, on every process: the
store (process 0 writes plan n, each other process waits for it: ``PlanChannel.send`` / ``receive``), the store in
lockstep (a reply from every process before the next plan: the upper bound when a step waits on them), and the
broadcast. Medians of 3 rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _plan(step: int):
    from kimi_jax.serving.stepplan import Decode, SetPages, StepPlan

    rows = list(range(8))
    return StepPlan(step, (SetPages(3, 5, (41,)), SetPages(6, 2, (42,)),
                           Decode.make(16, rows, [100 + r for r in rows], [20] * 8, [True] * 8, all_rows=True)))


def worker(pid: int, n: int, port: int, steps: int) -> dict:
    import jax
    import numpy as np

    jax.distributed.initialize(f"127.0.0.1:{port}", n, pid)
    from jax.experimental import multihost_utils

    from kimi_jax.serving.multihost import PlanChannel, _client
    from kimi_jax.serving.stepplan import StepPlan

    client, channel = _client(), PlanChannel()
    size = len(_plan(0).to_words())
    cap = 1024  # the fixed buffer a broadcast design sends every step (room for a long prefill chunk's ids)
    out = {"plan_words": size, "buffer_words": cap}
    step = 0
    rounds = {"store": [], "store_lockstep": [], "broadcast": []}
    for r in range(3):
        client.wait_at_barrier(f"bench/{r}/a", 60_000)
        t = time.perf_counter()
        for _ in range(steps):
            if pid == 0:
                channel.send(_plan(step))
            else:
                assert channel.receive(step).step == step
            step += 1
        client.wait_at_barrier(f"bench/{r}/b", 60_000)
        rounds["store"].append((time.perf_counter() - t) / steps)

        t = time.perf_counter()
        for _ in range(steps):
            if pid == 0:
                channel.send(_plan(step))
                for p in range(1, n):
                    client.blocking_key_value_get(f"bench/ack/{p}/{step}", 60_000)
            else:
                channel.receive(step)
                client.key_value_set(f"bench/ack/{pid}/{step}", "1")
            step += 1
        rounds["store_lockstep"].append((time.perf_counter() - t) / steps)

        buf = np.zeros((cap,), np.int32)
        words = _plan(step).to_words()
        buf[: len(words)] = words
        multihost_utils.broadcast_one_to_all(buf)  # compiled once, outside the timing
        t = time.perf_counter()
        for _ in range(steps):
            got = multihost_utils.broadcast_one_to_all(buf if pid == 0 else np.zeros_like(buf))
            StepPlan.from_words(got)
        rounds["broadcast"].append((time.perf_counter() - t) / steps)
    for k, v in rounds.items():
        out[f"{k}_us"] = round(statistics.median(v) * 1e6, 1)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        print("RESULT " + json.dumps(worker(args.worker, args.processes, args.port, args.steps)), flush=True)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices}", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.path.dirname(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, __file__, "--processes", str(args.processes), "--devices",
                               str(args.devices), "--steps", str(args.steps), "--worker", str(i), "--port", str(port)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for i in range(args.processes)]
    results = []
    for i, p in enumerate(procs):
        stdout, _ = p.communicate(timeout=900)
        line = next((x for x in stdout.splitlines() if x.startswith("RESULT ")), None)
        if p.returncode or line is None:
            print(f"process {i} failed (exit {p.returncode})", file=sys.stderr)
            return 1
        results.append(json.loads(line[len("RESULT "):]))
    print(f"{args.processes} processes x {args.devices} CPU devices, {args.steps} steps per round, medians of 3 rounds")
    print(f"plan: {results[0]['plan_words']} int32 words; broadcast buffer: {results[0]['buffer_words']} words")
    print("| process | key-value store, us/step | store in lockstep (with replies) | broadcast_one_to_all |")
    print("|---|---|---|---|")
    for i, r in enumerate(results):
        print(f"| {i} | {r['store_us']} | {r['store_lockstep_us']} | {r['broadcast_us']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
