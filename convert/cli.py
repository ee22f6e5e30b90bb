"""``kimi-jax convert SRC DST``: the command-line face of :func:`convert.converter.convert_checkpoint`."""

from __future__ import annotations


def register(subparsers):
    """Entry point of the ``kimi_jax.commands`` group (pyproject.toml): adds ``kimi-jax convert``."""
    p = subparsers.add_parser("convert", help="convert an HF safetensors checkpoint into a kimi-jax Orbax checkpoint")
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p):
    p.add_argument("src", metavar="SRC", help="HF checkpoint directory (config.json, safetensors shards, tokenizer)")
    p.add_argument("dst", metavar="DST", help="output directory (Orbax checkpoint + config + tokenizer files)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="parameter dtype (float32 tensors of the release stay float32, MXFP4 experts stay packed; "
                        "default: %(default)s)")
    p.add_argument("--layers", type=int, metavar="N", help="keep only the first N layers")
    p.add_argument("--experts", type=int, metavar="N", help="keep only the first N routed experts per MoE layer")
    p.add_argument("--overwrite", action="store_true", help="replace whatever DST holds")
    p.add_argument("--verify", action="store_true", help="reread every stored array and compare with its source")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-check-finite", action="store_true",
                   help="convert tensors holding NaN / Inf (or MXFP4 NaN scale bytes) instead of refusing them")
    p.add_argument("--quantize", default=None, metavar="FORMAT",
                   help="store the selected weights packed: int8, int4[:gN][:zero], nf4[:gN] (kimi_jax.quantize); "
                        "from_pretrained(DST) returns the quantized model")
    p.add_argument("--quantize-include", default=None, metavar="CLASSES",
                   help="comma-separated module classes to quantize (attention, mlp, latent, lm_head, embed, "
                        "experts; default attention,mlp,latent,lm_head)")


def run(args):
    from convert.converter import convert_checkpoint

    summary = convert_checkpoint(args.src, args.dst, dtype=args.dtype, layers=args.layers, experts=args.experts,
                                 overwrite=args.overwrite, verify=args.verify, progress=not args.no_progress,
                                 check_finite=not args.no_check_finite, quantize=args.quantize,
                                 quantize_include=None if args.quantize_include is None
                                 else [c.strip() for c in args.quantize_include.split(",") if c.strip()])
    print(summary)
