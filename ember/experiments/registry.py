"""Built-in experiments by the name a configuration uses."""

from __future__ import annotations

from ember.experiments.ablation import Ablation
from ember.experiments.activation_patching import ActivationPatching
from ember.experiments.activation_stats import ActivationStats
from ember.experiments.base import Experiment
from ember.experiments.logit_lens import LogitLens
from ember.experiments.steering import Steering
from ember.experiments.zero_layer_output import ZeroLayerOutput

BUILTIN_EXPERIMENTS: dict[str, type[Experiment]] = {
    "activation_stats": ActivationStats,
    "zero_layer_output": ZeroLayerOutput,
    "logit_lens": LogitLens,
    "activation_patching": ActivationPatching,
    "ablation": Ablation,
    "steering": Steering,
}
