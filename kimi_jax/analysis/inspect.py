"""Analysis helpers behind the notebooks: what a model routes, mixes and remembers, what its cache costs, where
its bytes live, and the deployment plan as rows and charts. Notebooks call these; they define no logic.

Everything returns plain numpy / dicts so it can be checked in tests. The ``plot_*`` functions draw into a new
matplotlib figure with a title, axis labels and units, and return it; matplotlib is imported only there (it is
the ``notebooks`` extra, not a runtime dependency).

Notes on what is measured:

* Expert utilisation counts (token, expert) assignments of the router over *valid* tokens only (right padding
  excluded), ``top_k`` per token per MoE layer.
* AttnRes weights: every AttnRes mix is a softmax over depth sources -- the sealed blocks (block 0 is the token
  embedding, block j the sum of block j's sublayer outputs) and the running partial sum of the current block.
  Layer 0 has no attention-side mix (nothing to mix yet), so K3 has ``2 L`` mixes (``L - 1`` attention, ``L`` MLP,
  one output).
* KDA state norms: the Frobenius norm of each KDA layer's recurrent state ``[H, K, V]`` after every chunk of a
  continued prefill (``prefix=True`` over one static cache).
* Cache bytes: :func:`kimi_jax.model.cache.cache_bytes` (shapes only) and, where it fits, the ``nbytes`` of the arrays
  :func:`kimi_jax.model.cache.init_cache` really allocates.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kimi_jax.model.cache import KDACache, cache_bytes, init_cache
from kimi_jax.model.config import ModelConfig

GB = 1e9
GIB = 1 << 30
COLAB_URL = "https://colab.research.google.com/github/kimi-jax/kimi-jax/blob/main/notebooks/{name}"


# -- runtime ---------------------------------------------------------------------------------------------------


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
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        yield ".".join(str(p) for p in path), var.get_value()


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
    """How the named parameters (dotted paths, e.g. ``layers.1.mlp.experts.w1_packed``) are laid out: global shape,
    partition spec, the shape of one shard and how many distinct shards the devices hold. Default names: the
    embedding, layer 0's first attention weight and the routed-expert arrays of the first MoE layer (packed MXFP4
    bytes and scales, or dense weights, whichever the checkpoint has)."""
    arrays = dict(_var_arrays(model))
    if names is None:
        attn = sorted((k for k in arrays if k.startswith("layers.0.self_attn.")),
                      key=lambda k: (not k.endswith(("q_proj", "q_a_proj")), k))[:1]
        moe = moe_layers(model.cfg)
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


def markdown_table(rows: Sequence[Mapping], columns: Mapping[str, str] | None = None, *, floatfmt: str = ".2f") -> str:
    """A GitHub-markdown table of ``rows`` (dicts). ``columns``: key -> header (default: the keys of row 0)."""
    if not rows:
        raise ValueError("markdown_table: no rows")
    columns = columns or {k: k for k in rows[0]}

    def cell(v):
        if v is None:
            return "-"
        if isinstance(v, bool):
            return "yes" if v else "no"
        if isinstance(v, (float, np.floating)):
            return format(float(v), floatfmt)
        return str(v)

    lines = ["| " + " | ".join(columns.values()) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(k)) for k in columns) + " |" for r in rows]
    return "\n".join(lines)


# -- partial downloads ---------------------------------------------------------------------------------------

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
    from huggingface_hub import hf_hub_download, snapshot_download

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


# -- inside the model ------------------------------------------------------------------------------------------


def pad_prompts(prompts: Sequence[Sequence[int]], multiple: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token-id lists into ``ids [B, T] int32`` (T rounded up to ``multiple``: fewer compiles) and
    ``lengths [B] int32``."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("pad_prompts: give at least one prompt, none of them empty")
    T = -(-max(len(p) for p in prompts) // multiple) * multiple
    ids = np.zeros((len(prompts), T), np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    return ids, np.asarray([len(p) for p in prompts], np.int32)


@dataclasses.dataclass
class Probe:
    """What one forward pass reports besides logits, on the host.

    ``router``: per MoE layer (idx [B, T, X] int32, weights [B, T, X] float32); ``attn_res``: per AttnRes mix
    [n_sources, B, T] float32 (empty for models without AttnRes); ``lengths`` [B]: valid tokens per row."""

    router: list[tuple[np.ndarray, np.ndarray]]
    attn_res: list[np.ndarray]
    lengths: np.ndarray

    @property
    def valid(self) -> np.ndarray:
        """[B, T] bool: the positions holding prompt tokens."""
        T = self.router[0][0].shape[1] if self.router else self.attn_res[0].shape[-1]
        return np.arange(T)[None] < self.lengths[:, None]


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _probe(graphdef, params, ids_BT, lengths_B):
    out = nnx.merge(graphdef, params)(ids_BT, lengths=lengths_B, last_only=True, return_router=True,
                                       return_attn_res=True)
    return out.router, out.attn_res_weights


def probe(model, ids_BT, lengths_B=None) -> Probe:
    """One jitted forward pass of right-padded prompts (``ids [B, T]``, ``lengths [B]``, default all T) returning
    the router choices of every MoE layer and the weights of every AttnRes mix."""
    ids = np.asarray(ids_BT, np.int32)
    if ids.ndim != 2:
        raise ValueError(f"probe: ids must be [B, T], got shape {ids.shape}")
    lengths = np.full((ids.shape[0],), ids.shape[1], np.int32) if lengths_B is None else np.asarray(lengths_B, np.int32)
    if lengths.shape != (ids.shape[0],) or lengths.min() < 1 or lengths.max() > ids.shape[1]:
        raise ValueError(f"probe: lengths {lengths.tolist()} must be one value in 1..{ids.shape[1]} per row")
    graphdef, params = nnx.split(model)
    router, weights = _probe(graphdef, params, ids, lengths)
    router = [(np.asarray(i), np.asarray(w)) for i, w in router]
    return Probe(router, [np.asarray(w) for w in (weights or ())], lengths)


def moe_layers(cfg: ModelConfig) -> list[int]:
    """Indices of the MoE layers (the order of ``ModelOutput.router``)."""
    return [i for i, kind in enumerate(cfg.ffn_types) if kind == "moe"]


def expert_counts(p: Probe, num_experts: int) -> np.ndarray:
    """[n_moe_layers, E] int64: how many valid tokens chose each expert, per MoE layer (each token counts top_k
    times per layer)."""
    valid = p.valid
    return np.stack([np.bincount(idx[valid].reshape(-1), minlength=num_experts) for idx, _ in p.router]).astype(np.int64)


def load_stats(counts: np.ndarray) -> dict:
    """Per layer: max load / mean load (1 = perfectly balanced; what sets the step time of expert parallelism),
    and the number of experts no token chose."""
    mean = counts.mean(axis=1)
    return {"max_over_mean": counts.max(axis=1) / np.where(mean > 0, mean, np.nan),
            "unused_experts": (counts == 0).sum(axis=1)}


def attn_res_layout(cfg: ModelConfig) -> tuple[list[str], list[int]]:
    """Names of the AttnRes mixes in the order the model reports them and their number of sources (sealed blocks
    + the running partial sum), following the block schedule of K3_SPEC §4.2."""
    if not cfg.attn_res:
        return [], []
    names, sizes, blocks = [], [], 0
    for i in range(cfg.num_layers):
        if blocks:  # the attention-side mix needs something to mix with
            names.append(f"layer {i} attn")
            sizes.append(blocks + 1)
        if i % cfg.attn_res_block_size == 0:
            blocks += 1  # the layer input is sealed as a block; the partial sum restarts
        names.append(f"layer {i} mlp")
        sizes.append(blocks + 1)
    names.append("output")
    sizes.append(blocks + 1)
    return names, sizes


@dataclasses.dataclass
class AttnResTable:
    """Mean AttnRes weight of each source, per mix. ``weights [n_mixes, n_blocks + 1]``: columns are block 0 (the
    embedding), blocks 1..n-1, then the running partial sum (last column); NaN where a mix has no such source."""

    weights: np.ndarray
    mixes: list[str]
    sources: list[str]


def attn_res_table(cfg: ModelConfig, p: Probe) -> AttnResTable:
    """Average every mix's weights over the valid tokens of ``p``, aligned by source (see :class:`AttnResTable`)."""
    names, sizes = attn_res_layout(cfg)
    if len(p.attn_res) != len(names):
        raise ValueError(f"the model reported {len(p.attn_res)} AttnRes mixes, the block schedule of {cfg.family} "
                         f"(block size {cfg.attn_res_block_size}, {cfg.num_layers} layers) has {len(names)}")
    n_blocks = max(sizes) - 1
    table = np.full((len(names), n_blocks + 1), np.nan)
    valid = p.valid
    for r, (w, n) in enumerate(zip(p.attn_res, sizes)):
        if w.shape[0] != n:
            raise ValueError(f"AttnRes mix {names[r]!r}: {w.shape[0]} sources, expected {n}")
        mean = w[:, valid].mean(axis=1)  # [n]
        table[r, : n - 1] = mean[:-1]
        table[r, -1] = mean[-1]
    sources = ["embedding"] + [f"block {j}" for j in range(1, n_blocks)] + ["partial sum"]
    return AttnResTable(table, names, sources)


