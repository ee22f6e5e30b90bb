"""Deployment planning as rows: common K3 deployments (:data:`DEPLOYMENTS`: H200 nodes, TPU v5p and v7x slices),
one :func:`kimi_jax.deploy.plan.make_plan` per deployment as a table row (:func:`plan_rows`: bytes per chip,
whether it fits, roofline decode speed), and roofline decode throughput vs batch size (:func:`roofline_vs_batch`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from kimi_jax.deploy import plan
from kimi_jax.model.config import ModelConfig

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Deployment:
    name: str  # e.g. "2 x 8 H200"
    chip: str  # a key of kimi_jax.deploy.plan.CHIPS
    sizes: tuple  # ((axis, n), ...) over data / expert / model
    layout: str = "tp_ep"

    @property
    def chips(self) -> int:
        return math.prod(n for _, n in self.sizes)


# Common K3 deployments: H200 nodes of 8 GPUs, TPU v5p and v7x pod slices (chip counts; a v5p chip has two
# TensorCores, so "v5p-64" is 32 chips). Tensor parallelism stays within 8 chips (one NVLink node / a torus
# dimension); expert parallelism spans the rest. "wide EP" spreads experts over every chip, as SGLang's TP16/EP16.
DEPLOYMENTS = (
    Deployment("1 x 8 H200", "h200", (("expert", 1), ("model", 8))),
    Deployment("2 x 8 H200", "h200", (("expert", 2), ("model", 8))),
    Deployment("2 x 8 H200, wide EP", "h200", (("expert", 1), ("model", 16)), "wide_ep"),
    Deployment("4 x 8 H200", "h200", (("expert", 4), ("model", 8))),
    Deployment("TPU v5p, 32 chips", "v5p", (("expert", 4), ("model", 8))),
    Deployment("TPU v5p, 64 chips", "v5p", (("expert", 8), ("model", 8))),
    Deployment("TPU v5p, 128 chips", "v5p", (("expert", 16), ("model", 8))),
    Deployment("TPU v7x, 16 chips", "v7x", (("expert", 2), ("model", 8))),
    Deployment("TPU v7x, 32 chips", "v7x", (("expert", 4), ("model", 8))),
    Deployment("TPU v7x, 64 chips", "v7x", (("expert", 8), ("model", 8))),
)


def plan_rows(cfg: ModelConfig, deployments: Sequence[Deployment] = DEPLOYMENTS, *, batch: int, context: int,
              dtype="bfloat16", reserve: float = 0.1) -> list[dict]:
    """One :func:`kimi_jax.deploy.plan.make_plan` per deployment, as table rows (bytes per chip, roofline decode)."""
    rows = []
    for d in deployments:
        chip = plan.CHIPS[d.chip]
        p = plan.make_plan(cfg, dict(d.sizes), d.layout, batch=batch, context=context, dtype=dtype, model_name=d.name)
        step = p.step_seconds(chip.hbm_bandwidth)
        rows.append({
            "deployment": d.name, "chip": chip.name, "chips": p.chips,
            "mesh": " ".join(f"{a}={n}" for a, n in d.sizes), "layout": d.layout,
            "params_gb": p.param_total / GB, "cache_gb": p.cache_total / GB, "activations_gb": p.activation_total / GB,
            "total_gb": p.total / GB, "hbm_gb": chip.hbm_bytes / GB, "fits": p.fits(chip, reserve),
            "step_ms": step * 1e3, "tokens_per_s": batch / step, "tokens_per_s_per_seq": 1 / step,
            "notes": "; ".join(p.notes),
        })
    return rows


def roofline_vs_batch(cfg: ModelConfig, deployment: Deployment, batches: Sequence[int], *, context: int,
                      dtype="bfloat16") -> dict:
    """Roofline decode throughput of one deployment at several batch sizes: {batch, step_ms, tokens_per_s,
    total_gb, fits} arrays (memory per chip grows with the batch's caches; ``fits``: within 90% of HBM)."""
    chip = plan.CHIPS[deployment.chip]
    out = {"batch": [], "step_ms": [], "tokens_per_s": [], "total_gb": [], "fits": []}
    for b in batches:
        p = plan.make_plan(cfg, dict(deployment.sizes), deployment.layout, batch=int(b), context=context, dtype=dtype)
        step = p.step_seconds(chip.hbm_bandwidth)
        out["batch"].append(int(b))
        out["step_ms"].append(step * 1e3)
        out["tokens_per_s"].append(b / step)
        out["total_gb"].append(p.total / GB)
        out["fits"].append(p.fits(chip))
    return {k: np.asarray(v) for k, v in out.items()}
