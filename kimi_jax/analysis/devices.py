"""The runtime a notebook runs on and where a model's bytes live: the device list, the speeds of one
:class:`kimi_jax.generation.generate.Generation`, a (data, expert, model) mesh split, bytes per device, how parameters
are sharded, and a per-device memory report (parameters, cache, what the runtime reports).

Everything returns plain Python / numpy values so it can be checked in tests."""

from __future__ import annotations

import math
from typing import Sequence

import jax
from flax import nnx

from kimi_jax.model import params
from kimi_jax.model.config import ModelConfig


def devices() -> list[dict]:
    """One row per device: id, platform, kind and (TPU/GPU) memory in use / limit in bytes (None on CPU)."""
    rows = []
    for d in jax.devices():
        stats = d.memory_stats() or {}
        rows.append({"id": d.id, "platform": d.platform, "kind": d.device_kind,
                     "bytes_in_use": stats.get("bytes_in_use"), "bytes_limit": stats.get("bytes_limit")})
    return rows


def throughput(gen) -> dict:
    """Speeds of one :class:`kimi_jax.generation.generate.Generation`: time to first token (the prefill, which samples the
    first token), prompt tokens/s, and decode tokens/s (tokens after the first, over the decode time)."""
    t = gen.timings
    n_prompt = sum(len(p) for p in gen.prompt_tokens)
    decoded = t["new_tokens"] - len(gen.tokens)  # the first token of each sequence comes from the prefill
    rate = lambda n, s: n / s if s > 0 else float("nan")  # noqa: E731
    return {"time_to_first_token_s": t["prefill"], "prompt_tokens": n_prompt,
            "prefill_tokens_per_s": rate(n_prompt, t["prefill"]), "new_tokens": t["new_tokens"],
            "decode_s": t["decode"], "decode_tokens_per_s": rate(decoded, t["decode"])}


def mesh_sizes(cfg: ModelConfig, n_devices: int) -> dict:
    """A (data, expert, model) split of ``n_devices`` for one replica of ``cfg``: routed experts over as many
    devices as divide their count, the rest tensor-parallel (the sharding rules replicate what does not divide)."""
    expert = math.gcd(n_devices, cfg.moe.num_experts) if cfg.moe is not None else 1
    return {"data": 1, "expert": expert, "model": n_devices // expert}


def _var_arrays(model):
    """(leaf path, array) of every parameter leaf (a packed weight: each field)."""
    yield from params.leaves(nnx.state(model, nnx.Param)).items()


def bytes_per_device(tree) -> dict:
    """Bytes each device holds of a model's parameters or of any pytree of arrays (a cache): summed over the
    addressable shards, so a replicated array counts once per device that holds it. Keys: device ids."""
    arrays = [a for _, a in _var_arrays(tree)] if isinstance(tree, nnx.Module) else jax.tree.leaves(tree)
    out: dict[int, int] = {}
    for a in arrays:
        for s in a.addressable_shards:
            out[s.device.id] = out.get(s.device.id, 0) + s.data.nbytes
    return dict(sorted(out.items()))


def param_bytes(model) -> int:
    """Logical bytes of a model's parameters (each array once, however it is sharded or replicated)."""
    return sum(a.nbytes for _, a in _var_arrays(model))


def shard_table(model, names: Sequence[str] | None = None) -> list[dict]:
    """How the named parameters (leaf paths, e.g. ``layers.1.mlp.experts.w1.packed``) are laid out: global shape,
    partition spec, the shape of one shard and how many distinct shards the devices hold. Default names: the
    embedding, layer 0's first attention weight and the routed-expert arrays of the first MoE layer (packed MXFP4
    bytes and scales, or dense weights, whichever the checkpoint has)."""
    arrays = dict(_var_arrays(model))
    if names is None:
        attn = sorted((k for k in arrays if k.startswith("layers.0.self_attn.")),
                      key=lambda k: (not k.endswith(("q_proj", "q_a_proj")), k))[:1]
        moe = model.cfg.moe_layers
        experts = [k for k in arrays if moe and k.startswith(f"layers.{moe[0]}.mlp.experts.")]
        names = ["embed_tokens", *attn, *experts]
    rows = []
    for name in names:
        if name not in arrays:
            raise KeyError(f"shard_table: no parameter {name!r} (e.g. {sorted(arrays)[:3]})")
        a = arrays[name]
        shards = a.addressable_shards
        spec = getattr(a.sharding, "spec", None)
        rows.append({"parameter": name, "dtype": str(a.dtype), "shape": tuple(a.shape),
                     "spec": "replicated" if spec is None else str(spec), "shard_shape": tuple(shards[0].data.shape),
                     "distinct_shards": len({tuple((i.start, i.stop) for i in s.index) for s in shards})})
    return rows


def memory_report(model, cache=None) -> list[dict]:
    """Per device: parameter bytes, cache bytes, and what the runtime reports in use / as the limit (TPU and GPU;
    None on CPU, whose runtime keeps no such statistics)."""
    params = bytes_per_device(model)
    cached = bytes_per_device(cache) if cache is not None else {}
    rows = []
    for d in devices():
        rows.append({"device": f"{d['platform']}:{d['id']}", "params_bytes": params.get(d["id"], 0),
                     "cache_bytes": cached.get(d["id"], 0), "bytes_in_use": d["bytes_in_use"],
                     "bytes_limit": d["bytes_limit"]})
    return rows
