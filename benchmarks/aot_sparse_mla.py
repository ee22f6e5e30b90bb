"""The sparse MLA kernel (``kernels_pallas/sparse_mla``, Kimi K3.1's DSA attention) compiled deviceless by the real
TPU and GPU compilers at full K3.1 decode shapes (static and paged cache), beside the dense MLA kernel over the same
cache, with what the
compilers say: memory analysis (arguments, output, temporaries, code) and cost analysis (flops, bytes accessed;
for a Pallas kernel XLA reports only its own ops around the custom call, not the kernel) per device.

    python benchmarks/aot_sparse_mla.py                       # v5p, v6e, H200: batch 8, 32K cache, top-2048
    python benchmarks/aot_sparse_mla.py --targets tpu:v6e:1x1 --batch 8 --context 131072

Writes ``benchmarks/results/aot_sparse_mla.json`` (``--json`` elsewhere) with the commit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import time

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import kernels_pallas.mla_decode as dense
import kernels_pallas.sparse_mla as sparse
from kimi_jax.deploy import aot

HERE = os.path.dirname(os.path.abspath(__file__))
S_ = jax.ShapeDtypeStruct
BF, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
SCALE = 192 ** -0.5  # K3's MLA scale (nope 128 + "rope" 64)


PAGE = 64


def operands(batch, heads, latent, rope, context, topk):
    """K3 absorbed MLA decode operands (one query token): the float32 absorbed query, the bf16 cache (static, or a
    pool of 64-token pages with a page table), and either the chosen positions (sparse) or the query positions
    (dense)."""
    q = (S_((batch, 1, heads, latent), F32), S_((batch, 1, heads, rope), BF))
    cache = (S_((batch, context, latent), BF), S_((batch, context, rope), BF))
    n = batch * context // PAGE + 8
    pool = (S_((n, PAGE, latent), BF), S_((n, PAGE, rope), BF), S_((batch, context // PAGE), I32))
    chosen = S_((batch, 1, topk), I32)
    return {"sparse": (*q, *cache, chosen), "sparse_paged": (*q, *pool, chosen),
            "dense": (*q, *cache, S_((batch, 1), I32))}


def compile_one(target_text, fn, args) -> dict:
    """Compile ``fn`` on one device of the target; the compiler's figures."""
    target = aot.parse_target(target_text)
    mesh = Mesh(aot.device_array(target, (1,)), ("x",))
    args = [S_(a.shape, a.dtype, sharding=NamedSharding(mesh, PartitionSpec())) for a in args]
    t0 = time.perf_counter()
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), jax.set_mesh(mesh):
        compiled = jax.jit(fn).lower(*args).compile()
    seconds = time.perf_counter() - t0
    m = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    return {"compile_s": round(seconds, 1), "pallas_kernel": target.marker in compiled.as_text(),
            "argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
            "temp_bytes": m.temp_size_in_bytes, "code_bytes": m.generated_code_size_in_bytes,
            "xla_flops": cost.get("flops"), "xla_bytes_accessed": cost.get("bytes accessed")}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", nargs="+", default=["tpu:v5p:1x1x1", "tpu:v6e:1x1", "gpu:h200:1x1x1"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=96)  # K3 num_attention_heads
    p.add_argument("--latent", type=int, default=512)  # kv_lora_rank
    p.add_argument("--rope", type=int, default=64)  # qk_rope_head_dim (NoPE in K3, still cached)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--json", default=os.path.join(HERE, "results", "aot_sparse_mla.json"))
    a = p.parse_args(argv)
    aot.cpu_runtime()
    ops = {"sparse": lambda *x: sparse.sparse_mla_attention(*x, scale=SCALE),
           "sparse_paged": lambda *x: sparse.paged_sparse_mla_attention(*x, scale=SCALE),
           "dense": lambda *x: dense.mla_attention(*x, scale=SCALE)}
    args = operands(a.batch, a.heads, a.latent, a.rope, a.context, a.topk)
    rows = []
    for target in a.targets:
        for name, fn in ops.items():
            try:
                r = compile_one(target, fn, args[name])
            except Exception as e:  # noqa: BLE001  (the compiler's refusal is a result too)
                r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:400]}"}
            rows.append({"target": target, "op": name, **r})
            print(json.dumps(rows[-1]), flush=True)
    write_results(a.json, {k: getattr(a, k) for k in ("batch", "heads", "latent", "rope", "context", "topk")}, rows)


def write_results(path: str, shapes: dict, rows: list) -> None:
    """The compilers' figures ``rows`` at ``shapes`` as JSON at ``path``, with the date, commit and JAX version."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                            text=True, check=False).stdout.strip()
    out = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "commit": commit,
           "jax": jax.__version__, "shapes": shapes, "cache_dtype": "bfloat16", "results": rows}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
