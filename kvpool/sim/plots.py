"""Matplotlib helpers for experiment figures; Agg backend, PNG files, no display needed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from types import ModuleType

import numpy as np


@cache
def _pyplot() -> ModuleType:
    """matplotlib.pyplot on the Agg backend, imported at the first figure: importing it takes
    ~0.4 s, which every `kvpool` command would otherwise pay (most draw nothing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path, title: str | None) -> Path:
    plt = _pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_lines(
    x: Sequence[float],
    series: Mapping[str, Sequence[float]],
    path: str | Path,
    xlabel: str,
    ylabel: str,
    title: str | None = None,
    logy: bool = False,
) -> Path:
    """One line per series over a shared x (e.g. normalized latency vs request rate)."""
    fig, ax = _pyplot().subplots(figsize=(6, 4))
    for label, ys in series.items():
        ax.plot(x, ys, marker="o", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path, title)


def plot_cdf(
    series: Mapping[str, Sequence[float]], path: str | Path, xlabel: str, title: str | None = None
) -> Path:
    """Empirical CDFs (e.g. TTFT per policy)."""
    fig, ax = _pyplot().subplots(figsize=(6, 4))
    for label, values in series.items():
        v = np.sort(np.asarray(values, dtype=float))
        ax.plot(v, np.arange(1, len(v) + 1) / max(len(v), 1), label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("CDF")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path, title)


def plot_stacked_bars(
    categories: Sequence[str],
    stacks: Mapping[str, Sequence[float]],
    path: str | Path,
    ylabel: str,
    title: str | None = None,
) -> Path:
    """Stacked bars per category (e.g. KV slot breakdown: tokens/reserved/internal/external)."""
    fig, ax = _pyplot().subplots(figsize=(6, 4))
    bottom = np.zeros(len(categories))
    for label, values in stacks.items():
        vals = np.asarray(values, dtype=float)
        ax.bar(categories, vals, bottom=bottom, label=label)
        bottom += vals
    ax.set_ylabel(ylabel)
    ax.legend(fontsize="small")
    return _save(fig, path, title)


def plot_grouped_bars(
    categories: Sequence[str],
    series: Mapping[str, Sequence[float]],
    path: str | Path,
    ylabel: str,
    title: str | None = None,
    logy: bool = False,
) -> Path:
    """One group of bars per category, one bar per series (e.g. mean batch per system per load)."""
    fig, ax = _pyplot().subplots(figsize=(7, 4))
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
    return _save(fig, path, title)
