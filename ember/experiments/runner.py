"""`ExperimentRunner`: drives the experiments of one generation through the lifecycle."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ember.errors import ConfigError
from ember.experiments.adapters import ActiveHooks
from ember.experiments.context import (
    ExecutionContext,
    ExecutionPhase,
    GenerationContext,
    ModelContext,
    TracingState,
)
from ember.experiments.failure import ExperimentFailure, describe_exception
from ember.experiments.results import ExperimentResult


class ExperimentRunner:
    """Runs a list of experiments through one generation.

    The engine calls `on_model_loaded()`, `before_prefill(...)`, passes `hooks` to its forward passes,
    then calls `on_generation_complete(...)`. Each call raises `ExperimentFailure` when an experiment
    fails; from then on no hook of any experiment runs. `results()` works at any time, also after a
    failure, and gives what each experiment has.
    """

    def __init__(
        self,
        experiments: Sequence[Any],
        model: ModelContext,
        tracing: TracingState = TracingState.DISABLED,
    ) -> None:
        self.experiments = list(experiments)
        _check_names(self.experiments)
        self.model = model
        self.tracing = TracingState(tracing)
        self.hooks = ActiveHooks(self.experiments, model, self.tracing)

    @property
    def failure(self) -> ExperimentFailure | None:
        return self.hooks.failure

    def on_model_loaded(self) -> None:
        self.hooks.run_lifecycle("on_model_loaded", self.model)

    def before_prefill(self, start_position: int, input_token_count: int) -> None:
        ctx = ExecutionContext(
            self.model, ExecutionPhase.PREFILL, int(start_position), int(input_token_count), self.tracing
        )
        self.hooks.run_lifecycle("before_prefill", ctx, ExecutionPhase.PREFILL)

    def on_generation_complete(
        self, prompt_token_count: int, generated_token_count: int, decode_evaluation_count: int
    ) -> None:
        ctx = GenerationContext(
            self.model,
            int(prompt_token_count),
            int(generated_token_count),
            int(decode_evaluation_count),
            self.tracing,
        )
        self.hooks.run_lifecycle("on_generation_complete", ctx)

    def results(self) -> dict[str, ExperimentResult]:
        """Experiment name -> its result. After a failure, an experiment whose `results()` itself
        raises gets an empty result (the first failure is the one reported)."""
        collected: dict[str, ExperimentResult] = {}
        for experiment in self.experiments:
            produce = getattr(experiment, "results", None)
            if produce is None:
                collected[experiment.name] = ExperimentResult()
                continue
            try:
                result = produce()
                if not isinstance(result, ExperimentResult):
                    raise TypeError(f"results() returned {type(result).__name__}, not an ExperimentResult")
            except Exception as error:
                if self.failure is not None:
                    collected[experiment.name] = ExperimentResult()
                    continue
                raise ExperimentFailure(experiment.name, "results", describe_exception(error)) from error
            collected[experiment.name] = result
        return collected


def _check_names(experiments: list[Any]) -> None:
    seen: set[str] = set()
    for experiment in experiments:
        name = getattr(experiment, "name", None)
        if not isinstance(name, str) or not name:
            raise ConfigError(f"experiment {experiment!r} has no name: set a non-empty string `name`")
        if name in seen:
            raise ConfigError(f"two experiments are named '{name}': give each a distinct name")
        seen.add(name)
