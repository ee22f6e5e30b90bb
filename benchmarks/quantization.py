"""Quality of weight-only quantization (kimi_jax.model.quantize): bytes, per-token KL against float32 logits and
greedy top-1 agreement, for the three families and the shared benchmark model.

For each model: the float32 model continues a 64-token prompt greedily for 64 tokens; the prompt and continuation
are then run teacher-forced through the float32 model and through each quantized copy, and at each of the 64
continuation positions we take KL(p_float32 || p_quantized) and whether the argmax agrees. Bytes are the loaded
parameter bytes (every field of a packed weight).

    python benchmarks/quantization.py                 # the three tiny families + the benchmark model
    python benchmarks/quantization.py --skip-bench    # tiny families only (a minute)

The trained demo model (kimi_jax/assets/k3-demo) is measured too, on four prompts of its held-out text (the
statistics over all 256 continuation positions; one 64-token continuation moves by about 1e-2 between variants):
the one trained model here, where the issue's targets mean something. It is also quantized with GPTQ (rows
``FORMAT+gptq``: ``from_pretrained(..., quantize_calibration=ids)``), calibrated on 64 sequences of 256 tokens of its
training text, and with a mixed recipe (``int4:g32,attention=int8``: the attention projections in int8, the rest in
int4 g32; two ``quantize`` calls, one per module-class selection). Each demo row also has its perplexity on the
first 16 windows of 256 tokens of the held-out text (teacher-forced; printed as a second table).

    python benchmarks/quantization.py --demo-only     # the demo model's rows alone (about 15 minutes)

    python benchmarks/quantization.py --sensitivity   # which weights carry int4's error (demo model, 3 minutes)

``--sensitivity`` quantizes one part of the demo model at a time to int4:g32 (round to nearest): each module class,
then each projection of the attention layers by mixer (KDA, MLA), and prints the same KL measure per part.

The benchmark model's weights are built as benchmarks/decode.py builds them (benchmarks/configs/kimi-linear-bench.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

# a CPU benchmark: with the aot extra installed, JAX would otherwise try to start the CUDA and TPU runtimes first
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

FORMATS = ["int8", "int4:g32", "int4:g64", "int4:g128", "int4:g32:zero", "int4:g128:zero", "nf4:g64"]
PROMPT, NEW = 64, 64
DEMO_PROMPTS = 4  # held-out prompts the demo model is measured on (one 64-token continuation moves by ~1e-2)
# The demo model's mixed recipe: its attention projections (KDA's carry most of int4's error, --sensitivity) in int8,
# every other selected weight in int4 g32 (two quantize() calls, one per module-class selection)
MIXED = "int4:g32,attention=int8"
CALIBRATION = (64, 256)  # GPTQ calibration: sequences x tokens of the demo model's training text
PERPLEXITY, PERPLEXITY_LEN = 16, 256  # the demo model's perplexity: windows x tokens of its held-out text


def param_bytes(model) -> int:
    from flax import nnx

    from kernels_pallas import packed

    return sum(packed.nbytes(v.get_value()) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))


def continuation(model, prompt: np.ndarray) -> np.ndarray:
    import kimi_jax

    gen = kimi_jax.Generator(model, max_len=PROMPT + NEW, batch_buckets=(1,), prompt_buckets=(PROMPT,))
    out = gen.generate(prompt, NEW, stop=())
    return np.concatenate([prompt[0], np.asarray(out.tokens[0])])[None]


def log_probs(model, seq: np.ndarray) -> np.ndarray:
    import jax
    import jax.numpy as jnp

    logits = model(jnp.asarray(seq)).logits[0, PROMPT - 1:-1].astype(jnp.float32)  # predicting the continuation
    return np.asarray(jax.nn.log_softmax(logits, axis=-1), np.float64)


def perplexity(model, text: np.ndarray, batch: int = 8) -> float:
    """exp of the mean next-token negative log-likelihood over every position of ``text [N, L]`` (real text)."""
    import jax
    import jax.numpy as jnp

    nll = []
    for i in range(0, len(text), batch):
        ids = text[i:i + batch]
        logits = model(jnp.asarray(ids)).logits[:, :-1].astype(jnp.float32)
        lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
        nll.append(-np.take_along_axis(lp, ids[:, 1:, None], axis=-1)[..., 0].ravel())
    return float(np.exp(np.concatenate(nll).astype(np.float64).mean()))


def measure(name: str, load, include=None, prompts=None, calibrated: bool = False, formats=FORMATS,
            text=None) -> list[dict]:
    """``load(quantize)`` returns a float32 model, quantized when ``quantize`` is given; ``load("bfloat16")`` the
    model in bfloat16 (a reference point: what rounding every weight and activation to bfloat16 costs).
    ``prompts``: ``[P, PROMPT]`` ids, each continued on its own; the KL mean, max and top-1 agreement are over all
    ``P * NEW`` positions (default: one prompt of random ids). ``calibrated``: also each format + GPTQ
    (``load(fmt + "+gptq")``). ``text``: held-out ids ``[N, L]``; each row then also has its :func:`perplexity`."""
    base = load(None)
    vocab = base.cfg.vocab_size
    if prompts is None:
        prompts = np.random.default_rng(0).integers(3, vocab, (1, PROMPT)).astype(np.int32)
    seqs = [continuation(base, prompt[None]) for prompt in prompts]
    ref = np.concatenate([log_probs(base, seq) for seq in seqs])
    rows = [dict(model=name, format="float32", bytes=param_bytes(base), kl_mean=0.0, kl_max=0.0, top1=1.0,
                 ppl=None if text is None else perplexity(base, text))]
    del base
    p = np.exp(ref)
    for fmt in ["bfloat16", *formats, *([f + "+gptq" for f in formats] if calibrated else [])]:
        t0 = time.perf_counter()
        try:
            model = load(fmt)
        except ValueError as e:  # a width the group does not divide (the tiny models' 96-wide MLPs)
            print(f"  {name} {fmt}: {e}")
            continue
        lq = np.concatenate([log_probs(model, seq) for seq in seqs])  # float32 logits of either model
        kl = np.sum(p * (ref - lq), axis=-1)
        rows.append(dict(model=name, format=fmt, bytes=param_bytes(model), kl_mean=float(kl.mean()),
                         kl_max=float(kl.max()), top1=float(np.mean(ref.argmax(-1) == lq.argmax(-1))),
                         ppl=None if text is None else perplexity(model, text)))
        ppl = "" if text is None else f" perplexity {rows[-1]['ppl']:.3f}"
        print(f"  {name} {fmt}: KL mean {rows[-1]['kl_mean']:.2e} max {rows[-1]['kl_max']:.2e} top-1 "
              f"{rows[-1]['top1']:.3f}{ppl} ({time.perf_counter() - t0:.1f}s)", flush=True)
        del model
    return rows


def _load(path, fmt, include, calibration=None):
    """The model at ``path`` in ``fmt``: None (float32), ``"bfloat16"``, a format of :mod:`kernels_pallas.quant`
    (``include``'s module classes), ``FORMAT,CLASS=FORMAT2,...`` (those classes in ``FORMAT2``, quantized first, the
    rest of ``include`` in ``FORMAT``); ``+gptq``: calibrated on ``calibration``."""
    import kimi_jax
    from kimi_jax.model import quantize as Q

    if fmt == "bfloat16":
        return kimi_jax.from_pretrained(path, dtype="bfloat16", progress=False)
    gptq = fmt is not None and fmt.endswith("+gptq")
    fmt = fmt and fmt.removesuffix("+gptq")
    calibration = calibration if gptq else None
    if fmt and "," in fmt:
        model = kimi_jax.from_pretrained(path, dtype="float32", progress=False)
        rest, *parts = fmt.split(",")
        special = dict(part.split("=") for part in parts)
        for cls, f in special.items():
            Q.quantize(model, f, [cls], calibration=calibration)
        return Q.quantize(model, rest, [c for c in (include or Q.DEFAULT) if c not in special],
                          calibration=calibration)
    return kimi_jax.from_pretrained(path, dtype="float32", progress=False, quantize=fmt,
                                    quantize_include=include if fmt else None, quantize_calibration=calibration)


def _demo(include) -> list[dict]:
    """The shipped demo model on DEMO_PROMPTS prompts of PROMPT tokens from its held-out text (its last 5%), 10
    prompts' length apart."""
    from kimi_jax.cli.demo import demo_model_dir
    from kimi_jax.text.tokenizer import load_tokenizer

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import make_demo_model

    path = demo_model_dir()
    ids = load_tokenizer(path).encode(make_demo_model.corpus())
    start = int(len(ids) * (1 - make_demo_model.EVAL_FRAC))
    prompts = np.stack([ids[a:a + PROMPT] for a in start + 10 * PROMPT * np.arange(DEMO_PROMPTS)]).astype(np.int32)
    at = np.random.default_rng(0).integers(0, start - CALIBRATION[1], CALIBRATION[0])  # training text only
    calibration = np.stack([ids[a:a + CALIBRATION[1]] for a in at]).astype(np.int32)
    # perplexity: the held-out text's first PERPLEXITY windows of PERPLEXITY_LEN tokens (the prompts are inside it)
    text = np.stack([ids[a:a + PERPLEXITY_LEN] for a in start + PERPLEXITY_LEN * np.arange(PERPLEXITY)])
    return measure("demo model (trained K3 10.1M)", lambda q: _load(path, q, include, calibration), prompts=prompts,
                   calibrated=True, formats=[*FORMATS, MIXED], text=text.astype(np.int32))


