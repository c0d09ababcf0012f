"""Figures written directly as SVG text: a curve with its interval band, and a heatmap with a colour bar.

A study draws a per-layer curve for each series it records, and the logit lens a layers × positions map;
through matplotlib each cost 60-100 ms (Agg or its SVG backend, 2-core EPYC and Xeon, quiet), three of
them 0.2 s of a 54-fact logit lens whose engine time is 1.4 s, more than issue 25's 10% allows a study's
own overhead. Written here as text they take about a millisecond, stay sharp at any zoom, and are what
MLflow's artifact view and a browser show as images. The patching experiments' score maps (panels side
by side) are drawn here too: through matplotlib the two of a 54-fact causal tracing took 1.4 s, most of
its runner time. Other figures (a sweep's points, an experiment's scatter or bars) stay matplotlib's:
they are drawn once per run or sweep, and need what matplotlib offers.

Only NumPy and the standard library: the records layer imports this module.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape

import numpy as np

MEDIA_TYPE = "image/svg+xml"
FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
LINE = "#1f77b4"  # matplotlib's first cycle colour, as the PNG figures had
# matplotlib's viridis sampled at 33 evenly spaced points; between them the colour is interpolated
# linearly in RGB: at most 3 of 255 per channel from matplotlib's own colours (a 256-entry table it looks
# up without interpolating; 17 points gave 5 of 255).
VIRIDIS = ("#440154", "#470d60", "#48186a", "#482374", "#472d7b", "#453781", "#424086", "#3e4989",
           "#3b528b", "#375b8d", "#33638d", "#2f6b8e", "#2c728e", "#297a8e", "#26828e", "#23898e",
           "#21918c", "#1f988b", "#1fa088", "#22a785", "#28ae80", "#32b67a", "#3fbc73", "#4ec36b",
           "#5ec962", "#70cf57", "#84d44b", "#98d83e", "#addc30", "#c2df23", "#d8e219", "#ece51b",
           "#fde725")
# matplotlib's RdBu_r (diverging: blue below the middle, red above; patching's restored shares from −1 to
# 1): its 11 ColorBrewer points, between which matplotlib interpolates linearly too (33 samples of its
# table were up to 5 of 255 off).
RDBU = ("#053061", "#2166ac", "#4393c3", "#92c5de", "#d1e5f0", "#f7f7f7", "#fddbc7", "#f4a582", "#d6604d",
        "#b2182b", "#67001f")
MISSING = "#ffffff"  # a cell without a finite value


@dataclass(frozen=True, slots=True)
class SvgFigure:
    """A finished figure as SVG text; logged as `<name>.svg`."""

    text: str
    suffix = ".svg"
    media_type = MEDIA_TYPE

    def data(self) -> bytes:
        return self.text.encode("utf-8")


def nice_ticks(low: float, high: float, count: int = 6, integer: bool = False) -> list[float]:
    """Round tick values (1, 2, 2.5 or 5 times a power of ten) in [low, high], the finest spacing that
    leaves at most `count` intervals between them."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return []
    if high < low:
        low, high = high, low
    if high == low:
        return [low]
    raw = (high - low) / max(1, count)
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw * (1 - 1e-9))
    if integer:
        step = max(1.0, math.ceil(step))
    first = math.ceil(low / step - 1e-9)
    last = math.floor(high / step + 1e-9)
    return [round(k * step, 12) for k in range(first, last + 1)]


def tick_text(value: float, ticks: Sequence[float]) -> str:
    """A tick's label with as many decimals as the ticks' spacing needs."""
    step = min((abs(b - a) for a, b in zip(ticks, ticks[1:], strict=False) if b != a), default=1.0)
    decimals = next((d for d in range(12) if abs(round(step, d) - step) <= 1e-9 * step), 12)
    text = f"{value:.{decimals}f}"
    return "0" if float(text) == 0 else text.replace("-", "−")


def colours(values: np.ndarray, low: float, high: float, stops: Sequence[str] = VIRIDIS) -> np.ndarray:
    """Hex colours of `values` scaled from `low` to `high` (clipped) along the colour map `stops` (VIRIDIS,
    RDBU); MISSING where not finite."""
    values = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(values)
    span = high - low if high > low else 1.0
    share = np.clip((np.where(finite, values, low) - low) / span, 0.0, 1.0)
    at = np.linspace(0.0, 1.0, len(stops))
    stops = np.array([[int(h[i:i + 2], 16) for i in (1, 3, 5)] for h in stops], dtype=np.float64)
    rgb = np.stack([np.interp(share, at, stops[:, c]) for c in range(3)], axis=-1)
    rgb = np.rint(rgb).astype(np.int64)
    packed = (rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2]
    out = np.array([f"#{v:06x}" for v in packed.ravel()], dtype=object).reshape(values.shape)
    out[~finite] = MISSING
    return out


