"""Partial downloads from the Hugging Face Hub: the shard files of a checkpoint's index that hold its first layers
(:func:`layer_subset`), and a download of only those shards plus the config and tokenizer files, with an index
restricted to them (:func:`hub_download_layers`, which needs ``huggingface_hub`` and network access)."""

from __future__ import annotations

import json
import os
import re
from typing import Mapping

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_NOT_TEXT = re.compile(r"(vision_tower|mm_projector)\.")  # the release's vision tower: never loaded
INDEX = "model.safetensors.index.json"
_HUB_FILES = ("config.json", "generation_config.json", "tiktoken.model", "tokenizer_config.json", "tokenizer.json",
              "special_tokens_map.json", "chat_template.jinja")


def layer_subset(weight_map: Mapping[str, str], layers: int) -> tuple[list[str], dict]:
    """The shard files holding every text tensor of the first ``layers`` layers and every tensor outside the layers
    (embedding, final norm, output head), and the index ``weight_map`` restricted to those files (tensors of later
    layers that share them stay listed: ``kimi-jax convert --layers`` skips them)."""
    if layers < 1:
        raise ValueError(f"layer_subset: layers must be >= 1, got {layers}")
    files = set()
    for name, fname in weight_map.items():
        m = _LAYER.search(name)
        if _NOT_TEXT.match(name) or (m and int(m.group(1)) >= layers):
            continue
        files.add(fname)
    return sorted(files), {n: f for n, f in weight_map.items() if f in files}


def hub_download_layers(repo_id: str, local_dir, layers: int, *, revision: str | None = None) -> list[str]:
    """Download from the Hugging Face Hub only the shards :func:`layer_subset` needs for the first ``layers`` layers,
    plus config and tokenizer files, and write an index listing only those shards (so the checkpoint validates and
    converts with ``--layers``). Needs ``huggingface_hub`` and network access. Returns the shard names."""
    from huggingface_hub import hf_hub_download, snapshot_download  # optional (the notebooks extra): downloads only

    local_dir = os.fspath(local_dir)
    with open(hf_hub_download(repo_id, INDEX, revision=revision, local_dir=local_dir)) as f:
        index = json.load(f)
    files, weight_map = layer_subset(index["weight_map"], layers)
    snapshot_download(repo_id, revision=revision, local_dir=local_dir, allow_patterns=[*files, *_HUB_FILES])
    index = {"metadata": {**index.get("metadata", {}), "subset_of": repo_id, "subset_layers": layers},
             "weight_map": weight_map}
    with open(os.path.join(local_dir, INDEX), "w") as f:
        json.dump(index, f, indent=2)
    return files
