"""Training a DSpark drafter (:mod:`kimi_jax.model.dspark`) for a target model, on the target's own outputs.

Data (:func:`collect`): token sequences -- prompts and the target's greedy continuations -- run once through the
target; kept per sequence are the tapped layers' hidden states (the drafter's context input) and the target's greedy
choice after every position (the label: what verification will accept).

A training row is (sequence, anchor position ``p``): the drafter sees the context of positions ``< p`` and the block
``[token p, mask, ..]``; slot ``i`` is trained towards the target's choice after position ``p + i``, with the
Markov head fed the previous label (the anchor for slot 0), as at inference when the earlier drafts were accepted.
Loss: cross-entropy per slot weighted by ``exp(-i / gamma)`` (DSpark's position decay, gamma = 4), averaged.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from kimi_jax.model.dspark import DSparkModel, target_taps
from kimi_jax.training.optim import OptimConfig, optimizer

GAMMA = 4.0  # DSpark's position decay of the loss


@dataclasses.dataclass
class DrafterData:
    tokens: np.ndarray  # [N, S] int32
    taps: np.ndarray  # [N, S, X]: the target's hidden states at the tapped layers, concatenated
    labels: np.ndarray  # [N, S] int32: the target's greedy token after each position
    first: np.ndarray  # [N] int32: the first anchor position to train on (the target's own output starts there)
    stop: np.ndarray  # [N] int32: each sequence's length (padding after it)


@functools.partial(jax.jit, static_argnames=("graphdef", "taps", "stream"))
def _target_pass(graphdef, params, ids, taps: tuple[int, ...], stream: str):
    model = nnx.merge(graphdef, params)
    res = model(ids, return_hidden=True)
    return target_taps(model, res, taps, stream), jnp.argmax(res.logits, axis=-1).astype(jnp.int32)


def collect(target, sequences: np.ndarray, first: np.ndarray, stop: np.ndarray, taps: tuple[int, ...],
            batch: int = 16, stream: str = "prefix") -> DrafterData:
    """Run ``sequences [N, S]`` (right-padded: ``stop`` tokens each) through ``target`` (a
    :class:`~kimi_jax.model.decoder.KimiModel`) for the tapped layers' hidden states and the greedy labels."""
    graphdef, params = nnx.split(target)
    xs, ls = [], []
    for i in range(0, len(sequences), batch):
        chunk = sequences[i:i + batch]
        pad = batch - len(chunk)
        ids = np.pad(chunk, [(0, pad), (0, 0)])
        x, lab = _target_pass(graphdef, params, jnp.asarray(ids), tuple(taps), stream)
        xs.append(np.asarray(x, np.float32)[:len(chunk)])
        ls.append(np.asarray(lab)[:len(chunk)])
    return DrafterData(np.asarray(sequences, np.int32), np.concatenate(xs), np.concatenate(ls),
                       np.asarray(first, np.int32), np.asarray(stop, np.int32))


def rows(data: DrafterData, n: int, count: int, rng: np.random.Generator):
    """``count`` random (sequence, anchor) rows: (sequence index, anchor position), each anchor with ``n`` labels
    after it inside the sequence."""
    seq = rng.integers(0, len(data.tokens), count)
    lo, hi = data.first[seq], data.stop[seq] - n - 1  # the last label must be a choice after a real token
    p = lo + (rng.random(count) * np.maximum(hi - lo + 1, 1)).astype(np.int64)
    return seq, np.clip(p, 0, np.maximum(hi, 0))


def loss(dmodel: DSparkModel, table, head, taps_RSX, tokens_RS, labels_RS, p_R, n: int):
    """The position-weighted cross-entropy of a batch of rows (module docstring) and the share of slots whose
    greedy draft (given accepted earlier drafts) is the label."""
    R, S, _ = taps_RSX.shape
    cache = dmodel.write_context(dmodel.empty_cache(R, S, jnp.float32), taps_RSX, jnp.zeros((R,), jnp.int32),
                                 jnp.full((R,), S, jnp.int32))
    anchor = jnp.take_along_axis(tokens_RS, p_R[:, None], axis=1)[:, 0]
    base = dmodel.base_logits(cache, table, head, anchor, p_R, n)  # [R, n, V]
    idx = p_R[:, None] + jnp.arange(n)[None]
    want = jnp.take_along_axis(labels_RS, idx, axis=1)  # [R, n]
    prev = jnp.concatenate([anchor[:, None], want[:, :-1]], axis=1)
    logits = base + dmodel.markov_head(prev, dmodel.run)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, want)
    w = jnp.exp(-jnp.arange(n) / GAMMA)
    hit = jnp.mean((jnp.argmax(logits, -1) == want).astype(jnp.float32), axis=0)
    return jnp.mean(ce * w) / jnp.mean(w), hit


def train(dmodel: DSparkModel, target, data: DrafterData, *, steps: int, batch: int = 64, lr: float = 3e-3,
          seed: int = 0, log=None) -> list[float]:
    """Train ``dmodel`` in place on ``data`` with the project's optimizer (clip + AdamW + warmup-cosine); the
    target's embedding and lm_head stay frozen. Returns the loss per step."""
    n = dmodel.cfg.block_size
    table = target.embed_tokens[...].astype(jnp.float32)
    head = table if target.cfg.tie_word_embeddings else target.lm_head[...].astype(jnp.float32)
    opt = nnx.Optimizer(dmodel, optimizer(OptimConfig(lr=lr, steps=steps, warmup=min(100, steps // 10))),
                        wrt=nnx.Param)

    @nnx.jit
    def step(dmodel, opt, taps, tokens, labels, p):
        (value, hit), grads = nnx.value_and_grad(loss, has_aux=True)(dmodel, table, head, taps, tokens, labels, p, n)
        opt.update(dmodel, grads)
        return value, hit

    rng = np.random.default_rng(seed)
    losses = []
    for t in range(steps):
        seq, p = rows(data, n, batch, rng)
        value, hit = step(dmodel, opt, jnp.asarray(data.taps[seq]), jnp.asarray(data.tokens[seq]),
                          jnp.asarray(data.labels[seq]), jnp.asarray(p, jnp.int32))
        losses.append(float(value))
        if log is not None and (t % 100 == 0 or t == steps - 1):
            log(t, float(value), np.asarray(hit).round(3).tolist())
    return losses
