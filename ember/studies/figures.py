"""Figures of aggregates: a metric against a step (a layer, a swept value) with its 95% interval."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def series_figure(name: str, steps: Sequence[Any], aggregates: Sequence[Any], subtitle: str = "",
                  xlabel: str = "step (layer)") -> Figure:
    """Mean per step with its 95% bootstrap interval as a band (each aggregate has mean, ci_low, ci_high)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4), layout="constrained")
    ax = figure.subplots()
    x = list(steps)
    means = [a.mean for a in aggregates]
    ax.fill_between(x, [a.ci_low for a in aggregates], [a.ci_high for a in aggregates], alpha=0.25,
                    label="95% bootstrap interval")
    ax.plot(x, means, marker=".", label="mean over items")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(name)
    ax.set_title(f"{name}" + (f" ({subtitle})" if subtitle else ""))
    ax.grid(alpha=0.3)
    ax.legend()
    return figure


def points_figure(name: str, labels: Sequence[str], x: Sequence[float] | None, means: Sequence[float],
                  lows: Sequence[float | None], highs: Sequence[float | None], xlabel: str,
                  title: str) -> Figure:
    """One point per job with error bars (where an interval is known); numeric x or categorical labels."""
    import math

    from matplotlib.figure import Figure

    width = 8 if x is not None else max(6, 0.5 * len(means) + 3)
    figure = Figure(figsize=(width, 4), layout="constrained")
    ax = figure.subplots()
    positions = list(x) if x is not None else list(range(len(means)))
    def known(value: float | None) -> bool:
        return value is not None and math.isfinite(value)

    below = [m - lo if known(lo) else 0.0 for m, lo in zip(means, lows, strict=True)]
    above = [hi - m if known(hi) else 0.0 for m, hi in zip(means, highs, strict=True)]
    ax.errorbar(positions, means, yerr=[below, above], marker="o", capsize=3, linestyle="-")
    if x is None:
        ax.set_xticks(positions, labels, rotation=30, ha="right")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(name)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return figure
