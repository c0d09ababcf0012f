"""Figures written as SVG text (`ember.svg_figure`): well-formed SVG, every point where its value says,
breaks where a value is missing, viridis as matplotlib draws it, row 0 of a map at the bottom."""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from ember.svg_figure import (
    MISSING,
    RDBU,
    VIRIDIS,
    SvgFigure,
    band_figure,
    colours,
    heatmap_figure,
    nice_ticks,
    panels_figure,
    tick_text,
)

SVG = "{http://www.w3.org/2000/svg}"


def _tree(figure: SvgFigure) -> ET.Element:
    assert isinstance(figure, SvgFigure) and figure.data() == figure.text.encode("utf-8")
    return ET.fromstring(figure.text)


def _texts(root: ET.Element) -> list[str]:
    return [t.text or "" for t in root.iter(f"{SVG}text")]


def _fit(pixels: list[float], values: list[float]) -> tuple[float, float]:
    """Slope of pixels against values, and the largest residual of a straight line through them."""
    slope, intercept = np.polyfit(values, pixels, 1)
    return float(slope), float(np.max(np.abs(np.polyval([slope, intercept], values) - pixels)))


@pytest.mark.parametrize(("low", "high", "integer", "expected"), [
    (0, 29, True, [0, 5, 10, 15, 20, 25]),
    (-0.12, 0.87, False, [0.0, 0.2, 0.4, 0.6, 0.8]),
    (0, 1, False, [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]),
    (3, 5, True, [3, 4, 5]),
    (2, 2, False, [2]),
    (1, -1, False, [-1.0, -0.5, 0.0, 0.5, 1.0]),
])
def test_ticks_are_round_and_cover_the_range(low, high, integer, expected):
    assert nice_ticks(low, high, 6, integer=integer) == pytest.approx(expected)
    assert nice_ticks(0, math.nan) == []


def test_tick_labels_have_the_decimals_their_spacing_needs():
    assert [tick_text(t, [0, 0.25, 0.5]) for t in (0, 0.25, 0.5)] == ["0", "0.25", "0.50"]
    assert tick_text(-2.0, [-2.0, 0.0, 2.0]) == "−2" and tick_text(5.0, [0, 2.5, 5]) == "5.0"


def test_a_band_figure_puts_every_point_where_its_value_says():
    x = list(range(10))
    mean = [0.1 * i * i - 2 for i in x]
    figure = band_figure(x, mean, [m - 0.5 for m in mean], [m + 0.7 for m in mean], title="a title\nsecond",
                         xlabel="layer", ylabel="some\nmetric", band_label="95% band", line_label="mean")
    root = _tree(figure)
    dots = [c for c in root.iter(f"{SVG}circle")][:-1]  # the last one is the legend's
    xs = [float(c.get("cx")) for c in dots]
    ys = [float(c.get("cy")) for c in dots]
    slope_x, off_x = _fit(xs, x)
    slope_y, off_y = _fit(ys, mean)
    assert slope_x > 0 and slope_y < 0 and off_x < 0.02 and off_y < 0.02  # linear axes, y upwards
    [polygon] = list(root.iter(f"{SVG}polygon"))
    corners = [tuple(map(float, p.split(","))) for p in polygon.get("points").split()]
    assert len(corners) == 20
    assert max(abs(cy - ys[i] - slope_y * 0.7) for i, (_, cy) in enumerate(corners[:10])) < 0.02  # highs
    texts = _texts(root)
    assert {"a title", "second", "layer", "some", "metric", "95% band", "mean"} <= set(texts)
    assert {"0", "2", "4", "6", "8"} <= set(texts) and "1" not in texts  # integer ticks of the layers
    root_attrs = root.attrib
    assert root_attrs["width"] == "700" and root_attrs["height"] == "420"
    zero = [ln for ln in root.iter(f"{SVG}line") if ln.get("stroke-opacity") == "0.6"]
    assert len(zero) == 1 and abs(float(zero[0].get("y1")) - (ys[0] + slope_y * 2)) < 0.1  # at y = 0


def test_a_missing_value_breaks_the_curve_and_the_band():
    mean = [1.0, 2.0, math.nan, 2.5, 3.0]
    figure = band_figure([0, 1, 2, 3, 4], mean, [m - 1 for m in mean], [m + 1 for m in mean], title="t",
                         xlabel="x", ylabel="y", band_label="b", line_label="m")
    root = _tree(figure)
    assert len(list(root.iter(f"{SVG}polyline"))) == 2 and len(list(root.iter(f"{SVG}polygon"))) == 2
    assert len(list(root.iter(f"{SVG}circle"))) == 4 + 1  # four points and the legend's dot
    assert not re.search(r"\bnan\b", figure.text, re.IGNORECASE)


