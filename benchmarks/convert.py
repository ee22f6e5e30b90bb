"""Conversion throughput and peak memory on a >= 1 GB multi-shard synthetic K3 checkpoint, next to a plain file copy
of the same shard bytes measured in the same run.

    python benchmarks/convert.py [--workdir DIR] [--keep] [--repeat 4]

Steps: write a K3-layout checkpoint (release key names, MXFP4 experts, F32 where the release has F32; bigger hidden
size and expert count than the tiny default) into DIR/src; then, --repeat times, `cp` the shard files to DIR/copy
(once plain, once followed by fsync of every copied file) and run `kimi-jax convert` (in a fresh process, so its peak
RSS is its own) to DIR/dst, alternating the order from one repeat to the next. All read the source from the page
cache (it is read once first); each timed section starts after a `sync`. The conversion syncs DST's filesystem
before it declares the checkpoint complete, so `cp+fsync` is the like-for-like baseline; plain `cp` (data left in
the page cache) is shown too. A third baseline, `py copy` (a fresh Python process reading each shard into one reused
64 MiB buffer and writing it out, then fsync; DIR/pycopy), moves the same bytes through process memory as any
converter must, where `cp` never does (it asks the kernel to copy file to file with copy_file_range). Reports bytes,
seconds, MB/s, medians, the ratios convert / copy within each repeat and their medians, and peak RSS against the
bound 2 x (largest output array) + 1 GiB. Write speed from process memory swung by up to 10x from minute to minute
on the shared virtual machine this was written on, hence the interleaving and the per-repeat ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def bench_config() -> dict:
    """K3 layout, ~3.6 GB: hidden 2048, 9 layers (dense, KDA/MLA 3:1, final two MLA), 128 experts of 1536 x 1024
    per MoE layer (MXFP4), vocab 32768."""
    from kimi_jax.model.config import tiny_k3_config_dict

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

PYCOPY = """
import json, os, sys, time
src, dst, names = sys.argv[1], sys.argv[2], sys.argv[3:]
buf = bytearray(64 << 20)
view = memoryview(buf)
t0 = time.perf_counter()
total = 0
for name in names:
    fi = os.open(os.path.join(src, name), os.O_RDONLY)
    fo = os.open(os.path.join(dst, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    while n := os.readv(fi, [view]):
        done = 0
        while done < n:
            done += os.write(fo, view[done:n])
        total += n
    os.fsync(fo)
    os.close(fi)
    os.close(fo)
print(json.dumps(dict(bytes=total, seconds=time.perf_counter() - t0)))
"""


def shard_files(src):
    return sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))


def child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _clear(dst, make: bool = True):
    """Remove the previous output of a timed step (its pages freed before the timer), then flush dirty data."""
    if os.path.exists(dst):
        shutil.rmtree(dst)
    if make:
        os.makedirs(dst)
    os.sync()


def _run_script(script: str, args: list, what: str) -> dict:
    """Run ``script`` in a fresh Python process from the repository root; returns the JSON of its last stdout line."""
    r = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{what} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def timed_copy(src, dst, durable: bool) -> tuple[int, float, float]:
    """`cp` of the shard files; with ``durable`` also fsync each copy (the conversion syncs its output before it
    finishes, so this is the like-for-like baseline)."""
    _clear(dst)
    files = [os.path.join(src, f) for f in shard_files(src)]
    t, c = time.perf_counter(), child_cpu()
    subprocess.run(["cp", "--reflink=never", *files, dst], check=True)
    cpu = child_cpu() - c
    if durable:
        for f in shard_files(src):
            fd = os.open(os.path.join(dst, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    return sum(os.path.getsize(f) for f in files), time.perf_counter() - t, cpu


def timed_pycopy(src, dst) -> tuple[int, float]:
    """The shard files copied through a Python process's memory (read into one buffer, write, fsync each file)."""
    _clear(dst)
    out = _run_script(PYCOPY, [src, dst, *shard_files(src)], "py copy")
    return out["bytes"], out["seconds"]


def timed_convert(src, dst) -> dict:
    _clear(dst, make=False)
    c = child_cpu()
    return dict(_run_script(CONVERT, [src, dst], "conversion"), cpu=child_cpu() - c)


def largest_output_array(dst) -> int:
    from kimi_jax.checkpoint import orbax as orbax_io

    return max(math.prod(s.shape) * s.dtype.itemsize for s in orbax_io.stored(dst).values())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", help="where to write (default: a temporary directory, removed afterwards)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--repeat", type=int, default=4)
    args = ap.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="kimi_jax_convert_bench_")
    src, copy_dir, py_dir, dst = (os.path.join(work, n) for n in ("src", "copy", "pycopy", "dst"))
    try:
        if not os.path.exists(os.path.join(src, "model.safetensors.index.json")):
            from kimi_jax.checkpoint.synthetic import write_checkpoint

            t = time.perf_counter()
            write_checkpoint(src, "k3", config=bench_config(), num_shards=8)
            print(f"wrote synthetic K3 checkpoint in {time.perf_counter() - t:.0f} s")
        total = sum(os.path.getsize(os.path.join(src, f)) for f in shard_files(src))
        print(f"source: {len(shard_files(src))} shards, {total / 1e9:.2f} GB; load average before: "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
        for f in shard_files(src):  # the source in the page cache for everyone
            with open(os.path.join(src, f), "rb") as fh:
                while fh.read(64 << 20):
                    pass
        copies, durable, pycopies, convs = [], [], [], []

        def copy(i):
            n, dt, cpu = timed_copy(src, copy_dir, durable=False)
            copies.append(n / dt)
            print(f"  run {i}: cp       {n / 1e9:.2f} GB in {dt:6.2f} s = {n / dt / 1e6:7.0f} MB/s, CPU {cpu:.1f} s")

        def copy_fsync(i):
            n, dt, cpu = timed_copy(src, copy_dir, durable=True)
            durable.append(n / dt)
            print(f"  run {i}: cp+fsync {n / 1e9:.2f} GB in {dt:6.2f} s = {n / dt / 1e6:7.0f} MB/s, CPU {cpu:.1f} s (cp)")

        def pycopy(i):
            n, dt = timed_pycopy(src, py_dir)
            pycopies.append(n / dt)
            print(f"  run {i}: py copy  {n / 1e9:.2f} GB in {dt:6.2f} s = {n / dt / 1e6:7.0f} MB/s (through process "
                  f"memory, fsync)")

        def conv(i):
            r = timed_convert(src, dst)
            convs.append(r["bytes_in"] / r["seconds"])
            print(f"  run {i}: convert  {r['bytes_in'] / 1e9:.2f} GB in {r['seconds']:6.2f} s = "
                  f"{r['bytes_in'] / r['seconds'] / 1e6:7.0f} MB/s (read), {r['bytes_out'] / 1e9:.2f} GB written; "
                  f"setup {r['setup']:.1f} s, streaming {r['stream']:.1f} s = {r['bytes_in'] / r['stream'] / 1e6:.0f} MB/s; "
                  f"peak RSS {r['peak_rss'] / 2**20:.0f} MiB (after imports {r['rss_after_imports'] / 2**20:.0f} MiB); "
                  f"process wall {r['wall']:.1f} s, CPU {r['cpu']:.1f} s (incl. Python/JAX start-up)")
            return r

        peak = 0
        for i in range(args.repeat):
            order = (copy, copy_fsync, pycopy, conv) if i % 2 == 0 else (conv, pycopy, copy_fsync, copy)
            for step in order:
                r = step(i)
                if r is not None:
                    peak = max(peak, r["peak_rss"])
        big = largest_output_array(dst)
        bound = 2 * big + 2**30
        med = statistics.median
        paired = [c / d for c, d in zip(convs, durable)]
        paired_plain = [c / d for c, d in zip(convs, copies)]
        paired_py = [c / d for c, d in zip(convs, pycopies)]
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print(f"per-repeat ratio convert / cp+fsync: {' '.join(f'{x:.2f}' for x in paired)}; "
              f"convert / cp: {' '.join(f'{x:.2f}' for x in paired_plain)}; "
              f"convert / py copy: {' '.join(f'{x:.2f}' for x in paired_py)}")
        print(f"RESULT (median of {args.repeat}) convert {med(convs) / 1e6:.0f} MB/s; cp+fsync "
              f"{med(durable) / 1e6:.0f} MB/s -> ratio {med(convs) / med(durable):.2f} (median per-repeat ratio "
              f"{med(paired):.2f}); cp {med(copies) / 1e6:.0f} MB/s -> ratio {med(convs) / med(copies):.2f} "
              f"(median per-repeat {med(paired_plain):.2f}); py copy {med(pycopies) / 1e6:.0f} MB/s -> ratio "
              f"{med(convs) / med(pycopies):.2f} (median per-repeat {med(paired_py):.2f}); best convert "
              f"{max(convs) / 1e6:.0f}, best cp+fsync {max(durable) / 1e6:.0f}, best cp {max(copies) / 1e6:.0f} MB/s; "
              f"peak RSS {peak / 2**20:.0f} MiB, "
              f"bound 2 x {big / 2**20:.0f} MiB + 1024 MiB = {bound / 2**20:.0f} MiB -> "
              f"{'within' if peak < bound else 'OVER'}")
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
