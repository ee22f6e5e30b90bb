"""Training: chunked causal-LM loss, AdamW + warmup-cosine + clipping (optax), the jitted (sharded) train step,
auxiliary-loss-free expert balancing, LoRA, Orbax train checkpoints and export to the released HF layouts.

    from kimi_jax import training
    model = training.prepare(kimi_jax.from_pretrained(path, dtype="float32"), dtype="bfloat16")
    trainer, state = training.init(model, training.TrainConfig(optim=training.OptimConfig(lr=3e-3, steps=300)))
    step, evaluate = training.compile_steps(trainer)
    state, metrics = step(state, training.Batch(ids_BT, mask_BT))
    training.export_hf(trainer.model(state), raw_config, out_dir)   # MXFP4 experts re-packed, LoRA merged
"""

from kimi_jax.training.export import export_hf  # noqa: F401
from kimi_jax.training.lora import LoraConfig  # noqa: F401
from kimi_jax.training.loss import causal_lm_loss, token_nll  # noqa: F401
from kimi_jax.training.optim import OptimConfig, optimizer, schedule  # noqa: F401
from kimi_jax.training.train import (Batch, TrainConfig, Trainer, TrainState, compile_steps, eval_loss,  # noqa: F401
                                     init, loss_and_grads, prepare, train_step, training_run)
