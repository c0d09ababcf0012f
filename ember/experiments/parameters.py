"""Plain-parameter parsing shared by the built-in experiments (errors name the bad value)."""

from __future__ import annotations

from collections.abc import Iterable

from ember.errors import ConfigError
from ember.experiments.context import ExecutionPhase

_PHASE_WORDS = {
    "prefill": frozenset({ExecutionPhase.PREFILL}),
    "decode": frozenset({ExecutionPhase.DECODE}),
    "both": frozenset(ExecutionPhase),
}


def parse_phases(phases: str | ExecutionPhase | Iterable[str | ExecutionPhase]) -> frozenset[ExecutionPhase]:
    """Turn "prefill", "decode", "both", an ExecutionPhase, or a list of those into a set of phases."""
    items = [phases] if isinstance(phases, str | ExecutionPhase) else list(phases)
    chosen: set[ExecutionPhase] = set()
    for item in items:
        if isinstance(item, ExecutionPhase):
            chosen.add(item)
        elif isinstance(item, str) and item.lower() in _PHASE_WORDS:
            chosen |= _PHASE_WORDS[item.lower()]
        else:
            raise ConfigError(f"phases: {item!r} is not one of 'prefill', 'decode', 'both'")
    if not chosen:
        raise ConfigError("phases: the list is empty; use 'prefill', 'decode' or 'both'")
    return frozenset(chosen)
