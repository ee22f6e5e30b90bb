"""The recall study: does KDA's fixed-size state lose what attention keeps?

Four models of one size are trained from scratch, with one token budget, on two synthetic associative-recall tasks,
then scored at growing context lengths beside the bytes each keeps per sequence to generate:

* ``kda`` (every layer Kimi Delta Attention), ``hybrid`` (K3's pattern: three KDA layers, then gated NoPE MLA),
  ``mla`` (every layer MLA): the K3 skeleton (Block AttnRes, SiTU MLPs), only the token mixers differ;
* ``gqa``: the dense ``KimiForCausalLM`` shape (grouped-query attention with RoPE, SwiGLU MLPs).

Tasks (token ids: 0 padding, 1 the query marker, then keys, values and filler in disjoint ranges):

* **MQAR** (multi-query associative recall, Zoology, Arora et al. 2023, as its training set poses it): ``L/16``
  key-value pairs, then each key again at a random later place (padding between), followed by its value; the
  values after the repeated keys are scored. (An earlier form with ``L/4`` pairs and the queries packed right
  after them was not learned by any model at this budget.)
* **Needle**: a haystack of filler tokens holding ``NEEDLES`` key-value pairs at random places, closed by
  ``[Q] key value`` for each; the values after the final keys are scored.

Accuracy is the fraction of scored values predicted exactly (greedy, teacher-forced). Cache bytes are
:func:`kimi_jax.model.cache.cache_bytes` for one sequence of the length, the KDA state counted once, and the
measured ``nbytes`` of the cache :func:`kimi_jax.model.cache.init_cache` allocates.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from kimi_jax import training
from kimi_jax.analysis.memory import measured_cache_bytes
from kimi_jax.model import config as C
from kimi_jax.model.cache import cache_bytes
from kimi_jax.model.decoder import KimiModel, param_count

PAD, QUERY = 0, 1
NUM_KEYS, NUM_VALUES, NUM_FILLER = 128, 64, 62
KEY0 = 2
VALUE0 = KEY0 + NUM_KEYS
FILLER0 = VALUE0 + NUM_VALUES
VOCAB = FILLER0 + NUM_FILLER  # 256
NEEDLES = 4
PAIRS_PER = 16  # MQAR: one key-value pair per 16 tokens
MODELS = ("kda", "hybrid", "mla", "gqa")


@dataclasses.dataclass(frozen=True)
class Study:
    """One setting of the study: model width and depth, the training run, the lengths trained and scored."""

    hidden: int = 64
    layers: int = 4
    heads: int = 2
    head_dim: int = 32
    steps: int = 2000
    batch: int = 32
    lr: float = 3e-3
    train_lengths: tuple = (64, 128)
    eval_lengths: tuple = (64, 128, 256, 512)
    eval_batches: int = 4
    seed: int = 0


def mqar(rng: np.random.Generator, batch: int, length: int):
    """``(ids [B, L] int32, scored [B, L] bool)``: MQAR as Zoology trains it, ``L/16`` key-value pairs (4 at 64
    tokens, 8 at 128, 32 at 512) first, then every key asked once more at a random place in the rest of the sequence
    (padding between), each followed by its value; ``scored[t]`` where ``ids[t]`` is such a value."""
    n = max(1, length // PAIRS_PER)
    if n > NUM_KEYS:
        raise ValueError(f"mqar: length {length} needs {n} distinct keys, the vocabulary has {NUM_KEYS}")
    ids = np.full((batch, length), PAD, np.int32)
    scored = np.zeros((batch, length), bool)
    room = (length - 2 * n) // 2  # even offsets after the pairs: a query and its value never overlap another
    if room < n:
        raise ValueError(f"mqar: length {length} is too short for {n} pairs and their queries")
    for b in range(batch):
        keys = KEY0 + rng.choice(NUM_KEYS, n, replace=False)
        values = VALUE0 + rng.integers(0, NUM_VALUES, n)
        ids[b, 0:2 * n:2], ids[b, 1:2 * n:2] = keys, values
        at = 2 * n + 2 * np.sort(rng.choice(room, n, replace=False))
        asked = rng.permutation(n)
        ids[b, at], ids[b, at + 1] = keys[asked], values[asked]
        scored[b, at + 1] = True
    return ids, scored


def needle(rng: np.random.Generator, batch: int, length: int):
    """``(ids, scored)``: ``NEEDLES`` key-value pairs hidden in filler, each asked for at the end after ``[Q]``."""
    tail = 3 * NEEDLES
    if length < tail + 2 * NEEDLES + 1:
        raise ValueError(f"needle: length {length} is too short for {NEEDLES} needles")
    ids = (FILLER0 + rng.integers(0, NUM_FILLER, (batch, length))).astype(np.int32)
    scored = np.zeros((batch, length), bool)
    room = length - tail
    for b in range(batch):
        keys = KEY0 + rng.choice(NUM_KEYS, NEEDLES, replace=False)
        values = VALUE0 + rng.integers(0, NUM_VALUES, NEEDLES)
        slots = np.sort(rng.choice(room // 2, NEEDLES, replace=False)) * 2  # even offsets: pairs never overlap
        ids[b, slots], ids[b, slots + 1] = keys, values
        order = rng.permutation(NEEDLES)
        at = room + 3 * np.arange(NEEDLES)
        ids[b, at], ids[b, at + 1], ids[b, at + 2] = QUERY, keys[order], values[order]
        scored[b, at + 2] = True
    return ids, scored


TASKS = {"mqar": mqar, "needle": needle}


def config_dict(kind: str, s: Study) -> dict:
    """The config.json of one of :data:`MODELS` at the study's size (dense MLPs, no experts)."""
    if kind == "gqa":
        return {"architectures": ["KimiForCausalLM"], "model_type": "kimi", "vocab_size": VOCAB,
                "hidden_size": s.hidden, "intermediate_size": 3 * s.hidden, "num_hidden_layers": s.layers,
                "num_attention_heads": s.heads, "num_key_value_heads": s.heads, "head_dim": s.head_dim,
                "rms_norm_eps": 1e-6, "rope_theta": 1e4, "tie_word_embeddings": False, "hidden_act": "silu",
                "bos_token_id": PAD, "eos_token_id": PAD, "dtype": "float32"}
    schedule = {"kda": ["kda"] * s.layers, "mla": ["mla"] * s.layers,
                "hybrid": [("mla" if (i + 1) % 4 == 0 else "kda") for i in range(s.layers)]}[kind]
    c = C.tiny_k3_config_dict()
    t = c["text_config"]
    for k in ("num_experts", "num_experts_per_token", "moe_intermediate_size", "routed_expert_hidden_size",
              "num_shared_experts", "quantization_config", "latent_moe_use_norm", "moe_router_activation_func",
              "moe_renormalize", "routed_scaling_factor", "topk_method", "use_grouped_topk", "num_expert_group",
              "topk_group", "first_k_dense_replace", "moe_layer_freq"):
        t.pop(k, None)
    t.update(vocab_size=VOCAB, hidden_size=s.hidden, num_hidden_layers=s.layers, num_attention_heads=s.heads,
             num_key_value_heads=s.heads, intermediate_size=2 * s.hidden, attn_res_block_size=2,
             q_lora_rank=2 * s.hidden, kv_lora_rank=s.head_dim, qk_nope_head_dim=s.head_dim, qk_rope_head_dim=16,
             v_head_dim=s.head_dim, bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD, dtype="float32")
    la = {"kda_layers": [i + 1 for i, a in enumerate(schedule) if a == "kda"]}
    if "kda" in schedule:
        la.update(num_heads=s.heads, head_dim=s.head_dim, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                  use_full_rank_gate=True)
    t["linear_attn_config"] = la
    c.update(bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD)
    return c


