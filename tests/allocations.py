"""Per-step allocation measurement for the "decode allocates no activation" tests.

tracemalloc sees every Python-level allocation of the process, NumPy data blocks included, from every
thread. A test process also holds other threads (MLflow's async loggers, run heartbeats, a progress
bar left by an earlier test): on a busy machine their wake-ups land inside a measured step at random
and were seen to add ~250 bytes to one step's peak (4348 bytes against a 4096 limit, issue 13). What
the engine itself allocates happens again at every step, so the tests judge the *median* step: an
allocation of the engine shows in it, a stray one from another thread does not.
"""

from __future__ import annotations

import statistics
import tracemalloc
from collections.abc import Callable


def step_allocations(step: Callable[[int], object], steps: range) -> tuple[list[int], list[int]]:
    """(transient peak, bytes kept) per call of `step(i)` for i in `steps`, in bytes, each measured from
    the traced total just before the step."""
    peaks, kept = [], []
    tracemalloc.start()
    try:
        for index in steps:
            tracemalloc.reset_peak()
            before, _ = tracemalloc.get_traced_memory()
            step(index)
            after, peak = tracemalloc.get_traced_memory()
            peaks.append(peak - before)
            kept.append(after - before)
    finally:
        tracemalloc.stop()
    return peaks, kept


def typical(values: list[int]) -> float:
    """The median step: what the engine does every step, not what another thread did once."""
    return statistics.median(values)
