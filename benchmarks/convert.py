"""Conversion throughput and peak memory on a >= 1 GB multi-shard synthetic K3 checkpoint, next to a plain file copy
of the same shard bytes measured in the same run.

    python benchmarks/convert.py [--workdir DIR] [--keep] [--repeat 2]

Steps: write a K3-layout checkpoint (release key names, MXFP4 experts, F32 where the release has F32; bigger hidden
size and expert count than the tiny default) into DIR/src; then, --repeat times, alternately `cp` the shard files to
DIR/copy (once plain, once followed by fsync of every copied file) and run `kimi-jax convert` (in a fresh process,
so its peak RSS is its own) to DIR/dst. All read the source from the page cache (the copy runs first and warms it);
each timed section starts after a `sync`. The conversion's Orbax saves fsync their data files before each commit,
so `cp+fsync` is the like-for-like baseline; plain `cp` (data left in the page cache) is shown too. Reports bytes, seconds, MB/s, the ratio convert/copy, and peak RSS against the bound
2 x (largest output array) + 1 GiB. The machine's load average is printed: other users' work skews both numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def bench_config() -> dict:
    """K3 layout, ~3.6 GB: hidden 2048, 9 layers (dense, KDA/MLA 3:1, final two MLA), 128 experts of 1536 x 1024
    per MoE layer (MXFP4), vocab 32768."""
    from kimi_jax.config import tiny_k3_config_dict

    c = tiny_k3_config_dict()
    t = c["text_config"]
    t.update(vocab_size=32768, hidden_size=2048, num_hidden_layers=9, intermediate_size=8192, num_attention_heads=16,
             num_key_value_heads=16, q_lora_rank=512, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
             v_head_dim=64, num_experts=128, num_experts_per_token=8, moe_intermediate_size=1536,
             routed_expert_hidden_size=1024, num_shared_experts=2, attn_res_block_size=3)
    t["linear_attn_config"].update(kda_layers=[1, 2, 3, 5, 6, 7], full_attn_layers=[4, 8, 9], num_heads=16,
                                   head_dim=128)
    return c


CONVERT = """
import json, sys, time
t0 = time.perf_counter()
from convert.converter import convert_checkpoint, peak_rss
base = peak_rss()
s = convert_checkpoint(sys.argv[1], sys.argv[2], progress=False, overwrite=True)
print(json.dumps(dict(seconds=s.seconds, bytes_in=s.bytes_in, bytes_out=s.bytes_out, peak_rss=s.peak_rss,
                      rss_after_imports=base, tensors=s.tensors, params=s.params, wall=time.perf_counter() - t0,
                      setup=s.setup_seconds, stream=s.stream_seconds)))
"""


def shard_files(src):
    return sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))


def child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def timed_copy(src, dst, durable: bool) -> tuple[int, float, float]:
    """`cp` of the shard files; with ``durable`` also fsync each copy (the conversion's Orbax saves fsync their data
    files before committing, so this is the like-for-like baseline)."""
    if os.path.exists(dst):
        shutil.rmtree(dst)
    os.makedirs(dst)
    files = [os.path.join(src, f) for f in shard_files(src)]
    os.sync()
    t, c = time.perf_counter(), child_cpu()
    subprocess.run(["cp", "--reflink=never", *files, dst], check=True)
    cpu = child_cpu() - c
    if durable:
        for f in shard_files(src):
            fd = os.open(os.path.join(dst, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    return sum(os.path.getsize(f) for f in files), time.perf_counter() - t, cpu


def timed_convert(src, dst) -> dict:
    os.sync()
    c = child_cpu()
    r = subprocess.run([sys.executable, "-c", CONVERT, src, dst], cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"conversion failed:\n{r.stderr[-3000:]}")
    return dict(json.loads(r.stdout.strip().splitlines()[-1]), cpu=child_cpu() - c)


def largest_output_array(dst) -> int:
    from convert import orbax_io

    return max(math.prod(s.shape) * s.dtype.itemsize for s in orbax_io.stored(dst).values())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", help="where to write (default: a temporary directory, removed afterwards)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="kimi_jax_convert_bench_")
    src, copy, dst = (os.path.join(work, n) for n in ("src", "copy", "dst"))
    try:
        if not os.path.exists(os.path.join(src, "model.safetensors.index.json")):
            from convert.synthetic import write_checkpoint

            t = time.perf_counter()
            write_checkpoint(src, "k3", config=bench_config(), num_shards=8)
            print(f"wrote synthetic K3 checkpoint in {time.perf_counter() - t:.0f} s")
        total = sum(os.path.getsize(os.path.join(src, f)) for f in shard_files(src))
        print(f"source: {len(shard_files(src))} shards, {total / 1e9:.2f} GB; load average before: "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
        copies, durable, convs = [], [], []
        for i in range(args.repeat):
            n, dt, cpu = timed_copy(src, copy, durable=False)
            copies.append(n / dt)
            print(f"  run {i}: cp       {n / 1e9:.2f} GB in {dt:6.2f} s = {n / dt / 1e6:7.0f} MB/s, CPU {cpu:.1f} s")
            n, dt, cpu = timed_copy(src, copy, durable=True)
            durable.append(n / dt)
            print(f"  run {i}: cp+fsync {n / 1e9:.2f} GB in {dt:6.2f} s = {n / dt / 1e6:7.0f} MB/s, CPU {cpu:.1f} s (cp)")
            r = timed_convert(src, dst)
            convs.append(r["bytes_in"] / r["seconds"])
            print(f"  run {i}: convert  {r['bytes_in'] / 1e9:.2f} GB in {r['seconds']:6.2f} s = "
                  f"{r['bytes_in'] / r['seconds'] / 1e6:7.0f} MB/s (read), {r['bytes_out'] / 1e9:.2f} GB written; "
                  f"setup {r['setup']:.1f} s, streaming {r['stream']:.1f} s = {r['bytes_in'] / r['stream'] / 1e6:.0f} MB/s; "
                  f"peak RSS {r['peak_rss'] / 2**20:.0f} MiB (after imports {r['rss_after_imports'] / 2**20:.0f} MiB); "
                  f"process wall {r['wall']:.1f} s, CPU {r['cpu']:.1f} s (incl. Python/JAX start-up)")
        big = largest_output_array(dst)
        bound = 2 * big + 2**30
        best_copy, best_durable, best_conv = max(copies), max(durable), max(convs)
        peak = r["peak_rss"]
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print(f"RESULT (best of {args.repeat}) convert {best_conv / 1e6:.0f} MB/s; cp {best_copy / 1e6:.0f} MB/s -> "
              f"ratio {best_conv / best_copy:.2f}; cp+fsync {best_durable / 1e6:.0f} MB/s -> ratio "
              f"{best_conv / best_durable:.2f}; peak RSS {peak / 2**20:.0f} MiB, bound "
              f"2 x {big / 2**20:.0f} MiB + 1024 MiB = {bound / 2**20:.0f} MiB -> {'within' if peak < bound else 'OVER'}")
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
