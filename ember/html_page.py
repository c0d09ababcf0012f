"""One self-contained HTML page (the bottom layer: imports nothing of ember): the skeleton that the
results page, the logit lens's page and the attention view share, so each writes only its body."""

from __future__ import annotations

import html


def html_page(title: str, style: str, body: str) -> str:
    """A UTF-8 document titled `title` (escaped here, as the page's <title> and <h1>) with `style` as
    its stylesheet and `body` (markup, inserted as given) after the heading."""
    title = html.escape(title)
    return (f'<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{title}</title>\n'
            f"<style>{style}</style>\n</head>\n<body>\n<h1>{title}</h1>\n{body}\n</body>\n</html>\n")
