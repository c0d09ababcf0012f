"""The pair-merge loop llama.cpp's BPE and SPM sessions share.

Symbols sit in a linked list; every adjacent pair with a priority goes on a heap (lower first, ties
to the smaller left index). Popped pairs whose text no longer matches are stale and skipped; a merge
pushes the two new neighbour pairs. O(n log n) in the symbol count, so long words are fine.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

Priority = Callable[[str, str], "float | int | None"]


def merge_symbols(symbols: list[str], priority: Priority) -> list[str]:
    """Merge adjacent symbols by `priority(left, right)` (None: never merge) until no pair is left."""
    count = len(symbols)
    if count < 2:
        return symbols
    text = list(symbols)
    following = list(range(1, count + 1))
    following[-1] = -1
    preceding = list(range(-1, count - 1))
    heap: list[tuple[float | int, int, int, str]] = []
    for i in range(count - 1):
        key = priority(text[i], text[i + 1])
        if key is not None:
            heap.append((key, i, i + 1, text[i] + text[i + 1]))
    heapq.heapify(heap)
    push, pop = heapq.heappush, heapq.heappop
    while heap:
        _, left, right, joined = pop(heap)
        left_text, right_text = text[left], text[right]
        if not left_text or not right_text or left_text + right_text != joined:
            continue
        text[left] = joined
        text[right] = ""
        after = following[right]
        following[left] = after
        if after >= 0:
            preceding[after] = left
        before = preceding[left]
        if before >= 0:
            key = priority(text[before], joined)
            if key is not None:
                push(heap, (key, before, left, text[before] + joined))
        if after >= 0:
            key = priority(joined, text[after])
            if key is not None:
                push(heap, (key, left, after, joined + text[after]))
    return [t for t in text if t]
