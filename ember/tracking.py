"""MLflow records of ember runs: provenance, params, metrics, artifacts, failure records, sweeps.

The runner (`ember.run`) decides what happened; this module writes it down. Runs are driven through
`MlflowClient` with explicit run ids (never MLflow's "active run" globals), so several jobs in one
process, parent and child runs, and closing a run on Ctrl-C all stay explicit.

Default store: a SQLite database at `outputs/mlflow.db` with artifacts in `outputs/mlartifacts`,
relative to the directory the command is run from, unless `mlflow.tracking_uri` or
`MLFLOW_TRACKING_URI` names another store (e.g. `http://127.0.0.1:5000`).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from hydra.experimental.callback import Callback

from ember import heartbeat, outbox
from ember.errors import ConfigError, EmberError
from ember.runconfig import MlflowSettings

log = logging.getLogger(__name__)

PARENT_RUN_ENV = "EMBER_MLFLOW_PARENT_RUN_ID"
SWEEP_RECORD = "mlflow_sweep.json"
MAX_PARAM_LENGTH = 6000
MAX_TAG_LENGTH = 8000
MAX_RUN_NAME_LENGTH = 250

# MLflow run statuses, and what a job folder without a status file says.
FINISHED, FAILED, KILLED = "FINISHED", "FAILED", "KILLED"
DIED = "DIED"

# MLflow 3's UI opens an experiment in its model-training view (runs, charts), not the GenAI view
# (traces, evaluations), when the experiment carries this tag with this value. The 3.17 UI no longer
# reads it: a switch in the page (remembered by the browser, or `?workflowType=machine_learning` in the
# address) chooses the view; README.md says so.
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}

# The UI's Source column: what made the run (the Hydra runner; the `ember` command sets its own name).
SOURCE_TAGS = {"mlflow.source.name": "ember.run", "mlflow.source.type": "LOCAL"}

# A server that stops answering is noticed in seconds (MLflow's defaults retry for ~4 minutes per
# request); the records then go to the run's outbox. Set these variables to choose otherwise.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")


@dataclass(frozen=True, slots=True)
class Store:
    """Where records go: the tracking URI and, for the embedded default, the artifact folder."""

    tracking_uri: str
    artifact_root: str | None = None

    @property
    def is_default(self) -> bool:
        return self.artifact_root is not None


def resolve_store(settings: MlflowSettings, base_dir: str | os.PathLike[str] | None = None, *,
                  sweep_job: bool = False) -> Store:
    """`mlflow.tracking_uri`, else `MLFLOW_TRACKING_URI`, else SQLite + artifacts under `outputs/`.

    A job of a sweep records where its parent run is (`EMBER_SWEEP_TRACKING_URI`, handed over by the
    process that started the sweep), wherever it runs."""
    uri = os.environ.get(SWEEP_STORE_ENV) if sweep_job else None
    uri = uri or settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        refuse_credentials(uri)
        return Store(uri)
    outputs = Path(base_dir or os.getcwd()).resolve() / "outputs"
    outputs.mkdir(parents=True, exist_ok=True)
    return Store(f"sqlite:///{outputs / 'mlflow.db'}", (outputs / "mlartifacts").as_uri())


def quiet_mlflow_logging() -> None:
    """Keep MLflow's and Alembic's INFO chatter (store migrations) out of the run's output."""
    for name in ("alembic", "mlflow", "sqlalchemy", "urllib3"):
        logging.getLogger(name).setLevel(logging.WARNING)


_METRIC_KEY = re.compile(r"[^A-Za-z0-9_\-. /]")


def metric_key(name: str) -> str:
    """A metric or param key MLflow accepts (alphanumerics, `_-. /`), at most 250 characters."""
    return _METRIC_KEY.sub("_", name)[:250]


