"""Deployment plan: per-chip bytes of a model on a mesh, a roofline decode step time, and which chips it fits.

Everything is computed from the abstract model (exact parameter shapes and dtypes, MXFP4 experts as packed
bytes) and the partition specs of :mod:`kimi_jax.parallel.sharding`, so the plan and the sharded program agree by
construction on parameters and caches. Activations are an estimate of the largest temporaries of one step
(named below, per kernel family); ``benchmarks/plan_vs_compiler.py`` checks the whole against XLA's own
per-device memory analysis of the compiled decode step.

Roofline: a decode step reads every local non-expert weight, the local share of the experts the batch routes
to (expected count under uniform routing), and the caches (KDA state read and written, MLA/KV cache read over
the whole context); time = bytes / HBM bandwidth. Collectives and compute are not modelled.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from kernels_pallas import packed
from kimi_jax.deploy.compile import compile_step
from kimi_jax.model import dspark, params
from kimi_jax.model.cache import MLACache, cache_shapes, paged_cache_shapes
from kimi_jax.model.config import ModelConfig
from kimi_jax.model.decoder import abstract_model
from kimi_jax.model.quantize import quantize as quantize_model
from kimi_jax.model.run import RunConfig
from kimi_jax.parallel import sharding

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    hbm_bytes: float
    hbm_bandwidth: float  # bytes/s


# Vendor datasheet figures (decimal GB, TB/s).
CHIPS = {
    "h100": Chip("NVIDIA H100 SXM", 80e9, 3.35e12),
    "h200": Chip("NVIDIA H200", 141e9, 4.8e12),
    "b200": Chip("NVIDIA B200", 180e9, 8.0e12),
    "v5p": Chip("TPU v5p", 95e9, 2.765e12),
    "v6e": Chip("TPU v6e", 32e9, 1.64e12),
    "v7x": Chip("TPU v7x", 192e9, 7.37e12),
}


@dataclasses.dataclass
class Plan:
    model: str
    sizes: dict
    layout: str
    batch: int
    context: int
    dtype: str
    kernels: str
    params: dict  # category -> bytes per chip
    cache: dict  # kda_state, kda_conv, mla, kv -> bytes per chip
    activations: dict  # name -> bytes per chip (decode step)
    step_read: dict  # name -> bytes read per decode step per chip
    prefill_activations: dict
    notes: list
    kv_cache: str | None = None  # the cache's storage options (kimi_jax.model.cache)
    kda_state: str = "float32"
    local_experts: int = 0  # routed experts one chip holds per MoE layer
    expert_dtypes: tuple = ()  # the distinct dtypes of the routed-expert weights' leaves (a packed weight: its fields)
    drafter: dict = dataclasses.field(default_factory=dict)  # a DSpark drafter's weights and context cache per chip

    @property
    def chips(self) -> int:
        return math.prod(self.sizes.values())

    @property
    def param_total(self) -> int:
        return sum(self.params.values())

    @property
    def cache_total(self) -> int:
        return sum(self.cache.values())

    @property
    def activation_total(self) -> int:
        return sum(self.activations.values())

    @property
    def drafter_total(self) -> int:
        return sum(self.drafter.values())

    @property
    def total(self) -> int:
        return self.param_total + self.cache_total + self.drafter_total + self.activation_total

    def step_seconds(self, bandwidth: float) -> float:
        return sum(self.step_read.values()) / bandwidth

    def fits(self, chip: Chip, reserve: float = 0.1) -> bool:
        return self.total <= chip.hbm_bytes * (1 - reserve)


_PACKED_FIELDS = frozenset(f for t in packed.TYPES for f in t._fields)


def _category(path: str) -> str:
    """The plan's category of one parameter leaf; a packed weight's field (``lm_head.packed``, ``...up_proj.scale``)
    counts as its weight."""
    head, _, last = path.rpartition(".")
    if head and last in _PACKED_FIELDS:
        path = head
    if ".experts." in path:
        return "routed experts"
    if ".self_attn." in path:
        return "attention"
    if ".shared_experts." in path or (".mlp." in path
                                      and path.rsplit(".", 1)[-1] in ("gate_proj", "up_proj", "down_proj")):
        return "dense + shared MLP"
    if ".mlp." in path:
        return "router + latent proj"
    if path in ("embed_tokens", "lm_head"):
        return "embedding + lm_head"
    return "norms + AttnRes"


def _spec_axes(part):
    return () if part is None else ((part,) if isinstance(part, str) else tuple(part))


def make_plan(cfg: ModelConfig, sizes: dict, layout="tp_ep", *, batch: int, context: int, dtype="bfloat16",
              kernels: str = "pallas", prefill_chunk: int = 0, model_name: str = "",
              quantize: str | None = None, kv_cache: str | None = None, kda_state=None, serve=None,
              drafter=None) -> Plan:
    """Per-chip bytes for ``cfg`` on a mesh of ``sizes`` (``{"data","expert","model"}``) under ``layout``.

    ``serve``: the serving engine's shapes (:class:`kimi_jax.serving.stepplan.Shapes`) instead of a generation
    batch: the paged cache of its slots and pool, a decode step over every slot reading a whole page table, and
    prefill chunks of one sequence (``batch``, ``context`` and ``prefill_chunk`` are then its slots, max_len and
    chunk).

    ``kernels``: ``"pallas"`` (TPU/GPU kernels decode MXFP4 and read caches per tile: no workspace) or
    ``"reference"`` (the jnp kernels, what CPU runs: one layer's local experts dequantized, the MLA latent cache
    of one layer upcast to float32). ``quantize``: the weight-only format of :func:`kimi_jax.model.quantize.quantize`
    (its default module classes), so parameters count their packed fields. ``kv_cache`` / ``kda_state``: the
    cache's storage options (:func:`kimi_jax.model.cache.cache_shapes`): int8 rows count codes and scales.
    ``drafter``: a DSpark drafter's :class:`~kimi_jax.model.dspark.DSparkConfig`: its weights (in ``dtype``) and
    its context cache for ``batch`` x ``context`` positions, split over the mesh as ``generate`` places them
    (:func:`drafter_bytes`).
    """
    if kernels not in ("pallas", "reference"):
        raise ValueError(f"kernels={kernels!r}: choose pallas or reference")
    lay = sharding.layout(layout)
    sizes = {a: int(sizes.get(a, 1)) for a in sharding.MESH_AXES}
    dt = jnp.dtype(dtype)
    model, table = _abstract(cfg, dt.name, quantize)
    specs = sharding.param_specs(model, sizes, lay, table=table)
    params, weights_read, expert_local = _param_bytes(table, specs, sizes)
    cache_options = dict(kv_cache=kv_cache, kda_state=kda_state)
    if serve is not None:
        batch, context, prefill_chunk = serve.slots, serve.max_len, serve.chunk
    cache, b_loc, notes, mla_positions = _cache_bytes(cfg, batch, context, dt, sizes, lay, cache_options, serve)
    act = _decode_activations(cfg, model, specs, sizes, lay, batch, b_loc, mla_positions, dt, kernels,
                              bool(expert_local))
    read = {"weights (non-expert)": weights_read, "embedding rows": b_loc * cfg.hidden_size * dt.itemsize}
    if expert_local:
        moe = cfg.moe
        group_tokens = batch // sizes["data"] if batch % sizes["data"] == 0 else batch
        p_used = 1 - (1 - moe.top_k / moe.num_experts) ** group_tokens  # expected share of local experts used
        read["routed experts (used)"] = int(sum(tot * p_used for tot in expert_local.values()))
    read["KDA state (read + write)"] = 2 * (cache["kda_state"] + cache["kda_conv"])
    read["MLA / KV cache"] = _mla_read(cfg, cache["mla"], context, dt, cache_options) + cache["kv"]
    seqs, seqs_loc = (1, 1) if serve is not None else (batch, b_loc)  # the engine prefills one sequence at a time
    prefill = (_prefill_activations(cfg, sizes, lay, specs, model, seqs, seqs_loc, prefill_chunk, dt)
               if prefill_chunk else {})
    state = jnp.dtype(jnp.float32 if kda_state is None else kda_state).name
    e_loc = _local_experts(model, specs, sizes)[1] if expert_local else 0
    e_dtypes = tuple(dict.fromkeys(a.dtype for m in table for n, a in m.arrays.items()
                                   if _category(m.prefix + n) == "routed experts"))
    return Plan(model_name or cfg.family, sizes, lay.name, batch, context, dt.name, kernels, params, cache, act, read,
                prefill, notes, kv_cache, state, e_loc, e_dtypes,
                {} if drafter is None else drafter_bytes(drafter, batch, context, dt.name, sizes, lay, serve=serve))


def _mla_read(cfg, mla_bytes: int, context: int, dt, cache_options) -> int:
    """Bytes of the MLA cache (``mla_bytes``: latent, decoupled key part and K3.1's indexer keys) a decode step
    reads: all of it, or with K3.1's indexer every indexer key but only ``topk`` of the ``context`` latent rows (the
    indexer key's share of a cached token's bytes, as ``cache_options`` store them: int8 keys beside a bf16 latent
    under ``kv_cache="int8-index"``)."""
    if cfg.indexer is None:
        return mla_bytes
    one = next(e for e in cache_shapes(cfg, 1, 1, dt, **(cache_options or {})).layers if isinstance(e, MLACache))
    nbytes = lambda x: sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(x))  # noqa: E731
    ik = nbytes(one.ik) / nbytes(one)
    return int(mla_bytes * (ik + (1 - ik) * min(1.0, cfg.indexer.topk / max(context, 1))))


@functools.lru_cache(maxsize=8)
def _drafter_weight_bytes(dcfg, dtype: str, sizes: tuple, layout: str) -> int:
    return sharding.param_bytes(dspark.abstract(dcfg, dtype), dict(sizes), layout)


def drafter_bytes(dcfg, batch: int, context: int, dtype="bfloat16", sizes=None, layout="tp_ep", serve=None) -> dict:
    """Per chip, a DSpark drafter (``dcfg``, a :class:`~kimi_jax.model.dspark.DSparkConfig`) as ``generate`` holds
    it on a mesh of ``sizes`` (default: one chip): its own weights in ``dtype``, split by their logical axes (the
    target's embedding and lm_head are shared, not counted again), and its context cache
    (:class:`~kimi_jax.model.dspark.DraftCache`: ``c [layers, batch, context, kv_lora_rank]`` and ``kpe [layers,
    batch, context, qk_rope_head_dim]`` in ``dtype``, rows and positions split as the target's latent cache's).
    ``serve`` (the serving engine's :class:`~kimi_jax.serving.stepplan.Shapes`): its context pools instead, ``[layers,
    n_pages, page_size, ...]`` replicated on every chip as the target's latent pools are."""
    sizes = {a: int((sizes or {}).get(a, 1)) for a in sharding.MESH_AXES}
    lay = sharding.layout(layout)
    weights = _drafter_weight_bytes(dcfg, jnp.dtype(dtype).name, tuple(sorted(sizes.items())), lay.name)
    if serve is not None:
        return {"weights": weights,
                "context pools (replicated)": dspark.cache_bytes(dcfg, serve.n_pages, serve.page_size, dtype)}
    return {"weights": weights, "context cache": sharding.draft_cache_bytes(dcfg, batch, context, dtype, sizes, lay)}


def tpu_loop_expert_copies(cfg: ModelConfig, sizes: dict, layout="tp_ep", dtype="bfloat16",
                           quantize: str | None = None) -> int:
    """Per chip, the routed-expert weights a TPU decode *loop* holds a second copy of: every leaf whose last dimension
    is not a multiple of 128 (the packed ``w2`` and its scales, the ``w1`` / ``w3`` scales of an MXFP4 expert stack),
    padded to one, in the layout the MoE kernel reads. A single step relayouts them layer by layer (a transient
    copy); inside a ``while_loop`` (the speculative loop) the weights are loop-invariant and XLA:TPU hoists every
    layer's copy out of the loop, so all of them are live at once (seen in the v5p buffer assignment of the
    speculative loop: ``u8[22,112,3584,256]`` and friends per scanned run). 0 without routed experts."""
    sizes = {a: int(sizes.get(a, 1)) for a in sharding.MESH_AXES}
    model, table = _abstract(cfg, jnp.dtype(dtype).name, quantize)
    specs = sharding.param_specs(model, sizes, sharding.layout(layout), table=table)
    total = 0
    for m in table:
        for name, a in m.arrays.items():
            key = m.prefix + name
            if _category(key) != "routed experts":
                continue
            local = sharding.shard_shape(a.shape, specs[key], sizes)
            if local[-1] % 128:
                total += math.prod(local[:-1]) * -(-local[-1] // 128) * 128 * jnp.dtype(a.dtype).itemsize
    return total


def drafter_workspace(dcfg, batch: int, context: int, k: int, sizes=None, layout="tp_ep") -> int:
    """Estimate of the largest temporaries of one DSpark drafting step inside the speculative loop, per chip of a
    mesh of ``sizes`` (the drafter split as :func:`drafter_bytes` counts it): one draft layer's absorbed attention in
    float32 over this chip's share of the context and the block (the latent and rope keys upcast, ``[B, L + k, r +
    rope]``; scores and probabilities ``[B, H, k, L + k]``: the plain form's, an upper bound for a kernel that
    tiles them), and the block's base logits ``[B, k, V]`` float32 (the vocabulary split as the lm_head's)."""
    sizes = {a: int((sizes or {}).get(a, 1)) for a in sharding.MESH_AXES}
    lay = sharding.layout(layout)
    cspecs = sharding.draft_cache_specs(dcfg, batch, context, sizes, lay)
    _, b, L, _ = sharding.shard_shape(dspark.cache_shapes(dcfg, batch, context, jnp.float32).c.shape, cspecs.c, sizes)
    vspec = sharding.group_specs({"logits": (("vocab",), (dcfg.vocab_size,))}, sizes, lay)["logits"]
    (vocab,) = sharding.shard_shape((dcfg.vocab_size,), vspec, sizes)
    L += k
    attn = b * L * (dcfg.kv_lora_rank + dcfg.qk_rope_head_dim) * 4 + 2 * b * dcfg.num_heads * k * L * 4
    return attn + b * k * vocab * 4


def _param_bytes(table, specs, sizes) -> tuple[dict, int, dict]:
    """(bytes per chip by category, bytes of the non-expert weights a decode step reads (all but the embedding),
    {MoE layer: bytes per chip of its local experts})."""
    params: dict[str, int] = {}
    read = 0
    expert_local: dict[str, int] = {}
    for m in table:
        for name, a in m.arrays.items():
            key = m.prefix + name
            b = sharding.shard_bytes(a.shape, a.dtype, specs[key], sizes)
            cat = _category(key)
            params[cat] = params.get(cat, 0) + b
            if cat == "routed experts":
                layer = key.split(".experts.")[0]
                expert_local[layer] = expert_local.get(layer, 0) + b
            elif key != "embed_tokens":
                read += b
    return params, read, expert_local


_CACHE_KIND = {"state": "kda_state", "conv_q": "kda_conv", "conv_k": "kda_conv", "conv_v": "kda_conv",
               "c": "mla", "kpe": "mla", "ik": "mla", "k": "kv", "v": "kv"}


def _cache_bytes(cfg, batch, context, dt, sizes, lay, cache_options=None, serve=None) -> tuple[dict, int, list, int]:
    """(cache bytes per chip by kind, sequences per chip, notes on what the layout cannot split, MLA cache positions
    one sequence reads per chip). ``serve``: the engine's paged cache instead (its pools whole on every chip)."""
    if serve is None:
        cshapes = cache_shapes(cfg, batch, context, dt, **(cache_options or {}))
        cspecs = sharding.cache_specs(cfg, cshapes, sizes, lay)
    else:
        cshapes = paged_cache_shapes(cfg, serve.slots, serve.n_pages, serve.page_size, dt, **(cache_options or {}))
        cspecs = sharding.paged_cache_specs(cfg, cshapes, sizes, lay)
    cache = {"kda_state": 0, "kda_conv": 0, "mla": 0, "kv": 0}
    for entry, spec in zip(cshapes.layers, cspecs.layers):
        for field in dataclasses.fields(entry):
            value, sp = getattr(entry, field.name), getattr(spec, field.name)
            # an int8 field: its codes and its scales, each under its own spec
            specs = jax.tree.leaves(sp, is_leaf=lambda x: isinstance(x, PartitionSpec))
            for sds, s in zip(jax.tree.leaves(value), specs):
                cache[_CACHE_KIND[field.name]] += sharding.shard_bytes(sds.shape, sds.dtype, s, sizes)
    cache["lengths"] = sharding.shard_bytes(cshapes.lengths.shape, cshapes.lengths.dtype, cspecs.lengths, sizes)
    b_loc = sharding.shard_shape((batch,), cspecs.lengths, sizes)[0]
    notes = []
    rep = [a for a in sharding.replicated_over(cspecs.lengths, sizes) if a in lay.mesh_axes("batch")]
    if rep and serve is None:
        notes.append(f"batch {batch} does not split over {'x'.join(rep)}: caches replicated there")
    mla = [spec.c for entry, spec in zip(cshapes.layers, cspecs.layers) if isinstance(entry, MLACache)]
    mla = jax.tree.leaves(mla[0], is_leaf=lambda x: isinstance(x, PartitionSpec))[0] if mla else None
    if serve is None and mla is not None and sizes["model"] > 1 and "model" in sharding.replicated_over(mla, sizes):
        notes.append(f"the MLA latent cache (no head axis) does not split its {context} positions over the model "
                     f"axis: replicated there")
    for kind, sub in (("kda", cfg.kda), ("mla", cfg.mla), ("gqa", cfg.gqa)):
        if sub is not None and kind in cfg.attn_types and sizes["model"] > 1:
            if not _allowed_heads(sub.num_heads, sizes, lay):
                notes.append(f"{kind}: {sub.num_heads} heads do not divide the model axis: attention replicated")
    if serve is not None:
        b_loc = sharding.shard_shape((batch,), sharding.batch_spec((batch,), sizes, lay), sizes)[0]
        mla_positions = serve.pages_per_seq * serve.page_size  # a whole page table, read through the pool
        if mla is not None:
            notes.append(f"the paged MLA pools ({serve.n_pages} pages of {serve.page_size}) are whole on every chip")
    else:
        mla_positions = sharding.shard_shape((batch, context), mla, sizes)[1] if mla is not None else context
    return cache, b_loc, notes, mla_positions


def _decode_activations(cfg, model, specs, sizes, lay, batch, b_loc, mla_positions, dt, kernels, moe: bool) -> dict:
    """Decode-step activations: the logits, the residual stream and AttnRes blocks, the expert exchange buffers; with
    the jnp reference kernels, also the largest per-layer workspace they may materialise (layers run in turn;
    ``mla_positions``: the MLA cache positions one chip holds)."""
    V, D = cfg.vocab_size, cfg.hidden_size
    head = "lm_head" if "lm_head" in specs else "embed_tokens"
    v_loc = V // math.prod(sizes[a] for a in _spec_axes(specs[head][0]))
    act = {"logits (f32)": b_loc * v_loc * 4}
    blocks = cfg.num_layers // cfg.attn_res_block_size + 2 if cfg.attn_res else 2
    act["residual stream + AttnRes blocks"] = b_loc * D * blocks * 4
    work = {}
    if moe:
        w1, e_loc, f_loc = _local_experts(model, specs, sizes)
        rows = _exchange_rows(cfg, specs[w1], e_loc, sizes, lay, batch)
        L = cfg.moe.expert_in
        act["expert exchange (lossless)"] = rows * (L * (2 * dt.itemsize + 4) + 2 * f_loc * dt.itemsize)
        # one weight decoded to dense, its transposed copy, and a dense product of every received row with every
        # local expert before the selection: an upper estimate of the plain-JAX grouped matmul's workspace (the
        # capacity form, now kernels_pallas/moe_gmm/xla_cpu, as XLA:CPU compiled it at full size; at small shapes it
        # loops over experts instead; the lax.ragged_dot reference decodes the packed stack once, within this bound)
        work["workspace: expert dequant (ref.)"] = (2 * e_loc * f_loc * L + rows * e_loc * max(f_loc, L)) * dt.itemsize
    if cfg.mla is not None and "mla" in cfg.attn_types:
        # The reference upcasts one layer's latent cache to float32 for the scores and again, transposed, for the
        # value read; the rope key part once (an int8 cache: its dequantized copy, the same float32 bytes).
        m = cfg.mla
        work["workspace: MLA upcast (ref.)"] = b_loc * mla_positions * (2 * m.kv_lora_rank + m.qk_rope_dim) * 4
    if kernels == "reference" and work:
        name = max(work, key=work.get)
        act[name] = work[name]  # the largest; the others are of other layers
    return act


@functools.lru_cache(maxsize=4)
def _abstract(cfg: ModelConfig, dtype: str, quantize: str | None = None):
    model = _quantized(abstract_model(cfg, RunConfig(dtype=jnp.dtype(dtype))), quantize)
    return model, sharding.module_table(model)


def _quantized(model, quantize: str | None):
    return model if quantize is None else quantize_model(model, quantize)


def _local_experts(model, specs, sizes):
    """The first routed-expert gate weight's leaf path, and the experts and expert width one chip holds of it (every
    leaf of a packed weight splits experts and width alike)."""
    w1 = next(k for k in specs if ".experts.w1" in k)
    e_loc, f_loc = sharding.shard_shape(_leaf_shape(model, w1), specs[w1], sizes)[:2]
    return w1, e_loc, f_loc


def _exchange_rows(cfg, w1_spec, e_loc, sizes, lay, tokens, with_pairs=False):
    """Rows a chip receives in one expert exchange of ``tokens`` tokens in all (lossless buffers: every sender's
    worst case); ``with_pairs``: and the (token, expert) pairs of the chip's own token shard."""
    ep = _spec_axes(w1_spec[0])
    n_ep = math.prod(sizes[a] for a in ep)
    tok_axes = [a for a in lay.mesh_axes("batch") if sizes[a] > 1] + [a for a in ep if a not in lay.mesh_axes("batch")]
    n_loc = -(-tokens // math.prod(sizes[a] for a in tok_axes))
    rows = n_ep * n_loc * min(cfg.moe.top_k, e_loc) if n_ep > 1 else n_loc * cfg.moe.top_k
    return (rows, n_loc * cfg.moe.top_k) if with_pairs else rows


def _allowed_heads(h, sizes, lay):
    return sharding.group_specs({"h": (("heads",), (h,))}, sizes, lay)["h"][0]


def _leaf_shape(model, path):
    return params.leaves(nnx.state(model))[path].shape


def _prefill_activations(cfg, sizes, lay, specs, model, batch, b_loc, T, dt):
    """The largest temporaries of a fresh prefill chunk of ``T`` tokens for each of ``batch`` sequences (``b_loc``
    on this chip): the residual stream and the AttnRes blocks, which live across the step, and on top of them the
    largest workspace of one layer. For an MoE layer that is the lossless expert exchange: every received row's
    input, its expert-sorted copy and its float32 down projection, the two float32 up projections and the
    activation over the local hidden width, and the chip's own pairs' send buffer (``rows`` grows with the
    tokens of every sequence the chip's token shard holds, not with ``b_loc``); for KDA the chunk's decay tensor.
    Checked against the compilers' memory analysis (``benchmarks/plan_vs_compiler.py --prefill``)."""
    D, N, s = cfg.hidden_size, b_loc * T, dt.itemsize
    blocks = cfg.num_layers // cfg.attn_res_block_size + 1 if cfg.attn_res else 0
    out = {"hidden + AttnRes blocks": N * D * s * (2 + blocks)}
    work = {}
    if cfg.moe is not None:
        moe = cfg.moe
        w1, e_loc, f_loc = _local_experts(model, specs, sizes)
        rows, pairs = _exchange_rows(cfg, specs[w1], e_loc, sizes, lay, batch * T, with_pairs=True)
        L = moe.expert_in
        work["MoE expert exchange (lossless)"] = rows * ((2 * s + 4) * L + (8 + s) * f_loc) + pairs * s * L
    if cfg.kda is not None:
        k = cfg.kda
        h_loc = k.num_heads // max(1, math.prod(sizes[a] for a in _spec_axes(_allowed_heads(k.num_heads, sizes, lay))))
        C = min(64, T)
        work["KDA chunk decay tensor"] = b_loc * h_loc * C * C * k.head_dim * 4
    if work:
        name = max(work, key=work.get)
        out[name] = work[name]  # the largest; the others are of other layers
    return out


# -- printing ----------------------------------------------------------------------------------------------


def _gb(b):
    return f"{b / GB:9.2f} GB"


def format_plan(p: Plan, chips=None, reserve: float = 0.1, bandwidth: float | None = None) -> str:
    chips = chips or list(CHIPS)
    mesh = ",".join(f"{a}={p.sizes[a]}" for a in sharding.MESH_AXES)
    cache_format = f", {p.kv_cache} MLA/KV cache" if p.kv_cache else ""
    cache_format += f", {p.kda_state} KDA state" if p.kda_state != "float32" else ""
    lines = [f"{p.model}: mesh {mesh} ({p.chips} chips), layout {p.layout}, batch {p.batch}, context {p.context}, "
             f"{p.dtype}{cache_format}, {p.kernels} kernels", "", "per-chip bytes"]
    for k, v in p.params.items():
        lines.append(f"  params  {k:<34}{_gb(v)}")
    lines.append(f"  params  {'total':<34}{_gb(p.param_total)}")
    state = {"float32": "f32", "bfloat16": "bf16"}.get(p.kda_state, p.kda_state)
    rows = f", {p.kv_cache}" if p.kv_cache else ""
    labels = {"kda_state": f"KDA state ({state})", "kda_conv": "KDA conv tails", "mla": f"MLA latent cache{rows}",
              "kv": f"GQA KV cache{rows}", "lengths": "sequence lengths"}
    for k, v in p.cache.items():
        if v:
            lines.append(f"  cache   {labels[k]:<34}{_gb(v)}")
    for k, v in p.activations.items():
        lines.append(f"  decode  {k:<34}{_gb(v)}")
    for k, v in p.drafter.items():
        lines.append(f"  drafter {k:<34}{_gb(v)}")
    lines.append(f"  {'total':<42}{_gb(p.total)}")
    if p.prefill_activations:
        lines.append("prefill-chunk activations (estimate, not in the total)")
        for k, v in p.prefill_activations.items():
            lines.append(f"  {k:<42}{_gb(v)}")
    lines.append("")
    lines.append(f"decode step reads per chip: {_gb(sum(p.step_read.values()))} "
                 f"({', '.join(f'{k} {v / GB:.2f}' for k, v in p.step_read.items())} GB)")
    if bandwidth:
        t = p.step_seconds(bandwidth)
        lines.append(f"  at {bandwidth / 1e12:.2f} TB/s: {t * 1e3:.2f} ms/step, {p.batch / t:.0f} tok/s aggregate")
    lines.append(f"fits (total <= {100 * (1 - reserve):.0f}% of HBM):")
    for name in chips:
        c = CHIPS[name]
        t = p.step_seconds(c.hbm_bandwidth)
        verdict = "fits" if p.fits(c, reserve) else "does NOT fit"
        lines.append(f"  {c.name:<18}{c.hbm_bytes / GB:5.0f} GB  {verdict:<13} roofline {t * 1e3:7.2f} ms/step "
                     f"({p.batch / t:7.0f} tok/s)")
    for n in p.notes:
        lines.append(f"note: {n}")
    return "\n".join(lines)


def candidate_meshes(chips: int):
    """(data=1) x expert x model meshes of ``chips`` chips, model axis a power of two up to 32."""
    return [{"data": 1, "expert": chips // m, "model": m} for m in (1, 2, 4, 8, 16, 32) if m <= chips]


def search(cfg: ModelConfig, layout, *, batch, context, dtype="bfloat16", kernels="pallas", chips=None,
           reserve=0.1, max_chips=512, quantize: str | None = None, kv_cache: str | None = None,
           kda_state=None) -> dict[str, list[Plan]]:
    """For each chip, the fitting meshes with the fewest chips (power-of-two counts; all model-axis sizes there)."""
    chips = list(chips or CHIPS)
    out: dict[str, list[Plan]] = {}
    n = 1
    while n <= max_chips and len(out) < len(chips):
        plans = [make_plan(cfg, s, layout, batch=batch, context=context, dtype=dtype, kernels=kernels,
                           quantize=quantize, kv_cache=kv_cache, kda_state=kda_state) for s in candidate_meshes(n)]
        for name in chips:
            fit = [p for p in plans if p.fits(CHIPS[name], reserve)]
            if name not in out and fit:
                out[name] = fit
        n *= 2
    return {name: out.get(name, []) for name in chips}


# -- the compiler's view -------------------------------------------------------------------------------------


def compare_with_compiler(cfg: ModelConfig, mesh, layout="tp_ep", *, batch: int, context: int, dtype="bfloat16",
                          model_name: str = "") -> tuple[Plan, Plan, dict]:
    """The plan (as deployed: Pallas kernels, no workspace), the plan with the jnp reference kernels' workspace
    estimate (what the compiled CPU program runs), and XLA's memory analysis of the compiled decode step."""
    kw = dict(batch=batch, context=context, dtype=dtype, model_name=model_name)
    p = make_plan(cfg, dict(mesh.shape), layout, kernels="pallas", **kw)
    r = make_plan(cfg, dict(mesh.shape), layout, kernels="reference", **kw)
    return p, r, compile_step(cfg, mesh, layout, batch=batch, context=context, dtype=dtype)


def format_comparison(p: Plan, r: Plan, xla: dict) -> str:
    """Plan vs XLA, per device: arguments (parameters + cache + ids), activations, peak."""
    rows = [("parameters + cache (arguments)", p.param_total + p.cache_total, None, xla["argument"]),
            ("activations (temp + non-aliased outputs)", p.activation_total, r.activation_total,
             xla["temp"] + xla["output"] - xla["alias"]),
            ("peak (args + outputs - aliased + temp)", p.total, r.total, xla["peak"])]
    lines = [f"{'per device':<42}{'plan':>12}{'XLA':>12}{'plan/XLA':>9}{'+ref. workspace':>17}{'/XLA':>7}"]
    for name, a, b, x in rows:
        ref = f"{b / GB:>14.3f} GB{b / x:>7.3f}" if b is not None else ""
        lines.append(f"{name:<42}{a / GB:>9.3f} GB{x / GB:>9.3f} GB{a / x:>9.3f}{ref}")
    lines.append(f"compile {xla['compile_seconds']:.0f} s")
    return "\n".join(lines)
