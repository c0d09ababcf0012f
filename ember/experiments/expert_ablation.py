"""`expert_ablation`: take experts out of a mixture-of-experts model, per layer or everywhere.

At the `router` stage of the chosen layers (every layer with `layer` unset) the banned experts' router
logits are set to −inf before the engine makes its choice (`ember.families.experts.route`): their
probability is 0, no row chooses them, and each row's top-k is taken from the experts that remain, their
weights renormalised over those (qwen3moe; Gemma 4 then multiplies by its per-expert scales). This is
what transformers computes with the same logits set to −inf before its softmax.

The ban holds in the chosen phases (prefill, decode or both) and, as every write, persists downstream
through the KV cache. The runner measures its effect against the clean model as for the other
interventions (per step KL divergence and top-1 agreement, first divergent step; in a study, per item,
with an answer the change in its probability and logit difference).

Results: `rerouted_choices`, how many (row, slot) choices the banned experts would have taken and the
ban sent elsewhere, and the same per layer as `rerouted_by_layer` (step = layer); `banned_rows`, the
evaluated rows the ban applied to (per layer, summed); a `rerouted` table, one row per phase, layer and
banned expert.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ember.errors import ConfigError
from ember.experiments.base import Experiment
from ember.experiments.context import ExecutionPhase, LayerContext, ModelContext, TensorAccess
from ember.experiments.parameters import parse_phases
from ember.experiments.results import ExperimentResult, Metric


def _indices(what: str, value: int | Sequence[int] | None, needed: str) -> tuple[int, ...]:
    """A sorted tuple of distinct non-negative integers from one integer or a list (ConfigError else)."""
    if value is None:
        raise ConfigError(f"expert_ablation needs {needed}")
    items = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if (
        isinstance(items, str)
        or not isinstance(items, Sequence)
        or not items
        or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in items)
    ):
        raise ConfigError(
            f"expert_ablation: {what} must be an index or a non-empty list of indices "
            f"(0, 1, ...), got {value!r}"
        )
    return tuple(sorted(set(items)))


class ExpertAblation(Experiment):
    """Ban experts (their router logits −inf) in the chosen layers, or in every layer.

    Parameters: `experts` (one expert index or a list), `layer` (an index or a list; unset: every layer),
    `phases` ("prefill", "decode" or "both", the default), `name`. A model without experts, an expert
    index past the model's experts, a layer past its layers, or a ban that leaves fewer experts than a
    token takes is a `ConfigError` (one line), raised before the model is loaded when the runner runs it.
    """

    may_write = True
    batched = True  # the ban is the same for every row of every sequence

    def __init__(
        self,
        experts: int | Sequence[int] | None = None,
        layer: int | Sequence[int] | None = None,
        phases: str | Iterable[str] = "both",
        name: str = "expert_ablation",
    ) -> None:
        self.name = name
        self.experts = _indices(
            "experts",
            experts,
            "`experts`, the experts to ban: an index or a list, e.g. 'experiments.0.experts=[3]'",
        )
        self.layers = None if layer is None else _indices("layer", layer, "")
        self.phases = parse_phases(phases)
        self._columns = np.asarray(self.experts, np.intp)
        self._layer_set: frozenset[int] | None = None if self.layers is None else frozenset(self.layers)
        self.top_k = 0
        self._rerouted: dict[tuple[ExecutionPhase, int], np.ndarray] = {}  # per banned expert
        self._rows: dict[tuple[ExecutionPhase, int], int] = {}

    def check_model(self, ctx: ModelContext) -> None:
        """Refuse a dense model, experts or layers it does not have, and a ban of too many experts."""
        model = ctx.model_id or ctx.architecture
        if not ctx.expert_count:
            raise ConfigError(
                f"expert_ablation: {model} is not a mixture of experts (family "
                f"{ctx.family.value}): it has no router whose experts could be banned"
            )
        outside = [e for e in self.experts if e >= ctx.expert_count]
        if outside:
            raise ConfigError(
                f"expert_ablation: expert {', '.join(map(str, outside))} is outside the model: "
                f"{model} has {ctx.expert_count} experts per layer (0..{ctx.expert_count - 1})"
            )
        remaining = ctx.expert_count - len(self.experts)
        if remaining < ctx.experts_per_token:
            raise ConfigError(
                f"expert_ablation: banning {len(self.experts)} of {model}'s {ctx.expert_count} "
                f"experts leaves {remaining}, fewer than the {ctx.experts_per_token} each token "
                "takes"
            )
        outside = [layer for layer in self.layers or () if layer >= ctx.layer_count]
        if outside:
            raise ConfigError(
                f"expert_ablation: layer {', '.join(map(str, outside))} is outside the model: "
                f"{model} has {ctx.layer_count} layers (0..{ctx.layer_count - 1})"
            )

    def on_model_loaded(self, ctx: ModelContext) -> None:
        self.check_model(ctx)
        self.top_k = ctx.experts_per_token
        self._rerouted, self._rows = {}, {}

    def router(self, ctx: LayerContext, router_logits: TensorAccess) -> None:
        phase = ctx.execution.phase
        if phase not in self.phases or (
            self._layer_set is not None and ctx.layer_index not in self._layer_set
        ):
            return
        from ember.families.experts import route  # the engine's own choice (imported once a model runs)

        logits = router_logits.values_mut()
        chosen, _ = route(logits, self.top_k)  # the choice the ban overrides
        key = (phase, ctx.layer_index)
        counts = self._rerouted.setdefault(key, np.zeros(len(self.experts), np.int64))
        counts += (chosen.ravel()[:, None] == self._columns[None, :]).sum(axis=0)
        self._rows[key] = self._rows.get(key, 0) + logits.shape[0]
        logits[:, self._columns] = -np.inf

    def results(self) -> ExperimentResult:
        per_layer: dict[int, int] = {}
        table: list[dict[str, Any]] = []
        for (phase, layer), counts in sorted(
            self._rerouted.items(), key=lambda item: (item[0][0] is not ExecutionPhase.PREFILL, item[0][1])
        ):
            per_layer[layer] = per_layer.get(layer, 0) + int(counts.sum())
            table += [
                {
                    "phase": phase.value,
                    "layer": layer,
                    "expert": expert,
                    "rows": self._rows[(phase, layer)],
                    "rerouted": int(count),
                }
                for expert, count in zip(self.experts, counts, strict=True)
            ]
        metrics = [
            Metric("rerouted_choices", float(sum(per_layer.values()))),
            Metric("banned_rows", float(sum(self._rows.values()))),
        ]
        metrics += [
            Metric("rerouted_by_layer", float(count), layer) for layer, count in sorted(per_layer.items())
        ]
        return ExperimentResult(metrics=metrics, tables={"rerouted": table} if table else {})
