"""The `Experiment` base class: only `name` is required, every lifecycle method is a no-op by default."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ember.experiments.context import (
    ExecutionContext,
    GenerationContext,
    LayerContext,
    ModelContext,
    TensorAccess,
)
from ember.experiments.results import ExperimentResult
from ember.stages import LAYER_NAMES, MODEL_NAMES, NAMES, Scope, Stage, define_stage_methods

# The lifecycle in the order a successful generation calls it; the tensor hooks are the stages
# (ember/stages.py), in their order.
LIFECYCLE_HOOKS = ("on_model_loaded", "before_prefill", "on_generation_complete")
LAYER_HOOKS = LAYER_NAMES
LOGITS_HOOKS = MODEL_NAMES
TENSOR_HOOKS = NAMES
ALL_HOOKS = ("on_model_loaded", "before_prefill", *TENSOR_HOOKS, "on_generation_complete")


class Experiment:
    """Base class of experiments attached to a generation.

    Set `name` (a class attribute or an instance attribute) and override only the hooks you need.
    Hooks run synchronously, in a fixed order; to fail, raise `ExperimentError` (any other exception
    escaping a hook is treated the same way). Tensor hooks get a `TensorAccess` valid only during the
    call. `results()` hands back what the experiment measured, also after a failure.

    The tensor hooks are one per stage of `ember.stages.STAGES`, in its order, each a no-op here:
    `before_layer(ctx, hidden)` ... `after_logits(ctx, logits)`.
    """

    name: str = ""
    # Contract v0.3: True when the tensor hooks handle a batch of sequences in one tensor (the context's
    # `spans` say which rows are which); an experiment that leaves it False sees one sequence at a time.
    batched: bool = False

    def on_model_loaded(self, ctx: ModelContext) -> None:
        """Once per generation, before anything runs."""

    def before_prefill(self, ctx: ExecutionContext) -> None:
        """Once per generation, before the prefill evaluation."""

    # the tensor hooks: `define_stage_methods(Experiment, _default_hook)` below

    def on_generation_complete(self, ctx: GenerationContext) -> None:
        """Once, when the generation finished successfully (never after a failure)."""

    def results(self) -> ExperimentResult:
        """What the experiment measured so far (the part it has after a failure)."""
        return ExperimentResult()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _default_hook(stage: Stage) -> Callable[..., None]:
    """`Experiment`'s no-op for a stage, documented from the table."""
    context = LayerContext if stage.scope is Scope.LAYER else ExecutionContext

    def hook(self: Experiment, ctx: Any, tensor: TensorAccess) -> None:
        pass

    hook.__code__ = hook.__code__.replace(co_varnames=("self", "ctx", stage.argument))  # callable by keyword
    hook.__doc__ = f"{stage.meaning}, `{stage.shape}`."
    hook.__signature__ = inspect.Signature([  # type: ignore[attr-defined]  # what help() shows
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=context),
        inspect.Parameter(stage.argument, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=TensorAccess),
    ], return_annotation=None)
    return hook


define_stage_methods(Experiment, _default_hook)
