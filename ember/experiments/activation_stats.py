"""`activation_stats`: the reference observation experiment. It never writes.

For every tensor hook (each stage of `ember.stages.STAGES`), layer and phase it accumulates, over all
evaluations of that phase: the number of finite values, their mean, standard deviation, RMS, minimum,
maximum and largest magnitude, and the count of non-finite values (NaN, +inf, -inf). Statistics of the
finite values exclude the non-finite ones. Each hook does four whole-array reductions (sum, dot, min,
max); the exact finite mask is computed only when those show something non-finite. In decode the rows
are copied aside and reduced together once per evaluation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from ember.experiments.base import LAYER_HOOKS, TENSOR_HOOKS, Experiment
from ember.experiments.context import (
    ExecutionContext,
    ExecutionPhase,
    LayerContext,
    ModelContext,
    TensorAccess,
)
from ember.experiments.parameters import parse_phases
from ember.experiments.results import ExperimentResult, Metric
from ember.stages import LAYER_STAGES, MODEL_STAGES, STAGES, Scope, Stage, define_stage_methods

if TYPE_CHECKING:
    from matplotlib.figure import Figure

STATISTICS = ("mean", "std", "rms", "min", "max", "max_abs", "nonfinite")

# Accumulator slots: evaluations, finite count, sum, sum of squares, min, max, non-finite count.
_EVALUATIONS, _COUNT, _SUM, _SUMSQ, _MIN, _MAX, _NONFINITE = range(7)


def _reduce(values: np.ndarray) -> tuple[int, float, float, float, float, int]:
    """(finite count, sum, sum of squares, min, max, non-finite count) of a float32 array."""
    total = float(values.sum())
    squares = float(np.vdot(values, values))
    if math.isfinite(total) and math.isfinite(squares):
        return values.size, total, squares, float(values.min()), float(values.max()), 0
    # Something is non-finite (or the float32 sums overflowed): do it exactly, in float64.
    finite = values[np.isfinite(values)].astype(np.float64)
    nonfinite = values.size - finite.size
    if finite.size == 0:
        return 0, 0.0, 0.0, math.inf, -math.inf, nonfinite
    return (
        finite.size,
        float(finite.sum()),
        float(finite @ finite),
        float(finite.min()),
        float(finite.max()),
        nonfinite,
    )


def _merge(stats: list[float], count: int, total: float, squares: float, low: float, high: float,
           nonfinite: int, evaluations: int = 1) -> None:
    stats[_EVALUATIONS] += evaluations
    stats[_COUNT] += count
    stats[_SUM] += total
    stats[_SUMSQ] += squares
    if low < stats[_MIN]:
        stats[_MIN] = low
    if high > stats[_MAX]:
        stats[_MAX] = high
    stats[_NONFINITE] += nonfinite


# A decode batch slot per (layer stage, layer), then one per model stage; indexed by the stage's
# position in STAGES (= TENSOR_HOOKS).
_SLOT_BASE = tuple(LAYER_STAGES.index(s) if s.scope is Scope.LAYER else MODEL_STAGES.index(s) for s in STAGES)


class _RowBatch:
    """The single-row activations of decode evaluations, copied aside (one row per hook and layer)
    and reduced together, four NumPy calls for all of them, when the evaluation ends."""

    def __init__(self, layer_count: int, width: int) -> None:
        self.layer_count = layer_count
        self.width = width
        self.row_shape = (1, width)
        slots = len(LAYER_HOOKS) * layer_count + len(MODEL_STAGES)
        self.stash = np.empty((slots, width), np.float32)
        self.pending: list[int] = []
        self.is_pending = bytearray(slots)
        self.totals = np.zeros((7, slots))
        self.totals[_MIN] = math.inf
        self.totals[_MAX] = -math.inf

    def slot(self, hook_index: int, layer: int | None) -> int | None:
        if layer is None:
            return len(LAYER_HOOKS) * self.layer_count + _SLOT_BASE[hook_index]
        if 0 <= layer < self.layer_count:
            return _SLOT_BASE[hook_index] * self.layer_count + layer
        return None

    def add(self, slot: int, values: np.ndarray) -> None:
        if self.is_pending[slot]:
            self.flush()
        self.stash[slot] = values  # [1, width] into a [width] row
        self.is_pending[slot] = 1
        self.pending.append(slot)

    def flush(self) -> None:
        if not self.pending:
            return
        index = np.array(self.pending)
        rows = self.stash[index]
        sums = rows.sum(axis=1).astype(np.float64)
        squares = np.einsum("ij,ij->i", rows, rows).astype(np.float64)
        lows = rows.min(axis=1).astype(np.float64)
        highs = rows.max(axis=1).astype(np.float64)
        counts = np.full(index.size, float(self.width))
        nonfinite = np.zeros(index.size)
        for k in np.flatnonzero(~(np.isfinite(sums) & np.isfinite(squares))):
            count, total, square, low, high, bad = _reduce(rows[k])
            counts[k], sums[k], squares[k], lows[k], highs[k], nonfinite[k] = (
                count, total, square, low, high, bad)
        totals = self.totals
        totals[_EVALUATIONS, index] += 1
        totals[_COUNT, index] += counts
        totals[_SUM, index] += sums
        totals[_SUMSQ, index] += squares
        totals[_MIN, index] = np.minimum(totals[_MIN, index], lows)
        totals[_MAX, index] = np.maximum(totals[_MAX, index], highs)
        totals[_NONFINITE, index] += nonfinite
        for slot in self.pending:
            self.is_pending[slot] = 0
        self.pending.clear()

    def entries(self) -> list[tuple[str, int | None, list[float]]]:
        """(hook, layer, accumulated stats) of every slot that has seen something."""
        self.flush()
        found = []
        layer_slots = len(LAYER_HOOKS) * self.layer_count
        for slot in np.flatnonzero(self.totals[_EVALUATIONS]):
            totals = self.totals[:, slot].tolist()
            if slot < layer_slots:
                stage, layer = divmod(int(slot), self.layer_count)
                found.append((LAYER_HOOKS[stage], layer, totals))
            else:
                found.append((MODEL_STAGES[slot - layer_slots].name, None, totals))
        return found


class ActivationStats(Experiment):
    """Observe every activation boundary and summarise it per hook, layer and phase.

    Parameters: `phases` ("prefill", "decode" or "both", the default) and `name`.

    Cost: a decode evaluation's single-row activations are copied aside and reduced together at the
    end of the evaluation (after_logits), so each hook only copies one row; prefill activations and
    the logits are reduced where they are seen.
    """

    def __init__(self, phases: str | Iterable[str] = "both", name: str = "activation_stats") -> None:
        self.name = name
        self.phases = parse_phases(phases)
        self.layer_count: int | None = None
        self._stats: dict[tuple[ExecutionPhase, str, int | None], list[float]] = {}
        self._batch: _RowBatch | None = None

    def on_model_loaded(self, ctx: ModelContext) -> None:
        self.layer_count = ctx.layer_count

    def _observe(self, execution: ExecutionContext, hook_index: int, layer: int | None,
                 tensor: TensorAccess) -> None:
        phase = execution.phase
        if phase not in self.phases:
            return
        values = tensor.values()
        if phase is ExecutionPhase.DECODE:
            batch = self._batch
            if batch is None:
                model = execution.model
                batch = self._batch = _RowBatch(model.layer_count, model.hidden_size)
            if values.shape == batch.row_shape:
                slot = batch.slot(hook_index, layer)
                if slot is not None:
                    batch.add(slot, values)
                    return
        key = (phase, TENSOR_HOOKS[hook_index], layer)
        stats = self._stats.get(key)
        if stats is None:
            stats = self._stats[key] = [0, 0, 0.0, 0.0, math.inf, -math.inf, 0]
        _merge(stats, *_reduce(values))

    # one hook per stage, observing it: `define_stage_methods(ActivationStats, _observes)` below

    def _all_stats(self) -> dict[tuple[ExecutionPhase, str, int | None], list[float]]:
        merged = {key: list(stats) for key, stats in self._stats.items()}
        if self._batch is not None:
            for hook, layer, totals in self._batch.entries():
                key = (ExecutionPhase.DECODE, hook, layer)
                if key in merged:
                    evaluations, count, total, squares, low, high, nonfinite = totals
                    _merge(merged[key], int(count), total, squares, low, high, int(nonfinite),
                           int(evaluations))
                else:
                    merged[key] = totals
        return merged

    # -- results -------------------------------------------------------------------------------

    def rows(self) -> list[dict[str, Any]]:
        """One row per (phase, hook, layer) seen, in phase, hook, layer order."""
        phase_order = {ExecutionPhase.PREFILL: 0, ExecutionPhase.DECODE: 1}
        hook_order = {hook: i for i, hook in enumerate(TENSOR_HOOKS)}

        def order(key: tuple[ExecutionPhase, str, int | None]) -> tuple[int, int, int]:
            phase, hook, layer = key
            return phase_order[phase], hook_order[hook], -1 if layer is None else layer

        stats = self._all_stats()
        return [_row(key, stats[key]) for key in sorted(stats, key=order)]

    def results(self) -> ExperimentResult:
        rows = self.rows()
        metrics = [
            Metric(f"{row['phase']}/{row['hook']}/{statistic}", float(row[statistic]), row["layer"] or 0)
            for row in rows
            for statistic in STATISTICS
        ]
        arrays = self._layer_arrays(rows)
        builders = {"rms_by_layer": lambda: _rms_figure(arrays)} if arrays else {}
        return ExperimentResult(
            metrics=metrics, tables={"activation_stats": rows}, arrays=arrays, figure_builders=builders
        )

    def _layer_arrays(self, rows: list[dict[str, Any]]) -> dict[str, np.ndarray]:
        """`"{phase}/{statistic}"` -> float64 `[layer stages, layer_count]` (rows: before_layer,
        after_attention, after_mlp, after_layer); NaN where nothing was recorded."""
        layer_rows = [row for row in rows if row["layer"] is not None]
        if not layer_rows:
            return {}
        layer_count = self.layer_count or (1 + max(row["layer"] for row in layer_rows))
        arrays: dict[str, np.ndarray] = {}
        for row in layer_rows:
            for statistic in STATISTICS:
                key = f"{row['phase']}/{statistic}"
                if key not in arrays:
                    arrays[key] = np.full((len(LAYER_HOOKS), layer_count), np.nan)
                arrays[key][LAYER_HOOKS.index(row["hook"]), row["layer"]] = row[statistic]
        return arrays


def _observes(stage: Stage) -> Callable[..., None]:
    index, ends_evaluation = STAGES.index(stage), stage is STAGES[-1]
    if stage.scope is Scope.LAYER:
        def layer_stage(self: ActivationStats, ctx: LayerContext, tensor: TensorAccess) -> None:
            self._observe(ctx.execution, index, ctx.layer_index, tensor)

        return layer_stage

    def model_stage(self: ActivationStats, ctx: ExecutionContext, tensor: TensorAccess) -> None:
        self._observe(ctx, index, None, tensor)
        if ends_evaluation and self._batch is not None:
            self._batch.flush()

    return model_stage


define_stage_methods(ActivationStats, _observes)


def _row(key: tuple[ExecutionPhase, str, int | None], stats: list[float]) -> dict[str, Any]:
    phase, hook, layer = key
    count = int(stats[_COUNT])
    if count:
        mean = stats[_SUM] / count
        mean_square = stats[_SUMSQ] / count
        std = math.sqrt(max(mean_square - mean * mean, 0.0))
        rms = math.sqrt(mean_square)
        low, high = stats[_MIN], stats[_MAX]
        max_abs = max(-low, high)
    else:
        mean = std = rms = low = high = max_abs = math.nan
    return {
        "phase": phase.value,
        "hook": hook,
        "layer": layer,
        "evaluations": int(stats[_EVALUATIONS]),
        "count": count,
        "mean": mean,
        "std": std,
        "rms": rms,
        "min": low,
        "max": high,
        "max_abs": max_abs,
        "nonfinite": int(stats[_NONFINITE]),
    }


def _rms_figure(arrays: dict[str, np.ndarray]) -> Figure:
    from matplotlib.figure import Figure

    phases = [phase.value for phase in ExecutionPhase if f"{phase.value}/rms" in arrays]
    figure = Figure(figsize=(6 * len(phases), 4), layout="constrained")
    axes = figure.subplots(1, len(phases), squeeze=False)[0]
    for ax, phase in zip(axes, phases, strict=True):
        rms = arrays[f"{phase}/rms"]
        for hook, series in zip(LAYER_HOOKS, rms, strict=True):
            ax.plot(np.arange(series.size), series, marker=".", label=hook)
        ax.set_title(f"activation RMS by layer ({phase})")
        ax.set_xlabel("layer")
        ax.set_ylabel("RMS")
        ax.set_yscale("log")
        ax.legend()
    return figure
