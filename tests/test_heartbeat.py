"""No run stays RUNNING after its process died: process tags, heartbeats, repair (real SQLite stores,
real processes killed with SIGKILL)."""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_support import prepared_store

import ember.records.tracker
from ember import cli
from ember.records import heartbeat
from ember.records.store import Store
from ember.records.tracker import FINISHED, Tracker, repair_store

REPO = Path(__file__).resolve().parent.parent

OPEN_A_RUN = """
import sys, time
from ember.records.store import Store
from ember.records.tracker import Tracker
tracker = Tracker(Store(sys.argv[1]), "beats")
run_id = tracker.start_run("doomed", {})
print(run_id, flush=True)
while True:  # until the test kills it
    time.sleep(60)
"""
HANG_GUARD = 300.0  # seconds to wait for what takes a fraction of one (0.2 s heartbeats), before failing


@pytest.fixture
def store(tmp_path, monkeypatch) -> str:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return f"sqlite:///{prepared_store(tmp_path / 'outputs')}"


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            **extra}


def open_run_in_a_process(store: str, **extra: str) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, "-c", OPEN_A_RUN, store], env=env(**extra),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_id = process.stdout.readline().strip()
    assert run_id, process.communicate(timeout=60)[1]
    return process, run_id


def test_a_run_carries_its_process_and_a_heartbeat(store):
    tracker = Tracker(Store(store), "beats")
    run_id = tracker.start_run("alive", {})
    tags = tracker.client.get_run(run_id).data.tags
    assert tags["ember.pid"] == str(os.getpid()) and tags["ember.host"]
    assert abs(float(tags["ember.process_start"]) - heartbeat._start_time(os.getpid())) < 0.01
    assert dt.datetime.fromisoformat(tags["ember.heartbeat"]).tzinfo is not None
    assert heartbeat.dead_reason(tags) is None, "this process is alive"
    assert repair_store(tracker.client, store) == []
    tracker.end_run(run_id, FINISHED)


def test_heartbeats_advance_while_the_run_is_open(store):
    process, run_id = open_run_in_a_process(store, EMBER_HEARTBEAT_SECONDS="0.2")
    try:
        client = Tracker(Store(store), "beats").client
        first = client.get_run(run_id).data.tags["ember.heartbeat"]
        deadline = time.monotonic() + HANG_GUARD
        while client.get_run(run_id).data.tags["ember.heartbeat"] == first and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.get_run(run_id).data.tags["ember.heartbeat"] > first
    finally:
        process.kill()
        process.wait()