class _Canvas:
    """SVG elements in pixel coordinates (y downwards), written out in order."""

    def __init__(self, width: float, height: float) -> None:
        self.width, self.height = width, height
        self.parts: list[str] = []

    def text(self, x: float, y: float, content: str, size: float = 12, anchor: str = "middle",
             rotate: float = 0.0, baseline: str = "middle", weight: str = "normal") -> None:
        turn = f' transform="rotate({rotate:g} {x:.1f} {y:.1f})"' if rotate else ""
        bold = ' font-weight="bold"' if weight != "normal" else ""
        self.parts.append(f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size:g}" text-anchor="{anchor}" '
                          f'dominant-baseline="{baseline}"{bold}{turn}>{escape(content)}</text>')

    def lines(self, x: float, y: float, content: str, size: float, anchor: str = "middle",
              rotate: float = 0.0, spacing: float = 1.25) -> None:
        """Several lines centred around (x, y) along the text's direction."""
        rows = content.split("\n")
        for i, row in enumerate(rows):
            offset = (i - (len(rows) - 1) / 2) * size * spacing
            if rotate:
                self.text(x + offset, y, row, size, anchor, rotate)
            else:
                self.text(x, y + offset, row, size, anchor)

    def line(self, x1: float, y1: float, x2: float, y2: float, stroke: str = "#000", width: float = 1.0,
             opacity: float = 1.0) -> None:
        alpha = f' stroke-opacity="{opacity:g}"' if opacity < 1 else ""
        self.parts.append(f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{stroke}" '
                          f'stroke-width="{width:g}"{alpha}/>')

    def rect(self, x: float, y: float, w: float, h: float, fill: str = "none", stroke: str = "none",
             extra: str = "") -> None:
        self.parts.append(f'<rect x="{x:.2f}" y="{y:.2f}" width="{w:.2f}" height="{h:.2f}" fill="{fill}" '
                          f'stroke="{stroke}"{extra}/>')

    def raw(self, element: str) -> None:
        self.parts.append(element)

    def finish(self, title: str) -> SvgFigure:
        size = f'width="{self.width:.0f}" height="{self.height:.0f}"'
        head = (f'<svg xmlns="http://www.w3.org/2000/svg" {size} '
                f'viewBox="0 0 {self.width:.0f} {self.height:.0f}" font-family="{FONT}">'
                f"<title>{escape(title)}</title>"
                f'<rect width="100%" height="100%" fill="#fff"/>')
        return SvgFigure(head + "".join(self.parts) + "</svg>")


def _points(xs: Sequence[float], ys: Sequence[float]) -> str:
    return " ".join(f"{x:.2f},{y:.2f}" for x, y in zip(xs, ys, strict=True))


def _runs(finite: np.ndarray) -> list[tuple[int, int]]:
    """(start, stop) of each run of consecutive True values."""
    runs, start = [], None
    for i, ok in enumerate(finite):
        if ok and start is None:
            start = i
        elif not ok and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(finite)))
    return runs


