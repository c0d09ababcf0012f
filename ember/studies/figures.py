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
                  prompt_set: str = "", n: int | None = None, xlabel: str = "layer") -> Figure:
    """Mean per step with its 95% bootstrap interval as a band (each aggregate has mean, ci_low, ci_high)."""
    from matplotlib.figure import Figure

    title = context_title(human_label(name), model, prompt_set, n)
    figure = Figure(figsize=(7, 4.2))
    ax = figure.add_axes(_fixed_margins(figure, title, axis_label(name)))
    x = list(steps)
    ax.fill_between(x, [a.ci_low for a in aggregates], [a.ci_high for a in aggregates], alpha=0.25,
                    label=INTERVAL_LABEL)
    ax.plot(x, [a.mean for a in aggregates], marker=".", label="mean over items")
    _axes(ax, x, xlabel, name)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return figure


def _fixed_margins(figure: Figure, title: str, ylabel: str) -> tuple[float, float, float, float]:
    """The axes' box (left, bottom, width, height as fractions) with margins in inches from the lines of
    the title and y label: a constrained layout measures every text by drawing it once more, 0.05 s of a
    0.09 s series figure (2-core Xeon, quiet), which a study pays for each of its figures."""
    width, height = figure.get_size_inches()
    left = 0.6 + 0.16 * (ylabel.count("\n") + 1)  # tick labels, then the label's lines at 9 pt
    top = 0.15 + 0.19 * (title.count("\n") + 1)  # the title's lines at 10 pt
    right, bottom = 0.2, 0.55
    return (left / width, bottom / height, 1 - (left + right) / width, 1 - (top + bottom) / height)


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


def png_bytes(figure: Figure, dpi: int = 100) -> bytes:
    """The figure as PNG (for a results page); the same bytes as its artifact when that was logged at
    this dpi (the default figure's), rendered once."""
    from ember.records.values import figure_png

    return figure_png(figure, dpi)


def _axes(ax: Axes, x: Sequence[float] | None, xlabel: str, name: str) -> None:
    """Labels, a zero line, a light grid; integer ticks when every x is an integer (layers)."""
    from matplotlib.ticker import MaxNLocator

    if x is not None and x and all(float(v).is_integer() for v in x):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.axhline(0.0, color="black", linewidth=0.8, alpha=0.6)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(axis_label(name), fontsize=9)
    ax.grid(alpha=0.3)
