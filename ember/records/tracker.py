"""One MLflow experiment in one store, written through one path: params, tags, metrics, artifacts, tables,
dataset inputs; live to the store, or to the run's outbox while an HTTP store is away.

Runs are driven through `MlflowClient` with explicit run ids (never MLflow's "active run" globals), so
several jobs in one process, parent and child runs, and closing a run on Ctrl-C all stay explicit.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ember.console import say
from ember.records import heartbeat, outbox
from ember.records.store import Store, mlflow_client
from ember.records.values import (
    MAX_PARAM_LENGTH,
    MAX_RUN_NAME_LENGTH,
    MAX_TAG_LENGTH,
    chunks,
    clip,
    figure_data,
    figure_suffix,
    json_cell,
    json_default,
    metric_key,
    table_csv,
)
from ember.svg_figure import SvgFigure

log = logging.getLogger(__name__)

# MLflow run statuses.
FINISHED, FAILED, KILLED = "FINISHED", "FAILED", "KILLED"

# MLflow 3's UI opens an experiment in its model-training view (runs, charts), not the GenAI view
# (traces, evaluations), when the experiment carries this tag with this value. The 3.17 UI no longer
# reads it: a switch in the page (remembered by the browser, or `?workflowType=machine_learning` in the
# address) chooses the view; README.md says so.
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}

# The UI's Source column: what made the run (the Hydra runner; the `ember` command sets its own name).
SOURCE_TAGS = {"mlflow.source.name": "ember.run", "mlflow.source.type": "LOCAL"}
# A JSON artifact up to this many characters (compact) is written indented (`Tracker.log_json`).
INDENTED_JSON_UP_TO = 100_000


class Tracker:
    """One MLflow experiment in one store, with explicit run ids.

    Every write of a run goes through `_write`: straight to the store, or, once an HTTP store has stopped
    answering during the run, into the run's outbox (`ember.records.outbox`), in order, to be uploaded later.
    A run started while the store is away gets a placeholder id and is created at upload.
    """

    def __init__(self, store: Store, experiment_name: str, *, outbox_root: Path | None = None) -> None:
        self.store = store
        self.client = mlflow_client(store.tracking_uri)
        self.outbox_root = outbox_root or outbox.default_root()
        self.outboxes: dict[str, outbox.Outbox] = {}
        self._tables: dict[str, list[dict[str, str]]] = {}  # run -> its table artifacts (loggedArtifacts)
        self._untagged: set[str] = set()  # runs whose loggedArtifacts tag waits for their next log_batch
        self.experiment_id = self._experiment(experiment_name)
        open_store(self.client, store.tracking_uri, self.outbox_root)

    @classmethod
    def attach(cls, store: Store, experiment_id: str, *, outbox_root: Path | None = None) -> Tracker:
        """A tracker for runs of a known experiment, without contacting the store (closing a sweep)."""
        tracker = cls.__new__(cls)
        tracker.store, tracker.experiment_id = store, experiment_id
        tracker.client = mlflow_client(store.tracking_uri)
        tracker.outbox_root = outbox_root or outbox.default_root()
        tracker.outboxes = {}
        tracker._tables = {}
        tracker._untagged = set()
        return tracker

    def _experiment(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        for _attempt in range(5):
            found = self.client.get_experiment_by_name(name)
            if found is not None:
                if found.lifecycle_stage == "deleted":
                    self.client.restore_experiment(found.experiment_id)
                self._tag_experiment(found)
                return found.experiment_id
            location = None
            if self.store.artifact_root is not None:
                location = f"{self.store.artifact_root}/{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}"
            try:
                return self.client.create_experiment(name, artifact_location=location, tags=EXPERIMENT_TAGS)
            except MlflowException:  # created meanwhile by a parallel job: look it up again
                time.sleep(0.2)
        raise RuntimeError(f"could not create or find the MLflow experiment {name!r}")

    def _tag_experiment(self, experiment: Any) -> None:
        """An experiment made before ember tagged its experiments, or by hand: tagged now, unless its
        owner chose another kind."""
        for key, value in EXPERIMENT_TAGS.items():
            if key not in experiment.tags:
                self.client.set_experiment_tag(experiment.experiment_id, key, value)

    # -------------------------------------------------------------------------------- runs

    def start_run(self, name: str, tags: Mapping[str, Any], parent_run_id: str | None = None) -> str:
        """A RUNNING run tagged with this process and a heartbeat kept fresh until `end_run`."""
        all_tags = {k: clip(v, MAX_TAG_LENGTH) for k, v in {**heartbeat.process_tags(), **tags}.items()}
        if parent_run_id:
            all_tags["mlflow.parentRunId"] = parent_run_id
        name = clip(name, MAX_RUN_NAME_LENGTH)  # SQL stores keep 250 characters (PostgreSQL enforces it)
        try:
            run = self.client.create_run(self.experiment_id, run_name=name, tags=all_tags)
        except Exception as error:
            if not outbox.unreachable(error, self.store.tracking_uri):
                raise
            run_id = outbox.new_placeholder()
            self._to_outbox(run_id, error)
            self.outboxes[run_id].append({"op": "create_run", "run_id": run_id, "run_name": name,
                                          "experiment_id": self.experiment_id, "tags": list(all_tags.items()),
                                          "start_time": int(time.time() * 1000)})
            return run_id
        heartbeat.start(self.client, run.info.run_id)
        return run.info.run_id

    def end_run(self, run_id: str, status: str) -> None:
        heartbeat.stop(run_id)
        if run_id in self._untagged:  # a table logged with tag=False and no log_batch after it
            self.log_batch(run_id, [], {})
        self._write(run_id, {"op": "terminate", "status": status, "end_time": int(time.time() * 1000)})
        kept = self.outboxes.pop(run_id, None)
        if kept is not None:  # the server may be back: try now, else the next command uploads it
            kept.release()
            try:
                outbox.upload(kept.folder, self.client)
            except Exception:
                pass

    def outbox_of(self, run_id: str) -> Path | None:
        """Where this run's records wait for the server, if they do."""
        kept = self.outboxes.get(run_id)
        if kept is not None:
            return kept.folder
        folder = self.outbox_root / run_id
        return folder if folder.exists() else None

    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        entries = [[metric_key(k), clip(v, MAX_PARAM_LENGTH)] for k, v in params.items()]
        for chunk in chunks(entries, 100):
            self._write(run_id, {"op": "log_batch", "params": list(chunk)})

    def set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        entries = [[k, clip(v, MAX_TAG_LENGTH)] for k, v in tags.items()]
        for chunk in chunks(entries, 100):
            self._write(run_id, {"op": "log_batch", "tags": list(chunk)})

    def log_metrics(self, run_id: str, metrics: Iterable[tuple[str, float, int]]) -> None:
        self.log_batch(run_id, metrics, {})

    def log_batch(self, run_id: str, metrics: Iterable[tuple[str, float, int]],
                  tags: Mapping[str, Any]) -> None:
        """Metrics and tags in as few store calls as MLflow allows (1000 metrics, 100 tags a call): each
        call is a transaction, 10-40 ms on a SQLite store (2-core machine, quiet to loaded). The tag naming
        tables logged with `tag=False` goes with them."""
        now = int(time.time() * 1000)  # kept in an outbox as is: an upload repeated stores them once
        entries = [[metric_key(k), float(v), now, int(step)] for k, v, step in metrics]
        if run_id in self._untagged:
            self._untagged.discard(run_id)
            tags = {**tags, **self._tables_tag(run_id)}
        tag_entries = [[k, clip(v, MAX_TAG_LENGTH)] for k, v in tags.items()]
        metric_chunks, tag_chunks = list(chunks(entries, 1000)), list(chunks(tag_entries, 100))
        for i in range(max(len(metric_chunks), len(tag_chunks))):
            op: dict[str, Any] = {"op": "log_batch"}
            if i < len(metric_chunks):
                op["metrics"] = list(metric_chunks[i])
            if i < len(tag_chunks):
                op["tags"] = list(tag_chunks[i])
            self._write(run_id, op)

    # -------------------------------------------------------------------------------- artifacts

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self._artifact(run_id, artifact_file, lambda path: path.write_text(text, encoding="utf-8"))

    def log_json(self, run_id: str, value: Any, artifact_file: str) -> None:
        """Indented for reading when short; a long value (an experiment's table of thousands of rows)
        stays compact: json indents in Python, 0.035 s for the logit lens's 7,500-row table against
        0.012 s compact (Xeon)."""
        text = json.dumps(value, default=json_default)
        if len(text) <= INDENTED_JSON_UP_TO:
            text = json.dumps(value, indent=2, default=json_default)
        self.log_text(run_id, text, artifact_file)

    def log_bytes(self, run_id: str, data: bytes, artifact_file: str) -> None:
        self._artifact(run_id, artifact_file, lambda path: path.write_bytes(data))

    def log_array(self, run_id: str, array: np.ndarray, artifact_file: str) -> None:
        self._artifact(run_id, artifact_file, lambda path: np.save(path, np.asarray(array)))

    def log_figure(self, run_id: str, figure: Any, artifact_file: str) -> None:
        """A matplotlib figure as the file `artifact_file` names (PNG rendered once, also for a results
        page); an SVG figure as SVG, its name's suffix made `.svg`."""
        if isinstance(figure, SvgFigure):
            artifact_file = str(Path(artifact_file).with_suffix(figure_suffix(figure)))
        if isinstance(figure, SvgFigure) or artifact_file.lower().endswith(".png"):  # PNG: rendered once
            self._artifact(run_id, artifact_file, lambda path: path.write_bytes(figure_data(figure)))
        else:
            self._artifact(run_id, artifact_file, lambda path: figure.savefig(path))

    def log_file(self, run_id: str, path: str | os.PathLike[str], artifact_dir: str | None = None) -> None:
        self._artifact(run_id, str(Path(artifact_dir or "") / Path(path).name),
                       lambda target: shutil.copyfile(path, target))

    def _artifact(self, run_id: str, artifact_file: str, write: Any) -> None:
        folder = str(Path(artifact_file).parent)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / Path(artifact_file).name
            write(path)
            self._write(run_id, {"op": "artifact", "dir": None if folder in ("", ".") else folder}, path)

    # -------------------------------------------------------------------------------- the one write path

    def _write(self, run_id: str, op: dict[str, Any], file: Path | None = None) -> None:
        op = {**op, "run_id": run_id}
        kept = self.outboxes.get(run_id)
        if kept is None:
            try:
                if file is not None:
                    self.client.log_artifact(run_id, str(file), op.get("dir"))
                else:
                    outbox.perform(self.client, op, None, {})
                return
            except Exception as error:
                if not outbox.unreachable(error, self.store.tracking_uri):
                    raise
                kept = self._to_outbox(run_id, error)
        kept.append(op, file)

    def _to_outbox(self, run_id: str, error: BaseException) -> outbox.Outbox:
        heartbeat.stop(run_id)
        kept = outbox.Outbox.create(self.outbox_root, self.store.tracking_uri, run_id, self.experiment_id)
        self.outboxes[run_id] = kept
        reason = str(getattr(error, "message", "") or error).splitlines()[0]
        say(f"ember: the tracking server at {self.store.tracking_uri} stopped answering ({reason[:200]}); "
            f"the records of run {run_id} are kept in {kept.folder} and uploaded by the next ember command "
            f"on this store (or: ember runs upload)")
        return kept

    def log_table(self, run_id: str, columns: Mapping[str, Sequence[Any]], artifact_file: str, *,
                  tag: bool = True) -> None:
        """Columns (name -> one value per row) as MLflow's table artifact: the JSON `MlflowClient.log_table`
        writes (`{"columns": [...], "data": [[...], ...]}`), named in the run's `mlflow.loggedArtifacts`
        tag, so the UI shows it as a table. Written here, through the one write path (outbox included),
        without pandas. `tag=False`: that tag goes with the run's next `log_batch` (one call less)."""
        names = list(columns)
        rows = zip(*(columns[n] for n in names), strict=True)
        table = {"columns": names, "data": [[json_cell(v) for v in row] for row in rows]}
        self._artifact(run_id, artifact_file, lambda path: path.write_text(
            json.dumps(table, default=json_default), encoding="utf-8"))
        tables = self._tables.setdefault(run_id, [])
        if {"path": artifact_file, "type": "table"} not in tables:
            tables.append({"path": artifact_file, "type": "table"})
        if tag:
            self._untagged.discard(run_id)
            self.set_tags(run_id, self._tables_tag(run_id))
        else:
            self._untagged.add(run_id)

    def _tables_tag(self, run_id: str) -> dict[str, str]:
        return {"mlflow.loggedArtifacts": json.dumps(self._tables.get(run_id, []))}

    def log_dataset(self, run_id: str, name: str, digest: str, source_type: str, source: Mapping[str, Any],
                    schema: Mapping[str, Any] | None = None, rows: int | None = None,
                    context: str = "eval") -> None:
        """A dataset input of the run (the UI's Datasets column shows name and digest)."""
        entry = [name, digest, source_type, json.dumps(source),
                 json.dumps(schema) if schema is not None else None,
                 json.dumps({"num_rows": rows}) if rows is not None else None, context]
        self._write(run_id, {"op": "log_inputs", "datasets": [entry]})


