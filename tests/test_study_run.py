"""Studies through `python -m ember.run` on SmolLM2, checked in the MLflow store they write: the
dataset input, the per-item table, aggregates with their intervals, the sweep parent's summary, and
mistakes in the prompt-set config."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from run_support import prepared_store

from ember import run as runner


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, smollm2_path):
    path = tmp_path_factory.mktemp("ember_study")
    prepared_store(path / "outputs")
    saved = os.getcwd()
    os.chdir(path)
    yield path
    os.chdir(saved)


@pytest.fixture(autouse=True)
def _no_outside_store(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def client(workdir: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"sqlite:///{workdir / 'outputs' / 'mlflow.db'}")


def runs_of(workdir: Path, experiment: str) -> list:
    mlflow = client(workdir)
    found = mlflow.get_experiment_by_name(experiment)
    assert found is not None
    return mlflow.search_runs([found.experiment_id], max_results=100)


def table(workdir: Path, run, path: str) -> dict:
    target = workdir / "downloads" / run.info.run_id
    target.mkdir(parents=True, exist_ok=True)
    local = client(workdir).download_artifacts(run.info.run_id, path, str(target))
    return json.loads(Path(local).read_text())


def steps(workdir: Path, run, key: str) -> dict[int, float]:
    return {m.step: m.value for m in client(workdir).get_metric_history(run.info.run_id, key)}


def main(*args: str) -> int:
    return runner.main([*args, "threads=1"])


def test_a_prompt_set_is_evaluated_item_by_item(workdir, capsys, monkeypatch):
    from ember.runs import study

    monkeypatch.setattr(study, "PROGRESS_DELAY", 0.0)  # progress from the first item, however fast
    code = main("data=capitals", "data.limit=4", "max_new_tokens=3", "mlflow.experiment_name=t_study")
    assert code == 0
    [run] = runs_of(workdir, "t_study")
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "generate capitals×4 smollm2-135m"
    # the prompt set is the run's dataset input (the UI's Datasets column)
    [dataset_input] = run.inputs.dataset_inputs
    dataset = dataset_input.dataset
    assert dataset.name == "capitals" and len(dataset.digest) == 12 and dataset.source_type == "local"
    assert json.loads(dataset.source)["uri"].endswith("capitals.jsonl")
    assert json.loads(dataset.profile) == {"num_rows": 4}
    assert {t.key: t.value for t in dataset_input.tags}["mlflow.data.context"] == "eval"
    # per-item rows as MLflow's table artifact, which the run's loggedArtifacts tag names
    logged = json.loads(run.data.tags["mlflow.loggedArtifacts"])
    assert {"path": "study/items.json", "type": "table"} in logged
    items = table(workdir, run, "study/items.json")
    assert len(items["data"]) == 4
    columns = items["columns"]
    for name in ("item", "prompt", "answer", "generated", "answer.prob", "answer.rank", "answer.correct",
                 "answer.logit_diff"):
        assert name in columns
    first = dict(zip(columns, items["data"][0], strict=True))
    assert first["prompt"] == "The capital of France is" and first["generated"].startswith(" Paris")
    # aggregates: mean, standard error and the 95% interval
    metrics = run.data.metrics
    assert metrics["study.items"] == 4
    for name in ("answer.prob", "answer.correct", "answer.logit_diff"):
        assert metrics[f"{name}.ci_low"] <= metrics[name] <= metrics[f"{name}.ci_high"]
        assert metrics[f"{name}.se"] >= 0
    assert 0 < metrics["answer.prob"] <= 1
    assert metrics["study.runner_seconds"] >= 0 and metrics["study.engine_seconds"] > 0
    assert run.data.tags["ember.study.key_metrics"] == "answer.prob,answer.correct,answer.logit_diff"
    # the console ends with a summary
    err = capsys.readouterr().err
    assert "study of 4 items of capitals" in err and "answer.prob: " in err and "95% CI" in err
    assert "capitals: 4 items: 2/4, ETA" in err


def test_per_layer_series_and_interventions(workdir):
    assert main("data=capitals", "data.limit=2", "experiment=logit_lens",
                "mlflow.experiment_name=t_lens") == 0
    [run] = runs_of(workdir, "t_lens")
    prob = steps(workdir, run, "logit_lens.target_prob")
    assert sorted(prob) == list(range(30))
    assert steps(workdir, run, "logit_lens.target_prob.ci_high")[29] >= prob[29]
    paths = {a.path for a in client(workdir).list_artifacts(run.info.run_id, "study")}
    assert "study/logit_lens.target_prob.png" in paths
    assert main("data=capitals", "data.limit=3", "experiment=ablation", "layer=3",
                "experiments.0.mode=mean", "max_new_tokens=2", "mlflow.experiment_name=t_ablate") == 0
    [run] = runs_of(workdir, "t_ablate")
    metrics = run.data.metrics
    for name in ("effect.kl_mean", "effect.top1_agreement", "answer.logit_diff_delta", "answer.prob_delta",
                 "clean.answer.prob"):
        assert name in metrics, name
    assert metrics["effect.kl_mean"] > 0
    means = table(workdir, run, "experiments/ablation/means.json")
    assert {row["site"] for row in means} == {"attention", "mlp"}


def test_inline_items_and_prompt_still_work(workdir):
    assert main("data=inline", "data.items=[Once upon a time,The weather today is]", "max_new_tokens=2",
                "mlflow.experiment_name=t_inline") == 0
    [run] = runs_of(workdir, "t_inline")
    assert run.inputs.dataset_inputs[0].dataset.source_type == "code"
    assert run.data.metrics["study.items"] == 2
    assert main("prompt=Hello there", "max_new_tokens=2", "mlflow.experiment_name=t_prompt") == 0
    [run] = runs_of(workdir, "t_prompt")
    assert "study.items" not in run.data.metrics and run.info.run_name == "generate smollm2-135m"


def test_a_sweep_parent_summarises_its_children(workdir):
    assert main("-m", "data=capitals", "data.limit=2", "experiment=ablation", "layer=1,4", "max_new_tokens=2",
                "mlflow.experiment_name=t_sweep") == 0
    runs = runs_of(workdir, "t_sweep")
    [parent] = [r for r in runs if r.data.tags.get("ember.sweep") == "true"]
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["ember.sweep.swept"] == "layer"
    summary = table(workdir, parent, "sweep/summary.json")
    rows = [dict(zip(summary["columns"], row, strict=True)) for row in summary["data"]]
    assert [row["layer"] for row in rows] == ["1", "4"]
    assert all(row["status"] == "FINISHED" for row in rows)
    children = {r.data.tags["ember.job"]: r for r in runs if r.info.run_id != parent.info.run_id}
    for row in rows:
        child = children[str(row["job"])]
        assert row["effect.kl_mean"] == pytest.approx(child.data.metrics["effect.kl_mean"])
        assert row["effect.kl_mean.ci_low"] <= row["effect.kl_mean"] <= row["effect.kl_mean.ci_high"]
    assert steps(workdir, parent, "effect.kl_mean") == {
        1: pytest.approx(rows[0]["effect.kl_mean"]), 4: pytest.approx(rows[1]["effect.kl_mean"])}
    paths = {a.path for a in client(workdir).list_artifacts(parent.info.run_id, "sweep")}
    assert {"sweep/effect.kl_mean.png", "sweep/summary.json"} <= paths


@pytest.mark.parametrize(("args", "message"), [
    (["data=file", "data.path=nowhere.jsonl"], "data.path=nowhere.jsonl: .* does not exist"),
    (["data=capitals", "data.limit=0"], "data.limit must be a positive integer"),
    (["data=sentiment", "experiment=activation_patching"], "patching needs equal lengths"),
    (["data=inline", "experiment=activation_patching"], "has no corrupted, wrong_answer"),
    (["data=capitals", "experiment=steering", "experiments.0.layers=3", "data.limit=2"],
     None),  # capitals has pairs: a direction can be made (country vs country)
])
def test_prompt_set_mistakes_end_with_one_line(workdir, capsys, args, message):
    code = main(*args, "max_new_tokens=1", "mlflow=off")
    err = capsys.readouterr().err
    if message is None:
        assert code == 0, err
        return
    assert code == 2, err
    assert "Traceback" not in err
    import re

    assert re.search(message, err), err


def test_an_interrupted_study_keeps_the_items_it_did(workdir):
    from run_support import InterruptAfterItems

    InterruptAfterItems.started = 0
    code = main("data=capitals", "data.limit=5", "max_new_tokens=1", "mlflow.experiment_name=t_interrupt",
                "experiments=[{_target_:run_support.InterruptAfterItems,items:2}]")
    assert code == 130
    [run] = runs_of(workdir, "t_interrupt")
    assert run.info.status == "KILLED"
    assert run.data.metrics["study.items"] == 2
    assert len(table(workdir, run, "study/items.json")["data"]) == 2