def band_figure(x: Sequence[float], mean: Sequence[float], low: Sequence[float], high: Sequence[float], *,
                title: str, xlabel: str, ylabel: str, band_label: str, line_label: str,
                width: float = 700, height: float = 420) -> SvgFigure:
    """A curve (`mean` against `x`, a dot per point) over a shaded band from `low` to `high`, a zero line,
    a light grid, integer x ticks when every x is an integer. A non-finite value breaks the curve or the
    band there; the axes include zero."""
    xs = np.asarray(x, dtype=np.float64)
    ys, lows, highs = (np.asarray(v, dtype=np.float64) for v in (mean, low, high))
    left = 62 + 16 * (ylabel.count("\n") + 1)
    top = 16 + 17 * (title.count("\n") + 1)
    right, bottom = 20, 72
    plot_w, plot_h = width - left - right, height - top - bottom
    values = np.concatenate([ys, lows, highs, [0.0]])
    values = values[np.isfinite(values)]
    y_lo, y_hi = float(values.min()), float(values.max())
    finite_x = xs[np.isfinite(xs)]
    x_lo, x_hi = (float(finite_x.min()), float(finite_x.max())) if finite_x.size else (0.0, 1.0)
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 0.5, x_hi + 0.5
    if y_hi == y_lo:
        y_lo, y_hi = y_lo - 0.5, y_hi + 0.5
    x_pad, y_pad = 0.05 * (x_hi - x_lo), 0.05 * (y_hi - y_lo)  # matplotlib's default margins
    x_lo, x_hi, y_lo, y_hi = x_lo - x_pad, x_hi + x_pad, y_lo - y_pad, y_hi + y_pad

    def px(v: np.ndarray | float) -> np.ndarray | float:
        return left + (np.asarray(v) - x_lo) / (x_hi - x_lo) * plot_w

    def py(v: np.ndarray | float) -> np.ndarray | float:
        return top + (y_hi - np.asarray(v)) / (y_hi - y_lo) * plot_h

    canvas = _Canvas(width, height)
    integer = bool(finite_x.size) and bool(np.all(finite_x == np.round(finite_x)))
    x_ticks = nice_ticks(x_lo + x_pad, x_hi - x_pad, 8, integer=integer)
    y_ticks = [t for t in nice_ticks(y_lo, y_hi, 6) if y_lo <= t <= y_hi]
    for t in x_ticks:
        canvas.line(px(t), top, px(t), top + plot_h, "#b0b0b0", 0.8, 0.3)
        canvas.line(px(t), top + plot_h, px(t), top + plot_h + 4)
        canvas.text(px(t), top + plot_h + 14, tick_text(t, x_ticks), 11)
    for t in y_ticks:
        canvas.line(left, py(t), left + plot_w, py(t), "#b0b0b0", 0.8, 0.3)
        canvas.line(left - 4, py(t), left, py(t))
        canvas.text(left - 7, py(t), tick_text(t, y_ticks), 11, anchor="end")
    both = np.isfinite(lows) & np.isfinite(highs) & np.isfinite(xs)
    for start, stop in _runs(both):
        outline = _points([*px(xs[start:stop]), *px(xs[start:stop][::-1])],
                          [*py(highs[start:stop]), *py(lows[start:stop][::-1])])
        canvas.raw(f'<polygon points="{outline}" fill="{LINE}" fill-opacity="0.25" stroke="none"/>')
    canvas.line(left, py(0.0), left + plot_w, py(0.0), "#000", 0.8, 0.6)
    shown = np.isfinite(ys) & np.isfinite(xs)
    for start, stop in _runs(shown):
        canvas.raw(f'<polyline points="{_points(px(xs[start:stop]), py(ys[start:stop]))}" fill="none" '
                   f'stroke="{LINE}" stroke-width="1.5"/>')
    canvas.raw("".join(f'<circle cx="{a:.2f}" cy="{b:.2f}" r="2.5" fill="{LINE}"/>'
                       for a, b in zip(px(xs[shown]), py(ys[shown]), strict=True)))
    canvas.rect(left, top, plot_w, plot_h, stroke="#000")
    canvas.lines(width / 2 + (left - right) / 2, top / 2 + 2, title, 13)
    canvas.text(left + plot_w / 2, top + plot_h + 34, xlabel, 12)
    canvas.lines(18 + 8 * ylabel.count("\n"), top + plot_h / 2, ylabel, 12, rotate=-90)
    legend_y = height - 14
    canvas.rect(left, legend_y - 6, 22, 12, fill=LINE, extra=' fill-opacity="0.25"')
    canvas.text(left + 28, legend_y, band_label, 11, anchor="start")
    legend_x = left + 40 + 6.2 * len(band_label)
    canvas.line(legend_x, legend_y, legend_x + 22, legend_y, LINE, 1.5)
    canvas.raw(f'<circle cx="{legend_x + 11:.1f}" cy="{legend_y:.1f}" r="2.5" fill="{LINE}"/>')
    canvas.text(legend_x + 28, legend_y, line_label, 11, anchor="start")
    return canvas.finish(title.replace("\n", " "))


def heatmap_figure(values: np.ndarray, *, title: str, xlabel: str, ylabel: str, colour_label: str,
                   x_labels: Sequence[str] | None = None, low: float = 0.0, high: float = 1.0,
                   stops: Sequence[str] = VIRIDIS) -> SvgFigure:
    """`values` [rows, columns] as cells coloured along `stops` from `low` to `high`, row 0 at the bottom
    (layers upwards), a colour bar on the right; `x_labels` under the columns (rotated when there are
    more than 12), integer row ticks."""
    return panels_figure([("", values)], title=title, xlabel=xlabel, ylabel=ylabel, colour_label=colour_label,
                         x_labels=x_labels, low=low, high=high, stops=stops)