def kda_layers(cfg: ModelConfig) -> list[int]:
    return [i for i, kind in enumerate(cfg.attn_types) if kind == "kda"]


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _continue(graphdef, params, cache, ids_BT):
    out = nnx.merge(graphdef, params)(ids_BT, cache=cache, prefix=True, last_only=True)
    norms = [jnp.sqrt(jnp.sum(jnp.square(layer.state), axis=(1, 2, 3)))
             for layer in out.cache.layers if isinstance(layer, KDACache)]
    return out.cache, jnp.stack(norms, axis=-1)  # [B, n_kda]


@dataclasses.dataclass
class StateNorms:
    """``norms [n_chunks, B, n_kda]``: Frobenius norm of each KDA layer's state ``[H, K, V]`` after each chunk;
    ``positions [n_chunks]``: tokens consumed by then; ``layers``: the KDA layer indices."""

    positions: np.ndarray
    norms: np.ndarray
    layers: list[int]


def kda_state_norms(model, ids_BT, chunk: int) -> StateNorms:
    """Feed ``ids [B, T]`` through the model ``chunk`` tokens at a time as a continued prefill (``prefix=True``,
    one static cache of length T, one compile) and record every KDA layer's state norm after each chunk."""
    ids = np.asarray(ids_BT, np.int32)
    B, T = ids.shape
    if chunk < 1 or T % chunk:
        raise ValueError(f"kda_state_norms: chunk {chunk} must divide the sequence length {T}")
    layers = kda_layers(model.cfg)
    if not layers:
        raise ValueError(f"kda_state_norms: {model.cfg.family} has no KDA layers")
    graphdef, params = nnx.split(model)
    cache = init_cache(model.cfg, B, T, model.run.dtype)
    norms = []
    for start in range(0, T, chunk):
        cache, n = _continue(graphdef, params, cache, ids[:, start : start + chunk])
        norms.append(np.asarray(n))
    return StateNorms(np.arange(chunk, T + 1, chunk), np.stack(norms), layers)