def _text(value: Any, limit: int) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str) if isinstance(
        value, dict | list) else str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _chunks(items: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _http_status(error: Exception) -> int | None:
    try:
        return int(error.get_http_status_code())  # type: ignore[attr-defined]
    except Exception:
        return None


def describe_mlflow_error(error: Exception, uri: str) -> str:
    """One line for an MLflow error: what the server said, and for a refusal what to do (the
    credentials themselves are never shown)."""
    status = _http_status(error)
    if status == 401:
        given = "MLFLOW_TRACKING_USERNAME" in os.environ and "MLFLOW_TRACKING_PASSWORD" in os.environ
        if given:
            return (f"the MLflow server at {uri} refused the credentials in MLFLOW_TRACKING_USERNAME / "
                    f"MLFLOW_TRACKING_PASSWORD (HTTP 401): wrong user name or password")
        return (f"the MLflow server at {uri} asks for credentials (HTTP 401): set MLFLOW_TRACKING_USERNAME "
                f"and MLFLOW_TRACKING_PASSWORD in the environment of every process that records")
    if status == 403:
        return (f"the MLflow server at {uri} does not let this user write here (HTTP 403): ask its admin "
                f"for EDIT permission on the experiment")
    message = getattr(error, "message", None) or str(error)
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    return f"MLflow ({uri}): {lines[0] if lines else type(error).__name__}"


class TrackingUnavailableError(EmberError):
    """The tracking server cannot be reached, or refuses ember, when a command starts."""


class CredentialsInUriError(EmberError):
    """A tracking URI with a user name or password in it."""


def refuse_credentials(uri: str) -> None:
    """Refuse a tracking URI with credentials in it (`http://user:pw@host`): ember records where its
    records go (params, tags, the sweep's files, log lines), and credentials travel only in the
    environment. The message shows the URI without them."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(uri)
        web = parts.scheme in ("http", "https")
        if not (parts.password is not None or (web and parts.username is not None)):
            return
    except ValueError:  # not a URL MLflow could use either: it says so itself
        return
    bare = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
    where = ("MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN)" if web
             else "the database's own way (PGPASSWORD or ~/.pgpass for PostgreSQL)")
    raise CredentialsInUriError(f"the tracking URI {bare} has credentials in it, which ember would record "
                                f"with the runs: give the URI without them and the credentials in {where}")


# The stores MLflow 3 builds (mlflow.tracking._tracking_service.utils); plugins add theirs as entry points.
_STORE_SCHEMES = {"", "file", "sqlite", "http", "https", "postgresql", "mysql", "mssql", "databricks",
                  "databricks-uc", "uc"}


def check_scheme(tracking_uri: str) -> None:
    """A URI whose scheme no MLflow store takes is a ConfigError before anything loads (found by fuzzing:
    mlflow.tracking_uri=bogus://x failed only when the run started, after the model was loaded)."""
    from importlib.metadata import entry_points
    from urllib.parse import urlparse

    scheme = urlparse(tracking_uri).scheme.lower().split("+")[0]  # postgresql+psycopg2://
    if len(scheme) <= 1 or scheme in _STORE_SCHEMES:  # a path (C:\... parses as scheme "c")
        return
    if scheme in {e.name for e in entry_points(group="mlflow.tracking_store")}:
        return
    raise ConfigError(f"MLflow has no tracking store for {tracking_uri!r} (scheme {scheme}://): give a "
                      "path, sqlite:///..., http(s)://... or a database URI in mlflow.tracking_uri "
                      "(ember commands: --mlflow-uri)")


_DATABASE_SCHEMES = ("postgresql", "mysql", "mssql")


def _check_database(tracking_uri: str, timeout: float) -> None:
    """A database store (PostgreSQL, MySQL, SQL Server): its driver importable and one connection made,
    or a TrackingUnavailable error in one line (the password, if any, comes from the environment)."""
    import sqlalchemy

    try:
        engine = sqlalchemy.create_engine(tracking_uri, connect_args=(
            {"connect_timeout": int(max(1, timeout))} if tracking_uri.startswith(("postgresql", "mysql"))
            else {}))
    except ModuleNotFoundError as error:
        raise TrackingUnavailableError(
            f"the MLflow store {tracking_uri} needs the database driver {error.name!r}, which is not "
            "installed (pip install it, or pip install -e '.[cluster]' for PostgreSQL)") from None
    except Exception as error:  # noqa: BLE001 - SQLAlchemy's errors for a URI it cannot read
        raise ConfigError(f"cannot read the database URI {tracking_uri!r}: {error}") from None
    try:
        with engine.connect():
            pass
    except Exception as error:  # noqa: BLE001 - OperationalError and the drivers' own
        reason = str(getattr(error, "orig", error)).strip().splitlines()[0]
        raise TrackingUnavailableError(
            f"the MLflow store {tracking_uri} is not reachable ({reason}); start the database, record "
            "elsewhere with mlflow.tracking_uri=... (ember commands: --mlflow-uri), or record nothing with "
            "mlflow=off (--no-mlflow)") from None
    finally:
        engine.dispose()


def check_reachable(tracking_uri: str, timeout: float = 5.0) -> None:
    """For an HTTP store: one quick request (no retries) before anything is loaded; a TrackingUnavailable
    error naming the server, what happened and the way out. Other stores (SQLite, files) pass. A URI
    with credentials in it is refused first (`refuse_credentials`)."""
    refuse_credentials(tracking_uri)
    check_scheme(tracking_uri)
    if tracking_uri.startswith(_DATABASE_SCHEMES):
        _check_database(tracking_uri, timeout)
    if not tracking_uri.startswith(("http://", "https://")):
        return
    import base64
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{tracking_uri.rstrip('/')}/api/2.0/mlflow/experiments/search",
                                     data=b'{"max_results": 1}', method="POST",
                                     headers={"Content-Type": "application/json"})
    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if user and password:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    elif os.environ.get("MLFLOW_TRACKING_TOKEN"):
        request.add_header("Authorization", f"Bearer {os.environ['MLFLOW_TRACKING_TOKEN']}")
    way_out = ("start it, record elsewhere with mlflow.tracking_uri=... (ember commands: --mlflow-uri), "
               "or record nothing with mlflow=off (--no-mlflow)")
    try:
        with urllib.request.urlopen(request, timeout=timeout):
            return
    except urllib.error.HTTPError as error:
        if error.code in (401, 403):
            raise TrackingUnavailableError(
                f"the MLflow tracking server at {tracking_uri} refused ember's credentials (HTTP "
                f"{error.code}): set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD for it") from None
        raise TrackingUnavailableError(
            f"the MLflow tracking server at {tracking_uri} answered HTTP {error.code} "
            f"({error.reason}); {way_out}") from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise TrackingUnavailableError(
            f"the MLflow tracking server at {tracking_uri} is not reachable ({reason}); {way_out}") from None


class Tracker:
    """One MLflow experiment in one store, with explicit run ids.

    Every write of a run goes through `_write`: straight to the store, or, once an HTTP store has stopped
    answering during the run, into the run's outbox (`ember.outbox`), in order, to be uploaded later.
    A run started while the store is away gets a placeholder id and is created at upload.
    """

    def __init__(self, store: Store, experiment_name: str, *, outbox_root: Path | None = None) -> None:
        from mlflow.tracking import MlflowClient

        quiet_mlflow_logging()
        self.store = store
        self.client = MlflowClient(tracking_uri=store.tracking_uri)
        self.outbox_root = outbox_root or outbox.default_root()
        self.outboxes: dict[str, outbox.Outbox] = {}
        self._tables: dict[str, list[dict[str, str]]] = {}  # run -> its table artifacts (loggedArtifacts)
        self.experiment_id = self._experiment(experiment_name)
        open_store(self.client, store.tracking_uri, self.outbox_root)

    @classmethod
    def attach(cls, store: Store, experiment_id: str, *, outbox_root: Path | None = None) -> Tracker:
        """A tracker for runs of a known experiment, without contacting the store (closing a sweep)."""
        from mlflow.tracking import MlflowClient

        tracker = cls.__new__(cls)
        tracker.store, tracker.experiment_id = store, experiment_id
        tracker.client = MlflowClient(tracking_uri=store.tracking_uri)
        tracker.outbox_root = outbox_root or outbox.default_root()
        tracker.outboxes = {}
        tracker._tables = {}
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
        all_tags = {k: _text(v, MAX_TAG_LENGTH) for k, v in {**heartbeat.process_tags(), **tags}.items()}
        if parent_run_id:
            all_tags["mlflow.parentRunId"] = parent_run_id
        name = _text(name, MAX_RUN_NAME_LENGTH)  # SQL stores keep 250 characters (PostgreSQL enforces it)
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
        entries = [[metric_key(k), _text(v, MAX_PARAM_LENGTH)] for k, v in params.items()]
        for chunk in _chunks(entries, 100):
            self._write(run_id, {"op": "log_batch", "params": list(chunk)})

    def set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        entries = [[k, _text(v, MAX_TAG_LENGTH)] for k, v in tags.items()]
        for chunk in _chunks(entries, 100):
            self._write(run_id, {"op": "log_batch", "tags": list(chunk)})

    def log_metrics(self, run_id: str, metrics: Iterable[tuple[str, float, int]]) -> None:
        now = int(time.time() * 1000)  # kept in an outbox as is: an upload repeated stores them once
        entries = [[metric_key(k), float(v), now, int(step)] for k, v, step in metrics]
        for chunk in _chunks(entries, 1000):
            self._write(run_id, {"op": "log_batch", "metrics": list(chunk)})

    # -------------------------------------------------------------------------------- artifacts

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self._artifact(run_id, artifact_file, lambda path: path.write_text(text, encoding="utf-8"))

    def log_json(self, run_id: str, value: Any, artifact_file: str) -> None:
        self.log_text(run_id, json.dumps(value, indent=2, default=_json_default), artifact_file)

    def log_array(self, run_id: str, array: np.ndarray, artifact_file: str) -> None:
        self._artifact(run_id, artifact_file, lambda path: np.save(path, np.asarray(array)))

    def log_figure(self, run_id: str, figure: Any, artifact_file: str) -> None:
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
        print(f"ember: the tracking server at {self.store.tracking_uri} stopped answering ({reason[:200]}); "
              f"the records of run {run_id} are kept in {kept.folder} and uploaded by the next ember command "
              f"on this store (or: ember runs upload)", file=sys.stderr, flush=True)
        return kept

    def log_table(self, run_id: str, columns: Mapping[str, Sequence[Any]], artifact_file: str) -> None:
        """Columns (name -> one value per row) as MLflow's table artifact: the JSON `MlflowClient.log_table`
        writes (`{"columns": [...], "data": [[...], ...]}`), named in the run's `mlflow.loggedArtifacts`
        tag, so the UI shows it as a table. Written here, through the one write path (outbox included),
        without pandas."""
        names = list(columns)
        rows = zip(*(columns[n] for n in names), strict=True)
        table = {"columns": names, "data": [[_json_cell(v) for v in row] for row in rows]}
        self._artifact(run_id, artifact_file, lambda path: path.write_text(
            json.dumps(table, default=_json_default), encoding="utf-8"))
        tables = self._tables.setdefault(run_id, [])
        if {"path": artifact_file, "type": "table"} not in tables:
            tables.append({"path": artifact_file, "type": "table"})
        self.set_tags(run_id, {"mlflow.loggedArtifacts": json.dumps(tables)})

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
        return outbox.flush(outbox_root or outbox.default_root(), tracking_uri, client,
                            lambda line: print(line, file=sys.stderr, flush=True))
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
            print(f"ember: MLflow run {run.run_id} ({run.run_name}) was still RUNNING but {run.reason}; "
                  f"closed as KILLED", file=sys.stderr, flush=True)
    return repaired


def _json_cell(value: Any) -> Any:
    """A table cell as strict JSON: NaN and infinities become null (the UI cannot read NaN)."""
    if isinstance(value, float | np.floating) and not math.isfinite(float(value)):
        return None
    return value


def _json_default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "value") and hasattr(value, "name"):  # enums
        return value.value
    return str(value)


