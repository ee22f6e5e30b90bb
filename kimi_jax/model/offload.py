"""Offload: KDA state, the MLA / KV cache and the routed experts kept in host memory, brought to the device per layer.

What is unusual here: placement is a *memory kind*, not a device. Offloaded arrays live with shardings whose
``memory_kind`` is ``"pinned_host"`` (same devices, same partition spec); inside the compiled step the model moves
each one to device memory right before its layer uses it (``jax.device_put(x, jax.memory.Space.Device)``) and moves
a layer's new cache entry back (``Space.Host``) before the layer returns. The copies are left to XLA's scheduler
(asynchronous host <-> device copies on TPU and GPU; plain copies on XLA:CPU, which has one memory, where the
offloaded path must give the on-device logits bit for bit).

Kinds (``RunConfig.offload``, :data:`kimi_jax.model.run.OFFLOAD_KINDS`):
  * ``"kda_state"``: every KDA cache entry (recurrent state and the three conv tails);
  * ``"cache"``: every MLA / GQA cache entry (an int8 cache: every part);
  * ``"experts"``: every routed-expert weight (a packed weight: every field). A decode-sized call moves only the
    experts its tokens chose (:func:`fetch_experts`), a larger one its layer's whole stack, which may start once
    the previous layer has (``after``).

What this costs a deployment, and what the compilers make of it, is :mod:`kimi_jax.deploy.offload`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kernels_pallas._dispatch import host_slices
from kimi_jax.model.cache import KDACache
from kimi_jax.model.run import check_offload

HOST = "pinned_host"
def entry_kind(entry) -> str:
    """The offload kind of a cache entry: ``"kda_state"`` for a KDA entry, else ``"cache"``."""
    return "kda_state" if isinstance(entry, KDACache) else "cache"


# -- inside the model (traced) -----------------------------------------------------------------------------


def to_device(tree, after=None):
    """Every array of ``tree`` in device memory (a no-op copy for arrays already there). ``after``: arrays the copies
    wait for (an ``optimization_barrier``): without it the compilers start every layer's copy at the top of the step
    and hold them all in device memory at once."""
    if after is not None:
        tree, _ = jax.lax.optimization_barrier((tree, after))
    return jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Device), tree)


def to_host(tree):
    """Every array of ``tree`` in host memory."""
    return jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Host), tree)


def fetch_entry(entry, run, after=None):
    """A layer's cache entry (or None) in device memory when its kind is offloaded under ``run``; the copy waits for
    ``after`` (:func:`to_device`)."""
    if entry is None or entry_kind(entry) not in run.offload:
        return entry
    return to_device(entry, after)


def store_entry(entry, run):
    """A layer's new cache entry back in host memory when its kind is offloaded under ``run``."""
    if entry is None or entry_kind(entry) not in run.offload:
        return entry
    return to_host(entry)


class HotExperts(nnx.Variable):
    """The routed experts of one MoE layer that are also kept in device memory while the layer's weights live in host
    memory (:func:`kimi_jax.model.hot_experts.keep_hot_experts`): ``{"slot": int32 [E] (the row of ``rows`` holding expert e, -1 where it is
    in host memory only), "rows": the weights' pytree with leading dimension H}``. Derived state, not a parameter:
    never saved, counted or trained."""


def fetch_experts(weights, idx_NX, run, *, routed: bool, after=None, hot=None):
    """Routed-expert weights (a pytree: arrays or packed weights, every leaf ``[E, ...]``) in device memory when
    ``run`` offloads them, and the expert ids ``[N, X]`` that index what comes back.

    ``routed`` (the caller's gather path: few pairs): only the chosen experts move, one ``[1, ...]`` slice of every
    leaf per (token, expert) slot, stacked on the device as ``[N*X, ...]`` (slot ``k`` holds expert
    ``idx_NX.flat[k]``; a repeated expert is moved once per slot), with the ids ``0 .. N*X-1``. The slices depend
    only on ``idx_NX``, so they start as soon as the router has chosen. Otherwise (or where the compiler cannot
    slice these leaves out of host memory, :func:`kernels_pallas._dispatch.host_slices`) the whole layer moves, waiting for ``after``
    (:func:`to_device`).

    ``hot`` (the value of a :class:`HotExperts`, or None): on the routed path a slot whose expert is hot is read from
    the device copy and nothing crosses the host link for it; each slot's choice is a ``lax.cond``, so the copy of a
    cold expert runs only when one was chosen."""
    if "experts" not in run.offload:
        return weights, idx_NX
    if routed and host_slices(jax.tree.leaves(weights), run.placement):
        return fetch_slots(weights, idx_NX, hot)
    return to_device(weights, after), idx_NX


