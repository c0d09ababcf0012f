"""A sweep's records: its parent run, what it hands to its jobs, and its close.

`Sweep.start` makes the sweep folder, the parent run (when recording is on) and the sweep file
(`mlflow_sweep.json`: the parent run, its store and experiment, the sweep size, and at the end how the
sweep closed). The jobs learn what they need from the environment variables named here (handed to
them by the caller, e.g. as Hydra `env_set` overrides, see `job_environment`) and from the sweep file.
`Sweep.finish` collects each job's attempts (its child runs in the store, its status file on this
machine), judges each job by its last attempt, and closes the parent.

The process that started a sweep finds it again with `Sweep.opened_here` (the folder is kept in this
process's environment, as the parent run id is); everything else lives in the sweep file.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ember.records import heartbeat, outbox
from ember.records.store import MlflowSettings, Store, resolve_store
from ember.records.tracker import FAILED, FINISHED, KILLED, SOURCE_TAGS, Tracker
from ember.records.values import MAX_TAG_LENGTH, clip

log = logging.getLogger(__name__)

SWEEP_FILE = "mlflow_sweep.json"
JOB_STATUS_FILE = "ember_status.json"

# What a sweep hands to its jobs, wherever they run, and what its own process keeps.
PARENT_RUN_ENV = "EMBER_MLFLOW_PARENT_RUN_ID"
SWEEP_STORE_ENV = "EMBER_SWEEP_TRACKING_URI"
SWEEP_SIZE_ENV = "EMBER_SWEEP_SIZE"
OPEN_SWEEP_ENV = "EMBER_OPEN_SWEEP_DIR"

DIED = "DIED"  # what a job folder without a status file says

# A summary of the parent's children (e.g. `ember.studies.summary.summarize_sweep`):
# (the store's Tracker, experiment id, parent run id); it writes through the tracker.
Summarize = Callable[[Any, str, str], Any]


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


class Sweep:
    """One sweep, as its folder and sweep file hold it."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder).resolve()

    @property
    def file(self) -> Path:
        return self.folder / SWEEP_FILE

    def record(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.file.read_text())
        except (OSError, ValueError):
            return None

    def _write(self, record: Mapping[str, Any]) -> None:
        self.file.write_text(json.dumps(record))

    # -------------------------------------------------------------------------------- start

    @classmethod
    def start(cls, folder: str | os.PathLike[str], settings: MlflowSettings | None, *, name: str,
              overrides: Sequence[str], launcher: str, search: str | None = None,
              size: int | None = None) -> Sweep:
        """The sweep folder and, when recording is on, the parent run. `search`: the direction of a
        search (its best trial is tagged on the parent at the end); `size`: how many jobs, when known."""
        from ember.provenance import environment_tags

        sweep = cls(folder)
        sweep.folder.mkdir(parents=True, exist_ok=True)
        os.environ.pop(PARENT_RUN_ENV, None)
        os.environ[SWEEP_SIZE_ENV] = str(size or "")
        record: dict[str, Any] = {"run_id": None, "tracking_uri": "", "size": size}
        if settings is not None and settings.enabled:
            store = resolve_store(settings)
            tracker = Tracker(store, settings.experiment_name)  # a refusal stops the sweep before any job
            tags = {**environment_tags(), **SOURCE_TAGS, "ember.sweep": "true",
                    "ember.sweep_dir": str(sweep.folder), "ember.launcher": launcher.rsplit(".", 1)[-1]}
            run_id = tracker.start_run(name, tags)
            tracker.log_params(run_id, {"hydra.overrides": " ".join(overrides), "hydra.launcher": launcher})
            record.update(run_id=run_id, tracking_uri=store.tracking_uri, experiment_id=tracker.experiment_id)
            if search:
                record["search"] = search
            os.environ[PARENT_RUN_ENV] = run_id
        sweep._write(record)
        os.environ[OPEN_SWEEP_ENV] = f"{os.getpid()}:{sweep.folder}"  # this process's, not its children's
        return sweep

    @property
    def run_id(self) -> str | None:
        record = self.record()
        return str(record["run_id"]) if record and record.get("run_id") else None

    def job_environment(self) -> dict[str, str]:
        """What every job needs from the process that started the sweep: the parent run, its store, the
        sweep size (to be set in each job's environment, wherever it runs)."""
        record = self.record() or {}
        env = {SWEEP_SIZE_ENV: str(record.get("size") or "")}
        if record.get("run_id"):
            env.update({PARENT_RUN_ENV: str(record["run_id"]), SWEEP_STORE_ENV: str(record["tracking_uri"])})
        return env

    # -------------------------------------------------------------------------------- this process

    @classmethod
    def opened_here(cls) -> Sweep | None:
        """The sweep this process started and has not forgotten (a child process inherits the variable,
        but not the sweep: it names the pid that opened it)."""
        pid, _, folder = os.environ.get(OPEN_SWEEP_ENV, "").partition(":")
        return cls(folder) if folder and pid == str(os.getpid()) else None

    def forget(self) -> None:
        if os.environ.get(OPEN_SWEEP_ENV) == f"{os.getpid()}:{self.folder}":
            os.environ.pop(OPEN_SWEEP_ENV, None)

    @property
    def summary(self) -> SweepSummary | None:
        """How the sweep closed, once `finish` has run."""
        kept = (self.record() or {}).get("summary")
        if kept is None:
            return None
        return SweepSummary(**{**kept, "failed_jobs": tuple(kept["failed_jobs"]),
                               "retried_jobs": tuple(kept["retried_jobs"])})

    # -------------------------------------------------------------------------------- finish

    def finish(self, *, interrupted: bool = False, error: str | None = None, all_returned: bool = False,
               summarize: Summarize | None = None) -> SweepSummary:
        """Close the sweep: every job that did not finish is named; the parent run ends KILLED on
        interruption, FAILED if any job failed, died or left no run, else FINISHED.

        What each job became is read from the child runs in the parent's store (jobs on every node
        record there) and, for jobs that ran on this machine, from the status files in their folders.
        A job may have several child runs: a launcher that retries a job whose worker died (Ray) starts
        it again as a new run. The last attempt decides; the earlier ones are named as retried.

        A child run still RUNNING is closed as KILLED when nobody can be writing it any more: when the
        launcher returned every job (`all_returned`, the normal end), or when its process is gone (a
        heartbeat check, `ember.records.heartbeat`). After a launcher crash or Ctrl-C, a job a cluster
        still runs (a SLURM task outlives the command that submitted it) is left alone and named as still
        running. `summarize` (when given) summarizes the children in the parent; its failure is noted in
        a tag, never in the way of closing.
        """
        local = _job_statuses(self.folder)
        best = None
        problems = {num: f"{status.lower()}: {detail}" if detail else status.lower()
                    for num, (status, detail) in local.items() if status != FINISHED}
        overrides = {num: _job_overrides(self.folder / num) for num in local}
        retried: dict[str, str] = {}
        jobs = set(local)
        record = self.record() if self.folder.exists() else None
        parent = record if record is not None and record.get("run_id") else None
        if parent is not None and not parent.get("closed"):
            tracker = Tracker.attach(Store(parent["tracking_uri"]), parent["experiment_id"])
            jobs.update(str(n) for n in range(int(parent.get("size") or 0)))
            try:
                attempts: Attempts | None = _attempts_by_job(tracker.client, parent, all_returned)
            except Exception as failure:  # the store is away: the job status files still tell the story
                if not outbox.unreachable(failure, parent["tracking_uri"]):
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
            if parent.get("search") and attempts is not None:
                best = _tag_best_trial(tracker, parent, attempts, overrides)
            failed_jobs = _describe_jobs(problems, overrides)
            if attempts is not None and summarize is not None:
                _summarize(summarize, tracker, parent)
            child_runs = "unknown" if attempts is None else str(sum(len(runs) for runs in attempts.values()))
            tags = {"ember.sweep.jobs": str(len(jobs)), "ember.sweep.child_runs": child_runs,
                    "ember.sweep.failed_jobs": "; ".join(failed_jobs) or "none",
                    "ember.sweep.retried_jobs": "; ".join(_describe_jobs(retried, overrides)) or "none"}
            if error:
                tags["ember.sweep.error"] = error
            tracker.set_tags(parent["run_id"], tags)
            status = KILLED if interrupted else FAILED if (problems or error) else FINISHED
            tracker.end_run(parent["run_id"], status)
            parent["closed"] = status
        summary = SweepSummary(parent["run_id"] if parent else None, len(jobs),
                               _describe_jobs(problems, overrides), _describe_jobs(retried, overrides), best,
                               parent["tracking_uri"] if parent else "", error)
        if record is not None:
            self._write({**record, **(parent or {}), "summary": asdict(summary)})
        return summary


