"""How an experiment says it failed (`ExperimentError`) and what the caller gets (`ExperimentFailure`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ember.errors import EmberError

if TYPE_CHECKING:
    from ember.experiments.context import ExecutionPhase


class ExperimentError(EmberError):
    """Raised by an experiment's hook to say it failed; the runner wraps it in `ExperimentFailure`."""


class ExperimentFailure(EmberError):
    """An experiment failed: which one, in which hook, at which phase and layer, and why.

    `str()` reads, for example (one line): `experiment 'my-experiment' failed in after_attention
    (phase=decode, layer=7): expected a finite activation`.
    The phase is given for prefill, layer and logits hooks, the layer for layer hooks. The original
    exception is chained as `__cause__`. The engine attaches the partial generation as `generation`.
    """

    def __init__(
        self,
        experiment: str,
        hook: str,
        message: str,
        *,
        phase: ExecutionPhase | None = None,
        layer: int | None = None,
    ) -> None:
        self.experiment = experiment
        self.hook = hook
        self.phase = phase
        self.layer = layer
        self.message = message
        self.generation: Any = None
        super().__init__(self._describe())

    def _describe(self) -> str:
        where = []
        if self.phase is not None:
            where.append(f"phase={self.phase.value}")
        if self.layer is not None:
            where.append(f"layer={self.layer}")
        location = f" ({', '.join(where)})" if where else ""
        return f"experiment '{self.experiment}' failed in {self.hook}{location}: {self.message}"

    def __str__(self) -> str:
        return self._describe()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_failure, (self.experiment, self.hook, self.message, self.phase, self.layer))


def _rebuild_failure(
    experiment: str, hook: str, message: str, phase: ExecutionPhase | None, layer: int | None
) -> ExperimentFailure:
    return ExperimentFailure(experiment, hook, message, phase=phase, layer=layer)


def describe_exception(error: BaseException) -> str:
    """The message an `ExperimentFailure` carries for an exception escaping a hook."""
    if isinstance(error, ExperimentError):
        return str(error) or "ExperimentError"
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
