"""The serving engine on a mesh of 8 simulated CPU devices (run by tests/test_engine.py in a subprocess: jax must see
the devices from its first import). Serves the same requests, prefix hits included, on one device and on a mesh;
prints one JSON line of the largest logit difference and whether every token matched. A third argument, a drafter
(``"dspark:DIR"``, ``"draft:DIR"``): both engines run it (no logits recorded then)."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import numpy as np  # noqa: E402

import kimi_jax  # noqa: E402
from kimi_jax.parallel.sharding import make_mesh  # noqa: E402
from kimi_jax.serving.engine import Engine  # noqa: E402


def serve(model, prompts, drafter=None):
    spec = dict(speculative=drafter) if drafter else dict(record_logits=True)
    eng = Engine(model, slots=4, max_len=96, page_size=16, prefill_chunk=32, min_chunk=32, **spec)
    eng.warmup()
    first = eng.generate(prompts[:2], max_tokens=6, stop_ids=())
    rest = eng.generate(prompts[2:], max_tokens=6, stop_ids=())  # prefix hits on the first two
    return first + rest, eng


def main():
    path, mesh_text, drafter = sys.argv[1], sys.argv[2], (sys.argv[3:] or [None])[0]
    data, expert, model_axis = (int(v) for v in mesh_text.split("x"))
    one = kimi_jax.from_pretrained(path, dtype="float32", progress=False)
    rng = np.random.default_rng(0)
    V = one.cfg.vocab_size
    a, b = rng.integers(3, V, 45).tolist(), rng.integers(3, V, 20).tolist()
    prompts = [a, b, a + [5, 6, 7], b + [9] * 12]
    ref, _ = serve(one, prompts, drafter)
    sharded = kimi_jax.from_pretrained(path, dtype="float32", progress=False,
                                       mesh=make_mesh(data, expert, model_axis))
    got, eng = serve(sharded, prompts, drafter)
    leaf = eng.cache.layers[0].state  # a KDA state: its heads split over the model axis
    print(json.dumps({
        "tokens_equal": all(r.tokens == g.tokens for r, g in zip(ref, got)),
        "max_diff": None if drafter else max(float(np.abs(r.logits - g.logits).max()) for r, g in zip(ref, got)),
        "spec": {k: eng.stats()[k] for k in ("spec_steps", "spec_drafted", "spec_accepted")},
        "cached": [g.cached_tokens for g in got],
        "state_sharding": str(leaf.sharding.spec),
        "compiles_after_warmup": eng.stats()["compiles_after_warmup"],
        "draft_state_sharding": (None if eng.executor.dcache is None else
                                 str(eng.executor.dcache.layers[0].state.sharding.spec)),
        "drafter_o_proj": (None if eng.executor.dparams is None or eng.executor.pool_shapes is None else
                           str(eng.executor.dparams["layers"][0]["self_attn"]["o_proj"][...].sharding.spec)),
    }))


if __name__ == "__main__":
    main()