def panels_figure(panels: Sequence[tuple[str, np.ndarray]], *, title: str, xlabel: str, ylabel: str,
                  colour_label: str, x_labels: Sequence[str] | None = None, low: float = 0.0,
                  high: float = 1.0, stops: Sequence[str] = VIRIDIS,
                  y_values: Sequence[int] | None = None) -> SvgFigure:
    """Heatmaps side by side, one per (name, values [rows, columns]) of `panels` (all of one shape), under
    their names, sharing the colour scale and its bar on the right; each as `heatmap_figure`'s. Row r is
    labelled y_values[r] (default r): the layers a map covers."""
    arrays = [np.asarray(values, dtype=np.float64) for _, values in panels]
    rows, columns = arrays[0].shape
    rotated = x_labels is not None and columns > 12
    if x_labels is None:
        label_room = 6.0
    elif rotated:  # one line each, read bottom to top
        x_labels = [label.replace("\n", " ") for label in x_labels]
        label_room = 6.2 * max((len(s) for s in x_labels), default=1) + 12
    else:
        label_room = 13.0 * max((s.count("\n") + 1 for s in x_labels), default=1) + 8
    count = len(arrays)
    gap = 56.0  # between panels: the next one's row ticks
    plot_w = max(414.0 if count == 1 else 200.0, 48.0 * columns + 4)
    left, right = 66, 120
    width = left + count * plot_w + (count - 1) * gap + right
    height = max(400.0, 16.0 * rows + 110 + label_room)
    named = any(name for name, _ in panels)
    top = 16 + 17 * (title.count("\n") + 1) + (18 if named else 0)
    bottom = 34 + label_room
    plot_h = height - top - bottom
    cell_w, cell_h = plot_w / columns, plot_h / rows
    canvas = _Canvas(width, height)
    labels = list(y_values) if y_values is not None else list(range(rows))
    for k, ((name, _), values) in enumerate(zip(panels, arrays, strict=True)):
        x0 = left + k * (plot_w + gap)
        fills = colours(values, low, high, stops)
        canvas.raw("".join(f'<rect x="{x0 + c * cell_w:.2f}" y="{top + (rows - 1 - r) * cell_h:.2f}" '
                           f'width="{cell_w + 0.3:.2f}" height="{cell_h + 0.3:.2f}" fill="{fills[r, c]}"/>'
                           for r in range(rows) for c in range(columns)))
        canvas.rect(x0, top, plot_w, plot_h, stroke="#000")
        if name:
            canvas.text(x0 + plot_w / 2, top - 10, name, 12)
        for r in nice_ticks(0, rows - 1, 8, integer=True):
            y = top + (rows - 1 - r + 0.5) * cell_h
            canvas.line(x0 - 4, y, x0, y)
            canvas.text(x0 - 7, y, f"{labels[int(r)]}", 11, anchor="end")
        if x_labels is not None:
            for c, label in enumerate(x_labels[:columns]):
                x = x0 + (c + 0.5) * cell_w
                canvas.line(x, top + plot_h, x, top + plot_h + 4)
                if rotated:
                    canvas.text(x, top + plot_h + 8, label, 10, anchor="end", rotate=-90)
                else:
                    canvas.lines(x, top + plot_h + 8 + 6.5 * (label.count("\n") + 1), label, 10,
                                 spacing=1.3)
    canvas.text((left + width - right) / 2, height - 12, xlabel, 12)
    canvas.text(18, top + plot_h / 2, ylabel, 12, rotate=-90)
    canvas.lines(width / 2, (16 + 17 * (title.count("\n") + 1)) / 2 + 2, title, 13)
    bar_x = width - right + 22
    gradient = "".join(f'<stop offset="{i / (len(stops) - 1):.4f}" stop-color="{c}"/>'
                       for i, c in enumerate(stops))
    canvas.raw(f'<defs><linearGradient id="bar" x1="0" y1="1" x2="0" y2="0">{gradient}'
               '</linearGradient></defs>')
    canvas.rect(bar_x, top, 16, plot_h, fill="url(#bar)", stroke="#000")
    bar_ticks = nice_ticks(low, high, 6)
    for t in bar_ticks:
        y = top + (high - t) / ((high - low) or 1.0) * plot_h
        canvas.line(bar_x + 16, y, bar_x + 20, y)
        canvas.text(bar_x + 23, y, tick_text(t, bar_ticks), 11, anchor="start")
    canvas.text(width - 16, top + plot_h / 2, colour_label, 12, rotate=-90)
    return canvas.finish(title.replace("\n", " "))
