"""kimi-jax: Kimi K3, Kimi Linear and dense Kimi models in JAX (Flax NNX).

    import kimi_jax
    model = kimi_jax.from_pretrained("path/to/checkpoint", dtype="bfloat16")
    logits = model(ids).logits
    small = kimi_jax.from_pretrained("path/to/checkpoint", quantize="int8")  # or "int4", "int4:g128:zero", "nf4"
    out = kimi_jax.generate(model, "The capital of France is", max_new_tokens=16, tokenizer="path/to/checkpoint")
    demo = kimi_jax.from_pretrained("demo")  # the small K3 shipped in the package (its tokenizer: tokenizer="demo")

The packages, bottom up (ARCHITECTURE.md): ``text`` (tokenizer, chat), ``model`` (config, layers, cache, offload,
the decoder), ``parallel`` (sharding tables, meshes, processes), ``checkpoint`` (reading and writing checkpoints,
loading), ``generation``, ``serving`` and ``training``, ``deploy`` (plans, deviceless compiles), ``analysis`` and
``cli``. This module is the public facade; nothing inside the package imports it.
"""

import importlib.metadata

from kimi_jax.checkpoint.loading import from_pretrained  # noqa: F401
from kimi_jax.generation import generate as _generation
from kimi_jax.generation.generate import Generation, Generator  # noqa: F401
from kimi_jax.model.config import ConfigError, ModelConfig, preset  # noqa: F401
from kimi_jax.model.decoder import KimiModel, ModelOutput, abstract_model, param_count  # noqa: F401
from kimi_jax.model.quantize import quantize  # noqa: F401
from kimi_jax.model.run import RunConfig  # noqa: F401
from kimi_jax.serving import offline as _offline


def generate(model, prompts, max_new_tokens=32, *, constraint=None, **kw) -> Generation:
    """Generate from a model: :func:`kimi_jax.generation.generate.generate` (its arguments in ``kw``). With a
    ``constraint`` (structured outputs: a :class:`kimi_jax.text.grammar.Constraint`, or ``{"json": schema}``,
    ``{"regex": ...}``, ``{"choice": [...]}``, ``{"grammar": lark}``, ``{"json_object": True}``), every output (the
    answer of a chat prompt) matches it: :func:`kimi_jax.serving.offline.generate` (temperature, top_k, top_p, stop,
    seed, tokenizer and max_len apply; not streaming, recorded logits or speculative decoding)."""
    if constraint is None:
        return _generation.generate(model, prompts, max_new_tokens, **kw)
    unsupported = sorted(set(kw) - {"tokenizer", "temperature", "top_k", "top_p", "stop", "seed", "max_len"})
    if unsupported:
        raise _generation.GenerationError(f"constraint: not with {unsupported} yet")
    return _offline.generate(model, prompts, max_new_tokens, constraint=constraint, **kw)


try:  # the installed distribution's version: pyproject.toml's, the one source
    __version__ = importlib.metadata.version("kimi-jax")
except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "unknown"
