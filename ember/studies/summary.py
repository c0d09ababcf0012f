"""The summary a sweep's parent run gets of its children, so the sweep reads at a glance.

* a table `sweep/summary.json` (MLflow's table artifact): one row per job with its number, overrides,
  status, the swept values and each key metric with its 95% interval (from the job's
  `study/summary.json`);
* a figure `sweep/<metric>.png` per key metric against the swept parameter (points joined in the order
  of the swept value), with the interval as error bars (a metric logged per step, e.g. per layer, is
  represented by its largest-magnitude step); a search's best trial is marked on `sweep/objective.png`;
* the same values as the parent's metrics `by_<swept>/<metric>` (the swept value as the step where it is
  an integer, e.g. `by_layer/effect.kl_mean`, else `by_job/...` with the job number), named apart from
  the jobs' own metrics so that no single job's value reads as the sweep's result; a search's parent
  also has `objective`, its best trial's;
* the threads the jobs ran with as the parent's `numpy.blas_threads` and `ember.threads` tags;
* one self-contained results page, `results.html` (ember.studies.report).

Key metrics are what the children name in their `ember.study.key_metrics` tag (studies), else the
intervention effect (`effect.kl_mean`, `effect.top1_agreement`) where children have it; a search's
`objective` comes first.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from ember.studies.figures import context_title, human_label, page_figure, points_figure
from ember.studies.report import PageFigure, ResultsPage, Table, interval_text, render

FALLBACK_KEYS = ("effect.kl_mean", "effect.top1_agreement")


def swept_values(overrides: Sequence[str]) -> dict[str, str]:
    """key=value pairs of one job's override list (`+key=value` and `~key` kept as written)."""
    out = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep:
            out[key.lstrip("+")] = value
    return out


