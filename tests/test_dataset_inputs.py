"""A prompt set is each study run's dataset input. Jobs of a parallel sweep log the same new dataset at
the same moment; MLflow's database stores look for the dataset's row and then insert it, so without
care all but one of them fail on the table's key (ember.records.outbox._log_inputs). Real SQLite stores, real
threads released together."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest
from run_support import prepared_store

from ember.records.store import Store
from ember.records.tracker import Tracker

JOBS = 8


def log_at_once(uri: str, experiment_id: str, run_ids: list[str], digest: str) -> list[str]:
    """Each run logs dataset `capitals`/`digest` from its own thread and client, all released together;
    the errors raised."""
    start = threading.Barrier(len(run_ids))
    errors: list[str] = []

    def job(run_id: str) -> None:
        tracker = Tracker.attach(Store(uri), experiment_id)
        start.wait()
        try:
            tracker.log_dataset(run_id, "capitals", digest, "local", {"uri": "capitals.jsonl"}, rows=10)
        except Exception as error:
            errors.append(str(error).splitlines()[0])

    threads = [threading.Thread(target=job, args=(run_id,)) for run_id in run_ids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)  # a guard against a hang: each job takes well under a second
    assert not any(thread.is_alive() for thread in threads), "a job never finished"
    return errors


def test_runs_logging_one_new_dataset_at_once_all_link_to_one_row(tmp_path: Path):
    from mlflow.tracking import MlflowClient

    database = prepared_store(tmp_path / "outputs")
    uri = f"sqlite:///{database}"
    client = MlflowClient(uri)
    experiment_id = client.create_experiment("races")
    # Without the repeat, 1 to 5 of 6 threads failed per round here: three rounds make a pass by luck
    # vanishingly unlikely.
    for round_number in range(3):
        digest = f"digest{round_number}"
        runs = [client.create_run(experiment_id).info.run_id for _ in range(JOBS)]
        assert log_at_once(uri, experiment_id, runs, digest) == []
        for run_id in runs:
            inputs = client.get_run(run_id).inputs.dataset_inputs
            assert [(i.dataset.name, i.dataset.digest) for i in inputs] == [("capitals", digest)]
        with sqlite3.connect(database) as db:  # one row per dataset, whoever won the race
            rows = db.execute("SELECT digest FROM datasets WHERE experiment_id = ?", (experiment_id,))
            assert sorted(digest for (digest,) in rows) == [f"digest{n}" for n in range(round_number + 1)]


def test_another_error_of_log_inputs_is_not_repeated(tmp_path: Path):
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{prepared_store(tmp_path / 'outputs')}"
    experiment_id = MlflowClient(uri).create_experiment("missing run")
    tracker = Tracker.attach(Store(uri), experiment_id)
    calls = []
    log_inputs = tracker.client.log_inputs
    tracker.client.log_inputs = lambda *a, **k: (calls.append(1), log_inputs(*a, **k))
    with pytest.raises(MlflowException, match="not found"):
        tracker.log_dataset("0" * 32, "capitals", "d", "local", {"uri": "x"})
    assert calls == [1]
