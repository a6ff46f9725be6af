"""Figures the chapters share. Each function returns a matplotlib Figure (and closes it, so a
notebook shows it once: where it is glued, or where it is displayed)."""

from __future__ import annotations

from typing import Sequence

import matplotlib.pyplot as plt


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average, so noisy per-step losses read as a trend."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def loss_curve(history: Sequence[dict], title: str = "training loss", key: str = "loss",
               window: int = 5, reference: float | None = None, reference_label: str = "") -> plt.Figure:
    """Per-step values of ``key`` with a moving average; optional horizontal reference line."""
    steps = [row["step"] for row in history]
    values = [row[key] for row in history]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(steps, values, alpha=0.35, label="per step")
    ax.plot(steps, smooth(values, window), label=f"{window}-step average")
    if reference is not None:
        ax.axhline(reference, color="grey", linestyle="--", label=reference_label)
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    plt.close(fig)
    return fig


# --------------------------------------------------------------------------- systems chapters

#: One colour per model-state component, shared by every memory picture.
COMPONENT_COLOURS = {"params_16bit": "#4C72B0", "grads": "#DD8452", "fp32_master": "#55A868",
                     "adam_moments": "#C44E52"}


def memory_stacked_bars(per_size: dict[str, dict[int, dict[str, float]]], unit: float = 1e9,
                        title: str = "model states per GPU", log: bool = True) -> plt.Figure:
    """Stacked bars of model-state memory by component: one group per model size, one bar per
    ZeRO stage. ``per_size[size][stage][component]`` is bytes (see memory.grouped)."""
    sizes = list(per_size)
    stages = sorted(next(iter(per_size.values())))
    width = 0.8 / len(stages)
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for j, stage in enumerate(stages):
        for i, size in enumerate(sizes):
            bottom = 0.0
            for component, colour in COMPONENT_COLOURS.items():
                value = per_size[size][stage].get(component, 0.0) / unit
                ax.bar(i + (j - (len(stages) - 1) / 2) * width, value, width * 0.92, bottom=bottom,
                       color=colour, label=component if (i, j) == (0, 0) else None)
                bottom += value
            if i == 0:
                ax.text(i + (j - (len(stages) - 1) / 2) * width, bottom * 1.08, f"Z{stage}",
                        ha="center", fontsize=7)
    ax.set_xticks(range(len(sizes)), sizes)
    ax.set_ylabel("GB per GPU" + (" (log scale)" if log else ""))
    if log:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.legend(fontsize=8, ncol=4, loc="upper left")
    fig.tight_layout()
    plt.close(fig)
    return fig


def measured_vs_formula(rows: list[dict], unit: float = 1e6) -> plt.Figure:
    """Per stage, a formula bar and a measured bar, each stacked by component.
    ``rows``: dicts with ``stage``, ``source`` ('formula'/'measured') and component bytes."""
    stages = sorted({r["stage"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for r in rows:
        x = stages.index(r["stage"]) + (-0.2 if r["source"] == "formula" else 0.2)
        bottom = 0.0
        for component, colour in COMPONENT_COLOURS.items():
            value = r.get(component, 0.0) / unit
            ax.bar(x, value, 0.38, bottom=bottom, color=colour,
                   hatch="//" if r["source"] == "formula" else None, edgecolor="white",
                   label=component if (r["stage"], r["source"]) == (stages[0], "measured") else None)
            bottom += value
        ax.text(x, bottom, "F" if r["source"] == "formula" else "M", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(stages)), [f"ZeRO-{s}" for s in stages])
    ax.set_ylabel("MB on rank 0")
    ax.set_title("formula (F, hatched) vs measured engine tensors (M)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


def tradeoff_scatter(points: list[dict], x: str, y: str, label: str = "config",
                     xlabel: str = "", ylabel: str = "", title: str = "") -> plt.Figure:
    """One labelled point per configuration (e.g. memory kept on the device vs tokens/s)."""
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for p in points:
        ax.scatter(p[x], p[y], s=40)
        ax.annotate(p[label], (p[x], p[y]), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel(xlabel or x)
    ax.set_ylabel(ylabel or y)
    ax.set_title(title)
    ax.margins(x=0.25, y=0.2)
    fig.tight_layout()
    plt.close(fig)
    return fig


def loss_scale_trace(history: list[dict], title: str = "fp16 dynamic loss scaling") -> plt.Figure:
    """Loss scale (log2, top) and loss (bottom) per step; skipped steps marked in red."""
    steps = [r["step"] for r in history]
    skipped, previous = [], 0
    for r in history:
        if r["skipped"] > previous:
            skipped.append(r["step"])
        previous = r["skipped"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.5, 4.5), sharex=True)
    top.step(steps, [r["loss_scale"] for r in history], where="post")
    top.set_yscale("log", base=2)
    top.set_ylabel("loss scale")
    for s in skipped:
        top.axvline(s, color="red", alpha=0.25)
    bottom.plot(steps, [r["loss"] for r in history], marker=".")
    bottom.scatter(skipped, [history[s]["loss"] for s in skipped], color="red", zorder=3,
                   label="skipped step (overflow)")
    bottom.set_xlabel("step")
    bottom.set_ylabel("loss")
    bottom.legend(fontsize=8)
    top.set_title(title)
    fig.tight_layout()
    plt.close(fig)
    return fig


def update_traces(traces: dict[str, list[float]], title: str = "") -> plt.Figure:
    """Weight value per step for each named trace (the vanishing-update demonstration)."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for name, values in traces.items():
        ax.plot(range(len(values)), values, label=name)
    ax.set_xlabel("update step")
    ax.set_ylabel("weight")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


def score_histograms(groups: dict[str, Sequence[float]], title: str = "ground-truth scores",
                     bins: int = 20) -> plt.Figure:
    """Overlaid histograms of scores in [0, 1], one per named group (e.g. chosen vs rejected)."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    edges = [i / bins for i in range(bins + 1)]
    for label, values in groups.items():
        ax.hist(values, bins=edges, alpha=0.55, label=f"{label} (mean {sum(values) / len(values):.2f})")
    ax.set_xlabel("score")
    ax.set_ylabel("rows")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    plt.close(fig)
    return fig


def loss_curves(histories: dict[str, Sequence[dict]], title: str = "training loss", key: str = "loss",
                window: int = 10) -> plt.Figure:
    """Several runs' moving-average ``key`` per micro-batch on one axis, labelled by run name."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for name, history in histories.items():
        ax.plot(range(len(history)), smooth([row[key] for row in history], window), label=name)
    ax.set_xlabel("micro-batch")
    ax.set_ylabel(f"{key} ({window}-step average)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    plt.close(fig)
    return fig


def lora_state_by_rank(sizes: Sequence[dict]) -> plt.Figure:
    """LoRA model-state memory against rank, beside full fine-tuning and the frozen-weight floor
    (rows from :func:`dschat_lib.lora.lora_size` for one architecture)."""
    ranks = [row["lora_dim"] for row in sizes]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(ranks, [row["lora_state_gb"] for row in sizes], marker="o", label="LoRA (16 B/trained + 2 B/frozen)")
    ax.axhline(sizes[0]["full_finetune_state_gb"], color="C3", linestyle="--", label="full fine-tuning (16 B/param)")
    ax.axhline(sizes[0]["full_finetune_state_gb"] / 8, color="grey", linestyle=":", label="floor: frozen 16-bit weights")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("LoRA rank r")
    ax.set_ylabel("model state, GB")
    ax.set_title(f"{sizes[0]['architecture']}: model state by LoRA rank")
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig
