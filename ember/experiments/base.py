"""The `Experiment` base class: only `name` is required, every lifecycle method is a no-op by default."""

from __future__ import annotations

from ember.experiments.context import (
    ExecutionContext,
    GenerationContext,
    LayerContext,
    ModelContext,
    TensorAccess,
)
from ember.experiments.results import ExperimentResult

# The lifecycle in the order a successful generation calls it.
LIFECYCLE_HOOKS = ("on_model_loaded", "before_prefill", "on_generation_complete")
LAYER_HOOKS = ("before_layer", "after_attention", "after_mlp", "after_layer")
LOGITS_HOOKS = ("before_logits", "after_logits")
TENSOR_HOOKS = LAYER_HOOKS + LOGITS_HOOKS
ALL_HOOKS = ("on_model_loaded", "before_prefill", *TENSOR_HOOKS, "on_generation_complete")


class Experiment:
    """Base class of experiments attached to a generation.

    Set `name` (a class attribute or an instance attribute) and override only the hooks you need.
    Hooks run synchronously, in a fixed order; to fail, raise `ExperimentError` (any other exception
    escaping a hook is treated the same way). Tensor hooks get a `TensorAccess` valid only during the
    call. `results()` hands back what the experiment measured, also after a failure.
    """

    name: str = ""

    def on_model_loaded(self, ctx: ModelContext) -> None:
        """Once per generation, before anything runs."""

    def before_prefill(self, ctx: ExecutionContext) -> None:
        """Once per generation, before the prefill evaluation."""

    def before_layer(self, ctx: LayerContext, hidden: TensorAccess) -> None:
        """The residual stream entering layer `ctx.layer_index`, `[tokens, hidden]`."""

    def after_attention(self, ctx: LayerContext, attention_output: TensorAccess) -> None:
        """The attention block's contribution to the residual, before it is added, `[tokens, hidden]`."""

    def after_mlp(self, ctx: LayerContext, mlp_output: TensorAccess) -> None:
        """The MLP block's contribution to the residual, before it is added, `[tokens, hidden]`."""

    def after_layer(self, ctx: LayerContext, hidden: TensorAccess) -> None:
        """The residual stream leaving the layer, `[tokens, hidden]`."""

    def before_logits(self, ctx: ExecutionContext, hidden: TensorAccess) -> None:
        """The last token's hidden state after the final norm, `[1, hidden]`."""

    def after_logits(self, ctx: ExecutionContext, logits: TensorAccess) -> None:
        """The last token's logits after the family's post-processing, `[1, vocab]`."""

    def on_generation_complete(self, ctx: GenerationContext) -> None:
        """Once, when the generation finished successfully (never after a failure)."""

    def results(self) -> ExperimentResult:
        """What the experiment measured so far (the part it has after a failure)."""
        return ExperimentResult()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
