"""`steering`: contrastive activation addition, compatible with llama.cpp's control vectors.

A direction per layer is either read from a file (a llama.cpp control-vector GGUF, or a `.npy` of
`[hidden]` for the chosen layers) or made from the prompt set's pairs (`prompt` = positive side,
`corrupted` = negative side): both sides are run clean (the pairs in batches), the residual leaving
each chosen layer is pooled per prompt (`pool`: the last token, or the mean over tokens), and per layer

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
# Pairs per batch when making the directions: a larger set is several batches, so that the logits handed
# back (one [vocab] row per prompt) stay small. The size matters little past a few prompts (measured for
# the mean pass of `ablation`, ITEMS_PER_BATCH); 32 pairs are 64 prompts, as many as that.
PAIRS_PER_BATCH = 32


class Steering(Experiment):
    """Add `scale` times a per-layer direction to the residual stream leaving the steered layers.

    Parameters: `layers` (an index or a list; with a file, default: the file's layers), `scale`,
    `vector` (a control-vector .gguf or a .npy; null: made from the prompt set's pairs), `method`
    (mean_diff, pca), `pool` (last, mean), `save` (write the directions as a control-vector .gguf),
    `phases`, `name`.
    """

    may_write = True
    batched = True  # contract v0.3: the pairs are recorded by `span.tag`; steering adds to every row

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
        self._recording: dict[Any, dict[int, np.ndarray]] | None = None  # tag -> layer -> pooled
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

    def prepare_study(self, items: Sequence[StudyItem]
                      ) -> Generator[list[Evaluation], list[np.ndarray], None]:
        if self.vector is not None:
            return
        assert self.layers is not None
        pooled: dict[int, list[np.ndarray]] = {layer: [] for layer in self.layers}
        try:
            for first in range(0, len(items), PAIRS_PER_BATCH):
                pairs = range(first, min(first + PAIRS_PER_BATCH, len(items)))
                self._recording = {}
                yield [Evaluation(tuple(ids or ()), tag=(k, side)) for k in pairs
                       for side, ids in enumerate((items[k].token_ids, items[k].corrupted_ids))]
                for k in pairs:
                    positive, negative = self._recording[(k, 0)], self._recording[(k, 1)]
                    for layer in self.layers:
                        pooled[layer].append(positive[layer] - negative[layer])
        finally:
            self._recording = None
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
                for span in ctx.spans:  # one per prompt, tagged (pair, side) by prepare_study
                    rows = values[span.rows]
                    pooled = rows[-1] if self.pool == "last" else rows.mean(axis=0)
                    self._recording.setdefault(span.tag, {})[layer] = pooled.astype(np.float64)
            return
        direction = self.directions.get(layer)
        if direction is None or ctx.execution.phase not in self.phases:
            return
        if layer not in (self.layers or ()):
            return
        hidden.values_mut()[...] += np.float32(self.scale) * direction  # every row of every sequence
        self._steered += len(ctx.spans)  # one per sequence, batched or not

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
