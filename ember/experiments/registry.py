"""Built-in experiments by the name a configuration uses."""

from __future__ import annotations

from ember.experiments.activation_stats import ActivationStats
from ember.experiments.base import Experiment
from ember.experiments.zero_layer_output import ZeroLayerOutput

BUILTIN_EXPERIMENTS: dict[str, type[Experiment]] = {
    "activation_stats": ActivationStats,
    "zero_layer_output": ZeroLayerOutput,
}
