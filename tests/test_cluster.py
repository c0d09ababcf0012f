"""Sweeps beyond one process, on real services started here on 127.0.0.1 (tests/cluster_services.py):
a PostgreSQL server, `mlflow server` on it with basic auth and served artifacts, a Ray head with 2 CPUs
and token auth. Every sweep is a real `python -m ember.run -m ...` subprocess; its records are read
back from the tracking server.

Needs the `cluster` extra and Debian's postgresql (`.ci/run` installs both); slow.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import cluster_services as services
import pytest

try:  # the cluster extra (PostgreSQL itself: cluster_services.postgres fails without it)
    import hydra_plugins.hydra_optuna_sweeper  # noqa: F401
    import hydra_plugins.hydra_ray_launcher  # noqa: F401
    import hydra_plugins.hydra_submitit_launcher  # noqa: F401
    import psycopg  # noqa: F401
    import ray  # noqa: F401
    MISSING = ""
except ImportError as error:
    MISSING = str(error)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
JOB_PATH = f"{REPO}{os.pathsep}{TESTS}"  # ember and run_support, for the jobs wherever they run


@pytest.fixture(scope="module", autouse=True)
def _cluster_extra():
    """CI installs the cluster extra before the slow tests: there a missing piece fails, never skips."""
    if MISSING:
        if os.environ.get("CI"):
            pytest.fail(f"the cluster extra is not installed: {MISSING}")
        pytest.skip(f"the cluster extra is not installed: {MISSING}")


@pytest.fixture(scope="module")
def database():
    with services.postgres() as db:
        yield db


@pytest.fixture(scope="module")
def server(tmp_path_factory, database):
    with services.tracking_server(database, tmp_path_factory.mktemp("tracking")) as tracking_server:
        yield tracking_server


@pytest.fixture(scope="module")
def worker_cache(tmp_path_factory) -> Path:
    """The workers' own ember cache, empty at first: models reach them without this process's disk."""
    return tmp_path_factory.mktemp("worker-cache")


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory, server, worker_cache):
    """A Ray head with 2 CPUs whose workers log to the tracking server as its job user.

    The workers fetch models into a cache of their own, but load the quantized kernels numba compiled
    for this process (its JIT cache): compiling them again in a fresh cache costs each new worker
    minutes on two busy cores, and says nothing about a sweep."""
    from ember.quant import jit_cache_dir

    folder = tmp_path_factory.mktemp("ray")
    jit = os.environ.get("NUMBA_CACHE_DIR") or str(jit_cache_dir())
    env = {"PYTHONPATH": JOB_PATH, "EMBER_CACHE": str(worker_cache), "NUMBA_CACHE_DIR": jit,
           **server.credentials()}
    with services.ray_head(2, folder, env=env) as head:
        yield head


@pytest.fixture()
def admin(server, monkeypatch):
    """An MlflowClient on the server, as its admin."""
    from mlflow.tracking import MlflowClient

    for key, value in server.credentials(server.admin).items():
        monkeypatch.setenv(key, value)
    return MlflowClient(server.url)


def ember_run(workdir: Path, *args: str, env: dict[str, str], timeout: float = 900,
              wait: bool = True) -> subprocess.CompletedProcess | subprocess.Popen:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("MLFLOW_", "RAY_", "EMBER_SWEEP", "EMBER_MLFLOW"))}
    command = [sys.executable, "-m", "ember.run", *args]
    full_env = {**clean, "PYTHONPATH": JOB_PATH, "RAY_DEDUP_LOGS": "0", **env}
    if not wait:  # output to files: a pipe nobody reads yet could fill and stop the sweep
        return subprocess.Popen(command, cwd=workdir, env=full_env, stdout=(workdir / "stdout").open("w"),
                                stderr=(workdir / "stderr").open("w"), text=True)
    return subprocess.run(command, cwd=workdir, env=full_env, capture_output=True, text=True, timeout=timeout)


def sweep_of(client, experiment: str):
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no experiment {experiment!r}"
    runs = client.search_runs([found.experiment_id], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("ember.sweep") == "true"]
    assert len(parents) == 1, [r.info.run_name for r in runs]
    parent = parents[0]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == len(runs) - 1, "every run of the sweep is a child of its one parent"
    return parent, sorted(children, key=lambda r: (int(r.data.tags["ember.job"]), r.info.start_time))


def children_told(children: list) -> list[str]:
    """What each child run says about itself (for a failed assertion's message)."""
    return [f"job {c.data.tags.get('ember.job')} {c.info.status}: "
            + ", ".join(f"{k}={v!r}" for k, v in sorted(c.data.tags.items())
                        if k.startswith(("ember.error", "ember.failure", "ember.repaired", "ember.pid")))
            for c in children]


def secrets_of(server) -> list[str]:
    return [server.user[1], server.admin[1]]


def assert_no_secret(server, texts: list[str], runs: list) -> None:
    for secret in secrets_of(server):
        for text in texts:
            assert secret not in text
        for run in runs:
            assert all(secret not in str(v) for v in run.data.params.values())
            assert all(secret not in str(v) for v in run.data.tags.values())


def test_ray_sweep_of_12_jobs_records_12_finished_children_under_one_parent(
        tmp_path, server, ray_head, admin, worker_cache):
    env = {**ray_head.client_env(), **server.credentials()}
    started = time.perf_counter()
    done = ember_run(tmp_path, "-m", "hydra/launcher=ray", "experiment=zero_layer",
                     "layer=0,1,2,3,4,5,6,7,8,9,10,11", "max_new_tokens=2", "intervention_effect=false",
                     f"mlflow.tracking_uri={server.url}", "mlflow.experiment_name=t_ray12", env=env)
    print(f"12-job Ray sweep: {time.perf_counter() - started:.1f} s")
    assert done.returncode == 0, done.stderr[-4000:]
    assert "sweep of 12 job(s) finished" in done.stderr

    parent, children = sweep_of(admin, "t_ray12")
    assert parent.info.status == "FINISHED" and parent.data.tags["ember.sweep.failed_jobs"] == "none"
    assert len(children) == 12, "none lost, none doubled"
    assert [c.info.status for c in children] == ["FINISHED"] * 12, "none RUNNING"
    assert sorted(int(c.data.params["experiments.0.layer"]) for c in children) == list(range(12))

    tags = [c.data.tags for c in children]
    assert {t["ember.scheduler"] for t in tags} == {"ray"}
    assert len({t["ember.scheduler.task_id"] for t in tags}) == 12
    assert len({t["ember.scheduler.job_id"] for t in tags}) == 1  # one Ray job: this sweep's driver
    assert all(t["ember.host"] and t["ember.scheduler.node_id"] and t["ember.scheduler.worker_id"]
               for t in tags)
    # Each job runs with the one CPU Ray granted it: two jobs at a time on the 2-CPU head, 2 threads.
    assert {t["ember.threads"] for t in tags} == {"1"} and {t["numpy.blas_threads"] for t in tags} == {"1"}
    # Ray reuses its worker processes, and each keeps its model: one load per worker, not per job.
    pids = {t["ember.pid"] for t in tags}
    misses = [t for t in tags if t["ember.model_cache"] == "miss"]
    assert len(pids) < 12 and len(misses) == len(pids)
    # The workers fetched the model by name into their own cache, verified, once for both of them.
    from ember.sources import KNOWN_MODELS

    known = KNOWN_MODELS["smollm2-135m"]
    fetched = worker_cache / "models" / known.file_name
    assert fetched.is_file() and {t["model.path"] for t in tags} == {str(fetched)}
    assert {t["model.sha256"] for t in tags} == {known.sha256}
    starts = [line for line in (done.stdout + done.stderr).splitlines()
              if "ember: downloading smollm2-135m" in line and "done in" not in line]
    assert len(starts) <= 1, starts  # 0 when an earlier test of this module fetched it
    assert not [p for p in fetched.parent.iterdir() if p.name.endswith(".partial")]
    # Artifacts went through the server into its artifact folder.
    listed = {f.path for f in admin.list_artifacts(children[0].info.run_id)}
    assert {"config.yaml", "generation.json"} <= listed
    assert any(server.artifacts.rglob("generation.json"))
    # The credentials reached the jobs through the environment only.
    sweep_files = [p.read_text(errors="replace") for p in (tmp_path / "outputs").rglob("*.yaml")]
    assert_no_secret(server, [done.stdout, done.stderr, *sweep_files], [parent, *children])


def victim(folder: Path, **params) -> str:
    """A run_support.WaitToBeKilled entry of `experiments` (as Hydra override text)."""
    extra = "".join(f",{key}:{value}" for key, value in params.items())
    return f"{{_target_:run_support.WaitToBeKilled,folder:'{folder}'{extra}}}"


def start_victim_sweep(tmp_path: Path, server, ray_head, experiment: str, retries: int):
    folder = tmp_path / "victim"
    folder.mkdir()
    env = {**ray_head.client_env(), **server.credentials()}
    return kill_the_victim(tmp_path, folder, ember_run(
        tmp_path, "-m", "hydra/launcher=ray", f"hydra.launcher.ray.remote.max_retries={retries}",
        f"experiments=[{victim(folder, layer='${layer}', victim=2)}]",
        "layer=0,1,2,3", "max_new_tokens=3", f"mlflow.tracking_uri={server.url}",
        f"mlflow.experiment_name={experiment}", env=env, wait=False))


def kill_the_victim(tmp_path: Path, folder: Path, process: subprocess.Popen):
    """SIGKILL the job that wrote its pid to `folder/pid`, let the sweep end; (exit status, stderr, pid)."""
    deadline = time.monotonic() + 600
    while not (folder / "pid").exists():
        assert process.poll() is None, (tmp_path / "stderr").read_text()[-4000:]
        assert time.monotonic() < deadline, "the victim job never started"
        time.sleep(0.2)
    pid = int((folder / "pid").read_text())
    (folder / "killed").write_text("")
    os.kill(pid, signal.SIGKILL)
    process.wait(timeout=900)
    return process.returncode, (tmp_path / "stderr").read_text(), pid


def test_a_killed_worker_leaves_its_run_killed_and_named_while_the_others_finish(
        tmp_path, server, ray_head, admin, smollm2_path):
    code, err, victim = start_victim_sweep(tmp_path, server, ray_head, "t_ray_kill", retries=0)
    assert code == 1, err[-4000:]
    failed = [line for line in err.splitlines() if line.startswith("  job #")]
    assert len(failed) == 1 and failed[0].startswith("  job #2 (") and "layer=2" in failed[0]
    assert "killed: its process died without closing its run" in failed[0] and f"pid {victim}" in failed[0]
    parent, children = sweep_of(admin, "t_ray_kill")
    statuses = {c.data.tags["ember.job"]: c.info.status for c in children}
    assert statuses == {"0": "FINISHED", "1": "FINISHED", "2": "KILLED", "3": "FINISHED"}
    assert parent.info.status == "FAILED" and "job #2" in parent.data.tags["ember.sweep.failed_jobs"]
    assert children[2].data.tags["ember.pid"] == str(victim)


def test_a_job_whose_worker_was_killed_is_retried_as_a_new_child_run(
        tmp_path, server, ray_head, admin, smollm2_path):
    code, err, victim = start_victim_sweep(tmp_path, server, ray_head, "t_ray_retry", retries=1)
    assert code == 0, err[-4000:]
    assert "job #2 (" in err and "retried: attempt 1 killed" in err and "attempt 2 finished" in err
    parent, children = sweep_of(admin, "t_ray_retry")
    attempts = [(c.data.tags["ember.job"], c.info.status) for c in children]
    assert attempts == [("0", "FINISHED"), ("1", "FINISHED"), ("2", "KILLED"), ("2", "FINISHED"),
                        ("3", "FINISHED")], "the retry is a second run, the dead attempt's run stays closed"
    assert children[2].data.tags["ember.pid"] == str(victim) != children[3].data.tags["ember.pid"]
    assert parent.info.status == "FINISHED" and "job #2" in parent.data.tags["ember.sweep.retried_jobs"]


def test_every_service_the_tests_started_listens_on_loopback_only(database, server, ray_head):
    """Every socket any process of PostgreSQL, the MLflow server or the Ray head listens or receives on:
    GCS, raylet, its agents (with ray[default] also the dashboard agent's and metrics ports) and the
    workers the sweeps above left running, wherever in the head's process tree or session."""
    def loopback(address: str) -> bool:
        return address.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:"))

    def port(address: str) -> int:
        return int(address.rsplit(":", 1)[1])

    core_ray = [port(ray_head.address), ray_head.ports["node-manager-port"],
                ray_head.ports["object-manager-port"]]
    for name, leader, expected in (("PostgreSQL", database.pid, [database.port]),
                                   ("mlflow server", server.pid, [port(server.url)]),
                                   ("Ray", ray_head.pid, core_ray)):
        addresses = services.listening_addresses(services.service_processes(leader))
        assert set(expected) <= {port(a) for a in addresses}, (name, sorted(addresses))
        assert all(loopback(a) for a in addresses), (name, sorted(addresses))


def test_a_search_records_a_trial_whose_worker_died_as_failed_not_as_a_value(
        tmp_path, server, ray_head, admin, smollm2_path):
    folder = tmp_path / "victim"
    folder.mkdir()
    steering = "{name:steering,layers:${layer},scale:1.0}"  # conf/experiment/steering.yaml's, and a victim
    code, err, pid = kill_the_victim(tmp_path, folder, ember_run(
        tmp_path, "-m", "+search=steering_flip", "hydra/launcher=ray",
        "hydra.launcher.ray.remote.max_retries=0", "hydra.sweeper.n_trials=2", "data.limit=1",
        "max_new_tokens=2", f"experiments=[{steering},{victim(folder)}]",
        f"mlflow.tracking_uri={server.url}", "mlflow.experiment_name=t_optuna_kill",
        env={**ray_head.client_env(), **server.credentials()}, wait=False))
    assert code == 1, err[-4000:]
    parent, children = sweep_of(admin, "t_optuna_kill")
    by_status = {c.info.status: c for c in children}
    assert sorted(by_status) == ["FINISHED", "KILLED"], (children_told(children), err[-4000:])
    assert by_status["KILLED"].data.tags["ember.pid"] == str(pid)
    killed, finished = by_status["KILLED"].data.tags["ember.job"], by_status["FINISHED"]
    # The sweeper recorded the dead trial as failed (Optuna's FAIL), not as a value (the exit status 1):
    # the best value is the one finished trial's, whatever it is.
    output = (tmp_path / "stdout").read_text() + err
    assert f"Failed experiment: job #{killed}: its Ray worker died" in output, output[-4000:]
    import yaml

    results = yaml.safe_load(next(tmp_path.rglob("optimization_results.yaml")).read_text())
    assert results["best_value"] == pytest.approx(finished.data.metrics["objective"])
    assert parent.data.tags["ember.search.best_run_id"] == finished.info.run_id
    failed = [line for line in err.splitlines() if line.startswith("  job #")]
    assert len(failed) == 1 and failed[0].startswith(f"  job #{killed} (")
    assert "killed: its process died" in failed[0]


def test_the_ray_head_lets_in_only_its_token(tmp_path, ray_head):
    wrong = {**ray_head.client_env(), "RAY_AUTH_TOKEN": "0" * 64}
    done = ember_run(tmp_path, "-m", "hydra/launcher=ray", "layer=0,1", "mlflow=off", env=wrong, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("ember:")]
    assert lines == [f"ember: could not join the Ray cluster at {ray_head.address} (ConnectionError: Failed "
                     f"to connect to Ray cluster at {ray_head.address}); a cluster with token authentication "
                     "wants its token in RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) with RAY_AUTH_MODE=token"
                     ], done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "sweep job" not in done.stderr


def test_a_wrong_password_is_one_clear_line(tmp_path, server, ray_head):
    wrong = {"MLFLOW_TRACKING_USERNAME": server.user[0], "MLFLOW_TRACKING_PASSWORD": "not-the-password"}
    single = ember_run(tmp_path, f"mlflow.tracking_uri={server.url}", "max_new_tokens=1", env=wrong,
                       timeout=300)
    sweep = ember_run(tmp_path, "-m", "hydra/launcher=ray", "layer=0,1", f"mlflow.tracking_uri={server.url}",
                      "max_new_tokens=1", env={**ray_head.client_env(), **wrong}, timeout=300)
    for done in (single, sweep):
        assert done.returncode == 2, done.stderr[-3000:]
        lines = [line for line in done.stderr.splitlines() if line.startswith("ember:")]
        assert lines == [f"ember: the MLflow tracking server at {server.url} refused ember's credentials "
                         "(HTTP 401): set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD for it"
                         ], done.stderr[-3000:]
        assert "Traceback" not in done.stderr and "not-the-password" not in done.stderr
    assert "sweep job" not in sweep.stderr, "no job starts"


def test_a_tracking_uri_with_credentials_is_refused_and_nothing_is_recorded(tmp_path, server, admin):
    name, password = server.user
    with_credentials = server.url.replace("://", f"://{name}:{password}@")
    done = ember_run(tmp_path, "-m", "layer=0,1", f"mlflow.tracking_uri={with_credentials}",
                     "max_new_tokens=1", "mlflow.experiment_name=t_userinfo", env={}, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert [line for line in done.stderr.splitlines() if line.startswith("ember:")] == [
        f"ember: the tracking URI {server.url} has credentials in it, which ember would record with the "
        "runs: give the URI without them and the credentials in MLFLOW_TRACKING_USERNAME and "
        "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN)"], done.stderr[-3000:]
    assert password not in done.stdout + done.stderr and "Traceback" not in done.stderr
    assert admin.get_experiment_by_name("t_userinfo") is None
    assert not (tmp_path / "outputs").exists(), "no sweep folder, no Hydra files"


def test_a_model_path_missing_on_the_worker_names_the_node_and_the_path(tmp_path, server, ray_head):
    missing = tmp_path / "elsewhere" / "model.gguf"
    done = ember_run(tmp_path, "-m", "hydra/launcher=ray", "model=path", f"model.source={missing}",
                     "layer=0,1", f"mlflow.tracking_uri={server.url}", "mlflow.experiment_name=t_missing",
                     env={**ray_head.client_env(), **server.credentials()}, timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]
    import socket

    lines = [line for line in done.stderr.splitlines()
             if "no such model file" in line and "ember: job" in line]
    assert len(lines) == 2, done.stderr[-3000:]
    assert all(f"on {socket.gethostname()}" in line and str(missing) in line for line in lines)


def test_submitit_local_sweep_of_4_jobs(tmp_path, server, admin, smollm2_path):
    done = ember_run(tmp_path, "-m", "hydra/launcher=submitit_local", "experiment=zero_layer",
                     "layer=0,1,2,3", "max_new_tokens=2", "intervention_effect=false",
                     f"mlflow.tracking_uri={server.url}",
                     "mlflow.experiment_name=t_submitit", env=server.credentials())
    assert done.returncode == 0, done.stderr[-4000:]
    parent, children = sweep_of(admin, "t_submitit")
    assert parent.info.status == "FINISHED" and len(children) == 4
    assert [c.info.status for c in children] == ["FINISHED"] * 4
    tags = [c.data.tags for c in children]
    assert {t["ember.scheduler"] for t in tags} == {"submitit_local"}
    assert len({t["ember.scheduler.job_id"] for t in tags}) == 4 and len({t["ember.pid"] for t in tags}) == 4
    cores = len(os.sched_getaffinity(0))
    assert {t["ember.threads"] for t in tags} == {str(max(1, cores // min(4, cores)))}


def test_a_killed_submitit_job_is_named_and_closed_killed_while_the_others_finish(
        tmp_path, server, admin, smollm2_path):
    folder = tmp_path / "victim"
    folder.mkdir()
    code, err, pid = kill_the_victim(tmp_path, folder, ember_run(
        tmp_path, "-m", "hydra/launcher=submitit_local",
        f"experiments=[{victim(folder, layer='${layer}', victim=1)}]",
        "layer=0,1,2,3", "max_new_tokens=3", f"mlflow.tracking_uri={server.url}",
        "mlflow.experiment_name=t_submitit_kill", env=server.credentials(), wait=False))
    assert code == 1, err[-4000:]
    for wrong in ("launcher stopped", "stopped before its end", "Traceback"):  # what the plugin did
        assert wrong not in err, err[-4000:]
    failed = [line for line in err.splitlines() if line.startswith("  job #")]
    assert len(failed) == 1 and failed[0].startswith("  job #1 (") and "layer=1" in failed[0], err[-4000:]
    assert "killed: its process died without closing its run" in failed[0] and f"pid {pid}" in failed[0]
    parent, children = sweep_of(admin, "t_submitit_kill")
    statuses = {c.data.tags["ember.job"]: c.info.status for c in children}
    assert statuses == {"0": "FINISHED", "1": "KILLED", "2": "FINISHED", "3": "FINISHED"}
    assert parent.info.status == "FAILED" and "job #1" in parent.data.tags["ember.sweep.failed_jobs"]
    assert children[1].data.tags["ember.pid"] == str(pid)
    assert all(child.info.end_time <= parent.info.end_time for child in children), "all awaited"


def test_optuna_search_of_6_trials_on_ray_tags_the_best_on_the_parent(
        tmp_path, server, ray_head, admin, smollm2_path):
    done = ember_run(tmp_path, "-m", "+search=steering_flip", "hydra/launcher=ray",
                     "hydra.sweeper.n_trials=6", "hydra.sweeper.n_jobs=2", "data.limit=3",
                     f"mlflow.tracking_uri={server.url}", "mlflow.experiment_name=t_optuna",
                     env={**ray_head.client_env(), **server.credentials()})
    assert done.returncode == 0, done.stderr[-4000:]
    parent, children = sweep_of(admin, "t_optuna")
    assert len(children) == 6 and all(c.info.status == "FINISHED" for c in children)
    assert parent.info.status == "FINISHED"
    scales = [float(c.data.params["experiments.0.scale"]) for c in children]
    assert len(set(scales)) == 6 and all(0.0 <= s <= 16.0 for s in scales)
    for child, scale in zip(children, scales, strict=True):
        tags = child.data.tags
        assert tags["ember.study.data"] == "capitals" and tags["ember.study.items"] == "3"
        changed = child.data.metrics["effect.answer_changed"]  # the share of the 3 answers that changed
        expected = scale if changed >= 0.8 else scale + 10.0 * (1.0 + 0.8 - changed)
        assert child.data.metrics["objective"] == pytest.approx(expected)
    best = min(children, key=lambda c: c.data.metrics["objective"])
    assert parent.data.tags["ember.search.best_run_id"] == best.info.run_id
    best_value = float(parent.data.tags["ember.search.best_objective"])
    assert best_value == pytest.approx(best.data.metrics["objective"])
    assert best.data.tags["ember.search.best"] == "true"
    assert f"best trial: job #{best.data.tags['ember.job']}" in done.stderr
