"""The experiment hook contract (v0.1)."""

from ember.experiments.context import ExecutionPhase, ModelFamily, TensorDType, TracingState

__all__ = ["ExecutionPhase", "ModelFamily", "TensorDType", "TracingState"]
