"""The cluster pieces that need no cluster: what a job learns from its scheduler (placement, threads),
what a sweep hands to its jobs, a search's objective, one-line tracking refusals, the tags of a sweep's
child runs. The real Ray / submitit / Optuna / PostgreSQL runs are in test_cluster.py (slow)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf
from run_support import prepared_store

from ember import run as runner
from ember.cores import ThreadChoice
from ember.errors import ConfigError
from ember.records.store import CredentialsInUriError, describe_mlflow_error, resolve_store
from ember.records.sweep import SWEEP_FILE, SWEEP_STORE_ENV, Sweep, handed_over_store
from ember.records.tracker import FINISHED, KILLED, Tracker
from ember.runconfig import settings_from_config
from ember.runs import placement, sweep_callback
from ember.runs.job import JobInfo, threads_for
from ember.runs.objective import TrialFailed, parse_objective

REPO = Path(__file__).resolve().parent.parent
CORES = len(os.sched_getaffinity(0))


@pytest.fixture(autouse=True)
def _clean_scheduler_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("SLURM_", "SUBMITIT_")):
            monkeypatch.delenv(name)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv(SWEEP_STORE_ENV, raising=False)


# ------------------------------------------------------------------------------------ placement


def test_a_run_of_its_own_gets_every_core():
    place = placement.detect()
    assert place.scheduler == "local" and place.cpus == CORES and place.pid == os.getpid()
    assert place.tags()["ember.host"] == place.host and not place.remote


def test_a_slurm_task_uses_its_allocation_and_is_tagged_with_its_ids(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "4240")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "2")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "1")
    monkeypatch.setenv("SLURMD_NODENAME", "node-7")
    place = placement.detect()
    assert place.scheduler == "slurm" and place.cpus == 1 and place.remote
    tags = place.tags()
    assert tags["ember.scheduler.job_id"] == "4242" and tags["ember.scheduler.array_task_id"] == "2"
    assert tags["ember.scheduler.node"] == "node-7" and tags["ember.scheduler.cpus"] == "1"
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "64")  # never more than the cores this process may use
    assert placement.detect().cpus == CORES


def test_submitit_local_jobs_share_the_cores_out(monkeypatch):
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")
    monkeypatch.setenv("SUBMITIT_LOCAL_JOB_ID", "123")
    place = placement.detect(sweep_size=4)
    assert place.scheduler == "submitit_local" and place.cpus == max(1, CORES // min(4, CORES))
    assert place.ids == {"job_id": "123"}
    assert placement.detect(sweep_size=1).cpus == CORES


def test_threads_follow_the_grant_unless_the_config_says():
    job = JobInfo(True, 0, (), None, None, 2, placement.Placement("joblib", "h", 1, 1))
    assert threads_for(job, None) == ThreadChoice(1, "granted by joblib")
    assert threads_for(job, 2) == ThreadChoice(2, "asked for")


# ------------------------------------------------------------------------------------ hand-over


def test_a_sweep_hands_its_parent_store_and_size_to_the_jobs_as_hydra_overrides(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        config = compose("config", overrides=["layer=1"], return_hydra_config=True)
    sweep_dir = tmp_path / "sweep"
    OmegaConf.update(config, "hydra.sweep.dir", "sweep")
    sweep_dir.mkdir()
    uri = "sqlite:////tmp/it's here/mlflow.db"
    (sweep_dir / SWEEP_FILE).write_text(
        f'{{"run_id": "abc123", "tracking_uri": "{uri}", "experiment_id": "1", "size": 12}}')
    sweep_callback.hand_over_to_jobs(config, Sweep(sweep_dir))
    parsed = OverridesParser.create().parse_overrides(list(config.hydra.overrides.hydra))
    values = {o.key_or_group: o.value() for o in parsed}
    assert values["hydra.job.env_set.EMBER_MLFLOW_PARENT_RUN_ID"] == "abc123"
    assert values["hydra.job.env_set.EMBER_SWEEP_TRACKING_URI"] == uri
    assert values["hydra.job.env_set.EMBER_SWEEP_SIZE"] == "12"
    assert values["hydra.sweep.dir"] == str(sweep_dir), "a Ray worker starts elsewhere: made absolute"


def test_a_sweep_job_records_where_its_parent_is(monkeypatch):
    from ember.runconfig import MlflowSettings

    settings = MlflowSettings(tracking_uri=None, experiment_name="e", enabled=True)
    monkeypatch.setenv(SWEEP_STORE_ENV, "http://127.0.0.1:5999")
    assert resolve_store(settings, handed_over=handed_over_store()).tracking_uri == "http://127.0.0.1:5999"
    assert resolve_store(settings).tracking_uri.startswith("sqlite:///")


# ------------------------------------------------------------------------------------ objective


def objective(**section):
    return parse_objective(OmegaConf.create({"objective": section}))


def test_an_objective_with_a_requirement_prefers_the_smallest_value_that_meets_it():
    spec = objective(value=1.5, require={"metric": "effect.answer_changed", "at_least": 0.8}, penalty=10.0)
    assert spec.evaluate({"effect.answer_changed": 1.0}) == (1.5, True)
    value, met = spec.evaluate({"effect.answer_changed": 0.0})
    assert not met and value == pytest.approx(1.5 + 10.0 * 1.8)
    assert objective(metric="effect.kl_mean").evaluate({"effect.kl_mean": 0.25}) == (0.25, True)
    maximized = parse_objective(OmegaConf.create({"objective": {"value": 2.0, "require": {
        "metric": "m", "at_least": 1.0}}}), "maximize")
    assert maximized.evaluate({"m": 0.0})[0] == pytest.approx(2.0 - 20.0)


def test_objective_mistakes_are_named():
    assert parse_objective(OmegaConf.create({"objective": None})) is None
    with pytest.raises(ConfigError, match="exactly one of 'metric'"):
        objective(metric="a", value=1.0)
    with pytest.raises(ConfigError, match="unknown key objective.direction"):
        objective(metric="a", direction="minimize")
    with pytest.raises(ConfigError, match="objective.require must be"):
        objective(value=1.0, require={"metric": "a"})
    with pytest.raises(TrialFailed, match="no metric 'effect.kl_mean'"):
        objective(metric="effect.kl_mean").evaluate({"tokens.generated": 2.0})


def test_a_lost_job_of_the_shipped_search_is_a_failed_trial_not_a_value():
    from hydra.core.utils import JobStatus

    from hydra_plugins.ember_launchers.lost import EXIT_FAILED, WorkerLost, lost_job

    search = OmegaConf.load(REPO / "conf" / "search" / "steering_flip.yaml")  # objective.value, no metric
    lost = lost_job(3, ["experiments.0.scale=2.5"], search, "its Ray worker died: killed")
    assert lost.status is JobStatus.FAILED  # what the Optuna sweeper records as TrialState.FAIL
    with pytest.raises(WorkerLost, match="job #3: its Ray worker died: killed"):
        lost.return_value  # noqa: B018 (the sweeper reads it so)
    grid = OmegaConf.create({"layer": 1})
    lost = lost_job(0, ["layer=1"], grid, "its Ray worker died: killed")
    assert lost.status is JobStatus.COMPLETED and lost.return_value == EXIT_FAILED


# ------------------------------------------------------------------------------------ refusals


def test_a_refusal_is_one_line_without_the_credentials(monkeypatch):
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import PERMISSION_DENIED, UNAUTHENTICATED

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "s3cret-pass")
    refused = MlflowException("API request failed with error code 401 != 200.\nResponse body: '...'",
                              error_code=UNAUTHENTICATED)
    text = describe_mlflow_error(refused, "http://127.0.0.1:5999")
    assert "\n" not in text and "s3cret" not in text and "alice" not in text
    assert "refused the credentials in MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD" in text
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD")
    assert "asks for credentials" in describe_mlflow_error(refused, "http://x")
    denied = MlflowException("denied", error_code=PERMISSION_DENIED)
    assert "EDIT permission" in describe_mlflow_error(denied, "http://x")


@pytest.mark.parametrize("args, env", [
    (["mlflow.tracking_uri=http://alice:s3cret-pass@127.0.0.1:5999"], {}),
    (["-m", "layer=0,1", "mlflow.tracking_uri=http://alice:s3cret-pass@127.0.0.1:5999"], {}),
    (["-m", "layer=0,1"], {"MLFLOW_TRACKING_URI": "http://alice:s3cret-pass@127.0.0.1:5999"}),
])
def test_a_tracking_uri_with_credentials_is_refused_before_anything_is_written(
        tmp_path, monkeypatch, capsys, args, env):
    monkeypatch.chdir(tmp_path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert runner.main([*args, "max_new_tokens=1"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "ember: the tracking URI http://127.0.0.1:5999 has credentials in it, which ember would record with "
        "the runs: give the URI without them and the credentials in MLFLOW_TRACKING_USERNAME and "
        "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN)"], err
    assert list(tmp_path.iterdir()) == [], "no sweep folder, no store, no Hydra files"


def test_every_store_a_job_records_to_is_checked_for_credentials(monkeypatch):
    from ember.runconfig import MlflowSettings

    settings = MlflowSettings(tracking_uri="postgresql://mlflow:pg-pass@db:5432/mlflow",
                              experiment_name="e", enabled=True)
    with pytest.raises(CredentialsInUriError, match="PGPASSWORD") as refused:
        resolve_store(settings)
    assert "pg-pass" not in str(refused.value) and "postgresql://db:5432/mlflow" in str(refused.value)
    monkeypatch.setenv(SWEEP_STORE_ENV, "https://token@mlflow.example")  # handed to a sweep job
    with pytest.raises(CredentialsInUriError, match="https://mlflow.example has credentials"):
        resolve_store(MlflowSettings(None, "e", True), handed_over=handed_over_store())
    assert resolve_store(MlflowSettings("postgresql://mlflow@db/mlflow", "e", True)).tracking_uri


# ------------------------------------------------------------------------------------ tags


def test_every_child_run_says_where_it_ran(tmp_path, monkeypatch, smollm2_path):
    prepared_store(tmp_path / "outputs")
    monkeypatch.chdir(tmp_path)
    assert runner.main(["-m", "layer=0,1", "experiment=zero_layer", "max_new_tokens=1",
                        "mlflow.experiment_name=t_where"]) == 0
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("t_where")
    runs = client.search_runs([experiment.experiment_id])
    parent = next(r for r in runs if r.data.tags.get("ember.sweep") == "true")
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 2 and parent.data.tags["ember.sweep.retried_jobs"] == "none"
    for child in children:
        tags = child.data.tags
        assert tags["ember.scheduler"] == "local" and tags["ember.pid"] == str(os.getpid())
        assert tags["ember.host"] and tags["ember.scheduler.cpus"] == str(CORES)


# ------------------------------------------------------------------------------------ closing a sweep


def sweep_config(sweep_dir: Path, name: str):
    return OmegaConf.create({
        "hydra": {"sweep": {"dir": str(sweep_dir)}, "overrides": {"task": ["layer=0,1,2"]},
                  "launcher": {"_target_": "hydra_plugins.ember_launchers.ray_launcher.EmberRayLauncher"}},
        "mlflow": {"tracking_uri": None, "experiment_name": name, "enabled": True},
        "model": {"source": "smollm2-135m"},
    })


def test_closing_a_sweep_judges_each_job_by_its_last_attempt(tmp_path, monkeypatch):
    prepared_store(tmp_path / "outputs")
    monkeypatch.chdir(tmp_path)
    sweep_dir = tmp_path / "sweep"
    sweep = sweep_callback.start(sweep_config(sweep_dir, "closing"), 3)
    parent = sweep.run_id
    store = resolve_store(settings_from_config(sweep_config(sweep_dir, "closing")))
    tracker = Tracker(store, "closing")
    done = {}
    for num, status in (("0", FINISHED), ("1", KILLED), ("1", FINISHED)):
        tags = {"ember.job": num, "ember.overrides": f"layer={num}"}
        run_id = tracker.start_run(f"job {num}", tags, parent)
        tracker.end_run(run_id, status)
        done.setdefault(num, []).append(run_id)
    # Job 2's run is open, and its process (this one) alive: after a launcher crash it may still be
    # running somewhere (a SLURM task outlives its submitter), so it is named, not closed.
    open_run = tracker.start_run("job 2", {"ember.job": "2", "ember.overrides": "layer=2"}, parent)
    summary = sweep_callback.finish(sweep, error="the sweep stopped before its end")
    assert [line.split(" (")[0] for line in summary.failed_jobs] == ["job #2"]
    assert summary.error == "the sweep stopped before its end" and not summary.ok
    assert "still running" in summary.failed_jobs[0]
    assert summary.retried_jobs == (f"job #1 (layer=1): retried: attempt 1 killed (run {done['1'][0]} on "
                                    f"{placement.detect().host}, pid {os.getpid()}); attempt 2 finished",)
    assert tracker.client.get_run(open_run).info.status == "RUNNING"
    parent_run = tracker.client.get_run(parent)
    assert parent_run.info.status == "FAILED" and parent_run.data.tags["ember.sweep.child_runs"] == "4"
    sweep.forget()

    # At a normal end every job has returned: a run still open has nobody left to close it.
    sweep_dir2 = tmp_path / "sweep2"
    sweep2 = sweep_callback.start(sweep_config(sweep_dir2, "closing"), 1)
    parent2 = sweep2.run_id
    left_open = tracker.start_run("job 0", {"ember.job": "0", "ember.overrides": "layer=0"}, parent2)
    summary = sweep_callback.finish(sweep2, all_returned=True)
    assert tracker.client.get_run(left_open).info.status == "KILLED"
    assert "killed: its process died without closing its run" in summary.failed_jobs[0]
    sweep2.forget()
