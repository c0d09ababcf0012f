"""What a study's runner costs beside the engine: per-item bookkeeping, aggregates and bootstrap
intervals, the items table, figures, the experiments' records and every MLflow write, against the time
the model spends evaluating, on a 50-item prompt set.

    python -m benchmarks.bench_study                       # 3 repeats, SmolLM2-135M, capitals × 50
    python -m benchmarks.bench_study --repeats 5 --json study.json

Each repeat runs four real jobs through `ember.run` (a fresh SQLite MLflow store in a temporary folder,
the model loaded once for all): plain generation (the runner's answer metrics), plain answer scoring
(one token per item: the items' prompts evaluated in batches), mean ablation of layer 3
(a preparation pass over the set, then the intervention-effect metrics against a clean prefill per item)
and the logit lens (every layer of several items read out at once, a top-token table and a layers ×
positions figure).
The runs time themselves (`study.engine_seconds`: model evaluations, hooks included;
`study.experiment_seconds`: experiment code between them; `study.runner_seconds`: everything else of
the job after the model is loaded). Figures are medians over the repeats. Issue 12's target: runner
time ≤ 10% of engine time.

MLflow calls are counted by wrapping the client's writing methods during the jobs: the writes are
batched when the number of calls does not grow with the number of items (the benchmark also runs a
10-item set to show that).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

TARGET = 0.10  # runner time / engine time
JOBS = {
    "generate": ["max_new_tokens=8"],
    "answer_scoring": ["max_new_tokens=1"],
    "mean_ablation": ["experiment=ablation", "layer=3", "experiments.0.mode=mean", "max_new_tokens=8"],
    "logit_lens": ["experiment=logit_lens"],
}
WRITES = ("log_batch", "log_metric", "log_param", "set_tag", "log_artifact", "log_artifacts", "log_text",
          "log_dict", "log_figure", "log_table", "log_inputs", "create_run", "set_terminated")


def count_mlflow_calls() -> Counter:
    """Wrap MlflowClient's writing methods so every call is counted (the calls still happen)."""
    from mlflow.tracking import MlflowClient

    calls: Counter = Counter()
    for name in WRITES:
        original = getattr(MlflowClient, name)

        def wrapper(self, *args, __original=original, __name=name, **kwargs):
            calls[__name] += 1
            return __original(self, *args, **kwargs)

        setattr(MlflowClient, name, wrapper)
    return calls


def run_job(workdir: Path, name: str, args: list[str], items: int, threads: int, calls: Counter) -> dict:
    from mlflow.tracking import MlflowClient

    from ember import run as runner

    experiment = f"bench_{name}_{items}_{time.monotonic_ns()}"
    before = Counter(calls)
    started = time.perf_counter()
    code = runner.main(["data=capitals", f"data.limit={items}", f"threads={threads}",
                        f"mlflow.experiment_name={experiment}", *args])
    wall = time.perf_counter() - started
    if code != 0:
        raise SystemExit(f"the {name} job failed with status {code}")
    client = MlflowClient(f"sqlite:///{workdir / 'outputs' / 'mlflow.db'}")
    found = client.get_experiment_by_name(experiment)
    [run] = client.search_runs([found.experiment_id])
    metrics = run.data.metrics
    used = calls - before
    return {
        "items": int(metrics["study.items"]),
        "engine_seconds": metrics["study.engine_seconds"],
        "experiment_seconds": metrics["study.experiment_seconds"],
        "runner_seconds": metrics["study.runner_seconds"],
        "total_seconds": metrics["study.total_seconds"],
        "job_wall_seconds": wall,
        "runner_share": metrics["study.runner_seconds"] / metrics["study.engine_seconds"],
        "mlflow_calls": sum(used.values()),
        "mlflow_calls_by_method": dict(used),
        "metric_values": len(metrics),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--items", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1,
                        help="engine threads (1: the benchmark shares this 2-core machine)")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()

    from ember.records.store import quiet_mlflow_logging

    quiet_mlflow_logging()
    calls = count_mlflow_calls()
    saved = os.getcwd()
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in JOBS}
    small: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="ember_bench_study_") as folder:
        os.chdir(folder)
        try:
            workdir = Path(folder)
            for name, job_args in JOBS.items():  # warm-up: model load, imports, store migrations
                small[name] = run_job(workdir, name, job_args, 10, args.threads, calls)
            for repeat in range(args.repeats):
                for name, job_args in JOBS.items():
                    results[name].append(run_job(workdir, name, job_args, args.items, args.threads, calls))
                    r = results[name][-1]
                    print(f"repeat {repeat + 1}: {name}: engine {r['engine_seconds']:.2f} s, runner "
                          f"{r['runner_seconds']:.3f} s ({r['runner_share']:.1%}), "
                          f"{r['mlflow_calls']} MLflow calls", flush=True)
        finally:
            os.chdir(saved)

    summary = {}
    print(f"\nmedians over {args.repeats} repeats, {args.items} items, threads={args.threads}:")
    print(f"{'job':<15} {'engine s':>9} {'experiment s':>13} {'runner s':>9} {'runner/engine':>14} "
          f"{'per item ms':>12} {'MLflow calls (10 / 50 items)':>30}")
    for name, runs in results.items():
        med = {key: statistics.median(r[key] for r in runs) for key in
               ("engine_seconds", "experiment_seconds", "runner_seconds", "runner_share", "mlflow_calls")}
        summary[name] = {**med, "runs": runs, "ten_items": small[name]}
        per_item = 1000 * med["runner_seconds"] / args.items
        print(f"{name:<15} {med['engine_seconds']:>9.2f} {med['experiment_seconds']:>13.2f} "
              f"{med['runner_seconds']:>9.3f} {med['runner_share']:>13.1%} {per_item:>12.1f} "
              f"{small[name]['mlflow_calls']:>14} / {int(med['mlflow_calls'])}")
    worst = max(s["runner_share"] for s in summary.values())
    verdict = "meets" if worst <= TARGET else "MISSES"
    print(f"\nworst runner/engine {worst:.1%}: {verdict} the target of {TARGET:.0%}")
    if args.json:
        Path(args.json).write_text(json.dumps({"target": TARGET, "items": args.items, "threads": args.threads,
                                               "repeats": args.repeats, "jobs": summary}, indent=2))


if __name__ == "__main__":
    main()
