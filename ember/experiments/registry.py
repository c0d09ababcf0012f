"""Built-in experiments by the name a configuration uses."""

from __future__ import annotations

from ember.experiments.ablation import Ablation
from ember.experiments.activation_patching import ActivationPatching
from ember.experiments.activation_stats import ActivationStats
from ember.experiments.attention_patterns import AttentionPatterns
from ember.experiments.base import Experiment
from ember.experiments.direct_logit_attribution import DirectLogitAttribution
from ember.experiments.expert_ablation import ExpertAblation
from ember.experiments.expert_usage import ExpertUsage
from ember.experiments.head_patching import HeadPatching
from ember.experiments.logit_lens import LogitLens
from ember.experiments.path_patching import PathPatching
from ember.experiments.steering import Steering
from ember.experiments.zero_layer_output import ZeroLayerOutput

BUILTIN_EXPERIMENTS: dict[str, type[Experiment]] = {
    "activation_stats": ActivationStats,
    "zero_layer_output": ZeroLayerOutput,
    "logit_lens": LogitLens,
    "activation_patching": ActivationPatching,
    "head_patching": HeadPatching,
    "ablation": Ablation,
    "steering": Steering,
    "direct_logit_attribution": DirectLogitAttribution,
    "expert_usage": ExpertUsage,
    "expert_ablation": ExpertAblation,
    "path_patching": PathPatching,
    "attention_patterns": AttentionPatterns,
}

# Names of the config's experiment/ group (conf/experiment/*.yaml) where they differ from a class's own
# name: both front doors (`experiment=zero_layer`, `--experiment zero_layer:layer=3`) take either.
ALIASES: dict[str, str] = {"zero_layer": "zero_layer_output"}


def experiment_names(builtins: dict[str, type[Experiment]] | None = None) -> list[str]:
    """The names to show a user: the config's where it has its own, e.g. `zero_layer (alias
    zero_layer_output)`."""
    builtins = BUILTIN_EXPERIMENTS if builtins is None else builtins
    alias_of = {name: alias for alias, name in ALIASES.items()}
    return sorted(f"{alias_of[name]} (alias {name})" if name in alias_of else name for name in builtins)
