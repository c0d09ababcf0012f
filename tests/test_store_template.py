"""A new SQLite store copied from the cached empty one (ember.records.store_template) is the store MLflow
would have made: same schema version, same tables, and MLflow's Default experiment added on first open."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from ember.records.store import mlflow_client
from ember.records.store_template import seed_store, sqlite_path


def _tables(path: Path) -> tuple[set[str], list[tuple]]:
    with sqlite3.connect(path) as db:
        names = {row[0] for row in db.execute("select name from sqlite_master where type = 'table'")}
        return names, db.execute("select version_num from alembic_version").fetchall()


def test_a_new_store_is_a_copy_of_the_template_and_opens_as_mlflow_made_it(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("EMBER_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ours").mkdir()
    (tmp_path / "theirs").mkdir()
    client = mlflow_client("sqlite:///ours/mlflow.db")  # relative, as MLflow reads it
    templates = list((tmp_path / "cache" / "mlflow-store").glob("*/mlflow.db"))
    assert len(templates) == 1, "the template is made once, under the cache, by MLflow version"
    reference = MlflowClient("sqlite:///theirs/mlflow.db")  # MLflow's own migrations
    assert _tables(tmp_path / "ours/mlflow.db") == _tables(tmp_path / "theirs/mlflow.db")
    ours, theirs = client.get_experiment("0"), reference.get_experiment("0")
    assert (ours.name, ours.artifact_location) == (theirs.name, theirs.artifact_location)
    experiment = client.create_experiment("x")
    client.set_terminated(client.create_run(experiment).info.run_id)
    with sqlite3.connect(templates[0]) as db:
        assert db.execute("select count(*) from experiments").fetchone() == (0,), "the template stays empty"


def test_an_existing_store_or_another_kind_is_left_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE", str(tmp_path / "cache"))
    existing = tmp_path / "mlflow.db"
    with sqlite3.connect(existing) as db:
        db.execute("create table mine (x)")
    assert not seed_store(f"sqlite:///{existing}")
    assert _tables_names(existing) == {"mine"}
    assert not seed_store(f"sqlite:///{tmp_path}/no/such/folder/mlflow.db")
    for uri in ("http://127.0.0.1:5000", "postgresql://h/db", "sqlite://", "sqlite:///:memory:",
                f"sqlite:///{tmp_path}/x.db?mode=ro", str(tmp_path / "mlruns")):
        assert not seed_store(uri), uri
    assert not (tmp_path / "cache").exists(), "no template is made where none is copied"


def _tables_names(path: Path) -> set[str]:
    with sqlite3.connect(path) as db:
        return {row[0] for row in db.execute("select name from sqlite_master where type = 'table'")}


@pytest.mark.parametrize(("uri", "path"), [("sqlite:////abs/m.db", "/abs/m.db"),
                                           ("sqlite:///rel/m.db", "rel/m.db"),
                                           ("sqlite:///:memory:", None), ("file:///x", None)])
def test_sqlite_path(uri, path):
    assert sqlite_path(uri) == (Path(path) if path else None)
