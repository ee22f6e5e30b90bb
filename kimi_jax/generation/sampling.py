"""What a decode step does with its logits: the sampler (temperature, top-k, top-p; greedy rows take the argmax) and
the loop state it appends to. Shared by the plain decode loop (:mod:`kimi_jax.generation.generate`), speculative
decoding (:mod:`kimi_jax.generation.speculative`) and the serving engine.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from kimi_jax.model.cache import Cache


class Graph:
    """A model's graph definition as a compiled loop's static argument, hashed once. jit hashes its static arguments
    on every call, and flax's ``GraphDef`` hashes its whole tree each time (about 2 ms for the demo model: more than
    two of its decode steps, per call). Equal definitions give equal ``Graph`` s, so they share compiled programs."""

    __slots__ = ("graphdef", "_hash")

    def __init__(self, graphdef):
        self.graphdef = graphdef
        self._hash = hash(graphdef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, Graph) and other.graphdef == self.graphdef)


def merge(graph, params):
    """``nnx.merge`` of a :class:`Graph` or a bare ``GraphDef`` (as the deviceless compiles pass it)."""
    return nnx.merge(graph.graphdef if isinstance(graph, Graph) else graph, params)


@struct.dataclass
class Sampling:
    temperature: jax.Array  # [B] float32; <= 0 means greedy
    top_k: jax.Array  # [B] int32; 0 = no top-k filter
    top_p: jax.Array  # [B] float32 in (0, 1]; 1 = no nucleus filter
    budget: jax.Array  # [B] int32 new tokens allowed (0 for unused batch slots)
    stop: jax.Array  # [n_stop] int32 stop ids, -1 = unused slot
    seed: jax.Array  # [] uint32


def _filtered(logits_V, temperature, top_k, top_p):
    """Temperature, then top-k, then top-p on the renormalised top-k distribution: (logits sorted descending with
    the filtered-out ones -inf, their token ids)."""
    V = logits_V.shape[-1]
    vals, idx = jax.lax.top_k(logits_V / jnp.maximum(temperature, 1e-6), V)  # sorted, descending
    rank = jnp.arange(V)
    vals = jnp.where((top_k <= 0) | (rank < top_k), vals, -jnp.inf)
    p = jax.nn.softmax(vals)
    mass_before = jnp.cumsum(p) - p
    vals = jnp.where((top_p >= 1.0) | (mass_before < top_p), vals, -jnp.inf)  # keeps rank 0 always
    return vals, idx


def _sample_one(logits_V, key, temperature, top_k, top_p):
    """One draw from the filtered distribution (:func:`_filtered`)."""
    vals, idx = _filtered(logits_V, temperature, top_k, top_p)
    return idx[jax.random.categorical(key, vals)]


def probabilities(logits_V, temperature, top_k, top_p):
    """The distribution :func:`sample` draws from for one row of float32 logits (temperature > 0), as ``[V]``
    float32 probabilities in vocabulary order: what rejection sampling compares a draft against."""
    vals, idx = _filtered(logits_V, temperature, top_k, top_p)
    return jnp.zeros_like(vals).at[idx].set(jax.nn.softmax(vals))


def argmax(logits_BV):
    """``jnp.argmax`` over the last axis (the first maximum; the first NaN if any) as int32, written as two plain
    reductions: XLA:CPU runs argmax's (value, index) reduction element by element (~150 us for a 32000-entry row,
    ~5x slower than the max and the min here)."""
    V = logits_BV.shape[-1]
    nan = jnp.isnan(logits_BV)
    top = jnp.max(logits_BV, axis=-1, keepdims=True)
    hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, logits_BV == top)
    return jnp.min(jnp.where(hit, jax.lax.broadcasted_iota(jnp.int32, logits_BV.shape, 1), V), axis=-1)


def sample(logits_BV, keys_B, temperature_B, top_k_B, top_p_B):
    """One token per row of float32 logits. Rows with temperature <= 0 take the argmax (first on ties, as
    torch); the sorting path only runs when some row samples."""
    greedy = argmax(logits_BV)
    stochastic = lambda: jax.vmap(_sample_one)(logits_BV, keys_B, temperature_B, top_k_B, top_p_B).astype(jnp.int32)
    drawn = jax.lax.cond(jnp.any(temperature_B > 0), stochastic, lambda: greedy)
    return jnp.where(temperature_B > 0, drawn, greedy)


def apply_bitmask(logits_xV, mask_xW):
    """``logits`` with the ids a constraint leaves out set to -inf. ``mask`` int32 ``[..., ceil(V / 32)]``, the
    leading axes as the logits': bit ``i % 32`` of word ``i // 32`` set when id ``i`` is allowed (llguidance's layout,
    :mod:`kimi_jax.text.grammar`); a row of all ones changes nothing."""
    ids = jnp.arange(logits_xV.shape[-1])
    word = jnp.take(mask_xW, ids // 32, axis=-1).astype(jnp.uint32)
    bit = jax.lax.shift_right_logical(word, jnp.broadcast_to((ids % 32).astype(jnp.uint32), word.shape)) & 1
    return jnp.where(bit == 1, logits_xV, -jnp.inf)


def step_keys(seed, count_B):
    """Key of sequence b for its n-th new token: fold_in(fold_in(key(seed), b), n) -- reproducible, and
    independent of how many steps each decode call runs."""
    base = jax.random.key(seed)
    b = jnp.arange(count_B.shape[0])
    return jax.vmap(lambda i, n: jax.random.fold_in(jax.random.fold_in(base, i), n))(b, count_B)


# -- the loop state ---------------------------------------------------------------------------------------


@struct.dataclass
class DecodeState:
    cache: Cache
    token: jax.Array  # [B] int32: last sampled token, the next step's input
    out: jax.Array  # [B, out_len] int32: new tokens, row b valid up to count[b]
    count: jax.Array  # [B] int32: new tokens so far
    done: jax.Array  # [B] bool
    logits: jax.Array | None = None  # [B, out_len, V] float32: the logits each new token was drawn from (optional)


def draw(logits_BV, samp: Sampling, count_B):
    """Each row's next token (its ``count``-th new one) from float32 logits: greedy rows the argmax, the others
    :func:`sample`; the keys are only derived when some row samples, so greedy decoding skips the PRNG work."""
    return jax.lax.cond(
        jnp.any(samp.temperature > 0),
        lambda: sample(logits_BV, step_keys(samp.seed, count_B), samp.temperature, samp.top_k, samp.top_p),
        lambda: argmax(logits_BV))


def accept(st: DecodeState, logits_BV, samp: Sampling, active_B) -> DecodeState:
    """Sample from ``logits`` for active rows and append; inactive rows keep everything."""
    tok = jnp.where(active_B, draw(logits_BV, samp, st.count), st.token)
    B, out_len = st.out.shape
    rows = jnp.arange(B)
    slot = jnp.where(active_B, st.count, out_len)  # out_len: out of range, dropped
    out = st.out.at[rows, slot].set(tok, mode="drop")
    logits = st.logits
    if logits is not None:
        logits = logits.at[rows, slot].set(logits_BV, mode="drop")
    count = st.count + active_B.astype(jnp.int32)
    stopped = jnp.any(tok[:, None] == samp.stop[None, :], axis=-1)
    done = st.done | (active_B & (stopped | (count >= samp.budget)))
    return DecodeState(st.cache, tok, out, count, done, logits)