_REPAIRED_STORES: set[str] = set()


def open_store(client: Any, tracking_uri: str, outbox_root: Path | None = None) -> None:
    """The first time this process opens a store: upload the records kept while it was away, then close
    the runs of dead processes (one line each)."""
    if tracking_uri in _REPAIRED_STORES:
        return
    _REPAIRED_STORES.add(tracking_uri)
    upload_outboxes(client, tracking_uri, outbox_root)
    repair_store(client, tracking_uri)


def upload_outboxes(client: Any, tracking_uri: str, outbox_root: Path | None = None) -> list[outbox.Uploaded]:
    """Upload the outboxes kept for this store under `outputs/` (or `outbox_root`); never raises."""
    try:
        return outbox.flush(outbox_root or outbox.default_root(), tracking_uri, client, say)
    except Exception as error:
        log.debug("upload of outboxes for %s failed: %s", tracking_uri, error)
        return []


def repair_store(client: Any, tracking_uri: str, *, quiet: bool = False) -> list[heartbeat.Repaired]:
    """Close every RUNNING run of the store whose process died, as KILLED; never raises."""
    try:
        repaired = heartbeat.repair_dead_runs(client)
    except Exception as error:  # the store's own problems show in the command's own calls
        log.debug("repair of %s failed: %s", tracking_uri, error)
        return []
    if not quiet:
        for run in repaired:
            say(f"ember: MLflow run {run.run_id} ({run.run_name}) was still RUNNING but {run.reason}; "
                "closed as KILLED")
    return repaired


