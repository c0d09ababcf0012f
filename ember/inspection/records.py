"""MLflow records of the inspection commands (dump, extract, probe, benchmark, demo, chat).

A thin layer over `ember.tracking.Tracker` with one run per command; tracking off gives a log that does
nothing, so callers never test for it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ember.runconfig import MlflowSettings


class RunLog:
    """One MLflow run (or nothing when `tracker` is None)."""

    def __init__(self, tracker: Any = None, run_id: str | None = None) -> None:
        self.tracker = tracker
        self.run_id = run_id
        self.failed = False  # set when the command failed without raising (e.g. an experiment failed)

    @property
    def enabled(self) -> bool:
        return self.tracker is not None

    def params(self, params: Mapping[str, Any]) -> None:
        if self.tracker:
            self.tracker.log_params(self.run_id, params)

    def tags(self, tags: Mapping[str, Any]) -> None:
        if self.tracker:
            self.tracker.set_tags(self.run_id, tags)

    def metrics(self, metrics: Iterable[tuple[str, float, int]]) -> None:
        if self.tracker:
            self.tracker.log_metrics(self.run_id, list(metrics))

    def json(self, value: Any, artifact_file: str) -> None:
        if self.tracker:
            self.tracker.log_json(self.run_id, value, artifact_file)

    def text(self, text: str, artifact_file: str) -> None:
        if self.tracker:
            self.tracker.log_text(self.run_id, text, artifact_file)

    def figure(self, figure: Any, artifact_file: str) -> None:
        if self.tracker:
            self.tracker.log_figure(self.run_id, figure, artifact_file)

    def files(self, paths: Iterable[str | Path], artifact_dir: str | None = None) -> None:
        if self.tracker:
            for path in paths:
                self.tracker.log_file(self.run_id, path, artifact_dir)


@contextmanager
def mlflow_run(settings: MlflowSettings | None, name: str, tags: Mapping[str, Any] | None = None,
               base_dir: str | Path | None = None, command: str | None = None) -> Iterator[RunLog]:
    """A run that ends FINISHED, FAILED on an exception, KILLED on Ctrl-C; a no-op log when disabled."""
    if settings is None or not settings.enabled:
        yield RunLog()
        return
    from ember import tracking
    from ember.provenance import environment_tags

    tracker = tracking.Tracker(tracking.resolve_store(settings, base_dir), settings.experiment_name)
    source = {"mlflow.source.name": command or f"ember {name.split()[0]}", "mlflow.source.type": "LOCAL"}
    run_id = tracker.start_run(name, {**environment_tags(), **source, **(tags or {})})
    status = tracking.FAILED
    log = RunLog(tracker, run_id)
    try:
        yield log
        status = tracking.FAILED if log.failed else tracking.FINISHED
    except KeyboardInterrupt:
        status = tracking.KILLED
        raise
    finally:
        tracker.end_run(run_id, status)
        waiting = tracker.outbox_of(run_id)
        print(f"ember: recorded as MLflow run {run_id} ({status}) in {tracker.store.tracking_uri}"
              + (f"; records waiting for the server in {waiting}" if waiting else ""), file=sys.stderr,
              flush=True)
