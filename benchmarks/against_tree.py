"""Ours against an earlier tree of ours: ``benchmarks/decode.py`` run alternately from this checkout and from a git
revision, in separate processes on the same machine, paired round by round.

    python benchmarks/against_tree.py --base a1bbf00 [--rounds 5] [--dtype float32] [--batches 1,8]

Each round runs the current tree, then the base (the order alternates between rounds, so drift on a shared machine
falls on both sides equally); each run is a fresh process that loads the benchmark model, compiles, and times one
repeat of ``decode.py --skip-hf`` (decode tok/s at each batch, prefill tok/s). The ratio of a round is current /
base; the result is the median of the rounds' ratios, with their spread. The base is checked out with ``git
worktree`` into a temporary folder and removed after. Both trees read the benchmark model from the same
``--weights`` folder and the same config (this tree's ``benchmarks/configs/``).

Writes ``benchmarks/results/decode_vs_<base>_<dtype>.json`` with the commits, the machine and every round.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ROW = re.compile(r"^\| (decode b=(\d+)|prefill \d+ b=(\d+)) .*?\| ([0-9.]+) \|")


def _git(*args, cwd=ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def run_decode(tree: str, args) -> dict[str, float]:
    """One ``decode.py`` process from ``tree``: {"decode b=1": tok/s, ..., "prefill b=1": tok/s}."""
    cmd = [sys.executable, os.path.join(tree, "benchmarks", "decode.py"), "--skip-hf", "--repeats", "1",
           "--dtype", args.dtype, "--batches", args.batches, "--weights", args.weights,
           "--config", os.path.join(HERE, "configs", "kimi-linear-bench.config.json")]
    env = {**os.environ, "PYTHONPATH": tree, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{tree}: decode.py failed ({out.returncode}):\n{out.stderr[-3000:]}")
    got = {}
    for line in out.stdout.splitlines():
        m = ROW.match(line)
        if m:
            got[("decode" if m.group(2) else "prefill") + f" b={m.group(2) or m.group(3)}"] = float(m.group(4))
    if not got:
        raise SystemExit(f"{tree}: no result rows in decode.py's output:\n{out.stdout[-3000:]}")
    return got


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the git revision to compare against")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--weights", default=os.path.join(os.path.expanduser("~"), ".cache", "kimi-jax",
                                                      "kimi-linear-bench"))
    ap.add_argument("--out", default=None, help="result file (default benchmarks/results/decode_vs_<base>_<dtype>.json)")
    args = ap.parse_args(argv)

    base = _git("rev-parse", "--short", args.base)
    head = _git("rev-parse", "--short", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        old = os.path.join(tmp, base)
        _git("worktree", "add", "--detach", old, base)
        try:
            for r in range(args.rounds):
                order = [("current", ROOT), ("base", old)]
                order = order if r % 2 == 0 else order[::-1]
                got = {name: run_decode(tree, args) for name, tree in order}
                rounds.append(got)
                print(f"round {r}: " + "; ".join(f"{k} {got['current'][k]:.1f} vs {got['base'][k]:.1f} tok/s "
                                                  f"({got['current'][k] / got['base'][k]:.2f}x)"
                                                  for k in got["current"]), flush=True)
        finally:
            _git("worktree", "remove", "--force", old)
    ratios = {k: sorted(g["current"][k] / g["base"][k] for g in rounds) for k in rounds[0]["current"]}
    summary = {k: {"median": statistics.median(v), "min": v[0], "max": v[-1],
                   "current_tok_s": statistics.median(g["current"][k] for g in rounds),
                   "base_tok_s": statistics.median(g["base"][k] for g in rounds)} for k, v in ratios.items()}
    print(f"\ncurrent {head}{' (with uncommitted changes)' if dirty else ''} / base {base}, {args.dtype}, "
          f"median of {args.rounds} paired rounds:")
    for k, s in summary.items():
        print(f"  {k:<12} {s['current_tok_s']:8.1f} vs {s['base_tok_s']:8.1f} tok/s   ratio {s['median']:.3f} "
              f"(rounds {s['min']:.3f} .. {s['max']:.3f})")
    out = args.out or os.path.join(HERE, "results", f"decode_vs_{base}_{args.dtype}.json")
    load = os.getloadavg()
    with open(out, "w") as f:
        json.dump({"benchmark": "benchmarks/against_tree.py", "command": " ".join(["python", *sys.argv]),
                   "current": head, "current_dirty": dirty, "base": base, "dtype": args.dtype,
                   "machine": {"cores": os.cpu_count(), "platform": platform.platform(),
                               "load_average_end": load},
                   "summary": summary, "rounds": rounds}, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
