"""What a reader of a study sees: figures that say what they show, the results page (one self-contained
HTML file), and a sweep parent's summary in a real SQLite MLflow store (a search's objective first, its
points joined in the order of the searched value)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ember.experiments.labels import shorten, token_label
from ember.studies.aggregate import Aggregate
from ember.studies.figures import INTERVAL_LABEL, human_label, points_figure, series_figure
from ember.studies.report import PageFigure, ResultsPage, Table, interval_text, render, summary_columns


def test_token_labels_are_cut_with_an_ellipsis():
    assert token_label(3, " Paris") == "3\n' Paris'"
    long = token_label(7, " internationalisation")
    assert long.endswith("…") and len(long.split("\n")[1]) == 12
    assert shorten("abc", 3) == "abc" and shorten("abcd", 3) == "ab…"


def _drawn(figure):
    figure.canvas.draw()  # ticks are chosen at draw time
    return figure.axes[0]


def test_a_sweep_line_follows_the_swept_value_not_the_trial_order():
    x = [8.0, 2.0, 14.0, 5.0]  # the order a search tried them in
    figure = points_figure("objective", ["a", "b", "c", "d"], x, [3.0, 1.0, 4.0, 2.0], [None] * 4,
                           [None] * 4, xlabel="experiments.0.scale", title="t", best=1)
    ax = _drawn(figure)
    line = ax.containers[0].lines[0]
    assert list(line.get_xdata()) == [2.0, 5.0, 8.0, 14.0]
    assert list(line.get_ydata()) == [1.0, 2.0, 3.0, 4.0]
    [star] = [ln for ln in ax.lines if ln.get_marker() == "*"]
    assert list(star.get_xdata()) == [2.0] and list(star.get_ydata()) == [1.0]
    assert ax.get_ylabel() == "search objective" and ax.get_title() == "t"


def test_an_integer_axis_has_integer_ticks_a_zero_line_and_explained_bands():
    import xml.etree.ElementTree as ET

    aggs = [Aggregate(5, m, 0.1, m - 0.2, m + 0.2) for m in (0.5, -0.2, 0.3)]
    figure = series_figure("answer.logit_diff", [3, 4, 5], aggs, model="smollm2-135m", prompt_set="capitals",
                           n=5)
    assert figure.suffix == ".svg"
    root = ET.fromstring(figure.text)
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert {"3", "4", "5"} <= set(texts) and not {"3.5", "4.5"} & set(texts)  # integer ticks
    assert [ln for ln in root.iter("{http://www.w3.org/2000/svg}line") if ln.get("stroke-opacity") == "0.6"]
    assert INTERVAL_LABEL in texts and "mean over items" in texts
    assert {"logit difference answer −", "wrong answer"} <= set(texts)  # the y label wrapped, never cut
    assert "logit difference answer − wrong answer (answer.logit_diff)" in texts
    assert "smollm2-135m, capitals, n = 5" in texts
    assert human_label("my.metric") == "my.metric"


def test_the_results_page_is_one_self_contained_file():
    aggregates = {("answer.prob", 0): Aggregate(3, 0.4, 0.05, 0.31, 0.49),
                  ("x.series", 2): Aggregate(3, 1.0, 0.0, 1.0, 1.0)}
    columns = summary_columns(aggregates, ["answer.prob"], ["x.series"])
    assert columns["metric"] == ["answer.prob", "x.series"] and columns["step"] == [None, 2]
    page = ResultsPage("Study: <capitals>", [("model", "m & n")], [PageFigure("a figure", b"\x89PNG")],
                       [Table("Items", {"prompt": ["<b>x</b>", "y"], "p": [0.5, math.nan]})], "a: 1")
    text = render(page)
    assert "&lt;capitals&gt;" in text and "m &amp; n" in text and "&lt;b&gt;x&lt;/b&gt;" in text
    assert "data:image/png;base64,iVBORw==" in text
    svg = render(ResultsPage("s", [], [PageFigure("svg", b"<svg/>", "image/svg+xml")]))
    assert "data:image/svg+xml;base64,PHN2Zy8+" in svg
    assert "http" not in text.replace("http-equiv", "") and "<script" not in text and "<link" not in text
    assert interval_text(0.4, 0.31, 0.49) == "0.4 [0.31, 0.49]" and interval_text(0.4, None, None) == "0.4"


@pytest.fixture
def store(tmp_path: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("t", artifact_location=str(tmp_path / "artifacts"))
    return client, experiment


def test_a_search_parent_has_its_objective_first(store):
    from ember.records.store import Store
    from ember.records.tracker import Tracker
    from ember.studies.summary import summarize_sweep

    client, experiment = store
    parent = client.create_run(experiment, run_name="sweep[search]").info.run_id
    scales, objectives = [8.5, 2.25, 14.75], [18.5, 2.25, 14.75]  # trial 1 (scale 2.25) is the best
    child_ids = []
    for job, (scale, objective) in enumerate(zip(scales, objectives, strict=True)):
        tags = {"mlflow.parentRunId": parent, "ember.job": str(job), "numpy.blas_threads": "1",
                "ember.overrides": f"+search=steering_flip experiments.0.scale={scale}",
                "ember.threads": "1", "model.name": "smollm2-135m", "ember.study.data": "capitals",
                "ember.study.items": "3", "ember.study.key_metrics": "effect.answer_changed"}
        run = client.create_run(experiment, tags=tags).info.run_id
        client.log_metric(run, "objective", objective)
        client.log_metric(run, "effect.answer_changed", 1.0 / (job + 1))
        client.log_table(run, {"metric": ["effect.answer_changed"], "step": [None], "n": [3],
                               "mean": [1.0 / (job + 1)], "se": [0.1], "ci_low": [0.0], "ci_high": [1.0]},
                         "study/summary.json")
        client.set_terminated(run)
        child_ids.append(run)
    client.set_tag(parent, "ember.search.best_run_id", child_ids[1])
    client.set_tag(parent, "ember.search.direction", "minimize")  # as ember.tracking tags a search
    client.set_tag(parent, "ember.search.best_job", "1")
    client.set_tag(parent, "numpy.blas_threads", "2")

    done = summarize_sweep(Tracker.attach(Store(client.tracking_uri), experiment), experiment, parent)
    assert done["key_metrics"] == ["objective", "effect.answer_changed"]
    run = client.get_run(parent)
    assert run.data.metrics["objective"] == 2.25  # the best trial's, the search's result
    assert run.data.tags["numpy.blas_threads"] == "1" and run.data.tags["ember.threads"] == "1"
    assert {m.step: m.value for m in client.get_metric_history(parent, "by_job/objective")} == {
        0: 18.5, 1: 2.25, 2: 14.75}  # a fractional scale is no step: the job
    target = Path(client.download_artifacts(parent, "", str(Path(client.tracking_uri[10:]).parent / "dl")))
    summary = json.loads((target / "sweep" / "summary.json").read_text())
    rows = [dict(zip(summary["columns"], r, strict=True)) for r in summary["data"]]
    assert [r["objective"] for r in rows] == objectives
    assert [r["effect.answer_changed.ci_high"] for r in rows] == [1.0, 1.0, 1.0]
    assert (target / "sweep" / "objective.png").stat().st_size > 0
    page = (target / "results.html").read_text()
    assert "smollm2-135m" in page and "capitals" in page and "n (items per job)</th><td>3<" in page
    assert "minimize the objective; best: job #1" in page
    assert all(run_id in page for run_id in child_ids)
    assert page.count("data:image/png;base64,") == 2
