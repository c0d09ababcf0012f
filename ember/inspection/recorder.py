"""`BoundaryRecorder`: a hooks adapter that keeps copies of what the engine shows at its boundaries.

It is what dumps and extraction pass to `Model.generate(observer=...)` / `Model.evaluate(observer=...)`:
the same calls, at the same places, with the same arrays an experiment's `TensorAccess.values()` sees.
It never writes into the engine's buffers. Its per-stage methods are made from `ember.stages.STAGES`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ember.errors import ConfigError
from ember.experiments.context import BatchLayout, ExecutionPhase
from ember.stages import BY_NAME, NAMES, Scope, Stage, define_stage_methods

STAGES = NAMES  # every stage's name, in call order
POOLS = ("last", "mean")


@dataclass(frozen=True, slots=True)
class Record:
    """One boundary of one evaluation: `array` is a copy (or its pooled row) of what the engine held."""

    evaluation: int  # 0 = the prefill, then one per decode step
    phase: ExecutionPhase
    start_position: int
    token_count: int
    stage: str
    layer: int | None  # None for a model stage (before_logits, after_logits)
    array: np.ndarray
    batch: BatchLayout | None = None  # a batched evaluation's sequences (`Model.evaluate_batch`)

    def sequence_rows(self, index: int) -> np.ndarray | None:
        """The rows of the batch's sequence `index` (the caller's order) in a full copy (no `reduce`):
        at a layer stage one per evaluated position, at a model stage its one row; None where the
        sequence is not evaluated (a layer before its first); a pattern's rows of every head, its columns
        those of the sequence's own positions. Without a batch: the whole array."""
        if self.batch is None:
            return self.array
        spans = self.batch.spans(self.layer)
        span = next((s for s in spans if s.index == index), None)
        if span is None:
            return None
        if BY_NAME[self.stage].rows == "heads × tokens":  # a pattern: [heads × rows, positions]
            rows = max(s.rows.stop for s in spans)
            columns = span.start_position + span.rows.stop - span.rows.start  # its own positions
            heads = self.array.reshape(self.array.shape[0] // rows, rows, self.array.shape[1])
            return np.ascontiguousarray(heads[:, span.rows, :columns]).reshape(-1, columns)
        return self.array[span.rows]


def pool_rows(array: np.ndarray, pool: str) -> np.ndarray:
    """[T, H] -> [H]: the last row, or the float32 mean over rows (summed in float64)."""
    if pool == "last":
        return np.array(array[-1], dtype=np.float32)
    if pool == "mean":
        return array.mean(axis=0, dtype=np.float64).astype(np.float32)
    raise ConfigError(f"pool must be one of {', '.join(POOLS)}, got {pool!r}")


def check_stages(stages: Iterable[str]) -> tuple[str, ...]:
    chosen = tuple(stages)
    unknown = [s for s in chosen if s not in STAGES]
    if unknown:
        raise ConfigError(f"unknown stage {unknown[0]!r}; stages: {', '.join(STAGES)}")
    return chosen


class BoundaryRecorder:
    """Records the chosen stages of the chosen layers (None: all), in call order.

    `reduce` turns each array into what is kept (default: a full copy); `phases` limits the phases.
    """

    def __init__(self, *, stages: Iterable[str] = STAGES, layers: Iterable[int] | None = None,
                 phases: Iterable[ExecutionPhase] = (ExecutionPhase.PREFILL, ExecutionPhase.DECODE),
                 reduce: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        self.stages = frozenset(check_stages(stages))
        self.layers = None if layers is None else frozenset(int(i) for i in layers)
        self.phases = frozenset(phases)
        self.reduce = reduce
        self.records: list[Record] = []
        self.evaluations = -1
        self._phase = ExecutionPhase.PREFILL
        self._start = 0
        self._count = 0
        self._batch: BatchLayout | None = None
        self._active = True

    @property
    def listening(self) -> frozenset[str]:
        """The stages it records in this evaluation's phase (the engine forms on-demand stages only there)."""
        return self.stages if self._active else frozenset()

    def begin_evaluation(self, phase: ExecutionPhase, start_position: int, token_count: int) -> None:
        self.evaluations += 1
        self._phase = ExecutionPhase(phase)
        self._start, self._count = int(start_position), int(token_count)
        self._batch = None
        self._active = self._phase in self.phases

    def begin_batch(self, rows: Any) -> None:
        """A batch of sequences evaluated together (`ember.rows.BatchRows`): one prefill evaluation whose
        records carry the layout (`Record.sequence_rows` splits them per sequence)."""
        self.begin_evaluation(ExecutionPhase.PREFILL, 0, rows.count)
        self._batch = batch_layout(rows)

    def _keep(self, stage: str, layer: int | None, array: np.ndarray) -> None:
        if not self._active or stage not in self.stages:
            return
        if layer is not None and self.layers is not None and layer not in self.layers:
            return
        kept = self.reduce(array) if self.reduce is not None else array.copy()
        self.records.append(
            Record(self.evaluations, self._phase, self._start, self._count, stage, layer, kept, self._batch))


def batch_layout(rows: Any) -> BatchLayout:
    """The plain-number layout of a `BatchRows` (as the experiments' context shows it)."""
    return BatchLayout(tuple(int(e) for e in rows.order), tuple(int(o) for o in rows.offsets),
                       tuple(int(s) for s in rows.starts), tuple(int(f) for f in rows.first_layers),
                       tuple(entry.tag for entry in rows.stacked))


def _keeps(stage: Stage) -> Callable[..., None]:
    name = stage.name
    if stage.scope is Scope.LAYER:
        def layer_stage(self: BoundaryRecorder, layer_index: int, array: np.ndarray) -> None:
            self._keep(name, layer_index, array)

        return layer_stage

    def model_stage(self: BoundaryRecorder, array: np.ndarray) -> None:
        self._keep(name, None, array)

    return model_stage


define_stage_methods(BoundaryRecorder, _keeps)
