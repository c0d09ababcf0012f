"""One console line per experiment saying what it found and where its records are.

Built-in experiments have a summary of their own (`SUMMARIES`, by experiment name; new experiments may
add theirs); any other experiment gets a generic line: its scalar metrics, how many series, tables
(rows), arrays and figures it produced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ember.records.tracker import experiment_folder


def _number(value: Any) -> str:
    return f"{float(value):.4g}"


def activation_stats_summary(result: Any) -> str:
    rows = result.tables.get("activation_stats", [])
    residual = [r for r in rows if r.get("hook") == "after_layer" and r.get("phase") == "prefill"]
    parts = []
    if residual:
        first, last = min(residual, key=lambda r: r["layer"]), max(residual, key=lambda r: r["layer"])
        peak = max(residual, key=lambda r: r["max_abs"])
        parts.append(f"residual RMS {_number(first['rms'])} after layer {first['layer']} → "
                     f"{_number(last['rms'])} after layer {last['layer']} (prefill); largest |value| "
                     f"{_number(peak['max_abs'])} after layer {peak['layer']}")
    nonfinite = sum(int(r.get("nonfinite", 0)) for r in rows)
    parts.append(f"{nonfinite} non-finite values" if nonfinite else "no NaN or inf")
    return "; ".join(parts)


def zero_layer_output_summary(result: Any) -> str:
    rows = result.tables.get("zeroed", [])
    zeroed = sum(int(r.get("evaluations", 0)) for r in rows)
    places = sorted({f"layer {r['layer']} {r['hook']}" for r in rows})
    return f"zeroed {zeroed} tensors ({', '.join(places)})" if rows else "zeroed nothing"


SUMMARIES: dict[str, Callable[[Any], str]] = {
    "activation_stats": activation_stats_summary,
    "zero_layer_output": zero_layer_output_summary,
}


def generic_summary(result: Any) -> str:
    steps: dict[str, list[Any]] = {}
    for metric in result.metrics:
        steps.setdefault(metric.name, []).append(metric)
    scalars = [values[0] for values in steps.values() if len(values) == 1]
    parts = [", ".join(f"{m.name}={_number(m.value)}" for m in scalars[:4])] if scalars else []
    series = len(steps) - len(scalars)
    if series:
        parts.append(f"{series} metric series")
    parts += [f"table {name} ({len(rows)} rows)" for name, rows in result.tables.items()]
    if result.arrays:
        parts.append(f"{len(result.arrays)} arrays")
    if result.figure_builders:
        parts.append(f"figures: {', '.join(result.figure_builders)}")
    if getattr(result, "file_builders", None):
        parts.append(f"files: {', '.join(result.file_builders)}")
    return "; ".join(parts) or "no results"


def experiment_summary(name: str, result: Any) -> str:
    """`name: what it found (records: experiments/<name>/)`."""
    try:
        text = SUMMARIES.get(name, generic_summary)(result)
    except Exception:  # a result shaped unlike its summary expects: the generic line still informs
        text = generic_summary(result)
    return f"{name}: {text} (records: {experiment_folder(name)}/)"
