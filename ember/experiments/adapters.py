"""The hooks adapters the engine's forward passes call: disabled (does nothing) and active.

The engine calls, by name, `begin_evaluation(phase, start_position, token_count)` (one sequence) or
`begin_batch(rows)` (a batch, `ember.rows.BatchRows`: contract v0.3), then each stage of
`ember.stages.STAGES` where it happens: a layer stage as `<name>(layer_index, array)` (per layer:
`before_layer`, `after_attention`, `after_mlp`, `after_layer`), a model stage as `<name>(array)`
(`before_logits`, `after_logits`). Arrays are engine-owned C-contiguous float32 2-D. The per-stage
methods are made from the table when each class is created (`define_stage_methods`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from ember.experiments.base import ALL_HOOKS, Experiment
from ember.experiments.context import (
    BatchLayout,
    ExecutionContext,
    ExecutionPhase,
    LayerContext,
    ModelContext,
    TensorAccess,
    TracingState,
)
from ember.experiments.failure import ExperimentFailure, describe_exception
from ember.stages import STAGES, Scope, Stage, define_stage_methods


def _does_nothing(stage: Stage) -> Callable[..., None]:
    if stage.scope is Scope.LAYER:
        def layer_stage(self: Any, layer_index: int, array: np.ndarray) -> None:
            pass

        return layer_stage

    def model_stage(self: Any, array: np.ndarray) -> None:
        pass

    return model_stage


class HooksAdapter(Protocol):
    """What a family forward pass may call: `begin_evaluation`, then one method per stage. An adapter may
    say at which stages it listens (`listening`, a set of stage names; `ember.stages.listened`): the engine
    forms the on-demand stages' arrays only there."""

    def begin_evaluation(self, phase: ExecutionPhase, start_position: int, token_count: int) -> None: ...

    def begin_batch(self, rows: Any) -> None: ...


define_stage_methods(HooksAdapter, _does_nothing)


class DisabledHooks:
    """The adapter used without experiments: every method does nothing and builds nothing."""

    __slots__ = ()
    listening: frozenset[str] = frozenset()

    def begin_evaluation(self, phase: ExecutionPhase, start_position: int, token_count: int) -> None:
        pass

    def begin_batch(self, rows: Any) -> None:
        pass


define_stage_methods(DisabledHooks, _does_nothing)
DISABLED_HOOKS = DisabledHooks()

_Call = tuple[str, Callable[..., Any]]


def _implemented(experiment: Any, hook: str) -> Callable[..., Any] | None:
    """The experiment's bound hook method, or None when it is missing or the base class's no-op."""
    method = getattr(experiment, hook, None)
    if method is None or getattr(method, "__func__", None) is getattr(Experiment, hook):
        return None
    return method