# -- cache memory ----------------------------------------------------------------------------------------------


def all_mla(cfg: ModelConfig) -> ModelConfig:
    """The same model with every layer full attention (MLA): the hypothetical K3 without linear attention."""
    if cfg.mla is None:
        raise ValueError(f"all_mla: {cfg.family} has no MLA config")
    return cfg.replace(attn_types=("mla",) * cfg.num_layers)


def cache_curve(cfg: ModelConfig, contexts: Sequence[int], *, batch: int = 1, dtype=jnp.bfloat16) -> dict:
    """Cache bytes vs context length from :func:`kimi_jax.model.cache.cache_bytes`: {kind: [len(contexts)] int64} with
    kinds kda_state, kda_conv, mla, kv, total."""
    rows = [cache_bytes(cfg, batch, int(n), dtype) for n in contexts]
    return {k: np.asarray([r[k] for r in rows], np.int64) for k in rows[0]}


def measured_cache_bytes(cfg: ModelConfig, context: int, *, batch: int = 1, dtype=jnp.bfloat16) -> int:
    """Allocate the cache with :func:`kimi_jax.model.cache.init_cache`, sum the ``nbytes`` of its arrays (the per-sequence
    ``lengths`` excluded, as in ``cache_bytes``), free it."""
    cache = init_cache(cfg, batch, int(context), dtype)
    jax.block_until_ready(cache)
    total = sum(a.nbytes for a in jax.tree.leaves(cache.layers))
    for a in jax.tree.leaves(cache):
        a.delete()
    return int(total)


