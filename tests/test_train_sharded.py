"""The train step on 2 simulated CPU devices equals the one-device step: data parallelism (batch over ``data``) and
tensor parallelism (parameters in the inference layout over ``model``), for a dense model over three steps (MoE
models on a mesh: tests/test_train_moe_sharded.py). Runs this file as a worker in a subprocess (jax must see 2
devices from its first import), like tests/sharding_run.py."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def _worker(out_path, family):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import kimi_jax
    from kimi_jax import training
    from kimi_jax.checkpoint.synthetic import llama_config_dict
    from kimi_jax.model import config as C
    from kimi_jax.model import params as params_lib
    from kimi_jax.model.run import RunConfig
    from kimi_jax.parallel.sharding import make_mesh

    assert jax.device_count() == 2
    cfg = C.from_dict(llama_config_dict())
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, (4, 16)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[3, 10:] = 0
    config = training.TrainConfig(optim=training.OptimConfig(lr=1e-2, warmup=0, steps=4))

    def run(mesh):
        model = kimi_jax.KimiModel(cfg, run=RunConfig(dtype=jnp.float32), param_dtype=jnp.float32,
                                   rngs=nnx.Rngs(0))
        model = training.prepare(model)
        trainer, state = training.init(model, config, mesh=mesh)
        step, _ = training.compile_steps(trainer)
        batch = training.Batch(jnp.asarray(ids), jnp.asarray(mask))
        if mesh is not None:
            sh = training.train.batch_sharding(ids.shape, mesh)
            batch = training.Batch(jax.device_put(batch.ids, sh), jax.device_put(batch.mask, sh))
        losses = []
        for _ in range(3):
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
        leaves = params_lib.leaves(state.params)
        split = {k: [int(s) for s in v.sharding.shard_shape(v.shape)] != list(v.shape) for k, v in leaves.items()}
        return losses, {k: np.asarray(v) for k, v in leaves.items()}, split, {
            k: np.asarray(v) for k, v in params_lib.leaves(state.bias).items()}

    base = run(None)
    out = {}
    for name, mesh in (("dp", make_mesh(data=2)), ("tp", make_mesh(model=2))):
        losses, p, split, bias = run(mesh)
        out[name] = {"losses": losses, "base_losses": base[0],
                     "param_err": max(float(np.max(np.abs(p[k] - base[1][k]))) for k in p),
                     "bias_err": max([float(np.max(np.abs(bias[k] - base[3][k]))) for k in bias] or [0.0]),
                     "split": sorted(k for k, s in split.items() if s)}
    with open(out_path, "w") as f:
        json.dump(out, f)


@pytest.fixture(scope="module", params=["llama"])
def result(request, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("train_sharded") / "out.json")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "tests.test_train_sharded", out, request.param], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise AssertionError(f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    with open(out) as f:
        return request.param, json.load(f)


@pytest.mark.parametrize("mesh", ["dp", "tp"])
def test_sharded_train_steps_equal_one_device(result, mesh):
    family, res = result
    r = res[mesh]
    print(f"\n{family} {mesh}: losses {r['losses']} vs one device {r['base_losses']}; max |param diff| "
          f"{r['param_err']:.2e}; bias {r['bias_err']:.2e}; split leaves {len(r['split'])}")
    assert r["base_losses"][2] < r["base_losses"][0]  # it trains
    np.testing.assert_allclose(r["losses"], r["base_losses"], rtol=1e-5)
    # Adam divides by sqrt(v): a gradient that differs in its last bits (another reduction order) moves a weight
    # by up to ~lr * relative difference; 3 steps at lr 1e-2 move weights by ~3e-2, so 5e-4 is under 2% of it.
    assert r["param_err"] < 5e-4  # (the dense models that train sharded have no router biases to compare)
    if mesh == "tp":  # the inference layout: attention heads / MLP width / vocab split over `model`
        assert any("q_proj" in k for k in r["split"]) and any("embed_tokens" in k for k in r["split"]), r["split"]


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
