"""The embedded default: a tiny Kimi K3 checkpoint written in the released format, with a tokenizer in the
released format, so ``kimi-jax demo`` exercises the real loading, tokenization and generation paths offline.

The weights are random (the text is noise); everything else is the real thing: sharded safetensors with the
``language_model.`` prefix and MXFP4-packed routed experts, ``tiktoken.model`` + ``tokenizer_config.json`` with
the 256 specials at the top of the vocabulary, ``config.json`` whose ``eos_token_id`` is ``<|end_of_msg|>``.
"""

from __future__ import annotations

import os

from kimi_jax.model.config import tiny_k3_config_dict
from kimi_jax.text.tokenizer import NUM_RESERVED_SPECIAL, write_demo_tokenizer


def demo_config() -> dict:
    """tiny_k3_config_dict() with the special ids of its own vocabulary, as the release's config has
    (bos = [BOS], eos = <|end_of_msg|>, pad = [PAD] at the first / third / last special id)."""
    c = tiny_k3_config_dict()
    first = c["text_config"]["vocab_size"] - NUM_RESERVED_SPECIAL
    ids = dict(bos_token_id=first, eos_token_id=first + 2, pad_token_id=first + NUM_RESERVED_SPECIAL - 1)
    c.update(ids)
    c["text_config"].update(ids)
    return c


def build_demo_checkpoint(path, *, seed: int = 0) -> str:
    """Write the demo checkpoint and tokenizer into ``path`` (an empty or new directory); returns ``path``."""
    from kimi_jax.checkpoint.synthetic import write_checkpoint

    path = os.fspath(path)
    config = demo_config()
    write_checkpoint(path, family="k3", config=config, seed=seed)
    write_demo_tokenizer(path, vocab_size=config["text_config"]["vocab_size"])
    return path