def crossover_context(cfg: ModelConfig, *, batch: int = 1, dtype=jnp.bfloat16) -> int | None:
    """The context length (tokens) from which the MLA latent cache outweighs the KDA state; None if the model
    lacks either."""
    one = cache_bytes(cfg, batch, 1, dtype)
    per_token = one["mla"] + one["kv"]
    if not one["kda_state"] or not per_token:
        return None
    return math.ceil(one["kda_state"] / per_token)


# -- deployment planning ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Deployment:
    name: str  # e.g. "2 x 8 H200"
    chip: str  # a key of kimi_jax.parallel.plan.CHIPS
    sizes: tuple  # ((axis, n), ...) over data / expert / model
    layout: str = "tp_ep"

    @property
    def chips(self) -> int:
        return math.prod(n for _, n in self.sizes)


# Common K3 deployments: H200 nodes of 8 GPUs, TPU v5p and v7x pod slices (chip counts; a v5p chip has two
# TensorCores, so "v5p-64" is 32 chips). Tensor parallelism stays within 8 chips (one NVLink node / a torus
# dimension); expert parallelism spans the rest. "wide EP" spreads experts over every chip, as SGLang's TP16/EP16.
DEPLOYMENTS = (
    Deployment("1 x 8 H200", "h200", (("expert", 1), ("model", 8))),
    Deployment("2 x 8 H200", "h200", (("expert", 2), ("model", 8))),
    Deployment("2 x 8 H200, wide EP", "h200", (("expert", 1), ("model", 16)), "wide_ep"),
    Deployment("4 x 8 H200", "h200", (("expert", 4), ("model", 8))),
    Deployment("TPU v5p, 32 chips", "v5p", (("expert", 4), ("model", 8))),
    Deployment("TPU v5p, 64 chips", "v5p", (("expert", 8), ("model", 8))),
    Deployment("TPU v5p, 128 chips", "v5p", (("expert", 16), ("model", 8))),
    Deployment("TPU v7x, 16 chips", "v7x", (("expert", 2), ("model", 8))),
    Deployment("TPU v7x, 32 chips", "v7x", (("expert", 4), ("model", 8))),
    Deployment("TPU v7x, 64 chips", "v7x", (("expert", 8), ("model", 8))),
)


def plan_rows(cfg: ModelConfig, deployments: Sequence[Deployment] = DEPLOYMENTS, *, batch: int, context: int,
              dtype="bfloat16", reserve: float = 0.1) -> list[dict]:
    """One :func:`kimi_jax.parallel.plan.make_plan` per deployment, as table rows (bytes per chip, roofline decode)."""
    from kimi_jax.parallel import plan

    rows = []
    for d in deployments:
        chip = plan.CHIPS[d.chip]
        p = plan.make_plan(cfg, dict(d.sizes), d.layout, batch=batch, context=context, dtype=dtype, model_name=d.name)
        step = p.step_seconds(chip.hbm_bandwidth)
        rows.append({
            "deployment": d.name, "chip": chip.name, "chips": p.chips,
            "mesh": " ".join(f"{a}={n}" for a, n in d.sizes), "layout": d.layout,
            "params_gb": p.param_total / GB, "cache_gb": p.cache_total / GB, "activations_gb": p.activation_total / GB,
            "total_gb": p.total / GB, "hbm_gb": chip.hbm_bytes / GB, "fits": p.fits(chip, reserve),
            "step_ms": step * 1e3, "tokens_per_s": batch / step, "tokens_per_s_per_seq": 1 / step,
            "notes": "; ".join(p.notes),
        })
    return rows


