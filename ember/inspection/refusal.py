"""The v0.1 boundary between inspection surfaces and active experiments.

Active experiments do not run together with layer dumps, logits dumps, hidden-state extraction, probes,
or the demo, interactive and benchmark commands: ember has not decided whether such surfaces would show
values before or after an intervention, so it refuses the combination rather than show a value whose
meaning is ambiguous. Structured tracing is not a value surface and may run with experiments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ember.errors import ConfigError

SURFACES = {
    "dump_layers": "--dump-layers",
    "dump_logits": "--dump-logits",
    "extract": "hidden-state extraction (ember extract)",
    "probe": "probes (ember probe)",
    "interactive": "the interactive command (ember interactive)",
    "demo": "the demo command (ember demo)",
    "benchmark": "the benchmark command (ember benchmark)",
}

_WHY = {
    "dump_layers": "a dump would hold values whose before/after-intervention meaning is not defined in v0.1",
    "dump_logits": "a dump would hold values whose before/after-intervention meaning is not defined in v0.1",
    "extract": "extracted states would have no defined before/after-intervention meaning in v0.1",
    "probe": "probe features would have no defined before/after-intervention meaning in v0.1",
    "interactive": "a chat shows the model's behaviour, and with an intervention attached it would be "
                   "unclear which model is talking",
    "demo": "the demo shows the unmodified model",
    "benchmark": "figures measured with hooks attached would not be the engine's figures",
}


class ExperimentConflictError(ConfigError):
    """An inspection surface or command was combined with active experiments."""


def refuse_with_experiments(surface: str, experiments: Sequence[Any]) -> None:
    """Raise ExperimentConflictError when `experiments` is not empty; call before loading the model."""
    if not experiments:
        return
    names = ", ".join(_label(e) for e in experiments)
    raise ExperimentConflictError(
        f"{SURFACES[surface]} cannot run with active experiments ({names}): {_WHY[surface]}. "
        "Run it without experiments, or run the experiments without it (tracing may run with experiments)."
    )


def _label(experiment: Any) -> str:
    if isinstance(experiment, str):
        return experiment
    return str(getattr(experiment, "name", None) or getattr(experiment, "label", None) or experiment)
