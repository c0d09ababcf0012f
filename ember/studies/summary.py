"""The summary a sweep's parent run gets of its children, so the sweep reads at a glance.

* a table `sweep/summary.json` (MLflow's table artifact): one row per job with its number, overrides,
  status, the swept values and each key metric with its 95% interval;
* a figure `sweep/<metric>.png` per key metric against the swept parameter, with the interval as error
  bars (a metric logged per step, e.g. per layer, is represented by its largest-magnitude step);
* the same values as the parent's own metrics, with the swept value (or the job number) as the step, so
  the UI's chart view of the parent is not empty.

Key metrics are what the children name in their `ember.study.key_metrics` tag (studies), else the
intervention effect (`effect.kl_mean`, `effect.top1_agreement`) where children have it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

FALLBACK_KEYS = ("effect.kl_mean", "effect.top1_agreement")


def swept_values(overrides: Sequence[str]) -> dict[str, str]:
    """key=value pairs of one job's override list (`+key=value` and `~key` kept as written)."""
    out = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep:
            out[key.lstrip("+")] = value
    return out


def summarize_sweep(client: Any, experiment_id: str, parent_run_id: str) -> dict[str, Any]:
    """Write the parent's table, figures and metrics; returns what was written (for tests and logs)."""
    children = client.search_runs([experiment_id], max_results=10000,
                                  filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'")
    if not children:
        return {}
    children.sort(key=lambda r: int(r.data.tags.get("ember.job", "0") or 0))
    overrides = {r.info.run_id: swept_values(r.data.tags.get("ember.overrides", "").split())
                 for r in children}
    keys_all = sorted({k for values in overrides.values() for k in values})
    swept = [k for k in keys_all if len({values.get(k) for values in overrides.values()}) > 1]
    key_metrics = _key_metrics(children)

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
            low = _at_step(client, run, f"{metric}.ci_low", step)
            high = _at_step(client, run, f"{metric}.ci_high", step)
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
    client.log_table(parent_run_id, data=columns, artifact_file="sweep/summary.json")

    x_name = swept[0] if len(swept) == 1 else None
    numeric_x = x_name is not None and all(_number(r.get(x_name)) is not None for r in rows)
    by_job = {row["job"]: row for row in rows}
    metrics: list[tuple[str, float, int]] = []
    figures = []
    for metric, found in points.items():
        if not found:
            continue
        labels = [by_job[job]["overrides"] for job, *_ in found]
        xs = [_number(by_job[job].get(x_name)) for job, *_ in found] if numeric_x else None
        from ember.studies.figures import points_figure

        figure = points_figure(metric, labels, xs, [f[1] for f in found], [f[2] for f in found],
                               [f[3] for f in found], xlabel=x_name if numeric_x else "job",
                               title=f"{metric} per job ({len(found)} of {len(children)} jobs)")
        client.log_figure(parent_run_id, figure, f"sweep/{metric}.png")
        figures.append(metric)
        for (job, mean, low, high, _), x in zip(found, xs or [None] * len(found), strict=True):
            step = int(x) if x is not None and float(x).is_integer() else job
            metrics.append((metric, mean, step))
            metrics += [(f"{metric}.{part}", v, step) for part, v in (("ci_low", low), ("ci_high", high))
                        if v is not None and math.isfinite(v)]
    _log_metrics(client, parent_run_id, metrics)
    client.set_tag(parent_run_id, "ember.sweep.key_metrics", ",".join(key_metrics))
    if x_name is not None:
        client.set_tag(parent_run_id, "ember.sweep.swept", x_name)
    return {"rows": rows, "swept": swept, "key_metrics": key_metrics, "figures": figures}


def _key_metrics(children: Sequence[Any]) -> list[str]:
    keys: list[str] = []
    for run in children:
        for name in (run.data.tags.get("ember.study.key_metrics") or "").split(","):
            if name and name not in keys:
                keys.append(name)
    if not keys:
        keys = [k for k in FALLBACK_KEYS if any(k in r.data.metrics for r in children)]
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


def _at_step(client: Any, run: Any, metric: str, step: int | None) -> float | None:
    if metric not in run.data.metrics:
        return None
    if step is None:
        return float(run.data.metrics[metric])
    for m in client.get_metric_history(run.info.run_id, metric):
        if m.step == step:
            return float(m.value)
    return None


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _log_metrics(client: Any, run_id: str, metrics: list[tuple[str, float, int]]) -> None:
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    entries = [Metric(name, float(value), now, int(step)) for name, value, step in metrics]
    for start in range(0, len(entries), 1000):
        client.log_batch(run_id, metrics=entries[start:start + 1000])
