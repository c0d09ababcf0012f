"""The logit lens's HTML map (ember.experiments.lens_view): its colours follow matplotlib's viridis, the
PNG map's colour map, and token texts cannot break out of the page."""

import numpy as np
from matplotlib import colormaps

from ember.experiments.lens_view import colour, lens_html


def test_colours_follow_viridis() -> None:
    viridis = colormaps["viridis"]
    for p in np.linspace(0.0, 1.0, 401):
        ours = np.array([int(colour(p)[i:i + 2], 16) for i in (1, 3, 5)])
        theirs = np.array(viridis(p)[:3]) * 255
        assert np.abs(ours - theirs).max() <= 6, p  # 17 stops, linear between: close, not equal
    assert colour(-1.0) == colour(0.0) == "#440154" and colour(2.0) == colour(1.0) == "#fde725"


def test_token_texts_are_escaped() -> None:
    entry = {"item": 3, "text": "a <b> & c", "probs": np.array([[0.2, 0.9]]),
             "tops": np.array([["</table><script>", "\n"]], dtype=object),
             "inputs": ["<i>", "x"], "predicted": ["x", "\"quoted\""]}
    page = lens_html([entry])
    assert "<script>" not in page and "&lt;/table&gt;&lt;script&gt;" in page
    assert ">\\n</td>" in page  # a newline shown as its escape
    assert "&quot;quoted&quot;" in page and "p(&#x27;\\&quot;quoted\\&quot;&#x27;)" not in page
    assert page.count("<td") == 2 and "item 3" in page
