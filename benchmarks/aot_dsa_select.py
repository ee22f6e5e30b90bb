"""K3.1's DSA selection (``kernels_pallas/dsa``) compiled deviceless by the real TPU and GPU compilers at full K3.1
indexer shapes (32 heads x 128, top-2048), the reference (all scores at once) beside the streaming form (keys in
blocks, a running top-k) and the op's automatic choice on one chip (the streaming form with the Pallas scores
kernel), with the compilers' memory and cost analysis per device: a prefill chunk of 2,048 queries
and a decode step of 8 sequences, each over a 128K-token bf16 indexer-key cache.

    python benchmarks/aot_dsa_select.py                      # v5p, v6e, H200
    python benchmarks/aot_dsa_select.py --targets tpu:v5p:1x1x1 --context 262144

Writes ``benchmarks/results/aot_dsa_select.json`` (``--json`` elsewhere) with the commit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.aot_sparse_mla import compile_one, write_results  # noqa: E402
from kernels_pallas import dsa  # noqa: E402
from kernels_pallas.dsa import reference, streaming  # noqa: E402
from kimi_jax.deploy import aot  # noqa: E402

S_ = jax.ShapeDtypeStruct


def operands(batch, queries, heads, head_dim, context):
    """Indexer queries (bf16), per-head weights (float32), the bf16 key cache, the query positions."""
    return (S_((batch, queries, heads, head_dim), jnp.bfloat16), S_((batch, queries, heads), jnp.float32),
            S_((batch, context, head_dim), jnp.bfloat16), S_((batch, queries), jnp.int32))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", nargs="+", default=["tpu:v5p:1x1x1", "tpu:v6e:1x1", "gpu:h200:1x1x1"])
    p.add_argument("--heads", type=int, default=32)  # index_n_heads
    p.add_argument("--head-dim", type=int, default=128)  # index_head_dim
    p.add_argument("--topk", type=int, default=2048)  # index_topk
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--json", default=os.path.join(HERE, "results", "aot_dsa_select.json"))
    a = p.parse_args(argv)
    aot.cpu_runtime()
    cases = {"prefill_chunk": (1, 2048), "decode": (8, 1)}
    forms = {"reference": reference.select, "streaming": streaming.select, "automatic (pallas)": dsa.select}
    rows = []
    for target in a.targets:
        for case, (batch, queries) in cases.items():
            args = operands(batch, queries, a.heads, a.head_dim, a.context)
            for name, fn in forms.items():
                try:
                    r = compile_one(target, lambda *x, fn=fn: fn(*x, topk=a.topk), args)
                except Exception as e:  # noqa: BLE001  (the compiler's refusal is a result too)
                    r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:400]}"}
                rows.append({"target": target, "case": case, "batch": batch, "queries": queries, "form": name, **r})
                print(json.dumps(rows[-1]), flush=True)
    write_results(a.json, {"heads": a.heads, "head_dim": a.head_dim, "topk": a.topk, "context": a.context,
                           "key_block": streaming.KEY_BLOCK}, rows)


if __name__ == "__main__":
    main()
