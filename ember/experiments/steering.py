"""`steering`: contrastive activation addition, compatible with llama.cpp's control vectors.

A direction per layer is either read from a file (a llama.cpp control-vector GGUF, or a `.npy` of
`[hidden]` for the chosen layers) or made from the prompt set's pairs (`prompt` = positive side,
`corrupted` = negative side): both sides are run clean, the residual leaving each chosen layer is
pooled per prompt (`pool`: the last token, or the mean over tokens), and per layer

* `method="mean_diff"`: the mean over pairs of (positive - negative);
* `method="pca"`: the first principal component of the pair differences, uncentered as llama.cpp's
  cvector-generator computes it (the top right singular vector of the difference matrix), signed to
  agree with the mean difference and scaled to the mean difference's length along it.

Applied as llama.cpp applies a control vector: `scale * direction[layer]` is added to the residual
leaving each steered layer, at every position, in prefill and decode. `save` writes the directions as a
control-vector GGUF (`direction.<layer>`, layers from 1) that llama.cpp loads (`--control-vector`, or
`llama_set_adapter_cvec` with the same strength) to steer the same way.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ember.errors import ConfigError
from ember.experiments.base import Experiment
from ember.experiments.context import ExecutionPhase, LayerContext, ModelContext, TensorAccess
from ember.experiments.failure import ExperimentError
from ember.experiments.parameters import parse_phases
from ember.experiments.results import ExperimentResult, Metric
from ember.experiments.study import Evaluation, StudyItem

METHODS = ("mean_diff", "pca")
POOLS = ("last", "mean")


class Steering(Experiment):
    """Add `scale` times a per-layer direction to the residual stream leaving the steered layers.

    Parameters: `layers` (an index or a list; with a file, default: the file's layers), `scale`,
    `vector` (a control-vector .gguf or a .npy; null: made from the prompt set's pairs), `method`
    (mean_diff, pca), `pool` (last, mean), `save` (write the directions as a control-vector .gguf),
    `phases`, `name`.
    """

    may_write = True

    def __init__(self, layers: int | Sequence[int] | None = None, scale: float = 1.0,
                 vector: str | None = None, method: str = "mean_diff", pool: str = "last",
                 save: str | None = None, phases: str | Iterable[str] = "both",
                 name: str = "steering") -> None:
        if method not in METHODS:
            raise ConfigError(f"steering: method {method!r} is not one of {', '.join(METHODS)}")
        if pool not in POOLS:
            raise ConfigError(f"steering: pool {pool!r} is not one of {', '.join(POOLS)}")
        if not math.isfinite(scale):
            raise ConfigError(f"steering: scale must be a finite number, got {scale}")
        if vector is not None and not Path(vector).is_file():
            raise ConfigError(f"steering: vector file {vector!r} does not exist")
        if vector is None and layers is None:
            raise ConfigError("steering: give `layers` to make a direction at, or a `vector` file")
        self.name = name
        chosen = None if layers is None else {layers} if isinstance(layers, int) else set(layers)
        self.layers = None if chosen is None else tuple(sorted(chosen))
        self.scale = float(scale)
        self.vector = vector
        self.method = method
        self.pool = pool
        self.save = save
        self.phases = parse_phases(phases)
        self.directions: dict[int, np.ndarray] = {}
        self._model_hint = ""
        self._hidden_size = 0
        self._recording: dict[int, np.ndarray] | None = None
        self._steered = 0
        self._fit: dict[str, Any] = {}
        if vector is not None:
            self.directions = load_directions(vector, self.layers)
            if self.layers is None:
                self.layers = tuple(sorted(self.directions))

    def on_model_loaded(self, ctx: ModelContext) -> None:
        self._model_hint = ctx.architecture
        self._hidden_size = ctx.hidden_size
        outside = [x for x in self.layers or () if not 0 <= x < ctx.layer_count]
        if outside:
            raise ExperimentError(f"layers {outside} are outside the model's 0..{ctx.layer_count - 1}")
        for layer, values in self.directions.items():
            if values.size != ctx.hidden_size:
                raise ExperimentError(f"the direction for layer {layer} has {values.size} values; the "
                                      f"model's hidden size is {ctx.hidden_size}")

    # -- making the directions ---------------------------------------------------------------------

    def check_items(self, items: Sequence[StudyItem]) -> None:
        if self.vector is None and any(item.corrupted_ids is None for item in items):
            raise ConfigError("making a steering direction needs pairs: every item needs `corrupted` (the "
                              "negative side), e.g. data=sentiment; or give vector=<file>")

    def prepare_study(self, items: Sequence[StudyItem]) -> Generator[Evaluation, np.ndarray, None]:
        if self.vector is not None:
            return
        assert self.layers is not None
        pooled: dict[int, list[np.ndarray]] = {layer: [] for layer in self.layers}
        for item in items:
            sides = []
            for ids in (item.token_ids, item.corrupted_ids):
                self._recording = {}
                yield Evaluation(tuple(ids or ()))
                sides.append(self._recording)
            self._recording = None
            for layer in self.layers:
                pooled[layer].append(sides[0][layer] - sides[1][layer])
        for layer in self.layers:
            diffs = np.stack(pooled[layer]).astype(np.float64)  # [pairs, hidden]
            self.directions[layer] = make_direction(diffs, self.method)
        self._fit = {"pairs": len(items), "method": self.method, "pool": self.pool}
        if self.save:
            from ember.control_vectors import write_control_vector

            write_control_vector(self.save, self.directions, self._model_hint)

    def after_layer(self, ctx: LayerContext, hidden: TensorAccess) -> None:
        layer = ctx.layer_index
        if self._recording is not None:
            if ctx.execution.phase is ExecutionPhase.PREFILL and layer in (self.layers or ()):
                values = hidden.values()
                pooled = values[-1] if self.pool == "last" else values.mean(axis=0)
                self._recording[layer] = pooled.astype(np.float64)
            return
        direction = self.directions.get(layer)
        if direction is None or ctx.execution.phase not in self.phases:
            return
        if layer not in (self.layers or ()):
            return
        hidden.values_mut()[...] += np.float32(self.scale) * direction
        self._steered += 1

    def results(self) -> ExperimentResult:
        rows = [{"layer": layer, "norm": float(np.linalg.norm(v)), **self._fit}
                for layer, v in sorted(self.directions.items())]
        arrays = {"directions": np.stack([self.directions[k] for k in sorted(self.directions)])} \
            if self.directions else {}
        metrics = [Metric("steered_evaluations", float(self._steered))]
        metrics += [Metric("direction_norm", float(np.linalg.norm(v)), layer)
                    for layer, v in self.directions.items()]
        return ExperimentResult(metrics=metrics, tables={"directions": rows}, arrays=arrays)


def make_direction(diffs: np.ndarray, method: str) -> np.ndarray:
    """One layer's direction from pair differences [pairs, hidden]."""
    mean = diffs.mean(axis=0)
    if method == "mean_diff":
        return mean.astype(np.float32)
    # The top right singular vector of the (uncentered) differences = the first principal component as
    # llama.cpp's power iteration finds it; signed and sized by the mean difference along it.
    _, _, vt = np.linalg.svd(diffs, full_matrices=False)
    component = vt[0]
    along = float(component @ mean)
    if along < 0:
        component, along = -component, -along
    return (component * along).astype(np.float32)


def load_directions(path: str, layers: Sequence[int] | None) -> dict[int, np.ndarray]:
    """{layer: direction} from a control-vector .gguf (its layers) or a .npy ([hidden] or
    [layers, hidden])."""
    if path.endswith(".gguf"):
        from ember.control_vectors import read_control_vector

        directions = read_control_vector(path)
        if layers is not None:
            missing = [x for x in layers if x not in directions]
            if missing:
                raise ConfigError(f"steering: {path} has no direction for layers {missing} "
                                  f"(it has {sorted(directions)})")
            directions = {x: directions[x] for x in layers}
        return directions
    values = np.load(path).astype(np.float32)
    if values.ndim == 1:
        if layers is None:
            raise ConfigError(f"steering: {path} holds one direction; say which layers get it (layers=...)")
        return {layer: values for layer in layers}
    if values.ndim == 2:
        chosen = layers if layers is not None else range(values.shape[0])
        return {layer: values[layer] for layer in chosen}
    raise ConfigError(f"steering: {path} must hold [hidden] or [layers, hidden] values, got {values.shape}")
