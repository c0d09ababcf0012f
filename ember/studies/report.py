"""One self-contained results page (HTML) of a study run or a sweep: what a researcher pastes into a lab
notebook. The facts (model, prompt set, n, ...), the key figures embedded (base64 SVG or PNG), the summary
table with 95% intervals, the per-item (or per-job) table and the config. No external URL, no script:
the page reads the same from a file, a mail or MLflow's artifact view. Plain data in, text out."""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ember.html_page import html_page
from ember.studies.figures import human_words

# Beyond this many rows a table shows its first rows and says how many it left out (the JSON table
# artifact beside the page has them all).
MAX_ROWS = 500

_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1.5em auto; max-width: 72em;
       padding: 0 1em; color: #1b1b1b; line-height: 1.4; }
h1 { font-size: 1.45em; margin-bottom: 0.2em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: 0.86em; margin: 0.5em 0; }
th, td { border: 1px solid #d0d0d0; padding: 0.2em 0.5em; text-align: left; vertical-align: top; }
th { background: #f2f2f2; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
table.facts th { background: none; font-weight: 600; border: none; padding-left: 0; }
table.facts td { border: none; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #e4e4e4; }
figcaption { font-size: 0.86em; color: #444; }
pre { background: #f6f6f6; padding: 0.7em; overflow-x: auto; font-size: 0.82em; }
.note { color: #555; font-size: 0.86em; }
.scroll { overflow-x: auto; }
"""


@dataclass(slots=True)
class PageFigure:
    caption: str
    data: bytes
    media_type: str = "image/png"  # or "image/svg+xml"


@dataclass(slots=True)
class Table:
    """Columns by name, one value per row, in order."""

    title: str
    columns: Mapping[str, Sequence[Any]]
    note: str = ""


@dataclass(slots=True)
class ResultsPage:
    title: str
    facts: list[tuple[str, str]]              # (label, value): model, prompt set, n, run, ...
    figures: list[PageFigure] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)  # summary first, then items
    config: str = ""                          # the resolved config (YAML) or the sweep's overrides
    intro: str = ""


def interval_text(mean: float | None, low: float | None, high: float | None) -> str:
    """`0.412 [0.35, 0.47]`; the mean alone where the interval is unknown."""
    if not _finite(mean):
        return ""
    if _finite(low) and _finite(high):
        return f"{_number(mean)} [{_number(low)}, {_number(high)}]"
    return _number(mean)


def render(page: ResultsPage) -> str:
    """The page as one HTML document."""
    parts = []
    if page.intro:
        parts.append(f'<p class="note">{_e(page.intro)}</p>')
    parts.append('<table class="facts">')
    parts += [f"<tr><th>{_e(label)}</th><td>{_e(value)}</td></tr>" for label, value in page.facts]
    parts.append("</table>")
    for table in page.tables[:1]:
        parts.append(_table(table))
    if page.figures:
        parts.append("<h2>Figures</h2>")
        for figure in page.figures:
            data = base64.b64encode(figure.data).decode("ascii")
            source = f"data:{figure.media_type};base64,{data}"
            parts.append(f'<figure><img alt="{_e(figure.caption)}" src="{source}">'
                         f"<figcaption>{_e(figure.caption)}</figcaption></figure>")
    for table in page.tables[1:]:
        parts.append(_table(table))
    if page.config:
        parts.append(f"<h2>Config</h2><pre>{_e(page.config)}</pre>")
    return html_page(page.title, _STYLE, "\n".join(parts))


def _table(table: Table) -> str:
    names = list(table.columns)
    rows = max((len(v) for v in table.columns.values()), default=0)
    shown = min(rows, MAX_ROWS)
    out = [f"<h2>{_e(table.title)}</h2>"]
    if table.note:
        out.append(f'<p class="note">{_e(table.note)}</p>')
    out.append('<div class="scroll"><table><tr>' + "".join(f"<th>{_e(n)}</th>" for n in names) + "</tr>")
    for i in range(shown):
        cells = []
        for name in names:
            column = table.columns[name]
            value = column[i] if i < len(column) else None
            numeric = isinstance(value, int | float) and not isinstance(value, bool)
            cells.append(f'<td{" class=num" if numeric else ""}>{_e(_cell(value))}</td>')
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table></div>")
    if shown < rows:
        out.append(f'<p class="note">the first {shown} of {rows} rows</p>')
    return "\n".join(out)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return _number(value) if math.isfinite(value) else ""
    return str(value)


def _number(value: Any) -> str:
    return f"{float(value):.4g}"


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(float(value))


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def summary_columns(aggregates: Mapping[tuple[str, int], Any], key: Sequence[str] = (),
                    series: Sequence[str] = ()) -> dict[str, list[Any]]:
    """The `study/summary.json` table: one row per metric (and step of a series), key metrics first:
    n, mean, standard error and the 95% bootstrap interval."""
    rank = {name: i for i, name in enumerate(key)}
    order = sorted(aggregates, key=lambda k: (k[0] not in rank, rank.get(k[0], 0), k[0], k[1]))
    names = ("metric", "step", "n", "mean", "se", "ci_low", "ci_high")
    columns: dict[str, list[Any]] = {c: [] for c in names}
    for name, step in order:
        agg = aggregates[(name, step)]
        for column, value in (("metric", name), ("step", step if name in series else None), ("n", agg.n),
                              ("mean", agg.mean), ("se", agg.se), ("ci_low", agg.ci_low),
                              ("ci_high", agg.ci_high)):
            columns[column].append(_plain(value))
    return columns


def study_page(*, model: str, prompt_set: str, digest: str, items: int, run_id: str | None,
               aggregates: Mapping[tuple[str, int], Any], key: Sequence[str], series: Sequence[str],
               figures: Sequence[PageFigure], item_columns: Mapping[str, Sequence[Any]], config: str,
               status: str = "") -> ResultsPage:
    """A study run's page: the key results (a series by its largest-magnitude step) with intervals, every
    aggregate, the figures, the items and the config."""
    facts = [("model", model), ("prompt set", f"{prompt_set} (digest {digest})"), ("n (items)", str(items))]
    if run_id:
        facts.append(("MLflow run", run_id))
    if status:
        facts.append(("status", status))
    headline: dict[str, list[Any]] = {"metric": [], "what it measures": [], "at step": [], "n": [],
                                      "mean [95% CI]": []}
    for name in key:
        steps = [(s, a) for (n, s), a in aggregates.items() if n == name and _finite(a.mean)]
        if not steps:
            continue
        step, agg = max(steps, key=lambda pair: abs(pair[1].mean)) if name in series else steps[0]
        headline["metric"].append(name)
        headline["what it measures"].append(human_words(name) or "")
        headline["at step"].append(f"{step} (largest)" if name in series else "")
        headline["n"].append(agg.n)
        headline["mean [95% CI]"].append(interval_text(agg.mean, agg.ci_low, agg.ci_high))
    every = summary_columns(aggregates, key, series)
    every_rows = {"metric": every["metric"], "step": every["step"], "n": every["n"],
                  "mean [95% CI]": [interval_text(m, lo, hi) for m, lo, hi in
                                    zip(every["mean"], every["ci_low"], every["ci_high"], strict=True)],
                  "se": every["se"]}
    tables = [Table("Key results", headline, "mean over items with its 95% percentile bootstrap interval "
                    "(2000 draws of the items); a per-layer series at its largest-magnitude step"),
              Table("Every aggregate", every_rows, "also in the run's table artifact study/summary.json"),
              Table("Items", item_columns, "one row per item; also study/items.json")]
    return ResultsPage(f"Study: {prompt_set} on {model}", facts, list(figures), tables, config)


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