def sensitivity(fmt: str = "int4:g32") -> None:
    """The demo model with one part at a time in ``fmt``: each module class, then each attention projection by
    mixer; the KL measure of :func:`measure` per part (the float32 continuation of its held-out prompt)."""
    import collections

    import kimi_jax
    from flax import nnx

    from kimi_jax.cli.demo import demo_model_dir
    from kimi_jax.model import quantize as Q
    from kimi_jax.text.tokenizer import load_tokenizer

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import make_demo_model

    path = demo_model_dir()
    ids = load_tokenizer(path).encode(make_demo_model.corpus())
    start = int(len(ids) * (1 - make_demo_model.EVAL_FRAC))
    base = kimi_jax.from_pretrained(path, dtype="float32", progress=False)
    seq = continuation(base, np.asarray(ids[start:start + PROMPT], np.int32)[None])
    ref = log_probs(base, seq)
    parts = {f"class {c}": list(Q.plan(base, fmt, [c])) for c in ("attention", "mlp", "latent", "lm_head")}
    by_projection = collections.defaultdict(list)
    for name in parts["class attention"]:
        mixer = base.cfg.attn_types[int(name.split(".")[1])]
        by_projection[f"{mixer} {name.split('.')[-1]}"].append(name)
    parts.update(sorted(by_projection.items()))
    print(f"| {fmt} on | weights | KL mean | KL max | top-1 agreement ({NEW} tokens) |")
    print("|---|---|---|---|---|")
    for part, names in parts.items():
        model = kimi_jax.from_pretrained(path, dtype="float32", progress=False)
        todo = Q.plan(model, fmt)
        state = nnx.state(model, nnx.Param)
        for p, var in nnx.to_flat_state(state):
            name = ".".join(map(str, p))
            if name in names:
                var.set_value(Q.quantizer(todo[name])(var.get_value()))
        nnx.update(model, state)
        lq = log_probs(model, seq)
        kl = np.sum(np.exp(ref) * (ref - lq), axis=-1)
        print(f"| {part} | {len(names)} | {kl.mean():.2e} | {kl.max():.2e} | "
              f"{np.mean(ref.argmax(-1) == lq.argmax(-1)):.3f} |", flush=True)


