"""The record of one run: `RunRecord` while recording is on, `NullRecord` (the same methods, writing
nothing) when it is off, so callers never test which one they hold.

Every write of a `RunRecord` goes through its `Tracker`'s one write path: to the store, or to the run's
outbox while the store is away. Both records remember every metric logged, by name (its step-0 value,
else its last), for what the caller computes from them (a search's objective).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ember.records.store import MlflowSettings, resolve_store
from ember.records.tracker import Tracker, log_experiment_result

Metrics = Iterable[tuple[str, float, int]]


class MetricsSeen:
    """Every metric logged, by name: its step-0 value, else its last."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}
        self._steps: dict[str, int] = {}

    def add(self, metrics: Iterable[tuple[str, float, int]]) -> None:
        for name, value, step in metrics:
            known = self._steps.get(name)
            if known is None or (known != 0 and (step == 0 or step >= known)):
                self.values[name] = float(value)
                self._steps[name] = int(step)

    def add_result(self, name: str, result: Any) -> None:
        self.add((f"{name}.{m.name}", m.value, m.step) for m in result.metrics
                 if isinstance(m.value, int | float))


class RunRecord:
    """One open MLflow run. After `close` it writes nothing more (`run_id` is None; `last_run_id` stays)."""

    def __init__(self, tracker: Tracker, run_id: str) -> None:
        self.tracker = tracker
        self.run_id: str | None = run_id
        self.last_run_id = run_id  # kept after close, for the console line naming the run
        self.store_uri = tracker.store.tracking_uri
        self.kept = ""  # what an interrupted job kept, for its console line
        self.failed = False  # set by a command that failed without raising (its run then ends FAILED)
        self._seen = MetricsSeen()

    @property
    def metrics(self) -> dict[str, float]:
        return self._seen.values

    @property
    def recording(self) -> bool:
        return self.run_id is not None

    def log_params(self, params: Mapping[str, Any]) -> None:
        if self.run_id is not None:
            self.tracker.log_params(self.run_id, params)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if self.run_id is not None:
            self.tracker.set_tags(self.run_id, tags)

    def log_metrics(self, metrics: Metrics) -> None:
        metrics = list(metrics)
        self._seen.add(metrics)
        if self.run_id is not None:
            self.tracker.log_metrics(self.run_id, metrics)

    def log_batch(self, metrics: Metrics, tags: Mapping[str, Any]) -> None:
        """Metrics and tags together, in as few store calls as possible."""
        metrics = list(metrics)
        self._seen.add(metrics)
        if self.run_id is not None:
            self.tracker.log_batch(self.run_id, metrics, tags)

    def log_text(self, text: str, artifact_file: str) -> None:
        if self.run_id is not None:
            self.tracker.log_text(self.run_id, text, artifact_file)

    def log_json(self, value: Any, artifact_file: str) -> None:
        if self.run_id is not None:
            self.tracker.log_json(self.run_id, value, artifact_file)

    def log_array(self, array: np.ndarray, artifact_file: str) -> None:
        if self.run_id is not None:
            self.tracker.log_array(self.run_id, array, artifact_file)

    def log_figure(self, figure: Any, artifact_file: str) -> None:
        if self.run_id is not None:
            self.tracker.log_figure(self.run_id, figure, artifact_file)

    def log_file(self, path: str | os.PathLike[str], artifact_dir: str | None = None) -> None:
        if self.run_id is not None:
            self.tracker.log_file(self.run_id, path, artifact_dir)

    def log_table(self, columns: Mapping[str, Sequence[Any]], artifact_file: str, *,
                  tag: bool = True) -> None:
        """A table artifact; `tag=False`: the tag that shows it as a table goes with the next `log_batch`."""
        if self.run_id is not None:
            self.tracker.log_table(self.run_id, columns, artifact_file, tag=tag)

    def log_dataset(self, name: str, digest: str, source_type: str, source: Mapping[str, Any],
                    schema: Mapping[str, Any] | None = None, rows: int | None = None,
                    context: str = "eval") -> None:
        if self.run_id is not None:
            self.tracker.log_dataset(self.run_id, name, digest, source_type, source, schema, rows, context)

    def result(self, name: str, result: Any) -> None:
        """An experiment's results: metrics prefixed with its name, tables, arrays, figures."""
        self._seen.add_result(name, result)
        if self.run_id is not None:
            log_experiment_result(self.tracker, self.run_id, name, result)

    def waiting(self) -> Path | None:
        """Where this run's records wait for the store, if they do."""
        return self.tracker.outbox_of(self.last_run_id)

    def close(self, status: str) -> None:
        if self.run_id is not None:
            self.tracker.end_run(self.run_id, status)
            self.run_id = None


class NullRecord:
    """Recording is off: `RunRecord`'s methods, writing nothing; metrics are still remembered."""

    run_id: str | None = None
    last_run_id: str | None = None
    store_uri = ""
    recording = False

    def __init__(self) -> None:
        self.kept = ""
        self.failed = False
        self._seen = MetricsSeen()

    @property
    def metrics(self) -> dict[str, float]:
        return self._seen.values

    def log_params(self, params: Mapping[str, Any]) -> None:
        pass

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: Metrics) -> None:
        self._seen.add(metrics)

    def log_batch(self, metrics: Metrics, tags: Mapping[str, Any]) -> None:
        self._seen.add(metrics)

    def log_text(self, text: str, artifact_file: str) -> None:
        pass

    def log_json(self, value: Any, artifact_file: str) -> None:
        pass

    def log_array(self, array: np.ndarray, artifact_file: str) -> None:
        pass

    def log_figure(self, figure: Any, artifact_file: str) -> None:
        pass

    def log_file(self, path: str | os.PathLike[str], artifact_dir: str | None = None) -> None:
        pass

    def log_table(self, columns: Mapping[str, Sequence[Any]], artifact_file: str, *,
                  tag: bool = True) -> None:
        pass

    def log_dataset(self, name: str, digest: str, source_type: str, source: Mapping[str, Any],
                    schema: Mapping[str, Any] | None = None, rows: int | None = None,
                    context: str = "eval") -> None:
        pass

    def result(self, name: str, result: Any) -> None:
        self._seen.add_result(name, result)

    def waiting(self) -> Path | None:
        return None

    def close(self, status: str) -> None:
        pass


Record = RunRecord | NullRecord


def open_run(settings: MlflowSettings | None, name: str, tags: Mapping[str, Any], *,
             parent_run_id: str | None = None, handed_over: str | None = None,
             base_dir: str | os.PathLike[str] | None = None) -> Record:
    """A new RUNNING run in the store `settings` name (or `handed_over`, a sweep's), or a `NullRecord`
    when recording is off."""
    if settings is None or not settings.enabled:
        return NullRecord()
    tracker = Tracker(resolve_store(settings, base_dir, handed_over=handed_over), settings.experiment_name)
    return RunRecord(tracker, tracker.start_run(name, tags, parent_run_id))
