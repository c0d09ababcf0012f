"""ember.records and ember.provenance without a model: store choice, params/tags/metrics/artifacts,
sweep parent runs and how a sweep is closed when jobs fail or die."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf
from run_support import prepared_store

from ember.experiments import ExperimentFailure, ExperimentResult, Metric
from ember.experiments.context import ExecutionPhase
from ember.provenance import config_digest, environment_tags, flatten
from ember.records.store import Store, resolve_store
from ember.records.sweep import PARENT_RUN_ENV, parent_run_id, write_job_status
from ember.records.tracker import FAILED, FINISHED, Tracker, log_experiment_result
from ember.records.values import MAX_PARAM_LENGTH, failure_record, failure_tags
from ember.runconfig import MlflowSettings
from ember.runs import sweep_callback


@pytest.fixture(autouse=True)
def _no_outside_store(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv(PARENT_RUN_ENV, raising=False)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tracking")
    prepared_store(path / "outputs")
    return path


def settings(uri: str | None = None, name: str = "t") -> MlflowSettings:
    return MlflowSettings(tracking_uri=uri, experiment_name=name, enabled=True)


def test_store_precedence_config_then_environment_then_outputs(tmp_path, monkeypatch):
    default = resolve_store(settings(), tmp_path)
    assert default.tracking_uri == f"sqlite:///{tmp_path.resolve()}/outputs/mlflow.db"
    assert default.artifact_root == (tmp_path.resolve() / "outputs" / "mlartifacts").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:1")
    assert resolve_store(settings(), tmp_path) == Store("http://127.0.0.1:1")
    assert resolve_store(settings("sqlite:///x.db"), tmp_path).tracking_uri == "sqlite:///x.db"


def test_flatten_and_config_digest():
    config = {"model": {"source": "m", "family": None}, "experiments": [{"name": "a", "layer": 3}],
              "messages": [], "mlflow": {"tracking_uri": None}}
    assert flatten(config) == {"model.source": "m", "model.family": None, "experiments.0.name": "a",
                               "experiments.0.layer": 3, "messages": "[]", "mlflow.tracking_uri": None}
    digest = config_digest(config)
    assert digest == config_digest({**config, "mlflow": {"tracking_uri": "http://elsewhere"}})
    assert digest != config_digest({**config, "experiments": [{"name": "a", "layer": 4}]})


def test_environment_tags_name_versions_and_commit():
    tags = environment_tags()
    assert tags["numpy.version"] == np.__version__
    assert tags["ember.git_dirty"] in ("true", "false", "unknown")
    assert len(tags["ember.git_commit"]) == 40 or tags["ember.git_commit"] == "unknown"


def test_tracker_records_and_closes_a_run(store_dir):
    tracker = Tracker(resolve_store(settings(name="records"), store_dir), "records")
    run_id = tracker.start_run("a run", {"k": "v"})
    tracker.log_params(run_id, {f"p{i}": i for i in range(150)} | {"long": "x" * 7000})
    tracker.log_metrics(run_id, [("series", float(i * i), i) for i in range(5)])
    result = ExperimentResult(
        metrics=[Metric("rms", 2.0, 3), Metric("bad", float("nan"))],
        tables={"rows": [{"layer": 0, "value": 1.5}, {"layer": 1, "value": 2.5}]},
        arrays={"grid": np.arange(6.0).reshape(2, 3)},
    )
    log_experiment_result(tracker, run_id, "probe", result)
    failure = ExperimentFailure("probe", "after_mlp", "boom", phase=ExecutionPhase.DECODE, layer=2)
    record = failure_record(failure, None)
    tracker.log_json(run_id, record, "failure.json")
    tracker.set_tags(run_id, failure_tags(record))
    tracker.end_run(run_id, FAILED)

    run = tracker.client.get_run(run_id)
    assert run.info.status == "FAILED" and run.info.run_name == "a run"
    assert len(run.data.params) == 151 and len(run.data.params["long"]) == MAX_PARAM_LENGTH
    history = tracker.client.get_metric_history(run_id, "series")
    assert [(m.step, m.value) for m in history] == [(i, float(i * i)) for i in range(5)]
    assert run.data.metrics["probe.rms"] == 2.0 and "probe.bad" not in run.data.metrics
    assert run.data.tags["ember.failure.hook"] == "after_mlp"
    assert run.data.tags["ember.failure.phase"] == "decode" and run.data.tags["ember.failure.layer"] == "2"
    assert record["description"] == "experiment 'probe' failed in after_mlp (phase=decode, layer=2): boom"
    folder = Path(tracker.client.download_artifacts(run_id, "", str(store_dir / "dl")))
    assert json.loads((folder / "experiments/probe/rows.json").read_text())[1] == {"layer": 1, "value": 2.5}
    assert (folder / "experiments/probe/rows.csv").read_text().splitlines()[0] == "layer,value"
    assert np.array_equal(np.load(folder / "experiments/probe/grid.npy"), np.arange(6.0).reshape(2, 3))
    assert json.loads((folder / "failure.json").read_text())["layer"] == 2


def test_sweep_parent_names_failed_and_dead_jobs(store_dir, monkeypatch):
    monkeypatch.chdir(store_dir)
    sweep_dir = store_dir / "sweep"
    config = OmegaConf.create({
        "hydra": {"sweep": {"dir": str(sweep_dir)}, "overrides": {"task": ["layer=0,1,2"]},
                  "launcher": {"_target_": "hydra._internal.core_plugins.basic_launcher.BasicLauncher"}},
        "mlflow": {"tracking_uri": None, "experiment_name": "sweeps", "enabled": True},
        "model": {"source": "smollm2-135m"},
    })
    sweep = sweep_callback.start(config)
    parent = sweep.run_id
    assert parent and parent_run_id(sweep_dir) == parent
    tracker = Tracker(resolve_store(settings(name="sweeps")), "sweeps")
    for num, status in (("0", FINISHED), ("1", FAILED)):
        child = tracker.start_run(f"job {num}", {"ember.job": num}, parent)
        tracker.end_run(child, status)
        write_job_status(sweep_dir / num, status, "boom" if status == FAILED else "")
    (sweep_dir / "2").mkdir()  # started, never reported, no run: a job that died

    summary = sweep_callback.finish(sweep)
    assert summary.jobs == 3 and not summary.ok
    assert [line.split(" (")[0] for line in summary.failed_jobs] == ["job #1", "job #2"]
    assert "failed: boom" in summary.failed_jobs[0] and "died" in summary.failed_jobs[1]
    run = tracker.client.get_run(parent)
    assert run.info.status == "FAILED"
    assert run.data.tags["ember.sweep.child_runs"] == "2"
    assert "job #2" in run.data.tags["ember.sweep.failed_jobs"]
    assert run.info.run_name == "sweep[layer=0,1,2] smollm2-135m"
    assert sweep.summary == summary, "kept in the sweep file, for the process that started the sweep"
    sweep.forget()


def test_recording_off_has_the_same_methods_and_writes_nothing():
    from ember.records.run import NullRecord, RunRecord, open_run

    def public(cls) -> dict[str, object]:
        return {name: inspect.signature(member) for name, member in vars(cls).items()
                if callable(member) and not name.startswith("_")}

    assert public(NullRecord) == public(RunRecord)
    off = open_run(MlflowSettings(None, "off", enabled=False), "a run", {})
    assert isinstance(off, NullRecord) and off.run_id is None and off.waiting() is None
    off.log_metrics([("m", 1.0, 0), ("m", 2.0, 3)])
    off.result("probe", ExperimentResult(metrics=[Metric("rms", 2.0, 3)]))
    assert off.metrics == {"m": 1.0, "probe.rms": 2.0}, "metrics are remembered with recording off too"
    with pytest.raises(AttributeError):
        off.log_metric([("m", 1.0, 0)])  # a misspelt method fails, recording on or off


def test_a_table_tag_deferred_goes_with_the_next_batch_or_the_close(store_dir):
    tracker = Tracker(resolve_store(settings(name="batch"), store_dir), "batch")
    run_id = tracker.start_run("batched", {})
    tracker.log_table(run_id, {"a": [1, 2]}, "study/items.json", tag=False)
    tracker.log_table(run_id, {"b": [3]}, "study/summary.json", tag=False)
    assert "mlflow.loggedArtifacts" not in tracker.client.get_run(run_id).data.tags
    tracker.log_batch(run_id, [("m", float(i), i) for i in range(1500)], {"t": "v"})
    run = tracker.client.get_run(run_id)
    assert [t["path"] for t in json.loads(run.data.tags["mlflow.loggedArtifacts"])] == [
        "study/items.json", "study/summary.json"]
    assert run.data.tags["t"] == "v" and len(tracker.client.get_metric_history(run_id, "m")) == 1500
    other = tracker.start_run("closed", {})
    tracker.log_table(other, {"a": [1]}, "t.json", tag=False)
    tracker.end_run(other, FINISHED)
    assert json.loads(tracker.client.get_run(other).data.tags["mlflow.loggedArtifacts"]) == [
        {"path": "t.json", "type": "table"}]
    tracker.end_run(run_id, FINISHED)
