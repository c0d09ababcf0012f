"""The logit lens's layers × positions map as one self-contained HTML page (`logit_lens.html`; inline
CSS, no script, nothing fetched), which MLflow's artifact viewer shows in its sandboxed frame.

One table per item: a row per layer (the last layer on top), a column per prompt position headed by its
input token; each cell holds the layer's top token at that position, on a colour for the probability the
layer gives the token that position predicts (the next prompt token, the item's target at the last
position), with that probability and the predicted token in the cell's tooltip. Rendered as text, the
map costs milliseconds where a matplotlib figure with a text per cell cost about 0.3 s (SmolLM2, 30 × 12
cells, 2-core Xeon): that figure was most of a 50-item lens study's own overhead (benchmarks/README.md).
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ember.html_page import html_page

# matplotlib's viridis at 0, 1/16, …, 1 (the PNG map's colour map), interpolated linearly: within 6 of 255
# of matplotlib's own colour everywhere (tests/test_lens_view.py)
_STOPS = np.array([
    [68, 1, 84], [72, 24, 106], [71, 45, 123], [66, 64, 134], [59, 82, 139], [51, 99, 141],
    [44, 114, 142], [38, 130, 142], [33, 145, 140], [31, 160, 136], [40, 174, 128], [63, 188, 115],
    [94, 201, 98], [132, 212, 75], [173, 220, 48], [216, 226, 25], [253, 231, 37],
], np.float64)

_STYLE = """
body { font: 14px system-ui, sans-serif; margin: 16px; color: #1f2328; }
h1 { font-size: 18px; margin: 0 0 8px; }
h2 { font-size: 15px; margin: 20px 0 6px; font-weight: 600; }
.hint { color: #57606a; font-size: 12px; max-width: 900px; }
table { border-collapse: collapse; font: 11px ui-monospace, monospace; }
td { border: 1px solid #ffffff; padding: 2px 4px; min-width: 40px; max-width: 90px; overflow: hidden;
     white-space: pre; text-align: center; }
th { font-weight: normal; padding: 0 6px; white-space: pre; }
thead th { vertical-align: bottom; }
td.light { color: #ffffff; }
td.dark { color: #000000; }
"""


def colour(probability: float) -> str:
    """The viridis colour of a probability in [0, 1], as #rrggbb."""
    at = min(max(float(probability), 0.0), 1.0) * (len(_STOPS) - 1)
    low = min(int(at), len(_STOPS) - 2)
    rgb = _STOPS[low] + (at - low) * (_STOPS[low + 1] - _STOPS[low])
    return "#" + "".join(f"{round(v):02x}" for v in rgb)


def _text(token: str, limit: int = 12) -> str:
    """A token as shown in a cell: escapes for whitespace and control characters, at most `limit`."""
    shown = repr(str(token))[1:-1]
    return shown if len(shown) <= limit else shown[:limit - 1] + "…"


def _table(entry: Mapping[str, Any]) -> str:
    probs, tops = np.asarray(entry["probs"]), entry["tops"]
    inputs, predicted = entry["inputs"], entry["predicted"]
    layers, positions = probs.shape
    head = "".join(f"<th title=\"position {p}\">{html.escape(_text(inputs[p]))}<br>{p}</th>"
                   for p in range(positions))
    body = []
    for layer in reversed(range(layers)):
        cells = []
        for p in range(positions):
            prob = float(probs[layer, p])
            tip = (f"layer {layer}, position {p}: top token {str(tops[layer, p])!r}; "
                   f"p({str(predicted[p])!r}) = {prob:.4f}")
            shade = "light" if prob < 0.5 else "dark"
            cells.append(f"<td class=\"{shade}\" style=\"background:{colour(prob)}\" "
                         f"title=\"{html.escape(tip)}\">{html.escape(_text(tops[layer, p]))}</td>")
        body.append(f"<tr><th>{layer}</th>{''.join(cells)}</tr>")
    caption = html.escape(f"item {entry['item']}: {str(entry.get('text', ''))!r}")
    return (f"<h2>{caption}</h2>\n<table><thead><tr><th>layer</th>{head}</tr></thead>\n"
            f"<tbody>{''.join(body)}</tbody></table>")


def lens_html(entries: Sequence[Mapping[str, Any]], title: str = "logit lens") -> str:
    """The page. `entries`: each with `item`, `text`, `probs` [layers, positions] (the probability each
    layer gives the token its position predicts), `tops` [layers, positions] (top token texts),
    `inputs` and `predicted` (token texts per position)."""
    tables = "\n".join(_table(entry) for entry in entries) or "<p>no items</p>"
    return html_page(title, _STYLE, f"""\
<p class="hint">Each cell: the layer's top token at that position, read through the model's final norm
and unembedding. Colour: the probability the layer gives the token that position predicts (the next
prompt token; at the last position the item's target), 0 dark to 1 yellow; hover a cell for the value.
The last layer's row is the model's own output.</p>
{tables}""")
