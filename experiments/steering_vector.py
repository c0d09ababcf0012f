"""A worked example of a researcher's own experiment: add a steering vector at one layer.

Use it from the runner (conf/experiment/custom_steering.yaml refers to it by `_target_`; the built-in
contrastive steering with llama.cpp control vectors is `experiment=steering`):

    python -m ember.run experiment=custom_steering layer=6
    python -m ember.run experiment=custom_steering layer=6 experiments.0.scale=1.0 prompt="I think that"

or make a direction of your own from two contrasting prompts (the difference of the mean residual
streams leaving the layer) and steer with it:

    python experiments/steering_vector.py --positive "Love" --negative "Hate" --layer 6 --out love.npy
    python -m ember.run experiment=custom_steering layer=6 experiments.0.vector=love.npy

The experiment writes into the residual stream (`after_layer`), so the runner also compares the
result with the clean model (KL divergence, top-1 agreement) and logs it.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

from ember.experiments import Experiment, ExperimentError, ExperimentResult, Metric
from ember.experiments.context import ExecutionPhase, LayerContext, ModelContext, TensorAccess

_PHASES = {"prefill": {ExecutionPhase.PREFILL}, "decode": {ExecutionPhase.DECODE},
           "both": {ExecutionPhase.PREFILL, ExecutionPhase.DECODE}}


class SteeringVector(Experiment):
    """Add `scale` times a unit direction to the residual stream leaving layer `layer`.

    With `relative=True` (the default) the added vector's length is `scale` times the length of each
    residual row, so `scale=0.5` pushes every position half its own norm along the direction. With
    `relative=False` the direction (normalised) is multiplied by `scale` as is.

    `vector` is a `.npy` file holding a `[hidden_size]` direction; without it a random direction is
    drawn with `seed` (a control: a random push of the same size as a meaningful one).
    """

    may_write = True

    def __init__(
        self,
        layer: int,
        scale: float = 0.5,
        vector: str | None = None,
        seed: int = 0,
        relative: bool = True,
        phases: str = "both",
        name: str = "steering_vector",
    ) -> None:
        if phases not in _PHASES:
            raise ValueError(f"phases must be one of {', '.join(_PHASES)}, got {phases!r}")
        if not math.isfinite(scale):
            raise ValueError(f"scale must be a finite number, got {scale}")
        if vector is not None and not Path(vector).is_file():
            raise ValueError(f"vector file {vector!r} does not exist")
        self.name = name
        self.layer = layer
        self.scale = float(scale)
        self.vector_path = vector
        self.seed = seed
        self.relative = relative
        self.phases = _PHASES[phases]
        self.direction: np.ndarray | None = None
        self._added_norms: list[float] = []
        self._row_norms: list[float] = []

    def on_model_loaded(self, ctx: ModelContext) -> None:
        if not 0 <= self.layer < ctx.layer_count:
            raise ExperimentError(f"layer {self.layer} is outside 0..{ctx.layer_count - 1}")
        if self.vector_path is not None:
            direction = np.load(self.vector_path).astype(np.float32).reshape(-1)
        else:
            direction = np.random.default_rng(self.seed).standard_normal(ctx.hidden_size).astype(np.float32)
        if direction.size != ctx.hidden_size:
            raise ExperimentError(
                f"the steering vector has {direction.size} values but the model's hidden size is "
                f"{ctx.hidden_size}"
            )
        norm = float(np.linalg.norm(direction))
        if not math.isfinite(norm) or norm == 0.0:
            raise ExperimentError("the steering vector is zero or not finite")
        self.direction = direction / norm

    def after_layer(self, ctx: LayerContext, hidden: TensorAccess) -> None:
        if ctx.layer_index != self.layer or ctx.execution.phase not in self.phases:
            return
        assert self.direction is not None
        values = hidden.values_mut()
        row_norms = np.linalg.norm(values, axis=1, keepdims=True)
        amount = self.scale * row_norms if self.relative else np.full_like(row_norms, self.scale)
        values += amount * self.direction
        self._row_norms.extend(row_norms.ravel().tolist())
        self._added_norms.extend(np.abs(amount).ravel().tolist())

    def results(self) -> ExperimentResult:
        metrics = [Metric("steered_positions", float(len(self._added_norms)))]
        if self._added_norms:
            metrics += [
                Metric("added_norm_mean", float(np.mean(self._added_norms))),
                Metric("residual_norm_mean", float(np.mean(self._row_norms))),
            ]
        rows = [{"position_index": i, "residual_norm": r, "added_norm": a}
                for i, (r, a) in enumerate(zip(self._row_norms, self._added_norms, strict=True))]
        return ExperimentResult(metrics=metrics, tables={"steering": rows})


class _ResidualRecorder(Experiment):
    """Keeps the prefill residual rows leaving one layer (used to build a contrastive direction)."""

    name = "residual_recorder"
    may_write = False

    def __init__(self, layer: int) -> None:
        self.layer = layer
        self.rows: np.ndarray | None = None

    def after_layer(self, ctx: LayerContext, hidden: TensorAccess) -> None:
        if ctx.layer_index == self.layer and ctx.execution.phase is ExecutionPhase.PREFILL:
            self.rows = hidden.values().copy()


def contrastive_direction(model: object, positive: str, negative: str, layer: int) -> np.ndarray:
    """mean residual(positive) - mean residual(negative), leaving `layer`, over the prompt tokens."""
    means = []
    for prompt in (positive, negative):
        recorder = _ResidualRecorder(layer)
        model.generate(prompt, max_new_tokens=1, experiments=[recorder])  # type: ignore[attr-defined]
        assert recorder.rows is not None
        means.append(recorder.rows.mean(axis=0))
    return (means[0] - means[1]).astype(np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description="Save a contrastive steering direction as .npy")
    parser.add_argument("--positive", required=True)
    parser.add_argument("--negative", required=True)
    parser.add_argument("--layer", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()

    import ember

    model = ember.load_model(args.model, context_length=512)
    direction = contrastive_direction(model, args.positive, args.negative, args.layer)
    np.save(args.out, direction)
    norm = float(np.linalg.norm(direction))
    print(f"saved a direction of norm {norm:.3f} ({direction.size} values) to {args.out}")


if __name__ == "__main__":
    main()