def roofline_vs_batch(cfg: ModelConfig, deployment: Deployment, batches: Sequence[int], *, context: int,
                      dtype="bfloat16") -> dict:
    """Roofline decode throughput of one deployment at several batch sizes: {batch, step_ms, tokens_per_s,
    total_gb, fits} arrays (memory per chip grows with the batch's caches; ``fits``: within 90% of HBM)."""
    from kimi_jax.parallel import plan

    chip = plan.CHIPS[deployment.chip]
    out = {"batch": [], "step_ms": [], "tokens_per_s": [], "total_gb": [], "fits": []}
    for b in batches:
        p = plan.make_plan(cfg, dict(deployment.sizes), deployment.layout, batch=int(b), context=context, dtype=dtype)
        step = p.step_seconds(chip.hbm_bandwidth)
        out["batch"].append(int(b))
        out["step_ms"].append(step * 1e3)
        out["tokens_per_s"].append(b / step)
        out["total_gb"].append(p.total / GB)
        out["fits"].append(p.fits(chip))
    return {k: np.asarray(v) for k, v in out.items()}


# -- figures ---------------------------------------------------------------------------------------------------


def _tokens(n: int) -> str:
    n = int(n)
    return f"{n >> 20}M" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10}K" if n % 1024 == 0 else str(n)


def _plt():
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - the notebooks extra installs it
        raise ImportError("the plot_* helpers need matplotlib: pip install 'kimi-jax[notebooks]'") from e
    return plt


def plot_expert_load(counts: np.ndarray, layers: Sequence[int], *, tokens: int | None = None):
    """Heatmap of each MoE layer's share of routed assignments per expert (percent), next to each layer's max/mean
    load."""
    plt = _plt()
    share = 100.0 * counts / counts.sum(axis=1, keepdims=True)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 0.45 * len(layers) + 2.2), width_ratios=(3, 1),
                                 layout="constrained")
    im = ax.imshow(share, aspect="auto", cmap="viridis")
    ax.set_yticks(range(len(layers)), [str(i) for i in layers])
    ax.set_xlabel("routed expert (index)")
    ax.set_ylabel("MoE layer (index)")
    uniform = 100.0 / counts.shape[1]
    ax.set_title(f"Expert utilisation{f' over {tokens} tokens' if tokens else ''} (uniform = {uniform:.1f}%)")
    cb = fig.colorbar(im, ax=ax)
    cb.set_label("share of the layer's routed assignments (%)")
    stats = load_stats(counts)
    bx.barh(range(len(layers)), stats["max_over_mean"], color="tab:orange")
    bx.axvline(1.0, color="k", lw=1, ls="--")
    bx.set_yticks(range(len(layers)), [str(i) for i in layers])
    bx.invert_yaxis()
    bx.set_xlabel("max load / mean load (ratio)")
    bx.set_ylabel("MoE layer (index)")
    bx.set_title("Load imbalance (1 = balanced)")
    return fig


def plot_attn_res(table: AttnResTable):
    """Heatmap of mean AttnRes weights: one row per mix (sublayer input), one column per depth source."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(1.3 * len(table.sources) + 3, 0.3 * len(table.mixes) + 1.8), layout="constrained")
    im = ax.imshow(np.ma.masked_invalid(table.weights), aspect="auto", cmap="magma", vmin=0, vmax=1)
    ax.set_xticks(range(len(table.sources)), table.sources)
    ax.set_yticks(range(len(table.mixes)), table.mixes)
    ax.set_xlabel("depth source (sealed blocks, then the current block's partial sum)")
    ax.set_ylabel("AttnRes mix (sublayer input)")
    ax.set_title("Block Attention Residuals: mean depth-attention weight per source")
    for r in range(table.weights.shape[0]):
        for c in range(table.weights.shape[1]):
            v = table.weights[r, c]
            if np.isfinite(v):
                ax.text(c, r, f"{v:.2f}", ha="center", va="center", fontsize=7, color="w" if v < 0.6 else "k")
    cb = fig.colorbar(im, ax=ax)
    cb.set_label("softmax weight (fraction, mean over tokens)")
    return fig


def plot_state_norms(s: StateNorms):
    """KDA state norm (mean over the batch) of each KDA layer against the number of tokens consumed."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    mean = s.norms.mean(axis=1)
    for j, layer in enumerate(s.layers):
        ax.plot(s.positions, mean[:, j], marker="o", ms=3, label=f"KDA layer {layer}")
    ax.set_xlabel("tokens consumed (position)")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("state norm ||S||_F (dimensionless)")
    ax.set_title("KDA recurrent state size over a long sequence (fixed memory, bounded norm)")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(alpha=0.3)
    return fig


