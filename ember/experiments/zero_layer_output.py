"""`zero_layer_output`: the reference intervention experiment.

"Zeroing a layer's output" means replacing a block's contribution to the residual stream with zeros
at the boundary where the contract exposes it, so the residual add adds nothing:

* LLaMA / Qwen3: `target="attention"` zeroes the attention output after the O projection (before the
  residual add), `target="mlp"` zeroes the MLP output after the down projection (before the residual
  add). `target="both"` (the default) removes the layer's whole contribution: the residual stream
  leaves the layer exactly as it entered it. The layer still writes its K/V for the tokens into the
  cache (they are computed from the layer's input), but nothing the layer computes reaches the
  residual.
* Gemma 4: the exposed outputs come after the post-attention / post-FFN RMS norms, so zeroing them
  removes the blocks' contributions as well; but the layer output also receives the per-layer
  embedding (PLE) term and the layer-output scaling, so with `target="both"` the residual is not
  passed through unchanged there.

Writes persist downstream: a change in prefill reaches later tokens through the KV cache of the
layers after the zeroed one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ember.errors import ConfigError
from ember.experiments.base import Experiment
from ember.experiments.context import ExecutionPhase, LayerContext, ModelContext, TensorAccess
from ember.experiments.failure import ExperimentError
from ember.experiments.parameters import parse_phases
from ember.experiments.results import ExperimentResult, Metric

TARGETS = ("attention", "mlp", "both")


def _parse_layers(layer: int | Iterable[int]) -> tuple[int, ...]:
    items = [layer] if isinstance(layer, int) else list(layer)
    if not items:
        raise ConfigError("zero_layer_output: `layer` is empty; give one layer index or a list")
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int):
            raise ConfigError(f"zero_layer_output: layer {item!r} is not an integer layer index")
    return tuple(sorted(set(items)))


class ZeroLayerOutput(Experiment):
    """Zero the attention and/or MLP output of the chosen layers, in the chosen phases.

    Parameters: `layer` (one 0-based index or a list), `target` ("attention", "mlp" or "both", the
    default), `phases` ("prefill", "decode" or "both", the default), `name`. A layer outside the model
    is an `ExperimentError` raised in `on_model_loaded`, naming the valid range.
    """

    def __init__(
        self,
        layer: int | Iterable[int],
        target: str = "both",
        phases: str | Iterable[str] = "both",
        name: str = "zero_layer_output",
    ) -> None:
        if target not in TARGETS:
            raise ConfigError(f"zero_layer_output: target {target!r} is not one of {', '.join(TARGETS)}")
        self.name = name
        self.layers = _parse_layers(layer)
        self.target = target
        self.phases = parse_phases(phases)
        self._layer_set = frozenset(self.layers)
        self._zero_attention = target in ("attention", "both")
        self._zero_mlp = target in ("mlp", "both")
        self._zeroed: dict[tuple[ExecutionPhase, str, int], int] = {}

    def on_model_loaded(self, ctx: ModelContext) -> None:
        outside = [layer for layer in self.layers if not 0 <= layer < ctx.layer_count]
        if outside:
            model = ctx.model_id or ctx.architecture
            raise ExperimentError(
                f"layer {', '.join(map(str, outside))} is outside the model: {model} has "
                f"{ctx.layer_count} layers, valid layers are 0..{ctx.layer_count - 1}"
            )

    def _maybe_zero(self, hook: str, ctx: LayerContext, tensor: TensorAccess) -> None:
        phase = ctx.execution.phase
        if ctx.layer_index in self._layer_set and phase in self.phases:
            tensor.zero()
            key = (phase, hook, ctx.layer_index)
            self._zeroed[key] = self._zeroed.get(key, 0) + 1

    def after_attention(self, ctx: LayerContext, attention_output: TensorAccess) -> None:
        if self._zero_attention:
            self._maybe_zero("after_attention", ctx, attention_output)

    def after_mlp(self, ctx: LayerContext, mlp_output: TensorAccess) -> None:
        if self._zero_mlp:
            self._maybe_zero("after_mlp", ctx, mlp_output)

    def results(self) -> ExperimentResult:
        rows: list[dict[str, Any]] = [
            {"phase": phase.value, "hook": hook, "layer": layer, "evaluations": count}
            for (phase, hook, layer), count in sorted(
                self._zeroed.items(), key=lambda item: (item[0][0].value != "prefill", item[0][2], item[0][1])
            )
        ]
        metrics = [Metric("zeroed_tensors", float(sum(self._zeroed.values())))]
        return ExperimentResult(metrics=metrics, tables={"zeroed": rows})
