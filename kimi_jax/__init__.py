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
from kimi_jax.generation.generate import Generation, Generator, generate  # noqa: F401
from kimi_jax.model.config import ConfigError, ModelConfig, preset  # noqa: F401
from kimi_jax.model.decoder import KimiModel, ModelOutput, abstract_model, param_count  # noqa: F401
from kimi_jax.model.quantize import quantize  # noqa: F401
from kimi_jax.model.run import RunConfig  # noqa: F401

try:  # the installed distribution's version: pyproject.toml's, the one source
    __version__ = importlib.metadata.version("kimi-jax")
except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "unknown"