def table(columns: str, rows: list[dict], cells) -> None:
    """A markdown table of ``rows``: model, format, bytes, then ``columns`` (``"a | b"``), whose cells are
    ``cells(row, first)``, ``first`` being the model's first (float32) row."""
    print()
    print(f"| model | format | bytes | {columns} |")
    print("|---|---|---|" + "---|" * (columns.count("|") + 1))
    first = {}
    for r in rows:
        f = first.setdefault(r["model"], r)
        print(f"| {r['model']} | {r['format']} | {r['bytes'] / 1e6:.1f} MB | {cells(r, f)} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default=os.path.join(os.path.expanduser("~"), ".cache", "kimi-jax",
                                                      "kimi-linear-bench"))
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--demo-only", action="store_true", help="only the demo model's rows")
    ap.add_argument("--include", default="attention,mlp,latent,lm_head,experts",
                    help="module classes quantized, comma separated (default: all but the embedding)")
    ap.add_argument("--sensitivity", action="store_true", help="only: int4:g32 on one part of the demo model at a "
                    "time (module docstring)")
    args = ap.parse_args(argv)
    if args.sensitivity:
        sensitivity()
        return 0

    from kimi_jax.checkpoint import synthetic

    include = args.include.split(",") if args.include else None
    rows = _demo(include)
    if not (args.demo_only or args.skip_bench):
        from decode import BENCH_CONFIG, build_weights

        path = build_weights(args.weights, BENCH_CONFIG)
        rows += measure("benchmark model (Kimi Linear 272.6M)", lambda q: _load(path, q, include))
    with tempfile.TemporaryDirectory() as tmp:
        for family in () if args.demo_only else ("k3", "kimi_linear", "llama"):
            path = os.path.join(tmp, family)
            synthetic.write_checkpoint(path, family)
            rows += measure(f"tiny {family} (random)", lambda q, p=path: _load(p, q, include))

    table("vs float32 | KL mean | KL max | top-1 agreement", rows,
          lambda r, f: f"{r['bytes'] / f['bytes']:.2f} | {r['kl_mean']:.2e} | {r['kl_max']:.2e} | {r['top1']:.3f}")
    with_ppl = [r for r in rows if r.get("ppl") is not None]
    if with_ppl:
        table(f"perplexity ({PERPLEXITY} x {PERPLEXITY_LEN} held-out tokens) | vs float32", with_ppl,
              lambda r, f: f"{r['ppl']:.3f} | {r['ppl'] / f['ppl']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
