"""`expert_usage`: which experts a mixture-of-experts model's tokens take, layer by layer.

At the `router` stage of every layer it reads the router logits and makes the choice from them as the
engine does (`ember.families.experts.route`: softmax, top-k, renormalised), so it counts the experts the
model actually runs; listed after an experiment that changes the router (a ban), it counts the changed
choice.

Results: `counts` [layers, experts] (how many evaluated rows chose each expert), per layer (step =
layer) the load's entropy in bits (`load_entropy`, at most log2(experts): every expert equally used) and
the largest share of the choices one expert took (`max_load_share`); a `choices` table, one row per
evaluated token and layer (phase, position, layer, the chosen experts and their weights, best first); a
layers × experts heatmap of each layer's load shares.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from ember.experiments.base import Experiment
from ember.experiments.context import ExecutionPhase, LayerContext, ModelContext, TensorAccess
from ember.experiments.failure import ExperimentError
from ember.experiments.parameters import parse_phases
from ember.experiments.results import ExperimentResult, Metric

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def load_entropy(counts: np.ndarray) -> float:
    """Entropy in bits of the distribution `counts` / Σ counts (0 for no counts)."""
    total = counts.sum()
    if total == 0:
        return 0.0
    shares = counts[counts > 0] / total
    return float(-(shares * np.log2(shares)).sum())


class ExpertUsage(Experiment):
    """Count the experts each layer's router chooses, in the chosen phases.

    Parameters: `phases` ("prefill", "decode" or "both", the default), `name`. A model without experts
    is an `ExperimentError` raised in `on_model_loaded`.
    """

    def __init__(self, phases: str | Iterable[str] = "both", name: str = "expert_usage") -> None:
        self.name = name
        self.phases = parse_phases(phases)
        self.top_k = 0
        self.counts: np.ndarray | None = None  # [layers, experts]
        self.choices: list[dict[str, Any]] = []

    def on_model_loaded(self, ctx: ModelContext) -> None:
        if not ctx.expert_count:
            model = ctx.model_id or ctx.architecture
            raise ExperimentError(f"{model} is not a mixture of experts (family {ctx.family.value}): it has "
                                  "no router whose choices expert_usage could count")
        self.top_k = ctx.experts_per_token
        self.counts = np.zeros((ctx.layer_count, ctx.expert_count), np.int64)
        self.choices = []

    def router(self, ctx: LayerContext, router_logits: TensorAccess) -> None:
        execution = ctx.execution
        if execution.phase not in self.phases or self.counts is None:
            return
        from ember.families.experts import route  # the engine's own choice (imported once a model runs)

        chosen, weights = route(router_logits.values(), self.top_k)
        self.counts[ctx.layer_index] += np.bincount(chosen.ravel(), minlength=self.counts.shape[1])
        phase = execution.phase.value
        for row, (experts, shares) in enumerate(zip(chosen.tolist(), weights.tolist(), strict=True)):
            self.choices.append({"phase": phase, "position": execution.start_position + row,
                                 "layer": ctx.layer_index, "experts": experts,
                                 "weights": [round(w, 6) for w in shares]})

    def results(self) -> ExperimentResult:
        if self.counts is None:
            return ExperimentResult()
        metrics = []
        for layer, counts in enumerate(self.counts):
            total = counts.sum()
            metrics.append(Metric("load_entropy", load_entropy(counts), layer))
            metrics.append(Metric("max_load_share", float(counts.max() / total) if total else 0.0, layer))
        choices = sorted(self.choices, key=lambda r: (r["phase"] != ExecutionPhase.PREFILL.value,
                                                      r["position"], r["layer"]))
        counts = self.counts.copy()
        return ExperimentResult(metrics=metrics, tables={"choices": choices}, arrays={"counts": counts},
                                figure_builders={"expert_load": lambda: _load_figure(counts)})


def _load_figure(counts: np.ndarray) -> Figure:
    from matplotlib.figure import Figure

    totals = counts.sum(axis=1, keepdims=True)
    shares = np.divide(counts, totals, out=np.zeros(counts.shape), where=totals > 0)
    layers, experts = counts.shape
    figure = Figure(figsize=(max(6, 0.12 * experts + 2), max(4, 0.2 * layers + 1.5)), layout="constrained")
    ax = figure.subplots()
    image = ax.imshow(shares, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest")
    figure.colorbar(image, ax=ax, label="share of the layer's choices")
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title("expert load per layer")
    return figure