class ActiveHooks:
    """The adapter used with experiments: builds contexts and `TensorAccess` views, calls each
    experiment in list order, and turns any exception into `ExperimentFailure`.

    After a failure nothing runs any more: every later call raises the same failure again.
    """

    def __init__(self, experiments: Sequence[Any], model: ModelContext, tracing: TracingState) -> None:
        self.model = model
        self.tracing = tracing
        self.failure: ExperimentFailure | None = None
        self.evaluation_count = {ExecutionPhase.PREFILL: 0, ExecutionPhase.DECODE: 0}
        self._execution: ExecutionContext | None = None
        self._layer: LayerContext | None = None
        calls: dict[str, list[_Call]] = {hook: [] for hook in ALL_HOOKS}
        self._experiments = [(experiment.name, experiment) for experiment in experiments]
        for experiment in experiments:
            for hook in ALL_HOOKS:
                method = _implemented(experiment, hook)
                if method is not None:
                    calls[hook].append((experiment.name, method))
        self._calls = calls
        self._stage_calls = tuple(calls[stage.name] for stage in STAGES)  # indexed like STAGES
        self.listening = frozenset(stage.name for stage in STAGES if calls[stage.name])

    # -- lifecycle (called by the runner) ------------------------------------------------------

    def run_lifecycle(self, hook: str, ctx: Any, phase: ExecutionPhase | None = None) -> None:
        self._stop_if_failed()
        for name, method in self._calls[hook]:
            try:
                method(ctx)
            except Exception as error:
                raise self._fail(name, hook, error, phase, None) from error

    # -- engine side ---------------------------------------------------------------------------

    def begin_evaluation(self, phase: ExecutionPhase, start_position: int, token_count: int) -> None:
        self._stop_if_failed()
        phase = ExecutionPhase(phase)
        self.evaluation_count[phase] += 1
        self._execution = ExecutionContext(
            self.model, phase, int(start_position), int(token_count), self.tracing
        )
        self._layer = None

    def begin_batch(self, rows: Any) -> None:
        """A batch of sequences (`ember.rows.BatchRows`) evaluated together: only experiments that opted
        in (`batched = True`, contract v0.3) see one; the context's `batch` says which rows are which."""
        self._stop_if_failed()
        single = [name for name, experiment in self._experiments if not getattr(experiment, "batched", False)]
        if single:
            raise RuntimeError(f"experiment {single[0]!r} sees one sequence at a time; it was handed a batch "
                               f"(ember bug: the caller must evaluate its sequences one by one)")
        self.evaluation_count[ExecutionPhase.PREFILL] += 1
        layout = BatchLayout(tuple(int(e) for e in rows.order), tuple(int(o) for o in rows.offsets),
                             tuple(int(s) for s in rows.starts), tuple(int(f) for f in rows.first_layers),
                             tuple(entry.tag for entry in rows.stacked))
        self._execution = ExecutionContext(self.model, ExecutionPhase.PREFILL, 0, int(rows.count),
                                           self.tracing, layout)
        self._layer = None

    # one method per stage: `define_stage_methods(ActiveHooks, _calls_experiments)` below

    # -- internals -----------------------------------------------------------------------------

    def _layer_hook(self, hook: str, calls: list[_Call], layer_index: int, array: np.ndarray) -> None:
        if not calls:
            self._stop_if_failed()
            return
        ctx = self._layer
        if ctx is None or ctx.layer_index != layer_index:
            ctx = self._layer = LayerContext(self._current_execution(), layer_index)
        self._tensor_hook(hook, calls, ctx, array, layer_index)

    def _tensor_hook(
        self, hook: str, calls: list[_Call], ctx: Any, array: np.ndarray, layer_index: int | None
    ) -> None:
        self._stop_if_failed()
        for name, method in calls:
            access = TensorAccess(array)
            try:
                method(ctx, access)
            except Exception as error:
                raise self._fail(name, hook, error, self._execution.phase, layer_index) from error
            finally:
                access.release()

    def _current_execution(self) -> ExecutionContext:
        if self._execution is None:
            raise RuntimeError("a tensor hook was called before begin_evaluation (engine bug)")
        return self._execution

    def _stop_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure

    def _fail(
        self, name: str, hook: str, error: Exception, phase: ExecutionPhase | None, layer: int | None
    ) -> ExperimentFailure:
        self.failure = ExperimentFailure(name, hook, describe_exception(error), phase=phase, layer=layer)
        return self.failure


def _calls_experiments(stage: Stage) -> Callable[..., None]:
    name, index = stage.name, STAGES.index(stage)
    if stage.scope is Scope.LAYER:
        def layer_stage(self: ActiveHooks, layer_index: int, array: np.ndarray) -> None:
            self._layer_hook(name, self._stage_calls[index], layer_index, array)

        return layer_stage

    def model_stage(self: ActiveHooks, array: np.ndarray) -> None:
        self._tensor_hook(name, self._stage_calls[index], self._current_execution(), array, None)

    return model_stage


define_stage_methods(ActiveHooks, _calls_experiments)
