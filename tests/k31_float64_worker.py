"""Runs a K3.1 checkpoint in float64 (``jax_enable_x64`` on from the start, in this process only) over token ids and
saves its logits, as tests/test_k31_model_oracle.py runs the float32 model: ``static``, a cached prefill of PREFILL
tokens then one decode step per token over a static cache; ``paged``, a prefill in two chunks then decode steps over
a paged cache (pages of 4 in shuffled order). Used by that module's float64 tests, which compare the logits with the
float64 oracle.

    python -m tests.k31_float64_worker CHECKPOINT IDS.npy PREFILL OUT.npz static|paged

OUT holds ``logits`` (``[B, T, V]``, every position's) and ``state_dtypes`` (the cache's KDA states' dtypes).
"""

from __future__ import annotations

import sys

import jax

jax.config.update("jax_enable_x64", True)

import functools  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from kimi_jax.checkpoint.loading import from_pretrained  # noqa: E402
from kimi_jax.model.cache import KDACache, init_cache, paged_cache  # noqa: E402


def _jitted(model):
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, static_argnames="prefix")
    def call(state, ids, cache, prefix, pages):
        out = nnx.merge(graphdef, state)(ids, cache=cache, prefix=prefix, page_table=pages)
        return out.logits, out.cache

    return lambda ids, cache, prefix=False, pages=None: call(state, jnp.asarray(ids), cache, prefix, pages)


def _states(cache) -> list[str]:
    return [str(e.state.dtype) for e, _ in cache.entries() if isinstance(e, KDACache)]


def main(path: str, ids_file: str, prefill: int, out_file: str, form: str) -> None:
    ids = np.load(ids_file)
    B, T = ids.shape
    model = from_pretrained(path, dtype="float64", progress=False)
    call = _jitted(model)
    if form == "static":
        cache, pages, calls = init_cache(model.cfg, B, T, jnp.float64), None, [(0, prefill, False)]
    elif form == "paged":
        ps, n_pages = 4, B * T // 4 + 2
        table = np.random.default_rng(4).permutation(n_pages)[:B * T // ps].reshape(B, T // ps).astype(np.int32)
        cache, pages = paged_cache(model.cfg, B, n_pages, ps, jnp.float64), jnp.asarray(table)
        calls = [(0, prefill // 2, True), (prefill // 2, prefill, True)]
    else:
        raise SystemExit(f"form {form!r}: static or paged")
    logits = []
    for a, b, prefix in calls + [(t, t + 1, True) for t in range(prefill, T)]:
        lg, cache = call(ids[:, a:b], cache, prefix=prefix, pages=pages)
        logits.append(np.asarray(lg))
    np.savez(out_file, logits=np.concatenate(logits, axis=1), state_dtypes=np.array(_states(cache)))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