def table_csv(rows: Sequence[Mapping[str, Any]]) -> str:
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns)
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _json_default(v) if not isinstance(v, str | int | float) else v
                         for k, v in row.items()})
    return out.getvalue()


# ------------------------------------------------------------------------------------ results


def log_experiment_result(tracker: Tracker, run_id: str, name: str, result: Any) -> None:
    """An experiment's metrics (prefixed with its name), tables, arrays and figures."""
    metrics = [(f"{name}.{m.name}", m.value, m.step) for m in result.metrics
               if isinstance(m.value, int | float) and math.isfinite(float(m.value))]
    tracker.log_metrics(run_id, metrics)
    folder = f"experiments/{metric_key(name).replace(' ', '_').replace('/', '_')}"
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
            tracker.log_figure(run_id, figure, f"{folder}/{figure_name}.png")


def failure_record(failure: Any, generation: Any) -> dict[str, Any]:
    """An ExperimentFailure as plain JSON: where it failed, why, and the tokens produced so far."""
    phase = getattr(failure, "phase", None)
    record: dict[str, Any] = {
        "experiment": failure.experiment,
        "hook": failure.hook,
        "phase": getattr(phase, "value", phase),
        "layer": failure.layer,
        "message": failure.message,
        "description": str(failure),
    }
    if generation is not None:
        record["generated_token_count"] = len(generation.token_ids)
        record["token_ids"] = list(map(int, generation.token_ids))
        record["text"] = generation.text
        record["stop_reason"] = generation.stop_reason
    return record