def test_viridis_is_matplotlibs():
    from matplotlib import colormaps

    values = np.random.default_rng(0).random(500)
    ours = np.array([[int(h[i:i + 2], 16) for i in (1, 3, 5)] for h in colours(values, 0.0, 1.0)])
    theirs = np.rint(colormaps["viridis"](values)[:, :3] * 255)
    assert np.abs(ours - theirs).max() <= 3
    edge = colours(np.array([-1.0, 0.0, 1.0, 2.0, math.nan]), 0.0, 1.0)
    assert list(edge) == [VIRIDIS[0], VIRIDIS[0], VIRIDIS[-1], VIRIDIS[-1], MISSING]


def test_a_heatmap_has_a_cell_per_value_row_zero_at_the_bottom():
    values = np.zeros((4, 3))
    values[0, 0], values[3, 2], values[1, 1] = 1.0, 0.5, math.nan
    figure = heatmap_figure(values, title="map", xlabel="position", ylabel="layer", colour_label="p",
                            x_labels=["0\n'a'", "1\n'b'", "2\n'c'"])
    root = _tree(figure)
    cells = [r for r in root.iter(f"{SVG}rect") if r.get("fill", "").startswith("#")
             and r.get("stroke") is None][1:]  # the first is the background
    assert len(cells) == 12
    by_place = {(round(float(r.get("y"))), round(float(r.get("x")))): r.get("fill") for r in cells}
    ys, xs = sorted({k[0] for k in by_place}), sorted({k[1] for k in by_place})
    assert by_place[(ys[-1], xs[0])] == VIRIDIS[-1]  # row 0 (bottom), column 0
    assert by_place[(ys[0], xs[2])] == colours(np.array([0.5]), 0, 1)[0]  # row 3 (top), column 2
    assert by_place[(ys[-2], xs[1])] == MISSING
    assert {"'a'", "'b'", "'c'", "0", "1.0", "map", "p"} <= set(_texts(root))
    stops = [s.get("stop-color") for s in root.iter(f"{SVG}stop")]
    assert stops == list(VIRIDIS)


def test_many_columns_get_rotated_single_line_labels():
    figure = heatmap_figure(np.random.default_rng(1).random((3, 20)), title="t", xlabel="x", ylabel="y",
                            colour_label="c", x_labels=[f"{i}\nword" for i in range(20)])
    labels = [t for t in _tree(figure).iter(f"{SVG}text") if (t.text or "").endswith(" word")]
    assert len(labels) == 20 and all("rotate(-90" in t.get("transform") for t in labels)


def test_rdbu_is_matplotlibs():
    from matplotlib import colormaps

    values = np.random.default_rng(2).uniform(-1.0, 1.0, 500)
    ours = np.array([[int(h[i:i + 2], 16) for i in (1, 3, 5)] for h in colours(values, -1.0, 1.0, RDBU)])
    theirs = np.rint(colormaps["RdBu_r"]((values + 1.0) / 2.0)[:, :3] * 255)
    assert np.abs(ours - theirs).max() <= 3


def test_panels_share_one_scale_and_label_their_rows_with_the_layers():
    first, second = np.full((3, 2), -1.0), np.full((3, 2), 1.0)
    second[2, 1] = 0.0
    figure = panels_figure([("residual", first), ("mlp", second)], title="maps", xlabel="", ylabel="layer",
                           colour_label="restored", x_labels=["a", "b"], low=-1.0, high=1.0, stops=RDBU,
                           y_values=[4, 7, 9])
    root = _tree(figure)
    cells = [r for r in root.iter(f"{SVG}rect") if r.get("fill", "").startswith("#")
             and r.get("stroke") is None][1:]
    assert len(cells) == 12
    left = sorted(cells, key=lambda r: float(r.get("x")))
    assert {r.get("fill") for r in left[:6]} == {RDBU[0]}  # the first panel: all −1, blue
    assert sorted(r.get("fill") for r in left[6:]) == sorted([RDBU[-1]] * 5 + [colours(np.array([0.0]), -1, 1,
                                                                                            RDBU)[0]])
    top_right = min(left[6:], key=lambda r: (float(r.get("y")), -float(r.get("x"))))
    assert top_right.get("fill") == RDBU[5]  # row 2 (top) of the second panel, column 1: the middle, 0
    texts = _texts(root)
    assert {"residual", "mlp", "maps", "restored", "4", "7", "9", "a", "b", "−1.0", "1.0"} <= set(texts)
    assert [s.get("stop-color") for s in root.iter(f"{SVG}stop")] == list(RDBU)