def wait_for_a_heartbeat_after_the_start(client, run_id: str, seconds: float = HANG_GUARD) -> None:
    """Until the run's heartbeat is newer than its start (the first one is taken just before the run is
    created): however slowly the busy machine runs the child's heartbeat thread."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        run = client.get_run(run_id)
        if heartbeat._epoch_ms(run.data.tags["ember.heartbeat"]) > run.info.start_time:
            return
        time.sleep(0.1)
    pytest.fail(f"no heartbeat after the run's start within {seconds:.0f} s")


def test_a_sigkilled_process_leaves_a_run_the_next_command_closes_as_killed(store, tmp_path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store)
    process, run_id = open_run_in_a_process(store, EMBER_HEARTBEAT_SECONDS="0.2")
    try:
        wait_for_a_heartbeat_after_the_start(client, run_id)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING"
    last_beat = heartbeat._epoch_ms(run.data.tags["ember.heartbeat"])
    assert last_beat > run.info.start_time, "the end time below is the heartbeat, not the start"

    # The explicit command (the next ember command on the store does the same on opening it).
    done = subprocess.run([sys.executable, "-m", "ember.cli", "runs", "repair", "--mlflow-uri", store],
                          env=env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == [f"ember: MLflow run {run_id} (doomed) was still RUNNING but its process (pid "
                     f"{process.pid} on {os.uname().nodename}) is gone; closed as KILLED",
                     f"ember: 1 run(s) of dead processes closed as KILLED in {store}"], done.stderr
    run = client.get_run(run_id)
    assert run.info.status == "KILLED" and run.info.end_time == last_beat
    assert "is gone" in run.data.tags["ember.repaired"]
    again = subprocess.run([sys.executable, "-m", "ember.cli", "runs", "repair", "--mlflow-uri", store],
                           env=env(), capture_output=True, text=True, timeout=300)
    assert again.stderr.strip() == f"ember: no run of a dead process in {store}"


def test_the_next_command_on_the_store_repairs_on_opening_it(store, capsys):
    process, run_id = open_run_in_a_process(store)
    process.kill()
    process.wait()
    ember.records.tracker._REPAIRED_STORES.discard(store)
    Tracker(Store(store), "another experiment")
    assert f"MLflow run {run_id} (doomed) was still RUNNING" in capsys.readouterr().err
    from mlflow.tracking import MlflowClient

    assert MlflowClient(store).get_run(run_id).info.status == "KILLED"


def fake_run(client, experiment_id: str, tags: dict[str, str], started_seconds_ago: float = 3600):
    start = int((dt.datetime.now(dt.UTC).timestamp() - started_seconds_ago) * 1000)
    run = client.create_run(experiment_id, run_name="fake", tags=tags, start_time=start)
    return client.get_run(run.info.run_id)


def test_which_runs_count_as_dead(store, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("EMBER_HEARTBEAT_TIMEOUT", "86400")  # "fresh" (5 s old) stays fresh on any machine
    client = MlflowClient(store)
    experiment = client.create_experiment("judged")
    own = heartbeat.process_tags()
    now = dt.datetime.now(dt.UTC)
    old = (now - dt.timedelta(seconds=heartbeat.stale_seconds() + 60)).isoformat()
    recent = (now - dt.timedelta(seconds=5)).isoformat()
    elsewhere = {**own, "ember.host": "another-node", "ember.pid_namespace": "other:pid:[1]"}
    cases = {
        "alive here": (own, False),
        "pid reused by another process": ({**own, "ember.process_start": "1.00"}, True),
        "pid free": ({**own, "ember.pid": str(2**22 + 17)}, True),
        "other node, fresh heartbeat": ({**elsewhere, "ember.heartbeat": recent}, False),
        "other node, stale heartbeat": ({**elsewhere, "ember.heartbeat": old}, True),
        "not ember's": ({"mlflow.user": "someone"}, False),
    }
    runs = {name: fake_run(client, experiment, tags, started_seconds_ago=2 * 86400)  # before `old`
            for name, (tags, _) in cases.items()}
    repaired = {r.run_id for r in heartbeat.repair_dead_runs(client, [experiment])}
    for name, (_, dead) in cases.items():
        status = client.get_run(runs[name].info.run_id).info.status
        assert (runs[name].info.run_id in repaired) == dead, name
        assert status == ("KILLED" if dead else "RUNNING"), name
    stale = client.get_run(runs["other node, stale heartbeat"].info.run_id)
    assert stale.info.end_time == heartbeat._epoch_ms(old)
    assert "no heartbeat from its process" in stale.data.tags["ember.repaired"]


def test_a_run_killed_before_its_second_heartbeat_ends_at_its_start(store):
    """The first heartbeat is taken just before the run is created: a process killed before the next
    one leaves a heartbeat older than the run's start, and the run must not end before it began."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store)
    experiment = client.create_experiment("early death")
    beat = (dt.datetime.now(dt.UTC) - dt.timedelta(seconds=2)).isoformat()
    tags = {**heartbeat.process_tags(), "ember.pid": str(2**22 + 17), "ember.heartbeat": beat}
    run = fake_run(client, experiment, tags, started_seconds_ago=1)
    assert [r.run_id for r in heartbeat.repair_dead_runs(client, [experiment])] == [run.info.run_id]
    closed = client.get_run(run.info.run_id)
    assert closed.info.status == "KILLED" and closed.info.end_time == closed.info.start_time


def test_runs_repair_without_a_store_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["runs", "repair"]) == 0
    assert capsys.readouterr().err.strip() == (
        f"ember: no MLflow store at {tmp_path.resolve() / 'outputs' / 'mlflow.db'}: nothing to repair")
