"""The recall study (kimi_jax/analysis/recall.py): all-KDA, K3's hybrid, all-MLA and dense GQA models of one size,
trained here with one token budget on multi-query associative recall and needle retrieval, scored at growing
context lengths beside the cache bytes each keeps per sequence.

    python benchmarks/recall.py                      # the README's table; writes benchmarks/results/recall.json
    python benchmarks/recall.py --steps 60 --models hybrid gqa --out /tmp/r.json   # a quick look

Two processes use two cores better than one (most steps are small, single-threaded ops): run halves of the models
with ``--out`` each, then ``--merge`` their files into the table (what the README's numbers come from). Runs of the
same setting with other ``--seed`` merge too: their accuracies share a line, one per seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kimi_jax.analysis import recall  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "recall.json")


def main(argv=None) -> int:
    d = recall.Study()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(recall.MODELS), choices=recall.MODELS)
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--hidden", type=int, default=d.hidden)
    ap.add_argument("--batch", type=int, default=d.batch)
    ap.add_argument("--train-lengths", type=int, nargs="+", default=list(d.train_lengths))
    ap.add_argument("--eval-lengths", type=int, nargs="+", default=list(d.eval_lengths))
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="combine the rows of earlier runs' files into --out")
    args = ap.parse_args(argv)
    if args.merge:
        return _merge(args.merge, args.out)
    study = dataclasses.replace(d, steps=args.steps, hidden=args.hidden, batch=args.batch, seed=args.seed,
                                train_lengths=tuple(args.train_lengths), eval_lengths=tuple(args.eval_lengths))
    rows = recall.run(study, args.models, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(recall.table(rows))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"study": dataclasses.asdict(study), "python": platform.python_version(),
                   "command": "python benchmarks/recall.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                   "rows": rows}, f, indent=1)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _merge(paths, out) -> int:
    runs = [json.load(open(p)) for p in paths]
    setting = lambda r: {k: v for k, v in r["study"].items() if k != "seed"}  # noqa: E731
    if any(setting(r) != setting(runs[0]) for r in runs):
        raise SystemExit(f"--merge: the runs used different settings: {[r['study'] for r in runs]}")
    for r in runs:
        for row in r["rows"]:
            row.setdefault("seed", r["study"]["seed"])
    rows = sorted((row for r in runs for row in r["rows"]),
                  key=lambda row: (recall.MODELS.index(row["model"]), row["seed"], row["length"]))
    print(recall.table(rows))
    with open(out, "w") as f:
        json.dump({**runs[0], "study": {**runs[0]["study"], "seed": sorted({row["seed"] for row in rows})},
                   "command": [c for r in runs for c in (r["command"] if isinstance(r["command"], list)
                                                         else [r["command"]])], "rows": rows}, f, indent=1)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
