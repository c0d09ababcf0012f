"""Figures of aggregates: a metric against a step (a layer, a swept value) with its 95% interval.

Every figure says what it shows: a human label for the metric (its recorded name in brackets), the
model, the prompt set and n in the title, integer ticks for an integer axis (layers), a zero line, and
what the band or the error bars are ("95% bootstrap CI of the mean").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from ember.studies.report import PageFigure
    from ember.svg_figure import SvgFigure

INTERVAL_LABEL = "95% bootstrap CI of the mean"

# What a recorded metric measures, in words (a name not listed here is shown as recorded).
LABELS = {
    "objective": "search objective",
    "answer.prob": "answer probability",
    "answer.rank": "answer rank (0 = top token)",
    "answer.correct": "answer is the top token (share)",
    "answer.logit": "answer logit",
    "answer.logit_diff": "logit difference answer − wrong answer",
    "answer.prob_delta": "change of answer probability vs clean",
    "answer.logit_diff_delta": "change of logit difference vs clean",
    "effect.kl_mean": "KL divergence to the clean model (mean over steps)",
    "effect.kl_max": "KL divergence to the clean model (largest step)",
    "effect.top1_agreement": "top-1 agreement with the clean model",
    "effect.first_divergent_step": "first step that differs from the clean model",
    "effect.answer_changed": "share of answers changed",
    "logit_lens.target_prob": "probability of the answer read at the layer",
    "logit_lens.target_rank": "rank of the answer read at the layer",
    "logit_lens.kl_to_final": "KL divergence to the final layer",
}


def human_words(name: str) -> str | None:
    """What a recorded metric measures, in words; None for a name not known here."""
    if name in LABELS:
        return LABELS[name]
    if name.startswith("clean.") and name[6:] in LABELS:
        return f"{LABELS[name[6:]]}, clean model"
    return None


def human_label(name: str) -> str:
    """`answer probability (answer.prob)`; an unknown name as it was recorded."""
    words = human_words(name)
    return f"{words} ({name})" if words else name


def axis_label(name: str, width: int = 28) -> str:
    """The words alone (the title names the metric), wrapped so that a long label is not cut."""
    import textwrap

    return textwrap.fill(human_words(name) or name, width)


def context_title(what: str, model: str = "", prompt_set: str = "", n: int | None = None) -> str:
    """`what` (wrapped) and, on a line of its own, the model, the prompt set and n where known."""
    import textwrap

    parts = [p for p in (model, prompt_set) if p]
    if n is not None:
        parts.append(f"n = {n}")
    return textwrap.fill(what, 80) + (f"\n{', '.join(parts)}" if parts else "")


def series_figure(name: str, steps: Sequence[Any], aggregates: Sequence[Any], *, model: str = "",
                  prompt_set: str = "", n: int | None = None, xlabel: str = "layer") -> SvgFigure:
    """Mean per step with its 95% bootstrap interval as a band (each aggregate has mean, ci_low, ci_high),
    written as SVG (`ember.svg_figure`: a millisecond where matplotlib took 60-100 ms, every study draws
    one per series)."""
    from ember.svg_figure import band_figure

    return band_figure(list(steps), [a.mean for a in aggregates], [a.ci_low for a in aggregates],
                       [a.ci_high for a in aggregates],
                       title=context_title(human_label(name), model, prompt_set, n), xlabel=xlabel,
                       ylabel=axis_label(name), band_label=INTERVAL_LABEL, line_label="mean over items")


def points_figure(name: str, labels: Sequence[str], x: Sequence[float] | None, means: Sequence[float],
                  lows: Sequence[float | None], highs: Sequence[float | None], xlabel: str,
                  title: str, best: int | None = None) -> Figure:
    """One point per job with error bars (where an interval is known); numeric x (points joined in the
    order of x) or categorical labels. `best`: the index of a point to mark (a search's best trial)."""
    from matplotlib.figure import Figure

    order = list(range(len(means)))
    if x is not None:
        order.sort(key=lambda i: x[i])
    width = 8 if x is not None else max(6, 0.5 * len(means) + 3)
    figure = Figure(figsize=(width, 4.2), layout="constrained")
    ax = figure.subplots()
    positions = [x[i] for i in order] if x is not None else list(range(len(means)))
    ys = [means[i] for i in order]

    def known(value: float | None) -> bool:
        return value is not None and math.isfinite(value)

    below = [means[i] - lows[i] if known(lows[i]) else 0.0 for i in order]  # type: ignore[operator]
    above = [highs[i] - means[i] if known(highs[i]) else 0.0 for i in order]  # type: ignore[operator]
    with_intervals = any(known(lows[i]) or known(highs[i]) for i in order)
    ax.errorbar(positions, ys, yerr=[below, above] if with_intervals else None, marker="o", capsize=3,
                linestyle="-", label=f"mean ± {INTERVAL_LABEL}" if with_intervals else "value per job")
    if best is not None:
        ax.plot([positions[order.index(best)]], [means[best]], marker="*", markersize=16, linestyle="none",
                color="tab:red", label="best trial")
    if x is None:
        ax.set_xticks(positions, [labels[i] for i in order], rotation=30, ha="right")
        _axes(ax, None, xlabel, name)
    else:
        _axes(ax, positions, xlabel, name)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return figure


def page_figure(caption: str, figure: Figure | SvgFigure, dpi: int = 100) -> PageFigure:
    """The figure for a results page: SVG as it is, a matplotlib figure as PNG (the same bytes as its
    artifact when that was logged at this dpi, the default figure's: rendered once)."""
    from ember.records.values import figure_data, figure_media_type
    from ember.studies.report import PageFigure

    return PageFigure(caption, figure_data(figure, dpi), figure_media_type(figure))


def _axes(ax: Axes, x: Sequence[float] | None, xlabel: str, name: str) -> None:
    """Labels, a zero line, a light grid; integer ticks when every x is an integer (layers)."""
    from matplotlib.ticker import MaxNLocator

    if x is not None and x and all(float(v).is_integer() for v in x):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.axhline(0.0, color="black", linewidth=0.8, alpha=0.6)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(axis_label(name), fontsize=9)
    ax.grid(alpha=0.3)
