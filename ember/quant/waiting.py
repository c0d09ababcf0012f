"""Short waits without the GIL and without sleeping: what `ember.parallel`'s threads do between shares.

A helper thread that blocks on a queue takes a median 72 µs to wake (p90 110 µs) once work is handed to
it, and a caller blocked on a lock as long to learn that the helpers' last piece is done (measured on a
2-core Zen 3 VM, 2026-12-07). Decode shares a product about every 0.3-1 ms (Qwen3-30B-A3B: ~200 a
token), so each share lost ~0.14 ms that way: two threads each taking half the layers ran a token's
experts in 68 ms where sharing every product took 94. `wait_for_change` lets a thread watch a counter
for a bounded time instead (numba, nogil, the CPU's pause instruction between reads), before it blocks.
"""

from __future__ import annotations

import time

import numpy as np

from ember.quant import simd
from ember.quant.jit import njit


@njit(nogil=True, cache=True)
def _watch(counter, seen, rounds):
    for _ in range(rounds):
        if simd.read_counter(counter) != seen:
            return True
        simd.pause()
    return False


_rounds_per_microsecond = 0.0


def wait_for_change(counter: np.ndarray, seen: int, microseconds: float) -> bool:
    """Whether counter[0] (int64) moved from `seen` within about `microseconds`, watched without the GIL."""
    return bool(_watch(counter, seen, rounds(microseconds)))


def rounds(microseconds: float) -> int:
    """How many rounds of `_watch` (one read and one `simd.pause`) take about `microseconds` here."""
    return max(1, int(microseconds * _rounds_per_microsecond))


def warm_up() -> None:
    """Compile (or load) the watcher and measure how many of its rounds make a microsecond here."""
    global _rounds_per_microsecond
    still = np.zeros(1, np.int64)
    _watch(still, 0, 10)
    rounds = 20000
    started = time.perf_counter()
    _watch(still, 0, rounds)
    _rounds_per_microsecond = rounds / max((time.perf_counter() - started) * 1e6, 1.0)
