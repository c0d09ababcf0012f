"""A new SQLite store from a cached empty one, instead of MLflow's migrations.

MLflow makes a new SQLite store by creating its tables and then running every Alembic migration since
its first schema (~60 scripts): 2.3 s on the 2-core development machine when quiet, 5.8 s under load,
where opening an existing store takes ~0.1 s once MLflow is imported. The empty, migrated database
depends only on the MLflow version, so it is made once per version under
`<ember cache>/mlflow-store/<version>/mlflow.db` and copied wherever a new SQLite store is wanted.

The template holds the tables and the schema version only, not MLflow's "Default" experiment: MLflow
adds that when it opens the copy, with the artifact location it would have given it anyway, so a copied
store is the store MLflow would have made. Any failure here leaves the path alone, and MLflow makes the
store itself as before.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SQLITE_PREFIX = "sqlite:///"


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a `sqlite:///...` URI (relative to the current directory, as MLflow reads it);
    None for other stores, in-memory databases and URIs with options."""
    if not tracking_uri.startswith(SQLITE_PREFIX) or "?" in tracking_uri:
        return None
    path = tracking_uri[len(SQLITE_PREFIX):]
    if not path or path == ":memory:":
        return None
    return Path(path)


def seed_store(tracking_uri: str) -> bool:
    """Copy the cached empty store to a SQLite store's path if no database is there yet; whether it did.
    Never raises: without a copy MLflow creates the store itself."""
    target = sqlite_path(tracking_uri)
    try:
        if target is None or target.exists() or not target.parent.is_dir():
            return False
        template = _template()
        if template is None:
            return False
        return _copy_new(template, target)
    except Exception as error:  # noqa: BLE001 - MLflow makes the store as it always did
        log.debug("no store template for %s: %s", tracking_uri, error)
        return False


def _template() -> Path | None:
    """The cached empty store for this MLflow version, made now if missing."""
    import mlflow

    from ember.paths import ember_cache_dir

    folder = ember_cache_dir() / "mlflow-store" / mlflow.__version__
    template = folder / "mlflow.db"
    if template.exists():
        return template
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        path = Path(tmp) / "mlflow.db"
        if not _create_schema(path):
            return None
        os.replace(path, template)  # atomic: a parallel job sees a whole template or none
    return template


def _create_schema(path: Path) -> bool:
    """MLflow's own table creation and migrations (what its SQLite store runs on a new file), on `path`."""
    import sqlalchemy
    from mlflow.store.db import utils

    from ember.records.store import quiet_mlflow_logging

    quiet_mlflow_logging()
    engine = sqlalchemy.create_engine(f"{SQLITE_PREFIX}{path}")
    try:
        utils._initialize_tables(engine)
        utils._verify_schema(engine)  # the same check MLflow makes on every open
        return utils._all_tables_exist(engine)
    finally:
        engine.dispose()


def _copy_new(template: Path, target: Path) -> bool:
    """Copy `template` to `target` unless a file appeared there meanwhile (a parallel job's store)."""
    fd, tmp = tempfile.mkstemp(prefix=".mlflow-db-", dir=target.parent)
    os.close(fd)
    try:
        shutil.copyfile(template, tmp)
        try:
            os.link(tmp, target)  # fails if the target exists: never replaces a store
        except FileExistsError:
            return False
        except OSError:  # a file system without hard links
            if target.exists():
                return False
            os.replace(tmp, target)
            return True
        return True
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
