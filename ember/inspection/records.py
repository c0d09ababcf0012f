"""MLflow records of the inspection commands (dump, extract, probe, benchmark, demo, chat).

One run per command, as an `ember.records.run` record: recording off gives a `NullRecord` (the same
methods, writing nothing), so callers never test for it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ember.console import say
from ember.records.run import NullRecord, Record, open_run
from ember.records.store import MlflowSettings
from ember.records.tracker import FAILED, FINISHED, KILLED


@contextmanager
def mlflow_run(settings: MlflowSettings | None, name: str, tags: Mapping[str, Any] | None = None,
               base_dir: str | Path | None = None, command: str | None = None) -> Iterator[Record]:
    """A run that ends FINISHED, FAILED on an exception or when the command sets `record.failed`,
    KILLED on Ctrl-C; a `NullRecord` when recording is off."""
    if settings is None or not settings.enabled:
        yield NullRecord()
        return
    from ember.provenance import environment_tags

    source = {"mlflow.source.name": command or f"ember {name.split()[0]}", "mlflow.source.type": "LOCAL"}
    record = open_run(settings, name, {**environment_tags(), **source, **(tags or {})}, base_dir=base_dir)
    status = FAILED
    try:
        yield record
        status = FAILED if record.failed else FINISHED
    except KeyboardInterrupt:
        status = KILLED
        raise
    finally:
        record.close(status)
        waiting = record.waiting()
        say(f"ember: recorded as MLflow run {record.last_run_id} ({status}) in {record.store_uri}"
            + (f"; records waiting for the server in {waiting}" if waiting else ""))
