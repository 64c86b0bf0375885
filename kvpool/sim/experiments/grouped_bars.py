"""Grouped bar charts for the experiments that compare systems per category (a candidate for
`kvpool.sim.plots`, kept here while that module has another owner)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (backend must be chosen first)
import numpy as np  # noqa: E402


def plot_grouped_bars(
    categories: Sequence[str],
    series: Mapping[str, Sequence[float]],
    path: str | Path,
    ylabel: str,
    title: str | None = None,
    logy: bool = False,
) -> Path:
    """One group of bars per category, one bar per series (e.g. mean batch per system per load)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.arange(len(categories))
    width = 0.8 / max(len(series), 1)
    for i, (label, values) in enumerate(series.items()):
        ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, label=label)
    ax.set_xticks(x, categories)
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
