"""The experiment hook contract: experiments attached to a generation through fixed hooks (v0.1), plus
a read-only readout of the model's final norm and unembedding and item-by-item studies over prompt sets
(v0.2, docs/architecture.md)."""

from ember.experiments.activation_stats import ActivationStats
from ember.experiments.adapters import DISABLED_HOOKS, ActiveHooks, DisabledHooks, HooksAdapter
from ember.experiments.base import Experiment
from ember.experiments.context import (
    ExecutionContext,
    ExecutionPhase,
    GenerationContext,
    LayerContext,
    ModelContext,
    ModelFamily,
    TensorAccess,
    TensorDType,
    TracingState,
)
from ember.experiments.failure import ExperimentError, ExperimentFailure
from ember.experiments.readout import Readout
from ember.experiments.registry import BUILTIN_EXPERIMENTS
from ember.experiments.results import ExperimentResult, Metric
from ember.experiments.runner import ExperimentRunner
from ember.experiments.study import Evaluation, ItemResult, StudyItem
from ember.experiments.zero_layer_output import ZeroLayerOutput

__all__ = [
    "BUILTIN_EXPERIMENTS",
    "DISABLED_HOOKS",
    "ActivationStats",
    "ActiveHooks",
    "DisabledHooks",
    "Evaluation",
    "ExecutionContext",
    "ExecutionPhase",
    "Experiment",
    "ExperimentError",
    "ExperimentFailure",
    "ExperimentResult",
    "ExperimentRunner",
    "GenerationContext",
    "HooksAdapter",
    "ItemResult",
    "LayerContext",
    "Metric",
    "ModelContext",
    "ModelFamily",
    "Readout",
    "StudyItem",
    "TensorAccess",
    "TensorDType",
    "TracingState",
    "ZeroLayerOutput",
]
