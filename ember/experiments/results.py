"""What an experiment hands back after a run, in a form a tracker can log."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ember.svg_figure import SvgFigure


@dataclass(frozen=True, slots=True)
class Metric:
    """One scalar: a name, a value, and the step it belongs to (e.g. a layer index)."""

    name: str
    value: float
    step: int = 0


@dataclass(slots=True)
class ExperimentResult:
    """Metrics by name and step, tables (name -> rows), arrays (name -> ndarray), figures and files.

    Figures are built lazily, on first access of `figures`, from the `figure_builders`, so nothing
    imports matplotlib unless somebody asks for a figure. A builder returns a matplotlib Figure (logged as
    PNG) or an `ember.svg_figure.SvgFigure` (logged as SVG). `file_builders`: artifacts of any other kind,
    by file name (e.g. `patterns.npz`, `view.html`) -> a function giving the file's bytes, called when the
    result is recorded.
    """

    metrics: list[Metric] = field(default_factory=list)
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    figure_builders: dict[str, Callable[[], Figure | SvgFigure]] = field(default_factory=dict, repr=False)
    file_builders: dict[str, Callable[[], bytes]] = field(default_factory=dict, repr=False)
    _figures: dict[str, Figure | SvgFigure] | None = field(default=None, init=False, repr=False,
                                                           compare=False)

    @property
    def figures(self) -> dict[str, Figure | SvgFigure]:
        """Name -> figure (a matplotlib Figure, logged as PNG, or an `SvgFigure`), built on first access."""
        if self._figures is None:
            self._figures = {name: build() for name, build in self.figure_builders.items()}
        return self._figures

    def is_empty(self) -> bool:
        return not (self.metrics or self.tables or self.arrays or self.figure_builders or self.file_builders)