def fetch_slots(weights, idx_NX, hot=None):
    """(every leaf's rows ``idx_NX.flat`` as ``[N*X, ...]`` in device memory, ids ``arange(N*X)`` as ``[N, X]``).
    Each row is a dynamic slice of the host array moved on its own: the TPU and GPU compilers turn that into one
    asynchronous copy of the slice (``dynamic-slice-start`` / ``fusion-start`` on a host operand); a gather
    (``jnp.take``) of a host array is refused by JAX, and a stack built in host memory first becomes host compute
    on XLA:GPU. With ``hot`` (:class:`HotExperts`' value) a slot of a hot expert takes its row from the device copy
    instead, behind a ``lax.cond`` per slot (XLA:GPU keeps the slice copy inside the cold branch)."""
    N, X = idx_NX.shape
    ids = idx_NX.reshape(N * X)
    from_host = lambda e: jax.tree.map(  # noqa: E731
        lambda a: jax.device_put(jax.lax.dynamic_slice_in_dim(a, e, 1, 0), jax.memory.Space.Device), weights)
    if hot is None:
        rows = [from_host(ids[k]) for k in range(N * X)]
    else:
        slot = hot["slot"][ids]

        def one(e, s):
            from_device = lambda: jax.tree.map(  # noqa: E731
                lambda a: jax.lax.dynamic_slice_in_dim(a, jnp.maximum(s, 0), 1, 0), hot["rows"])
            return jax.lax.cond(s >= 0, from_device, lambda: from_host(e))

        rows = [one(ids[k], slot[k]) for k in range(N * X)]
    return (jax.tree.map(lambda *r: jnp.concatenate(r), *rows),
            jnp.arange(N * X, dtype=jnp.int32).reshape(N, X))


# -- placing arrays ----------------------------------------------------------------------------------------


def host_sharding(sharding):
    """``sharding`` with host memory: same devices and spec, ``memory_kind="pinned_host"``."""
    return sharding.with_memory_kind(HOST)


def _is_expert_path(path) -> bool:
    names = [str(getattr(k, "key", k)) for k in path]
    return "experts" in names and any(w in names for w in ("w1", "w2", "w3"))


def is_expert_leaf(name: str) -> bool:
    """Whether a parameter leaf (``"layers.3.mlp.experts.w1.packed"``, :func:`kimi_jax.model.params.leaves`) belongs to
    a routed-expert weight: what ``offload=("experts",)`` keeps in host memory."""
    return _is_expert_path(name.split("."))


def place_model(model, kinds=None):
    """Move ``model``'s routed-expert weights (every field of a packed weight) to host memory, in place, when
    ``kinds`` (default: the model's ``run.offload``) holds ``"experts"``. Returns the model."""
    kinds = check_offload(model.run.offload if kinds is None else kinds)
    if "experts" not in kinds:
        return model
    state = nnx.state(model)
    flat = []
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        if _is_expert_path(path):
            value = jax.tree.map(lambda a: a if a.sharding.memory_kind == HOST
                                 else jax.device_put(a, host_sharding(a.sharding)), value)
        flat.append((path, var.replace(value)))
    nnx.update(model, nnx.from_flat_state(flat))
    return model


def place_cache(cache, kinds):
    """``cache`` with the entries of the offloaded ``kinds`` in host memory (unrolled and stacked entries)."""
    kinds = check_offload(kinds)
    if not kinds:
        return cache
    move = lambda e: (jax.tree.map(lambda a: jax.device_put(a, host_sharding(a.sharding)), e)  # noqa: E731
                      if e is not None and entry_kind(e) in kinds else e)
    return cache.replace(layers=tuple(move(e) for e in cache.layers), stack=tuple(move(e) for e in cache.stack))


def cache_host_shardings(cache_shardings, cache_shapes, kinds):
    """The cache's shardings (a :class:`~kimi_jax.model.cache.Cache` of them, matching ``cache_shapes``) with the
    offloaded kinds' entries in host memory."""
    kinds = check_offload(kinds)

    def move(e, s):
        if e is None or entry_kind(e) not in kinds:
            return s
        return jax.tree.map(host_sharding, s)

    return cache_shardings.replace(layers=tuple(map(move, cache_shapes.layers, cache_shardings.layers)),
                                   stack=tuple(map(move, cache_shapes.stack, cache_shardings.stack)))


def fetches_routed(pairs: int, num_experts: int, path: str = "gather") -> bool:
    """The one rule for moving only the chosen experts (the model's :meth:`~kimi_jax.model.moe.Experts.fetch` and
    the plan's :func:`routed_slots`): the products gather (``path``, one expert read per (token, expert) pair) and
    the pairs do not outnumber the layer's experts. On TPU and GPU the products gather exactly then
    (:func:`kernels_pallas.moe_gmm.expert_path`); a forced gather of more pairs would move more than the layer."""
    return path == "gather" and pairs <= num_experts
