"""Sweep throughput by launcher: jobs per minute of one SmolLM2 sweep, and each job's overhead beside its
engine time, with the basic launcher (one process), joblib (2 workers) and Ray (a 2-CPU head).

    python -m benchmarks.sweep_launchers                       # 32 jobs x 16 new tokens, all three
    python -m benchmarks.sweep_launchers --jobs 8 --launchers basic,ray --json out.json

Every sweep is a real `python -m ember.run -m ...` into one real tracking server (`mlflow server` with
basic auth on PostgreSQL, as a team would run it; tests/cluster_services.py starts it and the Ray head on
127.0.0.1 and stops them). The jobs are plain generations (`sampling.seed=range(0,N)`, greedy, 16 new
tokens, no early stop), so every job does the same engine work.

Per job, from its child run: its time in its process (`job.seconds`: validation, model load on a cache
miss, generation, MLflow calls), engine time (prefill + decode seconds as the job measured them) and the
difference, its overhead.
Per sweep: wall time of the whole command (Hydra, Ray connection, parent run and closing included) and
jobs per minute. The machine is shared: before each sweep the benchmark waits (bounded) for the other
users' load to drop, and reports it with the load average; rerun when they were busy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import cluster_services as services  # noqa: E402

from benchmarks.machine_load import wait_for_quiet  # noqa: E402

LAUNCHERS = {
    "basic": [],
    "joblib": ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"],
    "ray": ["hydra/launcher=ray"],
}


def run_sweep(name: str, jobs: int, new_tokens: int, workdir: Path, env: dict[str, str],
              server_url: str) -> tuple[float, subprocess.CompletedProcess]:
    args = [sys.executable, "-m", "ember.run", "-m", *LAUNCHERS[name], f"sampling.seed=range(0,{jobs})",
            f"max_new_tokens={new_tokens}", "stop_at_eog=false", f"mlflow.tracking_uri={server_url}",
            f"mlflow.experiment_name=bench_{name}"]
    started = time.perf_counter()
    done = subprocess.run(args, cwd=workdir, env=env, capture_output=True, text=True, timeout=3600)
    return time.perf_counter() - started, done


def job_figures(client: Any, experiment: str) -> list[dict[str, float]]:
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id], max_results=1000)
    parent = next(r for r in runs if r.data.tags.get("ember.sweep") == "true")
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    figures = []
    for run in children:
        m = run.data.metrics
        wall = m["job.seconds"]  # the job in its process: validation, load, generation, records
        engine = m["prefill.seconds"] + m["decode.seconds"]
        figures.append({"wall": wall, "engine": engine, "overhead": wall - engine,
                        "load": m.get("model.load_seconds", 0.0), "tokens": m["tokens.generated"],
                        "status": run.info.status, "pid": run.data.tags.get("ember.pid"),
                        "threads": run.data.tags.get("ember.threads")})
    return figures


def summarize(name: str, wall: float, figures: list[dict[str, Any]], foreign: float) -> dict[str, Any]:
    def median(key: str) -> float:
        return statistics.median(f[key] for f in figures)

    return {
        "launcher": name, "jobs": len(figures), "sweep_seconds": wall,
        "jobs_per_minute": len(figures) / wall * 60.0,
        "job_wall_median": median("wall"), "job_engine_median": median("engine"),
        "job_overhead_median": median("overhead"), "job_overhead_max": max(f["overhead"] for f in figures),
        "model_loads": sum(1 for f in figures if f["load"] > 0),
        "worker_pids": len({f["pid"] for f in figures}),
        "threads_per_job": sorted({f["threads"] for f in figures}),
        "finished": sum(1 for f in figures if f["status"] == "FINISHED"),
        "others_cores_before": foreign, "loadavg_after": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--launchers", default="basic,joblib,ray")
    parser.add_argument("--quiet-cores", type=float, default=0.3,
                        help="wait until other users take fewer cores than this (at most --max-wait s)")
    parser.add_argument("--max-wait", type=float, default=120.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.launchers.split(",") if n.strip()]
    workdir = Path(tempfile.mkdtemp(prefix="ember-sweep-bench-"))
    job_path = f"{REPO}{os.pathsep}{REPO / 'tests'}"
    results = []
    with services.postgres() as db, services.tracking_server(db, workdir / "tracking") as server:
        env = {**{k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "RAY_"))},
               "PYTHONPATH": job_path, **server.credentials()}
        os.environ.update(server.credentials(server.admin))
        from mlflow.tracking import MlflowClient

        client = MlflowClient(server.url)
        for name in names:
            head_env = {"PYTHONPATH": job_path, **server.credentials()}
            head = services.ray_head(2, workdir / "ray", env=head_env) if name == "ray" else None
            try:
                sweep_env = dict(env)
                if head is not None:
                    sweep_env.update(head.__enter__().client_env())
                foreign = wait_for_quiet(args.quiet_cores, args.max_wait)
                print(f"{name}: {args.jobs} jobs (others use {foreign:.2f} cores, load average "
                      f"{os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
                wall, done = run_sweep(name, args.jobs, args.new_tokens, workdir, sweep_env, server.url)
            finally:
                if head is not None:
                    head.__exit__(None, None, None)
            if done.returncode != 0:
                print(done.stderr[-4000:], file=sys.stderr)
                raise SystemExit(f"{name}: the sweep failed with exit status {done.returncode}")
            results.append(summarize(name, wall, job_figures(client, f"bench_{name}"), foreign))
    print(f"\n{args.jobs}-job SmolLM2 sweep, {args.new_tokens} new tokens a job, one tracking server "
          f"(PostgreSQL, basic auth) on this machine ({os.cpu_count()} cores)")
    print("| launcher | sweep s | jobs/min | job wall s | engine s | overhead s (max) | loads | "
          "threads/job | others' cores before |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['launcher']} | {r['sweep_seconds']:.1f} | {r['jobs_per_minute']:.1f} | "
              f"{r['job_wall_median']:.2f} | {r['job_engine_median']:.2f} | {r['job_overhead_median']:.2f} "
              f"({r['job_overhead_max']:.2f}) | {r['model_loads']} | {','.join(r['threads_per_job'])} | "
              f"{r['others_cores_before']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"when": time.strftime("%Y-%m-%dT%H:%M:%S"), "jobs": args.jobs,
                                         "new_tokens": args.new_tokens, "platform": platform.platform(),
                                         "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
