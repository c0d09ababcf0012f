"""What a search optimizes: the one number a job returns to its sweeper (`hydra/sweeper=optuna`).

    objective:
      metric: effect.kl_mean            # a metric this job records (its step-0 value, else its last)
      # value: ${experiments.0.scale}   # ... or a number from the job's own config
      require:                          # optional: the trial counts as meeting its target only where
        metric: effect.answer_changed   #   this metric reaches `at_least`
        at_least: 0.8
      penalty: 10.0                     # a trial that misses is worse by penalty * (1 + shortfall)

The direction (minimize or maximize) is the sweeper's (`hydra.sweeper.direction`). With a `value` to
minimize and a `require`ment, the search finds the smallest setting that meets the target, e.g. the
smallest steering scale that changes the answer (conf/search/steering_flip.yaml). Every job of a
search logs its `objective` metric; at the end of the sweep the parent run is tagged with the best one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf

from ember.errors import ConfigError

OBJECTIVE_KEYS = {"metric", "value", "require", "penalty"}


class TrialFailed(RuntimeError):
    """A job of a search that failed: its sweeper records the trial as failed, not as a value."""


@dataclass(frozen=True, slots=True)
class Requirement:
    metric: str
    at_least: float


@dataclass(frozen=True, slots=True)
class Objective:
    metric: str | None
    value: float | None
    require: Requirement | None
    penalty: float
    maximize: bool

    def evaluate(self, metrics: Mapping[str, float]) -> tuple[float, bool]:
        """(objective, whether the requirement was met) from the job's recorded metrics."""
        base = self.value if self.metric is None else _metric(metrics, self.metric)
        assert base is not None
        if self.require is None:
            return base, True
        reached = _metric(metrics, self.require.metric)
        shortfall = self.require.at_least - reached
        if shortfall <= 0:
            return base, True
        worse = self.penalty * (1.0 + shortfall)
        return (base - worse if self.maximize else base + worse), False


def _metric(metrics: Mapping[str, float], name: str) -> float:
    if name not in metrics:
        known = ", ".join(sorted(metrics)) or "none"
        raise TrialFailed(f"objective: this job recorded no metric {name!r} (it recorded: {known})")
    return metrics[name]


def parse_objective(cfg: Any, direction: str | None = None) -> Objective | None:
    """The job's `objective` section, checked; None when the job has none."""
    section = OmegaConf.select(cfg, "objective", default=None)
    if section is None:
        return None
    plain = OmegaConf.to_container(section, resolve=True) if OmegaConf.is_config(section) else section
    if not isinstance(plain, dict):
        raise ConfigError(f"objective must be a mapping with 'metric' or 'value', got {plain!r}")
    unknown = sorted(set(plain) - OBJECTIVE_KEYS)
    if unknown:
        raise ConfigError(f"unknown key objective.{unknown[0]}; known: {', '.join(sorted(OBJECTIVE_KEYS))}")
    metric, value = plain.get("metric"), plain.get("value")
    if (metric is None) == (value is None):
        raise ConfigError("objective needs exactly one of 'metric' (a recorded metric) and 'value' "
                          f"(a number), got metric={metric!r}, value={value!r}")
    if metric is not None and not isinstance(metric, str):
        raise ConfigError(f"objective.metric must be a metric name, got {metric!r}")
    number = None if value is None else _number("objective.value", value)
    require = None
    if plain.get("require") is not None:
        spec = plain["require"]
        if not isinstance(spec, dict) or set(spec) != {"metric", "at_least"}:
            raise ConfigError(f"objective.require must be {{metric: NAME, at_least: NUMBER}}, got {spec!r}")
        require = Requirement(str(spec["metric"]), _number("objective.require.at_least", spec["at_least"]))
    penalty = _number("objective.penalty", plain.get("penalty", 10.0))
    if penalty <= 0:
        raise ConfigError(f"objective.penalty must be positive, got {penalty}")
    maximize = str(direction or "minimize").lower().endswith("maximize")
    return Objective(metric, number, require, penalty, maximize)


def _number(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(float(value)):
        raise ConfigError(f"{where} must be a finite number, got {value!r}")
    return float(value)


def sweeper_direction() -> str | None:
    """`hydra.sweeper.direction` of the running job, when Hydra runs it."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    direction = OmegaConf.select(HydraConfig.get(), "sweeper.direction", default=None)
    if isinstance(direction, list | tuple) or OmegaConf.is_list(direction):
        raise ConfigError("objective: ember's jobs return one objective; hydra.sweeper.direction must be "
                          f"one direction, got {list(direction)}")
    return None if direction is None else str(direction)