def build(kind: str, s: Study):
    cfg = C.from_dict(config_dict(kind, s))
    return KimiModel(cfg, param_dtype=jnp.float32, rngs=nnx.Rngs(s.seed))


def batch_of(rng, s: Study, length: int):
    """Half MQAR, half needle, one length: ``(ids, scored)``."""
    a = mqar(rng, s.batch // 2, length)
    b = needle(rng, s.batch - s.batch // 2, length)
    return np.concatenate([a[0], b[0]]), np.concatenate([a[1], b[1]])


def train(kind: str, s: Study, log=None):
    """Train one model; returns ``(model, seconds, final loss)``. The loss counts the scored values only."""
    model = build(kind, s)
    training.prepare(model, dtype="float32")
    optim = training.OptimConfig(lr=s.lr, steps=s.steps, warmup=max(1, s.steps // 10), weight_decay=0.0)
    trainer, state = training.init(model, training.TrainConfig(optim=optim, seed=s.seed))
    step, _ = training.compile_steps(trainer)
    rng = np.random.default_rng([s.seed, 1])
    t0, loss = time.perf_counter(), float("nan")
    for i in range(s.steps):
        ids, scored = batch_of(rng, s, s.train_lengths[i % len(s.train_lengths)])
        state, metrics = step(state, training.Batch(jnp.asarray(ids), jnp.asarray(scored)))
        if log is not None and (i + 1) % max(1, s.steps // 10) == 0:
            loss = float(metrics["loss"])
            log(f"{kind}: step {i + 1}/{s.steps} loss {loss:.3f}")
    loss = float(metrics["loss"])
    return trainer.model(state), time.perf_counter() - t0, loss


@nnx.jit
def _predict(model, ids):
    return jnp.argmax(model(ids).logits, axis=-1)


def accuracy(model, task: str, length: int, s: Study) -> float:
    """Fraction of scored values the model predicts exactly, over ``eval_batches`` fresh batches (a fixed seed)."""
    rng = np.random.default_rng([s.seed, 2, length, list(TASKS).index(task)])
    right = total = 0
    for _ in range(s.eval_batches):
        ids, scored = TASKS[task](rng, s.batch, length)
        pred = np.asarray(_predict(model, jnp.asarray(ids)))  # pred[t] is the guess for ids[t + 1]
        hit = pred[:, :-1] == ids[:, 1:]
        right += int(hit[scored[:, 1:]].sum())
        total += int(scored[:, 1:].sum())
    return right / total


def run(s: Study = Study(), models: Sequence[str] = MODELS, log=print) -> list[dict]:
    """Train and score every model; one row per (model, length): ``model``, ``seed``, ``params``, ``length``, ``mqar``,
    ``needle`` (accuracies), ``cache_bytes`` (planned, one sequence), ``measured_bytes``, ``train_seconds``,
    ``final_loss``."""
    rows = []
    for kind in models:
        model, seconds, loss = train(kind, s, log)
        n = param_count(model)
        log(f"{kind}: {n} parameters, trained in {seconds:.0f} s, final loss {loss:.3f}")
        for length in s.eval_lengths:
            row = {"model": kind, "seed": s.seed, "params": n, "length": length,
                   **{t: accuracy(model, t, length, s) for t in TASKS},
                   "cache_bytes": cache_bytes(model.cfg, 1, length, jnp.float32)["total"],
                   "measured_bytes": measured_cache_bytes(model.cfg, length, dtype=jnp.float32),
                   "train_seconds": seconds, "final_loss": loss}
            log(f"  length {length}: mqar {row['mqar']:.3f} needle {row['needle']:.3f} cache "
                f"{row['cache_bytes'] / 1e3:.1f} kB")
            rows.append(row)
    return rows


def _seeds(rows) -> list:
    return sorted({r["seed"] for r in rows})


def table(rows: list[dict]) -> str:
    """A markdown table of :func:`run`'s rows; rows of several seeds share a line, their accuracies joined by
    ``/`` in seed order."""
    seeds = _seeds(rows)
    by = {}
    for r in rows:
        by.setdefault((r["model"], r["length"]), {})[r["seed"]] = r
    label = f" (seed {' / '.join(map(str, seeds))})" if len(seeds) > 1 else ""
    head = (f"| model | parameters | context | MQAR accuracy{label} | needle accuracy{label} | cache per sequence "
            "(plan / allocated) |")
    lines = [head, "|---|---|---|---|---|---|"]
    for (kind, length), per in by.items():
        r = next(iter(per.values()))
        acc = lambda task: " / ".join(f"{per[s][task]:.3f}" if s in per else "-" for s in seeds)  # noqa: E731
        lines.append(f"| {kind} | {r['params'] / 1e3:.0f}K | {length} | {acc('mqar')} | {acc('needle')} "
                     f"| {r['cache_bytes'] / 1e3:.1f} / {r['measured_bytes'] / 1e3:.1f} kB |")
    return "\n".join(lines)


def plot(rows: list[dict]):
    """Accuracy vs context length and vs cache bytes per sequence, one line per model (and seed) and task."""
    import matplotlib.pyplot as plt  # optional (the notebooks extra): figures only

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    several = len(_seeds(rows)) > 1
    for kind, seed in dict.fromkeys((r["model"], r["seed"]) for r in rows):
        rs = [r for r in rows if r["model"] == kind and r["seed"] == seed]
        name = f"{kind} seed {seed}" if several else kind
        for task, style in (("mqar", "-o"), ("needle", "--s")):
            axes[0].plot([r["length"] for r in rs], [r[task] for r in rs], style, label=f"{name} {task}")
            axes[1].plot([r["cache_bytes"] / 1e3 for r in rs], [r[task] for r in rs], style, label=f"{name} {task}")
    axes[0].set(xscale="log", xlabel="context length (tokens)", ylabel="accuracy (fraction of values)",
                title="Associative recall vs context length")
    axes[1].set(xscale="log", xlabel="cache per sequence (kB, float32)", ylabel="accuracy (fraction of values)",
                title="Associative recall vs state / cache bytes")
    for ax in axes:
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
