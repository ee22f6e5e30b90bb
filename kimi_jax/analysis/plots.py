"""The figures of the notebooks: every ``plot_*`` function draws into a new matplotlib figure with a title, axis
labels and units, and returns it. matplotlib is imported only when a figure is drawn (:func:`_plt`): it is the
``notebooks`` extra, not a runtime dependency."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from kimi_jax.analysis.deployments import GB
from kimi_jax.analysis.probes import AttnResTable, StateNorms, load_stats


def _tokens(n: int) -> str:
    n = int(n)
    return f"{n >> 20}M" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10}K" if n % 1024 == 0 else str(n)


def _plt():
    try:
        import matplotlib.pyplot as plt  # optional (the notebooks extra): figures only
    except ImportError as e:  # pragma: no cover - the notebooks extra installs it
        raise ImportError("the plot_* helpers need matplotlib: pip install 'kimi-jax[notebooks]'") from e
    return plt


def plot_expert_load(counts: np.ndarray, layers: Sequence[int], *, tokens: int | None = None):
    """Heatmap of each MoE layer's share of routed assignments per expert (percent), next to each layer's max/mean
    load."""
    plt = _plt()
    share = 100.0 * counts / counts.sum(axis=1, keepdims=True)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 0.45 * len(layers) + 2.2), width_ratios=(3, 1),
                                 layout="constrained")
    im = ax.imshow(share, aspect="auto", cmap="viridis")
    ax.set_yticks(range(len(layers)), [str(i) for i in layers])
    ax.set_xlabel("routed expert (index)")
    ax.set_ylabel("MoE layer (index)")
    uniform = 100.0 / counts.shape[1]
    ax.set_title(f"Expert utilisation{f' over {tokens} tokens' if tokens else ''} (uniform = {uniform:.1f}%)")
    cb = fig.colorbar(im, ax=ax)
    cb.set_label("share of the layer's routed assignments (%)")
    stats = load_stats(counts)
    bx.barh(range(len(layers)), stats["max_over_mean"], color="tab:orange")
    bx.axvline(1.0, color="k", lw=1, ls="--")
    bx.set_yticks(range(len(layers)), [str(i) for i in layers])
    bx.invert_yaxis()
    bx.set_xlabel("max load / mean load (ratio)")
    bx.set_ylabel("MoE layer (index)")
    bx.set_title("Load imbalance (1 = balanced)")
    return fig


def plot_attn_res(table: AttnResTable):
    """Heatmap of mean AttnRes weights: one row per mix (sublayer input), one column per depth source."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(1.3 * len(table.sources) + 3, 0.3 * len(table.mixes) + 1.8), layout="constrained")
    im = ax.imshow(np.ma.masked_invalid(table.weights), aspect="auto", cmap="magma", vmin=0, vmax=1)
    ax.set_xticks(range(len(table.sources)), table.sources)
    ax.set_yticks(range(len(table.mixes)), table.mixes)
    ax.set_xlabel("depth source (sealed blocks, then the current block's partial sum)")
    ax.set_ylabel("AttnRes mix (sublayer input)")
    ax.set_title("Block Attention Residuals: mean depth-attention weight per source")
    for r in range(table.weights.shape[0]):
        for c in range(table.weights.shape[1]):
            v = table.weights[r, c]
            if np.isfinite(v):
                ax.text(c, r, f"{v:.2f}", ha="center", va="center", fontsize=7, color="w" if v < 0.6 else "k")
    cb = fig.colorbar(im, ax=ax)
    cb.set_label("softmax weight (fraction, mean over tokens)")
    return fig


def plot_state_norms(s: StateNorms):
    """KDA state norm (mean over the batch) of each KDA layer against the number of tokens consumed."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    mean = s.norms.mean(axis=1)
    for j, layer in enumerate(s.layers):
        ax.plot(s.positions, mean[:, j], marker="o", ms=3, label=f"KDA layer {layer}")
    ax.set_xlabel("tokens consumed (position)")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("state norm ||S||_F (dimensionless)")
    ax.set_title("KDA recurrent state size over a long sequence (fixed memory, bounded norm)")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(alpha=0.3)
    return fig


def plot_cache_curve(contexts: Sequence[int], curves: Mapping[str, np.ndarray], *, measured: Sequence = (),
                     crossover: int | None = None):
    """Cache bytes per sequence (GB, log scale) vs context (tokens, log scale), one line per configuration;
    ``measured``: (name, context, bytes) points from real allocations, drawn as markers."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8.5, 5), layout="constrained")
    colors = {}
    for name, total in curves.items():
        (line,) = ax.plot(contexts, np.asarray(total) / GB, marker=".", label=name)
        colors[name] = line.get_color()
    for i, (name, n, b) in enumerate(measured):
        ax.plot([n], [b / GB], "x", ms=10, mew=2, color=colors.get(name, "k"),
                label="measured (init_cache nbytes)" if i == 0 else None)
    if crossover:
        ax.axvline(crossover, color="gray", ls=":", lw=1)
        ax.annotate(f"K3: MLA cache > KDA state\nfrom {crossover:,} tokens", (crossover, ax.get_ylim()[1]),
                    xytext=(5, -30), textcoords="offset points", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(list(contexts), [_tokens(n) for n in contexts])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("cache per sequence (GB)")
    ax.set_title("Decode cache per sequence vs context length (bf16 cache, fp32 KDA state)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return fig


def plot_plan_memory(rows: Sequence[Mapping]):
    """Stacked per-chip bytes (parameters, cache, activations) of each deployment against its chip's HBM."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(rows) + 2), layout="constrained")
    y = np.arange(len(rows))
    left = np.zeros(len(rows))
    for key, label, color in (("params_gb", "parameters", "tab:blue"), ("cache_gb", "cache", "tab:orange"),
                              ("activations_gb", "activations", "tab:green")):
        v = np.asarray([r[key] for r in rows])
        ax.barh(y, v, left=left, label=label, color=color)
        left += v
    ax.scatter([r["hbm_gb"] for r in rows], y, marker="|", s=400, color="k", label="HBM per chip", zorder=3)
    ax.set_yticks(y, [f"{r['deployment']}{'' if r['fits'] else '  (does not fit)'}" for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("bytes per chip (GB)")
    ax.set_ylabel("deployment (GPU nodes or TPU chips)")
    ax.set_title("K3 memory per chip by deployment")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3, axis="x")
    return fig


def plot_roofline(curves: Mapping[str, Mapping], *, context: int | None = None):
    """Roofline decode throughput (tokens/s, all sequences) vs batch, one line per deployment; batches that do not
    fit in HBM are drawn hollow."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    batches = set()
    for name, c in curves.items():
        (line,) = ax.plot(c["batch"], c["tokens_per_s"], label=name)
        fits = np.asarray(c.get("fits", np.ones(len(c["batch"]), bool)), bool)
        ax.plot(c["batch"][fits], c["tokens_per_s"][fits], "o", color=line.get_color())
        ax.plot(c["batch"][~fits], c["tokens_per_s"][~fits], "o", mfc="none", color=line.get_color())
        batches.update(int(b) for b in c["batch"])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sorted(batches), [str(b) for b in sorted(batches)])
    ax.set_xlabel("concurrent sequences (batch)")
    ax.set_ylabel("decode throughput, roofline (tokens/s)")
    where = f", {context:,} tokens each" if context else ""
    ax.set_title(f"K3 decode roofline (HBM bandwidth bound{where}; hollow = does not fit)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return fig
