"""Kernel benchmark for an NVIDIA Hopper GPU (H100/H200): every Pallas kernel compiled for the GPU, checked against
its plain-jnp reference, and timed against the XLA path, with achieved memory bandwidth for the decode-shaped
(bandwidth-bound) kernels and FLOP rates for the prefill-shaped ones. Shapes follow Kimi K3 (KDA 96 heads x 128,
MLA latent 512 + 64, experts 3072 x 3584 in MXFP4); batch, context and expert counts are cut to fit one GPU and
a few minutes.

    python benchmarks/gpu_kernels.py                    # on the GPU: all cases, a table, JSON with --json
    python benchmarks/gpu_kernels.py --only moe_gather_mxfp4,mla_decode --sweep
    python benchmarks/gpu_kernels.py --interpret        # CPU smoke test: tiny shapes, kernels in interpret mode
    python benchmarks/gpu_kernels.py --lower-only --sweep  # CPU: lower the GPU-sized cases for CUDA (no run)

"XLA path" is the package's plain-jnp reference jitted by XLA (float32 softmax/recurrence math, ``ragged_dot`` for
the grouped matmul); for attention a ``jax.nn.dot_product_attention`` row is added when XLA/cuDNN supports the
case. Every case runs in its own try/except: one failure is reported and the rest still run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import kernels_pallas.attention as attn_api  # noqa: E402
import kernels_pallas.kda as kda_api  # noqa: E402
import kernels_pallas.mla_decode as mla_api  # noqa: E402
import kernels_pallas.moe_gmm as moe_api  # noqa: E402
import kernels_pallas.qmatmul as qmm_api  # noqa: E402
from kernels_pallas import cache_quant  # noqa: E402
from kernels_pallas import quant as qfmt  # noqa: E402
from kernels_pallas.attention import pallas as attn_pallas  # noqa: E402
from kernels_pallas.kda import pallas as kda_pallas  # noqa: E402
from kernels_pallas.mla_decode import pallas as mla_pallas  # noqa: E402
from kernels_pallas.moe_gmm import pallas as moe_pallas  # noqa: E402
from kernels_pallas.qmatmul import pallas as qmm_pallas  # noqa: E402
from kernels_pallas.mxfp4 import MXFP4Weight  # noqa: E402

BF, F32, I32, U8 = jnp.bfloat16, jnp.float32, jnp.int32, jnp.uint8
PEAK_GBPS = {"H200": 4800.0, "H100": 3350.0, "H800": 3350.0, "A100": 2039.0}  # HBM, vendor figures


@dataclasses.dataclass
class Case:
    name: str
    specs: tuple  # ShapeDtypeStructs of the arguments (for --lower-only)
    make: object  # key -> concrete arguments
    kernel: object  # implementation -> callable(*args)
    xla: object  # callable(*args): the reference, jitted by XLA
    nbytes: float = 0.0  # bytes a bandwidth-optimal kernel must move (decode-shaped cases)
    flops: float = 0.0  # useful FLOPs (prefill-shaped cases)
    extra: dict = dataclasses.field(default_factory=dict)  # name -> callable(*args): more baselines
    tuned: object = None  # (**block_kwargs) -> callable(*args): the Pallas kernel with explicit block choices
    sweep: dict = dataclasses.field(default_factory=dict)  # label -> block kwargs for ``tuned``


def _normal(key, shape, dtype, scale=1.0):
    return (scale * jax.random.normal(key, shape, F32)).astype(dtype)


def _unit(key, shape):
    x = jax.random.normal(key, shape, F32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)


def _mxfp4(key, e, n, k):
    k1, k2 = jax.random.split(key)
    return MXFP4Weight(jax.random.randint(k1, (e, n, k // 2), 0, 256, I32).astype(U8),
                       jax.random.randint(k2, (e, n, k // 32), 119, 124, I32).astype(U8))


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def build_cases(tiny: bool) -> list[Case]:
    cases = []
    # -- attention -----------------------------------------------------------------------------------------
    B, T, H, G, K = (1, 40, 4, 2, 32) if tiny else (1, 4096, 32, 8, 128)

    def make_prefill(key):
        ks = jax.random.split(key, 3)
        pos = jnp.broadcast_to(jnp.arange(T, dtype=I32), (B, T))
        return _normal(ks[0], (B, T, H, K), BF), _normal(ks[1], (B, T, G, K), BF), _normal(ks[2], (B, T, G, K), BF), pos

    def sdpa_prefill(q, k, v, pos):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=K**-0.5)

    cases.append(Case(
        "attention_prefill_gqa",
        (_spec((B, T, H, K), BF), _spec((B, T, G, K), BF), _spec((B, T, G, K), BF), _spec((B, T), I32)), make_prefill,
        lambda impl: lambda q, k, v, p: attn_api.attention(q, k, v, p, scale=K**-0.5, implementation=impl),
        lambda q, k, v, p: attn_api.attention(q, k, v, p, scale=K**-0.5, implementation="reference"),
        flops=4.0 * B * H * T * T / 2 * K, extra={"xla_sdpa": sdpa_prefill},
        tuned=lambda **kw: lambda q, k, v, p: attn_pallas.attention(q, k, v, p, scale=K**-0.5, **kw),
        sweep={f"bq{bq}_bk{bk}": dict(block_q=bq, block_k=bk) for bq, bk in [(64, 32), (128, 64), (32, 64)]},
    ))

    Bd, Sd = (2, 100) if tiny else (8, 8192)

    def make_decode(key):
        ks = jax.random.split(key, 4)
        lengths = jax.random.randint(ks[3], (Bd,), Sd // 4, Sd - 1)
        return (_normal(ks[0], (Bd, 1, H, K), BF), _normal(ks[1], (Bd, Sd, G, K), BF),
                _normal(ks[2], (Bd, Sd, G, K), BF), lengths[:, None].astype(I32))

    def sdpa_decode(q, k, v, pos):
        return jax.nn.dot_product_attention(q, k, v, scale=K**-0.5, key_value_seq_lengths=pos[:, 0] + 1)

    mean_len = (Sd // 4 + Sd - 1) / 2
    cases.append(Case(
        "attention_decode_gqa",
        (_spec((Bd, 1, H, K), BF), _spec((Bd, Sd, G, K), BF), _spec((Bd, Sd, G, K), BF), _spec((Bd, 1), I32)),
        make_decode,
        lambda impl: lambda q, k, v, p: attn_api.attention(q, k, v, p, scale=K**-0.5, implementation=impl),
        lambda q, k, v, p: attn_api.attention(q, k, v, p, scale=K**-0.5, implementation="reference"),
        nbytes=Bd * mean_len * G * K * 2 * 2, extra={"xla_sdpa": sdpa_decode},
        tuned=lambda **kw: lambda q, k, v, p: attn_pallas.attention(q, k, v, p, scale=K**-0.5, **kw),
        sweep={f"splits{s}_bk{bk}": dict(num_splits=s, block_k=bk) for s, bk in [(1, 64), (4, 64), (16, 64), (8, 128)]},
    ))

    Hm, N, O, U = (3, 32, 16, 32) if tiny else (32, 128, 64, 128)
    Tm = 40 if tiny else 4096

    def make_mla_prefill(key):
        ks = jax.random.split(key, 5)
        pos = jnp.broadcast_to(jnp.arange(Tm, dtype=I32), (1, Tm))
        return (_normal(ks[0], (1, Tm, Hm, N), BF), _normal(ks[1], (1, Tm, Hm, N), BF),
                _normal(ks[2], (1, Tm, Hm, U), BF), pos, _normal(ks[3], (1, Tm, Hm, O), BF),
                _normal(ks[4], (1, Tm, O), BF))

    sc = (N + O) ** -0.5
    cases.append(Case(
        "mla_prefill_split_rope",
        (_spec((1, Tm, Hm, N), BF), _spec((1, Tm, Hm, N), BF), _spec((1, Tm, Hm, U), BF), _spec((1, Tm), I32),
         _spec((1, Tm, Hm, O), BF), _spec((1, Tm, O), BF)),
        make_mla_prefill,
        lambda impl: lambda q, k, v, p, qpe, kpe: attn_api.attention(q, k, v, p, scale=sc, q_pe=qpe, k_pe=kpe,
                                                                     implementation=impl),
        lambda q, k, v, p, qpe, kpe: attn_api.attention(q, k, v, p, scale=sc, q_pe=qpe, k_pe=kpe,
                                                        implementation="reference"),
        flops=2.0 * Hm * Tm * Tm / 2 * (N + O + U),
    ))

    Bl, Hl, R, Ol, Sl = (2, 4, 64, 16, 100) if tiny else (8, 96, 512, 64, 8192)

    def make_mla_decode(key):
        ks = jax.random.split(key, 5)
        lengths = jax.random.randint(ks[4], (Bl,), Sl // 4, Sl - 1)
        return (_normal(ks[0], (Bl, 1, Hl, R), F32, 0.05), _normal(ks[1], (Bl, 1, Hl, Ol), BF),
                _normal(ks[2], (Bl, Sl, R), BF), _normal(ks[3], (Bl, Sl, Ol), BF), lengths[:, None].astype(I32))

    ml = (Sl // 4 + Sl - 1) / 2
    cases.append(Case(
        "mla_decode_absorbed",
        (_spec((Bl, 1, Hl, R), F32), _spec((Bl, 1, Hl, Ol), BF), _spec((Bl, Sl, R), BF), _spec((Bl, Sl, Ol), BF),
         _spec((Bl, 1), I32)),
        make_mla_decode,
        lambda impl: lambda *a: mla_api.mla_attention(*a, scale=0.072, implementation=impl),
        lambda *a: mla_api.mla_attention(*a, scale=0.072, implementation="reference"),
        nbytes=Bl * ml * (R + Ol) * 2,
        tuned=lambda **kw: lambda *a: mla_pallas.mla_attention(*a, scale=0.072, **kw),
        sweep={f"bq{bq}_bk{bk}_splits{s}": dict(block_q=bq, block_k=bk, num_splits=s)
               for bq, bk, s in [(16, 32, 8), (32, 32, 4), (64, 16, 4), (32, 64, 8)]},
    ))

    def make_mla_decode_int8(key):
        q, qpe, c, kpe, pos = make_mla_decode(key)
        return q, qpe, cache_quant.quantize(c), cache_quant.quantize(kpe), pos

    i8 = lambda shape: cache_quant.Int8Rows(_spec(shape, jnp.int8), _spec(shape[:-1] + (1,), F32))
    cases.append(Case(
        "mla_decode_int8_cache",
        (_spec((Bl, 1, Hl, R), F32), _spec((Bl, 1, Hl, Ol), BF), i8((Bl, Sl, R)), i8((Bl, Sl, Ol)), _spec((Bl, 1), I32)),
        make_mla_decode_int8,
        lambda impl: lambda *a: mla_api.mla_attention(*a, scale=0.072, implementation=impl),
        lambda *a: mla_api.mla_attention(*a, scale=0.072, implementation="reference"),
        nbytes=Bl * ml * (R + Ol + 8),
    ))

    # -- KDA -------------------------------------------------------------------------------------------------
    Bk, Tk, Hk, Kk = (1, 40, 2, 32) if tiny else (1, 4096, 16, 128)

    def make_kda(key, Bx, Tx, Hx):
        ks = jax.random.split(key, 6)
        g = -5.0 * jax.nn.sigmoid(jax.random.normal(ks[3], (Bx, Tx, Hx, Kk)))
        return (_unit(ks[0], (Bx, Tx, Hx, Kk)), _unit(ks[1], (Bx, Tx, Hx, Kk)), _normal(ks[2], (Bx, Tx, Hx, Kk), BF), g,
                jax.nn.sigmoid(jax.random.normal(ks[4], (Bx, Tx, Hx))), _normal(ks[5], (Bx, Hx, Kk, Kk), F32, 0.1))

    kspec = lambda Bx, Tx, Hx: (_spec((Bx, Tx, Hx, Kk), F32), _spec((Bx, Tx, Hx, Kk), F32), _spec((Bx, Tx, Hx, Kk), BF),
                                _spec((Bx, Tx, Hx, Kk), F32), _spec((Bx, Tx, Hx), F32), _spec((Bx, Hx, Kk, Kk), F32))
    cases.append(Case(
        "kda_prefill_chunked", kspec(Bk, Tk, Hk), lambda key: make_kda(key, Bk, Tk, Hk),
        lambda impl: lambda *a: kda_api.kda_prefill(*a, scale=Kk**-0.5, implementation=impl),
        lambda *a: kda_api.kda_prefill(*a, scale=Kk**-0.5, implementation="reference"),
        flops=Bk * Tk * Hk * (2 * 64 * Kk * 3 + 8 * Kk * Kk),
        extra={"xla_recurrent_scan": lambda *a: kda_api.kda_prefill(*a, scale=Kk**-0.5, implementation="recurrent")},
        tuned=lambda **kw: lambda *a: kda_pallas.kda_chunked(*a, scale=Kk**-0.5, **kw),
        sweep={f"chunk{c}_bv{bv}": dict(chunk_size=c, block_v=min(bv, Kk))
               for c, bv in [(16, 32), (32, 64), (64, 64), (32, 128)]},
    ))
    Bkd, Hkd = (2, 2) if tiny else (8, 96)
    cases.append(Case(
        "kda_decode_step", kspec(Bkd, 1, Hkd), lambda key: make_kda(key, Bkd, 1, Hkd),
        lambda impl: lambda *a: kda_api.kda_decode(*a, scale=Kk**-0.5, implementation=impl),
        lambda *a: kda_api.kda_decode(*a, scale=Kk**-0.5, implementation="reference"),
        nbytes=2.0 * Bkd * Hkd * Kk * Kk * 4,
        tuned=lambda **kw: lambda *a: kda_pallas.kda_recurrent(*a, scale=Kk**-0.5, **kw),
        sweep={f"bv{bv}": dict(block_v=min(bv, Kk)) for bv in (16, 32, 64, 128)},
    ))

    # -- MoE -------------------------------------------------------------------------------------------------
    Fo, Li = (64, 64) if tiny else (3072, 3584)  # expert hidden (out of w1) x latent width (in)
    Eg, Mg = (6, 40) if tiny else (32, 4096)

    def make_gmm(key, quant):
        ks = jax.random.split(key, 3)
        expert = jax.random.randint(ks[2], (Mg,), 0, Eg)
        sizes = jnp.bincount(jnp.where(expert == 1, 0, expert), length=Eg).astype(I32)  # group 1 empty
        w = _mxfp4(ks[1], Eg, Fo, Li) if quant else _normal(ks[1], (Eg, Fo, Li), BF, Li**-0.5)
        return _normal(ks[0], (Mg, Li), BF), w, sizes

    for quant in (True, False):
        wspec = (MXFP4Weight(_spec((Eg, Fo, Li // 2), U8), _spec((Eg, Fo, Li // 32), U8)) if quant
                 else _spec((Eg, Fo, Li), BF))
        cases.append(Case(
            "moe_gmm_" + ("mxfp4" if quant else "bf16"), (_spec((Mg, Li), BF), wspec, _spec((Eg,), I32)),
            (lambda q: lambda key: make_gmm(key, q))(quant),
            lambda impl: lambda x, w, gs: moe_api.gmm(x, w, gs, compute_dtype=BF, implementation=impl),
            lambda x, w, gs: moe_api.gmm(x, w, gs, compute_dtype=BF, implementation="reference"),
            flops=2.0 * Mg * Fo * Li,
            tuned=lambda **kw: lambda x, w, gs: moe_pallas.gmm(x, w, gs, compute_dtype=BF, **kw),
            sweep={f"bm{bm}_bn{bn}_bk{bk}": dict(block_m=bm, block_n=min(bn, Fo), block_k=min(bk, Li))
                   for bm, bn, bk in [(64, 64, 256), (128, 128, 128), (64, 128, 512)]},
        ))

    Ea, Na, Xa = (8, 3, 2) if tiny else (128, 8, 16)  # experts in memory, tokens, experts per token

    def make_gather(key, quant):
        ks = jax.random.split(key, 3)
        idx = jax.vmap(lambda k: jax.random.choice(k, Ea, (Xa,), replace=False))(jax.random.split(ks[2], Na))
        w = _mxfp4(ks[1], Ea, Fo, Li) if quant else _normal(ks[1], (Ea, Fo, Li), BF, Li**-0.5)
        return _normal(ks[0], (Na, Xa, Li), BF), w, idx.astype(I32)

    for quant in (True, False):
        per_weight = 0.5 + 1 / 32 if quant else 2.0
        wspec = (MXFP4Weight(_spec((Ea, Fo, Li // 2), U8), _spec((Ea, Fo, Li // 32), U8)) if quant
                 else _spec((Ea, Fo, Li), BF))
        cases.append(Case(
            "moe_gather_" + ("mxfp4" if quant else "bf16"), (_spec((Na, Xa, Li), BF), wspec, _spec((Na, Xa), I32)),
            (lambda q: lambda key: make_gather(key, q))(quant),
            lambda impl: lambda x, w, i: moe_api.gather_matmul(x, w, i, compute_dtype=BF, implementation=impl),
            lambda x, w, i: moe_api.gather_matmul(x, w, i, compute_dtype=BF, implementation="reference"),
            nbytes=Na * Xa * Fo * Li * per_weight,
            tuned=lambda **kw: lambda x, w, i: moe_pallas.gather_matmul(x, w, i, compute_dtype=BF, **kw),
            sweep={f"bn{bn}_bk{bk}_w{nw}": dict(block_n=min(bn, Fo), block_k=min(bk, Li), num_warps=nw)
                   for bn, bk, nw in [(16, 512, 4), (32, 256, 4), (64, 512, 8), (128, 256, 8)]},
        ))

    # -- weight-only integer matmul (qmatmul): a K3-width projection, decode (8 rows) and prefill (2048 rows) ------
    Jq, Iq = (96, 128) if tiny else (7168, 7168)

    def make_qweight(key, fmt):
        w = _normal(key, (Jq, Iq), F32, Iq**-0.5)
        return qfmt.quantize(w, qfmt.Format.parse(fmt))

    def qspec(fmt):
        return jax.tree.map(lambda a: _spec(a.shape, a.dtype), jax.eval_shape(lambda: make_qweight(jax.random.key(0), fmt)))

    for fmt, rows in [("int8", 8), ("int4", 8), ("int4:g128:zero", 8), ("nf4", 8), ("int8", 2048), ("int4", 2048)]:
        Mq = min(rows, 16) if tiny else rows
        label = fmt.replace(":", "_")
        wbytes = Jq * Iq * qfmt.Format.parse(fmt).bytes_per_value(Iq)
        cases.append(Case(
            f"qmatmul_{label}_m{rows}", (_spec((Mq, Iq), BF), qspec(fmt)),
            (lambda f, m: lambda key: (_normal(jax.random.fold_in(key, 1), (m, Iq), BF), make_qweight(key, f)))(fmt, Mq),
            lambda impl: lambda x, w: qmm_api.matmul(x, w, implementation=impl),
            lambda x, w: qmm_api.matmul(x, w, implementation="reference"),
            nbytes=wbytes + Mq * Iq * 2 + Mq * Jq * 4 if rows <= 64 else 0.0,
            flops=2.0 * Mq * Jq * Iq if rows > 64 else 0.0,
            extra={"xla_dequant_bf16": lambda x, w: jnp.dot(x, qfmt.dequantize(w, BF).T,
                                                            preferred_element_type=F32)},
            tuned=lambda **kw: lambda x, w: qmm_pallas.matmul(x, w, **kw),
            sweep={f"bm{bm}_bn{bn}_bk{bk}": dict(block_m=bm, block_n=bn, block_k=bk)
                   for bm, bn, bk in ([(16, 64, 256), (16, 128, 256), (16, 32, 512)] if rows <= 64
                                      else [(64, 128, 128), (128, 128, 64), (128, 64, 128)])},
        ))
    return cases


def _time(fn, args, budget_s=0.5):
    """Median wall time (ms) of a compiled function, after one warm-up run."""
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = time.perf_counter() - t0
    reps = int(min(50, max(3, budget_s / max(once, 1e-6))))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _errors(got, want):
    def flat(t):
        return [np.asarray(x, np.float64) for x in jax.tree.leaves(t)]
    max_abs = rel = 0.0
    scale = 0.0
    for a, b in zip(flat(got), flat(want)):
        d = a - b
        max_abs = max(max_abs, float(np.max(np.abs(d))))
        scale = max(scale, float(np.max(np.abs(b))))
        rel = max(rel, float(np.sqrt(np.mean(d * d)) / (np.sqrt(np.mean(b * b)) + 1e-30)))
    return max_abs, rel, scale


def _peak_gbps():
    kind = jax.devices()[0].device_kind
    for k, v in PEAK_GBPS.items():
        if k in kind:
            return kind, v
    return kind, None


def run(cases, impl, sweep, rel_tol):
    kind, peak = _peak_gbps()
    print(f"device: {kind} ({jax.default_backend()}), jax {jax.__version__}, kernels: implementation={impl!r}")
    if peak:
        print(f"HBM peak (vendor): {peak:.0f} GB/s")
    rows = []
    for case in cases:
        row = {"case": case.name}
        try:
            args = case.make(jax.random.key(0))
            t0 = time.perf_counter()
            kfn = jax.jit(case.kernel(impl))
            got = jax.block_until_ready(kfn(*args))
            row["compile_run_s"] = round(time.perf_counter() - t0, 2)
            xfn = jax.jit(case.xla)
            want = jax.block_until_ready(xfn(*args))
            max_abs, rel, scale = _errors(got, want)
            finite = all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(got))
            row.update(max_abs=max_abs, rel_rms=rel, ref_max=scale, ok=bool(finite and rel <= rel_tol))
            row["kernel_ms"] = _time(kfn, args)
            row["xla_ms"] = _time(xfn, args)
            for name, fn in case.extra.items():
                try:
                    row[name + "_ms"] = _time(jax.jit(fn), args)
                except Exception as e:  # noqa: BLE001 -- a baseline XLA cannot run is reported, not fatal
                    row[name + "_ms"] = f"n/a ({type(e).__name__})"
            if case.nbytes:
                row["kernel_GBps"] = case.nbytes / (row["kernel_ms"] * 1e-3) / 1e9
                row["xla_GBps"] = case.nbytes / (row["xla_ms"] * 1e-3) / 1e9
                if peak:
                    row["kernel_pct_peak"] = 100 * row["kernel_GBps"] / peak
            if case.flops:
                row["kernel_TFLOPs"] = case.flops / (row["kernel_ms"] * 1e-3) / 1e12
                row["xla_TFLOPs"] = case.flops / (row["xla_ms"] * 1e-3) / 1e12
            if sweep:
                row["sweep"] = {}
                mode = dict(interpret=True) if impl == "pallas_interpret" else {}
                for label, kw in case.sweep.items():
                    try:
                        f = jax.jit(case.tuned(**kw, **mode))
                        e = _errors(f(*args), want)[1]
                        row["sweep"][label] = f"{_time(f, args):.3f} ms" if e <= rel_tol else f"wrong (rel {e:.2g})"
                    except Exception as e:  # noqa: BLE001
                        row["sweep"][label] = f"failed ({type(e).__name__}: {str(e)[:120]})"
            status = "PASS" if row["ok"] else "MISMATCH"
        except Exception as e:  # noqa: BLE001 -- report and go on with the next kernel
            row.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=6))
            status = "FAIL"
        rows.append(row)
        _print_row(status, row)
    return rows


def _print_row(status, row):
    parts = [f"{row['case']:24s} {status:8s}"]
    if "error" in row:
        parts.append(row["error"][:400])
    else:
        parts.append(f"err max {row['max_abs']:.2e} relRMS {row['rel_rms']:.2e}")
        speedup = row["xla_ms"] / row["kernel_ms"]
        parts.append(f"kernel {row['kernel_ms']:.3f} ms  xla {row['xla_ms']:.3f} ms  x{speedup:.2f}")
        for k in row:
            if k.endswith("_ms") and k not in ("kernel_ms", "xla_ms"):
                v = row[k]
                parts.append(f"{k[:-3]} {v:.3f} ms" if isinstance(v, float) else f"{k[:-3]} {v}")
        if "kernel_GBps" in row:
            pct = f" ({row['kernel_pct_peak']:.0f}% of peak)" if "kernel_pct_peak" in row else ""
            parts.append(f"{row['kernel_GBps']:.0f} GB/s{pct} vs xla {row['xla_GBps']:.0f} GB/s")
        if "kernel_TFLOPs" in row:
            parts.append(f"{row['kernel_TFLOPs']:.1f} TFLOP/s vs xla {row['xla_TFLOPs']:.1f}")
        if row.get("sweep"):
            parts.append("sweep " + ", ".join(f"{k}: {v}" for k, v in row["sweep"].items()))
    print("  ".join(parts), flush=True)
    if "traceback" in row:
        print("    " + row["traceback"].strip().replace("\n", "\n    "), flush=True)


def lower_only(cases, sweep):
    """Lower every case's kernel (and with ``sweep`` its block variants) for CUDA under an abstract H100 (no GPU
    needed): catches shape and block errors before a GPU is ever involved."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

    dev = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    rows = []
    for case in cases:
        fns = {"": case.kernel("pallas")}
        if sweep:
            fns.update({"sweep:" + k: case.tuned(**kw) for k, kw in case.sweep.items()})
        for label, fn in fns.items():
            row = {"case": case.name + (f" [{label}]" if label else "")}
            try:
                with use_abstract_mesh(AbstractMesh((1,), ("x",), axis_types=(AxisType.Auto,), abstract_device=dev)):
                    txt = jax.jit(fn).trace(*case.specs).lower(lowering_platforms=("cuda",)).as_text()
                n = txt.count("__gpu$xla.gpu.triton")
                row.update(ok=n > 0, triton_calls=n)
                print(f"{row['case']:48s} {'OK' if n else 'NO KERNEL'} ({n} Triton calls)", flush=True)
            except Exception as e:  # noqa: BLE001
                row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
                print(f"{row['case']:48s} FAIL {row['error']}", flush=True)
            rows.append(row)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="comma-separated case names")
    p.add_argument("--interpret", action="store_true", help="CPU smoke test: tiny shapes, Pallas interpret mode")
    p.add_argument("--lower-only", action="store_true", help="lower the GPU-sized cases for CUDA, run nothing")
    p.add_argument("--sweep", action="store_true", help="also time a few other block choices per kernel")
    p.add_argument("--rel-tol", type=float, default=2e-2, help="relative RMS error allowed vs the reference")
    p.add_argument("--json", default=None, help="write all results to this file")
    args = p.parse_args(argv)
    cases = build_cases(tiny=args.interpret)
    if args.only:
        names = set(args.only.split(","))
        unknown = names - {c.name for c in cases}
        if unknown:
            p.error(f"unknown cases {sorted(unknown)}; choose from {[c.name for c in cases]}")
        cases = [c for c in cases if c.name in names]
    if args.lower_only:
        rows = lower_only(cases, args.sweep)
    else:
        if not args.interpret and jax.default_backend() != "gpu":
            p.error(f"no GPU here (backend {jax.default_backend()!r}); use --interpret or --lower-only on CPU")
        rows = run(cases, "pallas_interpret" if args.interpret else "pallas", args.sweep, args.rel_tol)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, f, indent=1,
                      default=str)
    failed = [r["case"] for r in rows if not r.get("ok")]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} ok" + (f"; not ok: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
