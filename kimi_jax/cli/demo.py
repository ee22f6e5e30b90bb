"""The embedded defaults: the trained demo model shipped in the package, and a random tiny Kimi K3 written on demand.

``kimi_jax/assets/k3-demo`` (:func:`demo_model_dir`, what ``kimi-jax demo`` runs) is a small Kimi K3 trained here on
Python's own documentation (``scripts/make_demo_model.py`` re-creates it; its ``RECIPE.json`` says how and what its
held-out loss is; its location lives in :mod:`kimi_jax.model.config`, below every reader of model directories, so
that ``"demo"`` names it for every command and for ``from_pretrained``), stored in the released format: ``model.safetensors`` with the ``language_model.`` prefix and
MXFP4-packed routed experts, ``tiktoken.model`` + ``tokenizer_config.json`` with the 256 specials at the top of the
vocabulary, ``config.json`` whose ``eos_token_id`` is ``<|end_of_msg|>``.

:func:`build_demo_checkpoint` writes the same layout with random weights (sharded, as the release is) for the tests
and notebooks that need a checkpoint on disk (``kimi-jax demo --random``).
"""

from __future__ import annotations

import json
import os
import pathlib

from kimi_jax.checkpoint.synthetic import with_special_ids, write_checkpoint  # with_special_ids: re-exported
from kimi_jax.model.config import DEMO_MODEL, demo_model_dir, tiny_k3_config_dict  # noqa: F401 (re-exported)


def demo_recipe() -> dict:
    """How the shipped demo model was made and what it scores (its ``RECIPE.json``)."""
    return json.loads((pathlib.Path(demo_model_dir()) / "RECIPE.json").read_text())


def demo_config() -> dict:
    """tiny_k3_config_dict() with the special ids of its own vocabulary (:func:`with_special_ids`)."""
    return with_special_ids(tiny_k3_config_dict())


def build_demo_checkpoint(path, *, seed: int = 0) -> str:
    """Write the demo checkpoint and tokenizer into ``path`` (an empty or new directory); returns ``path``."""
    return write_checkpoint(os.fspath(path), family="k3", config=tiny_k3_config_dict(), seed=seed, tokenizer=True)
