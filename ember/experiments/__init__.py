"""The experiment hook contract (v0.1): experiments attached to a generation through fixed hooks."""

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
from ember.experiments.registry import BUILTIN_EXPERIMENTS
from ember.experiments.results import ExperimentResult, Metric
from ember.experiments.runner import ExperimentRunner
from ember.experiments.zero_layer_output import ZeroLayerOutput

__all__ = [
    "BUILTIN_EXPERIMENTS",
    "DISABLED_HOOKS",
    "ActivationStats",
    "ActiveHooks",
    "DisabledHooks",
    "ExecutionContext",
    "ExecutionPhase",
    "Experiment",
    "ExperimentError",
    "ExperimentFailure",
    "ExperimentResult",
    "ExperimentRunner",
    "GenerationContext",
    "HooksAdapter",
    "LayerContext",
    "Metric",
    "ModelContext",
    "ModelFamily",
    "TensorAccess",
    "TensorDType",
    "TracingState",
    "ZeroLayerOutput",
]