def summarize_sweep(records: Any, experiment_id: str, parent_run_id: str) -> dict[str, Any]:
    """Write the parent's table, figures, metrics and results page; returns what was written (for tests
    and logs). `records` is the store's `ember.records.tracker.Tracker`: it reads through its `client`
    and writes through its one write path (the outbox included, when the server is away)."""
    client = records.client
    children = client.search_runs([experiment_id], max_results=10000,
                                  filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'")
    if not children:
        return {}
    parent = client.get_run(parent_run_id)
    children.sort(key=lambda r: int(r.data.tags.get("ember.job", "0") or 0))
    overrides = {r.info.run_id: swept_values(r.data.tags.get("ember.overrides", "").split())
                 for r in children}
    keys_all = sorted({k for values in overrides.values() for k in values})
    swept = [k for k in keys_all if len({values.get(k) for values in overrides.values()}) > 1]
    key_metrics = _key_metrics(children)
    intervals = {r.info.run_id: _intervals(client, r) for r in children}

    rows: list[dict[str, Any]] = []
    Point = tuple[Any, float, float | None, float | None, int | None]  # job, mean, low, high, step
    points: dict[str, list[Point]] = {m: [] for m in key_metrics}
    for run in children:
        job = int(run.data.tags.get("ember.job", "0") or 0)
        row: dict[str, Any] = {"job": job, "overrides": run.data.tags.get("ember.overrides", ""),
                               "status": run.info.status, "run_id": run.info.run_id}
        for key in swept:
            row[key] = overrides[run.info.run_id].get(key)
        for metric in key_metrics:
            value = _metric_value(client, run, metric)
            if value is None:
                continue
            mean, step = value
            low, high = intervals[run.info.run_id].get((metric, step or 0), (None, None))
            row[metric] = mean
            row[f"{metric}.ci_low"] = low
            row[f"{metric}.ci_high"] = high
            if step is not None:
                row[f"{metric}.step"] = step
            points[metric].append((job, mean, low, high, step))
        rows.append(row)

    columns: dict[str, list[Any]] = {}
    for row in rows:
        for name in row:
            columns.setdefault(name, [])
    for row in rows:
        for name in columns:
            columns[name].append(row.get(name))
    records.log_table(parent_run_id, columns, "sweep/summary.json")

    context = _context(children)
    best_run = parent.data.tags.get("ember.search.best_run_id")
    x_name = swept[0] if len(swept) == 1 else None
    numeric_x = x_name is not None and all(_number(r.get(x_name)) is not None for r in rows)
    by_job = {row["job"]: row for row in rows}
    metrics: list[tuple[str, float, int]] = []
    figures: list[str] = []
    page_figures = []
    for metric, found in points.items():
        if not found:
            continue
        labels = [by_job[job]["overrides"] for job, *_ in found]
        xs = [_number(by_job[job].get(x_name)) for job, *_ in found] if numeric_x else None
        best = next((i for i, (job, *_) in enumerate(found) if by_job[job]["run_id"] == best_run), None)
        what = (f"{human_label(metric)} per {x_name if numeric_x else 'job'} "
                f"({len(found)} of {len(children)} jobs)")
        figure = points_figure(metric, labels, xs, [f[1] for f in found], [f[2] for f in found],
                               [f[3] for f in found], xlabel=x_name if numeric_x else "job",
                               title=context_title(what, *context),
                               best=best if metric == "objective" else None)
        records.log_figure(parent_run_id, figure, f"sweep/{metric}.png")
        figures.append(metric)
        page_figures.append(page_figure(f"sweep/{metric}.png: {what}", figure))
        # the step is the swept value where it is an integer (a layer), else the job number
        integer_x = xs is not None and x_name is not None and all(float(x).is_integer() for x in xs)
        axis = f"by_{_metric_word(x_name)}" if integer_x and x_name is not None else "by_job"
        for (job, mean, _low, _high, _), x in zip(found, xs or [None] * len(found), strict=True):
            metrics.append((f"{axis}/{metric}", mean, int(x) if integer_x else job))
    best_value = _best_objective(parent, children)
    if best_value is not None:
        metrics.append(("objective", best_value, 0))
    records.log_metrics(parent_run_id, metrics)
    tags = {"ember.sweep.key_metrics": ",".join(key_metrics), **_job_threads(children)}
    if x_name is not None:
        tags["ember.sweep.swept"] = x_name
    records.set_tags(parent_run_id, tags)
    _log_page(records, parent, children, rows, swept, key_metrics, page_figures, context)
    return {"rows": rows, "swept": swept, "key_metrics": key_metrics, "figures": figures}


def _context(children: Sequence[Any]) -> tuple[str, str, int | None]:
    """(model, prompt set, items per job) as the children name them (joined where they differ)."""
    def joined(tag: str) -> str:
        values = [r.data.tags.get(tag) for r in children if r.data.tags.get(tag)]
        return ", ".join(dict.fromkeys(values))

    items = {r.data.tags.get("ember.study.items") for r in children if r.data.tags.get("ember.study.items")}
    n = int(next(iter(items))) if len(items) == 1 else None
    return joined("model.name"), joined("ember.study.data"), n


def _job_threads(children: Sequence[Any]) -> dict[str, str]:
    """The threads the jobs ran with, on the parent (whose own process did no model work)."""
    out = {}
    for tag in ("numpy.blas_threads", "ember.threads"):
        values = list(dict.fromkeys(r.data.tags[tag] for r in children if tag in r.data.tags))
        if values:
            out[tag] = ",".join(values)
    return out


def _best_objective(parent: Any, children: Sequence[Any]) -> float | None:
    """A search's result: the objective of the best trial the parent is tagged with."""
    best = parent.data.tags.get("ember.search.best_run_id")
    for run in children:
        if run.info.run_id == best and "objective" in run.data.metrics:
            return float(run.data.metrics["objective"])
    return None


def _metric_word(name: str) -> str:
    """`experiments.0.scale` -> `scale`: the last part of a swept key, for a metric name."""
    return re.sub(r"[^A-Za-z0-9_]", "_", name.rsplit(".", 1)[-1]) or "value"


def _intervals(client: Any, run: Any) -> dict[tuple[str, int], tuple[float | None, float | None]]:
    """(metric, step) -> (ci_low, ci_high) from a child's `study/summary.json` (empty without one)."""
    import json
    import os
    import tempfile

    quiet = os.environ.get("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR")
    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"  # no progress bar per job on stderr
    try:
        with tempfile.TemporaryDirectory() as folder:
            path = client.download_artifacts(run.info.run_id, "study/summary.json", folder)
            with open(path, encoding="utf-8") as handle:
                table = json.load(handle)
    except Exception:  # no study in this job (a plain generation, a failed job): no intervals
        return {}
    finally:
        if quiet is None:
            os.environ.pop("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", None)
        else:
            os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = quiet
    out = {}
    for values in table.get("data", []):
        row = dict(zip(table["columns"], values, strict=False))
        out[(row["metric"], int(row.get("step") or 0))] = (row.get("ci_low"), row.get("ci_high"))
    return out


def _log_page(records: Any, parent: Any, children: Sequence[Any], rows: Sequence[dict[str, Any]],
              swept: Sequence[str], key_metrics: Sequence[str], page_figures: Sequence[PageFigure],
              context: tuple[str, str, int | None]) -> None:
    model, prompt_set, n = context
    tags = parent.data.tags
    facts = [("model", model or "?"), ("prompt set", prompt_set or "none (single prompts)"),
             ("n (items per job)", str(n) if n is not None else "varies"), ("jobs", str(len(children))),
             ("swept", ", ".join(swept) or "nothing varies"), ("MLflow run", parent.info.run_id)]
    if tags.get("ember.search.direction"):
        facts.append(("search", f"{tags['ember.search.direction']} the objective; best: job "
                                f"#{tags.get('ember.search.best_job', '?')} "
                                f"({tags.get('ember.search.best_overrides', '?')}), objective "
                                f"{tags.get('ember.search.best_objective', '?')}"))
    table: dict[str, list[Any]] = {"job": [r["job"] for r in rows]}
    for key in swept:
        table[key] = [r.get(key) for r in rows]
    table["status"] = [r["status"] for r in rows]
    for metric in key_metrics:
        table[f"{metric} [95% CI]"] = [interval_text(r.get(metric), r.get(f"{metric}.ci_low"),
                                                     r.get(f"{metric}.ci_high")) for r in rows]
        if any(f"{metric}.step" in r for r in rows):
            table[f"{metric} at step"] = [r.get(f"{metric}.step") for r in rows]
    table["run"] = [r["run_id"] for r in rows]
    note = ("one row per job; a key metric is the mean over the job's items with its 95% bootstrap "
            "interval (a per-layer series at its largest-magnitude step); also sweep/summary.json")
    config = "\n".join(f"{k}: {v}" for k, v in sorted(parent.data.params.items()))
    page = ResultsPage(f"Sweep: {parent.info.run_name}", facts,
                       list(page_figures),
                       [Table("Jobs", table, note)], config)
    records.log_text(parent.info.run_id, render(page), "results.html")


def _key_metrics(children: Sequence[Any]) -> list[str]:
    keys: list[str] = []
    for run in children:
        for name in (run.data.tags.get("ember.study.key_metrics") or "").split(","):
            if name and name not in keys:
                keys.append(name)
    if not keys:
        keys = [k for k in FALLBACK_KEYS if any(k in r.data.metrics for r in children)]
    if any("objective" in r.data.metrics for r in children):  # a search: what it searched first
        keys = ["objective", *(k for k in keys if k != "objective")]
    return keys


def _metric_value(client: Any, run: Any, metric: str) -> tuple[float, int | None] | None:
    """The metric's value; for a per-step series, its largest-magnitude step (value, step)."""
    if metric not in run.data.metrics:
        return None
    history = client.get_metric_history(run.info.run_id, metric)
    steps = {m.step: m.value for m in history}
    if set(steps) <= {0}:
        return float(run.data.metrics[metric]), None
    step = max(steps, key=lambda s: abs(steps[s]))
    return float(steps[step]), int(step)


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None
