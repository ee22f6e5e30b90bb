"""Inside the model: what one forward pass routes and mixes, and what KDA remembers.

* :func:`pad_prompts` right-pads token-id lists; :func:`probe` runs one jitted forward pass and returns a
  :class:`Probe` (router choices of every MoE layer, weights of every AttnRes mix).
* Expert utilisation (:func:`expert_counts`, :func:`load_stats`) counts (token, expert) assignments of the router
  over *valid* tokens only (right padding excluded), ``top_k`` per token per MoE layer.
* AttnRes weights (:func:`attn_res_layout`, :func:`attn_res_table`): every AttnRes mix is a softmax over depth
  sources -- the sealed blocks (block 0 is the token embedding, block j the sum of block j's sublayer outputs) and
  the running partial sum of the current block. Layer 0 has no attention-side mix (nothing to mix yet), so K3 has
  ``2 L`` mixes (``L - 1`` attention, ``L`` MLP, one output).
* KDA state norms (:func:`kda_state_norms`): the Frobenius norm of each KDA layer's recurrent state ``[H, K, U]``
  after every chunk of a continued prefill (``prefix=True`` over one static cache).

Everything returns plain numpy / dataclasses of numpy so it can be checked in tests."""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kimi_jax.model.cache import KDACache, init_cache
from kimi_jax.model.config import ModelConfig


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
    """Indices of the KDA layers (the layers :func:`kda_state_norms` reports, in order)."""
    return [i for i, kind in enumerate(cfg.attn_types) if kind == "kda"]


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _continue(graphdef, params, cache, ids_BT):
    out = nnx.merge(graphdef, params)(ids_BT, cache=cache, prefix=True, last_only=True)
    norms = [jnp.sqrt(jnp.sum(jnp.square(layer.state), axis=(1, 2, 3)))
             for layer in out.cache.layers if isinstance(layer, KDACache)]
    return out.cache, jnp.stack(norms, axis=-1)  # [B, n_kda]


@dataclasses.dataclass
class StateNorms:
    """``norms [n_chunks, B, n_kda]``: Frobenius norm of each KDA layer's state ``[H, K, U]`` after each chunk;
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