# ------------------------------------------------------------------------------------ results


def experiment_folder(name: str) -> str:
    """Where an experiment's artifacts go in its run (its checkpoints use the same names)."""
    return f"experiments/{metric_key(name).replace(' ', '_').replace('/', '_')}"


def log_experiment_result(tracker: Tracker, run_id: str, name: str, result: Any) -> None:
    """An experiment's metrics (prefixed with its name), tables, arrays, figures and files."""
    metrics = [(f"{name}.{m.name}", m.value, m.step) for m in result.metrics
               if isinstance(m.value, int | float) and math.isfinite(float(m.value))]
    tracker.log_metrics(run_id, metrics)
    folder = experiment_folder(name)
    tracker.log_json(run_id, [{"name": m.name, "value": m.value, "step": m.step} for m in result.metrics],
                     f"{folder}/metrics.json")  # also what a checkpoint of a killed run holds
    for table, rows in result.tables.items():
        rows = list(rows)
        tracker.log_json(run_id, rows, f"{folder}/{table}.json")
        if rows:
            tracker.log_text(run_id, table_csv(rows), f"{folder}/{table}.csv")
    for array_name, array in result.arrays.items():
        tracker.log_array(run_id, array, f"{folder}/{array_name}.npy")
    if result.figure_builders:
        for figure_name, figure in result.figures.items():
            tracker.log_figure(run_id, figure, f"{folder}/{figure_name}{figure_suffix(figure)}")
    for file_name, build in result.file_builders.items():
        tracker.log_bytes(run_id, build(), f"{folder}/{file_name}")
