"""Short, honest labels for figure ticks: a token shown with its position, cut with an ellipsis."""

from __future__ import annotations


def shorten(text: str, width: int) -> str:
    """`text` if it fits in `width` characters, else its first `width - 1` and an ellipsis."""
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"


def token_label(position: int, token: str, width: int = 12) -> str:
    """`3` over the token's repr (quotes show leading spaces), shortened to `width` characters."""
    return f"{position}\n{shorten(repr(str(token)), width)}"
