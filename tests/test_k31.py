"""Kimi K3.1: the DSA indexer in every MLA layer -- config, checkpoint layout, the math against the float64 oracle
(``tests/k31_oracle.py``), and K3.1 reducing to K3 while every context fits in top-k."""

from __future__ import annotations

import copy

import pytest

from kimi_jax.cli import main
from kimi_jax.model import config as C


def _tiny(**dsa) -> dict:
    c = C.tiny_k31_config_dict()
    c["text_config"]["dsa_config"].update(dsa)
    return c


# -- config ------------------------------------------------------------------------------------------------------


def test_presets_k31_and_k3():
    ix = C.preset("k3.1").mla.indexer
    assert (ix.num_heads, ix.head_dim, ix.topk, ix.q_lora_rank, ix.hidden) == (32, 128, 2048, 1536, 7168)
    assert ix.norm_eps == 1e-5  # rms_norm_eps: dsa_config declares none
    assert C.preset("k3").mla.indexer is None
    tiny = C.from_dict(C.tiny_k31_config_dict())
    assert tiny.family == "kimi_k3" and tiny.mla.indexer.topk == 16


@pytest.mark.parametrize("spelling", ["flat", "aliases", "top_level"])
def test_dsa_config_spellings(spelling):
    c = C.tiny_k31_config_dict()
    t = c["text_config"]
    dsa = t.pop("dsa_config")
    if spelling == "flat":  # DeepSeek-V3.2's keys in text_config, no layer list
        t.update(index_n_heads=2, index_head_dim=16, index_topk=8, index_norm_eps=1e-6)
    elif spelling == "aliases":  # llama.cpp's GGUF names
        t["dsa_config"] = {"head_count": 2, "key_length": 16, "top_k": 8, "layers": dsa["dsa_layers"],
                           "index_norm_eps": 1e-6}
    else:
        c["dsa_config"] = {**dsa, "index_topk": 8, "index_norm_eps": 1e-6}
    ix = C.from_dict(c).mla.indexer
    assert (ix.num_heads, ix.head_dim, ix.topk, ix.norm_eps) == (2, 16, 8, 1e-6)


def test_dsa_layers_must_be_the_mla_layers():
    with pytest.raises(C.ConfigError, match=r"dsa_config.dsa_layers=\[4, 8\] must equal the full-attention \(MLA\) "
                                            r"layers \[4, 8, 9\].*not indexed \[9\]"):
        C.from_dict(_tiny(dsa_layers=[4, 8]))
    with pytest.raises(C.ConfigError, match=r"not MLA \[3\]"):
        C.from_dict(_tiny(dsa_layers=[3, 4, 8, 9]))


def test_k31_refusals():
    c = C.tiny_k31_config_dict()
    del c["text_config"]["dsa_config"]
    with pytest.raises(C.ConfigError, match="K3.1 architecture needs a DSA indexer"):
        C.from_dict(c)
    with pytest.raises(C.ConfigError, match=r"unknown config key\(s\) \['types'\]"):
        C.from_dict(_tiny(types=["full", "shared", "full"]))
    with pytest.raises(C.ConfigError, match="index_topk=0 must be a positive integer"):
        C.from_dict(_tiny(index_topk=0))
    c = C.tiny_k31_config_dict()
    c["text_config"]["q_lora_rank"] = None
    with pytest.raises(C.ConfigError, match="q_lora_rank is null"):
        C.from_dict(c)
    c = copy.deepcopy(C.tiny_k31_config_dict())
    del c["text_config"]["dsa_config"]["index_head_dim"]
    with pytest.raises(C.ConfigError, match=r"missing \['index_head_dim'\]"):
        C.from_dict(c)


def test_info_shows_the_indexer(capsys):
    assert main(["info", "k3.1"]) == 0
    out = capsys.readouterr().out
    assert "DSA indexer (K3.1) in each of the 24 MLA layers: 32 heads x 128, top-2048 keys per query" in out
    assert "parameters:" in out
