"""Studies through `python -m ember.run` on SmolLM2, checked in the MLflow store they write: the
dataset input, the per-item table, aggregates with their intervals, the sweep parent's summary, and
mistakes in the prompt-set config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from run_support import runs_of
from run_support import store_client as client

from ember import run as runner

pytestmark = pytest.mark.usefixtures("no_outside_store")


def table(workdir: Path, run, path: str) -> dict:
    target = workdir / "downloads" / run.info.run_id
    target.mkdir(parents=True, exist_ok=True)
    local = client(workdir).download_artifacts(run.info.run_id, path, str(target))
    return json.loads(Path(local).read_text())


def artifact_text(workdir: Path, run, path: str) -> str:
    target = workdir / "downloads" / run.info.run_id
    target.mkdir(parents=True, exist_ok=True)
    return Path(client(workdir).download_artifacts(run.info.run_id, path, str(target))).read_text()


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
    # a model-development experiment (the MLflow UI before 3.17 opens it on its runs table)
    experiment = client(workdir).get_experiment_by_name("t_study")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    # its context names ember's use of it, not an MLflow GenAI evaluation ("eval")
    assert {t.key: t.value for t in dataset_input.tags}["mlflow.data.context"] == "study"
    # the prompt the set replaced is no param of the run (config.yaml keeps the resolved config)
    assert "prompt" not in run.data.params and run.data.params["data.name"] == "capitals"
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
    # aggregates: the mean as a metric; mean, standard error and the 95% interval in one table
    metrics = run.data.metrics
    assert metrics["study.items"] == 4
    assert not [name for name in metrics if name.endswith((".se", ".ci_low", ".ci_high"))]
    summary = table(workdir, run, "study/summary.json")
    rows = {row[0]: dict(zip(summary["columns"], row, strict=True)) for row in summary["data"]}
    assert summary["columns"] == ["metric", "step", "n", "mean", "se", "ci_low", "ci_high"]
    assert list(rows)[:3] == ["answer.prob", "answer.correct", "answer.logit_diff"]  # key metrics first
    for name in ("answer.prob", "answer.correct", "answer.logit_diff"):
        assert rows[name]["mean"] == pytest.approx(metrics[name]) and rows[name]["n"] == 4
        assert rows[name]["ci_low"] <= rows[name]["mean"] <= rows[name]["ci_high"]
        assert rows[name]["se"] >= 0
    # one self-contained results page: the model, the prompt set, n, the key results and every item
    page = artifact_text(workdir, run, "results.html")
    assert "smollm2-135m" in page and "capitals" in page and "n (items)</th><td>4<" in page
    prob = rows["answer.prob"]
    assert f"{prob['mean']:.4g} [{prob['ci_low']:.4g}, {prob['ci_high']:.4g}]" in page
    items_part = page[page.index("<h2>Items</h2>"):page.index("<h2>Config</h2>")]
    assert items_part.count("<tr>") == 1 + 4  # the header and one row per item
    assert all(row[columns.index("prompt")] in items_part for row in items["data"])
    assert "limit: 4" in page[page.index("<h2>Config</h2>"):]
    assert "http://" not in page and "https://" not in page and "<script" not in page
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
    summary = table(workdir, run, "study/summary.json")
    rows = [dict(zip(summary["columns"], row, strict=True)) for row in summary["data"]]
    last = next(r for r in rows if r["metric"] == "logit_lens.target_prob" and r["step"] == 29)
    assert last["ci_low"] <= prob[29] <= last["ci_high"]
    paths = {a.path for a in client(workdir).list_artifacts(run.info.run_id, "study")}
    assert "study/logit_lens.target_prob.svg" in paths
    assert artifact_text(workdir, run, "study/logit_lens.target_prob.svg").startswith("<svg")
    lens = {a.path for a in client(workdir).list_artifacts(run.info.run_id, "experiments/logit_lens")}
    assert "experiments/logit_lens/item0_layers_by_positions.svg" in lens
    page = artifact_text(workdir, run, "results.html")
    assert page.count("data:image/svg+xml;base64,") >= 2  # the study's curve and the lens map, embedded
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


@pytest.mark.parametrize("job", [
    ("data=capitals", "experiment=ablation", "layer=3", "experiments.0.mode=mean"),
    ("data=sentiment", "experiment=steering", "layer=6", "experiments.0.scale=4", "sampling.temperature=0.8"),
])
def test_single_token_items_batched_equal_one_at_a_time(workdir, monkeypatch, job):
    """max_new_tokens=1 with batch-handling experiments: the items run as batches, with the same
    per-item rows (generated token, answer and effect metrics) as one generation per item."""
    from ember.runs.study import Study

    name = job[1].split("=")[1]
    original = Study._generate
    with monkeypatch.context() as patched:
        def refused(self, item, run):
            raise AssertionError("a single-token study of batched experiments generated one item alone")
        patched.setattr(Study, "_generate", refused)
        assert main(*job, "data.limit=5", "max_new_tokens=1", f"mlflow.experiment_name=t_{name}_batched") == 0
    monkeypatch.setattr(Study, "_items_batched", lambda self, run: False)
    assert Study._generate is original
    assert main(*job, "data.limit=5", "max_new_tokens=1", f"mlflow.experiment_name=t_{name}_alone") == 0
    [batched], [alone] = runs_of(workdir, f"t_{name}_batched"), runs_of(workdir, f"t_{name}_alone")
    rows, expected = table(workdir, batched, "study/items.json"), table(workdir, alone, "study/items.json")
    assert rows["columns"] == expected["columns"] and "effect.kl_mean" in rows["columns"]
    for got, want in zip(rows["data"], expected["data"], strict=True):
        want_of = dict(zip(expected["columns"], want, strict=True))
        # differences of logits (logit_diff, deltas, KL) keep the logits' rounding: 1e-5 of their size
        scale = max(abs(want_of["answer.logit"]), abs(want_of["clean.answer.logit"]))
        for column, a, b in zip(rows["columns"], got, want, strict=True):
            if isinstance(b, float):
                assert a == pytest.approx(b, rel=1e-5, abs=1e-5 * scale), column
            else:
                assert a == b, column


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
    # the per-layer values under a name of their own: no one job's value reads as the sweep's result
    assert "effect.kl_mean" not in parent.data.metrics
    assert steps(workdir, parent, "by_layer/effect.kl_mean") == {
        1: pytest.approx(rows[0]["effect.kl_mean"]), 4: pytest.approx(rows[1]["effect.kl_mean"])}
    # the threads the jobs ran with, not the parent process's
    assert parent.data.tags["numpy.blas_threads"] == children["0"].data.tags["numpy.blas_threads"] == "1"
    assert parent.data.tags["ember.threads"] == "1"
    paths = {a.path for a in client(workdir).list_artifacts(parent.info.run_id, "sweep")}
    assert {"sweep/effect.kl_mean.png", "sweep/summary.json"} <= paths
    page = artifact_text(workdir, parent, "results.html")
    assert "smollm2-135m" in page and "capitals" in page and "n (items per job)</th><td>2<" in page
    for row in rows:
        assert row["run_id"] in page and f"{row['effect.kl_mean']:.4g} [" in page


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


def test_a_search_parent_shows_its_objective(workdir):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    assert main("-m", "+search=steering_flip", "hydra.sweeper.n_trials=3", "hydra.sweeper.n_jobs=1",
                "data.limit=2", "mlflow.experiment_name=t_search") == 0
    runs = runs_of(workdir, "t_search")
    [parent] = [r for r in runs if r.data.tags.get("ember.sweep") == "true"]
    children = [r for r in runs if r.info.run_id != parent.info.run_id]
    best = min(children, key=lambda c: c.data.metrics["objective"])
    assert parent.data.tags["ember.search.best_run_id"] == best.info.run_id
    assert parent.data.metrics["objective"] == pytest.approx(best.data.metrics["objective"])
    summary = table(workdir, parent, "sweep/summary.json")
    assert summary["columns"].index("objective") < summary["columns"].index("effect.kl_mean")
    paths = {a.path for a in client(workdir).list_artifacts(parent.info.run_id, "sweep")}
    assert "sweep/objective.png" in paths
    assert "best: job #" in artifact_text(workdir, parent, "results.html")
