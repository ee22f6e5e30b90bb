"""The model: embeddings, a stack of decoder layers (KDA / MLA / GQA mixer + dense MLP / MoE), final norm, lm_head.

Residual stream, two forms:
  * plain (Kimi Linear, Llama): ``h += mixer(norm(h)); h += ffn(norm(h))``;
  * Block Attention Residuals (K3): each sublayer reads a softmax mix over depth sources -- the sealed block
    sums ``B`` plus the running partial sum ``P`` -- and a new block is sealed every ``attn_res_block_size``
    layers. What a layer returns (and the per-layer hidden states report) is ``P``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx, struct

from kimi_jax.model import offload, params
from kimi_jax.model.attention import GQA, KDA, MLA, Step
from kimi_jax.model.cache import Cache
from kimi_jax.model.config import ModelConfig
from kimi_jax.model.layer_plan import LayerPlan, layer_plan
from kimi_jax.model.layers import MLP, AttnRes, embed, linear, param, rms_norm
from kimi_jax.model.moe import MoE
from kimi_jax.model.run import RunConfig


@struct.dataclass
class ModelOutput:
    logits: jax.Array  # [B, T, V] float32, float64 in a float64 run (or [B, 1, V] with last_only)
    cache: Cache | None = None
    hidden: tuple | None = None  # per layer [B, T, D]: the layer's output (P under AttnRes)
    router: tuple | None = None  # per MoE layer: (idx [B, T, X] int32, weights [B, T, X] float32)
    attn_res_weights: tuple | None = None  # per AttnRes mix: [n_sources, B, T] float32
    # with return_hidden: the lm_head's input [B, T, D] (after the final norm), the output AttnRes mix before that
    # norm, and the sealed AttnRes blocks [n_blocks, B, T, D] (AttnRes models; else None)
    final_hidden: jax.Array | None = None
    output_mix: jax.Array | None = None
    attn_res_blocks: jax.Array | None = None


class Blocks(NamedTuple):
    """The sealed AttnRes blocks a layer can read.

    Unrolled layers: ``arrays`` is a tuple of the sealed sums (``count`` None: all of them valid). Scanned layers:
    ``arrays`` is one ``[n_blocks, B, T, D]`` buffer with room for every block of the model and ``count`` the traced
    number sealed so far (slots from ``count`` on are zeros)."""

    arrays: tuple | jax.Array
    count: jax.Array | None = None

    def sources(self, partial) -> tuple[list, list | None]:
        """(sources for a mix: every block slot, then ``partial``; their validity, None when all are valid)."""
        if self.count is None:
            return [*self.arrays, partial], None
        n = self.arrays.shape[0]
        return [self.arrays[k] for k in range(n)] + [partial], [self.count > k for k in range(n)] + [None]

    def empty(self) -> bool:
        return self.count is None and not self.arrays

    def seal(self, x, seal):
        """Push the raw layer input ``x`` as a new block when ``seal`` (a bool, or traced in a scan)."""
        if self.count is None:
            return Blocks((*self.arrays, x)) if seal else self
        slot = jnp.minimum(self.count, self.arrays.shape[0] - 1)  # a full buffer is never sealed again
        keep = jax.lax.dynamic_index_in_dim(self.arrays, slot, keepdims=False)
        buf = jax.lax.dynamic_update_index_in_dim(self.arrays, jnp.where(seal, x, keep), slot, 0)
        return Blocks(buf, self.count + jnp.asarray(seal, jnp.int32))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, index: int, *, param_dtype, rngs):
        self.index = index
        self.attn_kind, self.ffn_kind = cfg.attn_types[index], cfg.ffn_types[index]
        self.eps = cfg.norm_eps
        D = cfg.hidden_size
        self.input_layernorm = param(rngs, (D,), ("embed",), param_dtype, init="ones")
        self.post_attention_layernorm = param(rngs, (D,), ("embed",), param_dtype, init="ones")
        if cfg.attn_res:
            self.self_attention_res = AttnRes(D, cfg.norm_eps, param_dtype=param_dtype, rngs=rngs)
            self.mlp_res = AttnRes(D, cfg.norm_eps, param_dtype=param_dtype, rngs=rngs)
        mixer = {"kda": (KDA, cfg.kda), "mla": (MLA, cfg.mla), "gqa": (GQA, cfg.gqa)}[self.attn_kind]
        self.self_attn = mixer[0](mixer[1], param_dtype=param_dtype, rngs=rngs)
        if self.ffn_kind == "moe":
            self.mlp = MoE(cfg.moe, param_dtype=param_dtype, rngs=rngs)
        else:
            self.mlp = MLP(cfg.mlp, param_dtype=param_dtype, rngs=rngs)

    def _ffn(self, x, run, prefetch):
        if self.ffn_kind == "moe":
            return self.mlp(x, run, after=prefetch)
        return self.mlp(x, run), None

    def __call__(self, h, step: Step, cache, run: RunConfig, prefetch=None):
        """Plain residual layer. Returns (h, cache, router). ``prefetch``: what a whole-layer copy of this layer's
        host-offloaded experts waits for (:meth:`MoE.__call__`'s ``after``; the decoder passes the previous
        layer's input)."""
        y, cache = self.self_attn(rms_norm(h, self.input_layernorm[...], self.eps, run), step, cache, run)
        h = (h + y).astype(run.dtype)
        z, router = self._ffn(rms_norm(h, self.post_attention_layernorm[...], self.eps, run), run, prefetch)
        return (h + z).astype(run.dtype), cache, router

    def attn_res_call(self, partial, blocks: Blocks, seal, step: Step, cache, run: RunConfig, prefetch=None):
        """AttnRes layer (K3_SPEC §4.2). ``seal``: this layer starts a block (traced in a scan). Returns (partial,
        blocks, cache, router, weights of its mixes). ``prefetch``: as in :meth:`__call__`."""
        x, weights = partial, []
        if blocks.empty():  # layer 0: nothing to mix yet
            a = x
        else:
            a, alpha = _mix(self.self_attention_res, blocks, x, run)
            weights.append(alpha)
        blocks = blocks.seal(x, seal)  # push the raw layer input; the partial sum restarts
        y, cache = self.self_attn(rms_norm(a, self.input_layernorm[...], self.eps, run), step, cache, run)
        summed = (x + y).astype(run.dtype)
        partial = (y if seal else summed) if isinstance(seal, bool) else jnp.where(seal, y, summed)
        m, alpha = _mix(self.mlp_res, blocks, partial, run)
        weights.append(alpha)
        z, router = self._ffn(rms_norm(m, self.post_attention_layernorm[...], self.eps, run), run, prefetch)
        return (partial + z).astype(run.dtype), blocks, cache, router, weights


def _mix(res: AttnRes, blocks: Blocks, partial, run: RunConfig):
    """``res``'s mix over the sealed blocks and the partial sum: (mix, weights)."""
    sources, valid = blocks.sources(partial)
    return res(sources, run, return_weights=True, valid=valid)


class LayerGroup(nnx.Module):
    """One repetition of a scanned run of layers (:mod:`kimi_jax.model.layer_plan`); stacked over repetitions in the model."""

    def __init__(self, cfg: ModelConfig, plan: LayerPlan, *, param_dtype, rngs):
        self.layers = nnx.List([DecoderLayer(cfg, plan.layer(j, 0), param_dtype=param_dtype, rngs=rngs)
                                for j in range(plan.period)])


def _stacked_group(cfg: ModelConfig, plan: LayerPlan, param_dtype, rngs) -> LayerGroup:
    @nnx.split_rngs(splits=plan.count)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(r):
        return LayerGroup(cfg, plan, param_dtype=param_dtype, rngs=r)

    return make(rngs)


class _Outputs(NamedTuple):
    """What the layers report, per layer in order (filled only when asked for)."""

    hidden: list
    router: list
    weights: list


class KimiModel(nnx.Module):
    """One Flax NNX model for Kimi K3, Kimi Linear and dense GQA checkpoints.

    ``model(ids_BT)`` -> :class:`ModelOutput` with float32 logits ``[B, T, V]`` (float64 in a float64 run). With a
    :class:`Cache`, the call also reads and writes the static cache (prefill with ``prefix=False``; decode or continued
    prefill with ``prefix=True``, positions starting at ``cache.lengths``). With ``page_table [B, pages_per_seq]`` the
    cache's attention entries are page pools (:func:`kimi_jax.model.cache.paged_cache`, the serving engine's).

    Layers live in ``layers`` (one module per layer). With ``RunConfig(scan_layers=True)`` the longest repeating run
    of layers (``self.plan``) lives in ``stack`` instead, one :class:`LayerGroup` whose parameters carry a leading
    repetition dimension, and runs as one ``lax.scan``; its entries of ``layers`` are None.

    With ``RunConfig(offload=...)`` the offloaded cache entries arrive in host memory: each layer's entry is moved to
    device memory before the layer runs and its new entry back before the next (:mod:`kimi_jax.model.offload`).
    Offloaded experts that move whole (prefill) may start moving once the previous layer has started (its input is
    each layer's ``prefetch``), so one layer's copy overlaps the layer before it.
    """

    def __init__(self, cfg: ModelConfig, *, run: RunConfig | None = None, param_dtype=None, rngs: nnx.Rngs | None = None):
        run = run or RunConfig()
        param_dtype = jnp.dtype(param_dtype or run.dtype)
        rngs = rngs or nnx.Rngs(0)
        self.cfg, self.run = cfg, run
        self.plan = layer_plan(cfg, run.scan_layers)
        D, V = cfg.hidden_size, cfg.vocab_size
        self.embed_tokens = param(rngs, (V, D), ("vocab", "embed"), param_dtype, std=0.3)
        self.layers = nnx.List([None if i in self.plan.scanned else
                                DecoderLayer(cfg, i, param_dtype=param_dtype, rngs=rngs) for i in range(cfg.num_layers)])
        if self.plan.count:
            self.stack = _stacked_group(cfg, self.plan, param_dtype, rngs)
        self.norm = param(rngs, (D,), ("embed",), param_dtype, init="ones")
        if cfg.attn_res:
            self.output_attn_res = AttnRes(D, cfg.norm_eps, param_dtype=param_dtype, rngs=rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = param(rngs, (V, D), ("vocab", "embed"), param_dtype, std=0.1)

    def __call__(self, ids_BT, *, cache: Cache | None = None, lengths=None, prefix: bool = False,
                 last_only: bool = False, return_hidden: bool = False, return_router: bool = False,
                 return_attn_res: bool = False, page_table=None) -> ModelOutput:
        cfg, run, plan = self.cfg, self.run, self.plan
        B, T = ids_BT.shape
        if cache is not None and bool(cache.stack) != bool(plan.count):
            raise ValueError(f"the cache is laid out for {'scanned' if cache.stack else 'unrolled'} layers but the "
                             f"model runs {'scanned' if plan.count else 'unrolled'} ones: build it with "
                             f"scan={bool(plan.count)} (RunConfig.scan_layers)")
        lengths = jnp.full((B,), T, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
        start = cache.lengths if (cache is not None and prefix) else jnp.zeros((B,), jnp.int32)
        positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
        step = Step(positions, jnp.arange(T)[None] < lengths[:, None], lengths, prefix, page_table)

        h = embed(self.embed_tokens[...], ids_BT, run)
        new_layers = [None] * cfg.num_layers
        new_stack = ()
        outs = _Outputs([None] * cfg.num_layers, [None] * cfg.num_layers, [None] * cfg.num_layers)
        want = (return_hidden, return_router, return_attn_res)
        blocks = Blocks(())
        prev = h  # the previous layer's input: what this layer's whole-layer expert copy waits for
        for i in range(cfg.num_layers):
            if i in plan.scanned:
                if i == plan.start:
                    h, blocks, new_stack = self._scan(h, blocks, step, None if cache is None else cache.stack,
                                                      run, want, outs)
                    prev = h
                continue
            layer = self.layers[i]
            layer_cache = None if cache is None else offload.fetch_entry(cache.layers[i], run, after=h)
            prev, prefetch = h, prev
            if cfg.attn_res:
                seal = i % cfg.attn_res_block_size == 0
                h, blocks, layer_cache, r, w = _remat(
                    lambda m, h, b, c, p: m.attn_res_call(h, b, seal, step, c, run, p), run)(
                        layer, h, blocks, layer_cache, prefetch)
                outs.weights[i] = w
            else:
                h, layer_cache, r = _remat(lambda m, h, c, p: m(h, step, c, run, p), run)(layer, h, layer_cache,
                                                                                           prefetch)
            new_layers[i] = offload.store_entry(layer_cache, run)
            outs.hidden[i], outs.router[i] = h, r
        weights, mixed = [], None
        if cfg.attn_res:
            for w in outs.weights if return_attn_res else ():
                weights.extend(w)
            h, alpha = _mix(self.output_attn_res, blocks, h, run)
            weights.append(alpha)
            mixed = h
        if last_only:
            h = jnp.take_along_axis(h, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)
        h = rms_norm(h, self.norm[...], cfg.norm_eps, run)
        head = self.embed_tokens[...] if cfg.tie_word_embeddings else self.lm_head[...]
        logits = linear(h, head, run).astype(run.compute_dtype)
        new_cache = None
        if cache is not None:
            new_cache = Cache(tuple(new_layers), start + lengths, new_stack)
        return ModelOutput(
            logits=logits,
            cache=new_cache,
            hidden=tuple(outs.hidden) if return_hidden else None,
            final_hidden=h if return_hidden else None,
            output_mix=mixed if return_hidden else None,
            attn_res_blocks=jnp.stack(blocks.arrays) if (return_hidden and blocks.arrays) else None,
            router=tuple(r for r in outs.router if r is not None) if return_router else None,
            attn_res_weights=tuple(weights) if return_attn_res else None,
        )

    def consumer_stream(self, out: ModelOutput, layer: int):
        """The stream the layer after ``layer`` reads for its attention, from a call's ``return_hidden`` outputs:
        under Block AttnRes its attention mix over the blocks sealed so far and ``layer``'s output (after the last
        layer: the output mix the final norm reads); without AttnRes, ``layer``'s output. What a DSpark drafter fed
        the ``attn_res`` stream taps."""
        cfg = self.cfg
        if not cfg.attn_res:
            return out.hidden[layer]
        if layer == cfg.num_layers - 1:
            return out.output_mix
        nxt = layer + 1
        seen = _blocks_seen(cfg, nxt)[0]
        slot = self.plan.slot(nxt)
        if slot is None:
            res = self.layers[nxt].self_attention_res
        else:  # a scanned layer: its repetition's slice of the stacked mix weights
            graph, state = nnx.split(self.stack.layers[slot[0]].self_attention_res)
            res = nnx.merge(graph, jax.tree.map(lambda a: a[slot[1]], state))
        return res([out.attn_res_blocks[i] for i in range(seen)] + [out.hidden[layer]], self.run)

    def _scan(self, h, blocks: Blocks, step: Step, stack_cache, run: RunConfig, want, outs: _Outputs):
        """The scanned run of layers as one ``lax.scan`` over its repetitions. The carry holds the residual stream,
        the AttnRes block buffer (room for every block of the model) and the stacked cache, written in place."""
        cfg, plan = self.cfg, self.plan
        graphdef, params = nnx.split(self.stack)
        blocks_in = len(blocks.arrays)
        buf = cnt = None
        if cfg.attn_res:
            nb = len(range(0, cfg.num_layers, cfg.attn_res_block_size))
            zeros = [jnp.zeros_like(h)] * (nb - blocks_in)
            buf, cnt = jnp.stack([*blocks.arrays, *zeros]), jnp.int32(blocks_in)

        def body(carry, xs):
            h, buf, cnt, caches = carry
            p, g = xs
            group = nnx.merge(graphdef, p)
            caches, ys = list(caches) if caches is not None else None, []
            prev = h  # within one repetition, as in the unrolled loop (the loop body is scheduled on its own)
            for j, layer in enumerate(group.layers):
                entry = None if caches is None else jax.tree.map(lambda a: a[g], caches[j])
                entry = offload.fetch_entry(entry, run, after=h)
                prev, prefetch = h, prev
                w = None
                if cfg.attn_res:
                    seal = (plan.start + g * plan.period + j) % cfg.attn_res_block_size == 0
                    h, b, entry, r, w = layer.attn_res_call(h, Blocks(buf, cnt), seal, step, entry, run, prefetch)
                    buf, cnt = b
                else:
                    h, entry, r = layer(h, step, entry, run, prefetch)
                if caches is not None:
                    entry = offload.store_entry(entry, run)
                    caches[j] = jax.tree.map(lambda a, e: a.at[g].set(e), caches[j], entry)
                ys.append(tuple(v if keep else None for v, keep in zip((h, r, w), want)))
            return (h, buf, cnt, None if caches is None else tuple(caches)), ys

        (h, buf, cnt, stack_cache), ys = jax.lax.scan(
            jax.checkpoint(body) if run.remat else body, (h, buf, cnt, stack_cache), (params, jnp.arange(plan.count, dtype=jnp.int32)))
        for layer in plan.scanned:
            j, g = plan.slot(layer)
            hidden, router, weights = jax.tree.map(lambda a: a[g], ys[j])
            outs.hidden[layer], outs.router[layer] = hidden, router
            if weights is not None:
                seen = _blocks_seen(cfg, layer)
                ws = [_unpad_weights(w, n, buf.shape[0]) for w, n in zip(weights, seen)]
                outs.weights[layer] = ws[1:] if seen[0] == 0 else ws  # unrolled, layer 0 has no attention mix
        if cfg.attn_res:
            sealed = len(range(0, plan.stop, cfg.attn_res_block_size))
            blocks = Blocks(tuple(buf[k] for k in range(sealed)))
        return h, blocks, (stack_cache if stack_cache is not None else ())


def _remat(fn, run: RunConfig):
    """``fn(layer, ...)`` rematerialised in the backward pass when ``run.remat`` (:class:`RunConfig`). The layer
    goes in as its state (``jax.checkpoint`` over ``nnx.split``): a layer's forward pass mutates nothing."""
    if not run.remat:
        return fn

    def call(layer, *args):
        graphdef, state = nnx.split(layer)
        return jax.checkpoint(lambda st, *a: fn(nnx.merge(graphdef, st), *a))(state, *args)

    return call


def _blocks_seen(cfg: ModelConfig, layer: int) -> tuple[int, int]:
    """Blocks the attention and the MLP mixes of an AttnRes layer read (the MLP's after this layer's seal)."""
    bs = cfg.attn_res_block_size
    return len(range(0, layer, bs)), len(range(0, layer + 1, bs))


def _unpad_weights(alpha, n_blocks: int, slots: int):
    """A scanned mix's weights ``[slots + 1, ...]`` as the unrolled mix reports them: the valid blocks, the partial."""
    return jnp.concatenate([alpha[:n_blocks], alpha[slots:]])


def abstract_model(cfg: ModelConfig, run: RunConfig | None = None, param_dtype=None) -> KimiModel:
    """The model with ``ShapeDtypeStruct`` leaves: shapes and dtypes, no memory (seconds even for 2.8T)."""
    return nnx.eval_shape(lambda: KimiModel(cfg, run=run, param_dtype=param_dtype, rngs=nnx.Rngs(0)))


def param_count(model: KimiModel, logical: bool = True) -> int:
    """Number of parameters; with ``logical`` a packed (MXFP4) weight counts the values it encodes."""
    return params.count(model, logical)


def relayout(model: KimiModel, *, scan_layers: bool, consume: bool = False) -> KimiModel:
    """The same model with its repeating run of layers stacked for a scan (``scan_layers=True``) or one module per
    layer. A stacked parameter of a sharded model keeps its layers' sharding, unsplit over the repetitions.

    Loaders read checkpoints into the per-layer form and pass ``consume=True``: each layer's arrays are deleted once
    stacked, so the peak is the model plus one stacked parameter, and ``model`` must not be used afterwards."""
    if bool(model.plan.count) == scan_layers:
        return model
    run = dataclasses.replace(model.run, scan_layers=scan_layers)
    src = {tuple(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}
    target = nnx.eval_shape(lambda: KimiModel(model.cfg, run=run, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(target)
    stacked = target.plan if scan_layers else model.plan
    flat = []
    for path, var in nnx.to_flat_state(state):
        path = tuple(path)
        if scan_layers and path[0] == "stack":  # ("stack", "layers", j, ...) <- ("layers", layer(j, g), ...)
            j, rest = path[2], path[3:]
            parts = [src[("layers", stacked.layer(j, g), *rest)] for g in range(stacked.count)]
            value = jax.tree.map(lambda *a: _stack(a), *parts)  # a packed weight: each field
            if consume:
                for a in jax.tree.leaves(parts):
                    a.delete()
        elif not scan_layers and path[0] == "layers" and stacked.slot(path[1]) is not None:
            j, g = stacked.slot(path[1])
            value = jax.tree.map(lambda a: _unstack(a, g), src[("stack", "layers", j, *path[2:])])
        else:
            value = src[path]
        flat.append((path, var.replace(value)))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _stack(parts):
    sh = getattr(parts[0], "sharding", None)
    if isinstance(sh, jax.sharding.NamedSharding):
        out = jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(None, *sh.spec))
        return jax.jit(lambda *a: jnp.stack(a), out_shardings=out)(*parts)
    return jnp.stack(parts)


def _unstack(value, g: int):
    sh = getattr(value, "sharding", None)
    if isinstance(sh, jax.sharding.NamedSharding):
        out = jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(*sh.spec[1:]))
        return jax.jit(lambda a: a[g], out_shardings=out)(value)
    return value[g]