def plot_cache_curve(contexts: Sequence[int], curves: Mapping[str, np.ndarray], *, measured: Sequence = (),
                     crossover: int | None = None):
    """Cache bytes per sequence (GB, log scale) vs context (tokens, log scale), one line per configuration;
    ``measured``: (name, context, bytes) points from real allocations, drawn as markers."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8.5, 5), layout="constrained")
    colors = {}
    for name, total in curves.items():
        (line,) = ax.plot(contexts, np.asarray(total) / GB, marker=".", label=name)
        colors[name] = line.get_color()
    for i, (name, n, b) in enumerate(measured):
        ax.plot([n], [b / GB], "x", ms=10, mew=2, color=colors.get(name, "k"),
                label="measured (init_cache nbytes)" if i == 0 else None)
    if crossover:
        ax.axvline(crossover, color="gray", ls=":", lw=1)
        ax.annotate(f"K3: MLA cache > KDA state\nfrom {crossover:,} tokens", (crossover, ax.get_ylim()[1]),
                    xytext=(5, -30), textcoords="offset points", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(list(contexts), [_tokens(n) for n in contexts])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("cache per sequence (GB)")
    ax.set_title("Decode cache per sequence vs context length (bf16 cache, fp32 KDA state)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return fig


def plot_plan_memory(rows: Sequence[Mapping]):
    """Stacked per-chip bytes (parameters, cache, activations) of each deployment against its chip's HBM."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(rows) + 2), layout="constrained")
    y = np.arange(len(rows))
    left = np.zeros(len(rows))
    for key, label, color in (("params_gb", "parameters", "tab:blue"), ("cache_gb", "cache", "tab:orange"),
                              ("activations_gb", "activations", "tab:green")):
        v = np.asarray([r[key] for r in rows])
        ax.barh(y, v, left=left, label=label, color=color)
        left += v
    ax.scatter([r["hbm_gb"] for r in rows], y, marker="|", s=400, color="k", label="HBM per chip", zorder=3)
    ax.set_yticks(y, [f"{r['deployment']}{'' if r['fits'] else '  (does not fit)'}" for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("bytes per chip (GB)")
    ax.set_ylabel("deployment (GPU nodes or TPU chips)")
    ax.set_title("K3 memory per chip by deployment")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3, axis="x")
    return fig


def plot_roofline(curves: Mapping[str, Mapping], *, context: int | None = None):
    """Roofline decode throughput (tokens/s, all sequences) vs batch, one line per deployment; batches that do not
    fit in HBM are drawn hollow."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    batches = set()
    for name, c in curves.items():
        (line,) = ax.plot(c["batch"], c["tokens_per_s"], label=name)
        fits = np.asarray(c.get("fits", np.ones(len(c["batch"]), bool)), bool)
        ax.plot(c["batch"][fits], c["tokens_per_s"][fits], "o", color=line.get_color())
        ax.plot(c["batch"][~fits], c["tokens_per_s"][~fits], "o", mfc="none", color=line.get_color())
        batches.update(int(b) for b in c["batch"])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sorted(batches), [str(b) for b in sorted(batches)])
    ax.set_xlabel("concurrent sequences (batch)")
    ax.set_ylabel("decode throughput, roofline (tokens/s)")
    where = f", {context:,} tokens each" if context else ""
    ax.set_title(f"K3 decode roofline (HBM bandwidth bound{where}; hollow = does not fit)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return fig
