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
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from hydra.experimental.callback import Callback

from ember import heartbeat
from ember.runconfig import MlflowSettings

log = logging.getLogger(__name__)

PARENT_RUN_ENV = "EMBER_MLFLOW_PARENT_RUN_ID"
SWEEP_RECORD = "mlflow_sweep.json"
MAX_PARAM_LENGTH = 6000
MAX_TAG_LENGTH = 8000

# MLflow run statuses.
FINISHED, FAILED, KILLED = "FINISHED", "FAILED", "KILLED"


@dataclass(frozen=True, slots=True)
class Store:
    """Where records go: the tracking URI and, for the embedded default, the artifact folder."""

    tracking_uri: str
    artifact_root: str | None = None

    @property
    def is_default(self) -> bool:
        return self.artifact_root is not None


def resolve_store(settings: MlflowSettings, base_dir: str | os.PathLike[str] | None = None) -> Store:
    """`mlflow.tracking_uri`, else `MLFLOW_TRACKING_URI`, else SQLite + artifacts under `outputs/`."""
    uri = settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
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


class Tracker:
    """One MLflow experiment in one store, with explicit run ids."""

    def __init__(self, store: Store, experiment_name: str) -> None:
        from mlflow.tracking import MlflowClient

        quiet_mlflow_logging()
        self.store = store
        self.client = MlflowClient(tracking_uri=store.tracking_uri)
        self.experiment_id = self._experiment(experiment_name)
        repair_once(self.client, store.tracking_uri)

    def _experiment(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        for _attempt in range(5):
            found = self.client.get_experiment_by_name(name)
            if found is not None:
                if found.lifecycle_stage == "deleted":
                    self.client.restore_experiment(found.experiment_id)
                return found.experiment_id
            location = None
            if self.store.artifact_root is not None:
                location = f"{self.store.artifact_root}/{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}"
            try:
                return self.client.create_experiment(name, artifact_location=location)
            except MlflowException:  # created meanwhile by a parallel job: look it up again
                time.sleep(0.2)
        raise RuntimeError(f"could not create or find the MLflow experiment {name!r}")

    # -------------------------------------------------------------------------------- runs

    def start_run(self, name: str, tags: Mapping[str, Any], parent_run_id: str | None = None) -> str:
        """A RUNNING run tagged with this process and a heartbeat kept fresh until `end_run`."""
        all_tags = {k: _text(v, MAX_TAG_LENGTH) for k, v in {**heartbeat.process_tags(), **tags}.items()}
        if parent_run_id:
            all_tags["mlflow.parentRunId"] = parent_run_id
        run = self.client.create_run(self.experiment_id, run_name=name, tags=all_tags)
        heartbeat.start(self.client, run.info.run_id)
        return run.info.run_id

    def end_run(self, run_id: str, status: str) -> None:
        heartbeat.stop(run_id)
        self.client.set_terminated(run_id, status=status)

    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        entries = [Param(metric_key(k), _text(v, MAX_PARAM_LENGTH)) for k, v in params.items()]
        for chunk in _chunks(entries, 100):
            self.client.log_batch(run_id, params=chunk)

    def set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        entries = [RunTag(k, _text(v, MAX_TAG_LENGTH)) for k, v in tags.items()]
        for chunk in _chunks(entries, 100):
            self.client.log_batch(run_id, tags=chunk)

    def log_metrics(self, run_id: str, metrics: Iterable[tuple[str, float, int]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        entries = [Metric(metric_key(k), float(v), now, int(step)) for k, v, step in metrics]
        for chunk in _chunks(entries, 1000):
            self.client.log_batch(run_id, metrics=chunk)

    # -------------------------------------------------------------------------------- artifacts

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self.client.log_text(run_id, text, artifact_file)

    def log_json(self, run_id: str, value: Any, artifact_file: str) -> None:
        self.client.log_text(run_id, json.dumps(value, indent=2, default=_json_default), artifact_file)

    def log_array(self, run_id: str, array: np.ndarray, artifact_file: str) -> None:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / Path(artifact_file).name
            np.save(path, np.asarray(array))
            self.client.log_artifact(run_id, str(path), str(Path(artifact_file).parent) or None)

    def log_figure(self, run_id: str, figure: Any, artifact_file: str) -> None:
        self.client.log_figure(run_id, figure, artifact_file)

    def log_table(self, run_id: str, columns: Mapping[str, Sequence[Any]], artifact_file: str) -> None:
        """Columns (name -> one value per row) as MLflow's table artifact (JSON, `split` orientation),
        which the UI shows as a table (the run's `mlflow.loggedArtifacts` tag names it)."""
        self.client.log_table(run_id, data=dict(columns), artifact_file=artifact_file)

    def log_dataset(self, run_id: str, name: str, digest: str, source_type: str, source: Mapping[str, Any],
                    schema: Mapping[str, Any] | None = None, rows: int | None = None,
                    context: str = "eval") -> None:
        """A dataset input of the run (the UI's Datasets column shows name and digest)."""
        from mlflow.entities import Dataset, DatasetInput, InputTag

        dataset = Dataset(name=name, digest=digest, source_type=source_type, source=json.dumps(source),
                          schema=json.dumps(schema) if schema is not None else None,
                          profile=json.dumps({"num_rows": rows}) if rows is not None else None)
        self.client.log_inputs(run_id, [DatasetInput(dataset, [InputTag("mlflow.data.context", context)])])


_REPAIRED_STORES: set[str] = set()


def repair_once(client: Any, tracking_uri: str) -> list[heartbeat.Repaired]:
    """The first time this process opens a store: close the runs of dead processes (one line each)."""
    if tracking_uri in _REPAIRED_STORES:
        return []
    _REPAIRED_STORES.add(tracking_uri)
    return repair_store(client, tracking_uri)


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
        os.environ[SWEEP_SIZE_ENV] = str(_sweep_size(config) or "")
        start_sweep(config)

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
        finish_sweep(str(config.hydra.sweep.dir))


SWEEP_SIZE_ENV = "EMBER_SWEEP_SIZE"


def _sweep_size(config: Any) -> int | None:
    """How many jobs the basic sweeper will make of the sweep overrides (product of their choices)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

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

    @property
    def ok(self) -> bool:
        return not self.failed_jobs


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


def start_sweep(config: Any) -> str | None:
    """Create the sweep folder and (when tracking is on) the parent run; returns its id."""
    global _ACTIVE_SWEEP_DIR, _LAST_SWEEP
    from omegaconf import OmegaConf

    from ember.provenance import environment_tags

    sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
    sweep_dir.mkdir(parents=True, exist_ok=True)
    _ACTIVE_SWEEP_DIR, _LAST_SWEEP = str(sweep_dir), None
    os.environ.pop(PARENT_RUN_ENV, None)
    settings = settings_from_config(config)
    if settings is None or not settings.enabled:
        return None
    store = resolve_store(settings)
    tracker = Tracker(store, settings.experiment_name)
    overrides = [str(o) for o in OmegaConf.select(config, "hydra.overrides.task", default=[]) or []]
    launcher = str(OmegaConf.select(config, "hydra.launcher._target_", default="") or "")
    tags = {**environment_tags(), "ember.sweep": "true", "ember.sweep_dir": str(sweep_dir),
            "ember.launcher": launcher.rsplit(".", 1)[-1]}
    run_id = tracker.start_run(_sweep_name(config), tags)
    tracker.log_params(run_id, {"hydra.overrides": " ".join(overrides), "hydra.launcher": launcher})
    record = {"run_id": run_id, "tracking_uri": store.tracking_uri, "experiment_id": tracker.experiment_id}
    sweep_record_path(sweep_dir).write_text(json.dumps(record))
    os.environ[PARENT_RUN_ENV] = run_id
    return run_id


def finish_sweep(sweep_dir: str, *, interrupted: bool = False, error: str | None = None) -> SweepSummary:
    """Close the sweep: every job that did not finish is named; the parent run ends KILLED on
    interruption, FAILED if any job failed, died or left no run, else FINISHED."""
    global _LAST_SWEEP
    folder = Path(sweep_dir).resolve()
    jobs = _job_statuses(folder)
    statuses = {num: status for num, (status, _) in jobs.items()}
    problems = {num: f"{status.lower()}: {detail}" if detail else status.lower()
                for num, (status, detail) in jobs.items() if status != FINISHED}
    record = read_sweep_record(folder) if folder.exists() else None
    if record is not None and not record.get("closed"):
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=record["tracking_uri"])
        children = client.search_runs(
            [record["experiment_id"]], filter_string=f"tags.mlflow.parentRunId = '{record['run_id']}'",
            max_results=10000,
        )
        for child in children:  # a job killed without closing its run: close it for it
            if child.info.status == "RUNNING":
                heartbeat.close_dead_run(client, child, "its sweep ended while it was still RUNNING")
                num = child.data.tags.get("ember.job")
                if num is not None:
                    problems.setdefault(num, "killed")
        recorded = {r.data.tags.get("ember.job") for r in children}
        for num in statuses:
            if num not in recorded:
                problems.setdefault(num, "no MLflow run")
        failed_jobs = _describe_jobs(folder, problems)
        _summarize(client, record)
        tags = {"ember.sweep.jobs": str(len(statuses)), "ember.sweep.child_runs": str(len(children)),
                "ember.sweep.failed_jobs": "; ".join(failed_jobs) or "none"}
        if error:
            tags["ember.sweep.error"] = error
        for key, value in tags.items():
            client.set_tag(record["run_id"], key, _text(value, MAX_TAG_LENGTH))
        status = KILLED if interrupted else FAILED if (problems or error) else FINISHED
        heartbeat.stop(record["run_id"])
        client.set_terminated(record["run_id"], status=status)
        record["closed"] = status
        sweep_record_path(folder).write_text(json.dumps(record))
    failed_jobs = _describe_jobs(folder, problems)
    if error:
        failed_jobs += (f"the sweep itself: {error}",)
    _LAST_SWEEP = SweepSummary(record["run_id"] if record else None, len(statuses), failed_jobs)
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


def _describe_jobs(folder: Path, problems: Mapping[str, str]) -> tuple[str, ...]:
    return tuple(f"job #{num} ({_job_overrides(folder / num)}): {problems[num]}"
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
            statuses[job_dir.name] = ("DIED", "the job ended without reporting (crashed or killed)")
    return statuses
