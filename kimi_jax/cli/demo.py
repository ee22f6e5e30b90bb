"""The embedded defaults: the trained demo model shipped in the package, and a random tiny Kimi K3 written on demand.

``kimi_jax/assets/k3-demo`` (:func:`demo_model_dir`, what ``kimi-jax demo`` runs) is a small Kimi K3 trained here on
Python's own documentation (``scripts/make_demo_model.py`` re-creates it; its ``RECIPE.json`` says how and what its
held-out loss is), stored in the released format: ``model.safetensors`` with the ``language_model.`` prefix and
MXFP4-packed routed experts, ``tiktoken.model`` + ``tokenizer_config.json`` with the 256 specials at the top of the
vocabulary, ``config.json`` whose ``eos_token_id`` is ``<|end_of_msg|>``.

:func:`build_demo_checkpoint` writes the same layout with random weights (sharded, as the release is) for the tests
and notebooks that need a checkpoint on disk (``kimi-jax demo --random``).
"""

from __future__ import annotations

import json
import os
import pathlib

from kimi_jax.checkpoint.synthetic import write_checkpoint
from kimi_jax.model.config import tiny_k3_config_dict
from kimi_jax.text.tokenizer import NUM_RESERVED_SPECIAL, write_demo_tokenizer

DEMO_MODEL = pathlib.Path(__file__).resolve().parents[1] / "assets" / "k3-demo"


def demo_model_dir() -> str:
    """The shipped demo model's directory (a FileNotFoundError names what is missing from an incomplete install)."""
    need = ("config.json", "model.safetensors", "tiktoken.model", "tokenizer_config.json", "RECIPE.json")
    missing = [f for f in need if not (DEMO_MODEL / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{DEMO_MODEL}: the shipped demo model lacks {missing} (reinstall kimi-jax, or "
                                f"re-create it: python scripts/make_demo_model.py --work DIR --install)")
    return str(DEMO_MODEL)


def demo_recipe() -> dict:
    """How the shipped demo model was made and what it scores (its ``RECIPE.json``)."""
    return json.loads((pathlib.Path(demo_model_dir()) / "RECIPE.json").read_text())


def with_special_ids(c: dict) -> dict:
    """A K3 config dict (in place) with the special ids of its own vocabulary, as the release's config has
    (bos = [BOS], eos = <|end_of_msg|>, pad = [PAD] at the first / third / last special id)."""
    first = c["text_config"]["vocab_size"] - NUM_RESERVED_SPECIAL
    ids = dict(bos_token_id=first, eos_token_id=first + 2, pad_token_id=first + NUM_RESERVED_SPECIAL - 1)
    c.update(ids)
    c["text_config"].update(ids)
    return c


def demo_config() -> dict:
    """tiny_k3_config_dict() with the special ids of its own vocabulary (:func:`with_special_ids`)."""
    return with_special_ids(tiny_k3_config_dict())


def build_demo_checkpoint(path, *, seed: int = 0) -> str:
    """Write the demo checkpoint and tokenizer into ``path`` (an empty or new directory); returns ``path``."""
    path = os.fspath(path)
    config = demo_config()
    write_checkpoint(path, family="k3", config=config, seed=seed)
    write_demo_tokenizer(path, vocab_size=config["text_config"]["vocab_size"])
    return path
