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
