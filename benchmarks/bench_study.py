"""What a study's runner costs beside the engine: per-item bookkeeping, aggregates and bootstrap
intervals, the items table, figures, the results page, the experiments' records and every MLflow write,
against the time the model spends evaluating; and what a new SQLite store costs.

    python -m benchmarks.bench_study                       # 3 repeats, SmolLM2-135M, capitals x 50
    python -m benchmarks.bench_study --items 24 --repeats 1 --jobs mean_ablation,logit_lens
    python -m benchmarks.bench_study --store-only          # the store's figures alone

Each repeat runs four real jobs through `ember.run` (a SQLite MLflow store in a temporary folder,
the model loaded once for all): plain generation (the runner's answer metrics), plain answer scoring
(one token per item: the items' prompts evaluated in batches), mean ablation of layer 3
(a preparation pass over the set, then the intervention-effect metrics against a clean prefill per item)
and the logit lens (every layer of several items read out at once, a top-token table and a layers ×
positions figure).
The runs time themselves (`study.engine_seconds`: model evaluations, hooks included;
`study.experiment_seconds`: experiment code between them; `study.runner_seconds`: everything else of the
study, the results page included, up to its last MLflow call). The job's own overhead beside them is
`job wall - engine - experiment` (validation, Hydra, opening and closing the run; the model is cached).
Figures are medians over the repeats. Issue 25's target: runner time <= 10% of engine time, per job.

The store: seconds to open a new SQLite store in a fresh process once MLflow is imported, made by
MLflow's own migrations, copied from ember's cached template (`ember.records.store_template`), and an
existing store for comparison (medians over `--store-repeats`, each in its own process).

MLflow calls are counted by wrapping the client's writing methods during the jobs: the writes are
batched when the number of calls does not grow with the number of items (the benchmark also runs a
10-item set to show that).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

TARGET = 0.10  # runner time / engine time, per job (issue 25)
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
        "job_overhead_seconds": wall - metrics["study.engine_seconds"] - metrics["study.experiment_seconds"],
        "runner_share": metrics["study.runner_seconds"] / metrics["study.engine_seconds"],
        "mlflow_calls": sum(used.values()),
        "mlflow_calls_by_method": dict(used),
        "metric_values": len(metrics),
    }


# Each in a fresh process: seconds to open a SQLite store once MLflow is imported (the child prints them).
_OPEN_STORE = """
import sys, time
from mlflow.tracking import MlflowClient
from ember.records.store import mlflow_client, quiet_mlflow_logging
quiet_mlflow_logging()
uri = sys.argv[1]
started = time.perf_counter()
client = MlflowClient(uri) if sys.argv[2] == "mlflow" else mlflow_client(uri)
client.search_experiments()
print(time.perf_counter() - started)
"""


def store_seconds(repeats: int) -> dict[str, float]:
    """Median seconds to open a new store made by MLflow, a new store copied from ember's template, and
    an existing store, each in its own process (alternating, so the machine's load hits all alike)."""
    times: dict[str, list[float]] = {"new_by_mlflow": [], "new_from_template": [], "existing": []}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory(prefix="ember_bench_store_") as folder:
        def opened(name: str, how: str) -> float:
            done = subprocess.run([sys.executable, "-c", _OPEN_STORE, f"sqlite:///{folder}/{name}.db", how],
                                  env=env, capture_output=True, text=True, check=True)
            return float(done.stdout.strip().splitlines()[-1])

        opened("warm", "ember")  # the template, made once per MLflow version
        for repeat in range(repeats):
            times["new_by_mlflow"].append(opened(f"mlflow{repeat}", "mlflow"))
            times["new_from_template"].append(opened(f"ember{repeat}", "ember"))
            times["existing"].append(opened("warm", "ember"))
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--items", type=int, default=50)
    parser.add_argument("--jobs", default=",".join(JOBS), help=f"some of {', '.join(JOBS)}")
    parser.add_argument("--threads", type=int, default=1,
                        help="engine threads (1: the benchmark shares this 2-core machine)")
    parser.add_argument("--store-repeats", type=int, default=3)
    parser.add_argument("--store-only", action="store_true", help="measure the store only")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()

    store = store_seconds(args.store_repeats)
    print(f"open a SQLite store (fresh process, MLflow imported; medians of {args.store_repeats}): new by "
          f"MLflow's migrations {store['new_by_mlflow']:.2f} s, new from ember's template "
          f"{store['new_from_template']:.2f} s, existing {store['existing']:.2f} s", flush=True)
    report: dict[str, Any] = {"target": TARGET, "items": args.items, "threads": args.threads,
                              "repeats": args.repeats, "store_seconds": store, "jobs": {}}
    if args.store_only:
        _write(args.json, report)
        return

    from ember.records.store import quiet_mlflow_logging

    jobs = {name: JOBS[name] for name in args.jobs.split(",")}
    quiet_mlflow_logging()
    calls = count_mlflow_calls()
    saved = os.getcwd()
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in jobs}
    small: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="ember_bench_study_") as folder:
        os.chdir(folder)
        try:
            workdir = Path(folder)
            for name, job_args in jobs.items():  # warm-up: model load, imports, the store
                small[name] = run_job(workdir, name, job_args, 10, args.threads, calls)
            for repeat in range(args.repeats):
                for name, job_args in jobs.items():
                    results[name].append(run_job(workdir, name, job_args, args.items, args.threads, calls))
                    r = results[name][-1]
                    print(f"repeat {repeat + 1}: {name}: engine {r['engine_seconds']:.2f} s, runner "
                          f"{r['runner_seconds']:.3f} s ({r['runner_share']:.1%}), job overhead "
                          f"{r['job_overhead_seconds']:.2f} s, {r['mlflow_calls']} MLflow calls", flush=True)
        finally:
            os.chdir(saved)

    print(f"\nmedians over {args.repeats} repeats, {args.items} items, threads={args.threads}; target: "
          f"runner <= {TARGET:.0%} of engine, per job:")
    print(f"{'job':<15} {'engine s':>9} {'experiment s':>13} {'runner s':>9} {'runner/engine':>14} "
          f"{'target':>7} {'per item ms':>12} {'job overhead s':>15} {'MLflow calls (10 / N items)':>28}")
    for name, runs in results.items():
        med = {key: statistics.median(r[key] for r in runs) for key in
               ("engine_seconds", "experiment_seconds", "runner_seconds", "runner_share", "mlflow_calls",
                "job_overhead_seconds")}
        report["jobs"][name] = {**med, "meets_target": med["runner_share"] <= TARGET, "runs": runs,
                                "ten_items": small[name]}
        per_item = 1000 * med["runner_seconds"] / args.items
        verdict = "meets" if med["runner_share"] <= TARGET else "MISSES"
        print(f"{name:<15} {med['engine_seconds']:>9.2f} {med['experiment_seconds']:>13.2f} "
              f"{med['runner_seconds']:>9.3f} {med['runner_share']:>13.1%} {verdict:>7} {per_item:>12.1f} "
              f"{med['job_overhead_seconds']:>15.2f} {small[name]['mlflow_calls']:>12} / "
              f"{int(med['mlflow_calls'])}")
    missed = [name for name, job in report["jobs"].items() if not job["meets_target"]]
    print(f"\n{len(jobs) - len(missed)} of {len(jobs)} jobs meet the target of {TARGET:.0%}"
          + (f"; missed by: {', '.join(missed)}" if missed else ""))
    _write(args.json, report)


def _write(path: str | None, report: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