# ------------------------------------------------------------------------------------ a job's side


def parent_run_id(sweep_dir: str | os.PathLike[str] | None) -> str | None:
    """The sweep's parent run: from the sweep folder, else from the environment (handed over)."""
    if sweep_dir is not None:
        run_id = Sweep(sweep_dir).run_id
        if run_id is not None:
            return run_id
    return os.environ.get(PARENT_RUN_ENV)


def handed_over_store() -> str | None:
    """The store of the sweep's parent run, where every job of the sweep records."""
    return os.environ.get(SWEEP_STORE_ENV) or None


def handed_over_size() -> str:
    """How many jobs the sweep has, as handed over ("" when unknown)."""
    return os.environ.get(SWEEP_SIZE_ENV, "")


def write_job_status(job_dir: str | os.PathLike[str], status: str, detail: str = "") -> None:
    """What one job ended as, in its own folder (read back by `Sweep.finish`)."""
    Path(job_dir).mkdir(parents=True, exist_ok=True)
    (Path(job_dir) / JOB_STATUS_FILE).write_text(json.dumps({"status": status, "detail": detail}))


# ------------------------------------------------------------------------------------ closing


def _summarize(summarize: Summarize, tracker: Any, record: Mapping[str, Any]) -> None:
    try:
        summarize(tracker, record["experiment_id"], record["run_id"])
    except Exception as error:
        log.warning("ember: could not summarise the sweep in its parent run: %s", error)
        detail = clip(f"{type(error).__name__}: {error}", MAX_TAG_LENGTH)
        try:  # the parent is still closed below, whatever this tag meets
            tracker.set_tags(record["run_id"], {"ember.sweep.summary_error": detail})
        except Exception as again:
            log.warning("ember: could not tag the parent run with that: %s", again)


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
    writer is gone (see `Sweep.finish`) is closed as KILLED here."""
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