def failure_tags(record: Mapping[str, Any]) -> dict[str, str]:
    keys = ("experiment", "hook", "phase", "layer", "message")
    tags = {f"ember.failure.{key}": str(record[key]) for key in keys if record.get(key) is not None}
    tags["ember.failure"] = str(record.get("description", ""))
    return tags


# ------------------------------------------------------------------------------------ sweeps


def sweep_record_path(sweep_dir: str | os.PathLike[str]) -> Path:
    return Path(sweep_dir) / SWEEP_RECORD


def read_sweep_record(sweep_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    path = sweep_record_path(sweep_dir)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def parent_run_id(sweep_dir: str | os.PathLike[str] | None) -> str | None:
    """The sweep's parent run: from the environment (set by the callback) or the sweep folder."""
    if sweep_dir is not None:
        record = read_sweep_record(sweep_dir)
        if record is not None:
            return str(record["run_id"])
    return os.environ.get(PARENT_RUN_ENV)


def settings_from_config(config: Any) -> MlflowSettings | None:
    """The `mlflow` section of a (possibly invalid) config, or None when it cannot be read."""
    from omegaconf import OmegaConf

    section = OmegaConf.select(config, "mlflow", default=None)
    if section is None:
        return None
    try:
        return MlflowSettings(
            tracking_uri=section.get("tracking_uri"),
            experiment_name=str(section.get("experiment_name") or "ember"),
            enabled=bool(section.get("enabled", True)),
        )
    except Exception:  # invalid values: each job reports them itself
        return None


def _sweep_name(config: Any) -> str:
    from omegaconf import OmegaConf

    overrides = [str(o) for o in OmegaConf.select(config, "hydra.overrides.task", default=[]) or []]
    source = OmegaConf.select(config, "model.source", default="?")
    label = Path(str(source)).stem if str(source).endswith(".gguf") else str(source)
    return f"sweep[{' '.join(overrides)}] {label}"


class SweepCallback(Callback):
    """One MLflow parent run per sweep: created before the first job, closed after the last.

    The parent's id reaches every job (in this process or a joblib worker) through the environment
    and through `mlflow_sweep.json` in the sweep folder. At the end the parent is FINISHED if every
    child finished, FAILED otherwise, with the failed jobs named in a tag (and by `ember.run` on
    stderr, with exit status 1).
    """

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        size = _sweep_size(config)
        os.environ[SWEEP_SIZE_ENV] = str(size or "")
        # Hydra turns a callback's exception into a warning and goes on; a sweep without its parent
        # run or its hand-over would record unlinked runs, so it stops here, before any job.
        try:
            run_id = start_sweep(config, size)
            hand_over_to_jobs(config, run_id, size)
        except EmberError as error:  # the store refused or is away: one line, no job started, status 2
            print(f"ember: {error}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        except Exception as error:
            from mlflow.exceptions import MlflowException

            settings = settings_from_config(config)
            uri = resolve_store(settings).tracking_uri if settings else "the configured store"
            text = describe_mlflow_error(error, uri) if isinstance(error, MlflowException) else (
                f"{type(error).__name__}: {error}")
            print(f"ember: could not start the sweep: {text}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        # Progress of a sweep, one plain line per job: readable on a terminal, in CI logs, and from
        # joblib workers alike (a bar would be torn apart by the jobs' own output).
        from omegaconf import OmegaConf

        number = OmegaConf.select(config, "hydra.job.num", default=None)
        if number is None:
            return
        size = os.environ.get(SWEEP_SIZE_ENV) or "?"
        overrides = OmegaConf.select(config, "hydra.overrides.task", default=[]) or []
        overrides = " ".join(str(o) for o in overrides)
        print(f"ember: sweep job {int(number) + 1}/{size}: {overrides}", file=sys.stderr, flush=True)

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        finish_sweep(str(config.hydra.sweep.dir), all_returned=True)


SWEEP_SIZE_ENV = "EMBER_SWEEP_SIZE"


SWEEP_STORE_ENV = "EMBER_SWEEP_TRACKING_URI"


def hand_over_to_jobs(config: Any, parent_run_id: str | None, size: int | None) -> None:
    """Give every job of the sweep what it needs from this process, wherever the launcher runs it.

    A job's config is composed again from the sweep's Hydra overrides (in this process for Ray and
    joblib, in the job's own process for submitit), and a job on another node shares neither this
    process's environment nor its disk. So the parent run id, the store it lives in and the sweep size
    travel as `hydra.job.env_set` overrides (Hydra sets them around the job), and a relative sweep
    folder is made absolute (a Ray worker's working directory is its raylet's, not this one).
    """
    from omegaconf import OmegaConf, open_dict

    overrides = OmegaConf.select(config, "hydra.overrides.hydra", default=None)
    if overrides is None:
        return
    env = {SWEEP_SIZE_ENV: str(size or "")}
    record = read_sweep_record(Path(str(config.hydra.sweep.dir)).resolve())
    if parent_run_id and record is not None:
        env.update({PARENT_RUN_ENV: parent_run_id, SWEEP_STORE_ENV: record["tracking_uri"]})
    added = [f"++hydra.job.env_set.{key}={_override_value(value)}" for key, value in env.items()]
    sweep_dir = str(OmegaConf.select(config, "hydra.sweep.dir"))
    if not os.path.isabs(sweep_dir):
        added.append(f"hydra.sweep.dir={_override_value(str(Path(sweep_dir).resolve()))}")
    with open_dict(config.hydra.overrides):
        config.hydra.overrides.hydra = [str(o) for o in overrides] + added


def _override_value(value: str) -> str:
    """`value` as a quoted Hydra override value (quotes and interpolations escaped)."""
    escaped = value.replace("'", "\\'").replace("${", "\\${")
    return f"'{escaped}'"


def _sweep_size(config: Any) -> int | None:
    """How many jobs the sweep will make: the Optuna sweeper's trials, else the product of the sweep
    overrides' choices (the basic sweeper)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    sweeper = str(OmegaConf.select(config, "hydra.sweeper._target_", default="") or "")
    if "optuna" in sweeper.lower():
        trials = OmegaConf.select(config, "hydra.sweeper.n_trials", default=None)
        return int(trials) if trials else None
    overrides = [str(o) for o in OmegaConf.select(config, "hydra.overrides.task", default=[]) or []]
    try:
        size = 1
        for override in OverridesParser.create().parse_overrides(overrides):
            if override.is_sweep_override():
                size *= len(list(override.sweep_string_iterator()))
        return size
    except Exception:  # an exotic sweep (ranges, custom sweepers): progress then shows "?"
        return None


@dataclass(frozen=True, slots=True)
class SweepSummary:
    run_id: str | None
    jobs: int
    failed_jobs: tuple[str, ...]
    retried_jobs: tuple[str, ...] = ()
    best: str | None = None  # a search's best trial
    tracking_uri: str = ""
    error: str | None = None  # what stopped the sweep itself (its launcher or sweeper), if anything

    @property
    def ok(self) -> bool:
        return not self.failed_jobs and self.error is None


# The sweep this process started (main process only) and how it ended.
_ACTIVE_SWEEP_DIR: str | None = None
_LAST_SWEEP: SweepSummary | None = None


def active_sweep_dir() -> str | None:
    return _ACTIVE_SWEEP_DIR


def last_sweep() -> SweepSummary | None:
    return _LAST_SWEEP


def forget_active_sweep() -> None:
    global _ACTIVE_SWEEP_DIR, _LAST_SWEEP
    _ACTIVE_SWEEP_DIR = _LAST_SWEEP = None


def start_sweep(config: Any, size: int | None = None) -> str | None:
    """Create the sweep folder and (when tracking is on) the parent run; returns its id. `size`: how
    many jobs the sweep will have, when known."""
    global _ACTIVE_SWEEP_DIR, _LAST_SWEEP
    from omegaconf import OmegaConf

    from ember.provenance import environment_tags

    sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
    sweep_dir.mkdir(parents=True, exist_ok=True)
    os.environ.pop(PARENT_RUN_ENV, None)
    _LAST_SWEEP = None
    settings = settings_from_config(config)
    if settings is None or not settings.enabled:
        _ACTIVE_SWEEP_DIR = str(sweep_dir)
        return None
    store = resolve_store(settings)
    tracker = Tracker(store, settings.experiment_name)  # a refusal stops the sweep before any job
    overrides = [str(o) for o in OmegaConf.select(config, "hydra.overrides.task", default=[]) or []]
    launcher = str(OmegaConf.select(config, "hydra.launcher._target_", default="") or "")
    tags = {**environment_tags(), **SOURCE_TAGS, "ember.sweep": "true", "ember.sweep_dir": str(sweep_dir),
            "ember.launcher": launcher.rsplit(".", 1)[-1]}
    run_id = tracker.start_run(_sweep_name(config), tags)
    tracker.log_params(run_id, {"hydra.overrides": " ".join(overrides), "hydra.launcher": launcher})
    record = {"run_id": run_id, "tracking_uri": store.tracking_uri, "experiment_id": tracker.experiment_id,
              "size": size}
    sweeper = str(OmegaConf.select(config, "hydra.sweeper._target_", default="") or "")
    if "optuna" in sweeper.lower():  # a search: the best trial is tagged on the parent at the end
        record["search"] = str(OmegaConf.select(config, "hydra.sweeper.direction", default="minimize"))
    sweep_record_path(sweep_dir).write_text(json.dumps(record))
    os.environ[PARENT_RUN_ENV] = run_id
    _ACTIVE_SWEEP_DIR = str(sweep_dir)
    return run_id


def finish_sweep(sweep_dir: str, *, interrupted: bool = False, error: str | None = None,
                 all_returned: bool = False) -> SweepSummary:
    """Close the sweep: every job that did not finish is named; the parent run ends KILLED on
    interruption, FAILED if any job failed, died or left no run, else FINISHED.

    What each job became is read from the child runs in the parent's store (jobs on every node
    record there) and, for jobs that ran on this machine, from the status files in their folders.
    A job may have several child runs: a launcher that retries a job whose worker died (Ray) starts
    it again as a new run. The last attempt decides; the earlier ones are named as retried.

    A child run still RUNNING is closed as KILLED when nobody can be writing it any more: when the
    launcher returned every job (`all_returned`, the normal end), or when its process is gone (a
    heartbeat check, `ember.heartbeat`). After a launcher crash or Ctrl-C, a job a cluster still runs
    (a SLURM task outlives the command that submitted it) is left alone and named as still running.
    """
    global _LAST_SWEEP
    folder = Path(sweep_dir).resolve()
    local = _job_statuses(folder)
    best = None
    problems = {num: f"{status.lower()}: {detail}" if detail else status.lower()
                for num, (status, detail) in local.items() if status != FINISHED}
    overrides = {num: _job_overrides(folder / num) for num in local}
    retried: dict[str, str] = {}
    jobs = set(local)
    record = read_sweep_record(folder) if folder.exists() else None
    if record is not None and not record.get("closed"):
        tracker = Tracker.attach(Store(record["tracking_uri"]), record["experiment_id"])
        jobs.update(str(n) for n in range(int(record.get("size") or 0)))
        try:
            attempts: dict[str, list[tuple[Any, str]]] | None = _attempts_by_job(tracker.client, record,
                                                                                 all_returned)
        except Exception as failure:  # the store is away: the job status files still tell the story
            if not outbox.unreachable(failure, record["tracking_uri"]):
                raise
            attempts = None
        for num, runs in (attempts or {}).items():
            jobs.add(num)
            overrides.setdefault(num, runs[-1][0].data.tags.get("ember.overrides", "?"))
            last_run, last_status = runs[-1]
            lost = [f"attempt {i} {status.lower()} ({_where(run)})"
                    for i, (run, status) in enumerate(runs, start=1) if status != FINISHED]
            if last_status == FINISHED:
                problems.pop(num, None)  # a status file left by an earlier attempt on this machine
                if lost:
                    retried[num] = f"retried: {'; '.join(lost)}; attempt {len(runs)} finished"
            elif num not in problems or len(runs) > 1 or local[num][0] == DIED:  # the run says more
                why = _run_problem(last_run, last_status)
                problems[num] = why if len(runs) == 1 else f"{why}; earlier: {'; '.join(lost[:-1])}"
        for num in jobs if attempts is not None else ():
            if num not in attempts:
                problems.setdefault(num, "no MLflow run")
        if record.get("search") and attempts is not None:
            best = _tag_best_trial(tracker, record, attempts, overrides)
        failed_jobs = _describe_jobs(problems, overrides)
        if attempts is not None:
            _summarize(tracker.client, record)
        child_runs = "unknown" if attempts is None else str(sum(len(runs) for runs in attempts.values()))
        tags = {"ember.sweep.jobs": str(len(jobs)), "ember.sweep.child_runs": child_runs,
                "ember.sweep.failed_jobs": "; ".join(failed_jobs) or "none",
                "ember.sweep.retried_jobs": "; ".join(_describe_jobs(retried, overrides)) or "none"}
        if error:
            tags["ember.sweep.error"] = error
        tracker.set_tags(record["run_id"], tags)
        status = KILLED if interrupted else FAILED if (problems or error) else FINISHED
        tracker.end_run(record["run_id"], status)
        record["closed"] = status
        sweep_record_path(folder).write_text(json.dumps(record))
    _LAST_SWEEP = SweepSummary(record["run_id"] if record else None, len(jobs),
                               _describe_jobs(problems, overrides), _describe_jobs(retried, overrides), best,
                               record["tracking_uri"] if record else "", error)
    return _LAST_SWEEP


def _summarize(client: Any, record: Mapping[str, Any]) -> None:
    """The parent's summary of its children (ember.studies.summary); a failure there is noted, never
    in the way of closing the sweep."""
    try:
        from ember.studies.summary import summarize_sweep

        summarize_sweep(client, record["experiment_id"], record["run_id"])
    except Exception as error:
        log.warning("ember: could not summarise the sweep in its parent run: %s", error)
        detail = _text(f"{type(error).__name__}: {error}", MAX_TAG_LENGTH)
        client.set_tag(record["run_id"], "ember.sweep.summary_error", detail)


Attempts = Mapping[str, list[tuple[Any, str]]]  # job number -> its child runs and their statuses


def _tag_best_trial(tracker: Tracker, record: Mapping[str, Any], attempts: Attempts,
                    overrides: Mapping[str, str]) -> str | None:
    """Tag the parent of a search with its best finished trial (by the `objective` metric each job
    logged, in the sweeper's direction) and that trial's run with `ember.search.best`."""
    finished = [(num, runs[-1][0]) for num, runs in attempts.items()
                if runs[-1][1] == FINISHED and "objective" in runs[-1][0].data.metrics]
    if not finished:
        tracker.set_tags(record["run_id"], {"ember.search.best_run_id": "none"})
        return None
    maximize = str(record["search"]).lower().endswith("maximize")
    pick = max if maximize else min
    num, run = pick(finished, key=lambda item: item[1].data.metrics["objective"])
    value = run.data.metrics["objective"]
    tags = {"ember.search.best_run_id": run.info.run_id, "ember.search.best_job": num,
            "ember.search.best_objective": repr(value), "ember.search.direction": str(record["search"]),
            "ember.search.best_overrides": overrides.get(num, "?"), "ember.search.trials": str(len(attempts))}
    tracker.set_tags(record["run_id"], tags)
    tracker.set_tags(run.info.run_id, {"ember.search.best": "true"})
    return f"job #{num} ({overrides.get(num, '?')}): objective {value:g}, run {run.info.run_id}"


def _attempts_by_job(client: Any, record: Mapping[str, Any],
                     all_returned: bool) -> dict[str, list[tuple[Any, str]]]:
    """Job number -> its child runs in start order, each with its status. A child still RUNNING whose
    writer is gone (see `finish_sweep`) is closed as KILLED here."""
    children, token = [], None
    while True:
        page = client.search_runs([record["experiment_id"]],
                                  filter_string=f"tags.mlflow.parentRunId = '{record['run_id']}'",
                                  max_results=1000, page_token=token)
        children.extend(page)
        token = page.token
        if not token:
            break
    attempts: dict[str, list[tuple[Any, str]]] = {}
    for child in sorted(children, key=lambda r: r.info.start_time or 0):
        status = child.info.status
        if status == "RUNNING":
            dead = heartbeat.dead_reason(child.data.tags)
            if all_returned or dead:
                heartbeat.close_dead_run(client, child, dead or "its sweep ended while it was still RUNNING")
                status = KILLED
        num = child.data.tags.get("ember.job")
        if num is not None:
            attempts.setdefault(num, []).append((child, status))
    return attempts


def _where(run: Any) -> str:
    tags = run.data.tags
    place = f"run {run.info.run_id}"
    if tags.get("ember.host"):
        place += f" on {tags['ember.host']}, pid {tags.get('ember.pid', '?')}"
    return place


def _run_problem(run: Any, status: str) -> str:
    """Why a job's run did not finish, in a few words."""
    tags = run.data.tags
    if status == "RUNNING":
        return f"still running ({_where(run)}): its process is alive or its heartbeat recent; not closed"
    if status == KILLED and not tags.get("ember.error"):
        return f"killed: its process died without closing its run ({_where(run)})"
    detail = tags.get("ember.failure") or tags.get("ember.error") or ""
    return f"{status.lower()}: {detail}" if detail else f"{status.lower()} ({_where(run)})"


def _describe_jobs(problems: Mapping[str, str], overrides: Mapping[str, str]) -> tuple[str, ...]:
    return tuple(f"job #{num} ({overrides.get(num, '?')}): {problems[num]}"
                 for num in sorted(problems, key=int))


def _job_overrides(job_dir: Path) -> str:
    try:
        import yaml

        overrides = yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text()) or []
        return " ".join(str(o) for o in overrides)
    except Exception:
        return "?"


JOB_STATUS_FILE = "ember_status.json"


def write_job_status(job_dir: str | os.PathLike[str], status: str, detail: str = "") -> None:
    """What one job ended as, in its own folder (read back by `finish_sweep`)."""
    Path(job_dir).mkdir(parents=True, exist_ok=True)
    (Path(job_dir) / JOB_STATUS_FILE).write_text(json.dumps({"status": status, "detail": detail}))


def _job_statuses(sweep_dir: Path) -> dict[str, tuple[str, str]]:
    """Job number -> (status, detail); a job folder without a status file is a job that died mid-way."""
    if not sweep_dir.exists():
        return {}
    statuses = {}
    for job_dir in sweep_dir.iterdir():
        if not (job_dir.is_dir() and job_dir.name.isdigit()):
            continue
        try:
            record = json.loads((job_dir / JOB_STATUS_FILE).read_text())
            statuses[job_dir.name] = (str(record["status"]), str(record.get("detail", "")))
        except (OSError, ValueError, KeyError):
            statuses[job_dir.name] = (DIED, "the job ended without reporting (crashed or killed)")
    return statuses
